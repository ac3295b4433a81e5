"""Latency benchmark (SelKV Figure 3): prefill and compression time, decode throughput and peak memory of the full
cache and compressed caches over prompt lengths (what it measures, the records: docs/REPORTS.md).

    python -m kvbench.tools.latency +experiment=selkv_fig3 [hydra overrides...] [--out FILE]
    python -m kvbench.tools.latency model=smollm2 budget=0.25 --methods full snapkv --lengths 256 512
"""

import gc
import itertools
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from methods import build_method
from methods.base import check_budget

from kvbench.cli import ArgParser, listof, parse_with_overrides
from kvbench.job.config import CONF, compose
from kvbench.job.run import set_threads
from kvbench.job.store import atomic_write

DEFAULT_NEW_TOKENS = 256  # SelKV Figure 3 generates 256 tokens
DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192]
RESULT_FIELDS = ("prefill_s", "compress_s", "decode_s", "generated_tokens", "decode_tok_s", "cache_bytes_before",
                 "cache_bytes_after")


def prompt_ids(n_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic ``n_tokens`` ids in ``[100, vocab_size)`` (below: most special tokens); text is irrelevant."""
    rng = random.Random(seed * 1_000_003 + n_tokens)
    return [rng.randrange(100, max(101, vocab_size)) for _ in range(n_tokens)]


def run_latency(model_cfg: dict, method_cfgs: dict[str, dict], budget: float, lengths: list[int],
                max_new_tokens: int, repeats: int, out: Path, make_engine: Callable[[dict], Any] | None = None,
                log: Callable[[str], None] = print, device: str = "auto") -> list[dict]:
    """The records (docs/REPORTS.md) of every method (``{preset: method node}``) at every prompt length (tokens),
    ``repeats`` runs each, ``out`` rewritten after each. ``make_engine``: ``method node -> engine`` (default: on the
    model loaded on ``device``)."""
    import torch

    from kvbench.engine import generate as engine_module, models  # reset_peak_rss read at each call (tests replace it)
    if make_engine is None:
        loaded = models.load_model(model_cfg, device)
        make_engine = lambda cfg: engine_module.Engine(loaded, build_method(cfg, loaded.layout), budget)  # noqa: E731
    records: list[dict] = []
    for preset, method_cfg in method_cfgs.items():
        engine = make_engine(dict(method_cfg))
        config = getattr(engine.model, "config", None)
        config = getattr(config, "get_text_config", lambda: config)()  # Gemma 3 keeps these in its text part
        limit = getattr(config, "max_position_embeddings", None)
        todo = [n for n in lengths if not isinstance(limit, int) or n + max_new_tokens <= limit]
        if len(todo) < len(lengths):
            log(f"skipping prompt lengths {sorted(set(lengths) - set(todo))}: over the context window {limit} "
                f"minus {max_new_tokens} new tokens")
        vocab = int(getattr(config, "vocab_size", 32000) or 32000)
        if todo:
            engine.generate(prompt_ids(min(todo), vocab), min(4, max_new_tokens), stop_ids=[])  # warm-up
        dev = getattr(getattr(engine, "loaded", None), "device", None)
        device = f"cuda:{torch.cuda.get_device_name(dev)}" if getattr(dev, "type", "") == "cuda" else str(dev or "unknown")
        for n, rep in itertools.product(todo, range(repeats)):
            engine_module.reset_peak_rss()
            res = engine.generate(prompt_ids(n, vocab), max_new_tokens, stop_ids=[])
            rec = {"model": model_cfg.get("name"), "method": method_cfg.get("label") or method_cfg.get("name"),
                   "method_name": method_cfg.get("name"), "preset": preset,
                   "budget": 1.0 if method_cfg.get("name") == "full" else float(budget), "prompt_tokens": n,
                   "repeat": rep, **{k: getattr(res, k) for k in RESULT_FIELDS},
                   "peak_mem_bytes": max(res.peak_prefill_bytes, res.peak_decode_bytes),
                   "peak_decode_bytes": res.peak_decode_bytes, "device": device,
                   "load_s": getattr(getattr(engine, "loaded", None), "load_s", None)}
            records.append(rec)
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(out, json.dumps(records, indent=1) + "\n")
            log(f"{rec['method']:>24} n={n:>7}: prefill {rec['prefill_s']:.3f} s, compress "
                f"{rec['compress_s']:.3f} s, decode {rec['decode_tok_s']:.1f} tok/s")
        del engine
        gc.collect()
    return records


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring); usage and config errors: one line, exit 2."""
    known = sorted(f.stem for f in (CONF / "method").glob("*.yaml"))
    positive, one = listof(int, lambda n: n >= 1, "integers >= 1"), listof(int, lambda n: n >= 1, "integers >= 1", one=True)
    p = ArgParser(prog="python -m kvbench.tools.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=selkv_fig3 model=llama31")
    p.add_argument("--methods", nargs="+", action="extend", type=listof(str, known.__contains__, ", ".join(known)),
                   help="method presets (conf/method/*.yaml; default: latency.methods, else full and the method)")
    p.add_argument("--lengths", nargs="+", action="extend", type=positive, help="prompt lengths in tokens, space- or "
                   "comma-separated (default: latency.lengths, else 512 to 8192 in powers of two)")
    p.add_argument("--new-tokens", type=one, help=f"generated tokens per request (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--repeats", type=one, help="timed runs per method and length (default 1)")
    p.add_argument("--out", help="output JSON (default: latency.out, else <output_root>/latency.json)")
    args = parse_with_overrides(p, argv)
    overrides, where = args.overrides, f"{' '.join(args.overrides)}: "
    try:  # before the model loads; an error names the overrides, the budget or the method preset
        cfg, where = compose(overrides), ""
        check_budget(budget := cfg.get("budget"))  # the job's own check: a ratio in (0, 1] or a token count >= 2
        lat = OmegaConf.to_container(cfg.get("latency") or OmegaConf.create(), resolve=True)
        model_cfg, method_cfgs = OmegaConf.to_container(cfg.model, resolve=True), {}
        for preset in dict.fromkeys(sum(args.methods or [], []) or lat.get("methods") or ["full", cfg.method.name]):
            keep = [o for o in overrides if not o.startswith("method=")  # method.* are no fields of the full cache
                    and not (preset == "full" and o.lstrip("+~").startswith("method."))]
            where = f"method={preset}: "
            method_cfgs[preset] = OmegaConf.to_container(compose(keep + [f"method={preset}"]).method, resolve=True,
                                                          enum_to_str=True)
            build_method(dict(method_cfgs[preset]))  # the method's own checks
    except Exception as e:  # noqa: BLE001 - Hydra's, the budget's and the methods' ConfigError: one line
        p.error(where + (str(e).strip() or type(e).__name__))
    new_tokens = int(args.new_tokens or lat.get("max_new_tokens") or DEFAULT_NEW_TOKENS)
    lengths = list(dict.fromkeys(int(x) for x in sum(args.lengths or [], []) or lat.get("lengths") or DEFAULT_LENGTHS))
    out = Path(args.out or lat.get("out") or Path(cfg.get("output_root", "results")) / "latency.json")
    set_threads(cfg.get("threads"))  # as a job does, before the model loads
    records = run_latency(model_cfg, method_cfgs, float(budget), lengths, new_tokens,
                          int(args.repeats or lat.get("repeats") or 1), out, device=str(cfg.get("device", "auto")))
    if not records:
        print(f"error: no latency records (every prompt length was skipped); {out} not written", file=sys.stderr)
        return 1
    print(f"latency records written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
