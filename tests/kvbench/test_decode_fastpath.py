"""The decode paths (flat per-head lengths, bias columns) equal the padded reference with a dense
bias (float32 / bf16 rounding), for MHA and GQA, on the attention function and end to end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kvbench.engine.attention
import kvbench.engine.kvcache
from kvbench.engine.attention import (CompressionState, _decode_attention, decode_backend, grouped_attention,
                                      kvbench_attention)
from kvbench.engine.generate import Engine, layer_bytes
from kvbench.engine.kvcache import PreallocatedLayer, RaggedLayer, store_layer, write_bias
from methods.base import CompressResult, Method
from methods.full import FullCache
from tests.conftest import loaded_for, tiny_model

LAYOUTS = {"mha": (4, 4), "gqa": (6, 2)}  # name -> (H_q, H_kv)


def _padded(h_kv, d, seed, lengths=None, bias_heads=0):
    """A method's padded result: keys/values (1, H_kv, m, d), valid (random per-head lengths), bias."""
    gen = torch.Generator().manual_seed(seed)
    lengths = lengths or torch.randint(1, 30, (h_kv,), generator=gen).tolist()
    m = max(lengths)
    keys, values = torch.randn(1, h_kv, m, d, generator=gen), torch.randn(1, h_kv, m, d, generator=gen)
    valid = torch.arange(m) < torch.tensor(lengths).unsqueeze(1)
    valid = valid[:, torch.randperm(m, generator=gen)].unsqueeze(0)  # invalid slots anywhere, not only at the end
    bias = torch.randn(1, bias_heads, m, generator=gen) if bias_heads else None
    return keys, values, valid, bias


def _store(keys, values, valid, bias, scaling, reserve):
    cache = SimpleNamespace(layers=[PreallocatedLayer(reserve)])
    rows = 0 if bias is None else bias.shape[1] // keys.shape[1]
    layer = store_layer(cache, 0, keys, values, valid, rows, scaling, reserve)
    if bias is not None:
        write_bias(layer, bias, keys.shape[-1], valid)
    return layer


