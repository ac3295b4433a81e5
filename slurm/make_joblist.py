#!/usr/bin/env python
"""Expand a Hydra sweep into a job list for ``slurm/array.sbatch``, a shell-quoted line per job (docs/SWEEPS.md)::

    python slurm/make_joblist.py method=snapkv,selkv budget=0.1,0.25 task=niah -o jobs.txt

With ``--plan`` (``kvbench plan``) it prints what the sweep will decode and its device-hours instead.
"""

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvbench, methods, eval of this checkout
from eval import get_task_class  # noqa: E402
from kvbench.cli import ArgParser  # noqa: E402
from kvbench.job.config import compose, one_line  # noqa: E402 - one_line: errors worded as run.py words them
from kvbench.job.store import JobStore  # noqa: E402


class SweepSpecError(ValueError):
    """A sweep override that cannot be expanded into a job list (one line, names the override)."""


def expand(overrides: list[str], shards: int = 1) -> list[list[str]]:
    """``n_jobs * shards`` override lists from those of ``run.py -m``, as Hydra's basic sweeper makes them (a preset's
    ``hydra.sweeper.params`` first). SweepSpecError: a bad override or preset, a glob/interval sweep, shards < 1."""
    if shards < 1:
        raise SweepSpecError(f"--shards={shards}: must be an integer >= 1")
    try:
        presets = [o for o in overrides if o.lstrip("+").startswith("experiment=")]
        params = (compose(presets, return_hydra_config=True).hydra.sweeper.params if presets else None) or {}
        parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
        bad = [o.input_line for o in parsed if o.is_interval_sweep() or o.value_type == ValueType.GLOB_CHOICE_SWEEP]
        if bad:
            raise SweepSpecError(f"{bad[0]!r}: only comma lists, range() and choice() can be expanded")
        jobs = BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException as error:
        raise SweepSpecError(" ".join(str(error).split())) from None  # Hydra's accepted options too
    return [job + [f"shard.index={k}", f"shard.count={shards}"] * (shards > 1) for job in jobs for k in range(shards)]


def measure(run: Path, model: str) -> dict:
    """What ``run`` measured for ``model`` (docs/SWEEPS.md): prefill s ≈ ``a``·n^``p``, ``decode_tok_s``, ``load_s``,
    ``compile_s``. SweepSpecError: no successful record."""
    if run.suffix == ".json":
        records = [r for r in json.loads(run.read_text()) if r.get("model") == model]
        loads = [r.get("load_s") for r in records]
    else:
        jobs = [f.parent for f in sorted(run.rglob("predictions.jsonl"))
                if yaml.safe_load((f.parent / "config.yaml").read_text())["model"]["name"] == model]
        records = [r for job in jobs for r in JobStore(job).records()]
        loads = [json.loads(env.read_text()).get("load_s") for job in jobs for env in sorted(job.glob("env*.json"))]
    ok = [r for r in records if not r.get("error") and r.get("prefill_s") and r.get("decode_s")]
    if not ok:
        raise SweepSpecError(f"--cost {run}: no successful record of model {model} to measure tokens/s")
    n, t = np.array([[r["prompt_tokens"], r["prefill_s"] + r.get("compress_s", 0)] for r in ok], dtype=float).T
    if len(set(n)) > 1:
        p, log_a = np.polyfit(np.log(n), np.log(t), 1)
        note = f"prefill s = {np.exp(log_a):.3g}·n^{p:.2f} fitted at {len(set(n))} prompt lengths ({n.min():.0f}-{n.max():.0f})"
    else:
        p, log_a = 1.0, np.log(t.sum() / n.sum())
        note = f"prefill measured at one prompt length only ({n[0]:.0f} tokens): scaled linearly in n"
    loads, compiles = [x for x in loads if x], [r["compile_s"] for r in ok if r.get("compile_s")]
    return {"a": float(np.exp(log_a)), "p": float(p), "note": note,
            "decode_tok_s": sum(r["generated_tokens"] for r in ok) / sum(r["decode_s"] for r in ok),
            "load_s": sum(loads) / len(loads) if loads else 0.0, "compile_s": sum(compiles) / len(compiles) if compiles else 0.0}


def job_samples(cfg: dict) -> list[tuple[int, int]]:
    """``(prompt tokens, max new tokens)`` of every sample of a composed job config's task, in order, unsharded."""
    from kvbench.job.run import build_task, encode_prompt
    from kvbench.engine.models import chat_format, load_tokenizer, read_config

    tok = load_tokenizer(cfg["model"])
    loaded = SimpleNamespace(tokenizer=tok, chat_template=chat_format(cfg["model"], tok),
                             max_input_length=cfg["model"]["max_input_length"])
    window = getattr(read_config(cfg["model"]).get_text_config(), "max_position_embeddings", None)
    return [(len(encode_prompt(loaded, s)), s.max_new_tokens)
            for s in build_task(cfg, loaded, {"context_window": window})[1]]


