"""The seed papers' figures, rebuilt from a results frame (and a latency benchmark file).

Each builder returns a list of :class:`FigureOut` (empty when its inputs are absent); the
report writes them as PNG and PDF with the caption line under the axes. Missing cells are
left out of the lines/bars (never drawn as zero) and named in the notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.patches import Patch

from .plots import SCORE_LABEL, add_caption, draw_niah_heatmap, plt
from .report_data import (
    FULL,
    _job_preference,
    budget_semantics,
    budget_text,
    incomplete_note,
    is_ratio_budget,
    method_sort_key,
    n_datasets,
    niah_grid_records,
    order_datasets,
    preset_overrides,
    preset_params,
)
from .report_grid import Grid, model_sort_key, score_grid
from .report_tables import _slug, ratio_grids, sweep_series

STAGES = [("prefill_s", "prefill"), ("compress_s", "compression"), ("decode_s", "decode")]
FIG5_DATASETS = ["qasper", "musique"]  # the SelKV paper's Figure 5 pair
TASK_NAMES = {"longbench": "LongBench", "longbench_e": "LongBench-E", "niah": "Needle-in-a-Haystack"}


@dataclass
class FigureOut:
    """A figure ready to save: ``name`` (file stem), the matplotlib figure, its caption line,
    the job folders it was built from and notes on absent inputs."""

    name: str
    fig: object
    caption: str
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _finish(name: str, fig, caption: str, sources, notes) -> FigureOut:
    add_caption(fig, caption)
    return FigureOut(name, fig, caption, sorted(set(sources)), list(dict.fromkeys(notes)))


def _axes_grid(n_rows: int, n_cols: int, w: float = 4.2, h: float = 3.2):
    """A constrained-layout grid of axes leaving room at the bottom for the caption line."""
    height = h * n_rows + 0.6
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(w * n_cols, height), squeeze=False, layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0.45 / height, 1, 1 - 0.45 / height))
    return fig, axes


def selkv_fig2(df: pd.DataFrame, budget: float = 0.25, task: str = "longbench") -> list[FigureOut]:
    """SelKV Figure 2: gap of each compressed method's LongBench average to the full cache, per model."""
    grid = score_grid(df, task, budget)
    if grid is None or grid.full_label is None:
        return []
    fig, axes = _axes_grid(1, 1, w=max(4.5, 1.6 * len(grid.models) + 2))
    ax = axes[0, 0]
    width = 0.8 / max(1, len(grid.labels))
    unfinished = False
    for j, lab in enumerate(grid.labels):
        xs, ys, open_ = [], [], []
        for i, mk in enumerate(grid.models):
            delta = grid.average(mk, lab) - grid.average(mk, grid.full_label)
            x = i - 0.4 + width * (j + 0.5)
            if math.isnan(delta):
                ax.annotate("n/a", (x, 0), xytext=(0, -3), textcoords="offset points", ha="center", va="top",
                            fontsize=6, rotation=90, color="grey")
            else:
                xs.append(x)
                ys.append(delta)
                open_.append(not (grid.complete(mk, lab) and grid.complete(mk, grid.full_label)))
        bars = ax.bar(xs, ys, width, label=lab)
        for bar, is_open in zip(bars, open_):
            if is_open:  # an unfinished job's average covers fewer samples
                bar.set_hatch("///")
                bar.set_alpha(0.5)
                unfinished = True
    ax.axhline(0, color="black", linewidth=0.8)
    ax.margins(y=0.15)
    ax.set_xticks(range(len(grid.models)), grid.models)
    ax.set_xlabel("Model")
    ax.set_ylabel(f"Δ LongBench average vs {grid.full_label} (points)")
    ax.set_title("Gap to the full cache\n(closer to 0 is better)", fontsize=10)
    ax.legend(fontsize=7)
    caption = (f"Task: LongBench ({n_datasets(len(grid.datasets))}); models: {', '.join(grid.models)}; "
               f"{budget_semantics([budget])}, ρ = {budget_text(budget)}."
               + (" Hatched, pale bars: an unfinished job (fewer samples scored)." if unfinished else ""))
    return [_finish("selkv_fig2", fig, caption, grid.sources, grid.notes)]


