"""Latency benchmark: prefill time, compression time, decode throughput and peak memory of the
full cache and compressed caches over prompt lengths (SelKV Figure 3).

    python -m kvbench.latency +experiment=selkv_fig3 [hydra overrides...] [--out FILE]
    python -m kvbench.latency model=smollm2 budget=0.25 --methods full snapkv --lengths 256 512

The model, budget and methods come from the Hydra config (``conf/``); an experiment preset
may carry a ``latency:`` node (``methods``, ``lengths``, ``max_new_tokens``, ``repeats``,
``out``) that the command-line flags override. Prompt lengths longer than the model's input
limit (``model.max_input_tokens`` minus the generated tokens) are skipped with a message.

Output: a JSON list of records, rewritten after every measurement (a killed run keeps what
it measured), read by ``kvbench report`` (``RESULTS_ROOT/latency.json`` or ``--latency``)::

    {"model": "llama31", "method": "SelKV", "method_name": "selkv", "budget": 0.25,
     "prompt_tokens": 8192, "repeat": 0, "prefill_s": 0.81, "compress_s": 0.03, "decode_s": 5.1,
     "generated_tokens": 256, "decode_tok_s": 50.2, "peak_mem_bytes": 17400000000,
     "cache_bytes_before": 1073741824, "cache_bytes_after": 268435456, "device": "cuda:NVIDIA H100"}

``peak_mem_bytes`` is the CUDA peak allocated memory on GPU, else the process peak RSS that the
engine reports. Timings are seconds; throughput is generated tokens per decode second.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Callable

DEFAULT_NEW_TOKENS = 256  # SelKV Figure 3 generates 256 tokens
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def default_lengths(max_tokens: int, start: int = 512) -> list[int]:
    """Powers of two from ``start`` up to ``max_tokens`` (prompt tokens)."""
    out, n = [], start
    while n <= max_tokens:
        out.append(n)
        n *= 2
    return out


def model_input_limit(model_cfg: dict) -> int | None:
    """The model's prompt limit in tokens (``max_input_tokens``, ``max_position_embeddings`` or
    ``context_length`` of the model node), None when the node does not say."""
    for key in ("max_input_tokens", "max_position_embeddings", "context_length"):
        if isinstance(model_cfg.get(key), int):
            return int(model_cfg[key])
    return None


def prompt_ids(n_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic synthetic prompt of ``n_tokens`` ids drawn from ``[100, vocab_size)``
    (ids below 100 hold most special tokens); latency does not depend on the text."""
    rng = random.Random(seed * 1_000_003 + n_tokens)
    return [rng.randrange(100, max(101, vocab_size)) for _ in range(n_tokens)]


def _vocab_size(engine: Any) -> int:
    for obj, attr in [(getattr(engine, "tokenizer", None), "vocab_size"),
                      (getattr(getattr(engine, "model", None), "config", None), "vocab_size")]:
        if obj is not None and isinstance(getattr(obj, attr, None), int):
            return int(getattr(obj, attr))
    return 32000


def _peak_reset() -> Callable[[], int | None]:
    """Reset the CUDA peak-memory counter; returns a reader of the peak (None without CUDA)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of the engine
        return lambda: None
    if not torch.cuda.is_available():
        return lambda: None
    torch.cuda.reset_peak_memory_stats()
    return lambda: int(torch.cuda.max_memory_allocated())


def _device() -> str:
    try:
        import torch

        return f"cuda:{torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def _free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def measure(engine: Any, ids: list[int], max_new_tokens: int) -> dict:
    """One timed generation; returns the record's measured fields.

    Calls ``engine.generate(prompt_ids, max_new_tokens)`` (with ``ignore_eos=True`` when the engine
    accepts it, so that every run decodes the same number of tokens).
    """
    kwargs = {"ignore_eos": True} if "ignore_eos" in inspect.signature(engine.generate).parameters else {}
    peak = _peak_reset()
    res = engine.generate(ids, max_new_tokens, **kwargs)
    gpu_peak = peak()
    get = lambda name: getattr(res, name, None)  # noqa: E731
    return {"prompt_tokens": len(ids), "prefill_s": get("prefill_s"), "compress_s": get("compress_s"),
            "decode_s": get("decode_s"), "generated_tokens": get("generated_tokens"),
            "decode_tok_s": get("decode_tok_s"),
            "peak_mem_bytes": gpu_peak if gpu_peak is not None else get("peak_rss_bytes"),
            "cache_bytes_before": get("cache_bytes_before"), "cache_bytes_after": get("cache_bytes_after")}


def write_records(path: Path, records: list[dict]) -> None:
    """Atomically rewrite the JSON list."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, path)