def unique_jobs(jobs: list[list[str]]) -> list[tuple[list[str], dict]]:
    """Each job with its composed config; ``method=full`` at several budgets (one job folder) once, at the first."""
    out: dict[str, tuple[list[str], dict]] = {}
    for job in jobs:
        OmegaConf.to_object(composed := compose(job))  # the schemas' range checks (ConfigError: the key)
        cfg = OmegaConf.to_container(composed, resolve=True, enum_to_str=True)
        twin = json.dumps({k: v for k, v in cfg.items() if k != "budget" or cfg["method"]["name"] != "full"},
                          sort_keys=True, default=str)
        out.setdefault(twin, (job, cfg))
    return list(out.values())


def cost(jobs: list[tuple[list[str], dict]], run: Path):
    """A pandas frame, a row per job: samples, tokens and hours = load + compile + Σ a·n^p + new tokens / decode tok/s
    (an upper bound; :func:`measure`); ``attrs["fits"]``: each model's fit in words."""
    rows, samples, fits = [], {}, {}
    for job, cfg in jobs:
        key, name = json.dumps([cfg["model"], cfg["task"]], sort_keys=True), cfg["model"]["name"]
        samples[key] = samples.get(key) or job_samples(cfg)
        fit = fits[name] = fits.get(name) or measure(run, name)
        mine = samples[key][cfg["shard"]["index"]::cfg["shard"]["count"]][:cfg.get("max_samples") or None]
        prompt, new = sum(p for p, _ in mine), cfg["sampling"]["n"] * sum(n for _, n in mine)  # each candidate
        once = fit["load_s"] + (fit["compile_s"] if cfg.get("compile", False) is not False else 0)
        seconds = once + sum(fit["a"] * p ** fit["p"] for p, _ in mine) + new / fit["decode_tok_s"]
        rows.append({"job": shlex.join(job), "samples": len(mine), "prompt_tokens": prompt, "new_tokens": new,
                     "longest": max((p + n for p, n in mine), default=0), "hours": seconds / 3600})
    table = pd.DataFrame(rows)
    table.attrs["fits"] = [f"{name}: {f['note']}; {f['decode_tok_s']:.1f} decode tok/s; per job: model load "
                           f"{f['load_s']:.0f} s, compile {f['compile_s']:.0f} s" for name, f in fits.items()]
    return table


def plan(jobs: list[tuple[list[str], dict]], given: dict[int, float] | None = None):
    """A pandas frame, a row per job: samples (NA: unknown), candidates, new tokens at most and decode hours at batch 1
    and ``batch_size`` at the tok/s of ``given`` (``--rate``) else ``benchmarks/rates.json`` (docs/SWEEPS.md);
    ``attrs["rates"]``: each model's rates in words."""
    table = {} if given else json.loads((Path(__file__).resolve().parents[1] / "benchmarks/rates.json").read_text())
    rows, found, notes = [], {}, {}
    for job, cfg in jobs:
        key, name = json.dumps([cfg["model"], cfg["task"]], sort_keys=True), cfg["model"]["name"]
        try:
            found[key] = found.get(key) or ([n for _, n in job_samples(cfg)], "data")
        except (OSError, ValueError, ImportError):  # no data or tokenizer here (offline)
            found[key] = (get_task_class(cfg["task"]["name"]).documented(cfg["task"]), "documented")
        news, source = found[key]
        measured = next((k for k in table if k.startswith(f"{name} on ")), next(iter(table), ""))
        entry = table.get(measured, {})
        other = "" if measured.startswith(f"{name} on ") else f", not {name}'s (pass --rate)"
        rate = given or {int(b): r for b, r in entry["tok_s"].items()}
        notes[name] = "given (--rate)" if given else f"{measured} ({entry['device']}, {entry['date']}){other}"
        batch = cfg["batch_size"] if isinstance(cfg["batch_size"], int) else max(rate)
        mine = (news or None) and news[cfg["shard"]["index"]::cfg["shard"]["count"]][:cfg.get("max_samples") or None]
        new = mine and cfg["sampling"]["n"] * sum(mine)
        hours = [mine and new / rate[max([1, *(k for k in rate if k <= b)])] / 3600 for b in (1, batch)]
        rows.append({"job": shlex.join(job), "samples": mine and len(mine), "from": source if mine else "unknown",
                     "candidates": mine and cfg["sampling"]["n"] * len(mine), "new tokens <=": new, "batch": batch,
                     "hours at 1": hours[0], "hours at batch": hours[1]})
    frame = pd.DataFrame(rows).astype({c: float for c in ("samples", "candidates", "new tokens <=", "hours at 1",
                                                          "hours at batch")})  # float (NaN: unknown) even all unknown
    frame.attrs["rates"] = notes
    return frame


