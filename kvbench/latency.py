"""Latency benchmark: prefill time, compression time, decode throughput and peak memory of the
full cache and compressed caches over prompt lengths (SelKV Figure 3).

    python -m kvbench.latency +experiment=selkv_fig3 [hydra overrides...] [--out FILE]
    python -m kvbench.latency model=smollm2 budget=0.25 --methods full snapkv --lengths 256 512

The model, budget and methods come from the Hydra config (``conf/``); an experiment preset
may carry a ``latency:`` node (``methods``, ``lengths``, ``max_new_tokens``, ``repeats``,
``out``) that the command-line flags override; ``method.*`` overrides apply to every method
but the full cache, and each method config passes the job runner's validation before the model
loads (one line, exit 2). Prompt lengths longer than the model's context
window (``max_position_embeddings`` minus the generated tokens) are skipped with a message;
when every length is over it (or ``--new-tokens`` alone is), the run is refused before the
model loads (the window is read from the model's config, :func:`kvbench.validate.context_window`).
Generation ignores stop tokens, so every request decodes exactly ``max_new_tokens`` tokens.

Output: a JSON list of records, rewritten after every measurement (a killed run keeps what
it measured); an earlier run's file is first kept beside it as ``latency.<time>.json``, and
``--out`` that is a folder, a job's file or inside a job folder is refused. It is read by ``kvbench report`` (``RESULTS_ROOT/latency.json`` or ``--latency``)::

    {"model": "llama31", "method": "SelKV", "method_name": "selkv", "budget": 0.25,
     "prompt_tokens": 8192, "repeat": 0, "prefill_s": 0.81, "compress_s": 0.03, "decode_s": 5.1,
     "generated_tokens": 256, "decode_tok_s": 50.2, "peak_mem_bytes": 17400000000,
     "cache_bytes_before": 1073741824, "cache_bytes_after": 268435456, "load_1min": 0.4, "cpu_cores": 16,
     "device": "cuda:NVIDIA H100"}

``peak_mem_bytes`` is the engine's peak CUDA memory of the generation on GPU, else the process's
peak RSS during the generation (model included). The full cache's records carry budget 1.0.
Timings are seconds; throughput is generated tokens per decode second. ``load_1min`` is the
larger of the 1-minute load average before and after the generation and ``cpu_cores`` the cores
the process may use: on CPU, a load above the cores means other processes shared them and the
times are inflated (the report's Figure 3 says so in its notes).
"""

from __future__ import annotations

import gc
import json
import random
import sys
from pathlib import Path
from typing import Any, Callable

from .cli_parser import OneLineParser
from .store import atomic_write, keep_previous, output_file_refusal
from .signals import one_line_stop, quiet_broken_pipe

DEFAULT_NEW_TOKENS = 256  # SelKV Figure 3 generates 256 tokens
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def default_lengths(max_tokens: int, start: int = 512) -> list[int]:
    """Powers of two from ``start`` up to ``max_tokens`` (prompt tokens)."""
    out, n = [], start
    while n <= max_tokens:
        out.append(n)
        n *= 2
    return out


def context_limit(model: Any) -> int | None:
    """The model's context window in tokens (``config.max_position_embeddings``), None if unknown."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def prompt_ids(n_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic synthetic prompt of ``n_tokens`` ids drawn from ``[100, vocab_size)``
    (ids below 100 hold most special tokens); latency does not depend on the text."""
    rng = random.Random(seed * 1_000_003 + n_tokens)
    return [rng.randrange(100, max(101, vocab_size)) for _ in range(n_tokens)]


def _device_name(engine: Any) -> str:
    dev = getattr(getattr(engine, "loaded", None), "device", None)
    if getattr(dev, "type", None) == "cuda":
        import torch

        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return str(dev or "unknown")


