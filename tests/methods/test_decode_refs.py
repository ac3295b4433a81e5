"""The decode-time reference drivers of ``tests/methods/decode_refs.py`` do what they claim: R-KV's pipeline is plain
greedy decoding until it compresses, compresses in the forwards of its ``step_length`` schedule, and the kept
positions it reports are the tokens the cache holds (their keys, recorded as each token entered the cache); the
kvpress driver leaves kvpress's tokens unchanged, sees DecodingPress compress when its counters say, and its
positions are again the cache's tokens. kvpress's own decode-time behaviours the engine must reproduce (topk-order
slots, StreamingLLM's lost sinks, AdaKVPress's fake keys) are asserted where they show."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import pytest
import torch

from tests.conftest import tiny_model
from tests.methods import decode_refs
from tests.methods.decode_refs import (Compression, RefRun, assert_same_compressions, attention, kvpress_generate,
                                       rkv_generate)

N, Q, NEW, TARGET, INTERVAL = 40, 6, 30, 24, 10  # prompt, question part, new tokens; kvpress target and interval


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", n_kv=2, n_q=4, layers=2, seed=1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 128, (N,), generator=torch.Generator().manual_seed(0)).tolist()


@contextmanager
def recorded_rows(model, prompt: list[int]):
    """``{layer: {position: (H_kv, d) key}}``: the prompt's from a plain full prefill, every later token's as it
    enters the cache (a hook that runs before kvpress's, which are registered later; R-KV's window keeps it last)."""
    from transformers import DynamicCache

    full = DynamicCache(config=model.config)
    with attention(model, "sdpa"):
        model(torch.tensor([prompt]), past_key_values=full)
    rows = {i: {p: layer.keys[0, :, p] for p in range(len(prompt))} for i, layer in enumerate(full.layers)}

    def hook(module, args, kwargs, out):
        positions, keys = kwargs["position_ids"][0].tolist(), kwargs["past_key_values"].layers[module.layer_idx].keys[0]
        for j, p in enumerate(positions if positions[0] >= len(prompt) else []):
            rows[module.layer_idx][p] = keys[:, keys.shape[1] - len(positions) + j]

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield rows
    finally:
        for h in hooks:
            h.remove()


def assert_rows(run, rows):
    """Every compression's keys are the recorded keys of the positions it reports, slot for slot."""
    for c in run.compressions:
        expected = torch.stack([torch.stack([rows[c.layer][p][h] for p in kept]) for h, kept in enumerate(c.kept)])
        assert torch.equal(c.keys, expected), (c.fed, c.layer)


def greedy(model, ids, new):
    from transformers import DynamicCache

    cache, tokens = DynamicCache(config=model.config), []
    with attention(model, "sdpa"):
        logits = model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]
        for step in range(new):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits[0, -1]
    return tokens


def test_rkv_reference_without_compression_is_plain_greedy(model, ids):
    run = rkv_generate(model, ids, 20, budget=1000, divide_length=4, window_size=4)
    assert run.compressions == [] and run.tokens == greedy(model, ids, 20)


@pytest.mark.parametrize("n,feds", [(N, [40, 49, 65]), (20, [33, 49, 65])])
def test_rkv_reference_compresses_on_its_schedule_and_reports_the_cached_tokens(model, ids, n, feds):
    """budget 24, divide_length 16: the prefill when n >= 24, then the forward after each one that brings the tokens
    fed to a multiple of 16 (fed before it 48, 64; 32 for the 20-token prompt: 33 tokens >= 24), every layer;
    budget tokens a head, the window (4) last and in order; the keys those of the reported positions."""
    with recorded_rows(model, ids[:n]) as rows:
        run = rkv_generate(model, ids[:n], 80 - n, budget=24, divide_length=16, window_size=4)
    assert [(c.fed, c.layer) for c in run.compressions] == [(f, i) for f in feds for i in (0, 1)]
    for c in run.compressions:
        assert c.scored == 4 and all(len(kept) == 24 == len(set(kept)) for kept in c.kept)
        assert all(kept[-4:] == list(range(c.fed - 4, c.fed)) and max(kept) < c.fed for kept in c.kept)
    assert_rows(run, rows)
    assert run.tokens != greedy(model, ids[:n], 80 - n)  # the compressed cache is the one decoded from


