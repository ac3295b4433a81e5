"""Crash safety through the real command line: ``kill -9`` after the first stored record, a half line
left as a mid-write kill leaves it, then the same command again: every sample stored exactly once."""

from __future__ import annotations

import os
import signal
import time

from tests.kvbench.cli_util import job_dir, popen_cli, read_lines, run_cli, tiny_model_args

GRID = ["task.context_lengths=[300,400]", "task.depth_percents=[0,50,100]", "method=snapkv", "method.window_size=8",
        "budget=0.5", "task.max_new_tokens=4", "quiet=true"]


def signal_after_first_record(args: list[str], predictions, sig: int) -> int:
    """Start ``run.py *args``, send ``sig`` once ``predictions`` holds a record; its exit code."""
    proc = popen_cli(args)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not (
            predictions.exists() and predictions.read_bytes().count(b"\n") >= 1):
        time.sleep(0.02)
    assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before the signal"
    os.kill(proc.pid, sig)
    return proc.wait()


def test_kill_9_then_rerun_stores_every_sample_once(tiny_model_dir, haystack_dir, tmp_path):
    args = [*tiny_model_args(tiny_model_dir), *GRID, f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}"]
    predictions = job_dir(args) / "predictions.jsonl"
    assert signal_after_first_record(args, predictions, signal.SIGKILL) == -signal.SIGKILL
    stored = read_lines(predictions)
    assert 1 <= len(stored) < 6
    half = b'{"id": "niah/400/100", "dataset": "niah", "predic'
    with open(predictions, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(half)

    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-2000:]
    records = read_lines(predictions)
    ok = [r["id"] for r in records if r["error"] is None]
    expected = {f"niah/{n}/{d}" for n in (300, 400) for d in (0, 50, 100)}
    assert len(ok) == len(set(ok)) and set(ok) == expected
    assert [r["id"] for r in records[:len(stored)]] == [r["id"] for r in stored]  # the first run's records kept
    (partial,) = predictions.parent.glob("predictions.jsonl.partial-*")
    assert partial.read_bytes() == half
    assert predictions.read_bytes().endswith(b"\n")


def test_kill_9_in_a_batch_then_rerun_stores_each_answer_once(tiny_model_dir, haystack_dir, tmp_path):
    """Sampled candidates decoded 4 rows at a time (issue #58): killed after its first records, run again, every
    (sample, candidate) is stored once, with batch 1's answer."""
    args = [*tiny_model_args(tiny_model_dir), *GRID, f"task.haystack_dir={haystack_dir}", "sampling.n=3",
            "sampling.temperature=0.8", "threads=1"]
    batched = [*args, "batch_size=4", f"output_root={tmp_path / 'b4'}"]
    predictions = job_dir(batched) / "predictions.jsonl"
    assert signal_after_first_record(batched, predictions, signal.SIGKILL) == -signal.SIGKILL
    assert 1 <= len(read_lines(predictions)) < 18
    with open(predictions, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"id": "niah/400/100#2", "dataset": "niah", "predic')

    assert (out := run_cli(batched)).returncode == 0, out.stderr[-2000:]
    one = [*args, "batch_size=1", f"output_root={tmp_path / 'b1'}"]
    assert (out := run_cli(one)).returncode == 0, out.stderr[-2000:]
    records, alone = read_lines(predictions), read_lines(job_dir(one) / "predictions.jsonl")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 18 and all(r["error"] is None for r in records)
    assert {r["id"]: r["prediction"] for r in records} == {r["id"]: r["prediction"] for r in alone}
    assert len({r["prediction"] for r in alone}) > 1


def test_sigterm_stops_the_job_as_ctrl_c_does(tiny_model_dir, haystack_dir, tmp_path):
    """``timeout`` and ``kill`` send SIGTERM: exit 130 as Ctrl-C, the shard's lock removed, the stored records kept."""
    args = [*tiny_model_args(tiny_model_dir), *GRID, f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path}"]
    predictions = job_dir(args) / "predictions.jsonl"
    assert signal_after_first_record(args, predictions, signal.SIGTERM) == 130
    assert 1 <= len(read_lines(predictions)) < 6 and not list(predictions.parent.glob(".lock.shard*"))
