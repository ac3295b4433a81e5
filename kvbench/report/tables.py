"""The report's tables and figures from the tidy frame: a score table per task × model key, the seed papers' tables
and figures, NIAH heatmaps. Each builder returns a list of :class:`Artifact` (empty without inputs); NaN: missing."""

import hashlib
import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import offset_copy

from eval.longbench import CATEGORIES
from eval.longbench_v2 import BREAKDOWN

from kvbench.job.plots import draw_niah_heatmap, niah_colorbar, plt
from kvbench.job.store import read_json
from kvbench.report.data import (DATASET_ABBR, FULL, LONG_CONTEXT_TOKENS, budget_cell, budget_semantics, budget_text,
                                 display_name, method_sort_key, model_sort_key, niah_grid_records, order_datasets,
                                 paper_order, presets)


@dataclass
class Artifact:
    """A table (``data``: label columns as text, values as floats) or a figure (``fig``)."""

    name: str
    caption: str
    data: pd.DataFrame | None = None
    fig: object = None
    bold: set = field(default_factory=set)  # (row position, column) cells printed in bold
    headers: dict = field(default_factory=dict)  # column -> display name (default: dataset abbreviations)
    signed: set = field(default_factory=set)  # columns printed with a sign (Δ)
    sources: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    se: pd.DataFrame | None = None  # standard errors of ``data``'s cells (same index, a subset of columns; NaN: none)
    used: pd.DataFrame | None = None  # the job × dataset rows shown: added to ``sources``, :func:`job_notes` to notes

    def __post_init__(self):
        self.headers = {c: DATASET_ABBR.get(c, c) for c in getattr(self.data, "columns", [])} | self.headers
        used = pd.DataFrame(columns=["job", "dataset", "n", "complete", "subset"]) if self.used is None else self.used
        self.sources, self.notes = sorted({*self.sources, *used["job"]}), [*dict.fromkeys(job_notes(used) + self.notes)]
        words = {p: p if p == "context" else "prompt" for p in sorted(set(used.get("compress", [])))}  # jobs shown
        self.caption = self.caption.replace("ρ of prompt tokens", " or ".join(
            f"ρ of the {w} tokens (task.compress={p})" for p, w in words.items()) or "ρ of prompt tokens")
        if self.fig is not None:  # the caption below the panels (the figure grows), titles wrapped to their panels
            fig, size, (w, h) = self.fig, FontProperties(size="small").get_size_in_points(), self.fig.get_size_inches()
            for ax in fig.axes:
                width = max(20, int(ax.get_position().width * w * 72 / (0.55 * ax.title.get_fontsize())))
                if text := ax.get_title():
                    ax.title.set_text("\n".join(textwrap.fill(line, width) for line in text.split("\n")))
            lines = textwrap.wrap(self.caption, int(w * 72 / (0.6 * size)))
            below = len(lines) * 1.3 * size / 72 + 0.1  # inches
            fig.set_figheight(h + below)
            fig.get_layout_engine().set(rect=(0, below / (h + below), 1, h / (h + below)))
            fig.text(0.5, 0.005, "\n".join(lines), ha="center", va="bottom", fontsize="small")


def round2(x: float) -> float:
    """Half-up to 2 decimals, the papers' printing (2.625 -> 2.63)."""
    return math.floor(round(x * 100, 6) + 0.5) / 100


def fmt(value, signed: bool = False, se=None) -> str | None:
    """A cell as printed: text as is, numbers half-up to 2 decimals (``41.20 ± 1.30`` with a standard error); None
    when missing."""
    if isinstance(value, str) or pd.isna(value):  # None, NaN, pd.NA (pandas 3 text columns hold NaN): missing
        return value if isinstance(value, str) else None
    return ("+" if signed and round2(value) > 0 else "") + f"{round2(value):.2f}" + (
        f" ± {round2(se):.2f}" if se is not None and not math.isnan(se) else "")


def bolds(data: pd.DataFrame, cols, ok, by: str | None = None, higher: bool = True) -> set:
    """``(row, col)`` cells of each column's best printed value among rows ``ok`` (per ``by`` group; ties all; none
    where two rows or more print one value: nothing differs)."""
    out = set()
    for col in cols:
        v = data[col][list(ok)].dropna().map(round2)
        g = v.groupby(data.loc[v.index, by] if by else pd.Series(0, v.index))
        alike = (g.transform("nunique") == 1) & (g.transform("size") > 1)
        out |= {(i, col) for i in v.index[(v == g.transform("max" if higher else "min")) & ~alike]}
    return out


def count(n: int, noun: str) -> str:
    """``1 dataset``, ``2 datasets``."""
    return f"{n} {noun}" + "s" * (n != 1)


def span(ns: pd.Series) -> str | None:
    """``5`` or ``2–5``: the range of the counts ``ns`` (NaN dropped); None when there is none."""
    ns = ns.dropna()
    return None if ns.empty else f"{ns.min():.0f}" + f"–{ns.max():.0f}" * bool(ns.min() < ns.max())


def slug(text: str) -> str:
    """``text`` as a file name part; a long one (a model key naming a source path) cut, its hash appended."""
    s = re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()
    return s if len(s) <= 100 else f"{s[:90]}_{hashlib.sha256(s.encode()).hexdigest()[:8]}"


