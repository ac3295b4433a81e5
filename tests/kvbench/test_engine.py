"""Engine tests on tiny randomly initialised models (no weights, no network)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.engine.generate import Engine
from methods.base import CompressResult, Method, Plan
from methods.full import FullCache
from methods.snapkv import SnapKV, SnapKVConfig
from tests.conftest import loaded_for, tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]


def hf_greedy(model, ids, steps):
    """Reference: the unpatched model (SDPA/eager as transformers ships it), greedy, full cache."""
    from transformers import DynamicCache

    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    cache = DynamicCache(config=ref.config)
    out = ref(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    logits, toks = [out.logits[0, -1]], []
    for step in range(steps):
        tok = int(logits[-1].argmax())
        toks.append(tok)
        if step == steps - 1:
            break
        out = ref(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return toks, logits


@pytest.mark.parametrize("family", FAMILIES)
def test_full_cache_matches_reference_model(family):
    model = tiny_model(family, layers=2)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_toks, ref_logits = hf_greedy(model, ids, 6)
    loaded = loaded_for(model)
    eng = Engine(loaded, FullCache(layout=loaded.layout), 1.0)
    eng.record_logits = True
    res = eng.generate(ids, 6, stop_ids=[])
    assert res.tokens == ref_toks
    for a, b in zip(eng.last_logits, ref_logits):
        torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_snapkv_runs_and_keeps_budget_on_every_family(family):
    model = tiny_model(family, layers=2)
    loaded = loaded_for(model)
    ids = list(range(1, 61))
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 20)
    res = eng.generate(ids, 4, stop_ids=[])
    assert res.compressed and res.generated_tokens == 4
    comp = loaded.layout.compressible_layers
    assert set(eng.last_state.results) == set(comp)
    for i in comp:
        assert eng.last_state.cache.layers[i].keys.shape[-2] == 20 + 3  # 20 kept + 3 decoded tokens appended
    if family == "gemma3":
        assert comp == (1,)  # the sliding-window layer is left alone


def _reference_snapkv_indices(model, ids, layer, window, kernel, budget):
    """SnapKV kept indices computed independently: queries rebuilt from the layer input."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    captured = {}
    attn = ref.model.layers[layer].self_attn

    def hook(mod, args, kwargs):
        captured["h"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured["pe"] = kwargs["position_embeddings"]

    attn.register_forward_pre_hook(hook, with_kwargs=True)
    cache = DynamicCache(config=ref.config)
    ref(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    keys = cache.layers[layer].keys[0]  # (H_kv, n, d)
    h = captured["h"]
    cos, sin = captured["pe"]
    n_q, d = ref.config.num_attention_heads, ref.config.head_dim
    q = attn.q_proj(h).view(1, len(ids), n_q, d).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    q = q[0, :, -window:]  # (H_q, W, d)
    g = n_q // keys.shape[0]
    n = len(ids)
    scores = torch.zeros(n_q, n)
    for hq in range(n_q):
        k = keys[hq // g]
        for wi in range(window):
            pos = n - window + wi
            logits = (q[hq, wi] @ k[: pos + 1].T) / math.sqrt(d)
            scores[hq, : pos + 1] += torch.softmax(logits, -1)
    # SnapKV / KVCache-Factory / kvpress pool the n - W prefix scores only (zero padding)
    pooled = F.avg_pool1d(scores[:, None, : n - window], kernel, 1, kernel // 2)[:, 0]
    per_kv = pooled.view(keys.shape[0], g, n - window).mean(1)
    top = per_kv.topk(budget - window, dim=-1).indices
    recent = torch.arange(n - window, n).expand(keys.shape[0], window)
    return torch.cat([top, recent], -1).sort(-1).values


@pytest.mark.parametrize("n_kv", [4, 2], ids=["MHA", "GQA"])
def test_kept_indices_equal_independent_topk(n_kv):
    model = tiny_model("llama", n_kv=n_kv, n_q=4, layers=2)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=6, kernel_size=3), loaded.layout), 16)
    eng.generate(ids, 2, stop_ids=[])
    for layer in range(2):
        kept = eng.last_state.results[layer].kept_indices[0]
        assert kept.shape == (n_kv, 16)
        expected = _reference_snapkv_indices(model, ids, layer, 6, 3, 16)
        assert torch.equal(kept, expected)
        assert eng.last_state.cache.layers[layer].keys.shape[-2] == 16 + 1


class BiasMethod(Method):
    """Keeps every token and returns a fixed logit bias (test double)."""

    name = "bias"

    def __init__(self, layout, bias_fn, drop=None):
        super().__init__(None, layout)
        self.bias_fn, self.drop = bias_fn, drop

    def plan(self, n_tokens, budget, layout):
        return Plan([n_tokens] * layout.num_layers, compress=True)

    def compress(self, ctx):
        k, v = ctx.keys, ctx.values
        if self.drop is not None:
            keep = [i for i in range(ctx.n_tokens) if i != self.drop]
            return CompressResult(keys=k[:, :, keep], values=v[:, :, keep])
        return CompressResult(keys=k, values=v, logit_bias=self.bias_fn(k))


@pytest.mark.parametrize("n_kv", [4, 2], ids=["MHA", "GQA"])
def test_zero_bias_decode_equals_unpatched_model(n_kv):
    model = tiny_model("llama", n_kv=n_kv, n_q=4)
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    _, ref_logits = hf_greedy(model, ids, 5)
    loaded = loaded_for(model)
    eng = Engine(loaded, BiasMethod(loaded.layout, lambda k: torch.zeros(k.shape[0], k.shape[1], k.shape[2])), 1.0)
    eng.record_logits = True
    eng.generate(ids, 5, stop_ids=[])
    assert all(eng.last_state.cache.layers[i].bias_rows == 1 for i in range(2))  # the biased decode path was taken
    for a, b in zip(eng.last_logits, ref_logits):
        torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_kv", [4, 2], ids=["MHA", "GQA"])
def test_minus_inf_bias_equals_physical_removal(n_kv):
    model = tiny_model("llama", n_kv=n_kv, n_q=4)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(7)).tolist()

    def minus_inf_at_7(k):
        b = torch.zeros(k.shape[0], k.shape[1], k.shape[2])
        b[..., 7] = float("-inf")
        return b

    masked = Engine(loaded, BiasMethod(loaded.layout, minus_inf_at_7), 1.0)
    removed = Engine(loaded, BiasMethod(loaded.layout, None, drop=7), 1.0)
    masked.record_logits = removed.record_logits = True
    ra, rb = masked.generate(ids, 5, stop_ids=[]), removed.generate(ids, 5, stop_ids=[])
    assert ra.tokens == rb.tokens
    # the first logits come from the uncompressed prefill; decode steps must agree
    for a, b in zip(masked.last_logits[1:], removed.last_logits[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_budget_one_point_zero_is_lossless():
    model = tiny_model("llama")
    loaded = loaded_for(model)
    ids = list(range(3, 50))
    full = Engine(loaded, FullCache(layout=loaded.layout), 1.0).generate(ids, 5, stop_ids=[])
    snap = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 1.0).generate(ids, 5, stop_ids=[])
    assert snap.tokens == full.tokens and not snap.compressed


def test_cache_bytes_and_stats():
    model = tiny_model("llama", n_kv=2, n_q=4, layers=2)
    loaded = loaded_for(model)
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 0.5)
    res = eng.generate(list(range(1, 41)), 2, stop_ids=[])
    per_token = 2 * 2 * 16 * 4  # keys+values × H_kv × d × 4 bytes
    assert res.cache_bytes_before == 2 * 40 * per_token
    assert res.cache_bytes_after == 2 * 20 * per_token
    assert res.kept_tokens == {"mean": 20.0, "min": 20.0, "max": 20.0}


