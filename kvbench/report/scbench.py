"""SCBench's report (docs/SCBENCH.md): the score of every turn per method (SCBench's per-turn curves), multi-turn
beside multi-request, and the cost per question with and without reusing the compressed context.

Built from the records of the ``task=scbench`` jobs: ``turn`` and ``group`` (shared-context runs; else read from
the sample id ``<dataset>/<row>/<turn>``), ``meta.task`` (the mixed datasets' sub-task), ``prefill_s``,
``compress_s``, ``decode_s`` and ``group_compressions``. A job's mode is its ``task.mode`` (``multi_turn`` with own
answers when ``task.golden_context`` is false).
"""

import json
import math
from pathlib import Path

import pandas as pd

from eval.scbench import CAPABILITIES, turn_of

from kvbench.report.data import FULL, budget_cell, budget_semantics, budget_text, paper_order, samples
from kvbench.report.tables import Artifact, _figure, count, draw_lines

MODES = {"multi_turn": "multi-turn", "own": "multi-turn, own answers", "multi_request": "multi-request"}
RANK = {m: i for i, m in enumerate(MODES.values())} | {c: i for i, c in enumerate(CAPABILITIES)}
CAPABILITY = {d: c for c, ds in CAPABILITIES.items() for d in ds}
STYLE = {"multi-turn": "-", "multi-turn, own answers": ":", "multi-request": "--"}


def mode_of(settings: str) -> str:
    """The mode label of a job from its ``settings`` (JSON of its config keys)."""
    s = json.loads(settings)
    mode = s.get("task.mode", "multi_turn")
    return MODES["own" if mode == "multi_turn" and s.get("task.golden_context") is False else mode]


def scbench_records(df: pd.DataFrame, root: Path) -> pd.DataFrame:
    """A row per scored record of the ``scbench`` jobs of ``df`` (the samples each ``summary.json`` scores): job,
    model, method (label), method_name, budget, mode, complete, dataset (``<dataset> / <sub-task>`` for the mixed
    ones), group, turn (1-based, as SCBench prints it), score (points), the timings (s) and group_compressions."""
    times = ["prefill_s", "compress_s", "decode_s", "group_compressions"]
    r = samples(df[(df["task"] == "scbench") & df["dataset"].notna()], root,
                ["id", "dataset", "error", "score", "meta", "group", "turn", *times], latest=True)
    r = r[r["error"].isna() & r["score"].notna()]
    tasks = [(m or {}).get("task", d) for m, d in zip(r["meta"], r["dataset"])]
    cols = ["job", "model", "method", "method_name", "budget", "mode", "complete", "dataset", "capability", "group",
            "turn", "score", *times]
    out = r.assign(mode=r["settings"].map(mode_of), capability=[CAPABILITY.get(d, "other") for d in r["dataset"]],
                   dataset=[d + f" / {t}" * (t != d) for d, t in zip(r["dataset"], tasks)],
                   group=[g or i.rsplit("/", 1)[0] for g, i in zip(r["group"], r["id"])],
                   turn=[turn_of({"id": i, "turn": t}) + 1 for i, t in zip(r["id"], r["turn"])],
                   score=100 * r["score"].astype(float))[cols]
    out[times] = out[times].apply(pd.to_numeric, errors="coerce")
    # one job per (model, method, budget, mode): the one with the most scored records (others: noted)
    keep = out.groupby(["model", "method", "budget", "mode", "job"]).size().reset_index(name="n").sort_values(
        "n", ascending=False, kind="stable").drop_duplicates(["model", "method", "budget", "mode"])["job"]
    out.attrs["dropped"] = sorted(set(out["job"]) - set(keep))
    return out[out["job"].isin(keep)]


def _heads(frame: pd.DataFrame, cols: str) -> dict:
    """A table's label columns ``cols`` (``model method budget``…), capitalized; the budget as :func:`budget_cell`."""
    return {c.capitalize(): [budget_cell(n, b, "–") for n, b in zip(frame["method_name"], frame["budget"])]
            if c == "budget" else frame[c] for c in cols.split()}


