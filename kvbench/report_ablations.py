"""Ablation and sensitivity tables of the seed papers.

SelKV Table 2 (staged ablation: eviction only, merge all, + gate, + gate + comp), SelKV Table 3
(W × K sensitivity), CompressKV Table 3 (a: component analysis, b: SRHs per layer). Variants of
one method are told apart by ``method.label`` (presets) and by the method fields that differ
between jobs (hyper-parameter sweeps, see :func:`kvbench.report_data.variants`).
"""

from __future__ import annotations

import json
import math

import pandas as pd

from .report_data import (
    DATASET_ABBR,
    budget_semantics,
    budget_text,
    cell_scores,
    main_labels,
    method_display_name,
    n_datasets,
    order_datasets,
    variants,
)
from .report_grid import model_sort_key, score_grid
from .report_tables import Table, _models_text, _table, bold_best


def _truthy(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "off", "false", "no", "0")
    return bool(value)


def ablation_flags(params: dict) -> dict[str, bool | None]:
    """Gate / Comp / Merge switches of a SelKV-style config (None when the config does not say).

    SelKV's fields (``conf/method/selkv*.yaml``): ``gate`` soft (gated merge) | none (merge all,
    g = 1) | off (eviction only, g = 0); ``compensation`` global | layer | count | off. A boolean
    ``merge`` field, where a method has one, decides Merge directly.
    """
    gate, comp = params.get("gate"), params.get("compensation", params.get("comp"))
    merge = params.get("merge")
    if merge is None and isinstance(gate, str):
        merge = gate.strip().lower() != "off"
    return {"Gate": None if gate is None else _truthy(gate), "Comp": None if comp is None else _truthy(comp),
            "Merge": None if merge is None else _truthy(merge)}


def selkv_table2(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench",
                 method_name: str = "selkv") -> list[Table]:
    """SelKV Table 2: staged ablation (eviction only, merge all, + gate, + gate + comp).

    One block per model key with at least two labels of ``method_name`` at ``budget``. Rows are
    ordered by their (merge, gate, comp) switches; ``Δ prev`` is the gain over the row above
    (as in the paper), ``Δ full`` the gap to the full cache. Two labels with identical method
    fields are one configuration (the longer, ablation-specific label is kept).
    """
    sel = df[(df["task"] == task) & (df["method_name"] == method_name) & ((df["budget"] - budget).abs() < 1e-9)]
    rows: list[dict] = []
    bold: set = set()
    sources: set[str] = set()
    notes: list[str] = []
    n_ds = 0
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        labels = list(sel.loc[sel["model_key"] == mk, "method"].unique())
        grid = score_grid(df, task, budget, models=[mk], method_names=[method_name], labels=labels)
        if grid is None or len(labels) < 2:
            continue
        by_params: dict[str, str] = {}
        for label in sorted(labels, key=len):
            lab_rows = sel[(sel["model_key"] == mk) & (sel["method"] == label)]
            by_params[variants(lab_rows)[0][1]["params"].iloc[0]] = label  # longer label wins
        configs = [(ablation_flags(json.loads(p)), lab) for p, lab in by_params.items()]
        configs.sort(key=lambda c: (tuple(-1 if v is None else int(v) for v in
                                          (c[0]["Merge"], c[0]["Gate"], c[0]["Comp"])), c[1]))
        full_avg = grid.average(mk, grid.full_label) if grid.full_label else math.nan
        if grid.full_label:
            rows.append({"Model": mk, "Configuration": grid.full_label, "Gate": "–", "Comp": "–", "Merge": "–",
                         "Avg": full_avg, "Δ prev": math.nan, "Δ full": math.nan})
        start, prev = len(rows), math.nan
        for flags, label in configs:
            avg = grid.average(mk, label)
            marks = {k: "?" if v is None else ("✓" if v else "–") for k, v in flags.items()}
            rows.append({"Model": mk, "Configuration": label, **marks, "Avg": avg,
                         "Δ prev": avg - prev, "Δ full": avg - full_avg})
            prev = avg
        bold |= bold_best(rows, list(range(start, len(rows))), "Avg")
        sources |= set(grid.sources)
        notes += grid.notes
        n_ds = max(n_ds, len(grid.datasets))
    if not rows:
        return []
    caption = (f"Ablation of {method_display_name(method_name)} on LongBench ({n_datasets(n_ds)}, "
               f"{budget_text(budget)} KV budget; "
               f"{budget_semantics([budget])}). Δ prev: change from the row above; Δ full: gap to the full cache. "
               "'Evict only' drops evicted tokens; 'merge all' merges without gate or compensation.")
    cols = ["Model", "Configuration", "Gate", "Comp", "Merge", "Avg", "Δ prev", "Δ full"]
    return [_table("selkv_table2", caption, rows, cols, bold=bold, signed={"Δ prev", "Δ full"},
                   headers={"Avg": f"Avg ({n_ds} ds)"}, sources=sorted(sources), notes=notes)]


PARAM_HEADERS = {"window_size": "W", "kernel_size": "K"}