def pick(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One score per ``keys`` × dataset: the preferred job's (finished, most datasets, samples); others fill gaps."""
    scored = rows[rows["score"].notna()]
    stats = scored.groupby("job").agg(done=("complete", "max"), nds=("score", "size"), n=("n", "sum"))
    order = stats.sort_index().sort_values(["done", "nds", "n"], ascending=False, kind="stable").index
    rank = scored["job"].map({j: i for i, j in enumerate(order)})
    return scored.assign(_r=rank).sort_values("_r").drop_duplicates(keys + ["dataset"])


def job_notes(used: pd.DataFrame) -> list[str]:
    """Notes on the jobs whose scores ``used`` (a row per job × dataset) holds: ``unfinished`` (the job has not
    finished or some samples failed; its rows are never bold) and ``subset`` (it scored part of each dataset)."""
    jobs = used.drop_duplicates(["job", "dataset"]).groupby("job").agg(n=("n", "sum"), done=("complete", "all"),
                                                                        subset=("subset", "first"))
    return ([f"unfinished: {j} ({r.n:.0f} samples scored); not bold" for j, r in jobs.iterrows() if not r.done]
            + [f"subset: {j} scored part of each dataset ({r.subset}); not comparable to whole-dataset scores"
               for j, r in jobs.iterrows() if r.subset])


@dataclass
class Grid:
    """One task at one budget: ``scores``, ``se`` (model key, label) × dataset; ``used``: the job rows they come from;
    ``incomplete``: (model key, label) of unfinished jobs."""

    scores: pd.DataFrame
    se: pd.DataFrame
    full: str | None
    labels: list[str]
    names: dict
    used: pd.DataFrame

    def __post_init__(self):
        self.incomplete = set(map(tuple, self.used.loc[~self.used["complete"], ["model_key", "method"]].to_numpy()))
        self.models = sorted({m for m, lab in self.scores.index if lab != self.full}, key=model_sort_key)
        self.datasets = order_datasets(self.scores.columns)
        self.rows = [self.full] * bool(self.full) + self.labels

    def avg(self, mk: str, label: str | None, datasets: list[str] | None = None, se: bool = False) -> float:
        """Mean over ``datasets`` (default: the grid's), NaN when one is missing; ``se``: its standard error."""
        vals = (self.se if se else self.scores).reindex(index=[(mk, label)], columns=datasets or self.datasets).iloc[0]
        return avg_se(vals) if se else vals.mean() if len(vals) and vals.notna().all() else math.nan

    def ok(self, data: pd.DataFrame) -> list[int]:
        """Rows of ``data`` (columns Model, Method) that compete for bold: compressed, finished."""
        return [i for i, m, lab in zip(data.index, data["Model"], data["Method"])
                if lab != self.full and (m, lab) not in self.incomplete]


def grid(df: pd.DataFrame, task: str, budget: float, models=None, names=None, labels=None) -> Grid | None:
    """One task at one budget, full cache at any budget; default ``labels``: a method's preset label, else its shortest
    (noted); a method without a preset of its name (``method=kvpress``, labelled by its press): each label."""
    comp = df[(df["task"] == task) & (df["method_name"] != FULL) & np.isclose(df["budget"], budget)]
    comp = comp[comp["model_key"].isin(models)] if models is not None else comp
    comp = comp[comp["method_name"].isin(names)] if names is not None else comp
    if labels is None:
        labels = []
        for n, g in comp.groupby("method_name"):
            labs = sorted(set(g["method"]))
            labels += [display_name(n)] if display_name(n) in labs else labs if n not in presets() else [min(labs, key=len)]
    comp = comp[comp["method"].isin(labels)]
    if comp.empty:
        return None
    order = sorted(set(zip(comp["method_name"], comp["method"])), key=lambda p: method_sort_key(*p))
    models = sorted(comp["model_key"].unique(), key=model_sort_key)
    full = df[(df["task"] == task) & (df["method_name"] == FULL) & df["model_key"].isin(models)]
    full_label = full["method"].mode().iloc[0] if len(full) else None
    rows = pd.concat([full.assign(method=full_label), comp])
    rows = rows[rows["default"] | ~rows.groupby(["model_key", "method"])["default"].transform("max")]
    used = pick(rows, ["model_key", "method"])
    piv = used.set_index(["model_key", "method", "dataset"])[["score", "se"]].unstack()
    return Grid(piv["score"][order_datasets(piv["score"].columns)], piv["se"], full_label,
                list(dict.fromkeys(lab for _n, lab in order)), {lab: n for n, lab in order}, used)


def avg_se(se: pd.Series) -> float:
    """Standard error of a mean over ``k`` datasets from theirs ``(k,)``: sqrt(Σ SE²) / k; NaN when one is missing."""
    k = len(se)
    return (se.astype(float) ** 2).sum(min_count=k) ** 0.5 / k if k else math.nan


def paired_bootstrap(diffs: dict, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float, float]:
    """Paired comparison of a mean over datasets of per-sample score differences (stratified by dataset).

    ``diffs``: dataset -> ``(n_d,)`` differences B − A of samples matched by id (points). Returns ``(Δ, low, high,
    p)``: the observed mean over datasets of the mean differences; its 95 % percentile interval from a paired
    bootstrap (Koehn 2004: every dataset's differences drawn with replacement); the two-sided p of a paired sign-flip
    randomization test: exact over all 2^pairs sign patterns up to 16 pairs, else ``n_boot`` random ones, add-one
    ``(1 + #{|Δ*| ≥ |Δ|}) / (n_boot + 1)``; it never falls below 2^(1 − pairs), unlike a bootstrap p."""
    rng = np.random.default_rng(seed)
    boot = np.mean([d[rng.integers(0, len(d), (n_boot, len(d)))].mean(axis=1) for d in diffs.values()], axis=0)
    w = [d / len(d) / len(diffs) for d in diffs.values()]  # Δ = the sum of all w; Δ* flips their signs
    diff, m = float(sum(x.sum() for x in w)), sum(map(len, w))
    flip = ((((np.arange(2**m)[:, None] >> np.arange(m)) & 1) * 2 - 1.0) @ np.concatenate(w) if m <= 16
            else sum(rng.choice([-1.0, 1.0], (n_boot, len(x))) @ x for x in w))
    hits = (np.abs(flip) >= abs(diff) - 1e-9).sum()
    return diff, *np.percentile(boot, [2.5, 97.5]), hits / 2**m if m <= 16 else min(1.0, (1 + hits) / (n_boot + 1))


def paired_table(name: str, what: str, heads: list[dict], samples: list[pd.Series], ref: int, scopes: dict, sources):
    """Each row vs row ``ref`` on the samples both scored (``samples``: dataset -> {id: score}), per scope (a name ->
    datasets averaged): :func:`paired_bootstrap`. [] when no row has per-sample records to pair."""
    rows = []
    for i, (head, mine) in enumerate(zip(heads, samples)):
        for scope, ds in scopes.items():
            a, b = ([x.get(d) if isinstance(x.get(d), dict) else {} for d in ds] for x in (samples[ref], mine))
            pairs = {d: 100 * (pd.Series(y) - pd.Series(x)).dropna().to_numpy(float) for d, x, y in zip(ds, a, b)}
            if i != ref and all(len(p) for p in pairs.values()):
                diff, low, high, p = paired_bootstrap(pairs)
                rows.append({**head, "Over": scope, "Pairs": str(sum(map(len, pairs.values()))), "Δ": diff,
                             "CI low": low, "CI high": high, "p": f"{p:.4f}"})
    caption = (f"{what}: each row minus {' / '.join(filter(None, heads[ref].values()))} on the Pairs of samples both "
               "scored. Δ: mean over datasets (points); CI (95 %): paired bootstrap; p (two-sided): sign-flip test.")
    return [Artifact(name, caption, pd.DataFrame(rows), signed={"Δ", "CI low", "CI high"}, sources=sources)] if rows \
        else []


def score_tables(df: pd.DataFrame, root: Path | None = None) -> list[Artifact]:
    """A table per task × model key (but ``cache.*``: a Bits column where cache widths differ), a row per (label,
    variant, budget, bits): dataset scores ± SE, Avg, n; bold: see caption.
    With per-sample records, also ``paired_<task>_<model>``: each row vs the full cache (else the first row)."""
    out, scored = [], df[df["score"].notna()]
    natural = lambda s: [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s)]
    for task, mk in sorted(set(zip(scored["task"], scored["table_key"])), key=lambda p: (p[0], model_sort_key(p[1]))):
        sel = df[(df["task"] == task) & (df["table_key"] == mk)]
        sel = sel.assign(bkey=sel["budget"].where(sel["method_name"] != FULL, -1.0).fillna(-1.0),
                         bits=sel["bits"].fillna(0.0))  # 0: the model dtype's cache
        picked = pick(sel, ["method", "variant", "bkey", "bits"])
        avg_ds = order_datasets(picked["dataset"])  # the NIAH strict match: a column beside each dataset, not averaged
        strict = picked[picked["strict"].notna()]
        used = pd.concat([picked, strict.assign(dataset=strict["dataset"] + " strict", score=strict["strict"],
                                                se=strict["strict_se"], samples=strict["strict_samples"])])
        datasets = order_datasets(used["dataset"])
        keys = sorted(set(zip(sel["method_name"], sel["method"], sel["variant"], sel["bkey"], ~sel["default"],
                              sel["bits"])), key=lambda k: (method_sort_key(k[0], k[1]), k[3], -(k[5] or 99), k[4],
                                                            natural(k[2])))
        show_variant, show_bits = any(k[2] for k in keys), len({k[5] for k in keys}) > 1
        grids = {j: niah_grid_records(Path(root) / j)[1] for j in set(used["job"])} if task == "niah" and root else {}
        rows, errs, samples, notes, comp, kinds = [], [], [], [], [], []
        for name, label, variant, b, _nd, bits in keys:
            part, mine = (t[(t["method"] == label) & (t["variant"] == variant) & (t["bkey"] == b) & (t["bits"] == bits)]
                          for t in (sel, used))
            btext = None if b < 0 else budget_text(b)
            cells = mine.set_index("dataset").reindex(datasets)
            rows.append({"Method": label, **({"Variant": variant} if show_variant else {}), "Budget": btext,
                         **({"Bits": f"{bits:.0f}" if bits else "–"} if show_bits else {}),
                         **cells["score"], "Avg": cells.loc[avg_ds, "score"].mean(skipna=False),
                         "n": span(cells.loc[avg_ds, "n"])})
            errs.append({**cells["se"], "Avg": avg_se(cells.loc[avg_ds, "se"])})
            samples.append(cells["samples"])
            kinds.append(" / ".join(sorted({" ".join(filter(None, [grids.get(j), s]))
                                            for j, s in zip(mine["job"], mine["subset"])})))
            kept_all = name != FULL and (part["compressed_fraction"] == 0).all()
            ratio = (part["kept_tokens"] / part["prompt_tokens"]).mean()
            raised = 0 < b < 1 and ratio > max(1.5 * b, b + 0.02)  # the method keeps at least its window/sinks/recent
            kept = "every prompt whole" if kept_all else f"{100 * ratio:.1f} % of the prompt tokens" if raised else ""
            notes += [f"not bold: {label} at budget {btext} kept {kept}"] * bool(kept)
            if name != FULL and b != 1.0 and not kept and mine["complete"].all():
                comp.append(len(rows) - 1)
        if len(set(kinds)) > 1:
            notes.append("not comparable: rows scored on different sample sets or NIAH grids (" + "; ".join(
                sorted({k or "whole datasets" for k in kinds})) + "); no bold")
            comp = []
        budgets = "; " + budget_semantics(bs) if (bs := [k[3] for k in keys if k[3] >= 0]) else ""
        caption = (f"Scores of {mk} on {task}, a row per method" + ", method variant" * show_variant + (
                   ", budget and cache width (Bits: cache.bits; –: the model dtype)" if show_bits else " and budget")
                   + f"{budgets}; bold: best finished compressed row. Score: round(100·mean, 2) of per-sample scores ± "
                   "SE (SD/√n; Avg: √ΣSE²/datasets); n: samples" + "; strict: % of samples holding the needle's "
                   "answer" * (not strict.empty) + ".")
        name = f"scores_{slug(task)}_{slug(mk)}"
        data = pd.DataFrame(rows, columns=["Method", *["Variant"] * show_variant, "Budget", *["Bits"] * show_bits,
                                           *datasets, "Avg", "n"])
        out.append(Artifact(name, caption, data, bold=bolds(data, [*datasets, "Avg"], comp), used=picked,
                            notes=notes, se=pd.DataFrame(errs, columns=[*datasets, "Avg"])))
        heads = [{k: r[k] for k in ("Method", "Variant", "Budget", "Bits") if k in r} for r in rows]
        ref = next((i for i, k in enumerate(keys) if k[0] == FULL), 0)
        out += paired_table(name.replace("scores_", "paired_", 1), f"Paired comparison on {task} of {mk}", heads,
                            samples, ref, {"Avg": avg_ds} | {d: [d] for d in datasets if d not in avg_ds}, used["job"])
    return out


