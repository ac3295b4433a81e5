"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Each prompt token is scored by the attention it receives from the last W prompt queries
(the observation window), summed over the window, smoothed by 1-D pooling of width K, and
aggregated over each GQA group. Every KV head keeps the window plus its top ``budget - W``
prefix tokens.

Presets: the SelKV paper's setting (W=32, K=5, avg pooling: ``conf/method/snapkv.yaml``) and
KVCache-Factory's (W=8, K=7, max pooling: ``conf/method/snapkv_kvcf.yaml``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import CompressResult, ConfigError, LayerContext, Method, gather_tokens
from .scoring import group_scores, pool_scores, topk_keep_window, window_attention


@dataclass
class SnapKVConfig:
    """SnapKV hyper-parameters.

    Attributes:
        window_size: W, observation-window queries (tokens), always kept.
        kernel_size: K, pooling width (odd, tokens).
        pooling: ``avg`` or ``max``.
        gqa_aggregation: ``mean`` or ``max`` over the G query heads of a KV head.
    """

    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    gqa_aggregation: str = "mean"


def snapkv_scores(ctx: LayerContext, cfg: SnapKVConfig) -> torch.Tensor:
    """Per-KV-head SnapKV scores of every prompt token.

    The attention of the W window queries is summed per prefix token (positions ``0..n-W-1``)
    and pooled over the prefix only, as the SnapKV, KVCache-Factory, AdaKV and kvpress code do
    (pooling over the whole prompt would leak the window's own attention into the last K//2
    prefix positions).

    ``cfg`` may be any config with ``kernel_size``, ``pooling`` and ``gqa_aggregation``; an
    optional ``group_before_pooling`` (default False) aggregates the GQA group before pooling
    (AdaKV / KVCache-Factory kv-head order) instead of after it (kvpress order). The two orders
    agree for mean+avg and max+max; they differ for mean aggregation with max pooling.

    Returns:
        ``(B, H_kv, n)`` float32; window positions get +inf so that any top-k keeps them.
    """
    attn = window_attention(ctx.window_queries, ctx.keys, ctx.scaling, ctx.softcap)  # (B, H_q, W, n)
    w, n = attn.shape[2], attn.shape[3]
    h_kv = ctx.layout.num_kv_heads
    if n == w:  # nothing outside the window to rank
        return attn.new_full((attn.shape[0], h_kv, n), float("inf"))
    scores = attn[..., : n - w].sum(dim=2)  # (B, H_q, n - W)
    if getattr(cfg, "group_before_pooling", False):
        scores = pool_scores(group_scores(scores, h_kv, cfg.gqa_aggregation), cfg.kernel_size, cfg.pooling)
    else:
        scores = group_scores(pool_scores(scores, cfg.kernel_size, cfg.pooling), h_kv, cfg.gqa_aggregation)
    return F.pad(scores, (0, w), value=float("inf"))  # (B, H_kv, n)


def check_window_fields(c) -> None:
    """Validate the SnapKV-style fields ``window_size``, ``kernel_size``, ``pooling`` of a config.

    Raises:
        ConfigError: W < 1, K even or < 1, unknown pooling.
    """
    if c.window_size < 1:
        raise ConfigError(f"method.window_size={c.window_size}: must be an integer >= 1")
    if c.kernel_size < 1 or c.kernel_size % 2 == 0:
        raise ConfigError(f"method.kernel_size={c.kernel_size}: must be an odd integer >= 1")
    if c.pooling not in ("avg", "max"):
        raise ConfigError(f"method.pooling={c.pooling!r}: accepted values are avg, max")


class SnapKV(Method):
    """SnapKV eviction: window attention scores, pooled, per-KV-head top-k."""

    name: ClassVar[str] = "snapkv"
    Config = SnapKVConfig

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        c = self.config
        check_window_fields(c)
        if c.gqa_aggregation not in ("mean", "max"):
            raise ConfigError(f"method.gqa_aggregation={c.gqa_aggregation!r}: accepted values are mean, max")

    def compress(self, ctx: LayerContext) -> CompressResult:
        scores = snapkv_scores(ctx, self.config)
        w = ctx.window_queries.shape[2]
        idx = topk_keep_window(scores, ctx.budget, w)  # (B, H_kv, m)
        return CompressResult(
            keys=gather_tokens(ctx.keys, idx), values=gather_tokens(ctx.values, idx), kept_indices=idx
        )
