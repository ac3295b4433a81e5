"""``python -m benchmarks``: run the performance suite, print a table per benchmark, save JSON,
write the Markdown summary.

    python -m benchmarks                    # the whole CPU suite (< 20 min on 2 cores), writes docs/PERFORMANCE.md
    python -m benchmarks --quick            # short lengths, few repetitions (a few minutes)
    python -m benchmarks --only decode --only memory
    python -m benchmarks --kvpress-python /path/to/venv/bin/python   # kvpress lives in another environment

The summary goes to ``docs/PERFORMANCE.md`` for a complete, non-quick run, else to
``<out>/PERFORMANCE.md`` (so quick or partial runs never overwrite the committed page);
``--doc PATH`` chooses.
"""

from __future__ import annotations

import os

# Before torch is imported: under CPU contention, OpenMP threads that spin while waiting make
# every small op of a decode step pay for descheduled spinners (measured 10× slower decode
# with 7 other busy processes on 2 cores); passive waiting costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

from .common import ROOT, BenchResult, Settings, apply_threads, log, machine_info, table  # noqa: E402

BENCHMARKS = ["engine", "overhead", "kvpress", "compression", "decode", "memory"]
MODULES = {"kvpress": "vs_kvpress"}  # benchmark name -> module, where they differ


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short prompts (256, 512 tokens), few repetitions")
    p.add_argument("--only", action="append", metavar="NAME",
                   help=f"run only these benchmarks (repeat or comma-separate): {', '.join(BENCHMARKS)}")
    p.add_argument("--model", default="smollm2", help="conf/model/<name>.yaml name or a YAML path (default: smollm2)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="output folder (default: benchmarks/out/)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's default)")
    p.add_argument("--kvpress-python", default=os.environ.get("KVBENCH_KVPRESS_PYTHON"),
                   help="python with kvpress installed, for the kvpress benchmark (default: this one; "
                        "env KVBENCH_KVPRESS_PYTHON)")
    p.add_argument("--doc", default=None, help="where to write the Markdown summary (see above)")
    p.add_argument("--note", action="append", default=[], help="a note to add to the summary (repeatable)")
    args = p.parse_args(argv)
    names: list[str] = []
    for item in args.only or []:
        names += [x.strip() for x in item.split(",") if x.strip()]
    unknown = [x for x in names if x not in BENCHMARKS]
    if unknown:
        p.error(f"--only {unknown[0]}: unknown benchmark; accepted values are {', '.join(BENCHMARKS)}")
    args.names = [b for b in BENCHMARKS if b in names] if names else list(BENCHMARKS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    settings = Settings(quick=args.quick, model=args.model, device=args.device, out=str(Path(args.out).resolve()),
                        threads=args.threads, kvpress_python=args.kvpress_python)
    apply_threads(settings)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    from .context import Context

    t_start = time.perf_counter()
    machine = machine_info(settings)
    machine["load_average_start"] = machine.pop("load_average")
    log(f"suite: {', '.join(args.names)} ({'quick' if args.quick else 'full'}) on {machine['cpu']}, "
        f"{machine['cores']} cores, {machine['torch_threads']} torch threads, load {machine['load_average_start'][0]:.1f}")
    ctx = Context(settings)
    results: list[BenchResult] = []
    crashed = False
    for name in args.names:
        mod = importlib.import_module(f"benchmarks.{MODULES.get(name, name)}")
        t0 = time.perf_counter()
        log(f"{name}: start")
        try:
            res = mod.run(ctx)
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others
            crashed = True
            traceback.print_exc()
            res = BenchResult(name, mod.TITLE, skipped=f"error: {type(e).__name__}: {str(e).splitlines()[0]}")
        res.seconds = time.perf_counter() - t0
        results.append(res)
        print(f"\n## {res.title}  [{res.seconds:.0f} s]")
        print(f"skipped: {res.skipped}" if res.skipped else table(res.headers, res.rows))
        for t in res.targets:
            print(f"  {t.verdict}: {t.name}: {t.measured} (target {t.target}){' - ' + t.note if t.note else ''}")
        for note in res.notes:
            print(f"  note: {note}")
        (out / f"{name}.json").write_text(json.dumps(res.to_json(), indent=2, default=str))
    machine["load_average_end"] = list(os.getloadavg())
    machine["wall_s"] = time.perf_counter() - t_start
    command = "python -m benchmarks" + ("" if len(sys.argv) <= 1 else " " + " ".join(sys.argv[1:]))
    (out / "summary.json").write_text(json.dumps({
        "machine": machine, "command": command,
        "targets": [dict(benchmark=r.name, **t.__dict__, verdict=t.verdict) for r in results for t in r.targets],
    }, indent=2, default=str))
    from . import report

    complete = not args.quick and args.names == BENCHMARKS
    doc = Path(args.doc) if args.doc else (ROOT / "docs" / "PERFORMANCE.md" if complete else out / "PERFORMANCE.md")
    report.write(doc, machine, results, command, args.note)
    print(f"\nsummary: {doc}; JSON: {out}/ (wall time {machine['wall_s'] / 60:.1f} min)")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
