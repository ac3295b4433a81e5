"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference").

Heads of one layer differ in how concentrated their attention is, so a uniform per-head budget
wastes slots on flat heads and starves peaked ones. AdaKV shares the layer's budget H_kv·m
among its KV heads by one global top-k over all heads' token scores, with a per-head floor
(:func:`methods.allocation.adaptive_head_budgets`); each head then keeps its own top tokens
plus the observation window. Heads keep different numbers of tokens: they are stored packed
and padded to the layer's longest head with a validity mask (:func:`methods.base.pack_kept`).

* Scores are SnapKV's (:func:`methods.snapkv.snapkv_scores`), per KV head (GQA: mean or max
  over the group, AdaKV's ``gqa_support``), or ``scorer``'s: any ScoreMethod, built-in (``knorm``) or
  ``module:Class``, its config the defaults but for the fields AdaKV's config shares (``window_size``...).
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

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

import torch

from .allocation import adaptive_head_budgets, keep_topk_per_head, safeguard_keep_mask
from .base import (Budget, CompressResult, HeadLayout, LayerContext, Method, Plan, ScoreMethod, masked_scores, pack_kept,
                   require)
from .pyramidkv import PyramidKV, PyramidKVConfig


@dataclass
class AdaKVConfig(PyramidKVConfig):
    """AdaKV hyper-parameters: PyramidKV's (SnapKV scores, pyramid schedule), and

    Attributes:
        scorer: token scorer: ``snapkv``, a built-in ScoreMethod's name or ``module:Class`` (:func:`methods.resolve`).
        floor_ratio: α, the share of each head's average budget it is guaranteed.
        normalize: rescale each head's scores by its top-budget mass share before the global
            top-k (AdaKV ``normalize``).
        floor_mode: ``capacity`` (AdaKV code) or ``safeguard`` (kvpress AdaKVPress).
        layer_schedule: ``uniform`` or ``pyramid`` (PyramidKV layer budgets).
    """

    kernel_size: int = 7
    pooling: Literal["avg", "max"] = "max"
    scorer: str = "snapkv"
    floor_ratio: float = 0.2
    normalize: bool = False
    floor_mode: Literal["capacity", "safeguard"] = "capacity"
    layer_schedule: Literal["uniform", "pyramid"] = "uniform"

    def check(self) -> None:
        super().check()
        require(0.0 <= self.floor_ratio <= 1.0, "floor_ratio", self.floor_ratio, "must be in [0, 1]")
        scorer_class(self.scorer)  # importable, a ScoreMethod
        require(self.gqa_aggregation != "per_query_head", "gqa_aggregation", self.gqa_aggregation,
                "accepted values are mean, max")


def scorer_class(name: str) -> type[ScoreMethod] | None:
    """The ScoreMethod ``method.scorer`` names (None: SnapKV's own scores). ConfigError: not one."""
    from . import REGISTRY, get_method_class, resolve

    cls = None if name == "snapkv" else get_method_class(name) if name in REGISTRY else resolve(name, "method.scorer")
    require(cls is None or issubclass(cls, ScoreMethod), "scorer", name, "must name a ScoreMethod (snapkv, knorm, "
            "module:Class)")
    return cls


class AdaKV(PyramidKV):
    """Head-wise adaptive budgets within each layer, per-head variable-length cache."""

    Config = AdaKVConfig
    per_head_lengths = True

    @functools.cached_property
    def scorer(self) -> ScoreMethod | None:
        """The ``scorer`` method (None: SnapKV's scores), configured by the fields its config shares with AdaKV's."""
        if (cls := scorer_class(self.config.scorer)) is None:
            return None
        shared = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(cls.Config) if hasattr(self.config, f.name)}
        return cls(cls.Config(**shared), self.layout, self.artifacts)

    def score(self, ctx: LayerContext) -> torch.Tensor:
        """SnapKV's scores, or the scorer's with the recent window at +inf (always kept)."""
        if self.scorer is None:
            return super().score(ctx)
        scores = self.scorer.score(ctx).clone()
        scores[..., ctx.n_tokens - min(self.recent_window, ctx.n_tokens):] = float("inf")
        return scores

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """Uniform layer budgets, or PyramidKV's when ``layer_schedule: pyramid``."""
        if self.config.layer_schedule == "uniform":
            return Method.plan(self, n_tokens, budget, layout)
        return super().plan(n_tokens, budget, layout)

    def select(self, ctx: LayerContext) -> torch.Tensor:
        """Keep mask ``(B, H_kv, n)`` of this layer (head-wise adaptive budgets + recent window)."""
        c = self.config
        scores = masked_scores(self.score(ctx), ctx.valid)  # (B, H_kv, n), recent window at +inf, empty slots −inf
        b_sz, h, n = scores.shape
        m = min(ctx.budget, n)
        w = min(self.recent_window, m)  # a ratio budget below W keeps the last m tokens
        if c.floor_mode == "safeguard":
            return safeguard_keep_mask(scores, m, c.floor_ratio)
        base = max(0, m - w)  # AdaKV allocates the prefix budget; the window is added to every head
        prefix = scores[..., : n - w]
        counts = adaptive_head_budgets(prefix, h * base, c.floor_ratio, c.normalize)  # (B, H)
        keep_prefix = keep_topk_per_head(prefix, counts)
        return torch.cat([keep_prefix, keep_prefix.new_ones(b_sz, h, w)], dim=-1)

    def compress(self, ctx: LayerContext) -> CompressResult:
        """At decode time (``ctx.valid``) the empty slots score −inf: only the valid ones are shared out."""
        keep = self.select(ctx)
        return pack_kept(ctx.keys, ctx.values, keep if ctx.valid is None else keep & ctx.valid)