AVERAGES = {  # task -> the caption of its averages tables (formatted with the model key), columns, headers
    "longbench_v2": ("LongBench-v2 accuracy (%) of {}: overall, easy/hard, short/medium/long (result.py's columns), a "
                     "row per job.", BREAKDOWN, {c: c.capitalize() for c in BREAKDOWN}),
    "loogle": ("LooGLE automatic metrics (×100) of {}, a row per job: cloze exact/partial match (matched / all masks), "
               "QA and summarization ROUGE recall and BLEU (mean over questions); loogle: the mean of the task "
               "scores.",),
    "zero_scrolls": ("ZeroSCROLLS (validation split) of {}, a row per job: zero_scrolls (the mean of the task scores) "
                     "and the mean ROUGE-1/2/L F (×100) of the summarization tasks, whose score is their geometric "
                     "mean.",)}


def averages_tables(df: pd.DataFrame, root: Path, task: str) -> list[Artifact]:
    """A table per model key of ``task`` (LongBench-v2's ``result.py`` columns, LooGLE's ``automatic_eval.py`` metrics,
    ZeroSCROLLS's score and ROUGE-1/2/L: :data:`AVERAGES`), a row per job (Method, Variant where jobs of one label
    differ in method fields, Budget), its ``summary.json`` ``averages`` as columns (the task's columns in order, else
    every key in stored order)."""
    caption, columns, headers = (*AVERAGES[task], (), {})[:3]
    out = []
    for mk, rows in df[(df["task"] == task) & df["score"].notna()].groupby("model_key"):
        part = paper_order(rows.drop_duplicates("job"), ["method", "budget"])
        heads = ["Method", *["Variant"] * bool(part["variant"].any()), "Budget"]  # jobs of one label apart, as score_tables
        found = [{"Method": r.method, "Variant": r.variant, "Budget": budget_cell(r.method_name, r.budget),
                  **(read_json(Path(root) / r.job / "summary.json").get("averages") or {})} for r in part.itertuples()]
        cols = list(columns) or list(dict.fromkeys(k for r in found for k in r if k not in ("Method", "Variant", "Budget")))
        data = pd.DataFrame(found, columns=[*heads, *cols])
        out.append(Artifact(f"{slug(task)}_{slug(mk)}", caption.format(mk), data, used=rows, headers=headers))
    return out


