"""The fast decode path equals the reference path (float32 tolerance), for MHA and GQA,
with and without logit bias and validity masks, on the attention function and end to end."""

from __future__ import annotations

import pytest
import torch

from kvbench.attention import _decode_attention, grouped_attention
from kvbench.engine import Engine
from methods.base import CompressResult, Method
from methods.full import FullCache
from tests.conftest import loaded_for, tiny_model

LAYOUTS = {"mha": (4, 4), "gqa": (6, 2)}  # name -> (H_q, H_kv)


def naive_attention(query, key, value, scaling, bias=None, keep=None):
    """Independent float64 attention: keys/values repeated per query head (h uses KV head h // G)."""
    g = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(g, dim=1)
    v = value.double().repeat_interleave(g, dim=1)
    logits = query.double() @ k.transpose(-1, -2) * scaling  # (B, H_q, 1, T)
    if bias is not None:
        logits = logits + bias.double()
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v  # (B, H_q, 1, d)
    return out.transpose(1, 2).float()


def _inputs(h_q, h_kv, t=37, d=16, spare=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 1, h_q, d, generator=gen).transpose(1, 2)  # (B, H_q, 1, d), as the model makes it
    key_buf = torch.randn(1, h_kv, t + spare, d, generator=gen)  # a preallocated cache: views of a buffer
    value_buf = torch.randn(1, h_kv, t + spare, d, generator=gen)
    bias_buf = torch.zeros(1, h_q, 1, t + spare)
    bias_buf[..., :t] = torch.randn(1, h_q, 1, t, generator=gen)
    return query, key_buf[:, :, :t], value_buf[:, :, :t], bias_buf, d**-0.5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_fast_decode_attention_equals_reference(layout, with_bias, mask_kind):
    h_q, h_kv = LAYOUTS[layout]
    query, key, value, bias_buf, scaling = _inputs(h_q, h_kv)
    t = key.shape[2]
    keep = torch.ones(1, 1, 1, t, dtype=torch.bool)
    keep[..., [2, 5, 11]] = False
    mask = None
    if mask_kind == "bool":
        mask = keep
    elif mask_kind == "float":
        mask = torch.zeros(1, 1, 1, t).masked_fill(~keep, float("-inf"))
    buf = bias_buf if with_bias else None
    fast = _decode_attention(query, key, value, mask, scaling, None, buf)
    ref = _decode_attention(query, key, value, mask, scaling, None, buf, reference=True)
    also_ref = grouped_attention(query, key, value, scaling, bias=buf[..., :t] if with_bias else None, mask=mask)
    expected = naive_attention(
        query, key, value, scaling, bias=bias_buf[..., :t] if with_bias else None, keep=keep if mask is not None else None
    )
    assert fast.shape == (1, 1, h_q, query.shape[-1])
    torch.testing.assert_close(ref, also_ref)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fast_decode_validity_bias_equals_removing_positions(layout):
    """A per-head −inf bias (validity mask folded into the bias) equals attending over fewer keys."""
    h_q, h_kv = LAYOUTS[layout]
    query, key, value, bias_buf, scaling = _inputs(h_q, h_kv, seed=3)
    t = key.shape[2]
    bias_buf.zero_()
    dropped = [4, 9, 30]
    bias_buf[..., dropped] = float("-inf")  # every head: invalid slots
    fast = _decode_attention(query, key, value, None, scaling, None, bias_buf)
    kept = [i for i in range(t) if i not in dropped]
    expected = naive_attention(query, key[:, :, kept], value[:, :, kept], scaling)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)


class RandomBiasAndValidity(Method):
    """Test method: keeps every other prompt token, with a random per-head logit bias and a
    per-KV-head validity mask (heads of different lengths padded to the longest)."""

    name = "random_bias_validity"

    def __init__(self, layout, per_q_head_bias: bool):
        super().__init__(None, layout)
        self.per_q_head_bias = per_q_head_bias

    @property
    def window_size(self) -> int:
        return 4

    def plan(self, n_tokens, budget, layout):
        from methods.base import Plan

        return Plan(layer_budgets=[n_tokens // 2] * layout.num_layers, compress=True)

    def compress(self, ctx):
        b, h_kv, n, _ = ctx.keys.shape
        idx = torch.arange(0, n, 2).expand(b, h_kv, -1)
        keys = ctx.keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, ctx.keys.shape[-1]))
        values = ctx.values.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, ctx.values.shape[-1]))
        gen = torch.Generator().manual_seed(ctx.layer_idx)
        m = idx.shape[-1]
        heads = ctx.layout.num_q_heads if self.per_q_head_bias else h_kv
        bias = 0.5 * torch.randn(b, heads, m, generator=gen)
        valid = torch.ones(b, h_kv, m, dtype=torch.bool)
        valid[:, 0, 1:4] = False  # head 0 is shorter: padded slots
        if h_kv > 1:
            valid[:, -1, -3:-1] = False
        return CompressResult(keys=keys, values=values, valid=valid, logit_bias=bias, kept_indices=idx)


def _run(model, method_factory, fast: bool, ids, steps=6):
    loaded = loaded_for(model)
    eng = Engine(loaded, method_factory(loaded.layout), 0.5)
    eng.preallocate = fast
    eng.reference_decode = not fast
    eng.record_logits = True
    res = eng.generate(ids, steps, stop_ids=[])
    return res, eng.last_logits


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["full", "bias_validity_kv", "bias_validity_q"])
def test_engine_fast_decode_equals_reference_decode(layout, kind):
    h_q, h_kv = LAYOUTS[layout]
    model = tiny_model("llama", n_kv=h_kv, n_q=h_q, layers=2, head_dim=16, hidden_size=96 if h_q == 6 else 64)
    ids = torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(7)).tolist()
    if kind == "full":
        factory = lambda layout_: FullCache(layout=layout_)  # noqa: E731
    else:
        factory = lambda layout_: RandomBiasAndValidity(layout_, per_q_head_bias=kind.endswith("_q"))  # noqa: E731
    fast, fast_logits = _run(model, factory, True, ids)
    ref, ref_logits = _run(model, factory, False, ids)
    assert fast.tokens == ref.tokens
    assert fast.generated_tokens == 6
    assert len(fast_logits) == len(ref_logits) == 6
    for a, b in zip(fast_logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if kind != "full":
        assert fast.compressed and fast.kept_tokens["min"] < fast.stored_tokens["max"]
