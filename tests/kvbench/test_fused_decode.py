"""The fused decode step (kvbench.fused_decode) equals decoding through the model's modules:
every supported family, MHA and GQA, biases, q/k-norm, compressed caches with compensation
bias and validity masks, RoPE repositioning; unsupported models and hooked models fall back."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine import Engine
from kvbench.fused_decode import FusedDecoder, unsupported_reason
from methods.full import FullCache
from methods.selkv import SelKV, SelKVConfig
from tests.conftest import loaded_for, switch_off_decode_kernels, tiny_model
from tests.kvbench.test_decode_fastpath import RandomBiasAndValidity

FAMILIES = {  # name -> (family, tiny_model kwargs)
    "llama_gqa": ("llama", dict(n_kv=2, n_q=6, hidden_size=96)),
    "llama_mha_bias": ("llama", dict(n_kv=4, n_q=4, attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(n_kv=2, n_q=4, sliding_window=None)),
    "qwen2_bias": ("qwen2", dict(n_kv=2, n_q=4)),
    "qwen3_qknorm": ("qwen3", dict(n_kv=1, n_q=4)),
}
STEPS = 6


def _ids(n=41, seed=7):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model, factory, fused: bool, ids, budget=0.5, dtype=torch.float32):
    loaded = loaded_for(model)
    loaded.dtype = dtype
    eng = Engine(loaded, factory(loaded.layout), budget)
    eng.fused_decode = fused
    eng.record_logits = True
    res = eng.generate(ids, STEPS, stop_ids=[])
    return res, eng.last_logits, eng.last_decode_path


def _factories():
    return {
        "full": lambda layout: FullCache(layout=layout),
        "bias_validity": lambda layout: RandomBiasAndValidity(layout, per_q_head_bias=True),
        "selkv_repos": lambda layout: SelKV(
            SelKVConfig(window_size=8, kernel_size=3, recent_window=4, bucket_size=8, reposition=True), layout
        ),
    }


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("kind", ["full", "bias_validity", "selkv_repos"])
def test_fused_decode_equals_module_decode(name, kind):
    family, kwargs = FAMILIES[name]
    model = tiny_model(family, layers=2, **kwargs)
    assert unsupported_reason(model) is None
    factory = _factories()[kind]
    ids = _ids()
    ref, ref_logits, ref_path = _generate(model, factory, False, ids)
    fused, fused_logits, fused_path = _generate(model, factory, True, ids)
    assert (ref_path, fused_path) == ("modules", "fused")
    assert fused.tokens == ref.tokens
    assert len(fused_logits) == len(ref_logits) == STEPS
    for a, b in zip(fused_logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if kind != "full":
        assert fused.compressed


def test_fused_decode_bfloat16():
    """bf16 weights (the CUDA setting): same casts as the modules, logits within bf16 rounding."""
    model = tiny_model("llama", n_kv=2, n_q=4).to(torch.bfloat16)
    factory = _factories()["bias_validity"]
    ref, ref_logits, _ = _generate(model, factory, False, _ids(), dtype=torch.bfloat16)
    fused, fused_logits, path = _generate(model, factory, True, _ids(), dtype=torch.bfloat16)
    assert path == "fused"
    assert fused_logits[0].dtype == torch.float32  # recorded as float
    torch.testing.assert_close(fused_logits[0], ref_logits[0], atol=2e-2, rtol=2e-2)


def test_fusing_keeps_one_copy_and_module_outputs(monkeypatch):
    """The modules are re-pointed to rows of the fused weights: same storage, same forward
    (without the compiled decode kernels, which keep PyTorch's layout: tests/kvbench/test_cpu_decode.py)."""
    switch_off_decode_kernels(monkeypatch)
    model = tiny_model("qwen2", n_kv=2, n_q=4)
    ids = torch.tensor([_ids(17)])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    decoder = FusedDecoder.for_model(model)
    assert decoder is not None and FusedDecoder.for_model(model) is decoder  # cached on the model
    attn = model.model.layers[1].self_attn
    fl = decoder.layers[1]
    assert attn.q_proj.weight.data_ptr() == fl.w_qkv.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fl.w_qkv[attn.q_proj.out_features + attn.k_proj.out_features :].data_ptr()
    assert attn.k_proj.bias.data_ptr() == fl.b_qkv[attn.q_proj.out_features :].data_ptr()
    assert model.model.layers[1].mlp.up_proj.weight.data_ptr() == fl.w_gu[fl.w_gu.shape[0] // 2 :].data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == n_bytes
    assert not attn.q_proj.weight.is_inference()
    # CPU: every projection stored input-major (its transpose contiguous), one copy each.
    mlp = model.model.layers[1].mlp
    assert decoder.input_major
    for w in (fl.w_qkv, fl.w_gu, fl.w_o, fl.w_down, attn.o_proj.weight, mlp.down_proj.weight):
        assert w.t().is_contiguous() and not w.is_contiguous()
    assert attn.o_proj.weight.data_ptr() == fl.w_o.data_ptr()
    assert mlp.down_proj.weight.data_ptr() == fl.w_down.data_ptr()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_input_major_switch_keeps_pytorch_layout(monkeypatch):
    """``FusedDecoder.INPUT_MAJOR_ON_CPU = False``: PyTorch's (out, in) layout, same logits."""
    ids = _ids()
    model = tiny_model("llama", layers=2, n_kv=2, n_q=4)
    _, ref_logits, _ = _generate(model, _factories()["bias_validity"], True, ids)
    monkeypatch.setattr(FusedDecoder, "INPUT_MAJOR_ON_CPU", False)
    model = tiny_model("llama", layers=2, n_kv=2, n_q=4)
    _, logits, path = _generate(model, _factories()["bias_validity"], True, ids)
    decoder = FusedDecoder.for_model(model)
    assert path == "fused" and not decoder.input_major
    fl = decoder.layers[0]
    assert all(w.is_contiguous() for w in (fl.w_qkv, fl.w_gu, fl.w_o, fl.w_down))
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_replaced_weights_rebuild_the_decoder():
    model = tiny_model("llama")
    first = FusedDecoder.for_model(model)
    lin = model.model.layers[0].self_attn.k_proj
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone() * 2)
    second = FusedDecoder.for_model(model)
    assert second is not first
    q_rows = model.model.layers[0].self_attn.q_proj.out_features
    assert torch.equal(second.layers[0].w_qkv[q_rows : q_rows + lin.out_features], lin.weight)
    assert lin.weight.data_ptr() == second.layers[0].w_qkv[q_rows:].data_ptr()


@pytest.mark.parametrize(
    "family,kwargs,reason",
    [
        ("gemma2", {}, "model_type"),
        ("gemma3", {}, "model_type"),
        ("mistral", {"sliding_window": 16}, "sliding window"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, "sliding-window"),
    ],
)
def test_unsupported_models_decode_through_modules(family, kwargs, reason):
    model = tiny_model(family, **kwargs)
    assert reason in unsupported_reason(model)
    res, _, path = _generate(model, _factories()["full"], True, _ids())
    assert path == "modules" and res.generated_tokens == STEPS


def test_hooks_force_the_module_path():
    """A forward hook anywhere (head masking, fault injection, user probes) must see its calls."""
    model = tiny_model("llama")
    calls = []
    handle = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, out: calls.append(1))
    res, _, path = _generate(model, _factories()["full"], True, _ids())
    assert path == "modules"
    assert len(calls) == 1 + (STEPS - 1)  # the prefill and every decode step
    handle.remove()
    _, _, path = _generate(model, _factories()["full"], True, _ids())
    assert path == "fused"
