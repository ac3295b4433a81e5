"""``score_vs_budget_<task>``: the score against the budget for any sweep of two budgets or more (docs/REPORTS.md).

A panel per model key and kind of budget (retention ratio or tokens): a line per method through its score at each
budget (the mean over the task's datasets, as :func:`kvbench.report.tables.sweep` takes it) with a band of ±1
standard error, the full cache as a dashed line with its band. Jobs of the two ``task.compress`` protocols never
share a model key (:func:`kvbench.report.data.load_results`), so they never share a panel.
"""

from kvbench.report.data import budget_text
from kvbench.report.tables import (Artifact, _done, _figure, budget_grids, count, draw_lines, reference, slug,
                                   sweep, used_by)


def score_vs_budget(df) -> list[Artifact]:
    """A figure per task whose jobs of one model key ran at two budgets or more; [] when none did."""
    out = []
    for task in sorted(df.loc[df["score"].notna(), "task"].unique()):
        panels = [(mk, ratio, grids) for ratio in (True, False) for grids, models in [budget_grids(df, task, ratio)]
                  for mk in models]
        if not panels:
            continue
        fig, axes = _figure(1, len(panels), w=5.6)
        multi = df.loc[(df["task"] == task) & df["score"].notna(), "dataset"].nunique() > 1
        fulls = {g.full for _, _, grids in panels for g in grids.values()}
        for ax, (mk, ratio, grids) in zip(axes[0], panels):
            scores, errors, budgets = sweep(grids, mk), sweep(grids, mk, se=True), sorted(grids)
            full = next((g.full for g in grids.values() if g.full), None)
            x = {b: 100 * b if ratio else b for b in budgets}
            if not ratio:
                ax.set_xscale("log", base=2)
            if full in scores.index and scores.loc[full].notna().any():  # the full cache: one score at every budget
                reference(ax, scores.loc[full].iloc[0], errors.loc[full].iloc[0], full)
            lines = {lab: scores.loc[lab].dropna().rename(x) for lab in scores.index if lab != full}
            lines = {lab: y for lab, y in lines.items() if len(y)}  # a label of another model key: all NaN
            draw_lines(ax, lines, {lab: errors.loc[lab].rename(x)[y.index].fillna(0.0) for lab, y in lines.items()},
                       {lab: [x[b] for b in budgets if (mk, lab) in grids[b].incomplete] for lab in lines}, band=True)
            ax.set_xticks([x[b] for b in budgets], [budget_text(b) for b in budgets])
            ax.minorticks_off()
            lo, hi = ax.get_ylim()  # scores are 0-100: the bands may not reach past them
            ax.set_ylim(max(lo, -3.0), min(max(hi, lo + 5), 103.0))
            ax.set(title=mk, ylabel="Average score (points)" if multi else "Score (points)",
                   xlabel="KV retention ratio ρ" if ratio else "KV budget (tokens per layer per KV head)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task}: score against KV budget")
        used = used_by({b: g for _, _, grids in panels for b, g in grids.items()}, [mk for mk, _, _ in panels])
        datasets = sorted(set(used["dataset"]))
        ns = used["n"].dropna()
        n_text = f"n = {ns.min():.0f}" + f"–{ns.max():.0f}" * bool(ns.min() < ns.max()) + " samples per dataset"
        caption = (f"Task: {task} ({count(len(datasets), 'dataset')}" + ", score: their mean" * (len(datasets) > 1)
                   + f"); {n_text}; budget = retention ratio ρ of prompt tokens" * any(r for _, r, _ in panels)
                   + "; budget = tokens kept per layer per KV head" * (not all(r for _, r, _ in panels))
                   + "; band: ±1 SE" + "; dashed: full cache" * bool(fulls - {None}) + "; hollow: an unfinished job" * bool(
                       (~used["complete"]).any()) + ".")
        out.append(_done(f"score_vs_budget_{slug(task)}", fig, caption, used))
    return out
