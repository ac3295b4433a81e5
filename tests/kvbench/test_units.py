"""One context, many answers (issue #48.1, #46.3): samples sharing a context are prefilled and compressed once,
multi-turn conversations build on one cache, sampled candidates are records of their own; each resumes alone."""

from __future__ import annotations

import pytest

from eval.base import Sample, Task
from kvbench.job.config import Sampling
from kvbench.engine.generate import Engine
from kvbench.job.runner import candidate_seed, run_sample, run_samples
from kvbench.job.store import JobStore
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


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_failed_candidate_leaves_the_stored_ones_alone(loaded, tmp_path, monkeypatch, batch_size):
    """Candidate 1's forking/decoding fails after candidate 0 was stored (or sent to the batch): every candidate
    is stored exactly once: 0 answered, 1 and 2 (the sample's rest) failed."""
    import kvbench.engine.generate as generate

    engine, store = Engine(loaded, FullCache(), 1.0), JobStore(tmp_path)
    calls, fork, decode = [], Engine.fork, Engine.decode

    def failing(real):
        def call(self, *a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise generate.NonFiniteLogitsError("injected")
            return real(self, *a, **k)
        return call

    monkeypatch.setattr(Engine, "fork" if batch_size > 1 else "decode", failing(fork if batch_size > 1 else decode))
    run_samples([engine], loaded, EchoTask("prompt"), [question(0)], [store], True, Sampling(n=3, temperature=0.8),
                seed=7, batch_size=batch_size)
    records = store.records()
    assert sorted(r["id"] for r in records) == [f"d/0#{k}" for k in range(3)]
    assert [r["error"] is None for r in sorted(records, key=lambda r: r["id"])] == [True, False, False]


class Encoding(dict):
    __getattr__ = dict.__getitem__


class LoogleTokenizer(CharTokenizer):
    """CharTokenizer whose calls answer as transformers' BatchEncoding does (keys and attributes)."""

    def __call__(self, text, **kwargs):
        return Encoding(input_ids=self.encode(text))


def test_a_loogle_document_with_three_questions_is_prefilled_once_and_answers_as_alone(tmp_path, monkeypatch):
    """Issue #48's acceptance: a LooGLE-shaped folder, 3 questions on one document, task.compress=context."""
    import json

    from eval.loogle import LoogleTask

    lm = loaded_for(tiny_model("llama", layers=2))
    lm.tokenizer = LoogleTokenizer()
    qa = [{"S": "", "Q": q, "A": "x"} for q in ("Where was he born?", "Who was he?", "What did he play?")]
    row = {"input": "Picardo was born in Jerez and played the guitar all his life. " * 4, "title": "Picardo",
           "qa_pairs": str(qa), "output": "none"}
    (tmp_path / "shortdep_qa.jsonl").write_text(json.dumps(row) + "\n")
    cfg = {"name": "loogle", "datasets": ["shortdep_qa"], "n_samples": None, "data_dir": str(tmp_path),
           "source": "official", "hub_dataset": None, "max_length": 100_000, "compress": "context"}
    task = LoogleTask(cfg, lm.tokenizer, 100_000)
    samples = list(task.samples())
    alone = [run_sample(snapkv(lm), lm, task, s) for s in samples]
    opened, store = counting(monkeypatch), JobStore(tmp_path / "job")
    run_samples([snapkv(lm)], lm, task, samples, [store], quiet=True)
    records = store.records()
    assert len(samples) == 3 and len(opened) == 1  # the document's context: prefilled and compressed once
    assert [r["group_compressions"] for r in records] == [1, 1, 1] and len({r["group"] for r in records}) == 1
    assert [r["prediction"] for r in records] == [r["prediction"] for r in alone]


def test_a_shared_sweep_prefills_a_shared_context_once_for_every_job(loaded, tmp_path, monkeypatch):
    """sweep.share_prefill with units (issue #48.4): one prefill of the context for both methods' jobs, each job's
    records as it stores them alone."""
    import kvbench.engine.generate

    samples = [question(i) for i in range(3)]
    knorm = lambda: Engine(loaded, build_method({"name": "knorm", "recent_window": 4}, loaded.layout), 32)  # noqa: E731
    alone = [[run_sample(make(), loaded, EchoTask(), s)["prediction"] for s in samples]
             for make in (lambda: snapkv(loaded), knorm)]
    calls, prefill = [], kvbench.engine.generate.prefill
    monkeypatch.setattr(kvbench.engine.generate, "prefill", lambda engines, *a: calls.append(len(engines)) or prefill(engines, *a))
    stores = [JobStore(tmp_path / "a"), JobStore(tmp_path / "b")]
    run_samples([snapkv(loaded), knorm()], loaded, EchoTask(), samples, stores, quiet=True)
    assert calls == [2]  # one forward over the context, both methods compress it
    assert [[r["prediction"] for r in s.records()] for s in stores] == alone