def selkv_table1(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench", long: bool = False):
    """SelKV Table 1 (per model, methods × datasets, Avg, Δ, Avg Rank); ``long``: Table 7 (inputs >= 16k tokens)."""
    keys = df.loc[df["max_input_tokens"] >= LONG_CONTEXT_TOKENS, "model_key"].unique() if long else None
    g = grid(df, task, budget, models=keys) if not long or len(keys) else None
    if g is None:
        return []
    rows = []
    for mk in g.models:
        ranks = g.scores.reindex([(mk, lab) for lab in g.labels]).rank(method="dense", ascending=False).mean(
            axis=1, skipna=False).droplevel(0)
        rows += [{"Model": mk, "Method": lab, **({} if long else g.scores.reindex([(mk, lab)]).iloc[0]),
                  "Avg": g.avg(mk, lab), "Δ": g.avg(mk, lab) - g.avg(mk, g.full) if lab != g.full else math.nan,
                  **({} if long else {"Avg Rank": ranks.get(lab, math.nan)})} for lab in g.rows]
    data = pd.DataFrame(rows)
    caption = (f"LongBench {'average' if long else 'results'} ({count(len(g.datasets), 'dataset')})" + f", inputs ≥ "
               f"{LONG_CONTEXT_TOKENS} tokens," * long + f" at a {budget_text(budget)} KV budget (" + budget_semantics(
                   [budget]) + "); bold: best compressed. Δ: gap to the full cache; Avg Rank: mean rank per dataset.")
    bold = bolds(data, ["Avg"] + [*g.datasets, "Δ"] * (not long), g.ok(data), "Model")
    bold |= set() if long else bolds(data, ["Avg Rank"], g.ok(data), "Model", higher=False)
    return [Artifact("selkv_table7" if long else "selkv_table1", caption, data, bold=bold, signed={"Δ"},
                     used=g.used, headers={"Avg": f"Avg ({len(g.datasets)} ds)"} if long else {})]


def selkv_table4(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Artifact]:
    """SelKV Table 4: mean over each LongBench category's datasets present, per model × category."""
    g = grid(df, task, budget)
    if g is None:
        return []
    cats = {c: [d for d in g.datasets if d in m] for c, m in CATEGORIES.items()}
    data = pd.DataFrame([{"Model": mk, "Category": c, **{lab: g.avg(mk, lab, ds) for lab in g.rows}}
                         for mk in g.models for c, ds in cats.items() if ds], columns=["Model", "Category", *g.rows])
    v = data[g.labels].where(pd.DataFrame({lab: [(m, lab) not in g.incomplete for m in data["Model"]]
                                           for lab in g.labels}))  # bold: best per row (a column of v.T)
    bold = {(i, lab) for lab, i in bolds(v.T, v.index, v.columns)}
    caption = (f"Category-level averages on LongBench ({budget_text(budget)} KV budget; {budget_semantics([budget])}):"
               " mean over the category's datasets present; bold: best compressed method per category.")
    return [Artifact("selkv_table4", caption, data, bold=bold, used=g.used)]


def budget_grids(df: pd.DataFrame, task: str, ratio: bool) -> tuple[dict[float, Grid], list[str]]:
    """A grid per retention ratio (budget <= 1) or per token budget among the task's compressed jobs; the model keys
    in two grids or more."""
    b = df.loc[(df["task"] == task) & (df["method_name"] != FULL), "budget"].dropna()
    grids = {float(x): g for x in sorted(b[(b <= 1) == ratio].unique()) if (g := grid(df, task, float(x)))}
    counts = pd.Series([m for g in grids.values() for m in g.models], dtype=object).value_counts()
    return grids, sorted(counts.index[counts >= 2], key=model_sort_key)


def sweep(grids: dict[float, Grid], mk: str, dataset: str | None = None, se: bool = False) -> pd.DataFrame:
    """One model's average over the datasets (or one dataset's score; ``se``: its SE), label × budget; full cache in
    every column."""
    present = {b: g for b, g in grids.items() if mk in g.models}
    ds = [dataset] if dataset else order_datasets(d for g in present.values() for d in g.datasets)
    names = {lab: n for g in present.values() for lab, n in g.names.items()}
    full = next((g.full for g in present.values() if g.full), None)
    labels = [full] * bool(full) + sorted(set(names), key=lambda lab: method_sort_key(names[lab], lab))
    table = pd.DataFrame({b: {lab: g.avg(mk, lab, ds, se) for lab in labels} for b, g in present.items()})
    if full and table.loc[full].notna().any():
        table.loc[full] = table.loc[full].dropna().iloc[0]
    return table


def sweep_panel(ax, grids: dict[float, Grid], mk: str, ratio: bool, dataset: str | None = None, band=False) -> None:
    """One model's average over the datasets (or ``dataset``'s score) against the budget (:func:`sweep`) on ``ax``: the
    full cache (:func:`reference`), a line per method with ±1 SE (error bars; ``band``: bands; :func:`draw_lines`),
    ticks at the budgets, y from 0 (scores 0-100) over at least 5 points."""
    t, err = sweep(grids, mk, dataset), sweep(grids, mk, dataset, True).fillna(0.0)
    full, x = next((g.full for g in grids.values() if g.full), None), {b: 100 * b if ratio else b for b in t.columns}
    if not ratio:
        ax.set_xscale("log", base=2)
    if full in t.index and t.loc[full].notna().any():  # the full cache keeps every token: one score at every budget
        late = not band and any((mk, full) in g.incomplete for g in grids.values())  # bands: the caption says it
        reference(ax, t.loc[full].iloc[0], err.loc[full].iloc[0], full + " (unfinished)" * late)
    lines = {lab: y.dropna().rename(x) for lab, y in t.iterrows() if lab != full and y.notna().any()}
    draw_lines(ax, lines, {lab: err.loc[lab].rename(x)[y.index] for lab, y in lines.items()},
               {lab: [x[b] for b in t.columns if (mk, lab) in grids[b].incomplete] for lab in lines}, band,
               ticks={x[b]: budget_text(b) for b in x})
    lo, hi = ax.get_ylim()
    lo = max(0.0, min(lo, (lo + hi) / 2 - 2.5))
    ax.set_ylim(lo, min(103.0, max(hi, lo + 5)))
    ax.set_xlabel("KV retention ratio ρ (% of prompt tokens)" if ratio else "KV budget (tokens per layer per KV head)")


def used_by(grids: dict[float, Grid], models: list[str]) -> pd.DataFrame:
    return pd.concat([g.used[g.used["model_key"].isin(models)] for g in grids.values()])


def sweep_table(name: str, grids: dict[float, Grid], models: list[str], caption: str, ratio: bool) -> Artifact:
    """Average per label × (model, budget) (``ratio``: one model, a column per ratio); bold: best per column."""
    col = (lambda mk, b: budget_text(b)) if ratio else (lambda mk, b: f"{mk} @{b:g}")
    cols = {col(mk, b): (mk, b, g) for mk in models for b, g in grids.items()}
    t = pd.concat([sweep(grids, mk).rename(columns=lambda b, mk=mk: col(mk, b)) for mk in models], axis=1)
    names = {lab: n for g in grids.values() for lab, n in g.names.items()}  # the full cache's label: none, first
    data = t.loc[sorted(t.index, key=lambda lab: method_sort_key(names.get(lab, FULL), lab))]
    data = data.rename_axis("Method").reset_index()
    bold = set().union(*(bolds(data, [c], cols[c][2].ok(data.assign(Model=cols[c][0]))) for c in t.columns))
    return Artifact(name, caption, data, bold=bold, used=used_by(grids, models))


def selkv_ratio_tables(df: pd.DataFrame, task: str = "longbench") -> list[Artifact]:
    """SelKV Tables 5 (llama31), 6 (gemma2), ``selkv_ratios_<model>``: LongBench average per method × ratio (>= 2)."""
    (grids, models), out = budget_grids(df, task, ratio=True), []
    n_ds = len(order_datasets(d for g in grids.values() for d in g.datasets))
    for mk in models:
        name = {"llama31": "selkv_table5", "gemma2": "selkv_table6"}.get(mk.split(" ")[0], "")
        name = name if name and name not in {a.name for a in out} else f"selkv_ratios_{slug(mk)}"
        out.append(sweep_table(name, grids, [mk], f"LongBench average ({count(n_ds, 'dataset')}) of {mk} at KV "
                               f"retention ratios ({budget_semantics(grids)}). Best compressed method per ratio in bold.",
                               ratio=True))
    return out


def compresskv_table1(df: pd.DataFrame, budgets=(256, 1024), task: str = "longbench") -> list[Artifact]:
    """CompressKV Table 1: LongBench average per method × (model, token budget); full cache repeated."""
    grids = {float(b): g for b in budgets if (g := grid(df, task, float(b))) is not None}
    models = sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
    return [sweep_table("compresskv_table1", grids, models, f"Average LongBench scores under fixed KV budgets ("
                        f"{budget_semantics(grids)}). Bold: best compressed per column.", False)] if grids else []


def staged_table(df: pd.DataFrame, name: str, budget: float, task: str = "longbench") -> list[Artifact]:
    """Component analyses per model key: ``selkv_table2`` (labels by Merge, Gate, Comp), ``compresskv_table3a``."""
    sel = df[(df["task"] == task) & np.isclose(df["budget"], budget)]
    rows, ok, used, selkv = [], [], [], name == "selkv_table2"
    main, snap = display_name("compresskv"), display_name("snapkv")
    on = lambda v: None if v is None else str(v).lower() not in ("", "none", "off", "false", "0")  # None: unsaid (? < – < ✓)
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        mine = sel[(sel["model_key"] == mk) & (sel["method_name"] == ("selkv" if selkv else "compresskv"))]
        labels = set(mine["method"])
        if len(labels) < 2 or not selkv and main not in labels:
            continue
        by_params = {p: lab for lab, p in sorted(zip(mine["method"], mine["params"]), key=lambda x: len(x[0]))}
        flags = {lab: {"Gate": on(p.get("gate")), "Comp": on(p.get("compensation")),  # gate: soft, none, off (evict)
                       "Merge": p.get("merge", None if p.get("gate") is None else str(p["gate"]).lower() != "off")}
                 for p, lab in ((json.loads(p), lab) for p, lab in by_params.items())}
        marks = {lab: {k: "?" if v is None else "✓" if v else "–" for k, v in f.items()} for lab, f in flags.items()}
        order = sorted(marks, key=lambda lab: ([marks[lab][k] for k in ("Merge", "Gate", "Comp")], lab)) if selkv else [
            snap] * (snap in set(sel.loc[sel["model_key"] == mk, "method"])) + [lab for lab in map(display_name, (
                "compresskv_snapkv", "compresskv_uniform", "compresskv")) if lab in labels]  # Table 3a's presets
        g = grid(df, task, budget, models=[mk], names=["selkv"] if selkv else ["snapkv", "compresskv"], labels=order)
        avgs = [g.avg(mk, lab) for lab in order]
        if selkv and g.full:
            rows.append({"Model": mk, "Method": g.full, **dict.fromkeys(("Gate", "Comp", "Merge"), "–"),
                         "Avg": g.avg(mk, g.full)})
        ok += range(len(rows), len(rows) + len(order))
        rows += [{"Model": mk, "Method": lab, **(marks[lab] if selkv else {}), "Avg": a, "Δ prev": a - p,
                  **({"Δ full": a - g.avg(mk, g.full)} if selkv else {})}
                 for lab, a, p in zip(order, avgs, [math.nan] + avgs)]
        used.append(g.used)
    if not rows:
        return []
    data = pd.DataFrame(rows).rename(columns={"Method": "Configuration"} if selkv else {})
    caption = (f"{'Ablation of SelKV' if selkv else 'Component analysis of CompressKV'} on LongBench at budget "
               f"{budget_text(budget)} ({budget_semantics([budget])}). Δ prev, Δ full: vs the row above, full cache.")
    return [Artifact(name, caption, data, bold=bolds(data, ["Avg"], ok, "Model") if selkv else set(),
                     signed={"Δ prev", "Δ full"}, used=pd.concat(used))]


def compresskv_table2b(df: pd.DataFrame, budget: float = 256, task: str = "longbench") -> list[Artifact]:
    """CompressKV Table 2(b): LongBench average per model key with tokens selected by traditional retrieval heads
    (TRH, ``compresskv_trh``) vs semantic retrieval heads (SRH, ``compresskv_uniform``), uniform layer budgets;
    Δ: gap to TRH (points)."""
    heads = {display_name("compresskv_trh"): "TRH", display_name("compresskv_uniform"): "SRH"}
    g = grid(df, task, budget, names=["compresskv"], labels=list(heads))
    if g is None:
        return []
    data = pd.DataFrame([{"Model": mk, "Heads": heads[lab], "Method": lab, "Avg": g.avg(mk, lab),
                          "Δ": g.avg(mk, lab) - g.avg(mk, [*heads][0])} for mk in g.models for lab in heads])
    caption = (f"CompressKV with TRH vs SRH token selection (uniform layer budgets) on LongBench ({len(g.datasets)} "
               f"datasets) at budget {budget_text(budget)} ({budget_semantics([budget])}). Δ: gap to TRH; bold: best.")
    return [Artifact("compresskv_table2b", caption, data, bold=bolds(data, ["Avg"], g.ok(data), "Model"),
                     signed={"Δ"}, used=g.used[g.used["method"].isin(heads)])]


def sensitivity_table(df, name: str, method: str, budget: float, task: str = "longbench", per_dataset=True,
                      preset: str | None = None):
    """A row per variant (differing fields) of the label of ``preset`` (default: the method's main label) (SelKV Table
    3; CompressKV Table 3b: ``compresskv_uniform``, SRH selection with uniform layer budgets), Δ default."""
    label = display_name(preset or method)
    sel = df[(df["task"] == task) & (df["method_name"] == method) & np.isclose(df["budget"], budget)
             & (df["method"] == label)]
    used = pick(sel, ["model_key", "variant"])
    datasets = order_datasets(used["dataset"])
    params = {p: json.loads(p) for p in sel["params"].unique()}
    keys = sorted({k for p in params.values() for k in p if len({json.dumps(q.get(k)) for q in params.values()}) > 1})
    num = lambda v: (0, float(v), "") if isinstance(v, (int, float)) else (1, 0.0, str(v))
    rows = []
    for mk, mine in sorted(used.groupby("model_key"), key=lambda kv: model_sort_key(kv[0])):
        if mine["variant"].nunique() < 2:
            continue
        for (p, dflt), v in sorted(mine.groupby(["params", "default"]),
                                   key=lambda x: [num(params[x[0][0]].get(k)) for k in keys]):
            vals = v.set_index("dataset")["score"].reindex(datasets)
            rows.append({"Model": mk, **{k: str(params[p].get(k, "–")) for k in keys}, "Default": "✓" * bool(dflt),
                         **(vals if per_dataset else {}), "Avg": vals.mean(skipna=False)})
    if not rows:
        return []
    data, headers = pd.DataFrame(rows), {"window_size": "W", "kernel_size": "K"}
    data["Δ default"] = data["Avg"] - data["Avg"].where(data["Default"] != "").groupby(data["Model"]).transform("first")
    caption = (f"Sensitivity of {label} to {', '.join(headers.get(k, k) for k in keys)} on LongBench at "
               f"budget {budget_text(budget)} ({budget_semantics([budget])}). Δ default: gap to the default (✓).")
    return [Artifact(name, caption, data, bold=bolds(data, [*datasets] * per_dataset + ["Avg"], data.index, "Model"),
                     signed={"Δ default"}, used=used, headers=headers)]


def _figure(n_rows: int, n_cols: int, w: float = 4.2, h: float = 3.2):
    return plt.subplots(n_rows, n_cols, figsize=(w * n_cols, h * n_rows + 0.15), squeeze=False, layout="constrained")


def dodge(n: int, step: float = 6.0) -> list[float]:
    """Horizontal offsets (points) of ``n`` lines' markers at one x, ``step`` apart, centred on it."""
    return [step * (k - (n - 1) / 2) for k in range(n)]


def legend(ax, handles=None):
    """The legend right of the axes (constrained layout makes room), never over the data."""
    return ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)