def rate_arg(text: str) -> dict[int, float]:
    """``--rate``: decode tok/s at batch 1 (``35``) or by batch size (``1:35,8:240``)."""
    with contextlib.suppress(ValueError):
        given = {int(b if c else 1): float(r) for b, c, r in (p.rpartition(":") for p in text.split(","))}
        if min(given) == 1 and min(given.values()) > 0:
            return given
    raise argparse.ArgumentTypeError(f"{text!r}: accepted values are tok/s > 0 at batch 1 (35) or BATCH:TOK_S "
                                     "pairs, batch 1 among them (1:35,8:240)")


def main(argv: list[str] | None = None) -> int:
    """Write the job list (``-o`` or stdout), print the sbatch command; 2 on a bad sweep or ``-o`` (one line)."""
    name = "kvbench plan" if "--plan" in (sys.argv[1:] if argv is None else argv) else "make_joblist"
    slurm = (lambda text: argparse.SUPPRESS) if name == "kvbench plan" else str  # kvbench plan -h: its own options
    parser = ArgParser(prog=name, description="Print what a sweep will decode and its device-hours (docs/SWEEPS.md)."
                       if name == "kvbench plan" else __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="+", help="Hydra overrides, sweeps as comma lists")
    parser.add_argument("-o", "--output", type=Path, help=slurm("job list file (default: standard output)"))
    parser.add_argument("--shards", type=int, default=1, help="split every job into this many shards")
    parser.add_argument("--parallel", type=int, default=16, help=slurm("array tasks at once, for the printed command"))
    parser.add_argument("--cost", type=Path, metavar="RUN", help=slurm("print hours at RUN's speed (docs/SWEEPS.md)"))
    parser.add_argument("--plan", action="store_true", help=slurm("print samples, new tokens, decode hours"))
    parser.add_argument("--rate", type=rate_arg, metavar="TOK_S", help="decode tok/s: 35, or 1:35,8:240 by batch size")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options, as with run.py
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: must be an integer >= 1 (array tasks run at once)")
    if "sweep.share_prefill=true" in [o.lower() for o in args.overrides]:
        parser.error("sweep.share_prefill=true: runs with the local launcher only (python run.py -m ...), not SLURM")
    given = [o for o in args.overrides if o.lstrip("+~").startswith("shard.")]
    if given and args.shards > 1:
        parser.error(f"{given[0]}: --shards {args.shards} sets shard.index and shard.count on every line")
    try:
        overrides = [("+" + o if o.startswith("experiment=") else o) for o in args.overrides]
        composed = unique_jobs(expand(overrides, args.shards))
        if args.plan:
            table = plan(composed, args.rate)
            print(table.to_string(index=False, float_format="{:.3g}".format, na_rep="?"),
                  *(f"rate of {model}: {words}" for model, words in table.attrs["rates"].items()), sep="\n")
            t = table.sum(numeric_only=True)
            print(f"{len(table)} jobs ({table.samples.isna().sum()} unknown: no data here, no documented size), "
                  f"{t['samples']:.0f} samples, {t['candidates']:.0f} candidates, {t['new tokens <=']:.0f} new tokens "
                  f"at most; {t['hours at 1']:.3g} device-hours at batch 1, {t['hours at batch']:.3g} at batch_size "
                  "(decode only, an upper bound; prefill and model loads: slurm/make_joblist.py --cost RUN)")
            return 0
        if args.cost:
            table = cost(composed, args.cost)
            print(table.to_string(index=False, float_format="{:.2f}".format), *table.attrs["fits"], sep="\n")
            print(f"{len(table)} jobs, {table.samples.sum()} samples, {table.hours.sum():.2f} hours on RUN's device; "
                  f"the longest job {60 * table.hours.max():.0f} min (size timeout_min, or split it with --shards / shard.count)")
        text = "".join(shlex.join(job) + "\n" for job, _ in composed)
        if args.output is None:
            sys.stdout.write("" if args.cost else text)
            return 0
        args.output.write_text(text, encoding="utf-8")
    except (SweepSpecError, OSError, ValueError, KeyError, HydraException, OmegaConfBaseException) as error:
        print(f"{name}: {one_line(error, args.overrides) or type(error).__name__}", file=sys.stderr)
        return 2
    print(f"{len(composed)} jobs written to {args.output}; submit with:\n"
          f"  sbatch --array=1-{len(composed)}%{args.parallel} slurm/array.sbatch {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
