"""What the report's figures show (values, markers, legends, captions), on small hand-made results trees."""

import numpy as np
import pandas as pd
from test_report import make_job

from kvbench.report import build as report
from kvbench.report.tables import bolds, budget_sweep_figure, dodge, niah_figures, other_samples


def display_x(ax, label: str, x: float) -> float:
    """Where (display pixels) the marker of ``label`` at data x = ``x`` is drawn."""
    line = next(c for c in ax.containers if c.get_label() == label)[0]
    xy = np.column_stack(line.get_data())
    return line.get_transform().transform(xy[xy[:, 0] == x])[0, 0]


def test_a_budget_sweep_dodges_methods_marks_unfinished_jobs_and_counts_samples(tmp_path):
    """SnapKV and SelKV score alike at 25 %: their markers sit apart; SnapKV's unfinished job is hollow."""
    make_job(tmp_path, method="full", budget=1.0, scores={"qasper": 40.0})
    for method, budget, complete in [("snapkv", 0.1, True), ("snapkv", 0.25, False), ("selkv", 0.1, True),
                                     ("selkv", 0.25, True)]:
        make_job(tmp_path, method=method, budget=budget, scores={"qasper": 30.0}, complete=complete)
    (fig,) = budget_sweep_figure(report.load_results(tmp_path), "f", "longbench", True, "t")
    ax = fig.fig.axes[0]
    snap, sel = display_x(ax, "SnapKV", 25.0), display_x(ax, "SelKV", 25.0)
    assert abs(sel - snap - 6 * fig.fig.dpi / 72) < 1e-6  # 6 points apart, centred on the budget
    assert dodge(1) == [0.0] and dodge(3) == [-6.0, 0.0, 6.0]
    hollow = [ln for ln in ax.lines if ln.get_markerfacecolor() == "white" and ln.get_label().startswith("_")]
    assert len(hollow) == 1 and hollow[0].get_xdata().tolist() == [25.0]  # SnapKV's unfinished job only
    assert "unfinished job" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert "(1 dataset); n = 5 samples per dataset;" in fig.caption and "other samples" not in fig.caption


def test_a_full_cache_on_other_samples_is_said_in_the_caption():
    row = {"model_key": "m", "dataset": "qasper", "n": 2, "subset": ""}
    used = pd.DataFrame([{**row, "method": "Full Cache", "samples": {"a": 1, "b": 0}},
                         {**row, "method": "SnapKV", "samples": {"a": 1, "b": 1}}])
    assert not other_samples(used, "Full Cache")
    used.at[1, "samples"] = {"a": 1, "c": 1}
    assert other_samples(used, "Full Cache")
    used.at[1, "samples"] = np.nan  # a summary without records: n decides
    assert not other_samples(used, "Full Cache") and other_samples(used.assign(n=[2, 5]), "Full Cache")


def test_no_bold_where_nothing_differs():
    data = pd.DataFrame({"Model": ["a", "a", "b", "b", "c"], "x": [0.0, 0.0, 1.0, 2.0, 3.0]})
    assert bolds(data, ["x"], data.index, "Model") == {(3, "x"), (4, "x")}  # a: all 0.00; c: alone, bold
    assert bolds(data, ["x"], [0, 1]) == set()


def test_the_niah_panel_shows_the_full_cache_once_and_names_grey_cells(tmp_path):
    recs = [{"id": f"niah/{n}/{d}", "dataset": "niah", "score": 1.0, "error": None,
             "meta": {"context_length": n, "depth_percent": d}} for n in (256, 512) for d in (10, 90)]
    failed = [dict(r, score=None, error={"type": "X"}) if r["id"] == "niah/512/90" else r for r in recs]
    make_job(tmp_path, task="niah", model="smollm2", method="full", budget=1.0, records=recs, scores={"niah": 100.0})
    for b in (128, 256):
        make_job(tmp_path, task="niah", model="smollm2", method="snapkv", budget=b, records=failed,
                 scores={"niah": 100.0})
    (panel,) = niah_figures(report.load_results(tmp_path), tmp_path)
    drawn = [ax for ax in panel.fig.axes if ax.get_visible() and ax.axison and ax.get_title()]
    assert [ax.get_title() for ax in drawn] == ["Full Cache", "SnapKV, budget 128", "SnapKV, budget 256"]
    assert all(t.get_rotation() == 0 for ax in drawn for t in ax.get_xticklabels())  # two ticks: upright
    cells = [t for ax in drawn for t in ax.texts]
    assert len(cells) == 4 + 3 + 3 and min(t.get_fontsize() for t in cells) >= 8  # the failed cells: no number
    assert [t.get_text() for leg in panel.fig.legends for t in leg.get_texts()] == ["no scored sample"]
