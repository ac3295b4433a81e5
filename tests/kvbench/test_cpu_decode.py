"""The compiled decode kernels (kvbench.cpu_decode): build, switch, and equality with PyTorch's
``F.linear`` and SDPA / an independent float64 attention, for the layouts the decode step passes."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvbench import cpu_decode
from kvbench.attention import _decode_attention
from kvbench.fused_decode import FusedDecoder
from tests.conftest import loaded_for, switch_off_decode_kernels, tiny_model
from tests.kvbench.test_decode_fastpath import naive_attention
from tests.kvbench.test_fused_decode import _factories, _generate, _ids


def _cpu_has_avx512() -> bool:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return "avx512f" in next((line for line in f if line.startswith("flags")), "")


@pytest.fixture
def kernels():
    k = cpu_decode.load()
    if shutil.which(os.environ.get("CC") or "cc") is not None and _cpu_has_avx512():
        assert k is not None, cpu_decode.unavailable_reason()  # CI and this project's machines
    else:
        assert k is None and cpu_decode.unavailable_reason()
    return k


def test_the_environment_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setattr(cpu_decode.LIBRARY, "loaded", None)
    monkeypatch.setattr(cpu_decode.LIBRARY, "reason", None)
    monkeypatch.setenv("KVBENCH_DECODE_KERNELS", "0")
    assert cpu_decode.load() is None
    assert cpu_decode.unavailable_reason() == "KVBENCH_DECODE_KERNELS=0 in the environment"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 15), (4, 16), (5, 17), (63, 576), (64, 581), (1001, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(kernels, threads, n, k, with_bias):
    if kernels is None:
        return
    g = torch.Generator().manual_seed(n * 1000 + k)
    big = torch.randn(n + 3, k + 7, generator=g)
    weight = big[2 : n + 2, 3 : k + 3]  # rows k + 7 floats apart: a row slice of a larger matrix
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(1, 1, k, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_decode.linear(kernels, x, weight, bias)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (1, 1, n)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5 * max(1, k**0.5), rtol=1e-5)
    assert cpu_decode.linear_applies(weight, bias)
    assert not cpu_decode.linear_applies(weight.double(), None)
    assert not cpu_decode.linear_applies(weight.t(), None)  # columns contiguous: not the kernel's layout


def _cache_views(b, h_kv, t, d, gen, spare=9):
    key_buf = torch.randn(b, h_kv, t + spare, d, generator=gen)
    value_buf = torch.randn(b, h_kv, t + spare, d, generator=gen)
    return key_buf[:, :, :t], value_buf[:, :, :t]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("b,h_kv,g,t,d", [
    (1, 3, 3, 5000, 64),  # SmolLM2's layout, a cache split into chunks
    (1, 3, 3, 1, 64),  # one cached token
    (1, 2, 4, 65, 128),  # one 64-key block and one key
    (2, 4, 1, 300, 32),  # MHA, a batch of 2
    (1, 1, 7, 777, 80),  # 7 query heads per KV head, d not a multiple of 64
    (1, 2, 16, 130, 16),  # the largest group
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_attention_equals_reference(kernels, threads, b, h_kv, g, t, d, with_bias):
    if kernels is None:
        return
    gen = torch.Generator().manual_seed(t * 10 + g)
    key, value = _cache_views(b, h_kv, t, d, gen)
    query = 2 * torch.randn(b, h_kv * g, 1, d, generator=gen)
    bias_buf = None
    if with_bias:  # the decode bias buffer (B, H_q, 1, T + reserve): compensation and validity
        bias_buf = torch.randn(b, h_kv * g, 1, t + 4, generator=gen)
        bias_buf[..., 1:t:5] = float("-inf")  # invalid slots
        if t > 128:
            bias_buf[0, 0, 0, 64:128] = float("-inf")  # a whole 64-key block invalid for one row
    bias = bias_buf[..., :t].view(b, h_kv, g, t) if bias_buf is not None else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_decode.attention(kernels, query.view(b, h_kv, g, d), key, value, bias, d**-0.5)
    finally:
        torch.set_num_threads(before)
    assert out is not None and out.shape == (b, h_kv, g, d)
    expected = naive_attention(query, key, value, d**-0.5, bias=bias_buf[..., :t] if with_bias else None)
    torch.testing.assert_close(out.view(b, 1, h_kv * g, d), expected, atol=2e-6, rtol=1e-5)
    sdpa = F.scaled_dot_product_attention(query.view(b, h_kv, g, d), key, value, attn_mask=bias, scale=d**-0.5)
    torch.testing.assert_close(out, sdpa, atol=2e-6, rtol=1e-5)


def test_attention_declines_what_it_does_not_handle(kernels):
    if kernels is None:
        return
    gen = torch.Generator().manual_seed(0)
    key, value = _cache_views(1, 2, 40, 24, gen)
    q = torch.randn(1, 2, 3, 24)
    assert cpu_decode.attention(kernels, q, key, value, None, 0.2) is None  # d not a multiple of 16
    key, value = _cache_views(1, 1, 40, 16, gen)
    assert cpu_decode.attention(kernels, torch.randn(1, 1, 17, 16), key, value, None, 0.2) is None  # G > 16
    q = torch.randn(1, 1, 2, 16)
    assert cpu_decode.attention(kernels, q.double(), key.double(), value.double(), None, 0.2) is None
    assert cpu_decode.attention(kernels, q, key.transpose(2, 3).contiguous().transpose(2, 3), value, None, 0.2) is None
    bias = torch.zeros(1, 1, 40, 2).transpose(2, 3)  # rows not contiguous
    assert cpu_decode.attention(kernels, q, key, value, bias, 0.2) is None
    assert cpu_decode.attention(kernels, q, key, value, torch.zeros(1, 1, 2, 40), 0.2) is not None


def test_decode_attention_uses_the_kernel_and_falls_back_without_it(kernels, monkeypatch):
    """``_decode_attention``'s fast path: the kernel when built, SDPA otherwise; the same values."""
    gen = torch.Generator().manual_seed(3)
    key, value = _cache_views(1, 3, 4000, 64, gen)
    query = torch.randn(1, 9, 1, 64, generator=gen)
    bias_buf = torch.randn(1, 9, 1, 4010, generator=gen)
    calls = []
    real = cpu_decode.attention
    monkeypatch.setattr(cpu_decode, "attention", lambda *a: calls.append(1) or real(*a))
    fast = _decode_attention(query, key, value, None, 0.125, None, bias_buf)
    assert len(calls) == (1 if kernels is not None else 0)
    switch_off_decode_kernels(monkeypatch)
    sdpa = _decode_attention(query, key, value, None, 0.125, None, bias_buf)
    assert len(calls) == (1 if kernels is not None else 0)  # not called without kernels
    torch.testing.assert_close(fast, sdpa, atol=2e-6, rtol=1e-5)


