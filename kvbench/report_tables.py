"""The seed papers' tables, rebuilt from a results frame, and the overview score tables of any
sweep (:func:`score_tables`).

Each builder takes the frame of :func:`kvbench.report_data.load_results` and returns a list
of :class:`Table` (empty when its inputs are absent). Numbers are kept unrounded in
``Table.data`` (NaN = missing cell, never zero); rendering rounds half-up to 2 decimals.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pandas as pd

from .report_data import (
    DATASET_ABBR,
    DATASET_CATEGORY,
    FULL,
    LONG_CONTEXT_TOKENS,
    LONGBENCH_CATEGORIES,
    budget_semantics,
    budget_text,
    cell_scores,
    incomplete_note,
    is_ratio_budget,
    left_out_note,
    method_sort_key,
    n_datasets,
    niah_grid,
    order_datasets,
    preset_overrides,
    preset_params,
    subset_notes,
    variants,
)
from .report_grid import Grid, average_rank, model_sort_key, score_grid


@dataclass
class Table:
    """A rendered-agnostic table.

    Attributes:
        name: artifact name (file stem), e.g. ``selkv_table1``.
        caption: one paragraph: what the numbers are, the budget semantics, the models.
        data: one row per table row; label columns hold strings, value columns floats (NaN = missing).
        bold: ``(row position, column)`` cells to set in bold.
        headers: display names of columns (Markdown/LaTeX); CSV keeps ``data.columns``.
        groups: optional header groups ``[(title, span)]`` over ``data.columns`` (LaTeX multicolumn).
        signed: columns printed with an explicit sign (deltas).
        sources: job folders the table was built from (relative to the results root).
        notes: absent jobs / datasets, incomplete jobs.
    """

    name: str
    caption: str
    data: pd.DataFrame
    bold: set[tuple[int, str]] = field(default_factory=set)
    headers: dict[str, str] = field(default_factory=dict)
    groups: list[tuple[str, int]] = field(default_factory=list)
    signed: set[str] = field(default_factory=set)
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def round2(x: float) -> float:
    """Round half-up to 2 decimals (the papers' printing: 2.625 → 2.63)."""
    return math.floor(round(x * 100, 6) + 0.5) / 100


def bold_best(data: list[dict], rows: list[int], col: str, higher: bool = True) -> set[tuple[int, str]]:
    """Cells holding the best printed value of ``col`` among ``rows`` (ties all bold)."""
    vals = {i: round2(data[i][col]) for i in rows if not math.isnan(data[i].get(col, math.nan))}
    if not vals:
        return set()
    best = max(vals.values()) if higher else min(vals.values())
    return {(i, col) for i, v in vals.items() if v == best}


def _category_groups(lead: int, datasets: list[str], tail: list[tuple[str, int]]) -> list[tuple[str, int]]:
    groups: list[tuple[str, int]] = [("", lead)] if lead else []
    for d in datasets:
        cat = DATASET_CATEGORY.get(d, "Other")
        if groups and groups[-1][0] == cat:
            groups[-1] = (cat, groups[-1][1] + 1)
        else:
            groups.append((cat, 1))
    return groups + tail


def _table(name: str, caption: str, rows: list[dict], columns: list[str], grid: Grid | None = None, **kw) -> Table:
    data = pd.DataFrame(rows, columns=columns)
    srcs, notes = (grid.sources, grid.notes) if grid else ([], [])
    return Table(name, caption, data, sources=kw.pop("sources", srcs), notes=kw.pop("notes", notes), **kw)


def _unfinished_text(*grids: Grid) -> str:
    """`` (unfinished jobs' rows excluded)`` for a caption when a cell of ``grids`` is of an
    unfinished job (its scores cover fewer samples: never bold), else ``""``."""
    return " (rows of unfinished jobs excluded)" if any(g.incomplete for g in grids) else ""


def _models_text(models: list[str]) -> str:
    return "Models: " + ", ".join(models) + "."


def selkv_table1(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Table]:
    """SelKV Table 1: per-dataset scores × method × model, Avg, Δ to full cache, Avg Rank.

    Avg is the mean over the table's datasets (missing if any is missing); Δ = Avg − full-cache
    Avg of the same model; Avg Rank is :func:`report_grid.average_rank`. Best compressed value
    per model and column in bold (lowest Avg Rank).
    """
    grid = score_grid(df, task, budget)
    if grid is None:
        return []
    rows: list[dict] = []
    bold: set[tuple[int, str]] = set()
    for mk in grid.models:
        full_avg = grid.average(mk, grid.full_label) if grid.full_label else math.nan
        ranks = average_rank(grid, mk)
        start = len(rows)
        for label in grid.row_labels():
            is_full = label == grid.full_label
            avg = grid.average(mk, label)
            rows.append({"Model": mk, "Method": label, **{d: grid.score(mk, label, d) for d in grid.datasets},
                         "Avg": avg, "Δ": math.nan if is_full else avg - full_avg,
                         "Avg Rank": math.nan if is_full else ranks[label]})
        comp = [i for i in range(start, len(rows)) if rows[i]["Method"] != grid.full_label
                and grid.complete(mk, rows[i]["Method"])]
        for col in [*grid.datasets, "Avg", "Δ"]:
            bold |= bold_best(rows, comp, col)
        bold |= bold_best(rows, comp, "Avg Rank", higher=False)
    caption = (f"LongBench results ({n_datasets(len(grid.datasets))}) at a {budget_text(budget)} KV budget "
               f"({budget_semantics([budget])}). Δ: gap to {grid.full_label or 'the full cache'} within each model. "
               "Avg Rank: mean over datasets of the per-dataset rank among compressed methods (lower is better; "
               "ties share the better rank). Best compressed method per column in bold" + _unfinished_text(grid)
               + ". " + _models_text(grid.models))
    cols = ["Model", "Method", *grid.datasets, "Avg", "Δ", "Avg Rank"]
    return [_table("selkv_table1", caption, rows, cols, grid, bold=bold, signed={"Δ"},
                   headers={d: DATASET_ABBR.get(d, d) for d in grid.datasets},
                   groups=_category_groups(2, grid.datasets, [("Overall", 3)]))]


def selkv_table4(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Table]:
    """SelKV Table 4: LongBench category averages per method (rows: model × category).

    A category's value is the mean of its datasets present in the grid; missing if the method
    lacks one of them. Best compressed method per row in bold.
    """
    grid = score_grid(df, task, budget)
    if grid is None:
        return []
    rows: list[dict] = []
    bold: set = set()
    cats = {**LONGBENCH_CATEGORIES, "Other": [d for d in grid.datasets if d not in DATASET_CATEGORY]}
    for mk in grid.models:
        for cat, members in cats.items():
            ds = [d for d in grid.datasets if d in members]
            if not ds:
                continue
            rows.append({"Model": mk, "Category": cat, **{lab: grid.average(mk, lab, ds) for lab in grid.row_labels()}})
            vals = {lab: round2(rows[-1][lab]) for lab in grid.labels
                    if not math.isnan(rows[-1][lab]) and grid.complete(mk, lab)}
            bold |= {(len(rows) - 1, lab) for lab, v in vals.items() if v == max(vals.values())}
    caption = (f"Category-level averages on LongBench ({budget_text(budget)} KV budget; {budget_semantics([budget])}). "
               "Best compressed method per category in bold" + _unfinished_text(grid) + ". "
               + _models_text(grid.models))
    partial = [f"partial category: {cat} averages {len(ds)} of its {len(members)} datasets ({', '.join(ds)}); not "
               "comparable to the paper's category score"
               for cat, members in LONGBENCH_CATEGORIES.items()
               if 0 < len(ds := [d for d in grid.datasets if d in members]) < len(members)]
    return [_table("selkv_table4", caption, rows, ["Model", "Category", *grid.row_labels()], grid, bold=bold,
                   notes=grid.notes + partial)]


RATIO_TABLE_NAMES = {"llama31": "selkv_table5", "gemma2": "selkv_table6"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def ratio_grids(df: pd.DataFrame, task: str = "longbench") -> dict[float, Grid]:
    """One grid per retention ratio (budget ≤ 1) present among the task's compressed jobs."""
    sel = df[(df["task"] == task) & (df["method_name"] != FULL) & df["budget"].map(is_ratio_budget).astype(bool)]
    grids = {float(b): score_grid(df, task, float(b)) for b in sorted(sel["budget"].dropna().unique())}
    return {b: g for b, g in grids.items() if g is not None}


def sweep_series(grids: dict[float, Grid], model: str) -> tuple[list[str], list[str], dict]:
    """For one model across budgets: datasets (union), method labels (full cache first, then
    :func:`method_sort_key` order) and ``{(label, budget): average}`` (NaN = missing cell).
    """
    present = {b: g for b, g in grids.items() if model in g.models}
    datasets = order_datasets(d for g in present.values() for (mk, _l), c in g.cells.items() if mk == model for d in c)
    names: dict[str, str] = {}
    values: dict = {}
    for b, g in present.items():
        names.update(g.names)
        for lab in g.row_labels():
            values[(lab, b)] = g.average(model, lab, datasets)
    labels = sorted({lab for lab, _b in values}, key=lambda lab: method_sort_key(names.get(lab, ""), lab))
    return datasets, labels, values


def missing_notes(rows: list[dict], cols: list[str], what) -> list[str]:
    """One note per missing (NaN) value cell not already explained: ``what(row, col)`` names it."""
    return [f"absent: {what(r, c)}" for r in rows for c in cols if math.isnan(r[c])]


def selkv_ratio_tables(df: pd.DataFrame, task: str = "longbench") -> list[Table]:
    """SelKV Tables 5 and 6: LongBench average per method at each retention ratio, per model.

    Named ``selkv_table5`` (llama31), ``selkv_table6`` (gemma2), else ``selkv_ratios_<model>``;
    only models with at least two ratios. The full-cache average is repeated in every column.
    """
    grids = ratio_grids(df, task)
    out: list[Table] = []
    models = sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
    used_names: set[str] = set()
    for mk in models:
        budgets = [b for b, g in grids.items() if mk in g.models]
        if len(budgets) < 2:
            continue
        datasets, labels, values = sweep_series(grids, mk)
        full = next((g.full_label for g in grids.values() if g.full_label in labels), None)
        cols = [budget_text(b) for b in budgets]
        full_avgs = [values.get((full, b), math.nan) for b in budgets]
        full_avg = next((v for v in full_avgs if not math.isnan(v)), math.nan)
        rows = [{"Method": lab, **{budget_text(b): (full_avg if lab == full else values.get((lab, b), math.nan))
                                    for b in budgets}} for lab in labels]
        comp = [i for i, r in enumerate(rows) if r["Method"] != full]
        bold = set().union(*(bold_best(rows, comp, c) for c in cols))
        name = RATIO_TABLE_NAMES.get(mk.split(" ")[0], "")
        name = name if name and name not in used_names else f"selkv_ratios_{_slug(mk)}"
        used_names.add(name)
        merged = Grid(task, math.nan, [mk], full, [])
        for b in budgets:
            merged.merge_notes(grids[b], [mk])
        notes = merged.notes + [n for n in missing_notes(rows, cols, lambda r, c: (
            f"{mk} / {r['Method']} at ratio {c} (no job, or a dataset missing)")) if n not in merged.notes]
        caption = (f"LongBench average ({n_datasets(len(datasets))}) of {mk} at different KV retention ratios "
                   f"({budget_semantics(budgets)}). The full cache does not depend on the ratio. "
                   "Best compressed method per ratio in bold.")
        out.append(_table(name, caption, rows, ["Method", *cols], merged, bold=bold, notes=notes))
    return out


def selkv_table7(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Table]:
    """SelKV Table 7: LongBench average and Δ for long-context settings (prompts truncated at
    >= :data:`report_data.LONG_CONTEXT_TOKENS` tokens, e.g. 31,500)."""
    long_keys = sorted(df.loc[df["max_input_tokens"] >= LONG_CONTEXT_TOKENS, "model_key"].unique(), key=model_sort_key)
    grid = score_grid(df, task, budget, models=long_keys) if long_keys else None
    if grid is None:
        return []
    rows: list[dict] = []
    bold: set = set()
    for mk in grid.models:
        full_avg = grid.average(mk, grid.full_label) if grid.full_label else math.nan
        start = len(rows)
        for label in grid.row_labels():
            avg = grid.average(mk, label)
            rows.append({"Model": mk, "Method": label, "Avg": avg,
                         "Δ": math.nan if label == grid.full_label else avg - full_avg})
        bold |= bold_best(rows, [i for i in range(start, len(rows)) if rows[i]["Method"] != grid.full_label
                                 and grid.complete(mk, rows[i]["Method"])], "Avg")
    ctx = sorted({int(t) for t in df.loc[df["model_key"].isin(grid.models), "max_input_tokens"].dropna()})
    caption = (f"LongBench average ({n_datasets(len(grid.datasets))}) with long inputs "
               f"({', '.join(map(str, ctx))} tokens), "
               f"{budget_text(budget)} KV budget ({budget_semantics([budget])}). " + _models_text(grid.models))
    return [_table("selkv_table7", caption, rows, ["Model", "Method", "Avg", "Δ"], grid, bold=bold, signed={"Δ"},
                   headers={"Avg": f"Avg ({len(grid.datasets)} ds)"})]


def compresskv_table1(df: pd.DataFrame, budgets: tuple[float, ...] = (256, 1024),
                      task: str = "longbench") -> list[Table]:
    """CompressKV Table 1: LongBench averages at fixed token budgets, per model (columns model × budget).

    The full-cache average is repeated under each budget; best compressed method per column in bold.
    """
    grids = {b: g for b in budgets if (g := score_grid(df, task, float(b))) is not None}
    if not grids:
        return []
    models = sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
    full = next((g.full_label for g in grids.values() if g.full_label), None)
    labels: list[str] = []
    cols: list[str] = []
    values: dict = {}
    merged = Grid(task, math.nan, models, full, [])
    for mk in models:
        _datasets, labs, vals = sweep_series(grids, mk)
        labels += [lab for lab in labs if lab not in labels]
        full_avg = next((v for (lab, _b), v in vals.items() if lab == full and not math.isnan(v)), math.nan)
        for b in grids:
            col = f"{mk} @{b:g}"
            cols.append(col)
            values.update({(lab, col): v for (lab, bb), v in vals.items() if bb == b})
            values[(full, col)] = full_avg
    for g in grids.values():
        merged.merge_notes(g)
    rows = [{"Method": lab, **{c: values.get((lab, c), math.nan) for c in cols}} for lab in labels]
    comp = [i for i, r in enumerate(rows) if r["Method"] != full]
    bold = set().union(*(bold_best(rows, [i for i in comp if grids[b].complete(mk, rows[i]["Method"])], f"{mk} @{b:g}")
                         for mk in models for b in grids))
    notes = merged.notes + missing_notes(rows, cols, lambda r, c: (
        f"{c.split(' @')[0]} / {r['Method']} at budget {c.split(' @')[1]} (no job, or a dataset missing)"))
    caption = (f"Average LongBench scores under fixed KV budgets ({budget_semantics(list(grids))}). "
               f"{full or 'The full cache'} is uncompressed and does not depend on the budget. "
               "Best compressed method per column in bold" + _unfinished_text(*grids.values()) + ". "
               + _models_text(models))
    groups = [("", 1)] + [(mk, len(grids)) for mk in models]
    return [_table("compresskv_table1", caption, rows, ["Method", *cols], merged, bold=bold, groups=groups,
                   notes=list(dict.fromkeys(notes)))]


def _variant_labels(groups: list[tuple], rows: pd.DataFrame) -> dict[tuple, tuple[str, tuple]]:
    """Per configuration key ``(name, label, params, budget)`` of one table: the method fields that
    tell its variant apart from the label's other variants or from its preset file
    (:func:`report_data.preset_params`: ``method.alpha=1.5`` shows as ``alpha=1.5`` even with
    no default job beside it) (``kernel_size=3, window_size=32``; ``""`` for a label whose only
    variant is its preset's) and the variant's sort key (the preset's own variant first, or
    without the preset file the preferred one of :func:`report_data.variants`; then the
    differing fields, numbers numerically: ``alpha=1.0`` before ``alpha=2``)."""
    out: dict[tuple, tuple[str, tuple]] = {}
    for label in dict.fromkeys(k[1] for k in groups):
        found = variants(rows[rows["method"] == label])
        all_params = [p for p, _r in found]
        varying = {k for k in set().union(*all_params) if len({json.dumps(p.get(k)) for p in all_params}) > 1}
        presets = rows.loc[rows["method"] == label, "preset"].unique()
        reference = preset_params(str(presets[0])) if len(presets) == 1 else None
        if reference:  # a lone variant that overrides the preset's fields is marked too
            varying |= {k for p in all_params for k in preset_overrides(p, reference)}
        varying = sorted(varying)
        for key in (k for k in groups if k[1] == label):
            own = json.loads(key[2])
            values = [own.get(k, "–") for k in varying]
            order = tuple((0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool)
                          else (1, 0.0, json.dumps(v)) for v in values)
            default = (all(json.dumps(own.get(k)) == json.dumps(reference.get(k)) for k in varying) if reference
                       else own == all_params[0])
            out[key] = (", ".join(f"{k}={v}" for k, v in zip(varying, values)), (not default, order))
    return out


def _niah_grids(root: Path | None, jobs: Iterable[str]) -> dict[str, str]:
    """Per NIAH job folder (relative to ``root``): its grid (:func:`report_data.niah_grid`) as
    ``lengths [..] × depths [..]``; jobs without a recorded grid are left out."""
    if root is None:
        return {}
    grids = {job: niah_grid(Path(root) / job) for job in jobs}
    return {job: f"lengths {g[0]} × depths {g[1]}" for job, g in grids.items() if g is not None}


def _raised_ratios(sel, groups, order, skip) -> dict[int, float]:
    """Rows ``{index: kept / prompt tokens}`` whose retention ratio ρ < 1 the method raised.

    A method keeps at least its observation window, sinks and recent tokens, so ``budget=0.001``
    on short prompts keeps far more than 0.1 %; flagged when the mean kept tokens per layer and KV
    head over the mean prompt tokens exceed ``max(1.5·ρ, ρ + 0.02)`` (rounding ρ·n never does).
    """
    raised = {}
    for i, key in enumerate(order):
        rho = key[3]
        if key[0] == FULL or i in skip or not isinstance(rho, (int, float)) or not 0 < rho < 1:
            continue
        part = sel.loc[groups[key]]
        if "kept_tokens" not in part or "prompt_tokens" not in part:
            continue
        kept, prompt = part["kept_tokens"].mean(), part["prompt_tokens"].mean()
        if prompt > 0 and kept / prompt > max(1.5 * rho, rho + 0.02):  # NaN compares False
            raised[i] = float(kept / prompt)
    return raised


def score_tables(df: pd.DataFrame, root: Path | None = None) -> list[Table]:
    """Overview of a results root (any sweep): one table per task × model key of every job
    configuration's per-dataset scores.

    Reads the frame of :func:`kvbench.report_data.load_results`: a row is one configuration,
    i.e. method label, method fields (``params``: a *variant*, shown in a ``Variant`` column
    when a label has several) and budget; jobs of one configuration (reruns, shards) are
    merged by :func:`report_data.cell_scores`, and the full cache, which ignores the budget,
    is one row per variant with no budget (``–``). Rows are sorted by method
    (:func:`report_data.method_sort_key`), then budget, then variant (default first).
    Columns: the datasets present in LongBench order (:func:`report_data.order_datasets`),
    ``Avg`` (mean over the table's datasets, missing when the row lacks one) and ``n`` (scored
    samples over the row's datasets). Best compressed configuration per column in bold.

    Returns:
        One :class:`Table` per (task, model key) with at least one scored dataset, named
        ``scores_<task>_<model>`` (slugs), in task then paper model order; ``[]`` when no job
        has a score.
    """
    scored = df[df["score"].notna()]
    pairs = sorted({(t, mk) for t, mk in zip(scored["task"], scored["model_key"])},
                   key=lambda p: (p[0], model_sort_key(p[1])))
    out: list[Table] = []
    used_names: set[str] = set()
    for task, mk in pairs:
        sel = df[(df["task"] == task) & (df["model_key"] == mk)]
        datasets = order_datasets(sel["dataset"])
        groups: dict[tuple, list[int]] = {}
        for idx, name, label, params, budget in zip(sel.index, sel["method_name"], sel["method"], sel["params"],
                                                    sel["budget"]):
            b = None if name == FULL or math.isnan(budget) else float(budget)
            groups.setdefault((name, label, params, b), []).append(idx)
        vlabels = _variant_labels(list(groups), sel)
        texts = {k: text for k, (text, _o) in vlabels.items()}
        order = sorted(groups, key=lambda k: (method_sort_key(k[0], k[1]), -1.0 if k[3] is None else k[3],
                                              vlabels[k][1], k[2]))
        show_variant = any(texts.values())
        rows: list[dict] = []
        sources: set[str] = set()
        notes: list[str] = []
        incomplete: set[int] = set()  # row indices with a job that has not finished
        row_jobs: list[list[str]] = []  # per row, the jobs its scores came from
        job_subset = dict(zip(sel["job"], sel["subset"]))
        for key in order:
            name, label, _params, budget = key
            rows_k = sel.loc[groups[key]]
            scores, used = cell_scores(rows_k)
            sources.update(used)
            row_jobs.append(used)
            n_by_ds: dict[str, int] = {}  # n of the job each score came from (used: best job first)
            for job in used:
                jr = rows_k[(rows_k["job"] == job) & rows_k["score"].notna()]
                for d, n in zip(jr["dataset"], jr["n"].fillna(0)):
                    n_by_ds.setdefault(d, int(n))
            vals = [scores.get(d, math.nan) for d in datasets]
            what = label + (f" ({texts[key]})" if texts[key] else "")
            btext = None if budget is None else budget_text(budget)
            rows.append({"Method": label, **({"Variant": texts[key]} if show_variant else {}),
                         "Budget": btext, **dict(zip(datasets, vals)),
                         "Avg": math.nan if any(math.isnan(v) for v in vals) else sum(vals) / len(vals),
                         "n": str(sum(n_by_ds.values())) if n_by_ds else None})
            lacking = [d for d in datasets if d not in scores]
            if lacking:
                notes.append(f"absent: {what}" + (f" at budget {btext}" if btext else "")
                             + f" has no score for {', '.join(lacking)}")
            pending: dict[str, int] = {}
            for job, complete, n in zip(rows_k["job"], rows_k["complete"], rows_k["n"].fillna(0)):
                if not complete and job in used:  # an unused job is named by the left-out note
                    pending[job] = pending.get(job, 0) + int(n)
            notes += [incomplete_note(job, n) for job, n in pending.items()]
            left = left_out_note(what + (f" at budget {btext}" if btext else ""), rows_k, used)
            if left:
                notes.append(left)
            notes += subset_notes(rows_k, used)
            if pending:
                incomplete.add(len(rows) - 1)
        grids = _niah_grids(root, sorted(sources)) if task == "niah" else {}
        if task == "niah":  # scores of different grids are not comparable: say so
            by_grid: dict[str, list[str]] = {}
            for job, grid in grids.items():
                by_grid.setdefault(grid, []).append(job)
            if len(by_grid) > 1:
                notes.append("different NIAH grids, scores not comparable across them: " + "; ".join(
                    f"{grid}: " + (", ".join(jobs) if len(jobs) <= 3 else f"{len(jobs)} jobs ({jobs[0]}, ...)")
                    for grid, jobs in by_grid.items()))
        # bold candidates: complete rows of compressed configurations (not the full cache, not 100 %,
        # not a budget that kept every prompt whole: a token budget above the prompt lengths)
        kept_all = {i for i, key in enumerate(order)
                    if (sel.loc[groups[key], "compressed_fraction"] == 0).all()}
        raised = _raised_ratios(sel, groups, order, kept_all)
        comp = [i for i, key in enumerate(order)
                if key[0] != FULL and key[3] != 1.0 and i not in incomplete and i not in kept_all and i not in raised]
        # rows scored on different sample sets (task.n_samples, max_samples) or NIAH grids do not
        # compete for bold: only those of the most common kind (ties: the whole datasets first)
        kinds = [" / ".join(sorted({" ".join(filter(None, [grids.get(j), job_subset.get(j)])) for j in jobs}))
                 for jobs in row_jobs]
        if task != "niah" and len(set(kinds)) > 1:
            notes.append("mixed samples: rows scored on different sample sets (" + "; ".join(
                sorted({k or "whole datasets" for k in kinds})) + "), scores not comparable across them")
        comp_kinds = [kinds[i] for i in comp]
        if len(set(comp_kinds)) > 1:
            main_kind = max(sorted(set(comp_kinds)), key=comp_kinds.count)
            notes.append("bold: only among rows scored on " + (main_kind or "whole datasets")
                         + f" ({comp_kinds.count(main_kind)} of {len(comp)} compressed rows)")
            comp = [i for i in comp if kinds[i] == main_kind]
        notes += [f"uncompressed: {rows[i]['Method']} at budget {rows[i]['Budget']} kept every prompt whole (no "
                  "sample was compressed: the budget is not below the prompt lengths, or not below the tokens the "
                  "method always keeps, e.g. its observation window, attention sinks or recent tokens; the job's log "
                  "says which), not a compressed configuration"
                  for i in sorted(kept_all) if order[i][0] != FULL and order[i][3] != 1.0]
        notes += [f"raised: {rows[i]['Method']} at budget {rows[i]['Budget']} kept {100 * eff:.1f} % of the prompt "
                  "tokens on average (mean kept_tokens / prompt_tokens), more than its label: the method always keeps "
                  "its observation window, attention sinks or recent tokens (the job's log warned), so the row is not "
                  "a configuration at that ratio and is not bold" for i, eff in sorted(raised.items())]
        bold = set().union(*(bold_best(rows, comp, c) for c in [*datasets, "Avg"]))
        budgets = [k[3] for k in order if k[3] is not None]
        full_text = (" The full cache ignores the budget (–)." if any(k[0] == FULL for k in order) else "")
        caption = (f"Scores of every job configuration of {mk} on {task} ({n_datasets(len(datasets))}; one row per method"
                   + (", method variant" if show_variant else "") + " and budget"
                   + (f"; {budget_semantics(budgets)}" if budgets else "") + "). "
                   "Each dataset's score is round(100·mean, 2) of the task's per-sample scores in [0, 1] "
                   "(LongBench's rule); Avg: mean over the table's datasets, missing when a row lacks one; "
                   f"n: scored samples.{full_text} Best complete compressed configuration (budget below 100 %, "
                   "at least one prompt compressed) per column in bold.")
        table_name = base = f"scores_{_slug(task)}_{_slug(mk)}"
        suffix = 2
        while table_name in used_names:  # two model keys with one slug
            table_name, suffix = f"{base}_{suffix}", suffix + 1
        used_names.add(table_name)
        cols = ["Method", *(["Variant"] if show_variant else []), "Budget", *datasets, "Avg", "n"]
        out.append(_table(table_name, caption, rows, cols, bold=bold, sources=sorted(sources),
                          notes=list(dict.fromkeys(notes)), headers={d: DATASET_ABBR.get(d, d) for d in datasets}))
    return out
