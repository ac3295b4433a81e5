"""The last layer's prefill for the last prompt token only (kvbench.engine.last_row_prefill)."""

from __future__ import annotations

import pytest
import torch

from kvbench import attention as attention_mod
from kvbench.engine import Engine
from methods.lookm import LookM, LookMConfig
from methods.snapkv import SnapKV, SnapKVConfig
from tests.conftest import loaded_for, tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
PROMPT = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(3)).tolist()


def _run(loaded, method, budget, last_row: bool, steps: int = 5):
    eng = Engine(loaded, method, budget)
    eng.record_logits = True
    eng.last_row_prefill = last_row
    res = eng.generate(PROMPT, steps, stop_ids=[])
    cache = eng.last_state.cache
    layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    kept = {i: r.kept_indices for i, r in eng.last_state.results.items()}
    return res.tokens, [x.clone() for x in eng.last_logits], layers, kept


def _method(name, layout):
    if name == "snapkv":
        return SnapKV(SnapKVConfig(window_size=4, kernel_size=3), layout), 16
    return LookM(LookMConfig(fused_score="on"), layout), 0.5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["snapkv", "lookm"])
def test_same_generation_cache_and_kept_sets_as_the_whole_layer(family, method):
    loaded = loaded_for(tiny_model(family, layers=3))
    runs = {flag: _run(loaded, *_method(method, loaded.layout), last_row=flag) for flag in (True, False)}
    (toks, logits, layers, kept), (ref_toks, ref_logits, ref_layers, ref_kept) = runs[True], runs[False]
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits):  # the first from prefill, the others from decode steps
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Every layer's cache (prompt keys/values, compressed, plus the decoded tokens') is bit-equal:
    # the last layer's keys and values come from its input, which the trim never touches.
    assert len(layers) == len(ref_layers) == 3
    for (k, v), (rk, rv) in zip(layers, ref_layers):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert kept.keys() == ref_kept.keys() and all(torch.equal(kept[i], ref_kept[i]) for i in kept)


def test_only_the_last_layer_attends_with_the_last_query_only(monkeypatch):
    loaded = loaded_for(tiny_model("llama", layers=3))
    seen = []
    real = attention_mod._prefill_attention

    def spy(module, query, *args):
        seen.append((module.layer_idx, query.shape[2]))
        return real(module, query, *args)

    monkeypatch.setattr(attention_mod, "_prefill_attention", spy)
    Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 16).generate(PROMPT, 1, stop_ids=[])
    assert seen == [(0, len(PROMPT)), (1, len(PROMPT)), (2, 1)]


def _overridden(model) -> list[str]:
    layer = model.model.layers[-1]
    return [name for name, m in (("o_proj", layer.self_attn.o_proj), ("mlp", layer.mlp)) if "forward" in m.__dict__]


def test_modules_are_restored_after_the_prefill_and_after_an_error():
    loaded = loaded_for(tiny_model("llama", layers=2))
    model = loaded.model

    class Boom(SnapKV):
        def compress(self, ctx):
            assert _overridden(model) == ["o_proj", "mlp"]  # inside the prefill: overridden
            raise RuntimeError("boom")

    Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 16).generate(PROMPT, 2)
    assert _overridden(model) == []
    with pytest.raises(RuntimeError, match="boom"):
        Engine(loaded, Boom(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 16).generate(PROMPT, 2)
    assert _overridden(model) == []


def test_a_hooked_model_runs_its_whole_last_layer():
    loaded = loaded_for(tiny_model("llama", layers=2))
    rows = []
    handle = loaded.model.model.layers[-1].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    try:
        Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 16).generate(PROMPT, 1)
    finally:
        handle.remove()
    assert rows == [len(PROMPT)]  # the hook sees the call it expects: every prompt row