def reference(ax, y: float, se: float, label: str) -> None:
    """The full cache's horizontal dashed line at ``y`` with a ±``se`` band (NaN: none)."""
    ax.axhline(y, color="black", linestyle="--", linewidth=1.2, label=label, zorder=5)
    ax.axhspan(y - np.nan_to_num(se), y + np.nan_to_num(se), color="grey", alpha=0.2, linewidth=0)


def draw_lines(ax, series: dict, err: dict | None = None, hollow: dict | None = None, band: bool = False,
               styles: dict | None = None, show_legend: bool = True, ticks: dict | None = None) -> None:
    """The one rule of every line figure, so that tied lines stay visible: line ``k`` of ``series`` (``{label:
    pd.Series}``, y indexed by x, in legend order) gets colour ``Ck``, solid with round markers (``styles[label]``
    overrides; dashed is the full cache's, :func:`reference`); the lines that share an x with another are drawn side
    by side, the k-th of n ``dodge(n)[k]`` points sideways (the data stay exact: the shift is in the transform; the x
    range grows to keep the markers inside). ``err[label]``: ±1 SE, error bars (``band``: a shaded band);
    ``hollow[label]``: the x of an unfinished job's points (hollow markers); ``ticks``: ``{x: text}``, the only x ticks.
    Set the x scale first."""
    shared = [a for a, y in series.items() if any(b != a and y.index.isin(z.index).any() for b, z in series.items())]
    shift = dict(zip(shared, dodge(len(shared))))
    for k, (label, y) in enumerate(series.items()):
        style = {"color": f"C{k % 10}", "marker": "o", "linestyle": "-"} | (styles or {}).get(label, {})
        e = (err or {}).get(label)
        if e is not None and not band:
            drawn = list(ax.errorbar(y.index, y, e, capsize=2, label=label, **style).get_children())
        else:
            drawn = ax.plot(y.index, y, label=label, **style)
            if e is not None:
                drawn.append(ax.fill_between(y.index, y - e, y + e, color=style["color"], alpha=0.2, linewidth=0))
        late = y[y.index.isin((hollow or {}).get(label, []))]
        drawn += ax.plot(late.index, late, style["marker"], mfc="white", mec=style["color"], zorder=4) if len(late) else []
        for artist in drawn:  # after autoscaling to the data; a score of 0 sits on the axis
            artist.set_transform(offset_copy(ax.transData, ax.figure, x=shift.get(label, 0), units="points")), artist.set_clip_on(False)
    pad = (max(shift.values(), default=0) + 8) * ax.figure.dpi / 72  # pixels
    px = ax.transData.transform([(x, 0) for x in ax.get_xlim()])[:, 0] + [-pad, pad]
    ax.set_xlim(*ax.transData.inverted().transform([(x, 0) for x in px])[:, 0])
    if show_legend:
        legend(ax, ax.get_legend_handles_labels()[0] + [Line2D([], [], marker="o", ls="", mfc="white", mec="grey", label="unfinished job")] * any(
            len((hollow or {}).get(lab, [])) for lab in series))
    if ticks:
        ax.set_xticks(list(ticks), list(ticks.values()))
        ax.minorticks_off()