@pytest.mark.parametrize("budget", [1e-9, 0.01])
def test_tiny_ratio_keeps_what_the_method_always_keeps(budget, caplog):
    """0.01 × 60 = 0 tokens: every layer keeps SnapKV's W = 4 window tokens instead of failing."""
    model = tiny_model("llama", n_kv=2, n_q=4, layers=2)
    loaded = loaded_for(model)
    ids = list(range(1, 61))
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), budget)
    with caplog.at_level("WARNING", logger="kvbench.engine.generate"):
        res = eng.generate(ids, 3, stop_ids=[])
    assert f"budget={budget}: fewer tokens than the 4 that method snapkv always keeps" in caplog.text
    assert res.compressed and res.generated_tokens == 3
    assert res.kept_tokens == {"mean": 4.0, "min": 4.0, "max": 4.0}
    for i in loaded.layout.compressible_layers:
        kept = eng.last_state.results[i].kept_indices
        assert sorted(kept[0, 0].tolist()) == [56, 57, 58, 59]  # exactly the observation window


def test_budget_floor_on_plans():
    from methods.base import apply_budget_floor

    plan = Plan(layer_budgets=[0, 5, 40], head_budgets=torch.tensor([[1, 9], [3, 3], [40, 40]]))
    out = apply_budget_floor(plan, n_tokens=50, floor=4)
    assert out.layer_budgets == [4, 5, 40] and out.compress
    assert out.head_budgets.tolist() == [[4, 9], [4, 4], [40, 40]]
    assert apply_budget_floor(plan, n_tokens=3, floor=4).layer_budgets == [3, 5, 40]  # never above n
    assert not apply_budget_floor(Plan(layer_budgets=[1, 2]), n_tokens=3, floor=4).compress  # all layers keep all n
    same = Plan(layer_budgets=[6, 7])
    assert apply_budget_floor(same, 50, 4) is same


