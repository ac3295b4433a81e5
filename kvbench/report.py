"""``kvbench report RESULTS_ROOT [--out DIR] [--only NAME...] [--latency FILE]`` (docs/REPORTS.md).

Reads the store into one tidy frame (:func:`kvbench.report_data.load_results`) and writes a score
table per task × model key (``scores_<task>_<model>``, any sweep) and each of the seed papers'
tables and figures whose inputs exist: tables as ``.md``, ``.tex`` (pandas ``to_latex``) and
``.csv``, figures as ``.png`` and ``.pdf``, each with ``<name>.sources.txt`` (the job folders
used and notes on absent inputs), plus ``index.md``. A missing cell is ``–`` / ``--`` / empty,
never zero; an average over a row missing a dataset is missing too.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.patches import Patch

from .cli import ArgParser
from .plots import SCORE_LABEL, draw_niah_heatmap, plt
from .report_data import (DATASET_ABBR, FULL, LONG_CONTEXT_TOKENS, LONGBENCH_CATEGORIES, budget_semantics,
                          budget_text, display_name, load_results, method_sort_key, model_sort_key, niah_grid,
                          niah_grid_records, order_datasets)

__all__ = ["ARTIFACTS", "Artifact", "Context", "build", "load_latency", "load_results", "main", "write"]


@dataclass
class Artifact:
    """A table (``data``: label columns as text, values as floats, NaN = missing) or a figure (``fig``)."""

    name: str
    caption: str
    data: pd.DataFrame | None = None
    fig: object = None
    bold: set = field(default_factory=set)  # (row position, column) cells printed in bold
    headers: dict = field(default_factory=dict)  # column -> display name (Markdown, LaTeX)
    signed: set = field(default_factory=set)  # columns printed with a sign (Δ)
    sources: list = field(default_factory=list)
    notes: list = field(default_factory=list)


@dataclass
class Context:
    root: Path
    df: pd.DataFrame
    latency: list | None = None
    latency_source: str = "latency.json"


def round2(x: float) -> float:
    """Half-up to 2 decimals, the papers' printing (2.625 -> 2.63)."""
    return math.floor(round(x * 100, 6) + 0.5) / 100


def fmt(value, signed: bool = False) -> str | None:
    """A cell as printed; None when missing."""
    if value is None or isinstance(value, str):
        return value
    if math.isnan(value):
        return None
    return ("+" if signed and round2(value) > 0 else "") + f"{round2(value):.2f}"


def best(rows: list[dict], idx: list[int], col: str, higher: bool = True) -> set:
    """Cells of ``col`` among rows ``idx`` holding the best printed value (ties all bold)."""
    vals = {i: round2(rows[i][col]) for i in idx if not math.isnan(rows[i][col])}
    top = (max if higher else min)(vals.values(), default=None)
    return {(i, col) for i, v in vals.items() if v == top}


def _dedupe(items) -> list:
    return list(dict.fromkeys(items))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def _same(series: pd.Series, budget: float) -> pd.Series:
    return (series - budget).abs() < 1e-9


# ---------------------------------------------------------------- picking one score per cell

def pick(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One score per ``keys`` × dataset: the preferred job's (finished, most datasets, most samples,
    then path); the other jobs of a key fill only the datasets it lacks."""
    scored = rows[rows["score"].notna()]
    stats = scored.groupby("job").agg(done=("complete", "max"), nds=("score", "size"), n=("n", "sum"))
    stats = stats.reindex(rows["job"].unique(), fill_value=0).sort_index()
    order = stats.sort_values(["done", "nds", "n"], ascending=False, kind="stable").index
    rank = {job: i for i, job in enumerate(order)}
    return scored.assign(_r=scored["job"].map(rank)).sort_values("_r").drop_duplicates(keys + ["dataset"])


def _cell_notes(rows: pd.DataFrame, used: pd.DataFrame, what: str) -> list[str]:
    """Incomplete, subset and left-out notes of the jobs of one cell or row."""
    n = rows.groupby("job")["n"].sum()
    jobs, done = set(used["job"]), dict(zip(rows["job"], rows["complete"]))
    notes = [f"incomplete: {j} ({n[j]:.0f} samples scored; the job has not finished or some samples failed: rerun it)"
             for j in sorted(jobs) if not done[j]]
    notes += [f"subset: {j} scored part of each dataset only ({s}); not comparable to whole-dataset scores"
              for j, s in sorted(set(zip(used["job"], used["subset"]))) if s]
    left = [f"{j} ({n[j]:.0f} samples{'' if done[j] else ', unfinished'})" for j in _dedupe(rows["job"]) if j not in jobs]
    if left:
        notes.append(f"left out: {what}: {', '.join(left)}; the scores are those of {', '.join(sorted(jobs))} "
                     "(preferred: complete, most datasets, most samples)")
    return notes


def _default_variant(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of each (model key, label) cell's default variant (the preset's fields) when it has one."""
    return rows[rows["default"] | ~rows.groupby(["model_key", "method"])["default"].transform("max")]


@dataclass
class Grid:
    """Scores of one task at one budget: ``scores`` indexed by (model key, label), one column per dataset."""

    scores: pd.DataFrame
    full: str | None
    labels: list[str]
    models: list[str]
    datasets: list[str]
    incomplete: set
    sources: list
    notes: list
    names: dict = field(default_factory=dict)  # label -> registry method name

    def score(self, mk: str, label: str, ds: str) -> float:
        return self.scores.at[(mk, label), ds] if (mk, label) in self.scores.index else math.nan

    def avg(self, mk: str, label: str | None, datasets: list[str] | None = None) -> float:
        """Mean over ``datasets`` (default: all of the grid's); NaN when one is missing."""
        vals = [self.score(mk, label, d) for d in (datasets or self.datasets)]
        return math.nan if not vals or any(map(math.isnan, vals)) else sum(vals) / len(vals)

    def rows(self) -> list[str]:
        return ([self.full] if self.full else []) + self.labels


