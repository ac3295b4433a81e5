"""``python -m benchmarks``: kvbench's performance suite on the embedded model (SmolLM2-135M):
engine, overhead, kvpress, compression, decode, memory and quantized-cache tables (benchmarks/README.md). Every
target is a ratio of two measurements of the same run. Tables are printed, JSON saved under --out
and the summary written to docs/PERFORMANCE.md (complete, non-quick runs; else <out>/PERFORMANCE.md).

    python -m benchmarks                    # the whole CPU suite (about 20 min on 2 cores)
    python -m benchmarks --quick            # 256/512-token prompts, few repetitions (a few minutes)
    python -m benchmarks --only decode --only memory
    python -m benchmarks --only compression --methods lookm,selkv --lengths 2048,4096
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

from kvbench.cli import ArgParser, listof
from kvbench.job.store import atomic_write
from methods.base import ConfigError

from .common import ROOT, BenchResult, Context, Settings, log, machine_info, table

BENCHMARKS = {"engine": "engine", "overhead": "overhead", "kvpress": "vs_kvpress", "compression": "compression",
              "decode": "decode", "memory": "memory", "thinking": "thinking", "quant": "quant",
              "throughput": "throughput"}  # name -> module
MIN_LENGTH = 64  # shortest --lengths value (the question frame of the prompt alone is ~40 tokens)
DOC = ROOT / "docs" / "PERFORMANCE.md"
for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false"),
                   ("MKL_DISABLE_FAST_MM", "1")):  # MKL's buffer pool (outside PyTorch) would count as memory not freed
    os.environ.setdefault(key, value)  # before transformers and MKL load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a usage error is one line naming the flag, exit 2, before anything runs."""
    from .compression import METHODS as COMPRESSION
    from .memory import METHODS as MEMORY

    from kvbench.job.config import conf_model

    methods = list(dict.fromkeys(COMPRESSION + MEMORY))
    p = ArgParser(prog="python -m benchmarks", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    many = dict(nargs="+", action="extend", default=[])
    p.add_argument("--quick", action="store_true", help="256/512-token prompts, 8 new tokens, 2 repetitions")
    p.add_argument("--only", **many, type=listof(str, BENCHMARKS.__contains__, ", ".join(BENCHMARKS)), metavar="NAME",
                   help=f"run only these: {', '.join(BENCHMARKS)}")
    p.add_argument("--model", default="smollm2", help="conf/model/<name>.yaml name or a YAML path (default: smollm2)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="output folder (default: benchmarks/out/)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's default)")
    p.add_argument("--doc", default=None, help="where to write the Markdown summary")
    p.add_argument("--note", action="append", default=[], help="a note to add to the summary (repeatable)")
    p.add_argument("--methods", **many, type=listof(str, methods.__contains__, ", ".join(methods)), metavar="NAME",
                   help=f"restrict compression and memory to these methods: {', '.join(methods)}")
    p.add_argument("--lengths", **many, type=listof(int, lambda n: n >= MIN_LENGTH, f"integers >= {MIN_LENGTH}"), metavar="N",
                   help="prompt lengths in tokens (default 1024,2048,4096,8000; --quick 256,512); compression, decode "
                        "and memory targets are measured at 4096 or the longest given")
    args = p.parse_args(argv)
    args.names = list(dict.fromkeys(sum(args.only, []))) or list(BENCHMARKS)
    args.method_names, args.prompt_lengths = sum(args.methods, []) or None, sorted(set(sum(args.lengths, []))) or None
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: must be an integer >= 1")
    try:
        conf_model(args.model, "--model")
    except ConfigError as e:
        p.error(str(e))
    return args


def section(r: BenchResult) -> list[str]:
    """One benchmark's part of the summary: title, command, tables, notes (Markdown lines)."""
    lines = [f"## {r.title}", "", f"`python -m benchmarks --only {r.name}` ({r.seconds:.0f} s)", ""]
    if r.skipped:
        return lines + [f"Skipped: {r.skipped}", ""]
    lines += [table(r.headers, r.rows), ""] if r.rows else []
    for extra in r.tables:
        lines += [f"{extra['title']}:", "", table(extra["headers"], extra["rows"]), ""]
    return lines + [f"- {n}" for n in r.notes] + ([""] if r.notes else [])


def render(machine: dict, results: list[BenchResult], command: str, notes: list[str]) -> str:
    """The Markdown summary: machine, every target with measured value and PASS/FAIL, each section."""
    targets = [[r.name, t.name, t.measured, t.target, t.verdict, t.note] for r in results for t in r.targets]
    intro = (f"Generated by `{command}` on {machine['date']} (wall time {machine.get('wall_s', 0) / 60:.1f} min); "
             "JSON of every benchmark in `--out`. Every target is a ratio of two measurements of the same run.")
    lines = ["# Performance", "", intro, "", "## Machine", "",
             table(["key", "value"], [[k, v] for k, v in machine.items()]), ""]
    lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""] if notes else []
    lines += ["## Targets", "", table(["benchmark", "target", "measured", "target value", "result", "note"], targets)
              if targets else "(none)", ""]
    return "\n".join(lines + [x for r in results for x in section(r)]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    settings = Settings(quick=args.quick, model=args.model, device=args.device, out=str(Path(args.out).resolve()),
                        threads=args.threads, methods=args.method_names, prompt_lengths=args.prompt_lengths)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start, machine, ctx = time.perf_counter(), machine_info(settings), Context(settings)
    results: list[BenchResult] = []
    crashed = False
    for name in args.names:
        mod = importlib.import_module(f"benchmarks.{BENCHMARKS[name]}")
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
        print("\n" + "\n".join(section(res)))
        for t in res.targets:
            print(f"  {t.verdict}: {t.name}: {t.measured} (target {t.target}){' - ' + t.note if t.note else ''}")
        atomic_write(out / f"{name}.json", json.dumps(res.to_json(), indent=2, default=str))
    machine["wall_s"] = time.perf_counter() - t_start
    command = "python -m benchmarks" + "".join(" " + a for a in (sys.argv[1:] if argv is None else argv))
    atomic_write(out / "summary.json", json.dumps({"machine": machine, "command": command, "targets": [
        dict(benchmark=r.name, **t.__dict__, verdict=t.verdict) for r in results for t in r.targets]}, indent=2))
    complete = not args.quick and args.names == list(BENCHMARKS) and not args.method_names and not args.prompt_lengths
    doc = Path(args.doc) if args.doc else DOC if complete else out / "PERFORMANCE.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(doc, render(machine, results, command, args.note))
    counts = Counter(t.verdict for r in results for t in r.targets)
    print("\ntargets: " + (", ".join(f"{counts[v]} {v}" for v in ("PASS", "FAIL", "SKIP") if counts[v]) or "none"))
    print(f"summary: {doc}; JSON: {out}/ (wall time {machine['wall_s'] / 60:.1f} min)")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
