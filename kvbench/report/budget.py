"""``score_vs_budget_<task>``: the score against the budget for any sweep of two budgets or more (docs/REPORTS.md).

A panel per model key and kind of budget (retention ratio or tokens): a line per method through its score at each
budget (the mean over the task's datasets, as :func:`kvbench.report.tables.sweep` takes it) with a band of ±1
standard error, the full cache as a dashed line with its band. Jobs of the two ``task.compress`` protocols never
share a model key (:func:`kvbench.report.data.load_results`), so they never share a panel.
"""

from kvbench.report.data import budget_text
from kvbench.report.tables import Artifact, _done, _figure, budget_grids, count, slug, sweep, used_by


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
        tables = [(sweep(grids, mk), sweep(grids, mk, se=True).fillna(0.0)) for mk, _, grids in panels]
        fulls = {g.full for _, _, grids in panels for g in grids.values()}
        colors = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(
            x for t, _ in tables for x in t.index if x not in fulls))}
        for ax, (mk, ratio, grids), (scores, errors) in zip(axes[0], panels, tables):
            budgets = sorted(grids)
            full = next((g.full for g in grids.values() if g.full), None)
            x = {b: 100 * b if ratio else b for b in budgets}
            for label in scores.index:
                y = scores.loc[label].dropna()  # a label of another model key: all NaN
                if y.empty:
                    continue
                xs, e = [x[b] for b in y.index], errors.loc[label, y.index]
                if label == full:  # the full cache keeps every token: one score at every budget
                    ax.axhline(y.iloc[0], color="black", linestyle="--", linewidth=1.2, label=label, zorder=5)
                    ax.axhspan(y.iloc[0] - e.iloc[0], y.iloc[0] + e.iloc[0], color="grey", alpha=0.15, linewidth=0)
                    continue
                ax.plot(xs, y, marker="o", label=label, color=colors[label], zorder=3)
                ax.fill_between(xs, y - e, y + e, color=colors[label], alpha=0.2, linewidth=0)
                late = [(x[b], v) for b, v in y.items() if (mk, label) in grids[b].incomplete]
                if late:  # an unfinished job's point: hollow
                    ax.plot(*zip(*late), "o", color=colors[label], mfc="white", zorder=4)
            if not ratio:
                ax.set_xscale("log", base=2)
            ax.set_xticks([x[b] for b in budgets], [budget_text(b) for b in budgets])
            ax.minorticks_off()
            ax.margins(x=0.08)
            lo, hi = ax.get_ylim()  # scores are 0-100: the bands may not reach past them
            ax.set_ylim(max(lo, -3.0), min(max(hi, lo + 5), 103.0))
            ax.set(title=mk, ylabel="Average score (points)" if multi else "Score (points)",
                   xlabel="KV retention ratio ρ" if ratio else "KV budget (tokens per layer per KV head)")
            ax.grid(alpha=0.3)
            ax.legend(title="Method", loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
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