def _sortable(value) -> tuple:
    """Numbers before other values, numbers compared numerically."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, json.dumps(value, sort_keys=True))


def sensitivity_table(df: pd.DataFrame, name: str, method_name: str, budget: float, task: str = "longbench",
                      per_dataset: bool = True) -> list[Table]:
    """Hyper-parameter sensitivity: one row per variant (method fields that differ between jobs)
    of a method's main label at one budget (SelKV Table 3: W × K; CompressKV Table 3b: SRHs per layer).

    ``Δ default`` is the gap to the default variant (the job folder without a fields hash).
    """
    sel = df[(df["task"] == task) & (df["method_name"] == method_name) & ((df["budget"] - budget).abs() < 1e-9)]
    if sel.empty:
        return []
    sel = sel[sel["method"].isin(main_labels(sel))]
    rows: list[dict] = []
    bold: set = set()
    sources: set[str] = set()
    keys: list[str] = []
    blocks = []
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        vs = variants(sel[sel["model_key"] == mk])
        if len(vs) < 2:
            continue
        varying = sorted(k for k in set().union(*(p for p, _ in vs)) if len({json.dumps(p.get(k)) for p, _ in vs}) > 1)
        keys += [k for k in varying if k not in keys]
        blocks.append((mk, vs))
    all_scores = {(mk, i): cell_scores(r) for mk, vs in blocks for i, (_p, r) in enumerate(vs)}
    datasets = order_datasets(d for s, _u in all_scores.values() for d in s)
    for mk, vs in blocks:
        start = len(rows)
        default_avg = math.nan
        order = sorted(range(len(vs)), key=lambda i: tuple(_sortable(vs[i][0].get(k)) for k in keys))
        for i in order:
            params, _rows = vs[i]
            scores, used = all_scores[(mk, i)]
            sources.update(used)
            vals = [scores.get(d, math.nan) for d in datasets]
            avg = math.nan if any(math.isnan(v) for v in vals) else sum(vals) / len(vals)
            if i == 0:
                default_avg = avg
            rows.append({"Model": mk, **{k: str(params.get(k, "–")) for k in keys}, "Default": "✓" if i == 0 else "",
                         **({d: scores.get(d, math.nan) for d in datasets} if per_dataset else {}), "Avg": avg})
        for r in rows[start:]:
            r["Δ default"] = r["Avg"] - default_avg
        block = list(range(start, len(rows)))
        for col in ([*datasets] if per_dataset else []) + ["Avg"]:
            bold |= bold_best(rows, block, col)
    if not rows:
        return []
    notes = [f"absent: {r['Model']} variant {', '.join(f'{k}={r[k]}' for k in keys)} has no score for "
             + ", ".join(d for d in datasets if math.isnan(r.get(d, 0.0))) for r in rows
             if per_dataset and any(math.isnan(r[d]) for d in datasets)]
    caption = (f"Sensitivity of {method_display_name(method_name)} to "
               f"{', '.join(PARAM_HEADERS.get(k, k) for k in keys)} on LongBench "
               f"({n_datasets(len(datasets))}, {budget_text(budget)} KV budget; {budget_semantics([budget])}). "
               f"Δ default: gap to the default configuration (✓). " + _models_text(sorted({r['Model'] for r in rows})))
    cols = ["Model", *keys, "Default", *(datasets if per_dataset else []), "Avg", "Δ default"]
    return [_table(name, caption, rows, cols, bold=bold, signed={"Δ default"}, sources=sorted(sources), notes=notes,
                   headers={**PARAM_HEADERS, **{d: DATASET_ABBR.get(d, d) for d in datasets}})]


def compresskv_table3a(df: pd.DataFrame, budget: float = 256, task: str = "longbench") -> list[Table]:
    """CompressKV Table 3a: component analysis: SnapKV, then CompressKV ablation labels, then the
    full CompressKV (its main label); ``Δ prev`` is the gain over the row above. Only for models
    with at least one CompressKV ablation label."""
    sel = df[(df["task"] == task) & ((df["budget"] - budget).abs() < 1e-9)]
    rows: list[dict] = []
    sources: set[str] = set()
    notes: list[str] = []
    for mk in sorted(sel["model_key"].unique(), key=model_sort_key):
        ck = sel[(sel["model_key"] == mk) & (sel["method_name"] == "compresskv")]
        snap = sel[(sel["model_key"] == mk) & (sel["method_name"] == "snapkv")]
        ck_labels = list(ck["method"].unique())
        if len(ck_labels) < 2:
            continue
        main = sorted(main_labels(ck))[0]
        order = ([sorted(main_labels(snap))[0]] if not snap.empty else []) + sorted(
            lab for lab in ck_labels if lab != main) + [main]
        grid = score_grid(df, task, budget, models=[mk], method_names=["snapkv", "compresskv"], labels=order)
        prev = math.nan
        for lab in order:
            avg = grid.average(mk, lab)
            rows.append({"Model": mk, "Method": lab, "Avg": avg, "Δ prev": avg - prev})
            prev = avg
        sources |= set(grid.sources)
        notes += grid.notes
    if not rows:
        return []
    caption = (f"Component analysis of CompressKV on LongBench at budget {budget:g} "
               f"({budget_semantics([budget])}). Δ prev: change from the row above.")
    return [_table("compresskv_table3a", caption, rows, ["Model", "Method", "Avg", "Δ prev"], signed={"Δ prev"},
                   sources=sorted(sources), notes=notes)]


def compresskv_table3b(df: pd.DataFrame, budget: float = 256, task: str = "longbench") -> list[Table]:
    """CompressKV Table 3b: effect of CompressKV's fields (e.g. SRHs per layer) at one budget."""
    return sensitivity_table(df, "compresskv_table3b", "compresskv", budget, task, per_dataset=False)


def selkv_table3(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[Table]:
    """SelKV Table 3: sensitivity to the observation window W and kernel size K (per dataset + Avg)."""
    return sensitivity_table(df, "selkv_table3", "selkv", budget, task)