def run_latency(model_cfg: dict, method_cfgs: dict[str, dict], budget: float, lengths: list[int],
                max_new_tokens: int, repeats: int, out: Path, engine_cls: Any = None,
                log: Callable[[str], None] = print) -> list[dict]:
    """Measure every method at every prompt length and write the records to ``out``.

    Args:
        model_cfg: the model's Hydra node as a dict (``model.name``...).
        method_cfgs: ``{preset name: method node}``; the record's ``method`` is the node's ``label``.
        budget: compressed methods' budget (the full cache ignores it).
        lengths: prompt lengths in tokens; those over the model's input limit are skipped.
        max_new_tokens: tokens generated per request.
        repeats: timed runs per (method, length), after one untimed warm-up per method.
        out: output JSON path.
        engine_cls: the engine class (default :class:`kvbench.engine.Engine`).

    Returns:
        The records written.
    """
    if engine_cls is None:
        from kvbench.engine import Engine as engine_cls  # the lead's engine; imported late
    limit = model_input_limit(model_cfg)
    if limit is not None:
        skipped = [n for n in lengths if n + max_new_tokens > limit]
        if skipped:
            log(f"skipping prompt lengths {skipped}: over the model's input limit {limit} - {max_new_tokens} new tokens")
        lengths = [n for n in lengths if n + max_new_tokens <= limit]
    records: list[dict] = []
    device = _device()
    for preset, method_cfg in method_cfgs.items():
        engine = engine_cls(dict(model_cfg), dict(method_cfg), float(budget))
        vocab = _vocab_size(engine)
        if lengths:
            engine.generate(prompt_ids(min(lengths), vocab), min(4, max_new_tokens))  # warm-up, untimed
        for n in lengths:
            for rep in range(repeats):
                rec = {"model": model_cfg.get("name"), "method": method_cfg.get("label") or method_cfg.get("name"),
                       "method_name": method_cfg.get("name"), "preset": preset, "budget": float(budget),
                       "repeat": rep, **measure(engine, prompt_ids(n, vocab), max_new_tokens), "device": device}
                records.append(rec)
                write_records(out, records)
                log(f"{rec['method']:>24} n={n:>7} prefill {rec['prefill_s']} s, compress {rec['compress_s']} s, "
                    f"decode {rec['decode_tok_s']} tok/s")
        del engine
        _free_memory()
    return records


def compose(overrides: list[str]) -> Any:
    """The composed Hydra config (``conf/config.yaml`` plus overrides)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if not (CONF_DIR / "config.yaml").is_file():
        raise SystemExit(f"kvbench.latency: {CONF_DIR / 'config.yaml'} not found (the engine's Hydra config)")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    from omegaconf import OmegaConf

    p = argparse.ArgumentParser(prog="python -m kvbench.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=selkv_fig3 model=llama31")
    p.add_argument("--methods", nargs="+", help="method presets (conf/method/*.yaml); default: latency.methods "
                   "or full + the configured method")
    p.add_argument("--lengths", nargs="+", type=int, help="prompt lengths (tokens); default: latency.lengths or "
                   "powers of two from 512 to the model's input limit")
    p.add_argument("--new-tokens", type=int, help=f"generated tokens per request (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--repeats", type=int, help="timed runs per method and length (default 1)")
    p.add_argument("--out", help="output JSON (default: latency.out, else <output_root>/latency.json)")
    args = p.parse_args(argv)
    cfg = compose(args.overrides)
    lat = OmegaConf.to_container(cfg.get("latency") or OmegaConf.create({}), resolve=True)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    presets = args.methods or lat.get("methods") or ["full", cfg.method.name]
    method_cfgs = {}
    for preset in dict.fromkeys(presets):
        sub = compose([o for o in args.overrides if not o.startswith("method=")] + [f"method={preset}"])
        method_cfgs[preset] = OmegaConf.to_container(sub.method, resolve=True)
    new_tokens = args.new_tokens or lat.get("max_new_tokens") or DEFAULT_NEW_TOKENS
    lengths = args.lengths or lat.get("lengths") or default_lengths(model_input_limit(model_cfg) or 8192)
    out = Path(args.out or lat.get("out") or Path(cfg.get("output_root", "results")) / "latency.json")
    run_latency(model_cfg, method_cfgs, float(cfg.budget), list(lengths), int(new_tokens),
                int(args.repeats or lat.get("repeats") or 1), out)
    print(f"latency records written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
