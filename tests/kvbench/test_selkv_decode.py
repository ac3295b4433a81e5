"""SelKV through the engine: at decode, compensation raises each kept position's logit by α·log R_i."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kvbench.engine.attention
from kvbench.engine.generate import Engine
from methods.selkv import SelKV, SelKVConfig
from tests.conftest import loaded_for, tiny_model

LAYERS, D = 2, 16  # tiny_model's head_dim


class RecordingF:
    """``torch.nn.functional`` as seen by kvbench.engine.attention, recording every decode-step SDPA call."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        return getattr(F, name)

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, **kw):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kw)
        if not kw.get("enable_gqa"):  # a decode step (prefill calls pass enable_gqa=True)
            # the decode fast path puts each GQA group's G query heads as rows: (B, H_kv, G, ·);
            # record in the per-query-head layout (B, H_q, 1, ·), query head h = kv·G + g
            b, h_kv, g, _ = query.shape
            as_heads = lambda x: x.reshape(b, h_kv * g, 1, x.shape[-1])  # noqa: E731
            bias = None
            if key.shape[-1] > D:  # a logit bias b: key column D holds b / scale, the query's component D is 1
                assert torch.all(query[..., D] == 1) and torch.all(key[..., D + 1 :] == 0)
                bias = as_heads(key[..., D].unsqueeze(2).expand(b, h_kv, g, -1)) * kw["scale"]
            self.calls.append({"q": as_heads(query[..., :D]), "k": key[..., :D], "v": value[..., :D], "mask": attn_mask,
                               "bias": bias, "out": as_heads(out[..., :D]), "scale": kw.get("scale")})
        return out


def generate(monkeypatch, loaded, ids, **cfg):
    calls: list = []
    monkeypatch.setattr(kvbench.engine.attention, "F", RecordingF(calls))
    config = SelKVConfig(window_size=8, kernel_size=3, recent_window=4, bucket_size=8, **cfg)
    eng = Engine(loaded, SelKV(config, loaded.layout), 0.5)
    eng.generate(ids, 3, stop_ids=[])
    monkeypatch.undo()
    return eng.last_state, calls[:LAYERS]  # the first decode step, one call per layer


def attend(q, k, v, scale, bias=None):
    """softmax(q·kᵀ·scale + bias)·v with the KV heads repeated over their query heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    logits = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias
    return torch.softmax(logits, dim=-1) @ v


@pytest.mark.parametrize("n_kv", [4, 2], ids=["MHA", "GQA"])
def test_compensation_raises_kept_logits_by_alpha_log_ratio(monkeypatch, n_kv):
    model = tiny_model("llama", n_kv=n_kv, n_q=4, layers=LAYERS)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(11)).tolist()
    off_state, off = generate(monkeypatch, loaded, ids, compensation="off")
    on_state, on = generate(monkeypatch, loaded, ids, compensation="layer", alpha=0.5)
    assert len(on) == len(off) == LAYERS
    g = 4 // n_kv
    for layer in range(LAYERS):
        res = on_state.results[layer]
        m = res.keys.shape[-2]
        assert m == 24 and off_state.results[layer].logit_bias is None
        # compensation changes no kept key or value; layer 0's decode query is the same too
        # (deeper layers' queries see the previous layers' biased outputs)
        for name in ("k", "v"):
            assert torch.equal(on[layer][name][:, :, :m], off[layer][name][:, :, :m])
        if layer == 0:
            assert torch.equal(on[0]["q"], off[0]["q"])
        q, k, v, scale = on[layer]["q"], on[layer]["k"], on[layer]["v"], on[layer]["scale"]
        t = k.shape[2]  # m kept positions + the token appended at this step
        ratio = torch.exp(res.logit_bias / 0.5)  # R_i ≥ 1, > 1 where tokens were merged in
        assert ratio.min() >= 1 - 1e-6 and ratio.max() > 1.01
        want = torch.zeros(1, 4, 1, t)
        want[:, :, 0, :m] = 0.5 * torch.log(ratio).repeat_interleave(g, dim=1)
        assert on[layer]["mask"] is None and off[layer]["mask"] is None and off[layer]["bias"] is None  # no attn_mask
        torch.testing.assert_close(on[layer]["bias"], want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(on[layer]["out"], attend(q, k, v, scale, want), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(off[layer]["out"], attend(off[layer]["q"], off[layer]["k"], off[layer]["v"], scale), atol=1e-5, rtol=1e-5)
        if n_kv == 2:  # GQA, union selection: one R per position, averaged across KV heads
            assert torch.equal(res.logit_bias[0, 0], res.logit_bias[0, 1])


def test_global_compensation_is_the_layer_average_applied_by_the_engine(monkeypatch):
    model = tiny_model("llama", n_kv=2, n_q=4, layers=LAYERS)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(12)).tolist()
    per_layer, _ = generate(monkeypatch, loaded, ids, compensation="layer", alpha=0.5)
    averaged, calls = generate(monkeypatch, loaded, ids, compensation="global", alpha=0.5)
    ratios = [torch.exp(per_layer.results[layer].logit_bias / 0.5) for layer in range(LAYERS)]
    assert not torch.allclose(ratios[0], ratios[1])
    want = 0.5 * torch.log((ratios[0] + ratios[1]) / 2)
    for layer in range(LAYERS):
        torch.testing.assert_close(averaged.results[layer].logit_bias, want, atol=1e-6, rtol=1e-6)
        m = want.shape[-1]
        torch.testing.assert_close(calls[layer]["bias"][:, :, 0, :m], want.repeat_interleave(2, dim=1), atol=1e-6, rtol=1e-6)


def test_repositioned_decode_continues_at_m(monkeypatch):
    model = tiny_model("llama", n_kv=2, n_q=4, layers=LAYERS)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(13)).tolist()
    state, _ = generate(monkeypatch, loaded, ids, reposition=True)
    for layer in range(LAYERS):
        assert state.results[layer].next_position == 24
    assert math.isfinite(float(state.results[0].keys.abs().sum()))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_selkv_runs_on_every_family(monkeypatch, family):
    model = tiny_model(family, n_kv=2, n_q=4, layers=LAYERS)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(14)).tolist()
    reposition = len(loaded.layout.compressible_layers) == loaded.layout.num_layers  # not on Gemma 2/3
    SelKV(SelKVConfig(reposition=reposition)).check_layout(loaded.layout)
    state, _ = generate(monkeypatch, loaded, ids, reposition=reposition)
    assert state.results  # at least one compressible layer
    for layer, res in state.results.items():
        assert res.keys.shape[-2] == 20 and res.next_position == (20 if reposition else None)
        assert torch.isfinite(res.logit_bias).all() and torch.isfinite(res.values).all()
        assert state.cache.layers[layer].keys.shape[-2:] == (20 + 2, D + 1)  # two decode steps appended, a bias column