def grid(df: pd.DataFrame, task: str, budget: float, models=None, names=None, labels=None) -> Grid | None:
    """Cells of one task at one budget; the full cache (which ignores the budget) at any budget.
    Without ``labels``, each method's main label: its ``conf/method/<name>.yaml`` preset's, else its
    shortest (a stand-in, noted). None when no compressed job matches."""
    comp = df[(df["task"] == task) & (df["method_name"] != FULL) & _same(df["budget"], budget)]
    comp = comp[comp["model_key"].isin(models)] if models is not None else comp
    comp = comp[comp["method_name"].isin(names)] if names is not None else comp
    where, notes = f"{task}, budget {budget_text(budget)}", []
    if labels is None:
        labels = []
        for name, g in comp.groupby("method_name"):
            own = display_name(name)
            labels.append(own if own in set(g["method"]) else min(g["method"].unique(), key=lambda s: (len(s), s)))
            if labels[-1] != own:
                notes.append(f"stand-in: the {name} row is {labels[-1]}: {name}'s main preset ({own}) has no job "
                             f"({where})")
    comp = comp[comp["method"].isin(labels)]
    if comp.empty:
        return None
    order = sorted(set(zip(comp["method_name"], comp["method"])), key=lambda p: method_sort_key(*p))
    models = sorted(comp["model_key"].unique(), key=model_sort_key)
    full = df[(df["task"] == task) & (df["method_name"] == FULL) & df["model_key"].isin(models)]
    full_label = full["method"].mode().iloc[0] if len(full) else None
    rows = _default_variant(pd.concat([full.assign(method=full_label), comp]))
    used = pick(rows, ["model_key", "method"])
    for (mk, lab), cell in rows.groupby(["model_key", "method"]):
        notes += _cell_notes(cell, used[(used["model_key"] == mk) & (used["method"] == lab)], f"{mk} / {lab} ({where})")
    scores = used.pivot_table(index=["model_key", "method"], columns="dataset", values="score", aggfunc="first")
    datasets = order_datasets(scores.columns)
    for mk in models:
        notes += [f"absent: no full-cache job for {mk} ({task})"] if full_label is None or (mk, full_label) \
            not in scores.index else []
        for lab in [lab for _n, lab in order]:
            notes += [f"absent: no job for {mk} / {lab} ({where})"] if (mk, lab) not in scores.index else []
    for (mk, lab), cell in scores.iterrows():
        if cell[datasets].isna().any():
            notes.append(f"absent: {mk} / {lab} has no score for {', '.join(cell[datasets][cell.isna()].index)} ({where})")
    return Grid(scores, full_label if len(full) else None, _dedupe(lab for _n, lab in order), models, datasets,
                set(zip(used.loc[~used["complete"], "model_key"], used.loc[~used["complete"], "method"])),
                sorted(set(used["job"])), _dedupe(notes), {lab: n for n, lab in order})


def _unfinished(*grids: Grid) -> str:
    return " (rows of unfinished jobs excluded)" if any(g.incomplete for g in grids) else ""


def _ds(n: int) -> str:
    return f"{n} dataset" + "s" * (n != 1)


# ---------------------------------------------------------------- tables

def score_tables(df: pd.DataFrame, root: Path | None = None) -> list[Artifact]:
    """One table per task × model key of every job configuration (method label, variant, budget):
    per-dataset scores, Avg and n (scored samples). The full cache is one row without budget. Bold:
    best complete compressed row per column (not full, not 100 %, not a budget that kept every
    prompt whole or that the method raised above its label)."""
    out, names = [], set()
    scored = df[df["score"].notna()]
    for task, mk in sorted(set(zip(scored["task"], scored["model_key"])), key=lambda p: (p[0], model_sort_key(p[1]))):
        sel = df[(df["task"] == task) & (df["model_key"] == mk)]
        sel = sel.assign(bkey=sel["budget"].where(sel["method_name"] != FULL, -1.0).fillna(-1.0))
        used = pick(sel, ["method", "variant", "bkey"])
        datasets = order_datasets(used["dataset"])
        keys = sorted(set(zip(sel["method_name"], sel["method"], sel["variant"], sel["bkey"], ~sel["default"])),
                      key=lambda k: (method_sort_key(k[0], k[1]), k[3], k[4], k[2]))
        show_variant = any(k[2] for k in keys)
        rows, notes, comp, kinds = [], [], [], []
        for name, label, variant, b, _nd in keys:
            part = sel[(sel["method"] == label) & (sel["variant"] == variant) & (sel["bkey"] == b)]
            mine = used[(used["method"] == label) & (used["variant"] == variant) & (used["bkey"] == b)]
            btext = "–" if b < 0 else budget_text(b)
            what = f"{label}{f' ({variant})' if variant else ''}" + (f" at budget {btext}" if b >= 0 else "")
            vals = dict(zip(mine["dataset"], mine["score"]))
            rows.append({"Method": label, **({"Variant": variant} if show_variant else {}), "Budget": btext,
                         **{d: vals.get(d, math.nan) for d in datasets},
                         "Avg": sum(vals[d] for d in datasets) / len(datasets) if set(datasets) <= set(vals) else math.nan,
                         "n": f"{mine['n'].sum():.0f}" if len(mine) else None})
            notes += [f"absent: {what} has no score for {', '.join(d for d in datasets if d not in vals)}"] \
                if not set(datasets) <= set(vals) else []
            notes += _cell_notes(part, mine, what)
            kinds.append(" / ".join(sorted(set(mine["subset"]))))
            kept_all = (part["compressed_fraction"] == 0).all()
            ratio = (part["kept_tokens"] / part["prompt_tokens"]).mean()
            raised = 0 < b < 1 and ratio > max(1.5 * b, b + 0.02)
            if name != FULL and b != 1.0 and kept_all:
                notes.append(f"uncompressed: {label} at budget {btext} kept every prompt whole (the budget is not "
                             "below the prompt lengths or the tokens the method always keeps); not bold")
            if raised:
                notes.append(f"raised: {label} at budget {btext} kept {100 * ratio:.1f} % of the prompt tokens on "
                             "average (the method always keeps its window, sinks or recent tokens); not bold")
            if name != FULL and b != 1.0 and not kept_all and not raised and mine["complete"].all():
                comp.append(len(rows) - 1)
        if task == "niah" and root is not None:
            grids = {j: str(niah_grid(Path(root) / j)) for j in sorted(set(used["job"]))}
            if len(set(grids.values()) - {"None"}) > 1:
                notes.append("different NIAH grids, scores not comparable across them: " + "; ".join(
                    f"{j}: {g}" for j, g in grids.items()))
        if len(set(kinds)) > 1:
            notes.append("mixed samples: rows scored on different sample sets (" + "; ".join(
                sorted({k or "whole datasets" for k in kinds})) + "), scores not comparable across them")
            main = max(sorted({kinds[i] for i in comp}), key=[kinds[i] for i in comp].count, default="")
            comp = [i for i in comp if kinds[i] == main]
        budgets = [k[3] for k in keys if k[3] >= 0]
        caption = (f"Scores of every job configuration of {mk} on {task} ({_ds(len(datasets))}; one row per method"
                   + (", method variant" if show_variant else "") + " and budget"
                   + (f"; {budget_semantics(budgets)}" if budgets else "") + "). Each dataset's score is "
                   "round(100·mean, 2) of the per-sample scores in [0, 1]; Avg: mean over the table's datasets, "
                   "missing when a row lacks one; n: scored samples. The full cache ignores the budget (–). Best "
                   "complete compressed configuration per column in bold.")
        name = base = f"scores_{_slug(task)}_{_slug(mk)}"
        while name in names:
            name += "_2"
        names.add(name)
        cols = ["Method", *(["Variant"] if show_variant else []), "Budget", *datasets, "Avg", "n"]
        out.append(Artifact(name, caption, pd.DataFrame(rows, columns=cols),
                            bold=set().union(*(best(rows, comp, c) for c in [*datasets, "Avg"])),
                            headers={d: DATASET_ABBR.get(d, d) for d in datasets}, sources=sorted(set(used["job"])),
                            notes=_dedupe(notes)))
    return out


