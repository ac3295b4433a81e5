"""score_vs_budget_<task> (kvbench/report/tables.py): score against budget for any sweep of two budgets or more."""

import statistics

import numpy as np
import yaml
from matplotlib.colors import to_rgb
from test_report import make_job

from kvbench.report import build as report
from kvbench.report.tables import score_vs_budget

#: per-sample NIAH scores (0-1) of each (method, budget); the full cache's at 0.25 (it holds for every budget)
SAMPLES = {("snapkv", 0.25): [0.0, 0.5, 1.0, 0.5], ("snapkv", 0.5): [1.0, 1.0, 0.5, 1.0],
           ("streamingllm", 0.25): [0.0, 0.0, 0.5, 0.0], ("streamingllm", 0.5): [0.5, 0.0, 1.0, 0.5],
           ("full", 0.25): [1.0, 1.0, 1.0, 0.5]}


def niah_job(root, method, budget, scores, **kw):
    records = [{"id": f"niah/{i}", "dataset": "niah", "score": s, "error": None} for i, s in enumerate(scores)]
    return make_job(root, task="niah", model="smollm2", method=method, budget=budget, summary=False, records=records,
                    **kw)


def mean_se(scores):
    """Score and standard error in points: 100 · mean, 100 · SD / √n."""
    return 100 * statistics.mean(scores), 100 * statistics.stdev(scores) / len(scores) ** 0.5


def band(ax, color):
    """``{x: (low, high)}`` of the band drawn in ``color``."""
    (coll,) = [c for c in ax.collections if np.allclose(c.get_facecolor()[0][:3], to_rgb(color))]
    xy = coll.get_paths()[0].vertices
    return {round(x, 6): (xy[xy[:, 0] == x, 1].min(), xy[xy[:, 0] == x, 1].max()) for x in set(xy[:, 0])}


def test_a_line_per_method_through_its_scores_with_standard_error_bands(tmp_path):
    for (method, budget), scores in SAMPLES.items():
        niah_job(tmp_path, method, budget, scores)
    (fig,) = score_vs_budget(report.load_results(tmp_path))
    assert fig.name == "score_vs_budget_niah" and len(fig.fig.axes) == 1
    ax = fig.fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    for method, label in (("snapkv", "SnapKV"), ("streamingllm", "StreamingLLM")):
        expected = [mean_se(SAMPLES[method, b]) for b in (0.25, 0.5)]
        assert list(lines[label].get_xdata()) == [25.0, 50.0]  # the ratio in %
        assert np.allclose(lines[label].get_ydata(), [m for m, _ in expected])
        drawn = band(ax, lines[label].get_color())
        assert np.allclose([drawn[25.0], drawn[50.0]], [(m - e, m + e) for m, e in expected])
    full, full_se = mean_se(SAMPLES["full", 0.25])
    assert np.allclose(lines["Full Cache"].get_ydata(), [full, full]) and lines["Full Cache"].get_linestyle() == "--"
    assert "band: ±1 SE" in fig.caption and "n = 4 samples per dataset" in fig.caption


def test_protocols_apart_one_budget_nothing_and_the_cli_writes_png_and_pdf(tmp_path):
    for (method, budget), scores in SAMPLES.items():
        niah_job(tmp_path / "one", method, 0.25, scores) if budget == 0.25 else None
    assert score_vs_budget(report.load_results(tmp_path / "one")) == []  # one budget: no curve
    for (method, budget), scores in SAMPLES.items():
        niah_job(tmp_path / "two", method, budget, scores)
        if method == "snapkv":  # the same method with task.compress=context
            job = niah_job(tmp_path / "two", method, budget, scores[::-1][:3], folder_tag="ctx")
            cfg = yaml.safe_load((job / "config.yaml").read_text())
            (job / "config.yaml").write_text(yaml.safe_dump({**cfg, "task": {**cfg["task"], "compress": "context"}}))
    (fig,) = score_vs_budget(report.load_results(tmp_path / "two"))
    titles = sorted(ax.get_title() for ax in fig.fig.axes)
    assert titles == ["smollm2 [task.compress=context]", "smollm2 [task.compress=prompt]"]
    context = next(ax for ax in fig.fig.axes if "context" in ax.get_title())
    assert [line.get_label() for line in context.get_lines() if line.get_label()[0] != "_"] == ["SnapKV"]
    assert np.allclose(context.get_lines()[0].get_ydata(), [mean_se(SAMPLES["snapkv", b][::-1][:3])[0] for b in (0.25, 0.5)], atol=0.005)
    assert report.main([str(tmp_path / "two"), "--out", str(tmp_path / "r"), "--only", "score_vs_budget_niah"]) == 0
    assert {p.name for p in (tmp_path / "r").glob("score_vs_budget*")} == {
        "score_vs_budget_niah.png", "score_vs_budget_niah.pdf", "score_vs_budget_niah.sources.txt"}


def test_each_kvpress_press_is_a_line_of_its_own(tmp_path):
    """method=kvpress is labelled by its press: two presses are two methods, each drawn (and neither dropped)."""
    niah_job(tmp_path, "full", 0.25, SAMPLES["full", 0.25])
    for press, scores in (("TOVAPress", SAMPLES["snapkv", 0.25]), ("KnormPress", SAMPLES["streamingllm", 0.25])):
        for budget in (0.25, 0.5):
            niah_job(tmp_path, "kvpress_press", budget, scores, label=press, preset=f"kvpress_{press}")
    (fig,) = score_vs_budget(report.load_results(tmp_path))
    lines = {line.get_label(): line for line in fig.fig.axes[0].get_lines()}
    assert {"TOVAPress", "KnormPress"} <= set(lines)
    assert np.allclose(lines["KnormPress"].get_ydata(), [mean_se(SAMPLES["streamingllm", 0.25])[0]] * 2)