def _sweep_axes(ax, grids: dict[float, Grid], model: str, dataset: str | None, ratio: bool) -> list[str]:
    """Lines of one model's scores (average, or one dataset) across budgets; full cache dashed."""
    budgets = [b for b, g in grids.items() if model in g.models]
    _ds, labels, values = sweep_series(grids, model)
    if dataset is not None:
        values = {(lab, b): grids[b].score(model, lab, dataset) for b in budgets for lab in labels}
    full = next((g.full_label for g in grids.values() if g.full_label), None)
    notes = []
    for lab in labels:
        pts = [(b * 100 if ratio else b, values.get((lab, b), math.nan)) for b in budgets]
        if lab == full:
            ref = next((v for _x, v in pts if not math.isnan(v)), math.nan)
            if not math.isnan(ref):
                ax.axhline(ref, color="black", linestyle="--", linewidth=1, label=lab)
            continue
        xs = [x for x, v in pts if not math.isnan(v)]
        ys = [v for _x, v in pts if not math.isnan(v)]
        notes += [f"absent: {model} / {lab} at budget {budget_text(b)}" + (f" ({dataset})" if dataset else "")
                  for b, (_x, v) in zip(budgets, pts) if math.isnan(v)]
        ax.plot(xs, ys, marker="o", label=lab)
    if ratio:
        ax.set_xlabel("KV retention ratio ρ (% of prompt tokens)")
    else:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("KV budget (tokens per layer per KV head)")
    ax.set_ylabel("Score (points)" if dataset else "Average score (points)")
    ax.set_title(model + (f" — {dataset}" if dataset else ""), fontsize=9)
    ax.legend(fontsize=7)
    return notes


def _merged(grids: dict[float, Grid], models: list[str]) -> Grid:
    """Sources and notes of several budgets' grids, for the given models only."""
    merged = Grid("", math.nan, models, None, [])
    for g in grids.values():
        merged.merge_notes(g, models)
    return merged


def budget_sweep_figure(df: pd.DataFrame, name: str, task: str, ratio: bool, title: str) -> list[FigureOut]:
    """Average score vs budget, one panel per model with at least two budgets (SelKV Figure 4,
    CompressKV Figures 4 and 5)."""
    sel = df[(df["task"] == task) & (df["method_name"] != FULL)]
    ratios = sel["budget"].map(is_ratio_budget).astype(bool)  # 1.0 is the ratio 100 %
    sel = sel[ratios] if ratio else sel[~ratios & sel["budget"].notna()]
    grids = {float(b): g for b in sorted(sel["budget"].dropna().unique()) if (g := score_grid(df, task, float(b)))}
    models = [m for m in sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
              if sum(m in g.models for g in grids.values()) >= 2]
    if not models:
        return []
    fig, axes = _axes_grid(1, len(models))
    merged = _merged(grids, models)
    notes = list(merged.notes)
    for ax, mk in zip(axes[0], models):
        notes += _sweep_axes(ax, grids, mk, None, ratio)
    n_ds = max(len(g.datasets) for g in grids.values())
    fig.suptitle(title, fontsize=10)
    caption = (f"Task: {TASK_NAMES.get(task, task)} ({n_ds} dataset{'s' if n_ds > 1 else ''}); "
               f"models: {', '.join(models)}; "
               f"{budget_semantics(grids)}; dashed line: full cache.")
    return [_finish(name, fig, caption, merged.sources, notes)]


def selkv_fig4(df: pd.DataFrame) -> list[FigureOut]:
    """SelKV Figure 4: LongBench average vs KV retention ratio, one panel per model."""
    return budget_sweep_figure(df, "selkv_fig4", "longbench", True, "LongBench average at varying KV retention ratios")


def compresskv_fig4(df: pd.DataFrame) -> list[FigureOut]:
    """CompressKV Figure 4: LongBench average vs KV budget (tokens, 128-2048), one panel per model."""
    return budget_sweep_figure(df, "compresskv_fig4", "longbench", False, "LongBench average under varying KV budgets")


def compresskv_fig5(df: pd.DataFrame) -> list[FigureOut]:
    """CompressKV Figure 5: Needle-in-a-Haystack average vs KV budget, one panel per model."""
    return budget_sweep_figure(df, "compresskv_fig5", "niah", False, "Needle-in-a-Haystack average under KV budgets")


def selkv_fig5(df: pd.DataFrame, task: str = "longbench", max_datasets: int = 4) -> list[FigureOut]:
    """SelKV Figure 5: per-dataset ratio sweeps (Qasper and MuSiQue when present, else the first
    datasets in LongBench order), rows = models with at least two ratios."""
    grids = ratio_grids(df, task)
    models = [m for m in sorted({m for g in grids.values() for m in g.models}, key=model_sort_key)
              if sum(m in g.models for g in grids.values()) >= 2]
    if not models:
        return []
    present = order_datasets(d for g in grids.values() for d in g.datasets)
    datasets = [d for d in FIG5_DATASETS if d in present] or present[:max_datasets]
    fig, axes = _axes_grid(len(models), len(datasets))
    merged = _merged(grids, models)
    notes = list(merged.notes)
    for i, mk in enumerate(models):
        for j, ds in enumerate(datasets):
            notes += _sweep_axes(axes[i, j], grids, mk, ds, True)
    caption = (f"Task: LongBench, per dataset ({', '.join(datasets)}); models: {', '.join(models)}; "
               f"{budget_semantics(grids)}; dashed line: full cache.")
    return [_finish("selkv_fig5", fig, caption, merged.sources, notes)]


