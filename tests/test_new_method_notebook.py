"""notebooks/new_method.ipynb: a method written in a cell runs against SnapKV at two budgets (kvbench.run) on the
embedded SmolLM2 and is plotted; its jobs are the folders the command line writes for the same settings."""

from __future__ import annotations

import json

from notebook_runner import execute_notebook


def test_the_new_method_notebook_runs_and_plots(tmp_path):
    nb = execute_notebook("new_method", f"""OUT = {str(tmp_path)!r}
BUDGETS = [0.25, 0.5]
SETTINGS = ["task=niah", "task.context_lengths=[120]", "task.depth_percents=[50]", "task.max_new_tokens=4",
            "max_samples=1", "threads=1", "quiet=true"]""")
    assert (tmp_path / "score_vs_budget.png").stat().st_size > 0  # the plot
    summaries = sorted(tmp_path.glob("niah/smollm2/*/*/summary.json"))
    assert sorted(p.parts[-3] for p in summaries) == ["ValueNorm", "ValueNorm", "snapkv", "snapkv"]
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "ValueNorm {0.25: " in printed and "SnapKV {0.25: " in printed
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["n_samples"] == 1 and summary["complete"]
    identity = json.loads(next(tmp_path.glob("niah/smollm2/ValueNorm/b0.25-*/identity.json")).read_text())
    assert identity["method"]["target"] == "__main__:ValueNorm" and len(identity["inputs"]["method_source_sha256"]) == 64
