"""Decode-time compression (issue #46.1), checkpoints of a context (#48.1) and sampling (#46.3) in the engine,
on tiny random models."""

from __future__ import annotations

import pytest
import torch

from kvbench.job.config import Decode, Sampling
from kvbench.engine.generate import Engine
from methods import build_method
from methods.full import FullCache
from tests.conftest import loaded_for, tiny_model

PROMPT = [1 + (i * 7) % 120 for i in range(150)]


@pytest.fixture(scope="module")
def loaded():
    return loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))


def stored_per_step(engine: Engine) -> list[list[int]]:
    """The tokens each compressible layer's longest KV head holds before every decode step, read from the cache."""
    seen = []
    engine.on_decode_step = lambda step: seen.append(
        [engine.last_state.cache.layers[i].get_seq_length() for i in engine.last_state.layout.compressible_layers])
    return seen


@pytest.mark.parametrize("schedule", ["steps", "length"])
def test_snapkv_budget_64_interval_32_never_stores_more_than_96_tokens(loaded, schedule):
    engine = Engine(loaded, build_method({"name": "snapkv"}, loaded.layout), 64, Decode(interval=32, schedule=schedule))
    seen = stored_per_step(engine)
    result = engine.generate(PROMPT, 200, stop_ids=[])
    assert result.generated_tokens == 200 and len(seen) == 200
    assert max(map(max, seen)) == 95 and result.peak_stored_tokens == 96  # 95 + the token of the compressing forward
    assert result.decode_compressions == 6 and result.decode_compress_s > 0
    trace = result.cache_trace
    assert trace[0][:2] == [0, 64.0] and all(p[1] <= 96 for p in trace)
    after = trace[2:-1:2]  # the points just after each compression: back to the budget
    assert [p[1] for p in after] == [64.0] * 6
    if schedule == "steps":  # kvpress: every 32nd decode forward, the first after the 32nd token
        assert [p[0] for p in after] == [32, 64, 96, 128, 160, 192]
    else:  # R-KV: the forward that starts when the tokens fed (150 + generated - 1) are a multiple of 32
        assert [p[0] for p in after] == [11, 43, 75, 107, 139, 171]


def test_a_budget_never_reached_decodes_as_prefill_only(loaded):
    method = build_method({"name": "snapkv"}, loaded.layout)
    plain, decoding = Engine(loaded, method, 1000), Engine(loaded, method, 1000, Decode(interval=16))
    plain.record_logits = decoding.record_logits = True
    a, b = plain.generate(PROMPT, 40, stop_ids=[]), decoding.generate(PROMPT, 40, stop_ids=[])
    assert a.tokens == b.tokens and b.decode_compressions == 0
    assert all(torch.equal(x, y) for x, y in zip(plain.last_logits, decoding.last_logits))


def test_decode_only_keeps_the_prompt_until_the_first_compression(loaded):
    engine = Engine(loaded, build_method({"name": "knorm"}, loaded.layout), 64, Decode(interval=32, prefill=False))
    result = engine.generate(PROMPT, 100, stop_ids=[])
    assert result.compressed is False and result.cache_trace[0][1] == 150.0  # the whole prompt after prefill
    assert result.cache_trace[1][:2] == [32, 181.0] and result.cache_trace[2][:2] == [32, 64.0]


def test_a_compression_of_a_cache_that_holds_exactly_the_budget_counts(loaded):
    """R-KV's schedule cuts a layer holding exactly the budget (cut_at_budget): 40 prompt tokens < budget 48, the cache
    holds 48 when the tokens fed reach 48 (counted, though it holds 48 before and after), then at 64 and 80."""
    engine = Engine(loaded, build_method({"name": "rkv", "window_size": 4}, loaded.layout), 48,
                    Decode(interval=16, schedule="length"))
    result = engine.generate(PROMPT[:40], 45, stop_ids=[])
    assert [p[:2] for p in result.cache_trace[1:3]] == [[9, 48.0], [9, 48.0]]
    assert result.decode_compressions == 3


def test_adakv_cuts_ragged_layers_to_the_layer_budget(loaded):
    method = build_method({"name": "adakv", "floor_mode": "safeguard"}, loaded.layout)
    engine = Engine(loaded, method, 64, Decode(interval=32))
    result = engine.generate(PROMPT, 100, stop_ids=[])
    layer = engine.last_state.cache.layers[0]
    assert result.decode_compressions == 3 and hasattr(layer, "lens_host")
    after = result.cache_trace[2:-1:2]
    assert all(p[2] == after[0][2] for p in after)  # H_kv·64 tokens per layer after each compression (safeguard)
    assert sum(layer.lens_host) == 2 * 64 and layer.decoded == 100 - 96 - 1


@pytest.mark.parametrize("name", ["snapkv", "adakv"])
def test_a_restored_context_answers_the_same_again(loaded, name):
    engine = Engine(loaded, build_method({"name": name}, loaded.layout), 64, Decode(interval=16))
    ctx = engine.open(PROMPT[:140], 60)
    engine.feed(ctx, PROMPT[140:])
    saved = engine.checkpoint(ctx)
    first = engine.decode(ctx, 60, [])
    engine.restore(ctx, saved)
    second = engine.decode(ctx, 60, [])
    assert first.tokens == second.tokens and first.decode_compressions == second.decode_compressions == 3
    assert first.prefill_s > 0 and second.prefill_s == 0 and second.compress_s == 0  # the context was charged once
    assert first.tokens == engine.generate(PROMPT, 60, stop_ids=[], query_tokens=10).tokens


def test_sampling_equals_transformers_generate(loaded):
    """Candidate sampling draws what model.generate(do_sample=True) draws from the same seed."""
    sampling = Sampling(n=2, temperature=0.7, top_p=0.9, top_k=20)
    engine = Engine(loaded, FullCache(), 1.0)
    ours = engine.decode(engine.open(PROMPT, 30), 30, [], 0, torch.Generator().manual_seed(123), sampling).tokens
    model = loaded.model
    torch.manual_seed(123)
    model.set_attn_implementation("sdpa")
    try:
        hf = model.generate(torch.tensor([PROMPT]), do_sample=True, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=30,
                            min_new_tokens=30, pad_token_id=0)[0, len(PROMPT):].tolist()
    finally:
        model.set_attn_implementation("kvbench")
    greedy = engine.generate(PROMPT, 30, stop_ids=[]).tokens
    assert ours == hf and ours != greedy
