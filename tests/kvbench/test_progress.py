"""Progress outside a terminal (issue #50): a line per sample at most once a minute (and the last), signs of life
during a long generation, the mean over every stored record (resumed ones too), an eta."""

from __future__ import annotations

import logging

import pytest

import kvbench.job.runner as runner
from eval.base import Sample
from kvbench.job.store import JobStore


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(runner.time, "monotonic", clock)
    monkeypatch.setattr(runner.sys.stderr, "isatty", lambda: False)
    return clock


def sample(i: int) -> Sample:
    return Sample(id=f"s/{i}", dataset="s", prompt="p", max_new_tokens=4, answers=["a"])


def test_log_lines_are_at_most_one_a_minute_with_the_resumed_mean_and_an_eta(tmp_path, clock, caplog):
    store = JobStore(tmp_path)
    store.append({"id": "s/0", "score": 0.5, "error": None})  # stored by an earlier run
    store.append({"id": "s/1", "score": None, "error": {"type": "X", "message": ""}})  # failed: not in the mean
    progress = runner.Progress(total=3, stores=[store], quiet=False)
    caplog.set_level(logging.INFO, logger="kvbench")
    clock.now += 10
    progress.scored(0, {"score": 1.0, "error": None})
    progress.sample_done(sample(1), ["score 100.00"])  # 10 s after the start: no line yet
    clock.now += 70
    progress.step(17)  # a long generation: a sign of life
    clock.now += 20
    progress.scored(0, {"score": 0.0, "error": None})
    progress.sample_done(sample(2), ["score 0.00"])  # 20 s after the last line: none
    clock.now += 5
    progress.scored(0, {"score": 1.0, "error": None})
    progress.sample_done(sample(3), ["score 100.00"])  # the last one: always
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("sample 2/3: generating, 17 tokens so far; mean 75.00, eta 00:02:40")  # 80 s for 1 sample, 2 left
    assert lines[1] == "sample 3/3 s/3: score 100.00; mean 62.50, eta 00:00:00"  # (50 + 100 + 0 + 100) / 4


def test_the_first_prefill_has_a_line_and_several_jobs_label_their_means(tmp_path, clock, caplog):
    stores = [JobStore(tmp_path / "snapkv" / "b0.25-aaaa"), JobStore(tmp_path / "knorm" / "b0.25-bbbb")]
    stores[0].append({"id": "s/0", "score": 0.5, "error": None})
    progress = runner.Progress(total=2, stores=stores, quiet=False)
    caplog.set_level(logging.INFO, logger="kvbench")
    progress.starting(sample(1))  # at once: loading to the first answer says what it does
    clock.now += 10
    progress.sample_done(sample(1), ["score 0.00"])
    progress.starting(sample(2))  # within the minute: none
    assert [r.getMessage() for r in caplog.records] == [
        "sample 1/2 s/1: prefilling; mean snapkv/b0.25-aaaa 50.00, knorm/b0.25-bbbb -, eta ?"]
