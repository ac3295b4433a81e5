"""The seed papers' figures and the NIAH heatmaps, from the tidy frame and the latency records."""

import math
from pathlib import Path

import pandas as pd
from matplotlib.patches import Patch

from .plots import SCORE_LABEL, draw_niah_heatmap, plt
from .report_data import (FULL, budget_semantics, budget_text, method_sort_key, model_sort_key, niah_grid_records,
                          order_datasets)
from .report_tables import Artifact, _ds, at, budget_grids, cell_notes, dedupe, grid, merged, pick, slug, sweep


def _figure(n_rows: int, n_cols: int, w: float = 4.2, h: float = 3.2):
    height = h * n_rows + 0.6
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(w * n_cols, height), squeeze=False, layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0.45 / height, 1, 1 - 0.45 / height))
    return fig, axes


def _done(name, fig, caption, sources, notes) -> Artifact:
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True)
    return Artifact(name, caption, fig=fig, sources=sorted(set(sources)), notes=dedupe(notes))


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
    ax.set(xticks=range(len(g.models)), xticklabels=g.models, xlabel="Model",
           ylabel=f"Δ LongBench average vs {g.full} (points)")
    ax.set_title("Gap to the full cache\n(closer to 0 is better)", fontsize=10)
    ax.legend(fontsize=7)
    caption = (f"Task: LongBench ({_ds(len(g.datasets))}); models: {', '.join(g.models)}; "
               f"{budget_semantics([budget])}, ρ = {budget_text(budget)}."
               + " Hatched, pale bars: an unfinished job (fewer samples scored)." * unfinished)
    return [_done("selkv_fig2", fig, caption, g.sources, g.notes)]


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
    sources, notes = merged(list(grids.values()), models)
    full = next((g.full for g in grids.values() if g.full), None)
    for i, mk in enumerate(models):
        for j, ds in enumerate(datasets):  # one model's average (or one dataset's score) across budgets
            ax, t = axes[i, j] if per_dataset else axes[0, i], sweep(grids, mk, ds)
            for lab, vals in t.iterrows():
                if lab == full:
                    ax.axhline(vals.iloc[0], color="black", linestyle="--", linewidth=1, label=lab)
                    continue
                notes += [f"absent: {mk} / {lab} at budget {budget_text(b)}" + f" ({ds})" * bool(ds)
                          for b in vals.index[vals.isna()]]
                ax.plot([b * 100 if ratio else b for b in vals.dropna().index], vals.dropna(), marker="o", label=lab)
            if not ratio:
                ax.set_xscale("log", base=2)
                ax.set_xticks(list(t.columns), [f"{b:g}" for b in t.columns])
                ax.minorticks_off()
            ax.set(ylabel="Score (points)" if ds else "Average score (points)", xlabel="KV retention ratio ρ (% of "
                   "prompt tokens)" if ratio else "KV budget (tokens per layer per KV head)")
            ax.set_title(mk + f" — {ds}" * bool(ds), fontsize=9)
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    what = f"per dataset ({', '.join(datasets)})" if per_dataset else _ds(len(present))
    caption = (f"Task: {({'longbench': 'LongBench', 'niah': 'Needle-in-a-Haystack'}).get(task, task)} ({what}); "
               f"models: {', '.join(models)}; {budget_semantics(grids)}; dashed line: full cache.")
    return [_done(name, fig, caption, sources, notes)]


