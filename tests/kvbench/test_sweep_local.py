"""A local sweep (``python run.py -m``, Hydra's basic launcher) through the real command line:
failed jobs are listed one line each at the end, and Ctrl-C / SIGTERM stop the whole sweep."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

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