def _padded_reference(query, keys, values, valid, bias, new_k, new_v, scaling):
    """grouped_attention over the padded layer (−inf on invalid slots) + decoded tokens (bias 0)."""
    b, h_q, _, _ = query.shape
    h_kv, m = keys.shape[1], keys.shape[2]
    dense = torch.zeros(b, h_q, 1, m) if bias is None else bias.repeat_interleave(h_q // bias.shape[1], 1).unsqueeze(2)
    if valid is not None:
        dense = dense.masked_fill(~valid.repeat_interleave(h_q // h_kv, 1).unsqueeze(2), float("-inf"))
    dense = F.pad(dense, (0, new_k.shape[2]))
    return grouped_attention(query, torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2), scaling, bias=dense)


def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, enable_gqa, seqused_k):
    """torch.nn.attention.varlen.varlen_attn's documented semantics, in plain torch (CPU)."""
    assert enable_gqa and cu_q.dtype == cu_k.dtype == seqused_k.dtype == torch.int32 and max_q == 1
    out = []
    for i in range(len(cu_q) - 1):
        s, n = int(cu_k[i]), int(seqused_k[i])
        assert n <= int(cu_k[i + 1]) - s and n <= max_k
        qi, ki, vi = q[int(cu_q[i]) : int(cu_q[i + 1])], k[s : s + n], v[s : s + n]  # (1, G, w), (n, 1, w)
        p = torch.softmax(torch.einsum("qgw,nw->gqn", qi.float(), ki[:, 0].float()) * scale, -1)
        out.append(torch.einsum("gqn,nw->qgw", p, vi[:, 0].float()).to(q.dtype))
    return torch.cat(out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("bias_kind", [None, "kv", "q"])
@pytest.mark.parametrize("backend", ["sdpa per head", "flash varlen", "sdpa per head, width 8k"])
def test_ragged_decode_equals_padded_reference(monkeypatch, layout, bias_kind, backend):
    """Per-head lengths stored flat: each decode step equals grouped_attention with the dense −inf/bias
    mask over the padded layer, and the stored prompt bytes are the kept tokens' (no padding); past the
    reserve the layer is laid out again with more room, and still equals it."""
    h_q, h_kv = LAYOUTS[layout]
    d, scaling, reserve = 16, 16**-0.5, 4
    if backend == "flash varlen":  # the CUDA call's arguments, checked against the kernel's documented semantics
        monkeypatch.setattr(kvbench.engine.attention, "decode_backend", lambda layer, key, ref=False: "reference" if ref else backend)
        monkeypatch.setattr(kvbench.engine.attention, "varlen_attn", fake_varlen_attn)
    if backend.endswith("8k"):  # CUDA's alignment of bias columns (zero padding to a multiple of 8)
        monkeypatch.setitem(kvbench.engine.kvcache.ALIGN, "cpu", 8)
    keys, values, valid, bias = _padded(h_kv, d, seed=h_q, bias_heads={None: 0, "kv": h_kv, "q": h_q}[bias_kind])
    layer = _store(keys, values, valid, bias, scaling, reserve)
    kept = int(valid.sum())
    rows = 0 if bias is None else bias.shape[1] // h_kv
    width = d + rows if not backend.endswith("8k") or not rows else 24
    assert isinstance(layer, RaggedLayer) and layer.keys.shape == (kept + h_kv * reserve, 1, width)
    assert layer_bytes(layer) == kept * 2 * width * 4 and torch.isfinite(layer.keys).all()  # nothing −inf stored
    assert kvbench.engine.attention.decode_backend(layer, layer.keys) == backend.split(",")[0]
    gen = torch.Generator().manual_seed(1)
    new_k, new_v = torch.zeros(1, h_kv, 0, d), torch.zeros(1, h_kv, 0, d)
    for step in range(reserve + 3):
        query = torch.randn(1, h_q, 1, d, generator=gen)
        k1, v1 = torch.randn(1, h_kv, 1, d, generator=gen), torch.randn(1, h_kv, 1, d, generator=gen)
        new_k, new_v = torch.cat([new_k, k1], 2), torch.cat([new_v, v1], 2)
        key, value = layer.update(k1, v1)
        assert layer.get_seq_length() == int(valid.sum(-1).max()) + step + 1
        fast = _decode_attention(query, key, value, None, scaling, None, layer)
        ref = _decode_attention(query, key, value, None, scaling, None, layer, reference=True)
        expected = _padded_reference(query, keys, values, valid, bias, new_k, new_v, scaling)
        torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    assert layer.reserve == 2 * reserve and layer.keys.shape[0] == kept + h_kv * (reserve + 2 * reserve)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("bias_kind", [None, "q"])
def test_decode_batch_in_one_varlen_call_equals_each_row(monkeypatch, layout, bias_kind):
    """A decode batch whose layers have per-head lengths (rows of different lengths, decoded tokens, one laid out again
    past its reserve) attends in one varlen call (CUDA) that equals each row's own per-head SDPA (CPU)."""
    h_q, h_kv = LAYOUTS[layout]
    d, scaling, gen = 16, 16**-0.5, torch.Generator().manual_seed(2)
    layers = []
    for r, steps in enumerate((1, 3, 6)):  # reserve 4: row 2 is laid out again
        keys, values, valid, bias = _padded(h_kv, d, seed=10 + r, bias_heads=h_q if bias_kind else 0)
        layers.append(_store(keys, values, valid, bias, scaling, 4))
        for _ in range(steps):
            layers[-1].update(torch.randn(1, h_kv, 1, d, generator=gen), torch.randn(1, h_kv, 1, d, generator=gen))
    assert len({tuple(x.lengths.tolist()) for x in layers}) == 3
    query = torch.randn(3, h_q, 1, d, generator=gen)
    states = [CompressionState(SimpleNamespace(reads=False), None, None, SimpleNamespace(layers=[x]), "decode")
              for x in layers]
    run = lambda: kvbench_attention(SimpleNamespace(layer_idx=0), query, [x.keys for x in layers],
                                    [x.values for x in layers], None, scaling, kvbench_state=states)[0]
    want, calls, attn = run(), [], kvbench.engine.attention  # want: row by row, one SDPA call per KV head (CPU)
    monkeypatch.setattr(attn, "decode_backend", lambda layer, key, ref=False: "flash varlen")
    monkeypatch.setattr(attn, "varlen_attn", lambda *a, **k: calls.append(a) or fake_varlen_attn(*a, **k))
    got = run()
    assert len(calls) == 1 and calls[0][0].shape == (3 * h_kv, h_q // h_kv, layers[0].keys.shape[-1])
    assert calls[0][6] == max(x.get_seq_length() for x in layers)  # max_k
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("bias_kind", ["kv", "q"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_columns_decode_without_mask_equals_dense_bias(monkeypatch, layout, bias_kind, dtype):
    """Uniform lengths with a logit bias (SelKV): SDPA gets no attn_mask, and equals SDPA with the dense bias."""
    h_q, h_kv = LAYOUTS[layout]
    d, scaling = 16, 16**-0.5
    monkeypatch.setitem(kvbench.engine.kvcache.ALIGN, "cpu", 8)
    keys, values, _, bias = _padded(h_kv, d, seed=5, lengths=[20] * h_kv, bias_heads=h_kv if bias_kind == "kv" else h_q)
    layer = _store(keys.to(dtype), values.to(dtype), None, bias, scaling, 3)
    assert layer.keys.shape == (1, h_kv, 20, 24) and decode_backend(layer, layer.keys) == "sdpa, bias columns"
    gen = torch.Generator().manual_seed(6)
    query, k1, v1 = (torch.randn(1, h, 1, d, generator=gen).to(dtype) for h in (h_q, h_kv, h_kv))
    key, value = layer.update(k1, v1)
    masks = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(kvbench.engine.attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: masks.append(kw.get("attn_mask")) or real_sdpa(*a, **kw))
    fast = _decode_attention(query, key, value, None, scaling, None, layer)
    monkeypatch.undo()
    assert masks == [None]  # no mask: the flash backend stays eligible on CUDA
    expected = _padded_reference(query.float(), keys.to(dtype).float(), values.to(dtype).float(), None, bias, k1.float(),
                                 v1.float(), scaling)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the stored bias b/scaling and q, k, v are rounded
    torch.testing.assert_close(fast.float(), expected, atol=tol, rtol=tol)


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
    if kind != "full":  # flat per-head storage: stored = kept, widened by the bias columns only
        rows = h_q // h_kv if kind.endswith("_q") else 1
        assert fast.compressed and fast.stored_tokens == fast.kept_tokens and fast.kept_tokens["min"] < 16
        assert fast.stored_bytes * 16 == fast.kept_bytes * (16 + rows) 
        assert fast.kept_bytes == fast.kept_tokens["mean"] * 2 * h_kv * (2 * 16 * 4)  # 2 layers, K and V, float32


def test_backend_recorder_reports_pytorchs_choice():
    """sdpa_backend is PyTorch's dispatch decision (it follows sdpa_kernel), and a generation records the prefill's
    and each compressed layer kind's decode backend; decode runs under DECODE_BACKENDS whatever the caller set."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvbench.engine.attention import sdpa_backend
    from kvbench.engine.generate import Engine
    from methods import build_method
    from tests.conftest import loaded_for, tiny_model

    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 10, 16)
    assert sdpa_backend(q, k, k) == "flash_attention"  # CPU float32: PyTorch's CPU flash kernel
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend(q, k, k) == "math"
    loaded = loaded_for(tiny_model("llama", layers=2).eval())
    kinds = {"full": "uniform", "snapkv": "uniform", "selkv": "bias columns", "adakv": "per-head lengths"}
    for name, kind in kinds.items():
        engine = Engine(loaded, build_method({"name": name}, loaded.layout), 1.0 if name == "full" else 0.5)
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):  # the caller's settings: prefill may use math
            assert sdpa_backend(q, k, k) == "flash_attention"
        with sdpa_kernel([SDPBackend.MATH]):
            rec = engine.generate([1 + i % 120 for i in range(150)], 3, stop_ids=[]).record()
        assert rec["sdpa_backends"] == {"prefill": "math", "decode": {kind: "flash_attention"}}, name
