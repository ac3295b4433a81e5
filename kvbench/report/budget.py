"""``score_vs_budget_<task>``: the score against the budget for any sweep of two budgets or more (docs/REPORTS.md).

A panel per model key and kind of budget (retention ratio or tokens): a line per method through its score at each
budget (the mean over the task's datasets, as :func:`kvbench.report.tables.sweep` takes it) with a band of ±1
standard error, the full cache as a dashed line with its band. Jobs of the two ``task.compress`` protocols never
share a model key (:func:`kvbench.report.data.load_results`), so they never share a panel.
"""

from kvbench.report.tables import Artifact, _done, _figure, budget_grids, count, slug, sweep_panel, used_by


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
        for ax, (mk, ratio, grids) in zip(axes[0], panels):
            sweep_panel(ax, grids, mk, ratio, band=True)
            ax.set(title=mk, ylabel="Average score (points)" if multi else "Score (points)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{task}: score against KV budget")
        used = used_by({b: g for _, _, grids in panels for b, g in grids.items()}, [mk for mk, _, _ in panels])
        datasets = sorted(set(used["dataset"]))
        ns = used["n"].dropna()
        n_text = f"n = {ns.min():.0f}" + f"–{ns.max():.0f}" * bool(ns.min() < ns.max()) + " samples per dataset"
        caption = (f"Task: {task} ({count(len(datasets), 'dataset')}" + ", score: their mean" * (len(datasets) > 1)
                   + f"); {n_text}; budget = retention ratio ρ of prompt tokens" * any(r for _, r, _ in panels)
                   + "; budget = tokens kept per layer per KV head" * (not all(r for _, r, _ in panels))
                   + "; band: ±1 SE" + "; dashed: full cache" * bool((used["method_name"] == "full").any()) + "; hollow: an unfinished job" * bool(
                       (~used["complete"]).any()) + ".")
        out.append(_done(f"score_vs_budget_{slug(task)}", fig, caption, used))
    return out
