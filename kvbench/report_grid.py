"""Score grids: the (model × method × dataset) cells that every table and figure is built from.

A :class:`Grid` holds, for one task and one budget, the per-dataset scores of each model key's
full cache and compressed methods, the job folders they came from, and notes naming what is
absent (a job never run, a dataset a job has not scored, an incomplete job). A missing score
is absent from the cell dict, never zero; averages over cells with a missing dataset are NaN.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pandas as pd

from .report_data import (
    FULL,
    budget_text,
    cell_scores,
    full_rows,
    incomplete_note,
    main_label_fallbacks,
    main_labels,
    method_sort_key,
    order_datasets,
    left_out_note,
    pick_variant,
    subset_notes,
)

MODEL_ORDER = ["llama31", "gemma2", "longchat", "mistral", "qwen25_14b", "qwen25_32b"]


def model_sort_key(model_key: str) -> tuple:
    """Paper model order first, then natural order (``[ctx3500]`` before ``[ctx31500]``)."""
    base = model_key.split(" ")[0]
    natural = tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", model_key) if t)
    return (MODEL_ORDER.index(base) if base in MODEL_ORDER else len(MODEL_ORDER), natural)


@dataclass
class Grid:
    """Cells of one task at one budget.

    Attributes:
        task: task name (``longbench``, ``niah``).
        budget: the compressed methods' budget (ratio ≤ 1 or tokens > 1).
        models: model keys, in paper order.
        full_label: display label of the full-cache row (``None`` when no full job exists).
        labels: compressed method labels, in :data:`report_data.METHOD_ORDER`.
        cells: ``{(model_key, label): {dataset: score}}`` (scores in points, 0-100); absent
            keys are missing cells.
        datasets: every dataset scored by any cell, in LongBench order.
        names: registry method name of each label (row order, :func:`method_sort_key`).
        cell_jobs: ``{(model_key, label): [job folder, ...]}`` that filled each cell.
        sources: job folders (relative to the results root) that contributed a score.
        model_notes: ``(model_key, line)`` per absent job / dataset / incomplete job.
    """

    task: str
    budget: float
    models: list[str]
    full_label: str | None
    labels: list[str]
    cells: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)
    cell_jobs: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    model_notes: list[tuple[str, str]] = field(default_factory=list)
    incomplete: set[tuple[str, str]] = field(default_factory=set)  # (model key, label) cells of unfinished jobs

    def complete(self, model: str, label: str) -> bool:
        """Whether every job of a cell finished (an unfinished job's scores cover fewer samples, so
        its cell is never bold)."""
        return (model, label) not in self.incomplete

    @property
    def notes(self) -> list[str]:
        """Every note line, in order, without repeats."""
        return list(dict.fromkeys(text for _mk, text in self.model_notes))

    def notes_for(self, models: list[str]) -> list[str]:
        """Note lines about the given model keys only."""
        return list(dict.fromkeys(text for mk, text in self.model_notes if mk in models))

    def note(self, model: str, text: str) -> None:
        """Record a line about one model key (absent job, dataset, incomplete job)."""
        self.model_notes.append((model, text))

    def row_labels(self) -> list[str]:
        """Full cache first (when present), then the compressed labels."""
        return ([self.full_label] if self.full_label else []) + self.labels

    def score(self, model: str, label: str, dataset: str) -> float:
        """One cell's score, NaN when missing."""
        return self.cells.get((model, label), {}).get(dataset, math.nan)

    def average(self, model: str, label: str, datasets: list[str] | None = None) -> float:
        """Mean score over ``datasets`` (default: all of the grid's); NaN if any is missing."""
        vals = [self.score(model, label, d) for d in (datasets or self.datasets)]
        return math.nan if not vals or any(math.isnan(v) for v in vals) else sum(vals) / len(vals)

    def merge_notes(self, other: "Grid", models: list[str] | None = None) -> None:
        """Adopt another grid's sources and notes (tables spanning several budgets), for ``models``
        only when given (sources then: the jobs of those models' cells, see :attr:`cell_jobs`)."""
        keep = other.model_notes if models is None else [(m, t) for m, t in other.model_notes if m in models]
        self.model_notes += [n for n in keep if n not in self.model_notes]
        jobs = other.sources if models is None else [j for (m, _l), js in other.cell_jobs.items() if m in models
                                                     for j in js]
        self.sources = sorted(set(self.sources) | set(jobs))
        self.names.update(other.names)