def selkv_table1(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Artifact]:
    """SelKV Table 1: per model, full cache + main methods × datasets, Avg, Δ (Avg − full-cache Avg)
    and Avg Rank: mean over datasets of the dense rank among compressed methods (ties share the
    better rank, 1, 1, 2: reproduces the paper's column); NaN when a method lacks a dataset."""
    g = grid(df, task, budget)
    if g is None:
        return []
    rows, bold = [], set()
    for mk in g.models:
        ranks = pd.DataFrame({lab: [g.score(mk, lab, d) for d in g.datasets] for lab in g.labels})
        ranks = ranks.rank(axis=1, method="dense", ascending=False).mean(skipna=False)
        start = len(rows)
        for lab in g.rows():
            is_full = lab == g.full
            rows.append({"Model": mk, "Method": lab, **{d: g.score(mk, lab, d) for d in g.datasets},
                         "Avg": g.avg(mk, lab), "Δ": math.nan if is_full else g.avg(mk, lab) - g.avg(mk, g.full),
                         "Avg Rank": math.nan if is_full else ranks[lab]})
        comp = [i for i in range(start, len(rows)) if rows[i]["Method"] != g.full and (mk, rows[i]["Method"])
                not in g.incomplete]
        bold |= set().union(*(best(rows, comp, c) for c in [*g.datasets, "Avg", "Δ"]), best(rows, comp, "Avg Rank",
                                                                                           False))
    caption = (f"LongBench results ({_ds(len(g.datasets))}) at a {budget_text(budget)} KV budget "
               f"({budget_semantics([budget])}). Δ: gap to {g.full or 'the full cache'} within each model. Avg Rank: "
               "mean over datasets of the per-dataset rank among compressed methods (lower is better; ties share the "
               f"better rank). Best compressed method per column in bold{_unfinished(g)}. Models: {', '.join(g.models)}.")
    return [Artifact("selkv_table1", caption, pd.DataFrame(rows), bold=bold, signed={"Δ"}, sources=g.sources,
                     notes=g.notes, headers={d: DATASET_ABBR.get(d, d) for d in g.datasets})]


def selkv_table4(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Artifact]:
    """SelKV Table 4: mean of each LongBench category's datasets present, per model × method."""
    g = grid(df, task, budget)
    if g is None:
        return []
    cats = {c: [d for d in g.datasets if d in m] for c, m in LONGBENCH_CATEGORIES.items()}
    cats["Other"] = [d for d in g.datasets if not any(d in m for m in LONGBENCH_CATEGORIES.values())]
    rows, bold = [], set()
    for mk in g.models:
        for cat, ds in cats.items():
            if ds:
                rows.append({"Model": mk, "Category": cat, **{lab: g.avg(mk, lab, ds) for lab in g.rows()}})
                vals = {lab: round2(rows[-1][lab]) for lab in g.labels
                        if not math.isnan(rows[-1][lab]) and (mk, lab) not in g.incomplete}
                bold |= {(len(rows) - 1, lab) for lab, v in vals.items() if v == max(vals.values())}
    partial = [f"partial category: {c} averages {len(ds)} of its {len(LONGBENCH_CATEGORIES[c])} datasets "
               f"({', '.join(ds)}); not comparable to the paper's category score"
               for c, ds in cats.items() if c != "Other" and 0 < len(ds) < len(LONGBENCH_CATEGORIES[c])]
    caption = (f"Category-level averages on LongBench ({budget_text(budget)} KV budget; {budget_semantics([budget])}). "
               f"Best compressed method per category in bold{_unfinished(g)}. Models: {', '.join(g.models)}.")
    return [Artifact("selkv_table4", caption, pd.DataFrame(rows, columns=["Model", "Category", *g.rows()]), bold=bold,
                     sources=g.sources, notes=g.notes + partial)]


def budget_grids(df: pd.DataFrame, task: str, ratio: bool) -> dict[float, Grid]:
    """One grid per ratio (budget <= 1) or token budget among the task's compressed jobs."""
    b = df.loc[(df["task"] == task) & (df["method_name"] != FULL), "budget"].dropna()
    grids = {float(x): grid(df, task, float(x)) for x in sorted(b[(b <= 1) == ratio].unique())}
    return {x: g for x, g in grids.items() if g is not None}


def sweep(grids: dict[float, Grid], mk: str, dataset: str | None = None) -> pd.DataFrame:
    """One model's average (or one dataset's score) per label × budget; the full cache's first value
    under every budget. Datasets: the union over budgets."""
    present = {b: g for b, g in grids.items() if mk in g.models}
    ds = [dataset] if dataset else order_datasets(d for g in present.values() for d in g.datasets)
    full = next((g.full for g in present.values() if g.full), None)
    names = {lab: n for g in present.values() for lab, n in g.names.items()}
    labels = sorted({lab for g in present.values() for lab in g.labels}, key=lambda lab: method_sort_key(names[lab], lab))
    table = pd.DataFrame({b: {lab: g.avg(mk, lab, ds) for lab in ([full] if full else []) + labels}
                          for b, g in present.items()})
    if full and table.loc[full].notna().any():
        table.loc[full] = table.loc[full].dropna().iloc[0]
    return table


def _merged(grids: list[Grid], models: list[str]) -> tuple[list, list]:
    """Sources and notes of several grids, for ``models`` only."""
    src = sorted({j for g in grids for j in g.sources})
    return src, _dedupe(n for g in grids for n in g.notes if any(m in n for m in models))


def selkv_ratio_tables(df: pd.DataFrame, task: str = "longbench") -> list[Artifact]:
    """SelKV Tables 5 (llama31) and 6 (gemma2), else ``selkv_ratios_<model>``: LongBench average per
    method at each retention ratio, for models with at least two ratios."""
    grids, out, names = budget_grids(df, task, ratio=True), [], set()
    for mk in sorted({m for g in grids.values() for m in g.models}, key=model_sort_key):
        t = sweep(grids, mk)
        if t.shape[1] < 2:
            continue
        t.columns = [budget_text(b) for b in t.columns]
        rows = [{"Method": lab, **t.loc[lab].to_dict()} for lab in t.index]
        full = next((g.full for g in grids.values() if g.full), None)
        comp = [i for i, r in enumerate(rows) if r["Method"] != full]
        name = {"llama31": "selkv_table5", "gemma2": "selkv_table6"}.get(mk.split(" ")[0], "")
        name = name if name and name not in names else f"selkv_ratios_{_slug(mk)}"
        names.add(name)
        sources, notes = _merged([g for g in grids.values() if mk in g.models], [mk])
        notes += [f"absent: {mk} / {r['Method']} at ratio {c} (no job, or a dataset missing)"
                  for r in rows for c in t.columns if math.isnan(r[c])]
        caption = (f"LongBench average ({_ds(len(order_datasets(d for g in grids.values() for d in g.datasets)))}) of "
                   f"{mk} at different KV retention ratios ({budget_semantics(grids)}). The full cache does not depend "
                   "on the ratio. Best compressed method per ratio in bold.")
        out.append(Artifact(name, caption, pd.DataFrame(rows, columns=["Method", *t.columns]),
                            bold=set().union(*(best(rows, comp, c) for c in t.columns)), sources=sources,
                            notes=_dedupe(notes)))
    return out


