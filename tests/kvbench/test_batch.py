"""Batched decoding (issue #58): rows of one decode batch answer as each answers alone, on tiny random models."""

from __future__ import annotations

import time

import pytest
import torch

from kvbench.engine import attention
from kvbench.engine.generate import Engine, Row, cache_bytes
from kvbench.engine.kvcache import RaggedLayer
from kvbench.job.config import Decode, Sampling
from kvbench.job.runner import candidate_seed, run_samples
from kvbench.job.store import JobStore
from methods import build_method
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.test_decode_fastpath import fake_varlen_attn
from tests.kvbench.test_units import EchoTask, loaded, question, snapkv  # noqa: F401 - the fixture

SAMPLING = Sampling(n=5, temperature=0.8, top_p=0.95)


def alone(engine, ctx, rows):
    """Each row's result decoded alone from a fork of ``ctx``."""
    return [engine.decode(engine.fork(ctx), n, [], 0, torch.Generator().manual_seed(k) if k is not None else None,
                          SAMPLING) for n, k in rows]


def batched(engine, ctx, rows, batch_size):
    out = {}
    engine.decode_rows([Row(engine.fork(ctx), n, [], 0, torch.Generator().manual_seed(k) if k is not None else None,
                            tag=i) for i, (n, k) in enumerate(rows)], batch_size, SAMPLING,
                       lambda row, result: out.setdefault(row.tag, result))
    return [out[i].tokens for i in range(len(rows))], [out[i] for i in range(len(rows))]


def test_sparse_reading_in_a_batch_equals_each_alone():
    """Quest (issue #59.5): each row of a batch reads its own pages, as it does alone."""
    lm = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=4))
    engine = Engine(lm, build_method({"name": "quest", "dense_layers": 1}, lm.layout), 32)
    ctx = engine.open([1 + (i * 7) % 120 for i in range(90)], 90)
    rows = [(20, 0), (9, 1), (20, 2)]
    want = alone(engine, ctx, rows)
    got, results = batched(engine, ctx, rows, 2)
    assert got == [r.tokens for r in want] and [len(t) for t in got] == [20, 9, 20]
    assert [r.read_tokens for r in results] == [r.read_tokens for r in want] and want[0].read_tokens


# uniform and per-head lengths, compressed while decoding; "varlen": CUDA's path, the rows' heads in one varlen call
@pytest.mark.parametrize("name", ["rkv", "adakv", "adakv varlen"])
def test_sampled_candidates_in_a_batch_equal_each_alone(monkeypatch, name):
    calls, backend = [], attention.decode_backend

    def varlen(q, *a, **k):  # varlen_attn's documented semantics on CPU; calls: the query rows (KV heads) of each
        calls.append(len(q))
        return fake_varlen_attn(q, *a, **k)

    if name.endswith("varlen"):
        monkeypatch.setattr(attention, "decode_backend", lambda layer, key, ref=False: "flash varlen" if not ref and
                            isinstance(layer, RaggedLayer) else backend(layer, key, ref))
        monkeypatch.setattr(attention, "varlen_attn", varlen)
    lm = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))
    engine = Engine(lm, build_method({"name": name.split()[0]}, lm.layout), 40, Decode(interval=8, schedule="length"))
    ctx = engine.open([1 + (i * 7) % 120 for i in range(60)], 60)
    rows = [(40, 0), (13, 1), (40, 2), (25, 3), (40, 4)]  # rows leave at different steps, slots refill (batch 3)
    want = alone(engine, ctx, rows)
    got, results = batched(engine, ctx, rows, 3)
    assert got == [r.tokens for r in want] and [len(t) for t in got] == [40, 13, 40, 25, 40]
    assert [r.decode_compressions for r in results] == [5, 1, 5, 3, 5]  # each row on its own schedule
    assert [(r.peak_stored_tokens, r.cache_trace) for r in results] == [(r.peak_stored_tokens, r.cache_trace) for r in want]
    assert not name.endswith("varlen") or {2, 4, 6} <= set(calls)  # alone, 2 and 3 rows' KV heads in one call


def test_greedy_rows_of_different_prompts_equal_each_alone():
    lm = loaded_for(tiny_model("qwen3", n_kv=2, n_q=4, layers=2))
    engine = Engine(lm, build_method({"name": "snapkv", "window_size": 8}, lm.layout), 32)
    prompts = [[1 + (i * s) % 120 for i in range(n)] for s, n in ((7, 90), (11, 50), (5, 120))]
    want = [engine.decode(engine.open(p, 20), 20, []).tokens for p in prompts]
    out = {}
    engine.decode_rows([Row(engine.open(p, 20), 20, [], tag=i) for i, p in enumerate(prompts)], 4, None,
                       lambda row, result: out.setdefault(row.tag, result.tokens))
    assert [out[i] for i in range(3)] == want


def test_a_row_pulled_later_is_no_part_of_a_live_rows_decode_time(monkeypatch):
    """The runner prefills a row as the batch pulls it: that time (here 100 s on a shifted clock) is the new row's,
    never the decode_s of the rows already decoding."""
    lm = loaded_for(tiny_model("qwen3", n_kv=2, n_q=4, layers=2))
    engine, shift, real = Engine(lm, build_method({"name": "full"}, lm.layout), 1.0), [0.0], time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + shift[0])

    def rows():
        for i in range(3):
            shift[0] += 100.0 * bool(i)  # rows 1 and 2 take 100 s to prefill
            yield Row(engine.open([1 + (i * 7 + j) % 120 for j in range(30)], 12), 12, [], tag=i)
    out = {}
    engine.decode_rows(rows(), 2, None, lambda row, result: out.setdefault(row.tag, result.decode_s))
    assert sorted(out) == [0, 1, 2] and all(0 < s < 100 for s in out.values()), out