def press(kind: str, prefill: bool):
    import kvpress

    def base():
        return {"knorm": lambda: kvpress.KnormPress(), "streamingllm": lambda: kvpress.StreamingLLMPress(),
                "adakv": lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(window_size=4))}[kind]()

    decoding = kvpress.DecodingPress(base(), compression_interval=INTERVAL, target_size=TARGET, hidden_states_buffer_size=16)
    if not prefill:
        return decoding
    first = base()
    first.compression_ratio = 0.5
    return kvpress.PrefillDecodingPress(prefilling_press=first, decoding_press=decoding)


def run_kvpress(model, ids, kind, prefill, protocol):
    context = ids[: N - Q] if protocol == "pipeline" else ids
    return context, kvpress_generate(model, press(kind, prefill), context, NEW,
                                     ids[N - Q:] if protocol == "pipeline" else None)


CASES = [(k, p, proto) for k in ("knorm", "streamingllm", "adakv") for p in (False, True) for proto in ("pipeline", "prompt")]


@pytest.mark.parametrize("kind,prefill,protocol", CASES)
def test_kvpress_reference_leaves_kvpress_unchanged(model, ids, kind, prefill, protocol, monkeypatch):
    pytest.importorskip("kvpress")
    ours = run_kvpress(model, ids, kind, prefill, protocol)[1]
    monkeypatch.setattr(decode_refs, "_instrumented", lambda *args: nullcontext())
    assert ours.tokens == run_kvpress(model, ids, kind, prefill, protocol)[1].tokens and len(ours.tokens) == NEW