def selkv_table7(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Artifact]:
    """SelKV Table 7: LongBench average and Δ of settings truncating prompts at >= 16,000 tokens."""
    long_keys = list(df.loc[df["max_input_tokens"] >= LONG_CONTEXT_TOKENS, "model_key"].unique())
    g = grid(df, task, budget, models=long_keys) if long_keys else None
    if g is None:
        return []
    rows, bold = [], set()
    for mk in g.models:
        start = len(rows)
        rows += [{"Model": mk, "Method": lab, "Avg": g.avg(mk, lab),
                  "Δ": math.nan if lab == g.full else g.avg(mk, lab) - g.avg(mk, g.full)} for lab in g.rows()]
        bold |= best(rows, [i for i in range(start, len(rows)) if rows[i]["Method"] != g.full
                            and (mk, rows[i]["Method"]) not in g.incomplete], "Avg")
    ctx = sorted({int(t) for t in df.loc[df["model_key"].isin(g.models), "max_input_tokens"].dropna()})
    caption = (f"LongBench average ({_ds(len(g.datasets))}) with long inputs ({', '.join(map(str, ctx))} tokens), "
               f"{budget_text(budget)} KV budget ({budget_semantics([budget])}). Models: {', '.join(g.models)}.")
    return [Artifact("selkv_table7", caption, pd.DataFrame(rows), bold=bold, signed={"Δ"}, sources=g.sources,
                     notes=g.notes, headers={"Avg": f"Avg ({len(g.datasets)} ds)"})]


def compresskv_table1(df: pd.DataFrame, budgets=(256, 1024), task: str = "longbench") -> list[Artifact]:
    """CompressKV Table 1: LongBench average per method × (model, token budget); full cache repeated."""
    grids = {float(b): g for b in budgets if (g := grid(df, task, float(b))) is not None}
    if not grids:
        return []
    models = sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
    parts = [sweep(grids, mk).rename(columns=lambda b, mk=mk: f"{mk} @{b:g}") for mk in models]
    t = pd.concat(parts, axis=1)
    full = next((g.full for g in grids.values() if g.full), None)
    names = {lab: n for g in grids.values() for lab, n in g.names.items()}
    t = t.loc[sorted(t.index, key=lambda lab: (lab != full, method_sort_key(names.get(lab, ""), lab)))]
    rows = [{"Method": lab, **t.loc[lab].to_dict()} for lab in t.index]
    bold = set()
    for col in t.columns:
        mk, b = col.rsplit(" @", 1)
        g = grids[float(b)]
        bold |= best(rows, [i for i, r in enumerate(rows) if r["Method"] != full and (mk, r["Method"])
                            not in g.incomplete], col)
    sources, notes = _merged(list(grids.values()), models)
    notes += [f"{'absent'}: {c.split(' @')[0]} / {r['Method']} at budget {c.split(' @')[1]} (no job, or a dataset "
              "missing)" for r in rows for c in t.columns if math.isnan(r[c])]
    caption = (f"Average LongBench scores under fixed KV budgets ({budget_semantics(grids)}). {full or 'The full cache'} "
               f"is uncompressed and does not depend on the budget. Best compressed method per column in bold"
               f"{_unfinished(*grids.values())}. Models: {', '.join(models)}.")
    return [Artifact("compresskv_table1", caption, pd.DataFrame(rows, columns=["Method", *t.columns]), bold=bold,
                     sources=sources, notes=_dedupe(notes))]


def ablation_flags(params: dict) -> dict:
    """Gate / Comp / Merge switches of a SelKV config (None when it does not say): ``gate`` soft | none
    (merge all) | off (eviction only); ``compensation`` off or not."""
    on = lambda v: None if v is None else str(v).lower() not in ("", "none", "off", "false", "0")  # noqa: E731
    gate = params.get("gate")
    return {"Gate": on(gate), "Comp": on(params.get("compensation")),
            "Merge": params.get("merge", None if gate is None else str(gate).lower() != "off")}