# ---- task.compress=context: the query part prefilled on the compressed cache --------------------


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])  # gemma: soft-capping, sliding layers
def test_query_part_on_a_full_cache_generates_what_the_whole_prompt_does(family):
    """Nothing compressed: the query part's forward on the context's cache is the prompt's own prefill split in two."""
    loaded = loaded_for(tiny_model(family, layers=3))
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    whole, split = (Engine(loaded, FullCache(layout=loaded.layout), 1.0) for _ in range(2))
    for e in (whole, split):
        e.record_logits = True
    ref, res = whole.generate(ids, 6, stop_ids=[]), split.generate(ids, 6, stop_ids=[], query_tokens=12)
    assert res.tokens == ref.tokens and (res.prompt_tokens, res.compressed_tokens, ref.compressed_tokens) == (50, 38, 50)
    for a, b in zip(split.last_logits, whole.last_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["snapkv", "adakv", "selkv"])  # uniform, per-head lengths, bias columns
def test_query_part_equals_its_ids_fed_one_by_one(name):
    """The query part in one forward (causal per head over the compressed cache) gives the logits and tokens of
    feeding its ids one by one as decode steps on the same compressed context."""
    from kvbench.engine.attention import attach_bias
    from kvbench.engine.generate import prefill
    from methods import build_method

    loaded = loaded_for(tiny_model("llama", layers=2))
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    cfg = {"name": name, **({"window_size": 4} if name != "selkv" else {})}
    one = Engine(loaded, build_method(cfg, loaded.layout), 0.3)
    one.record_logits = True
    res = one.generate(ids, 4, stop_ids=[], query_tokens=10)
    assert res.compressed and (res.prompt_tokens, res.compressed_tokens) == (80, 70)
    ref = Engine(loaded, build_method(cfg, loaded.layout), 0.3)
    state, tokens = prefill([ref], ids[:70], 14)[0].state, []
    with torch.inference_mode():
        if callable(getattr(ref.method, "finalize", None)):
            ref.method.finalize(state.results)
        attach_bias(state)
        state.phase = "decode"
        for pos, tok in enumerate(ids[70:] + [None] * 4, start=70):
            tok = tok if tok is not None else tokens[-1]
            logits = loaded.model(input_ids=torch.tensor([[tok]]), past_key_values=state.cache, use_cache=True,
                                  position_ids=torch.tensor([[pos]]), kvbench_state=state).logits[0, -1]
            if pos >= 79:
                if pos == 79:
                    torch.testing.assert_close(logits, one.last_logits[0], atol=1e-5, rtol=1e-5)
                tokens.append(int(logits.argmax()))
    assert tokens[:4] == res.tokens