def selkv_fig2(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Artifact]:
    """SelKV Figure 2: bars of each method's LongBench average − the full cache's per model (unfinished: hatched)."""
    g = grid(df, task, budget)
    if g is None or g.full is None:
        return []
    ax, width, late = _figure(1, 1, w=max(4.5, 1.6 * len(g.models) + 2))[1][0, 0], 0.8 / len(g.labels), []
    for j, lab in enumerate(g.labels):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(g.models))]
        ys = [g.avg(mk, lab) - g.avg(mk, g.full) for mk in g.models]
        errs = [math.hypot(g.avg(mk, lab, se=True), g.avg(mk, g.full, se=True)) for mk in g.models]
        for x, y, mk, bar in zip(xs, ys, g.models, ax.bar(xs, ys, width, yerr=errs, capsize=2, label=lab)):
            if math.isnan(y):
                ax.annotate("n/a", (x, 0), (0, -4), textcoords="offset points", ha="center", va="top", rotation=90,
                            color="grey")
            elif {(mk, lab), (mk, g.full)} & g.incomplete:
                bar.set(hatch="///", alpha=0.5)
                late = [Patch(facecolor="white", edgecolor="black", hatch="///", label="unfinished job")]
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(ymargin=0.15, xticks=range(len(g.models)), xticklabels=g.models, xlabel="Model",
           ylabel=f"Δ LongBench average vs {g.full} (points)", title="Gap to the full cache\n(closer to 0 is better)")
    legend(ax, ax.get_legend_handles_labels()[0] + late)
    caption = (f"LongBench ({count(len(g.datasets), 'dataset')}), {budget_semantics([budget])}, ρ = "
               f"{budget_text(budget)}; error bars: ±1 SE, √(SE² + SE full²). Hatched, pale bars: an unfinished job "
               "(fewer samples scored).")
    return [Artifact("selkv_fig2", caption, fig=ax.figure, used=g.used)]