def selkv_table2(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench", method: str = "selkv"):
    """SelKV Table 2: staged ablation rows ordered by (merge, gate, comp); Δ prev: gain over the row
    above; Δ full: gap to the full cache. Labels with identical fields are one row (the longer kept)."""
    sel = df[(df["task"] == task) & (df["method_name"] == method) & _same(df["budget"], budget)]
    rows, bold, sources, notes = [], set(), set(), []
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        mine = sel[sel["model_key"] == mk]
        by_params = {p: lab for lab, p in sorted(zip(mine["method"], mine["params"]), key=lambda x: len(x[0]))}
        if len(mine["method"].unique()) < 2:
            continue
        g = grid(df, task, budget, models=[mk], names=[method], labels=list(by_params.values()))
        configs = sorted(((ablation_flags(json.loads(p)), lab) for p, lab in by_params.items()),
                         key=lambda c: ([-1 if c[0][k] is None else int(c[0][k]) for k in ("Merge", "Gate", "Comp")], c[1]))
        if g.full:
            rows.append({"Model": mk, "Configuration": g.full, "Gate": "–", "Comp": "–", "Merge": "–",
                         "Avg": g.avg(mk, g.full), "Δ prev": math.nan, "Δ full": math.nan})
        start, prev = len(rows), math.nan
        for flags, lab in configs:
            avg = g.avg(mk, lab)
            rows.append({"Model": mk, "Configuration": lab, **{k: "?" if v is None else "✓" if v else "–"
                                                                for k, v in flags.items()},
                         "Avg": avg, "Δ prev": avg - prev, "Δ full": avg - g.avg(mk, g.full)})
            prev = avg
        bold |= best(rows, list(range(start, len(rows))), "Avg")
        sources |= set(g.sources)
        notes += g.notes
    if not rows:
        return []
    caption = (f"Ablation of {display_name(method)} on LongBench ({budget_text(budget)} KV budget; "
               f"{budget_semantics([budget])}). Δ prev: change from the row above; Δ full: gap to the full cache. "
               "'Evict only' drops evicted tokens; 'merge all' merges without gate or compensation.")
    return [Artifact("selkv_table2", caption, pd.DataFrame(rows), bold=bold, signed={"Δ prev", "Δ full"},
                     sources=sorted(sources), notes=_dedupe(notes))]


def sensitivity_table(df, name: str, method: str, budget: float, task: str = "longbench", per_dataset=True):
    """One row per variant (method fields that differ) of a method's main label at one budget
    (SelKV Table 3: W × K; CompressKV Table 3b); Δ default: gap to the preset's own fields (✓)."""
    sel = df[(df["task"] == task) & (df["method_name"] == method) & _same(df["budget"], budget)
             & (df["method"] == display_name(method))]
    used = pick(sel, ["model_key", "variant"])
    rows, bold = [], set()
    datasets = order_datasets(used["dataset"])
    params = {p: json.loads(p) for p in sel["params"].unique()}
    keys = sorted({k for p in params.values() for k in p if len({json.dumps(q.get(k)) for q in params.values()}) > 1})
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        mine = used[used["model_key"] == mk]
        if mine["variant"].nunique() < 2:
            continue
        start, ref = len(rows), math.nan
        sortable = lambda v: (0, float(v), "") if isinstance(v, (int, float)) else (1, 0.0, str(v))  # noqa: E731
        for (p, dflt), v in sorted(mine.groupby(["params", "default"]), key=lambda x: [
                sortable(params[x[0][0]].get(k)) for k in keys]):
            vals = dict(zip(v["dataset"], v["score"]))
            avg = sum(vals[d] for d in datasets) / len(datasets) if set(datasets) <= set(vals) else math.nan
            rows.append({"Model": mk, **{k: str(params[p].get(k, "–")) for k in keys}, "Default": "✓" if dflt else "",
                         **({d: vals.get(d, math.nan) for d in datasets} if per_dataset else {}), "Avg": avg})
            ref = avg if dflt else ref
        for r in rows[start:]:
            r["Δ default"] = r["Avg"] - ref
        for col in [*datasets] * per_dataset + ["Avg"]:
            bold |= best(rows, list(range(start, len(rows))), col)
    if not rows:
        return []
    caption = (f"Sensitivity of {display_name(method)} to {', '.join({'window_size': 'W', 'kernel_size': 'K'}.get(k, k) for k in keys)} "
               f"on LongBench ({_ds(len(datasets))}, {budget_text(budget)} KV budget; {budget_semantics([budget])}). "
               "Δ default: gap to the default configuration (✓).")
    return [Artifact(name, caption, pd.DataFrame(rows), bold=bold, signed={"Δ default"}, sources=sorted(set(
        used["job"])), headers={"window_size": "W", "kernel_size": "K", **{d: DATASET_ABBR.get(d, d) for d in datasets}},
        notes=[f"absent: {r['Model']} variant {', '.join(f'{k}={r[k]}' for k in keys)} lacks a dataset"
               for r in rows if math.isnan(r["Avg"])])]


def compresskv_table3a(df: pd.DataFrame, budget: float = 256, task: str = "longbench") -> list[Artifact]:
    """CompressKV Table 3a: SnapKV, the CompressKV ablation labels, then CompressKV; Δ prev: gain over the row above."""
    sel = df[(df["task"] == task) & _same(df["budget"], budget)]
    rows, sources, notes = [], set(), []
    main = display_name("compresskv")
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        ck = set(sel.loc[(sel["model_key"] == mk) & (sel["method_name"] == "compresskv"), "method"])
        if len(ck) < 2 or main not in ck:
            continue
        snap = display_name("snapkv")
        order = [snap] * (snap in set(sel.loc[sel["model_key"] == mk, "method"])) + sorted(ck - {main}) + [main]
        g = grid(df, task, budget, models=[mk], names=["snapkv", "compresskv"], labels=order)
        prev = math.nan
        for lab in order:
            rows.append({"Model": mk, "Method": lab, "Avg": g.avg(mk, lab), "Δ prev": g.avg(mk, lab) - prev})
            prev = g.avg(mk, lab)
        sources |= set(g.sources)
        notes += g.notes
    caption = (f"Component analysis of CompressKV on LongBench at budget {budget:g} ({budget_semantics([budget])}). "
               "Δ prev: change from the row above.")
    return [Artifact("compresskv_table3a", caption, pd.DataFrame(rows), signed={"Δ prev"}, sources=sorted(sources),
                     notes=_dedupe(notes))] if rows else []


# ---------------------------------------------------------------- figures

def _figure(n_rows: int, n_cols: int, w: float = 4.2, h: float = 3.2):
    height = h * n_rows + 0.6
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(w * n_cols, height), squeeze=False, layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0.45 / height, 1, 1 - 0.45 / height))
    return fig, axes


def _done(name, fig, caption, sources, notes) -> Artifact:
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    return Artifact(name, caption, fig=fig, sources=sorted(set(sources)), notes=_dedupe(notes))


def selkv_fig2(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Artifact]:
    """SelKV Figure 2: Δ of each compressed method's LongBench average to the full cache, bars per
    model; an unfinished job's bar hatched and pale."""
    g = grid(df, task, budget)
    if g is None or g.full is None:
        return []
    fig, axes = _figure(1, 1, w=max(4.5, 1.6 * len(g.models) + 2))
    ax, width, unfinished = axes[0, 0], 0.8 / len(g.labels), False
    for j, lab in enumerate(g.labels):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(g.models))]
        ys = [g.avg(mk, lab) - g.avg(mk, g.full) for mk in g.models]
        for x, y, mk, bar in zip(xs, ys, g.models, ax.bar(xs, ys, width, label=lab)):
            if math.isnan(y):
                ax.annotate("n/a", (x, 0), xytext=(0, -3), textcoords="offset points", ha="center", va="top",
                            fontsize=6, rotation=90, color="grey")
            elif {(mk, lab), (mk, g.full)} & g.incomplete:
                bar.set_hatch("///")
                bar.set_alpha(0.5)
                unfinished = True
    ax.axhline(0, color="black", linewidth=0.8)
    ax.margins(y=0.15)
    ax.set_xticks(range(len(g.models)), g.models)
    ax.set(xlabel="Model", ylabel=f"Δ LongBench average vs {g.full} (points)")
    ax.set_title("Gap to the full cache\n(closer to 0 is better)", fontsize=10)
    ax.legend(fontsize=7)
    caption = (f"Task: LongBench ({_ds(len(g.datasets))}); models: {', '.join(g.models)}; {budget_semantics([budget])}, "
               f"ρ = {budget_text(budget)}." + " Hatched, pale bars: an unfinished job (fewer samples scored)." * unfinished)
    return [_done("selkv_fig2", fig, caption, g.sources, g.notes)]


