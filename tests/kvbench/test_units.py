"""One context, many answers (issue #48.1, #46.3): samples sharing a context are prefilled and compressed once,
multi-turn conversations build on one cache, sampled candidates are records of their own; each resumes alone."""

from __future__ import annotations

import pytest

from eval.base import Sample, Task
from kvbench.config import Sampling
from kvbench.engine import Engine
from kvbench.runner import candidate_seed, run_sample, run_samples
from kvbench.store import JobStore
from methods import build_method
from methods.full import FullCache
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.test_isolation import CharTokenizer

CONTEXT = "the quick brown fox jumps over the lazy dog and runs far away from the hunter " * 2


class EchoTask(Task):
    """Scores 1 when the prediction is non-empty."""

    name = "echo"

    def __init__(self, compress: str = "context"):
        super().__init__({"name": "echo", "compress": compress})

    def score(self, sample, prediction):
        return float(bool(prediction))


def question(i: int, group: str = "") -> Sample:
    q = f" question {i}: where?"
    return Sample(id=f"d/{i}", dataset="d", prompt=CONTEXT + q, query=q, max_new_tokens=6, answers=["x"], chat=False,
                  group=group)


@pytest.fixture(scope="module")
def loaded():
    lm = loaded_for(tiny_model("llama", layers=2))
    lm.tokenizer = CharTokenizer()
    lm.tokenizer.eos_token_id = 3
    return lm


def counting(monkeypatch) -> list[int]:
    opened, open_ = [], Engine.open
    monkeypatch.setattr(Engine, "open", lambda self, ids, *a, **k: opened.append(len(ids)) or open_(self, ids, *a, **k))
    return opened


def snapkv(loaded):
    return Engine(loaded, build_method({"name": "snapkv", "window_size": 8}, loaded.layout), 32)


def test_questions_on_one_context_prefill_it_once_and_answer_as_alone(loaded, tmp_path, monkeypatch):
    samples = [question(i) for i in range(3)] + [Sample(id="o/0", dataset="o", prompt="another text " * 9 + " q?",
                                                        query=" q?", max_new_tokens=6, answers=["x"], chat=False)]
    alone = [run_sample(snapkv(loaded), loaded, EchoTask(), s) for s in samples]
    opened = counting(monkeypatch)
    store = JobStore(tmp_path)
    run_samples([snapkv(loaded)], loaded, EchoTask(), samples, [store], quiet=True)
    records = store.records()
    assert opened == [len(CONTEXT), len("another text " * 9)]  # one prefill per context
    assert [r["prediction"] for r in records] == [r["prediction"] for r in alone]
    assert [r["kept_tokens"] for r in records] == [r["kept_tokens"] for r in alone]
    assert [(r["turn"], r["group_compressions"]) for r in records[:3]] == [(0, 1)] * 3 and "group" not in records[3]
    assert len({r["group"] for r in records[:3]}) == 1
    assert records[0]["prefill_s"] > 0 and records[1]["compress_s"] == records[2]["compress_s"] == 0  # charged once
    (tmp_path / "predictions.jsonl").write_text("".join(
        line for line in (tmp_path / "predictions.jsonl").read_text().splitlines(True) if '"d/1"' not in line))
    opened.clear()
    run_samples([snapkv(loaded)], loaded, EchoTask(), samples, [store], quiet=True)  # resumes the missing question
    assert opened == [len(CONTEXT)] and store.latest()["d/1"]["prediction"] == records[1]["prediction"]


@pytest.mark.parametrize("keep_answer", [False, True])
def test_turns_build_on_one_cache(loaded, tmp_path, keep_answer):
    """Golden history: each follow-up segment lands on the context and earlier segments, answers rolled back;
    own answers: they stay, and an answer cut by the limit is followed by an eos (SCBench's GreedySearch)."""
    turns = [Sample(id="c/0/0", dataset="c", prompt=CONTEXT + " q0?", query=" q0?", max_new_tokens=5, answers=["x"],
                    chat=False, group="c/0", keep_answer=keep_answer)]
    turns += [Sample(id=f"c/0/{k}", dataset="c", prompt=f" answer. q{k}?", max_new_tokens=5, answers=["x"], chat=False,
                     group="c/0", turn=k, follow_up=True, keep_answer=keep_answer) for k in (1, 2)]
    store = JobStore(tmp_path)
    run_samples([Engine(loaded, FullCache(), 1.0)], loaded, EchoTask("prompt"), turns, [store], quiet=True)
    records = store.records()
    assert [r["id"] for r in records] == ["c/0/0", "c/0/1", "c/0/2"] and all(r["group"] == "c/0" for r in records)
    tok = loaded.tokenizer.encode
    ids = tok(CONTEXT + " q0?")
    for k, r in enumerate(records[:2]):
        answer = [int(t) for t in r["prediction"].split()]
        ids += (answer[:-1] + [3] if keep_answer else []) + tok(f" answer. q{k + 1}?")  # 5 tokens: cut by the limit
    expected = Engine(loaded, FullCache(), 1.0).generate(ids, 5, stop_ids=[]).text
    assert records[2]["prediction"] == expected and records[2]["prompt_tokens"] == len(ids)
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines(True)
    (tmp_path / "predictions.jsonl").write_text(lines[0] + lines[2])
    run_samples([Engine(loaded, FullCache(), 1.0)], loaded, EchoTask("prompt"), turns, [store], quiet=True)
    assert store.latest()["c/0/1"]["prediction"] == records[1]["prediction"]  # the conversation replayed to turn 1


def test_candidates_are_records_that_resume_alone(loaded, tmp_path):
    engine, store, sample = Engine(loaded, FullCache(), 1.0), JobStore(tmp_path), question(0)
    sampling = Sampling(n=3, temperature=0.8, top_p=0.95)
    run_samples([engine], loaded, EchoTask("prompt"), [sample], [store], True, sampling, seed=7)
    first = store.records()
    assert [(r["id"], r["problem"], r["candidate"]) for r in first] == [(f"d/0#{k}", "d/0", k) for k in range(3)]
    assert len({r["prediction"] for r in first}) == 3
    run_samples([engine], loaded, EchoTask("prompt"), [sample], [store], True, Sampling(n=4, temperature=0.8, top_p=0.95), 7)
    records = store.records()
    assert records[:3] == first and [r["id"] for r in records[3:]] == ["d/0#3"]  # only the new candidate ran
    import torch

    ctx = engine.open(loaded.tokenizer.encode(sample.prompt), 6)  # candidate 3 alone, from its own seed
    alone = engine.decode(ctx, 6, None, 0, torch.Generator().manual_seed(candidate_seed(7, "d/0", 3)), sampling)
    assert records[3]["prediction"] == alone.text
