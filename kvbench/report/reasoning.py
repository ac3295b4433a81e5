"""Reports of generation-heavy jobs (reasoning, sampled candidates, compression while decoding), a set per task × model
key: ``passk_<task>_<model>`` (pass@1 ± SE over problems, pass@k, answer share, generated length; from the records by
:func:`eval.sampling.summary`), ``cache_trace_<task>_<model>`` (stored cache tokens and bytes against generated tokens,
the records' ``cache_trace``) and ``gen_length_<task>_<model>`` (generated tokens per candidate against the budget)."""

import math

import numpy as np
import pandas as pd

from eval.sampling import by_problem, summary

from kvbench.report.data import FULL, budget_cell, budget_text, paper_order, samples
from kvbench.report.tables import Artifact, _figure, draw_lines, reference, slug

COLUMNS = ["id", "problem", "dataset", "error", "score", "scores", "generated_tokens", "cache_trace", "decode_compressions"]


def passk_table(task: str, mk: str, jobs: list) -> Artifact:
    """pass@1 ± SE, pass@k, answered (%), mean generated tokens, problems and candidates per job (summed datasets:
    a task's datasets are scored apart, the first one shown; reasoning tasks have one)."""
    rows, errs = [], []
    for row, recs in jobs:
        for dataset, s in summary(recs).items():
            rows.append({"Method": row["method"], "Budget": budget_cell(row["method_name"], row["budget"]),
                         "Dataset": dataset, "pass@1": s["pass@1"],
                         **{f"pass@{k}": v for k, v in s["pass@k"].items() if k != "1"},
                         "Answered %": s["answered"], "Gen. tokens": s["generated_tokens"],
                         "Problems": str(s["problems"]), "Candidates": str(s["candidates"])})
            errs.append({"pass@1": s["pass@1_se"]})
    data = pd.DataFrame(rows)
    ks = sorted((c for c in data if c.startswith("pass@")), key=lambda c: int(c[5:]))
    data = data[["Method", "Budget", "Dataset", *ks, "Answered %", "Gen. tokens", "Problems", "Candidates"]]
    caption = (f"{task} on {mk}, a row per job: pass@1 = mean over problems of the share of correct candidates (± SE "
               "over problems), pass@k = Chen et al. (2021)'s unbiased estimator (k up to the fewest candidates of a "
               "problem; empty: fewer), in %; Answered: candidates with a final answer; Gen. tokens: mean per "
               "candidate.")
    return Artifact(f"passk_{slug(task)}_{slug(mk)}", caption, data, se=pd.DataFrame(errs, index=data.index),
                    sources=[r["job"] for r, _ in jobs])


def cache_trace_figure(task: str, mk: str, jobs: list) -> list[Artifact]:
    """Stored tokens (mean over compressible layers of a KV head's tokens) and bytes of the whole cache against
    generated tokens, the longest generation of each job (its ``cache_trace`` points, drawn as steps)."""
    traced = [(row, max((r for r in recs if r["cache_trace"]), key=lambda r: r["cache_trace"][-1][0]))
              for row, recs in jobs if any(r["cache_trace"] for r in recs)]
    if not traced:
        return []
    fig, axes = _figure(1, 2)
    label = lambda row: row["method"] + f" b{budget_text(row['budget'])}" * (row["method_name"] != FULL)
    full = {label(row): {"color": "black", "linestyle": "--"} for row, _ in traced if row["method_name"] == FULL}
    for k, (ax, what) in enumerate(zip(axes[0], ("Stored tokens per KV head", "Stored cache (MiB, all layers)"))):
        traces = [np.array(rec["cache_trace"], dtype=float).T for _, rec in traced]
        draw_lines(ax, {label(row): pd.Series(t[k + 1] / (2**20 if k else 1), t[0]) for (row, _), t in zip(traced, traces)},
                   styles=full, show_legend=k == 1)
        ax.set(xlabel="Generated tokens", ylabel=what, title=f"{mk} — {task}", ylim=(0, None))
    caption = (f"KV cache against generated tokens on {task} ({mk}): each job's longest generation, its cache (tokens "
               "per KV head: mean over the compressible layers) after prefill, just before and after each compression "
               "while decoding, and at the end (records' cache_trace). A full cache grows with the generation; a "
               "compressed one stays within budget + interval.")
    return [Artifact(f"cache_trace_{slug(task)}_{slug(mk)}", caption, fig=fig, sources=[r["job"] for r, _ in traced])]


def gen_length_figure(task: str, mk: str, jobs: list) -> list[Artifact]:
    """Mean generated tokens per candidate (± SE over problems) against the budget, a line per method; the full
    cache dashed (longer chains of thought when compression hurts)."""
    ax, lines, drawn = _figure(1, 1)[1][0, 0], {}, []
    for row, recs in jobs:
        per = [np.mean([r["generated_tokens"] for r in rs]) for ds in by_problem(recs).values() for rs in ds.values()
               if all(isinstance(r["generated_tokens"], (int, float)) for r in rs)]
        if per:
            se = np.std(per, ddof=1) / math.sqrt(len(per)) if len(per) > 1 else 0.0
            lines.setdefault((row["method_name"] == FULL, row["method"]), []).append((row["budget"], np.mean(per), se))
            drawn.append(row["job"])
    if not lines:
        return []
    for (full, label), pts in lines.items():
        if full:
            reference(ax, pts[0][1], pts[0][2], label)
    comp = {label: pd.DataFrame(sorted(pts)).set_index(0) for (full, label), pts in lines.items() if not full}
    ax.set_xscale("log", base=2)
    draw_lines(ax, {label: t[1] for label, t in comp.items()}, {label: t[2].to_numpy() for label, t in comp.items()},
               ticks={b: f"{b:g}" for b in sorted({b for t in comp.values() for b in t.index})})
    ax.set(xlabel="KV budget (tokens per layer per KV head)", ylabel="Generated tokens per candidate",
           title=f"{mk} — {task}")
    caption = (f"Generation length on {task} ({mk}): mean generated tokens per candidate (± SE over problems) by "
               "method and budget; dashed: the full cache.")
    return [Artifact(f"gen_length_{slug(task)}_{slug(mk)}", caption, fig=ax.figure, sources=drawn)]


def reasoning_reports(df: pd.DataFrame, root) -> list[Artifact]:
    """Every task × model key with generation-heavy jobs (whose records are sampled candidates, ``problem``, say if
    they found an answer, ``scores.found``, or compressed while decoding): its pass@k table, cache-trace figure and
    generated-length figure, each from ``[(job row, its scored records), ...]`` in paper order."""
    jobs = paper_order(df[df["dataset"].notna()].drop_duplicates("job"), ["task", "model_key", "method", "budget"])
    recs, groups, out = samples(jobs, root, COLUMNS), {}, []
    for _, row in jobs.iterrows():
        mine = recs.loc[recs["job"] == row["job"], COLUMNS].to_dict("records")
        if any(r["problem"] is not None or "found" in (r["scores"] or {}) or r["decode_compressions"] for r in mine):
            groups.setdefault((row["task"], row["model_key"]), []).append((row, mine))
    for (task, mk), group in groups.items():
        if any(r["problem"] is not None or "found" in (r["scores"] or {}) for _, rs in group for r in rs):
            out.append(passk_table(task, mk, group))
        out += cache_trace_figure(task, mk, group) + gen_length_figure(task, mk, group)
    return out