def _sweep_axes(ax, grids: dict[float, Grid], mk: str, dataset: str | None, ratio: bool) -> list[str]:
    """Lines of one model's average (or one dataset's score) across budgets; full cache dashed."""
    t = sweep(grids, mk, dataset)
    full = next((g.full for g in grids.values() if g.full), None)
    notes = []
    for lab, vals in t.iterrows():
        if lab == full:
            ax.axhline(vals.iloc[0], color="black", linestyle="--", linewidth=1, label=lab)
            continue
        notes += [f"absent: {mk} / {lab} at budget {budget_text(b)}" + f" ({dataset})" * bool(dataset)
                  for b in vals.index[vals.isna()]]
        ax.plot([b * 100 if ratio else b for b in vals.dropna().index], vals.dropna(), marker="o", label=lab)
    if ratio:
        ax.set_xlabel("KV retention ratio ρ (% of prompt tokens)")
    else:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(t.columns), [f"{b:g}" for b in t.columns])
        ax.minorticks_off()
        ax.set_xlabel("KV budget (tokens per layer per KV head)")
    ax.set_ylabel("Score (points)" if dataset else "Average score (points)")
    ax.set_title(mk + f" — {dataset}" * bool(dataset), fontsize=9)
    ax.legend(fontsize=7)
    return notes


def budget_sweep_figure(df, name: str, task: str, ratio: bool, title: str, per_dataset: bool = False):
    """Average vs budget, one panel per model with >= 2 budgets (SelKV Fig. 4, CompressKV Figs. 4, 5);
    ``per_dataset``: one row per model, one panel per dataset (Qasper, MuSiQue when present; SelKV Fig. 5)."""
    grids = budget_grids(df, task, ratio)
    models = [m for m in sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
              if sum(m in g.models for g in grids.values()) >= 2]
    if not models:
        return []
    present = order_datasets(d for g in grids.values() for d in g.datasets)
    datasets = ([d for d in ("qasper", "musique") if d in present] or present[:4]) if per_dataset else [None]
    fig, axes = _figure(len(models) if per_dataset else 1, len(datasets) if per_dataset else len(models))
    sources, notes = _merged(list(grids.values()), models)
    for i, mk in enumerate(models):
        for j, ds in enumerate(datasets):
            notes += _sweep_axes(axes[i, j] if per_dataset else axes[0, i], grids, mk, ds, ratio)
    if title:
        fig.suptitle(title, fontsize=10)
    what = f"per dataset ({', '.join(datasets)})" if per_dataset else _ds(len(present))
    caption = (f"Task: {({'longbench': 'LongBench', 'niah': 'Needle-in-a-Haystack'}).get(task, task)} ({what}); "
               f"models: {', '.join(models)}; {budget_semantics(grids)}; dashed line: full cache.")
    return [_done(name, fig, caption, sources, notes)]


def contention_notes(latency: list[dict]) -> list[str]:
    """A note when CPU records ran with a 1-minute load average above their cores (inflated times)."""
    cpu = [r for r in latency if not str(r.get("device", "cpu")).startswith("cuda")
           and isinstance(r.get("load_1min"), (int, float)) and isinstance(r.get("cpu_cores"), int)]
    busy = [r for r in cpu if r["load_1min"] > r["cpu_cores"]]
    if not busy:
        return []
    worst = max(busy, key=lambda r: r["load_1min"])
    return [f"CPU contention: {len(busy)} of {len(cpu)} measurements ran with a 1-minute load average above the cores "
            f"(up to {worst['load_1min']:.1f} on {worst['cpu_cores']}): other processes shared the CPU, so those times "
            "are inflated; rerun on an idle machine"]


def selkv_fig3(latency: list[dict], source: str = "latency.json") -> list[Artifact]:
    """SelKV Figure 3 from kvbench.latency records: (a) prefill/compression/decode seconds per request,
    (b) decode tokens/s vs prompt length; one row per model, repeats averaged."""
    lat = pd.DataFrame(latency or [])
    if not {"model", "method", "prompt_tokens", "decode_tok_s"} <= set(lat.columns):
        return []
    stages = {"prefill_s": "prefill", "compress_s": "compression", "decode_s": "decode"}
    lat = lat.reindex(columns=list(dict.fromkeys([*lat.columns, *stages, "budget"])))
    means = lat.groupby(["model", "method", "prompt_tokens"]).mean(numeric_only=True).fillna({c: 0.0 for c in stages})
    models = sorted(lat["model"].unique(), key=model_sort_key)
    fig, axes = _figure(len(models), 2, w=5.2)
    hatches = ["", "//", "xx", "..", "\\\\"]
    for (ax_a, ax_b), mk in zip(axes, models):
        m = means.loc[mk]
        lengths = sorted(m.index.get_level_values(1).unique())
        methods = sorted(m.index.get_level_values(0).unique(), key=lambda s: (not s.lower().startswith("full"), s))
        width = 0.8 / len(methods)
        for j, meth in enumerate(methods):
            mm = m.loc[meth].reindex(lengths)
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(lengths))]
            bottom = 0
            for k, col in enumerate(stages):
                ax_a.bar(xs, mm[col].fillna(0), width, bottom=bottom, color=f"C{k}", hatch=hatches[j % 5],
                         edgecolor="black", linewidth=0.4)
                bottom = bottom + mm[col].fillna(0)
            ax_b.plot(mm.dropna(subset=["decode_tok_s"]).index, mm["decode_tok_s"].dropna(), marker="o", label=meth)
        ax_a.legend(handles=[Patch(facecolor=f"C{k}", label=s) for k, s in enumerate(stages.values())]
                    + [Patch(facecolor="white", edgecolor="black", hatch=hatches[j % 5], label=meth)
                       for j, meth in enumerate(methods)], fontsize=6, loc="upper left")
        ax_a.set_ylim(top=ax_a.get_ylim()[1] * 1.45)
        ax_a.set_xticks(range(len(lengths)), [f"{n:.0f}" for n in lengths], rotation=45, fontsize=7)
        ax_a.set(xlabel="Prompt length (tokens)", ylabel="Time per request (s)")
        ax_a.set_title(f"(a) {mk}: time breakdown", fontsize=9)
        ax_b.set_xscale("log", base=2)
        ax_b.set_xticks(lengths, [f"{n:.0f}" for n in lengths], rotation=45, fontsize=7)
        ax_b.minorticks_off()
        ax_b.set(xlabel="Prompt length (tokens)", ylabel="Decode throughput (tokens/s)")
        ax_b.set_title(f"(b) {mk}: decode throughput", fontsize=9)
        ax_b.legend(fontsize=7)
    budgets = sorted(set(pd.to_numeric(lat["budget"], errors="coerce").dropna()) - {1.0})
    devices = sorted(lat["device"].dropna().astype(str).unique()) if "device" in lat else []
    gen = lat["generated_tokens"].dropna() if "generated_tokens" in lat else []
    caption = (f"Latency{' on ' + ', '.join(devices) if devices else ''}; models: {', '.join(models)}; task: synthetic "
               f"prompts, {f'{gen.mean():.0f} generated tokens; ' if len(gen) else ''}compressed at budget "
               f"{', '.join(map(budget_text, budgets)) or '?'} ({budget_semantics(budgets or [math.nan])}).")
    return [_done("selkv_fig3", fig, caption, [source], contention_notes(latency))]