def test_fused_decoder_uses_the_kernels_in_pytorch_layout(kernels):
    model = tiny_model("qwen2", layers=2, n_kv=2, n_q=4)
    decoder = FusedDecoder.for_model(model)
    if kernels is None:
        assert decoder.kernels is None and decoder.input_major
        return
    assert decoder.kernels is kernels and not decoder.input_major
    assert isinstance(decoder._linear, functools.partial) and decoder._linear.func is cpu_decode.linear
    fl = decoder.layers[0]
    assert all(w.is_contiguous() for w in (fl.w_qkv, fl.w_gu, fl.w_o, fl.w_down))


def test_fused_decode_with_and_without_kernels_agree(kernels, monkeypatch):
    ids = _ids()
    model = tiny_model("llama", layers=2, n_kv=2, n_q=6, hidden_size=96)
    with_k, logits_k, path = _generate(model, _factories()["bias_validity"], True, ids)
    assert path == "fused"
    switch_off_decode_kernels(monkeypatch)
    model = tiny_model("llama", layers=2, n_kv=2, n_q=6, hidden_size=96)
    without, logits, path = _generate(model, _factories()["bias_validity"], True, ids)
    decoder = FusedDecoder.for_model(model)
    assert path == "fused" and decoder.kernels is None and decoder._linear is F.linear and decoder.input_major
    assert with_k.tokens == without.tokens
    for a, b in zip(logits_k, logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_env_json_names_the_decode_path(kernels, monkeypatch):
    from kvbench.job import decode_kernels

    loaded = loaded_for(tiny_model("llama"))
    assert decode_kernels(None) is None
    assert decode_kernels(loaded) == ("c" if kernels is not None else f"torch ({cpu_decode.unavailable_reason()})")
    loaded.dtype = torch.bfloat16
    assert decode_kernels(loaded) == "torch"
    loaded.dtype = torch.float32
    switch_off_decode_kernels(monkeypatch)
    assert decode_kernels(loaded) == "torch (switched off by the test)"


def test_a_model_with_its_decoder_can_be_deep_copied(kernels):
    import copy

    model = tiny_model("llama")
    decoder = FusedDecoder.for_model(model)
    twin = copy.deepcopy(model)
    assert twin._kvbench_fused_decoder.kernels is decoder.kernels  # the one library, shared
    ids = torch.tensor([_ids(9)])
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)


def test_decode_again_repeats_the_decode_on_the_same_compressed_cache():
    from kvbench.engine import Engine
    from methods.snapkv import SnapKV, SnapKVConfig

    model = tiny_model("llama", layers=2, n_kv=2, n_q=4)
    loaded = loaded_for(model)
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 0.5)
    eng.record_logits = True
    with pytest.raises(RuntimeError, match="no generation to repeat"):
        eng.decode_again(3)
    first = eng.generate(_ids(40), 6, stop_ids=[])
    logits = list(eng.last_logits)
    lengths = [layer.keys.shape[-2] for layer in eng.last_state.cache.layers]
    again = eng.decode_again(6)
    assert first.compressed and again.tokens == first.tokens and again.prefill_s == first.prefill_s
    assert all(torch.equal(a, b) for a, b in zip(eng.last_logits, logits))
    assert [layer.keys.shape[-2] for layer in eng.last_state.cache.layers] == lengths  # 5 tokens appended again
    shorter = eng.decode_again(2)
    assert shorter.tokens == first.tokens[:2]
    with pytest.raises(RuntimeError, match="7 tokens > the cache's reserve"):
        eng.decode_again(7)
    eng.fused_decode = False
    eng.generate(_ids(40), 3, stop_ids=[])
    with pytest.raises(RuntimeError, match="decoded through the model's modules"):
        eng.decode_again(3)