def score_grid(df: pd.DataFrame, task: str, budget: float, models: list[str] | None = None,
               method_names: list[str] | None = None, labels: list[str] | None = None) -> Grid | None:
    """Build the cells of one task at one budget.

    Args:
        df: the frame of :func:`report_data.load_results`.
        task: task name to select.
        budget: budget of the compressed methods (the full cache is taken at any budget).
        models: restrict to these model keys (default: every model key with a compressed job).
        method_names: restrict compressed methods to these registry names.
        labels: restrict to these labels (default: the main label of each method name, so that
            ablation presets stay out of the main tables).

    Returns:
        The grid, or None when no compressed job matches (the artifact has no inputs).
    """
    comp = df[(df["task"] == task) & (df["method_name"] != FULL) & ((df["budget"] - budget).abs() < 1e-9)]
    if method_names is not None:
        comp = comp[comp["method_name"].isin(method_names)]
    if models is not None:
        comp = comp[comp["model_key"].isin(models)]
    stand_ins: dict[str, tuple[str, str]] = {}
    if labels is None:
        labels = list(main_labels(comp))
        stand_ins = main_label_fallbacks(comp)
    comp = comp[comp["method"].isin(labels)]
    if comp.empty:
        return None
    pairs = comp[["method_name", "method"]].drop_duplicates()
    ordered = sorted(zip(pairs["method_name"], pairs["method"]), key=lambda p: method_sort_key(*p))
    model_keys = sorted(comp["model_key"].unique(), key=model_sort_key)
    grid = Grid(task, budget, model_keys, None, list(dict.fromkeys(lab for _n, lab in ordered)))
    grid.names = {lab: name for name, lab in ordered}
    full_labels: list[str] = []
    where = f"{task}, budget {budget_text(budget)}"

    subsets: dict[str, str] = {}  # job -> the keys that limited its scored samples ("" = whole datasets)

    def add_cell(mk: str, key: str, rows: pd.DataFrame) -> None:
        rows = pick_variant(rows)
        grid.cells[(mk, key)], grid.cell_jobs[(mk, key)] = cell_scores(rows)
        used = grid.cell_jobs[(mk, key)]
        subsets.update(zip(rows["job"], rows["subset"]))
        scored: dict[str, int] = {}
        for job, complete, n in zip(rows["job"], rows["complete"], rows["n"].fillna(0)):
            if not complete and job in used:  # an unused job (left out, noted below) does not count
                scored[job] = scored.get(job, 0) + int(n)
        left = left_out_note(f"{mk} / {'full cache' if key == chr(0) + 'full' else key} ({where})", rows, used)
        if left:
            grid.note(mk, left)
        for job, n in scored.items():
            grid.note(mk, incomplete_note(job, n))
        if scored:
            grid.incomplete.add((mk, key))
        for note in subset_notes(rows, grid.cell_jobs[(mk, key)]):
            grid.note(mk, note)

    for mk in model_keys:
        frows = full_rows(df, task, mk)
        if frows.empty:
            grid.note(mk, f"absent: no full-cache job for {mk} ({task})")
        else:
            add_cell(mk, "\0full", frows)
            full_labels.append(frows.loc[frows["job"] == grid.cell_jobs[(mk, "\0full")][0], "method"].iloc[0])
        for label in grid.labels:
            rows = comp[(comp["model_key"] == mk) & (comp["method"] == label)]
            if rows.empty:
                grid.note(mk, f"absent: no job for {mk} / {label} ({where})")
                continue
            add_cell(mk, label, rows)
            if label in stand_ins:
                name, presets = stand_ins[label]
                grid.note(mk, f"stand-in: the {name} row is {label} (preset {presets}): preset {name}, "
                              f"{name}'s main configuration, has no job for {mk} ({where})")
    if full_labels:
        grid.full_label = max(set(full_labels), key=full_labels.count)
        grid.names[grid.full_label] = FULL
        for mk in model_keys:
            if (mk, "\0full") in grid.cells:
                grid.cells[(mk, grid.full_label)] = grid.cells.pop((mk, "\0full"))
                grid.cell_jobs[(mk, grid.full_label)] = grid.cell_jobs.pop((mk, "\0full"))
    for mk in model_keys:
        kinds = sorted({subsets[j] or "whole datasets" for (m, _l), jobs in grid.cell_jobs.items() if m == mk
                        for j in jobs})
        if len(kinds) > 1:
            grid.note(mk, f"mixed samples: the rows of {mk} were scored on different sample sets "
                          f"({' / '.join(kinds)}; {where}); compare them with care")
    grid.datasets = order_datasets(d for cell in grid.cells.values() for d in cell)
    for (mk, label), cell in grid.cells.items():
        lacking = [d for d in grid.datasets if d not in cell]
        if lacking:
            grid.note(mk, f"absent: {mk} / {label} has no score for {', '.join(lacking)} ({where})")
    grid.sources = sorted({j for jobs in grid.cell_jobs.values() for j in jobs})
    return grid


def dense_ranks(values: dict[str, float]) -> dict[str, int]:
    """Rank methods by score, higher is better; ties share the better rank and the next rank
    follows on (1, 1, 2): the convention that reproduces the SelKV paper's Avg Rank column.

    Args:
        values: ``{label: score}``; NaN scores are left out (no rank).
    """
    present = sorted({v for v in values.values() if not math.isnan(v)}, reverse=True)
    pos = {v: i + 1 for i, v in enumerate(present)}
    return {k: pos[v] for k, v in values.items() if not math.isnan(v)}


def average_rank(grid: Grid, model: str) -> dict[str, float]:
    """SelKV Table 1's Avg Rank: mean over the grid's datasets of each compressed method's rank
    among the model's compressed methods (full cache excluded); NaN for a method missing a dataset.
    """
    per_label: dict[str, list[int]] = {lab: [] for lab in grid.labels}
    for d in grid.datasets:
        ranks = dense_ranks({lab: grid.score(model, lab, d) for lab in grid.labels})
        for lab in grid.labels:
            if lab in ranks:
                per_label[lab].append(ranks[lab])
    n = len(grid.datasets)
    return {lab: (sum(r) / n if n and len(r) == n else math.nan) for lab, r in per_label.items()}