def test_a_failed_batch_halves_and_decodes_every_row_again(monkeypatch):
    lm = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))
    engine = Engine(lm, build_method({"name": "rkv"}, lm.layout), 24, Decode(interval=8))
    ctx = engine.open([1 + (i * 7) % 120 for i in range(60)], 30)
    rows = [(30, k) for k in range(4)]
    want = alone(engine, ctx, rows)
    forward, calls = lm.model.forward, []

    def oom_at_four(*a, **k):  # a batch of 4 rows runs out of memory at its 5th step
        calls.append(k["input_ids"].shape[0])
        if calls[-1] == 4 and calls.count(4) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return forward(*a, **k)

    monkeypatch.setattr(lm.model, "forward", oom_at_four)
    got, _ = batched(engine, ctx, rows, 4)
    assert got == [r.tokens for r in want] and 2 in calls and 4 not in calls[calls.index(2):]


@pytest.mark.parametrize("sampling", [None, SAMPLING])  # greedy samples (NIAH's protocol) or sampled candidates
def test_a_batched_job_stores_the_records_of_batch_one(loaded, tmp_path, sampling):  # noqa: F811
    samples, n = [question(i) for i in range(3)], 5 if sampling else 1
    samples[1].prompt = samples[1].prompt[40:]  # prompts of other lengths
    records = []
    for b in (1, 4):
        store = JobStore(tmp_path / f"b{b}")
        engine = Engine(loaded, build_method({"name": "snapkv", "window_size": 8}, loaded.layout), 32)
        run_samples([engine], loaded, EchoTask("prompt"), samples, [store], True, sampling, 7, batch_size=b)
        records.append(sorted(store.records(), key=lambda r: r["id"]))
    ids = [f"d/{i}#{k}" if sampling else f"d/{i}" for i in range(3) for k in range(n)]
    assert [r["id"] for r in records[1]] == ids
    assert [r["prediction"] for r in records[1]] == [r["prediction"] for r in records[0]]
    assert [r["prefill_s"] > 0 for r in records[1]] == [k == 0 for i in range(3) for k in range(n)]  # charged once
    if sampling:
        assert len({r["prediction"] for r in records[1]}) > 1
        ctx = engine.open(loaded.tokenizer.encode(samples[2].prompt), 6)  # d/2#4 alone, from its own seed
        solo = engine.decode(ctx, 6, None, 0, torch.Generator().manual_seed(candidate_seed(7, "d/2", 4)), SAMPLING)
        assert records[1][-1]["prediction"] == solo.text


def test_auto_decodes_as_many_rows_as_max_bytes_fits(loaded, tmp_path, monkeypatch, caplog):  # noqa: F811
    """batch_size=auto: each row's peak bytes (its cache now, plus max_new_tokens tokens in every layer) against
    cache.max_bytes (or CUDA's free memory); a cap that fits 3 rows decodes 3 at a time; the records are batch 1's."""
    engine = Engine(loaded, build_method({"name": "snapkv", "window_size": 8}, loaded.layout), 32)
    ids, lay = loaded.tokenizer.encode(question(0).prompt), loaded.layout
    ctx, token = engine.open(ids, 6), lay.num_layers * lay.num_kv_heads * lay.head_dim * 2 * 4  # float32 keys, values
    row = engine.row_bytes(Row(ctx, 6))
    assert row == cache_bytes(ctx.state.cache) + 6 * token and cache_bytes(ctx.state.cache)
    decoding = Engine(loaded, build_method({"name": "rkv"}, loaded.layout), 24, Decode(interval=8))
    ctx = decoding.open(ids, 100)  # compressed while decoding: at most budget + interval tokens added
    assert decoding.row_bytes(Row(ctx, 100)) == cache_bytes(ctx.state.cache) + 32 * token
    forward, widths = loaded.model.forward, []
    monkeypatch.setattr(loaded.model, "forward", lambda *a, **k: widths.append(k["input_ids"].shape)
                        or forward(*a, **k))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * row + 1, 10**12))  # free, total on "CUDA"
    samples, records, most = [question(i) for i in range(7)], [], []
    caplog.set_level("INFO", "kvbench")
    for b, cap in ((1, None), ("auto", 3.5 * row), ("auto", None)):  # cache.max_bytes=1e9 is a float
        store, widths[:] = JobStore(tmp_path / f"{b}{cap}"), []
        run_samples([snapkv(loaded)], loaded, EchoTask("prompt"), samples, [store], True, None, 7, b, cap)
        records.append([(r["id"], r["prediction"]) for r in sorted(store.records(), key=lambda r: r["id"])])
        most.append(max(w[0] for w in widths if w[1] == 1))  # decode steps: (rows, 1)
    assert most == [1, 3, 2] and records[1] == records[2] == records[0] and len(records[0]) == 7
    assert "at most 3 rows decoded together" in caplog.text and "at most 2 rows" in caplog.text
