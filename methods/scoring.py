"""Shared scoring helpers: observation-window attention, pooling, GQA aggregation, top-k.

All scores are computed in float32 whatever the model dtype. Nothing here builds an n×n
matrix: the window attention is ``(B, H_q, W, n)`` with W ≪ n.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "window_attention",
    "pool_scores",
    "group_scores",
    "topk_keep_window",
]


def window_attention(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of the last W prompt queries over all n prompt keys.

    The causal mask inside the window is applied (query i of the window, at absolute
    position n-W+i, sees keys 0..n-W+i). GQA is handled by viewing queries as
    ``(B, H_kv, G·W, d)`` against the un-repeated keys (nothing repeated or broadcast-copied).

    Args:
        window_queries: ``(B, H_q, W, d)`` after RoPE.
        keys: ``(B, H_kv, n, d)`` after RoPE.
        scaling: logit scale (d^-0.5 for most models).
        softcap: Gemma-2 logit soft-capping (``tanh(x/c)·c``) or None.

    Returns:
        ``(B, H_q, W, n)`` float32 attention probabilities (rows sum to 1).
    """
    b, h_q, w, d = window_queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    # The G·W queries of a GQA group as rows of one matmul against the group's keys: no
    # broadcast of keys over G (which would copy them), one (G·W, n) product per KV head.
    q = window_queries.float().reshape(b, h_kv, g * w, d)
    k = keys.float()  # (B, H_kv, n, d)
    logits = torch.matmul(q, k.transpose(-1, -2)).view(b, h_kv, g, w, n)
    logits.mul_(scaling)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    # causal mask: window row i may see keys j <= n - w + i
    rows = torch.arange(w, device=keys.device).unsqueeze(1) + (n - w)
    cols = torch.arange(n, device=keys.device).unsqueeze(0)
    logits.masked_fill_(cols > rows, float("-inf"))
    return torch.softmax(logits, dim=-1).view(b, h_q, w, n)


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str = "avg") -> torch.Tensor:
    """1-D pooling along the token axis with 'same' padding (SnapKV clustering step).

    Args:
        scores: ``(B, H, n)`` float32.
        kernel_size: odd pooling width K (1 disables pooling).
        pooling: ``avg`` or ``max``.

    Returns:
        ``(B, H, n)``.

    Raises:
        ValueError: unknown pooling or even kernel size.
    """
    if kernel_size <= 1:
        return scores
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size={kernel_size}: must be odd")
    b, h, n = scores.shape
    x = scores.reshape(b * h, 1, n)
    pad = kernel_size // 2
    if pooling == "avg":
        # count_include_pad=True, as the reference SnapKV code (F.avg_pool1d default).
        y = F.avg_pool1d(x, kernel_size, stride=1, padding=pad)
    elif pooling == "max":
        y = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        raise ValueError(f"pooling={pooling!r}: accepted values are avg, max")
    return y.view(b, h, n)


def group_scores(scores: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Aggregate per-query-head scores to per-KV-head scores over each GQA group.

    Args:
        scores: ``(B, H_q, n)``.
        num_kv_heads: H_kv.
        how: ``mean`` or ``max`` over the G query heads of a group.

    Returns:
        ``(B, H_kv, n)``.
    """
    b, h_q, n = scores.shape
    if h_q == num_kv_heads:
        return scores
    s = scores.view(b, num_kv_heads, h_q // num_kv_heads, n)
    if how == "mean":
        return s.mean(dim=2)
    if how == "max":
        return s.amax(dim=2)
    raise ValueError(f"gqa_aggregation={how!r}: accepted values are mean, max")


def topk_keep_window(scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """Indices to keep: the last ``window`` positions plus the top ``budget - window`` of the rest.

    Args:
        scores: ``(B, H, n)`` scores of every prompt position.
        budget: total tokens kept per head (window included), ``window <= budget <= n``.
        window: trailing positions always kept.

    Returns:
        ``(B, H, budget)`` long indices, sorted ascending (original order preserved).
    """
    b, h, n = scores.shape
    window = min(window, budget)
    n_select = budget - window
    prefix = scores[..., : n - window]
    top = prefix.topk(n_select, dim=-1).indices if n_select > 0 else prefix.new_zeros((b, h, 0), dtype=torch.long)
    recent = torch.arange(n - window, n, device=scores.device).expand(b, h, window)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values