def other_samples(used: pd.DataFrame, full: str | None) -> bool:
    """Whether a full-cache row of ``used`` scored other samples than a compressed row of its model key × dataset
    (sample ids where both list them, else ``n`` and ``subset``)."""
    ref = used[used["method"] == full].drop_duplicates(["model_key", "dataset"])
    pairs = used[used["method"] != full].merge(ref, on=["model_key", "dataset"], suffixes=("", "_f"))
    return any((r.n, r.subset) != (r.n_f, r.subset_f) or isinstance(r.samples, dict) and isinstance(r.samples_f, dict)
               and set(r.samples) != set(r.samples_f) for r in pairs.itertuples())


def budget_sweep_figure(df, name: str, task: str, ratio: bool, title: str, per_dataset: bool = False):
    """Average vs budget, a panel per model (SelKV Fig. 4, CompressKV Figs. 4, 5); ``per_dataset``: SelKV Fig. 5."""
    grids, models = budget_grids(df, task, ratio)
    if not models:
        return []
    present = order_datasets(d for g in grids.values() for d in g.datasets)
    datasets = ([d for d in ("qasper", "musique") if d in present] or present[:4]) if per_dataset else [None]
    fig, axes = _figure(len(models) if per_dataset else 1, len(datasets) if per_dataset else len(models))
    full = next((g.full for g in grids.values() if g.full), None)
    for ax, (mk, ds) in zip(axes.flat, [(mk, ds) for mk in models for ds in datasets]):  # a model × dataset a row
        sweep_panel(ax, grids, mk, ratio, ds)  # one model's average (or one dataset's score) across budgets
        ax.set(ylabel="Score (points)" if ds else "Average score (points)", title=mk + f" — {ds}" * bool(ds))
    fig.suptitle(title)
    used = used_by(grids, models)
    n_text = f"; n = {ns} samples per dataset" if (ns := span(used.loc[used["method"] != full, "n"])) else ""
    what = f"datasets {', '.join(datasets)}, a panel each" if per_dataset else count(len(present), "dataset")
    caption = (f"Task: {task} ({what}){n_text}; {budget_semantics(grids)}; dashed line: full cache" + (
        " (scored on other samples than the compressed points: not a paired comparison)" if other_samples(
            used, full) else "") + "; error bars and band: ±1 SE; methods at one budget drawn side by side.")
    return [Artifact(name, caption, fig=fig, used=used)]