def selkv_fig3(latency: list[dict], source: str = "latency.json") -> list[FigureOut]:
    """SelKV Figure 3: (a) time breakdown (prefill, compression, decode) and (b) decode throughput
    vs prompt length, full vs compressed, one row per model (latency records, see kvbench.latency)."""
    if not latency:
        return []
    lat = pd.DataFrame(latency)
    need = {"model", "method", "prompt_tokens", "decode_tok_s"}
    if not need <= set(lat.columns):
        return []
    for col, _ in STAGES:
        lat[col] = pd.to_numeric(lat.get(col, math.nan), errors="coerce")
    means = lat.groupby(["model", "method", "prompt_tokens"], as_index=False).mean(numeric_only=True)
    models = sorted(means["model"].unique(), key=model_sort_key)
    fig, axes = _axes_grid(len(models), 2, w=5.2)
    hatches = ["", "//", "xx", "..", "\\\\"]
    for row, mk in enumerate(models):
        m = means[means["model"] == mk]
        lengths = sorted(m["prompt_tokens"].unique())
        methods = sorted(m["method"].unique(), key=lambda s: (0 if s.lower().startswith("full") else 1, s))
        ax_a, ax_b = axes[row]
        width = 0.8 / len(methods)
        for j, meth in enumerate(methods):
            mm = m[m["method"] == meth].set_index("prompt_tokens")
            xs = [i - 0.4 + width * (j + 0.5) for i, n in enumerate(lengths) if n in mm.index]
            bottom = [0.0] * len(xs)
            for k, (col, _stage) in enumerate(STAGES):
                ys = [0.0 if math.isnan(mm.at[n, col]) else float(mm.at[n, col]) for n in lengths if n in mm.index]
                ax_a.bar(xs, ys, width, bottom=bottom, color=f"C{k}", hatch=hatches[j % len(hatches)],
                         edgecolor="black", linewidth=0.4)
                bottom = [b + y for b, y in zip(bottom, ys)]
            ax_b.plot(mm.index, mm["decode_tok_s"], marker="o", label=meth)
        handles = [Patch(facecolor=f"C{k}", label=stage) for k, (_c, stage) in enumerate(STAGES)]
        handles += [Patch(facecolor="white", edgecolor="black", hatch=hatches[j % len(hatches)], label=meth)
                    for j, meth in enumerate(methods)]
        ax_a.legend(handles=handles, fontsize=6, loc="upper left")
        ax_a.set_ylim(top=ax_a.get_ylim()[1] * 1.45)
        ax_a.set_xticks(range(len(lengths)), [f"{int(n)}" for n in lengths], rotation=45, fontsize=7)
        ax_a.set_xlabel("Prompt length (tokens)")
        ax_a.set_ylabel("Time per request (s)")
        ax_a.set_title(f"(a) {mk}: time breakdown", fontsize=9)
        ax_b.set_xscale("log", base=2)
        ax_b.set_xticks(lengths, [f"{int(n)}" for n in lengths], rotation=45, fontsize=7)
        ax_b.minorticks_off()
        ax_b.set_xlabel("Prompt length (tokens)")
        ax_b.set_ylabel("Decode throughput (tokens/s)")
        ax_b.set_title(f"(b) {mk}: decode throughput", fontsize=9)
        ax_b.legend(fontsize=7)
    budgets = sorted({float(b) for b in lat.get("budget", pd.Series(dtype=float)).dropna()
                      if str(b) not in ("", "nan")} - {1.0}) or [math.nan]
    gen = lat["generated_tokens"].dropna() if "generated_tokens" in lat else pd.Series(dtype=float)
    devices = sorted({str(d) for d in lat["device"].dropna()}) if "device" in lat else []
    caption = (f"Latency{' on ' + ', '.join(devices) if devices else ''}; models: {', '.join(models)}; "
               "task: synthetic prompts, "
               f"{f'{gen.mean():.0f} generated tokens; ' if len(gen) else ''}"
               f"compressed at budget {', '.join(budget_text(b) for b in budgets if not math.isnan(b)) or '?'} "
               f"({budget_semantics(budgets)}).")
    return [_finish("selkv_fig3", fig, caption, [source], contention_notes(latency))]


