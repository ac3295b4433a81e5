"""Sweeps on this machine through the real command line (``python run.py -m``; Hydra's basic
launcher, and the parallel and submitit_local launchers whose jobs run in other processes):
failed jobs are listed one line each at the end, and Ctrl-C / SIGTERM stop the whole sweep."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kvbench.cli_util import ROOT, cli_env, read_lines, run_cli, tiny_model_args

GRID = ["task.context_lengths=[300,400]", "task.depth_percents=[0,50,100]",
        "task.max_new_tokens=4", "quiet=true"]


def _args(model_dir, haystack_dir, root) -> list[str]:
    return ["-m", "method=snapkv,pyramidkv", "budget=0.5", *tiny_model_args(model_dir), *GRID,
            f"task.haystack_dir={haystack_dir}", f"output_root={root}"]


def test_failed_jobs_are_listed_one_line_each_without_a_traceback(tiny_model_dir, haystack_dir, tmp_path):
    out = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path), KVBENCH_FAIL_SAMPLES="niah/300/50")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-3:] == [
        "error: sweep job niah/tiny/snapkv/b0.5 exited 1: some samples failed (stored with their error; rerun to "
        "retry them)",
        "error: sweep job niah/tiny/pyramidkv/b0.5 exited 1: some samples failed (stored with their error; rerun to "
        "retry them)",
        "sweep: 2 of 2 jobs did not finish cleanly; rerun the same command to retry them (finished jobs are skipped)",
    ]
    again = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path))  # the failed samples are retried
    assert again.returncode == 0, again.stderr[-2000:]
    assert "sweep:" not in again.stderr


@pytest.mark.parametrize("launcher", ["parallel", "submitit_local"])
def test_jobs_run_by_other_processes_end_the_sweep_the_same_way(tiny_model_dir, haystack_dir, tmp_path, launcher):
    """hydra/launcher=parallel (joblib worker processes) and submitit_local (one process per job, as
    SLURM array tasks are): every job leaves its exit code in the sweep's ledger, so the sweep ends
    with the same one line per failed job and the largest exit code as a local one, not Hydra's
    traceback of the first failure (kvbench/sweep_ledger.py)."""
    args = ["-m", "method=snapkv,streamingllm", "budget=0.5,24", *tiny_model_args(tiny_model_dir), *GRID,
            f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}", f"hydra/launcher={launcher}",
            "hydra.launcher.n_jobs=2" if launcher == "parallel" else "hydra.launcher.timeout_min=10"]
    out = run_cli(args, KVBENCH_FAIL_SAMPLES="niah/300/50")
    assert out.returncode == 2, out.stderr[-3000:]  # the largest exit code: snapkv at 24 tokens (below its window)
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr
    failed = "exited 1: some samples failed (stored with their error; rerun to retry them)"
    assert out.stderr.strip().splitlines()[-5:] == [
        f"error: sweep job niah/tiny/snapkv/b0.5 {failed}",
        "error: sweep job niah/tiny/snapkv/b24 exited 2: configuration error",
        f"error: sweep job niah/tiny/streamingllm/b0.5 {failed}",
        f"error: sweep job niah/tiny/streamingllm/b24 {failed}",
        "sweep: 4 of 4 jobs did not finish cleanly; fix the configuration errors above, then rerun the same command "
        "to retry them (finished jobs are skipped)",
    ]
    again = run_cli([a if a != "budget=0.5,24" else "budget=0.5" for a in args])  # resumed: failed samples retried
    assert again.returncode == 0 and "sweep:" not in again.stderr, again.stderr[-3000:]


@pytest.mark.parametrize("sig, code, what", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_stops_the_whole_sweep_and_the_same_command_resumes(tiny_model_dir, haystack_dir, tmp_path, sig,
                                                                     code, what):
    args = _args(tiny_model_dir, haystack_dir, tmp_path)
    first = tmp_path / "niah/tiny/snapkv/b0.5/predictions.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and not (first.exists() and first.read_bytes().count(b"\n") >= 1) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the first job ended before the signal: {proc.stderr.read()[-2000:]}"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"{what}: every finished sample is stored; rerun the same command to resume"
    assert not (tmp_path / "niah/tiny/pyramidkv").exists()  # the second job never started
    again = run_cli(args)
    assert again.returncode == 0, again.stderr[-2000:]
    for method in ("snapkv", "pyramidkv"):
        ids = [r["id"] for r in read_lines(tmp_path / f"niah/tiny/{method}/b0.5/predictions.jsonl")]
        assert len(ids) == len(set(ids)) == 6


def _children(pid: int) -> set[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


@pytest.mark.parametrize("sig, code, what", [(signal.SIGINT, 130, "interrupted")])  # SIGTERM: the same handler
def test_a_stopped_parallel_sweep_leaves_no_worker_behind(tiny_model_dir, haystack_dir, tmp_path, sig, code, what):
    """Ctrl-C (SIGTERM takes the same path, kvbench.signals._exit_now) sent to run.py alone (not its process group) during a hydra/launcher=parallel
    sweep: its joblib workers are stopped too (they used to stay, blocked on the dead parent's
    queue, a model in memory each), and the same command resumes the jobs."""
    args = [*_args(tiny_model_dir, haystack_dir, tmp_path), "hydra/launcher=parallel", "hydra.launcher.n_jobs=2",
            "threads=1"]
    first = tmp_path / "niah/tiny/snapkv/b0.5/predictions.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT,
                            env=cli_env(KVBENCH_SAMPLE_DELAY_S="0.5"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and not (first.exists() and first.read_bytes().count(b"\n") >= 1) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert proc.poll() is None and workers, "the sweep ended before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == f"{what}: every finished sample is stored; rerun the same command to resume"
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30  # joblib stops them as it aborts; they take a moment to exit
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if running(pid)]
    again = run_cli(args)
    assert again.returncode == 0, again.stderr[-2000:]
    for method in ("snapkv", "pyramidkv"):
        ids = [r["id"] for r in read_lines(tmp_path / f"niah/tiny/{method}/b0.5/predictions.jsonl")]
        assert len(ids) == len(set(ids)) == 6


@pytest.mark.parametrize("sig, code, what", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_during_start_up_gives_the_line_not_a_traceback(tiny_model_dir, haystack_dir, tmp_path, sig, code,
                                                                 what):
    """Ctrl-C or SIGTERM while run.py still imports Hydra and torch (no job running yet): the same
    one line and exit code as inside a job."""
    args = [*tiny_model_args(tiny_model_dir), *GRID, f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)  # the interpreter is up; the imports take seconds
    assert proc.poll() is None
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"{what}: every finished sample is stored; rerun the same command to resume")