def niah_figures(df: pd.DataFrame, root: Path) -> list[Artifact]:
    """NIAH heatmaps (depth × length): one per job (``niah/<job>``) and one panel per model key
    (rows: budgets; columns: full cache, then methods; a cell's variant and unfinished job named)."""
    niah = df[(df["task"] == "niah") & df["dataset"].notna()]
    records = {job: niah_grid_records(Path(root) / job) for job in niah["job"].unique()}
    out = []
    for job, row in niah.groupby("job").first().iterrows():
        fig, axes = _figure(1, 1, w=5.6, h=4.0)
        title = f"{row['model_key']} / {row['method']} / budget {budget_text(row['budget'])}"
        if (im := draw_niah_heatmap(axes[0, 0], records[job], title)) is not None:
            fig.colorbar(im, ax=axes[0, 0], label=SCORE_LABEL)
        out.append(_done(f"niah/{_slug(job)}", fig, f"Task: NIAH; model: {row['model_key']}; "
                         f"{budget_semantics([row['budget']])}.", [job], []))
    for mk in sorted(niah["model_key"].unique(), key=model_sort_key):
        sel = niah[niah["model_key"] == mk]
        comp, full = sel[sel["method_name"] != FULL], pick(sel[sel["method_name"] == FULL], ["model_key"])
        budgets = sorted(comp["budget"].unique()) or [math.nan]
        cols = [None] * (len(full) > 0) + sorted(set(comp["method"]), key=lambda lab: method_sort_key(
            comp.loc[comp["method"] == lab, "method_name"].iloc[0], lab))
        fig, axes = _figure(len(budgets), len(cols), w=3.2, h=2.8)
        im, sources, notes = None, [], []
        for i, b in enumerate(budgets):
            for j, lab in enumerate(cols):
                chosen = full if lab is None else pick(comp[(comp["method"] == lab) & _same(comp["budget"], b)],
                                                       ["method"])
                title = (chosen["method"].iloc[0] if lab is None and len(chosen) else lab or "full") + (
                    f", budget {budget_text(b)}" if lab is not None else "")
                if len(chosen):
                    r = chosen.iloc[0]
                    title += f"\n{r['variant']}" * bool(r["variant"]) + " (unfinished)" * (not r["complete"])
                    notes += _cell_notes(sel[sel["job"] == r["job"]], chosen, f"{mk} / {title}")
                    sources.append(r["job"])
                else:
                    notes.append(f"absent: {mk} / {lab} at budget {budget_text(b)}")
                im = draw_niah_heatmap(axes[i, j], records[chosen["job"].iloc[0]] if len(chosen) else [], title,
                                       labels=False) or im
        for ax in axes[-1]:
            ax.set_xlabel("Context length (tokens)")
        for ax in axes[:, 0]:
            ax.set_ylabel("Needle depth (%)")
        if im is not None:
            fig.colorbar(im, ax=axes, label=SCORE_LABEL, shrink=0.8)
        fig.suptitle(f"Needle-in-a-Haystack: {mk}", fontsize=10)
        out.append(_done(f"niah_panel_{_slug(mk)}", fig, f"Task: NIAH; model: {mk}; {budget_semantics(budgets)}; score "
                         "= mean over samples per cell (%).", sources, notes))
    return out


# ---------------------------------------------------------------- artifacts and output

ARTIFACTS = {  # family -> (builder, output names it may produce: what --only matches)
    "scores": (lambda c: score_tables(c.df, c.root), ["scores_*"]),
    "selkv_table1": (lambda c: selkv_table1(c.df), ["selkv_table1"]),
    "selkv_table2": (lambda c: selkv_table2(c.df), ["selkv_table2"]),
    "selkv_table3": (lambda c: sensitivity_table(c.df, "selkv_table3", "selkv", 0.25), ["selkv_table3"]),
    "selkv_table4": (lambda c: selkv_table4(c.df), ["selkv_table4"]),
    "selkv_ratio_tables": (lambda c: selkv_ratio_tables(c.df), ["selkv_table5", "selkv_table6", "selkv_ratios_*"]),
    "selkv_table7": (lambda c: selkv_table7(c.df), ["selkv_table7"]),
    "selkv_fig2": (lambda c: selkv_fig2(c.df), ["selkv_fig2"]),
    "selkv_fig3": (lambda c: selkv_fig3(c.latency, c.latency_source), ["selkv_fig3"]),
    "selkv_fig4": (lambda c: budget_sweep_figure(c.df, "selkv_fig4", "longbench", True,
                                                 "LongBench average at varying KV retention ratios"), ["selkv_fig4"]),
    "selkv_fig5": (lambda c: budget_sweep_figure(c.df, "selkv_fig5", "longbench", True, "", True), ["selkv_fig5"]),
    "compresskv_table1": (lambda c: compresskv_table1(c.df), ["compresskv_table1"]),
    "compresskv_table3": (lambda c: compresskv_table3a(c.df) + sensitivity_table(
        c.df, "compresskv_table3b", "compresskv", 256, per_dataset=False), ["compresskv_table3a", "compresskv_table3b"]),
    "compresskv_fig4": (lambda c: budget_sweep_figure(c.df, "compresskv_fig4", "longbench", False,
                                                      "LongBench average under varying KV budgets"), ["compresskv_fig4"]),
    "compresskv_fig5": (lambda c: budget_sweep_figure(c.df, "compresskv_fig5", "niah", False,
                                                      "Needle-in-a-Haystack average under KV budgets"), ["compresskv_fig5"]),
    "niah": (lambda c: niah_figures(c.df, c.root), ["niah/*", "niah_panel_*"]),
}


def _cells(t: Artifact) -> pd.DataFrame:
    return pd.DataFrame({c: [fmt(v, c in t.signed) for v in t.data[c]] for c in t.data.columns})


def to_markdown(t: Artifact) -> str:
    """Caption, table (missing: –, best: bold), notes, source count."""
    cells = _cells(t)
    right = [pd.api.types.is_numeric_dtype(t.data[c]) or cells[c].dropna().str.isdigit().all() for c in cells]
    lines = [f"**{t.name}**: {t.caption}", "", "| " + " | ".join(t.headers.get(c, c) for c in cells) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join("–" if v is None else f"**{v}**" if (i, c) in t.bold else v for c, v in row.items())
              + " |" for i, row in cells.iterrows()]
    lines += ["", *(["Notes (a missing cell is shown as –):", *[f"- {n}" for n in t.notes], ""] if t.notes else []),
              f"Built from {len(t.sources)} job folder(s), listed in `{t.name}.sources.txt`."]
    return "\n".join(lines) + "\n"