def contention_notes(latency: list[dict]) -> list[str]:
    """A note when CPU measurements of a latency file ran with more load than cores.

    Records of ``kvbench.latency`` carry ``load_1min`` (the 1-minute load average around the
    generation) and ``cpu_cores``; a CPU record whose load exceeds its cores was measured while
    other processes shared the CPU, so its times are inflated. GPU records and records without
    those fields (older files) are not judged.
    """
    cpu = [r for r in latency if not str(r.get("device", "cpu")).startswith("cuda")
           and isinstance(r.get("load_1min"), (int, float)) and isinstance(r.get("cpu_cores"), int)]
    busy = [r for r in cpu if r["load_1min"] > r["cpu_cores"]]
    if not busy:
        return []
    worst = max(busy, key=lambda r: r["load_1min"])
    return [f"CPU contention: {len(busy)} of {len(cpu)} measurements ran with a 1-minute load average above the "
            f"cores (up to {worst['load_1min']:.1f} on {worst['cpu_cores']}): other processes shared the CPU, so "
            "those times are inflated; rerun on an idle machine"]


def _cell_variant(row: pd.Series, title: str) -> tuple[str, str | None]:
    """A panel cell's title with what the score table also says about its job: the method fields
    it overrides in its preset (``method.alpha=2`` → ``alpha=2``, on a second line) and
    ``(unfinished)`` when its samples are not all scored; returns ``(title, note or None)``."""
    import json

    own = json.loads(row["params"]) if isinstance(row.get("params"), str) else {}
    changed = preset_overrides(own, preset_params(str(row.get("preset"))) or {})
    if changed:
        title += "\n" + ", ".join(f"{k}={own[k]}" for k in changed)
    if bool(row.get("complete", True)):
        return title, None
    n = row.get("n")
    return title + " (unfinished)", incomplete_note(str(row["job"]), int(n) if pd.notna(n) else 0)


def niah_figures(df: pd.DataFrame, root: Path) -> list[FigureOut]:
    """NIAH heatmaps (needle depth × context length): one per job (``niah/<job>``) and one panel
    per model (rows = budgets, columns = methods, full cache in the first column)."""
    niah = df[(df["task"] == "niah") & df["dataset"].notna()]
    out: list[FigureOut] = []
    records = {job: niah_grid_records(root / job) for job in niah["job"].unique()}  # the summary's grid
    for job, grp in niah.groupby("job"):
        row = grp.iloc[0]
        fig, axes = _axes_grid(1, 1, w=5.6, h=4.0)
        im = draw_niah_heatmap(axes[0, 0], records[job], f"{row['model_key']} / {row['method']} / budget "
                               f"{budget_text(row['budget'])}")
        if im is not None:
            fig.colorbar(im, ax=axes[0, 0], label=SCORE_LABEL)
        caption = f"Task: NIAH; model: {row['model_key']}; {budget_semantics([row['budget']])}."
        out.append(_finish(f"niah/{_slug(job)}", fig, caption, [job], []))
    for mk in sorted(niah["model_key"].unique(), key=model_sort_key):
        sel = niah[niah["model_key"] == mk]
        comp = sel[sel["method_name"] != FULL]
        budgets = sorted(comp["budget"].unique()) or [math.nan]
        fulls = list(sel.loc[sel["method_name"] == FULL, "job"].unique())[:1]
        pairs = dict(zip(comp["method"], comp["method_name"]))
        labels = sorted(pairs, key=lambda lab: method_sort_key(pairs[lab], lab))
        cols = (["full"] if fulls else []) + labels
        fig, axes = _axes_grid(len(budgets), len(cols), w=3.2, h=2.8)
        im, sources, notes = None, list(fulls), []
        for i, b in enumerate(budgets):
            for j, lab in enumerate(cols):
                jobs = fulls if lab == "full" else _job_preference(comp[(comp["method"] == lab) & (comp["budget"] == b)])
                name = sel.loc[sel["job"] == jobs[0], "method"].iloc[0] if jobs else lab
                title = f"{name}" + ("" if lab == "full" else f", budget {budget_text(b)}")
                if jobs:
                    title, note = _cell_variant(sel[sel["job"] == jobs[0]].iloc[0], title)
                    notes += [note] if note else []
                else:
                    notes.append(f"absent: {mk} / {lab} at budget {budget_text(b)}")
                im = draw_niah_heatmap(axes[i, j], records[jobs[0]] if jobs else [], title, labels=False) or im
                sources += jobs[:1]
        for ax in axes[-1]:
            ax.set_xlabel("Context length (tokens)")
        for ax in axes[:, 0]:
            ax.set_ylabel("Needle depth (%)")
        if im is not None:
            fig.colorbar(im, ax=axes, label=SCORE_LABEL, shrink=0.8)
        fig.suptitle(f"Needle-in-a-Haystack: {mk}", fontsize=10)
        caption = f"Task: NIAH; model: {mk}; {budget_semantics(budgets)}; score = mean over samples per cell (%)."
        out.append(_finish(f"niah_panel_{_slug(mk)}", fig, caption, sources, notes))
    return out
