"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference").

Heads of one layer differ in how concentrated their attention is, so a uniform per-head budget
wastes slots on flat heads and starves peaked ones. AdaKV shares the layer's budget H_kv·m
among its KV heads by one global top-k over all heads' token scores, with a per-head floor
(:func:`methods.allocation.adaptive_head_budgets`); each head then keeps its own top tokens
plus the observation window. Heads keep different numbers of tokens: they are stored packed
and padded to the layer's longest head with a validity mask (:mod:`methods.packing`).

* Scores come from any registered scorer (``scorer``, :data:`methods.scoring.SCORERS`;
  SnapKV by default), per KV head (GQA: mean or max over the group, AdaKV's ``gqa_support``).
* ``layer_schedule: pyramid`` composes with PyramidKV's layer budgets (AdaKV ``pyram`` mode).
* ``floor_mode: capacity`` is the AdaKV paper/code rule (budget of head h =
  round((1 − α)·c_h + ⌊α·(m − W)⌋), c_h its share of the global top H·(m − W), window excluded);
  ``floor_mode: safeguard`` is kvpress 0.5.x AdaKVPress (each head's own top ⌊α·m⌋ protected,
  then a global top H·m with the window counted inside).

Budgets: m (``budget``) is the average tokens per KV head per layer, window included. With
``floor_mode: capacity`` the layer keeps H_kv·W + (1 − α)·H_kv·(m − W) + H_kv·⌊α·(m − W)⌋ tokens
up to rounding (±H_kv/2), i.e. H_kv·m when α·(m − W) is an integer (AdaKV code); with
``safeguard`` exactly H_kv·m.

Presets: ``adakv`` (AdaKV code defaults: W = 32, K = 7, max pooling, α = 0.2),
``adakv_pyramid`` (with the PyramidKV schedule), ``adakv_compresskv`` (CompressKV Sec. 4:
W = 8, K = 5, avg pooling), ``adakv_kvpress`` (kvpress semantics, for the cross-check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .allocation import (
    PYRAMID_VARIANTS,
    adaptive_head_budgets,
    keep_topk_per_head,
    pyramid_plan,
    safeguard_keep_mask,
)
from .base import CompressResult, ConfigError, HeadLayout, LayerContext, Method, Plan
from .packing import pack_kept, packing_stats
from .scoring import get_scorer

FLOOR_MODES = ("capacity", "safeguard")
LAYER_SCHEDULES = ("uniform", "pyramid")


@dataclass
class AdaKVConfig:
    """AdaKV hyper-parameters.

    Attributes:
        scorer: token scorer name (``snapkv``; others register in ``methods.scoring.SCORERS``).
        window_size: W, observation-window queries (tokens), always kept.
        kernel_size: K, pooling width of the SnapKV scorer (odd, tokens).
        pooling: ``avg`` or ``max``.
        gqa_aggregation: ``mean`` or ``max`` over the G query heads of a KV head.
        group_before_pooling: aggregate the GQA group before pooling (AdaKV code order).
        floor_ratio: α, the share of each head's average budget it is guaranteed.
        normalize: rescale each head's scores by its top-budget mass share before the global
            top-k (AdaKV ``normalize``).
        floor_mode: ``capacity`` (AdaKV code) or ``safeguard`` (kvpress AdaKVPress).
        layer_schedule: ``uniform`` or ``pyramid`` (PyramidKV layer budgets).
        beta: β of the pyramid schedule.
        schedule: pyramid arithmetic, ``kvcf`` or ``kvpress``.
    """

    scorer: str = "snapkv"
    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    gqa_aggregation: str = "mean"
    group_before_pooling: bool = True
    floor_ratio: float = 0.2
    normalize: bool = False
    floor_mode: str = "capacity"
    layer_schedule: str = "uniform"
    beta: int = 20
    schedule: str = "kvcf"


class AdaKV(Method):
    """Head-wise adaptive budgets within each layer, per-head variable-length cache."""

    name: ClassVar[str] = "adakv"
    Config = AdaKVConfig

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        c = self.config
        self.scorer = get_scorer(c.scorer)
        checks = [
            (c.window_size >= 1, f"method.window_size={c.window_size}: must be an integer >= 1"),
            (c.kernel_size >= 1 and c.kernel_size % 2 == 1, f"method.kernel_size={c.kernel_size}: must be an odd integer >= 1"),
            (c.pooling in ("avg", "max"), f"method.pooling={c.pooling!r}: accepted values are avg, max"),
            (c.gqa_aggregation in ("mean", "max"), f"method.gqa_aggregation={c.gqa_aggregation!r}: accepted values are mean, max"),
            (0.0 <= c.floor_ratio <= 1.0, f"method.floor_ratio={c.floor_ratio}: must be in [0, 1]"),
            (c.floor_mode in FLOOR_MODES, f"method.floor_mode={c.floor_mode!r}: accepted values are {', '.join(FLOOR_MODES)}"),
            (c.layer_schedule in LAYER_SCHEDULES, f"method.layer_schedule={c.layer_schedule!r}: accepted values are {', '.join(LAYER_SCHEDULES)}"),
            (c.schedule in PYRAMID_VARIANTS, f"method.schedule={c.schedule!r}: accepted values are {', '.join(PYRAMID_VARIANTS)}"),
            (c.beta >= 1, f"method.beta={c.beta}: must be an integer >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    def min_budget(self) -> int:
        return self.window_size + 1

    def plan(self, n_tokens: int, budget: float, layout: HeadLayout) -> Plan:
        """Uniform layer budgets, or PyramidKV's when ``layer_schedule: pyramid``."""
        c = self.config
        if c.layer_schedule == "uniform":
            return super().plan(n_tokens, budget, layout)
        return pyramid_plan(n_tokens, budget, layout, self.window_size, c.beta, c.schedule)

    def select(self, ctx: LayerContext) -> torch.Tensor:
        """Keep mask ``(B, H_kv, n)`` of this layer (head-wise adaptive budgets + window)."""
        c = self.config
        scores = self.scorer(ctx, c)  # (B, H_kv, n), window at +inf
        b_sz, h, n = scores.shape
        m = min(ctx.budget, n)
        w = min(ctx.window_queries.shape[2], m)  # a ratio budget below W keeps the last m tokens
        if c.floor_mode == "safeguard":
            return safeguard_keep_mask(scores, m, c.floor_ratio)
        base = max(0, m - w)  # AdaKV allocates the prefix budget; the window is added to every head
        prefix = scores[..., : n - w]
        counts = adaptive_head_budgets(prefix, h * base, c.floor_ratio, c.normalize)  # (B, H)
        keep_prefix = keep_topk_per_head(prefix, counts)
        return torch.cat([keep_prefix, keep_prefix.new_ones(b_sz, h, w)], dim=-1)

    def compress(self, ctx: LayerContext) -> CompressResult:
        packed = pack_kept(ctx.keys, ctx.values, self.select(ctx))
        return CompressResult(
            keys=packed.keys,
            values=packed.values,
            valid=packed.valid,
            kept_indices=packed.indices,
            stats=packing_stats(packed.valid),
        )
