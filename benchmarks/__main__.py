"""``python -m benchmarks``: run the performance suite, print a table per benchmark, save JSON,
write the Markdown summary.

    python -m benchmarks                    # the whole CPU suite (< 20 min on 2 cores), writes docs/PERFORMANCE.md
    python -m benchmarks --quick            # short lengths, few repetitions (a few minutes)
    python -m benchmarks --only decode --only memory
    python -m benchmarks --only compression --methods lookm,selkv --lengths 2048,4096
    python -m benchmarks --kvpress-python /path/to/venv/bin/python   # kvpress lives in another environment

The summary goes to ``docs/PERFORMANCE.md`` for a complete, non-quick run, else to
``<out>/PERFORMANCE.md`` (so quick or partial runs, and runs where every target was skipped,
never overwrite the committed page); ``--doc PATH`` chooses. ``--methods``/``--lengths`` also
make a run partial. ``--device`` and ``--threads`` are checked before anything runs.
"""

from __future__ import annotations

import os

# OpenMP's wait policy is left as the user's environment has it (the machine table records
# it): jobs run with the default, so the suite measures the default. On an idle machine the
# default (spin, then sleep) is what makes a decode step's ~600 small ops cheap: PASSIVE
# waiting made SmolLM2's decode step 1.6× slower (55 vs 35 ms at 1k tokens, 2 cores). On a
# CPU shared with other busy processes spinning threads are the slow ones (up to 10×): set
# OMP_WAIT_POLICY=PASSIVE there, and expect numbers that are not comparable.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
from collections import Counter  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from kvbench.cli_parser import OneLineParser  # noqa: E402
from kvbench.signals import one_line_stop, quiet_broken_pipe  # noqa: E402
from kvbench.store import store_write_refusal  # noqa: E402
from kvbench.validate import check_device_flag, check_not_in_store  # noqa: E402
from methods.base import ConfigError  # noqa: E402

from .common import ROOT, BenchResult, Settings, apply_threads, log, machine_info, model_config, save, table  # noqa: E402

BENCHMARKS = ["engine", "overhead", "kvpress", "compression", "decode", "memory"]
MODULES = {"kvpress": "vs_kvpress"}  # benchmark name -> module, where they differ
MIN_LENGTH = 64  # shortest --lengths value (the question frame of the prompt alone is ~40 tokens)