def _free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def measure(engine: Any, ids: list[int], max_new_tokens: int) -> dict:
    """One timed generation: ``engine.generate(ids, max_new_tokens, stop_ids=[])`` (no stop token,
    so every run decodes exactly ``max_new_tokens``); returns the record's measured fields.

    ``peak_mem_bytes`` is the engine's ``peak_rss_bytes``: peak CUDA memory of this generation on
    GPU; on CPU the process's peak resident set during this generation (the loaded model
    included): the peak is restarted first (:func:`kvbench.engine.reset_peak_rss`), so an
    earlier, longer prompt's peak does not carry over (where ``/proc/self/clear_refs`` is
    missing it is the process's peak so far).
    """
    from .engine import reset_peak_rss

    reset_peak_rss()
    load_before = _load_1min()
    res = engine.generate(ids, max_new_tokens, stop_ids=[])
    return {"prompt_tokens": len(ids), "prefill_s": res.prefill_s, "compress_s": res.compress_s,
            "decode_s": res.decode_s, "generated_tokens": res.generated_tokens, "decode_tok_s": res.decode_tok_s,
            "peak_mem_bytes": res.peak_rss_bytes, "cache_bytes_before": res.cache_bytes_before,
            "cache_bytes_after": res.cache_bytes_after,
            "load_1min": max(load_before, _load_1min()), "cpu_cores": _cpu_cores()}