def selkv_fig3(latency: list[dict], source: str = "latency.json") -> list[Artifact]:
    """SelKV Figure 3 from kvbench.latency records: (a) prefill/compression/decode seconds per request,
    (b) decode tokens/s vs prompt length; one row per model, repeats averaged."""
    lat = pd.DataFrame(latency or [])
    if not {"model", "method", "prompt_tokens", "decode_tok_s"} <= set(lat.columns):
        return []
    stages = {"prefill_s": "prefill", "compress_s": "compression", "decode_s": "decode"}
    lat = lat.reindex(columns=dedupe([*lat.columns, *stages, "budget", "device", "generated_tokens"]))
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
            for k, col in enumerate(stages):
                ax_a.bar(xs, mm[col].fillna(0), width, bottom=mm[list(stages)[:k]].fillna(0).sum(axis=1),
                         color=f"C{k}", hatch=hatches[j % 5], edgecolor="black", linewidth=0.4)
            ax_b.plot(mm.dropna(subset=["decode_tok_s"]).index, mm["decode_tok_s"].dropna(), marker="o", label=meth)
        ax_a.legend(handles=[Patch(facecolor=f"C{k}", label=s) for k, s in enumerate(stages.values())]
                    + [Patch(facecolor="white", edgecolor="black", hatch=hatches[j % 5], label=meth)
                       for j, meth in enumerate(methods)], fontsize=6, loc="upper left")
        ax_a.set_ylim(top=ax_a.get_ylim()[1] * 1.45)
        ax_b.set_xscale("log", base=2)
        for ax, xs, what, y in ((ax_a, range(len(lengths)), "(a) time breakdown", "Time per request (s)"),
                                (ax_b, lengths, "(b) decode throughput", "Decode throughput (tokens/s)")):
            ax.set_xticks(xs, [f"{n:.0f}" for n in lengths], rotation=45, fontsize=7)
            ax.set(xlabel="Prompt length (tokens)", ylabel=y)
            ax.set_title(f"{what[:4]}{mk}: {what[4:]}", fontsize=9)
        ax_b.minorticks_off()
        ax_b.legend(fontsize=7)
    budgets = sorted(set(pd.to_numeric(lat["budget"], errors="coerce").dropna()) - {1.0})
    devices, gen = sorted(lat["device"].dropna().astype(str).unique()), lat["generated_tokens"].dropna()
    caption = (f"Latency{' on ' + ', '.join(devices) if devices else ''}; models: {', '.join(models)}; task: synthetic "
               f"prompts, {f'{gen.mean():.0f} generated tokens; ' if len(gen) else ''}compressed at budget "
               f"{', '.join(map(budget_text, budgets)) or '?'} ({budget_semantics(budgets or [math.nan])}).")
    return [_done("selkv_fig3", fig, caption, [source], [])]


def niah_figures(df: pd.DataFrame, root: Path) -> list[Artifact]:
    """NIAH heatmaps (depth × length): one per job (``niah/<job>``) and one panel per model key
    (rows: budgets; columns: full cache, then methods; a cell's variant and unfinished job named)."""
    niah = df[(df["task"] == "niah") & df["dataset"].notna()]
    records = {job: niah_grid_records(Path(root) / job) for job in niah["job"].unique()}
    out = []
    for job, row in niah.groupby("job").first().iterrows():
        fig, axes = _figure(1, 1, w=5.6, h=4.0)
        if im := draw_niah_heatmap(axes[0, 0], records[job], f"{row['model_key']} / {row['method']} / budget "
                                   f"{budget_text(row['budget'])}"):
            fig.colorbar(im, ax=axes[0, 0], label=SCORE_LABEL)
        out.append(_done(f"niah/{slug(job)}", fig, f"Task: NIAH; model: {row['model_key']}; "
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
                chosen = full if lab is None else pick(comp[(comp["method"] == lab) & at(comp, b)], ["method"])
                r = chosen.iloc[0] if len(chosen) else {"method": lab or "full", "variant": "", "complete": True}
                title = r["method"] + f", budget {budget_text(b)}" * (lab is not None) + f"\n{r['variant']}" * bool(
                    r["variant"]) + " (unfinished)" * (not r["complete"])
                notes += cell_notes(sel[sel["job"] == r["job"]], chosen, f"{mk} / {title}") if len(chosen) else [
                    f"absent: {mk} / {lab} at budget {budget_text(b)}"]
                sources += list(chosen["job"][:1])
                im = draw_niah_heatmap(axes[i, j], records.get(r.get("job"), []), title, labels=False) or im
        plt.setp(axes[-1], xlabel="Context length (tokens)")
        plt.setp(axes[:, 0], ylabel="Needle depth (%)")
        if im is not None:
            fig.colorbar(im, ax=axes, label=SCORE_LABEL, shrink=0.8)
        fig.suptitle(f"Needle-in-a-Haystack: {mk}", fontsize=10)
        out.append(_done(f"niah_panel_{slug(mk)}", fig, f"Task: NIAH; model: {mk}; {budget_semantics(budgets)}; score "
                         "= mean over samples per cell (%).", sources, notes))
    return out