def _tex(text: str) -> str:
    for a, b in [("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"), ("Δ", r"$\Delta$"),
                 ("ρ", r"$\rho$"), ("✓", r"\checkmark"), ("–", "--"), ("×", r"$\times$"), ("·", r"$\cdot$")]:
        text = text.replace(a, b)
    return text


def to_latex(t: Artifact) -> str:
    """A booktabs table (pandas ``to_latex``): missing cells ``--``, best cells ``\\textbf``; notes
    and sources as comments."""
    cells = _cells(t)
    for c in cells:
        cells[c] = ["--" if v is None else (r"\textbf{%s}" if (i, c) in t.bold else "%s") % _tex(
            "$-$" + v[1:] if v.startswith("-") else v) for i, v in enumerate(cells[c])]
    spec = "".join("r" if pd.api.types.is_numeric_dtype(t.data[c]) else "l" for c in t.data.columns)
    cells.columns = [_tex(t.headers.get(c, c)) for c in cells.columns]
    body = cells.to_latex(index=False, escape=False, caption=_tex(t.caption), label=f"tab:{t.name}", position="t",
                          column_format=spec)
    return body + "".join(f"% note: {n}\n" for n in t.notes) + "".join(f"% source: {s}\n" for s in t.sources)


def write(a: Artifact, out: Path) -> list[Path]:
    """Write a table (``.md``, ``.tex``, ``.csv``) or a figure (``.png`` at 150 dpi, ``.pdf``; closed
    after), and ``<name>.sources.txt``; returns the paths of the table or figure files."""
    base = out / a.name
    base.parent.mkdir(parents=True, exist_ok=True)
    if a.fig is not None:
        paths = [base.with_name(base.name + s) for s in (".png", ".pdf")]
        a.fig.savefig(paths[0], dpi=150)
        a.fig.savefig(paths[1])
        plt.close(a.fig)
    else:
        paths = [base.with_name(base.name + s) for s in (".md", ".tex", ".csv")]
        paths[0].write_text(to_markdown(a))
        paths[1].write_text(to_latex(a))
        csv = a.data.copy()
        for c in csv.columns:
            if pd.api.types.is_numeric_dtype(csv[c]):
                csv[c] = [None if math.isnan(v) else round2(v) for v in csv[c]]
        csv.to_csv(paths[2], index=False, na_rep="")
    text = [f"# {a.name}: job folders this artifact was built from (relative to the results root)", f"# {a.caption}",
            *a.sources, *([""] + [f"# note: {n}" for n in a.notes] if a.notes else [])]
    base.with_name(base.name + ".sources.txt").write_text("\n".join(text) + "\n")
    return paths


def load_latency(path: str | Path) -> list[dict]:
    """Records of a kvbench.latency JSON file (a list of objects, or ``{"records": [...]}``).

    Raises:
        ValueError: the file is not JSON or not a list of records.
    """
    data = json.loads(Path(path).read_text())
    records = data.get("records") if isinstance(data, dict) else data
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("expected a list of records")
    return records


def _selected(family: str, outputs: list[str], only) -> bool:
    return not only or any(fnmatch.fnmatch(family, p) or any(fnmatch.fnmatch(o, p) or fnmatch.fnmatch(p, o)
                                                             for o in outputs) for p in only)


def build(ctx: Context, only: list[str] | None = None) -> dict[str, list | Exception]:
    """Run the selected builders: ``{family: [Artifact, ...]}`` (``[]``: no inputs) or the exception
    it raised (one broken artifact does not stop the others)."""
    built = {}
    for family, (builder, outputs) in ARTIFACTS.items():
        if _selected(family, outputs, only):
            try:
                arts = builder(ctx)
            except Exception as e:  # noqa: BLE001 - reported in index.md and on stderr
                built[family] = e
                continue
            whole = not only or any(fnmatch.fnmatch(family, p) for p in only)
            built[family] = [a for a in arts if whole or any(fnmatch.fnmatch(a.name, p) for p in only)]
    return built


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit status 1 when an artifact failed to build, 2 on a usage error."""
    names = sorted({o for _b, outs in ARTIFACTS.values() for o in outs} | set(ARTIFACTS))
    p = ArgParser(prog="kvbench report", description="Score tables of any sweep and the seed papers' tables and "
                  "figures from the job folders under RESULTS_ROOT.")
    p.add_argument("root", metavar="RESULTS_ROOT")
    p.add_argument("--out", help="output folder (default: RESULTS_ROOT/report)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="artifact names or patterns: " + ", ".join(names))
    p.add_argument("--latency", help="latency JSON for selkv_fig3 (default: RESULTS_ROOT/latency.json)")
    args = p.parse_args(argv)
    only = [x for item in args.only or [] for x in item.split(",") if x]
    root, out = Path(args.root), Path(args.out or Path(args.root) / "report")
    if not root.is_dir():
        p.error(f"RESULTS_ROOT {str(root)!r} is not a directory")
    for pattern in only:
        if not any(_selected(f, o, [pattern]) for f, (_b, o) in ARTIFACTS.items()):
            p.error(f"--only {pattern!r}: no such artifact; accepted: {', '.join(names)}")
    lat_path = Path(args.latency or root / "latency.json")
    try:
        latency = load_latency(lat_path) if args.latency or lat_path.is_file() else None
    except (OSError, ValueError) as e:
        p.error(f"--latency {str(lat_path)!r}: not a latency file of python -m kvbench.latency ({type(e).__name__})")
    df = load_results(root)
    index = [f"# Report of {root}", "", f"{df['job'].nunique()} job folder(s) read.", ""]
    for line in df.attrs["unreadable"]:
        print(f"warning: job folder {line}; left out of the report", file=sys.stderr)
        index.insert(-1, f"Left out (unreadable): {line}")
    if df.empty and not (latency and only and all(fnmatch.fnmatch("selkv_fig3", x) for x in only)):
        print(f"warning: no job folders under {root} (a job folder holds config.yaml and summary.json or "
              "predictions.jsonl)", file=sys.stderr)
    failed = 0
    for family, arts in build(Context(root, df, latency, str(lat_path)), only).items():
        if isinstance(arts, Exception):
            failed += 1
            index.append(f"- {family}: FAILED ({type(arts).__name__}: {arts})")
            print(f"{family}: FAILED: {type(arts).__name__}: {arts}", file=sys.stderr)
        index += [f"- {family}: no inputs in this results root"] if arts == [] else []
        for a in arts if isinstance(arts, list) else []:
            paths = write(a, out)
            kinds = ", ".join(_dedupe(n.split(":")[0] for n in a.notes))
            index.append(f"- {a.name}: {', '.join(q.name for q in paths)} ({len(a.sources)} job(s)"
                         + (f", {len(a.notes)} note(s): {kinds}" if a.notes else "") + ")")
            print(f"wrote {a.name}" + (f", {len(a.notes)} note(s): {kinds}" if a.notes else ""))
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.md").write_text("\n".join(index) + "\n")
    print(f"report written to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