def _load_1min() -> float:
    """The 1-minute load average (-1.0 where the OS has none)."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return -1.0


def _cpu_cores() -> int:
    """CPU cores this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def write_records(path: Path, records: list[dict]) -> None:
    """Atomically rewrite the JSON list (:func:`kvbench.store.atomic_write`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(records, indent=1) + "\n")


def engine_factory(model_cfg: dict, budget: float, device: str = "auto") -> Callable[[dict], Any]:
    """``method node -> kvbench.engine.Engine``, loading the model once (on first use)."""
    from .engine import Engine
    from .models import load_model
    from .validate import build_method

    loaded: list = []

    def make(method_cfg: dict) -> Any:
        if not loaded:
            loaded.append(load_model(model_cfg, device))
        return Engine(loaded[0], build_method(method_cfg, loaded[0].layout), float(budget))

    return make


def run_latency(model_cfg: dict, method_cfgs: dict[str, dict], budget: float, lengths: list[int],
                max_new_tokens: int, repeats: int, out: Path, make_engine: Callable[[dict], Any] | None = None,
                log: Callable[[str], None] = print) -> list[dict]:
    """Measure every method at every prompt length and write the records to ``out``.

    Args:
        model_cfg: the model's Hydra node as a dict (``model.name``...).
        method_cfgs: ``{preset name: method node}``; the record's ``method`` is the node's ``label``.
        budget: compressed methods' budget (the full cache ignores it; its records say 1.0).
        lengths: prompt lengths in tokens; those over the model's context window (minus the
            generated tokens) are skipped with a message.
        max_new_tokens: tokens generated per request.
        repeats: timed runs per (method, length), after one untimed warm-up per method.
        out: output JSON path.
        make_engine: ``method node -> engine`` (default :func:`engine_factory`).

    Returns:
        The records written.
    """
    make_engine = make_engine or engine_factory(model_cfg, budget)
    records: list[dict] = []
    kept = False
    for preset, method_cfg in method_cfgs.items():
        engine = make_engine(dict(method_cfg))
        limit = context_limit(getattr(engine, "model", None))
        todo = [n for n in lengths if limit is None or n + max_new_tokens <= limit]
        if len(todo) < len(lengths):
            log(f"skipping prompt lengths {sorted(set(lengths) - set(todo))}: over the context window {limit} "
                f"minus {max_new_tokens} new tokens")
        vocab = int(getattr(getattr(engine.model, "config", None), "vocab_size", 32000) or 32000)
        if todo:
            engine.generate(prompt_ids(min(todo), vocab), min(4, max_new_tokens), stop_ids=[])  # warm-up
        for n in todo:
            for rep in range(repeats):
                rec = {"model": model_cfg.get("name"), "method": method_cfg.get("label") or method_cfg.get("name"),
                       "method_name": method_cfg.get("name"), "preset": preset,
                       "budget": 1.0 if method_cfg.get("name") == "full" else float(budget),  # full keeps all
                       "repeat": rep, **measure(engine, prompt_ids(n, vocab), max_new_tokens),
                       "device": _device_name(engine)}
                records.append(rec)
                if not kept:  # an earlier run's records stay beside the new ones, never replaced
                    kept = True
                    snapshot = keep_previous(out)
                    if snapshot:
                        log(f"{out} of an earlier run is kept as {snapshot.name}")
                write_records(out, records)
                log(f"{rec['method']:>24} n={n:>7}: prefill {rec['prefill_s']:.3f} s, compress "
                    f"{rec['compress_s']:.3f} s, decode {rec['decode_tok_s']:.1f} tok/s")
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


@quiet_broken_pipe
@one_line_stop("the records measured so far are in the output file (rewritten after each one); an earlier file is kept as latency.<time>.json")
def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    from omegaconf import OmegaConf

    p = OneLineParser(prog="python -m kvbench.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=selkv_fig3 model=llama31")
    p.add_argument("--methods", nargs="+", action="extend", help="method presets (conf/method/*.yaml), space- or "
                   "comma-separated; default: latency.methods or full + the configured method")
    p.add_argument("--lengths", nargs="+", action="extend", help="prompt lengths (tokens), space- or comma-separated; "
                   "default: latency.lengths or powers of two from 512 to 8192 (lengths over the model's context "
                   "window are skipped)")
    p.add_argument("--new-tokens", type=int, help=f"generated tokens per request (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--repeats", type=int, help="timed runs per method and length (default 1)")
    p.add_argument("--out", help="output JSON (default: latency.out, else <output_root>/latency.json)")
    argv = list(sys.argv[1:] if argv is None else argv)
    at = _hydra_overrides(argv)
    args = p.parse_args([a for i, a in enumerate(argv) if i not in at])
    args.overrides = [argv[i] for i in sorted(at)] + args.overrides
    # "--lengths 256 512", "--lengths 256,512" and repeated flags all give one list (as in benchmarks, mask-heads)
    args.methods = p.list_arg("--methods", args.methods)
    lengths = p.list_arg("--lengths", args.lengths) or []
    bad = [x for x in lengths if not x.lstrip("-").isdigit()]
    if bad:
        p.error(f"--lengths {bad[0]}: must be an integer number of tokens")
    args.lengths = [int(x) for x in lengths] or None
    for flag, values in (("--lengths", args.lengths), ("--new-tokens", [args.new_tokens]), ("--repeats", [args.repeats])):
        bad = [v for v in values or [] if v is not None and v < 1]
        if bad:
            p.error(f"{flag} {bad[0]}: must be an integer >= 1")
    known = sorted(f.stem for f in (CONF_DIR / "method").glob("*.yaml"))
    for preset in args.methods or []:
        if preset not in known:
            p.error(f"--methods {preset}: unknown method preset; accepted values are {', '.join(known)}")
    try:
        cfg = compose(args.overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's override and config errors: one line, not a traceback
        from .cli_guard import composition_error

        p.error(composition_error(args.overrides) or f"{' '.join(args.overrides)}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
    lat = OmegaConf.to_container(cfg.get("latency") or OmegaConf.create({}), resolve=True)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    presets = args.methods or lat.get("methods") or ["full", cfg.method.name]
    method_cfgs = {}
    from eval.base import TaskConfigError
    from methods.base import ConfigError

    from .validate import validate

    for preset in dict.fromkeys(presets):
        # method.* overrides tune the compressed methods; the full-cache baseline has none of their fields
        keep = [o for o in args.overrides if not o.startswith("method=")
                and not (preset == "full" and o.lstrip("+~").startswith("method."))]
        try:
            sub = compose(keep + [f"method={preset}"])
        except Exception as e:  # noqa: BLE001 - a method.* key this preset lacks: one line
            from .cli_guard import composition_error

            why = composition_error(keep + [f"method={preset}"])
            p.error(f"method={preset}: " + (why or (str(e).strip().splitlines()[0] if str(e).strip()
                                                    else type(e).__name__)))
        try:  # the job runner's checks (budget, method fields, model source), before the model loads
            validate(OmegaConf.to_container(sub, resolve=True), layout=False)
        except (ConfigError, TaskConfigError) as e:
            p.error(f"method={preset}: {e}" if args.methods or len(presets) > 1 else str(e))
        method_cfgs[preset] = OmegaConf.to_container(sub.method, resolve=True)
    new_tokens = args.new_tokens if args.new_tokens is not None else lat.get("max_new_tokens") or DEFAULT_NEW_TOKENS
    lengths = list(dict.fromkeys(args.lengths or lat.get("lengths") or default_lengths(8192)))  # each length once
    out = Path(args.out or lat.get("out") or Path(cfg.get("output_root", "results")) / "latency.json")
    why = _out_refusal(out)
    if why:
        p.error(f"--out {str(out)!r}: {why}")
    from .validate import check_creatable, context_window

    try:  # not in a results root's task/model/method folder; its folder exists before the model loads
        from .validate import check_not_in_store

        check_not_in_store(f"--out {str(out)!r}", out.parent)
        check_creatable(f"--out {str(out)!r}", out.parent)
    except ConfigError as e:
        p.error(str(e))

    try:
        limit = context_window(model_cfg)  # from the config alone: no weights load for a run that would skip all
    except ConfigError as e:
        p.error(str(e))
    if limit is not None and int(new_tokens) >= limit:
        p.error(f"--new-tokens {new_tokens}: not below the context window {limit} of model={model_cfg.get('name')}")
    if limit is not None and all(n + int(new_tokens) > limit for n in lengths):
        key = "--lengths" if args.lengths else "latency.lengths"
        p.error(f"{key} {' '.join(map(str, lengths))}: every prompt length is over the context window {limit} "
                f"of model={model_cfg.get('name')} minus {new_tokens} new tokens (at most {limit - int(new_tokens)})")
    if cfg.get("threads"):  # as a job does: torch's CPU threads, before the model loads
        import torch

        torch.set_num_threads(int(cfg.threads))
    records = run_latency(model_cfg, method_cfgs, float(cfg.budget), list(lengths), int(new_tokens),
                          int(args.repeats or lat.get("repeats") or 1), out,
                          engine_factory(model_cfg, float(cfg.budget), str(cfg.get("device", "auto"))))
    if not records:
        print(f"error: no latency records (every prompt length was skipped); {out} not written", file=sys.stderr)
        return 1
    print(f"latency records written to {out}")
    return 0


def _hydra_overrides(argv: list[str]) -> set[int]:
    """The positions of the Hydra overrides in ``argv`` wherever they stand (``key=value``,
    ``+key=value``, ``~key``), so that they may follow the options: ``--methods full snapkv
    budget=0.3`` would otherwise read ``budget=0.3`` as a preset. The value of ``--out`` is
    never one."""
    return {i for i, token in enumerate(argv)
            if not token.startswith("-") and ("=" in token or token.startswith("~"))
            and not (i and argv[i - 1] == "--out")}


def _out_refusal(out: Path) -> str:
    """Why the records must not be written to ``out`` (``""`` when they may): a folder, a
    results-store file or a path in a job folder (:func:`kvbench.store.output_file_refusal`), or
    an existing file that is not a latency record list (an earlier list is kept, see
    :func:`run_latency`)."""
    return output_file_refusal(out, "a latency record list", lambda old: isinstance(old, list) and all(
        isinstance(r, dict) and "prompt_tokens" in r for r in old), "<output_root>/latency.json")


if __name__ == "__main__":
    sys.exit(main())