def _method_names() -> list[str]:
    """Methods the per-method benchmarks know (compression and memory), in their order."""
    from .compression import METHODS as COMPRESSION
    from .memory import METHODS as MEMORY

    return list(dict.fromkeys(COMPRESSION + MEMORY))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    intro, _, rest = __doc__.partition("\n\n")
    p = OneLineParser(prog="python -m benchmarks", description=intro, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short prompts (256, 512 tokens), few repetitions")
    p.add_argument("--only", nargs="+", action="extend", metavar="NAME",
                   help=f"run only these benchmarks (space- or comma-separated, or repeated): {', '.join(BENCHMARKS)}")
    p.add_argument("--model", default="smollm2", help="conf/model/<name>.yaml name or a YAML path (default: smollm2)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="output folder (default: benchmarks/out/)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's default)")
    p.add_argument("--kvpress-python", default=os.environ.get("KVBENCH_KVPRESS_PYTHON"),
                   help="python with kvpress installed, for the kvpress benchmark (default: this one; "
                        "env KVBENCH_KVPRESS_PYTHON)")
    p.add_argument("--doc", default=None, help="where to write the Markdown summary (default: docs/PERFORMANCE.md "
                   "for a complete, non-quick run, else <out>/PERFORMANCE.md; an existing file must be such a summary)")
    p.add_argument("--note", action="append", default=[], help="a note to add to the summary (repeatable)")
    p.add_argument("--methods", nargs="+", action="extend", metavar="NAME",
                   help="restrict the per-method benchmarks (compression, memory) to these methods (space- or "
                        f"comma-separated, or repeated): {', '.join(_method_names())}")
    p.add_argument("--lengths", nargs="+", action="extend", metavar="N",
                   help="prompt lengths in tokens (space- or comma-separated, or repeated) for compression, engine and decode, "
                        "and the longest for memory (default: 2048,4096,8000 for compression, 1024,2048,4096,8000 "
                        "otherwise; --quick: 256,512); overhead and kvpress keep their fixed lengths; each at most the "
                        "model's context window minus the tokens a sample generates (32; 8 with --quick)")
    args = p.parse_args(argv)
    names = p.list_arg("--only", args.only) or []
    unknown = [x for x in names if x not in BENCHMARKS]
    if unknown:
        p.error(f"--only {unknown[0]}: unknown benchmark; accepted values are {', '.join(BENCHMARKS)}")
    args.names = [b for b in BENCHMARKS if b in names] if names else list(BENCHMARKS)
    args.method_names = p.list_arg("--methods", args.methods)
    bad = [x for x in args.method_names or [] if x not in _method_names()]
    if bad:
        p.error(f"--methods {bad[0]}: unknown method; accepted values are {', '.join(_method_names())}")
    lengths = p.list_arg("--lengths", args.lengths) or []
    bad = [x for x in lengths if not x.isdigit() or int(x) < MIN_LENGTH]
    if bad:
        p.error(f"--lengths {bad[0]}: must be an integer number of tokens >= {MIN_LENGTH}")
    args.prompt_lengths = sorted({int(x) for x in lengths}) or None
    for flag, path in (("--out", Path(args.out)), ("--doc", Path(args.doc) if args.doc else None)):
        why = store_write_refusal(path) if path is not None else ""
        if why:
            p.error(f"{flag} {str(path)!r}: {why}; pass a path outside the job folders")
    try:  # a results root's task, model or method folder; a device this machine lacks
        check_not_in_store(f"--out {args.out!r}", Path(args.out))
        check_device_flag("--device", args.device, args.threads)
    except ConfigError as e:
        p.error(str(e))
    try:  # the model config exists (its source is checked when the suite loads it)
        model_cfg = model_config(args.model)
    except SystemExit as e:
        p.error(str(e).removeprefix("error: "))
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out!r}: a file, not a folder (the JSON files and worker logs are written into it)")
    if args.prompt_lengths:
        from kvbench.validate import context_window

        try:  # from the model's config alone (no weights)
            window = context_window(model_cfg)
        except ConfigError as e:
            p.error(str(e))
        longest = max(args.prompt_lengths)
        new = Settings(quick=args.quick).new_tokens  # tokens each sample generates (8 with --quick, else 32)
        if window is not None and longest + new > window:
            p.error(f"--lengths {longest}: over the context window {window} of --model={args.model} minus {new} "
                    f"generated tokens (at most {window - new})")
    if args.doc and Path(args.doc).is_file() and not Path(args.doc).read_text(
            encoding="utf-8", errors="replace").startswith("# Performance"):
        p.error(f"--doc {args.doc!r}: exists and is not a performance summary of python -m benchmarks; pass a new file")
    if args.kvpress_python and "kvpress" in args.names and not (
            Path(args.kvpress_python).is_file() and os.access(args.kvpress_python, os.X_OK)):
        p.error(f"--kvpress-python {args.kvpress_python!r}: not an executable file; pass the python of an "
                "environment with kvpress installed")
    from kvbench.validate import check_creatable

    try:  # the last check: the JSON folder exists before anything runs
        check_creatable(f"--out {args.out!r}", Path(args.out))
    except ConfigError as e:
        p.error(str(e))
    return args


def busy_warning(load: float, cores: int, device: str) -> str | None:
    """The warning printed before a CPU suite starts on a busy machine, else None.

    Every benchmark times work on the CPU's cores; another process on them inflates the times
    and, worse, the ratios of things measured at different moments (compression / prefill,
    decode steps / floor). ``load``: the 1-minute load average; busy from half the cores on.
    """
    if device not in ("cpu", "auto") or load < max(1.0, cores / 2):
        return None
    return (f"warning: the CPU is busy (1-minute load average {load:.1f} on {cores} cores): if other processes "
            "still run, they share the cores the suite times, and its times and ratios come out inflated and noisy "
            "(a compression share or a decode step can be several times too high); run it on an idle machine")


@quiet_broken_pipe
@one_line_stop("the JSON of each finished benchmark is in --out; no summary page (--doc, default docs/PERFORMANCE.md) "
               "was written")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    settings = Settings(quick=args.quick, model=args.model, device=args.device, out=str(Path(args.out).resolve()),
                        threads=args.threads, kvpress_python=args.kvpress_python,
                        methods=args.method_names, prompt_lengths=args.prompt_lengths)
    apply_threads(settings)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    from .context import Context

    t_start = time.perf_counter()
    machine = machine_info(settings)
    machine["load_average_start"] = machine.pop("load_average")
    log(f"suite: {', '.join(args.names)} ({'quick' if args.quick else 'full'}) on {machine['cpu']}, "
        f"{machine['cores']} cores, {machine['torch_threads']} torch threads, load {machine['load_average_start'][0]:.1f}")
    busy = busy_warning(machine["load_average_start"][0], machine["cores"], settings.device)
    if busy:
        print(busy, file=sys.stderr)
    ctx = Context(settings)
    results: list[BenchResult] = []
    crashed = False
    for name in args.names:
        mod = importlib.import_module(f"benchmarks.{MODULES.get(name, name)}")
        t0 = time.perf_counter()
        started, reused = ctx.runs_started, ctx.runs_reused
        log(f"{name}: start")
        try:
            res = mod.run(ctx)
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others
            crashed = True
            traceback.print_exc()
            res = BenchResult(name, mod.TITLE, skipped=f"error: {type(e).__name__}: {str(e).splitlines()[0]}")
        res.seconds = time.perf_counter() - t0
        res.runs_started, res.runs_reused = ctx.runs_started - started, ctx.runs_reused - reused
        results.append(res)
        print(f"\n## {res.title}  [{res.seconds:.0f} s]")
        print(f"skipped: {res.skipped}" if res.skipped else table(res.headers, res.rows))
        for extra in [] if res.skipped else res.tables:
            print(f"\n{extra['title']}:\n{table(extra['headers'], extra['rows'])}")
        for t in res.targets:
            print(f"  {t.verdict}: {t.name}: {t.measured} (target {t.target}){' - ' + t.note if t.note else ''}")
        for note in res.notes:
            print(f"  note: {note}")
        save(out / f"{name}.json", json.dumps(res.to_json(), indent=2, default=str))
    machine["load_average_end"] = list(os.getloadavg())
    machine["wall_s"] = time.perf_counter() - t_start
    command = "python -m benchmarks" + ("" if len(sys.argv) <= 1 else " " + " ".join(sys.argv[1:]))
    save(out / "summary.json", json.dumps({
        "machine": machine, "command": command,
        "targets": [dict(benchmark=r.name, **t.__dict__, verdict=t.verdict) for r in results for t in r.targets],
    }, indent=2, default=str))
    from . import report

    complete = not args.quick and args.names == BENCHMARKS and not args.method_names and not args.prompt_lengths
    measured = any(t.verdict in ("PASS", "FAIL") for r in results for t in r.targets)
    if complete and not measured and not args.doc:  # nothing measured: the committed summary stays as it is
        print(f"no target was measured; docs/PERFORMANCE.md is left as it was (summary in {out}/)")
    doc = Path(args.doc) if args.doc else (ROOT / "docs" / "PERFORMANCE.md" if complete and measured
                                           else out / "PERFORMANCE.md")
    resolved = out.resolve()
    json_dir = (f"{resolved.relative_to(ROOT.resolve())}/" if resolved.is_relative_to(ROOT.resolve())
                else f"{resolved}/")
    # docs/PERFORMANCE.md is under version control: its history is git's; any other summary is kept
    report.write(doc, machine, results, command, args.note, json_dir,
                 keep=doc.resolve() != (ROOT / "docs" / "PERFORMANCE.md").resolve())
    contention = report.contention_note(machine)
    if contention:
        print("\n" + contention.replace("**", ""))
    counts = Counter(t.verdict for r in results for t in r.targets)
    print("\ntargets: " + (", ".join(f"{counts[v]} {v}" for v in ("PASS", "FAIL", "INFO", "SKIP") if counts[v]) or "none"))
    print(f"summary: {doc}; JSON: {out}/ (wall time {machine['wall_s'] / 60:.1f} min)")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