def _notes(rec: pd.DataFrame) -> list[str]:
    late = sorted(set(rec.loc[~rec["complete"], "job"]))
    return ([f"unfinished: {j}; its points are scored on fewer samples" for j in late]
            + [f"not shown: {j} (another job of the same model, method, budget and mode scored more samples)"
               for j in rec.attrs.get("dropped", [])])


def turn_table(rec: pd.DataFrame) -> Artifact:
    """Score per turn (columns) of every model × capability × dataset × method × budget × mode, and Avg: the mean
    over the row's questions (as :func:`mode_table`)."""
    keys = ["model", "capability", "dataset", "method", "method_name", "budget", "mode"]
    piv = rec.pivot_table(index=keys, columns="turn", values="score", aggfunc="mean")
    piv = paper_order(piv.assign(Avg=rec.groupby(keys)["score"].mean()).reset_index(), keys, RANK)
    data = pd.DataFrame({**_heads(piv, "model capability dataset method budget mode"),
                         **{f"Turn {t}": piv[t] for t in sorted(rec["turn"].unique())}, "Avg": piv["Avg"]})
    caption = (f"SCBench by capability: score per turn (points; mean over the groups that reached the turn), "
               f"{budget_semantics(rec['budget'])}; multi-request: per question index. Avg: mean over the row's "
               "questions.")
    return Artifact("scbench_turns", caption, data, sources=sorted(set(rec["job"])), notes=_notes(rec))


def turn_figure(rec: pd.DataFrame) -> Artifact:
    """A panel per SCBench capability (the mean over its datasets) and an average panel: score vs turn, a line per
    method × budget (its colour) × mode (its line style) (:func:`~kvbench.report.tables.draw_lines`)."""
    keys = ["model", "method", "budget", "mode"]
    per = rec.groupby([*keys, "capability", "dataset", "turn"])["score"].mean().reset_index()
    caps = sorted(per["capability"].unique(), key=RANK.get)
    panels = ["Average"] * (len(caps) > 1) + caps
    cols = min(4, len(panels))
    fig, axes = _figure(math.ceil(len(panels) / cols), cols, w=3.6, h=3.0)
    models, full = len(set(rec["model"])) > 1, set(rec.loc[rec["method_name"] == FULL, "method"])
    rows = {k: f"C{i % 10}" for i, k in enumerate(paper_order(rec, ["model", "method", "budget"])[
        ["model", "method", "budget"]].drop_duplicates().itertuples(index=False, name=None))}
    label = lambda model, method, budget, mode: (f"{model}: " * models + f"{method}, " + f"{budget_text(budget)}, " * (
        method not in full) + mode)
    for ax, cap in zip(axes.flat, panels):
        lines = per[per["capability"].isin(caps if cap == "Average" else [cap])].groupby([*keys, "turn"])["score"].mean()
        lines = sorted(lines.groupby(keys), key=lambda kg: (list(rows).index(kg[0][:3]), RANK[kg[0][3]]))
        draw_lines(ax, {label(*k): g.droplevel(keys) for k, g in lines}, show_legend=ax is axes.flat[cols - 1],
                   styles={label(*k): {"color": rows[k[:3]], "linestyle": STYLE[k[3]]} for k, _ in lines})
        ax.set(title=cap, xlabel="Turn", ylabel="Score (points)", ylim=(-3, 103))
        ax.set_xticks(sorted(rec["turn"].unique()))
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    caption = (f"SCBench per-turn scores by capability ({count(rec['dataset'].nunique(), 'dataset')}; a panel: the "
               f"mean over its datasets at each turn; Average: over the capabilities shown); "
               f"{budget_semantics(rec['budget'])}; solid: multi-turn (golden answers), dotted: multi-turn with the "
               "model's own answers, dashed: multi-request (question index); lines drawn side by side.")
    return Artifact("scbench_turns_fig", caption, fig=fig, sources=sorted(set(rec["job"])))


