"""Shared scoring helpers: observation-window attention, pooling, GQA aggregation, top-k.

Scores are computed in float32 unless a caller asks for the model's dtype. Nothing here builds an n×n
matrix: the window attention is ``(B, H_q, W, n)`` with W ≪ n.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_attention(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    first_position: int | None = None,
    dtype: torch.dtype = torch.float32,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of the last W prompt queries over all n prompt keys.

    The causal mask inside the window is applied (query i of the window, at absolute
    position n-W+i, sees keys 0..n-W+i). GQA is handled by viewing queries as
    ``(B, H_kv, G, W, d)`` against the un-repeated keys.

    Args:
        window_queries: ``(B, H_q, W, d)`` after RoPE.
        keys: ``(B, H_kv, n, d)`` after RoPE.
        scaling: logit scale (d^-0.5 for most models).
        softcap: Gemma-2 logit soft-capping (``tanh(x/c)·c``) or None.
        first_position: absolute position of the first query row (default ``n - W``: the
            queries are the last W prompt positions). Lets a caller score a long run of
            queries in chunks (LOOK-M's cumulative attention over the whole prompt).
        dtype: of the logits and the result; other than float32 as KVCache-Factory / kvpress:
            logits ``q·kᵀ / √d`` in ``dtype``, softmax in float32, cast back.
        valid: ``(B, H_kv, n)`` bool, the keys that exist (``LayerContext.valid``; None: all); the others get
            probability 0.

    Returns:
        ``(B, H_q, W, n)`` attention probabilities in ``dtype`` (rows sum to 1).
    """
    b, h_q, w, d = window_queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    # (B, H_kv, G·W, d) @ (B, H_kv, d, n): one plain batched matmul per KV head (a broadcast
    # over G would copy the keys G times and is ~15x slower on CPU)
    q = window_queries.to(dtype).reshape(b, h_kv, g * w, d)
    logits = torch.matmul(q, keys.to(dtype).transpose(-1, -2)).view(b, h_kv, g, w, n)
    logits = logits.mul_(scaling) if dtype == torch.float32 else logits.div_(1 / scaling)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    # causal mask: window row i (absolute position start+i) may not see keys j > start+i, all of
    # which lie in the columns from `start` on: mask the strict upper triangle of that block in place
    start = n - w if first_position is None else first_position
    future = torch.ones(w, n - start, dtype=torch.bool, device=keys.device).triu_(1)
    logits[..., start:].masked_fill_(future, float("-inf"))
    if valid is not None:
        logits.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype).view(b, h_q, w, n)


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str = "avg") -> torch.Tensor:
    """1-D pooling along the token axis with 'same' padding (SnapKV clustering step).

    Args:
        scores: ``(B, H, n)`` float32.
        kernel_size: odd pooling width K (1 disables pooling).
        pooling: ``avg`` or ``max``.

    Returns:
        ``(B, H, n)``.
    """
    if kernel_size <= 1:
        return scores
    b, h, n = scores.shape
    x = scores.reshape(b * h, 1, n)
    pad = kernel_size // 2
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d  # avg: count_include_pad=True, as SnapKV's code
    return pool(x, kernel_size, stride=1, padding=pad).view(b, h, n)


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
    return s.mean(dim=2) if how == "mean" else s.amax(dim=2)


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