def score_vs_budget(df) -> list[Artifact]:
    """``score_vs_budget_<task>``: a figure per task whose jobs of one model key ran at two budgets or more ([] when
    none did), a panel per model key and kind of budget (:func:`sweep_panel` with bands; the two ``task.compress``
    protocols never share a model key, so never a panel)."""
    out = []
    for task in sorted(df.loc[df["score"].notna(), "task"].unique()):
        panels = [(mk, ratio, grids) for ratio in (True, False) for grids, models in [budget_grids(df, task, ratio)]
                  for mk in models]
        if not panels:
            continue
        fig, axes = _figure(1, len(panels), w=5.6)
        multi = df.loc[(df["task"] == task) & df["score"].notna(), "dataset"].nunique() > 1
        for ax, (mk, ratio, grids) in zip(axes[0], panels):
            sweep_panel(ax, grids, mk, ratio, band=True)
            ax.set(title=mk, ylabel="Average score (points)" if multi else "Score (points)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task}: score against KV budget")
        used = used_by({b: g for _, _, grids in panels for b, g in grids.items()}, [mk for mk, _, _ in panels])
        datasets = sorted(set(used["dataset"]))
        n_text = f"n = {span(used['n'])} samples per dataset"
        caption = (f"Task: {task} ({count(len(datasets), 'dataset')}" + ", score: their mean" * (len(datasets) > 1)
                   + f"); {n_text}; budget = retention ratio ρ of prompt tokens" * any(r for _, r, _ in panels)
                   + "; budget = tokens kept per layer per KV head" * (not all(r for _, r, _ in panels))
                   + "; band: ±1 SE" + "; dashed: full cache" * bool((used["method_name"] == "full").any()) + "; hollow: an unfinished job" * bool(
                       (~used["complete"]).any()) + ".")
        out.append(Artifact(f"score_vs_budget_{slug(task)}", caption, fig=fig, used=used))
    return out


def selkv_fig3(latency: list[dict], source: str = "latency.json") -> list[Artifact]:
    """SelKV Figure 3 from kvbench.tools.latency records (repeats averaged), per model: (a) prefill, compression and decode
    seconds stacked per prompt length and method, (b) decode tokens/s vs prompt length."""
    lat = pd.DataFrame(latency or [])
    if not {"model", "method", "prompt_tokens", "decode_tok_s"} <= set(lat.columns):
        return []
    stages = {"prefill_s": "prefill", "compress_s": "compression", "decode_s": "decode"}
    lat = lat.reindex(columns=[*dict.fromkeys([*lat.columns, *stages, "budget", "device"])])
    means = lat.groupby(["model", "prompt_tokens", "method"]).mean(numeric_only=True).fillna({c: 0.0 for c in stages})
    models = sorted(lat["model"].unique(), key=model_sort_key)
    fig, axes = _figure(len(models), 2, w=5.2)
    for (ax_a, ax_b), mk in zip(axes, models):
        m = means.loc[mk]
        m[list(stages)].rename(columns=stages).plot.bar(stacked=True, ax=ax_a, width=0.8, ylabel="Time per "
                                                        "request (s)", title=f"(a) {mk}: time breakdown")
        ax_a.set_xticks(range(len(m)), [f"{n:.0f} {meth}" for n, meth in m.index], rotation=60, ha="right")
        ax_a.set(xlabel="Prompt length (tokens), method")
        legend(ax_a)
        tok_s = m["decode_tok_s"].unstack("method")
        ax_b.set_xscale("log")
        draw_lines(ax_b, {meth: tok_s[meth].dropna() for meth in tok_s}, ticks={n: f"{n:.0f}" for n in tok_s.index})
        ax_b.set(xlabel="Prompt length (tokens)", ylabel="Decode throughput (tokens/s)",
                 title=f"(b) {mk}: decode throughput")
    budgets = sorted(set(pd.to_numeric(lat["budget"], errors="coerce").dropna()) - {1.0})
    devices = ", ".join(sorted(lat["device"].dropna().astype(str).unique())) or "a device not recorded"
    caption = (f"Latency on {devices} (synthetic prompts; repeats averaged) at budget "
               f"{', '.join(map(budget_text, budgets)) or '?'} ({budget_semantics(budgets or [math.nan])}).")
    return [Artifact("selkv_fig3", caption, fig=fig, sources=[source])]


def niah_figures(df: pd.DataFrame, root: Path) -> list[Artifact]:
    """NIAH heatmap panels, one per model key (budgets × full cache, methods); each job's own heatmap is its folder's
    ``heatmap.png``."""
    niah = df[(df["task"] == "niah") & df["dataset"].notna()]
    records = {job: niah_grid_records(Path(root) / job)[0] for job in niah["job"].unique()}
    out = []
    for mk, sel in sorted(niah.groupby("model_key"), key=lambda kv: model_sort_key(kv[0])):
        comp, full = sel[sel["method_name"] != FULL], pick(sel[sel["method_name"] == FULL], ["model_key"])
        budgets = sorted(comp["budget"].unique()) or [math.nan]
        cols = [None] * (len(full) > 0) + list(paper_order(comp, ["method"])["method"].unique())
        fig, axes = _figure(len(budgets), len(cols), w=3.2, h=2.8)
        images, used = [], []
        for i, b in enumerate(budgets):
            for j, lab in enumerate(cols):
                if lab is None and i:  # the full cache: once, top left
                    axes[i, j].axis("off")
                    continue
                cell = comp[(comp["method"] == lab) & np.isclose(comp["budget"], b)]
                chosen = full if lab is None else pick(cell, ["method"])
                r = chosen.iloc[0] if len(chosen) else {"method": lab or "full", "variant": "", "complete": True}
                title = r["method"] + f", budget {budget_text(b)}" * (lab is not None) + f"\n{r['variant']}" * bool(
                    r["variant"]) + " (unfinished)" * (not r["complete"])
                used.append(chosen)
                images.append(draw_niah_heatmap(axes[i, j], records.get(r.get("job"), []), title))
                axes[i, j].set(xlabel="Context length (tokens)" * (i == len(budgets) - 1 or lab is None),
                               ylabel="Needle depth (%)" * (j == (cols[0] is None and i > 0)))
        niah_colorbar(fig, images, axes)
        fig.suptitle(f"Needle-in-a-Haystack: {mk}")
        out.append(Artifact(f"niah_panel_{slug(mk)}", f"NIAH, {mk}; {budget_semantics(budgets)}; score: mean per "
                            "cell (%).", fig=fig, used=pd.concat(used)))
    return out