@pytest.mark.parametrize("kind,prefill,protocol", CASES)
def test_kvpress_reference_follows_decoding_press(model, ids, kind, prefill, protocol):
    """Every INTERVAL-th forward after the prefill compresses each layer to TARGET tokens a head (AdaKVPress: TARGET
    on average, masked): the pipeline's question forward counts as one (its 6 hidden states one buffer entry), so
    the tokens fed are 34 + 6 + 9 = 49, 59, 69; over the whole prompt 50, 60. A PrefillDecodingPress first halves the
    prompt at prefill. Kept keys are the keys of the reported positions (not for AdaKVPress: see the next test)."""
    pytest.importorskip("kvpress")
    context = ids[: N - Q] if protocol == "pipeline" else ids
    with recorded_rows(model, context) as rows:
        run = run_kvpress(model, ids, kind, prefill, protocol)[1]
    n = len(context)
    decode = [(49, 15), (59, 10), (69, 10)] if protocol == "pipeline" else [(50, 10), (60, 10)]
    steps = [(n, n, n // 2)] * prefill + [(fed, scored, TARGET) for fed, scored in decode]
    assert [(c.fed, c.layer, c.scored) for c in run.compressions] == [(f, i, s) for f, s, _ in steps for i in (0, 1)]
    for c, (_, _, m) in zip(run.compressions, [s for s in steps for _ in (0, 1)]):
        sizes = [len(set(kept)) for kept in c.kept]
        assert (sum(sizes) == 2 * m) if kind == "adakv" else (sizes == [m, m])
    if kind != "adakv":
        assert_rows(run, rows)
    if kind == "streamingllm" and not prefill:  # slots in topk order: from the 2nd compression the sinks drift
        first, second = run.compressions[0].kept, run.compressions[2].kept
        assert all(set(range(4)) <= set(kept) for kept in first)
        assert any(not set(range(4)) <= set(kept) for kept in second)


def test_adakv_decoding_masks_with_fake_keys_and_rescoring_unmasks(model, ids):
    """AdaKVPress in a DecodingPress frees nothing: the cache keeps every slot, kvpress's attention patch writes a
    fake key into the cache at each masked slot, and the next compression scores those slots and keeps some again."""
    pytest.importorskip("kvpress")
    with recorded_rows(model, ids) as rows:
        run = run_kvpress(model, ids, "adakv", False, "prompt")[1]
    first, second = run.compressions[0], run.compressions[2]  # layer 0 at 50 and 60 tokens fed
    assert (first.layer, second.layer, first.keys.shape[1], second.keys.shape[1]) == (0, 0, 50, 60)
    masked = [set(range(50)) - set(kept) for kept in first.kept]
    for h, slots in enumerate(masked):
        assert all(not torch.equal(second.keys[h, p], rows[0][p][h]) for p in slots)  # fake keys
        assert all(torch.equal(second.keys[h, p], rows[0][p][h]) for p in set(range(60)) - slots)
    assert any(slots & set(kept) for slots, kept in zip(masked, second.kept))  # masked, then kept again


def run_of(*kept, tokens=(1, 2, 3), scores=None, feds=None) -> RefRun:
    """A run of one head's compressions, ``kept[k]`` at the forward ``feds[k]`` (prompt 10: 10, 11, ...)."""
    return RefRun(list(tokens), [Compression(fed, 0, [list(k)], torch.empty(0), 1, scores and [list(scores[i])])
                                 for i, (fed, k) in enumerate(zip(feds or range(10, 10 + len(kept)), kept))])


def test_comparison_accepts_near_ties_in_the_other_order_and_nothing_else():
    """assert_same_compressions: equal runs pass, and two positions whose reference scores differ by float noise
    (2e-7 of the head's largest score) may come in the other order; a changed kept set, a duplicate, two positions
    of well-separated scores (or a run with no scores) in the other order, other tokens: all fail."""
    scores = [[0.9, 0.5 + 2e-7, 0.5, 0.1]]
    theirs = run_of([7, 3, 5, 1], scores=scores)
    assert assert_same_compressions(run_of([7, 3, 5, 1]), theirs, 10) == 1
    assert assert_same_compressions(run_of([7, 5, 3, 1]), theirs, 10) == 1  # 3 and 5: a near-tie
    for kept, tokens, why in [([7, 3, 5, 2], (1, 2, 3), "kept sets differ"), ([7, 3, 5, 5], (1, 2, 3), "kept twice"),
                              ([3, 7, 5, 1], (1, 2, 3), "order differs"), ([7, 3, 1, 5], (1, 2, 3), "order differs"),
                              ([7, 3, 5, 1], (1, 2, 4), "tokens differ")]:
        with pytest.raises(AssertionError, match=why):
            assert_same_compressions(run_of(kept, tokens=tokens), theirs, 10)
    with pytest.raises(AssertionError, match="order differs"):  # exact scores (None): the exact order
        assert_same_compressions(run_of([7, 5, 3, 1]), run_of([7, 3, 5, 1]), 10)
    with pytest.raises(AssertionError, match="order differs"):  # R-KV's window (inf): its position order
        window = run_of([3, 1, 7, 5], scores=[[0.2, 0.1, math.inf, math.inf]])
        assert_same_compressions(run_of([3, 1, 5, 7]), window, 10)


def test_comparison_stops_where_the_order_feeds_the_next_compression():
    """order_feeds_forward (R-KV): a near-tie stored in the other order at the forward fed 10 tokens; the next
    compression (fed 12) may then keep another set and the tokens after the forward at 12 differ. Compared: the
    compressions at 10 and the tokens through 12. Without a swap everything is compared."""
    near = [[0.9, 0.5 + 2e-7, 0.5, 0.1], [0.9, 0.8, 0.7, 0.6]]
    theirs = run_of([7, 3, 5, 1], [7, 3, 5, 11], tokens=(1, 2, 3, 4), scores=near, feds=[10, 12])
    parted = run_of([7, 5, 3, 1], [7, 3, 5, 9], tokens=(1, 2, 3, 9), feds=[10, 12])
    assert assert_same_compressions(parted, theirs, 10, order_feeds_forward=True) == 1
    with pytest.raises(AssertionError, match="kept sets differ"):
        assert_same_compressions(parted, theirs, 10)
    with pytest.raises(AssertionError, match="greedy tokens differ"):  # the token of the forward at 12
        assert_same_compressions(run_of([7, 5, 3, 1], [7, 3, 5, 9], tokens=(1, 2, 8, 9), feds=[10, 12]), theirs, 10,
                                 order_feeds_forward=True)
    with pytest.raises(AssertionError, match="kept sets differ"):  # no swap: the next compression compared too
        assert_same_compressions(run_of([7, 3, 5, 1], [7, 3, 5, 9], tokens=(1, 2, 3, 4), feds=[10, 12]), theirs, 10,
                                 order_feeds_forward=True)
