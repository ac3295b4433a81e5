"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Each prompt token is scored by the attention it receives from the last W prompt queries
(the observation window), summed over the window, smoothed by 1-D pooling of width K, and
aggregated over each GQA group. Every KV head keeps the recent window (default: the W window
tokens) plus its top ``budget − W`` earlier tokens.

Presets: the SelKV paper's setting (W=32, K=5, avg pooling: ``conf/method/snapkv.yaml``) and
KVCache-Factory's (W=8, K=7, max pooling, each query head selects: ``conf/method/snapkv_kvcf.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .base import CompressResult, LayerContext, MethodConfig, ScoreMethod, pack_kept, require
from .scoring import group_scores, pool_scores, topk_keep_window, window_attention


@dataclass
class SnapKVConfig(MethodConfig):
    """SnapKV hyper-parameters.

    Attributes:
        window_size: W, observation-window queries (tokens).
        recent_window: trailing tokens always kept; ``None``: W (SnapKV keeps its window).
        kernel_size: K, pooling width (odd, tokens).
        pooling: ``avg`` or ``max``.
        gqa_aggregation: ``mean`` or ``max`` over the G query heads of a KV head, or
            ``per_query_head`` (each query head keeps its own top-k: KVCache-Factory's default).
        group_before_pooling: aggregate the GQA group before pooling (KVCache-Factory kv-head
            mode, AdaKV) instead of after (kvpress).
        score_dtype: ``float32``, or ``model``: scores in the model's dtype, as the references.
    """

    window_size: int = 32
    recent_window: int | None = None
    kernel_size: int = 5
    pooling: Literal["avg", "max"] = "avg"
    gqa_aggregation: Literal["mean", "max", "per_query_head"] = "mean"
    group_before_pooling: bool = False
    score_dtype: Literal["float32", "model"] = "float32"

    def check(self) -> None:
        require(self.window_size >= 1, "window_size", self.window_size, "must be an integer >= 1")
        require(self.recent_window is None or self.recent_window >= 0, "recent_window", self.recent_window,
                "must be an integer >= 0 or null (= window_size)")
        require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", self.kernel_size,
                "must be an odd integer >= 1")


def snapkv_scores(ctx: LayerContext, cfg: SnapKVConfig) -> torch.Tensor:
    """Per-KV-head SnapKV scores of every prompt token.

    The attention of the W window queries is summed per token before the recent window
    (positions ``0..n−R−1``, R = ``cfg.recent_window``, default W) and pooled over those
    positions only, as the SnapKV, KVCache-Factory, AdaKV and kvpress code do with R = W
    (pooling over the whole prompt would leak the window's own attention into the last K//2
    positions).

    ``cfg`` is a :class:`SnapKVConfig`. ``group_before_pooling`` aggregates the GQA group before
    pooling (AdaKV / KVCache-Factory kv-head order) instead of after it (kvpress order); the two
    orders agree for mean+avg and max+max.

    Returns:
        ``(B, H_kv, n)`` (``(B, H_q, n)`` for ``per_query_head``), float32 or the model's dtype
        (``score_dtype``); the recent positions get +inf.
    """
    dtype = torch.float32 if cfg.score_dtype == "float32" else ctx.keys.dtype
    attn = window_attention(ctx.window_queries, ctx.keys, ctx.scaling, ctx.softcap, dtype=dtype,
                            valid=ctx.valid)  # (B, H_q, W, n)
    per_q = cfg.gqa_aggregation == "per_query_head"
    n, h_kv = attn.shape[3], attn.shape[1] if per_q else ctx.layout.num_kv_heads
    recent = getattr(cfg, "recent_window", None)
    r = attn.shape[2] if recent is None else min(recent, n)
    if n == r:  # nothing outside the recent window to rank
        return attn.new_full((attn.shape[0], h_kv, n), float("inf"))
    scores = attn[..., : n - r].sum(dim=2)  # (B, H_q, n − R)
    if cfg.group_before_pooling:
        scores = pool_scores(group_scores(scores, h_kv, cfg.gqa_aggregation), cfg.kernel_size, cfg.pooling)
    else:
        scores = group_scores(pool_scores(scores, cfg.kernel_size, cfg.pooling), h_kv, cfg.gqa_aggregation)
    return F.pad(scores, (0, r), value=float("inf"))  # (B, H_kv, n)


class SnapKV(ScoreMethod):
    """SnapKV eviction: window attention scores, pooled, per-KV-head top-k."""

    Config = SnapKVConfig

    @property
    def decodes(self) -> bool:  # per_query_head's logit bias is written once, after prefill
        return self.config.gqa_aggregation != "per_query_head"

    @property
    def per_head_lengths(self) -> bool:  # per_query_head on GQA: each KV head keeps its query heads' union
        return self.config.gqa_aggregation == "per_query_head" and (self.layout is None or self.layout.is_gqa)

    def score(self, ctx: LayerContext) -> torch.Tensor:
        return snapkv_scores(ctx, self.config)

    def compress(self, ctx: LayerContext) -> CompressResult:
        """``per_query_head`` (GQA): each KV head stores its query heads' union of top-k (packed);
        a ``(B, H_q, m)`` −inf logit bias hides from each query head what it did not select."""
        if self.config.gqa_aggregation != "per_query_head" or not ctx.layout.is_gqa:
            return super().compress(ctx)
        idx = topk_keep_window(self.score(ctx), ctx.budget, min(self.recent_window, ctx.n_tokens))  # (B, H_q, m)
        (b, h_kv, n, _), g = ctx.keys.shape, ctx.layout.group_size
        chosen = torch.zeros(b, h_kv * g, n, dtype=torch.bool, device=idx.device).scatter_(-1, idx, True)
        res = pack_kept(ctx.keys, ctx.values, chosen.view(b, h_kv, g, n).any(2))
        own = chosen.gather(-1, res.kept_indices.repeat_interleave(g, dim=1))  # (B, H_q, m_max)
        res.logit_bias = torch.zeros(own.shape, device=own.device).masked_fill_(~own, float("-inf"))
        return res
