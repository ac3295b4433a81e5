"""Sweeps on this machine through the real command line (``python run.py -m``, Hydra's basic launcher)."""

from __future__ import annotations

from tests.kvbench.cli_util import job_dir, read_lines, run_cli, tiny_model_args

GRID = ["task.context_lengths=[300]", "task.depth_percents=[0,50]", "task.max_new_tokens=3", "quiet=true", "threads=1",
        "method=streamingllm"]


def test_a_sweep_over_two_budgets_runs_both_jobs(tiny_model_dir, haystack_dir, tmp_path):
    args = [*tiny_model_args(tiny_model_dir), *GRID, f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}"]
    out = run_cli(["-m", "budget=0.5,24", *args])
    assert out.returncode == 0, out.stderr[-3000:]
    folders = [job_dir([*args, f"budget={b}"]) for b in ("0.5", "24")]
    assert [f.name.split("-")[0] for f in folders] == ["b0.5", "b24"]
    for folder in folders:
        assert [r["id"] for r in read_lines(folder / "predictions.jsonl")] == ["niah/300/0", "niah/300/50"]
    assert sorted(p.parent for p in tmp_path.rglob("summary.json")) == sorted(folders)


def test_a_sweep_with_a_bad_job_stops_before_any_job_loads_a_model(tmp_path):
    out = run_cli(["-m", "method=snapkv", "budget=0.5,16", f"output_root={tmp_path}"])  # 16 < snapkv's window
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr[-3000:]
    assert out.stderr.startswith("error: ") and "budget" in out.stderr
    assert not list(tmp_path.rglob("predictions.jsonl")) and not list(tmp_path.rglob("env.json"))  # the 0.5 job too