def mode_table(rec: pd.DataFrame) -> Artifact | None:
    """Multi-turn beside multi-request: each dataset's mean over turns, a column per mode, Δ = multi-request minus
    multi-turn (golden). None without two modes."""
    modes = [m for m in MODES.values() if m in set(rec["mode"])]
    if len(modes) < 2:
        return None
    piv = rec.groupby(["model", "method", "method_name", "budget", "capability", "dataset", "mode"])["score"].mean(
    ).unstack("mode").reset_index()
    piv = paper_order(piv, ["model", "method", "budget", "capability", "dataset"], RANK)
    data = pd.DataFrame({**_heads(piv, "model method budget capability dataset"), **{m: piv[m] for m in modes}})
    if {"multi-turn", "multi-request"} <= set(modes):
        data["Δ"] = data["multi-request"] - data["multi-turn"]
    caption = ("SCBench, multi-turn vs multi-request: each dataset's score (points, mean over turns / questions) per "
               f"mode; Δ: multi-request − multi-turn; {budget_semantics(rec['budget'])}.")
    return Artifact("scbench_modes", caption, data, signed={"Δ"}, sources=sorted(set(rec["job"])), notes=_notes(rec))


def cost_table(rec: pd.DataFrame) -> Artifact | None:
    """Seconds per question with the context compressed once per group (as run) and, estimated, compressed for every
    question: each question then pays its group's costliest prefill + compression. None without timings."""
    timed = rec.dropna(subset=["prefill_s", "compress_s", "decode_s"])
    if timed.empty:
        return None
    timed = timed.assign(pc=timed["prefill_s"] + timed["compress_s"])
    g = timed.groupby(["job", "group"]).agg(n=("pc", "size"), pc=("pc", "sum"), worst=("pc", "max"),
                                            dec=("decode_s", "sum"), comp=("group_compressions", "max"))
    t = g.eval("alone = worst * n").groupby("job").agg(n=("n", "sum"), groups=("n", "size"), dec=("dec", "sum"),
                                                       pc=("pc", "sum"), comp=("comp", "mean"), alone=("alone", "sum"))
    t = t.join(timed.drop_duplicates("job").set_index("job")[["model", "method", "method_name", "budget", "mode"]])
    t = paper_order(t, ["model", "method", "budget", "mode"], RANK)
    reuse, alone = (t["pc"] + t["dec"]) / t["n"], (t["alone"] + t["dec"]) / t["n"]
    data = pd.DataFrame({**_heads(t, "model method budget mode"), "Questions": t["n"].map(str),
                         "Contexts": t["groups"].map(str), "Compressions / context": t["comp"],
                         "Prefill+compress s/q (reuse)": t["pc"] / t["n"],
                         "Prefill+compress s/q (each, est.)": t["alone"] / t["n"], "Decode s/q": t["dec"] / t["n"],
                         "Saved (%)": 100 * (1 - reuse / alone)}).reset_index(drop=True)
    caption = ("SCBench, cost per question (s): prefill + compression and decoding as run (the context prefilled and "
               "compressed Compressions / context times; – : a run that records no count, each question alone) and "
               "estimated as if every question prefilled and compressed its context again (each pays its group's "
               "costliest prefill + compression; a lower bound in multi-turn, whose later turns would also carry the "
               "history). Saved: 1 − reuse / each, with decoding.")
    return Artifact("scbench_cost", caption, data, sources=sorted(set(timed["job"])), notes=_notes(rec))


def scbench_artifacts(df: pd.DataFrame, root: Path) -> list[Artifact]:
    """The SCBench artifacts of the results root (none without ``task=scbench`` jobs)."""
    rec = scbench_records(df, root)
    if rec.empty:
        return []
    return [a for a in (turn_table(rec), turn_figure(rec), mode_table(rec), cost_table(rec)) if a is not None]

