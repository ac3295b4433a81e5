"""window_attention (GQA queries as rows of one matmul) equals a naive float64 attention with
repeated keys, with and without soft-capping, for MHA and GQA."""

from __future__ import annotations

import pytest
import torch

from methods.scoring import window_attention


def naive_window_attention(q, k, scaling, softcap=None):
    b, h_q, w, d = q.shape
    n = k.shape[2]
    kr = k.double().repeat_interleave(h_q // k.shape[1], dim=1)  # query head h uses KV head h // G
    logits = q.double() @ kr.transpose(-1, -2) * scaling  # (B, H_q, W, n)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    for i in range(w):  # window row i sits at position n - w + i
        logits[:, :, i, n - w + i + 1 :] = float("-inf")
    return torch.softmax(logits, dim=-1).float()


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_window_attention_matches_naive(h_q, h_kv, softcap):
    gen = torch.Generator().manual_seed(h_q * 10 + h_kv)
    q = torch.randn(1, h_q, 5, 8, generator=gen)
    k = torch.randn(1, h_kv, 23, 8, generator=gen)
    out = window_attention(q, k, 8**-0.5, softcap)
    assert out.shape == (1, h_q, 5, 23)
    torch.testing.assert_close(out, naive_window_attention(q, k, 8**-0.5, softcap), atol=1e-6, rtol=1e-5)
    assert torch.all(out[0, :, 0, -4:] == 0)  # first window row cannot see the last 4 keys
