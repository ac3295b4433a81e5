"""PyramidKV (Cai et al., 2025, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

Lower layers attend broadly, upper layers focus on few tokens, so the budget falls linearly
from the bottom layer to the top one around the same total as SnapKV's uniform budget
(:func:`methods.allocation.pyramid_layer_budgets`, β = 20, including the reference code's
fall-back to uniform budgets when the prompt is short). Inside a layer, tokens are chosen as
in SnapKV (:func:`methods.snapkv.snapkv_scores`): observation-window attention, pooled,
aggregated per GQA group, top-k per KV head plus the window.

Budgets: ``budget`` m is the average number of tokens kept per KV head per layer, window
included (``budget < 1``: m = ⌊ρ·n⌋). The schedule runs over the compressible layers.

Presets: ``pyramidkv`` (SelKV Sec. 4 setting: W = 32, K = 5, avg pooling),
``pyramidkv_kvcf`` (KVCache-Factory LongBench script: W = 8, K = 7, max pooling),
``pyramidkv_compresskv`` (CompressKV Sec. 4: W = 8, K = 5, avg pooling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .allocation import PYRAMID_VARIANTS, pyramid_plan
from .base import ConfigError, HeadLayout, Plan
from .snapkv import SnapKV


@dataclass
class PyramidKVConfig:
    """PyramidKV hyper-parameters.

    Attributes:
        window_size: W, observation-window queries (tokens), always kept.
        kernel_size: K, pooling width (odd, tokens).
        pooling: ``avg`` or ``max``.
        gqa_aggregation: ``mean`` or ``max`` over the G query heads of a KV head.
        group_before_pooling: aggregate the GQA group before pooling (KVCache-Factory kv-head
            order) instead of after (kvpress order).
        beta: β, pyramid steepness: the top layer keeps about (m − W)/β + W tokens.
        schedule: ``kvcf`` (the authors' KVCache-Factory arithmetic) or ``kvpress`` (kvpress
            0.5.x PyramidKVPress arithmetic, for the cross-check).
    """

    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    gqa_aggregation: str = "mean"
    group_before_pooling: bool = True
    beta: int = 20
    schedule: str = "kvcf"


class PyramidKV(SnapKV):
    """Pyramidal layer budgets + SnapKV token selection."""

    name: ClassVar[str] = "pyramidkv"
    Config = PyramidKVConfig

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        c = self.config
        if c.beta < 1:
            raise ConfigError(f"method.beta={c.beta}: must be an integer >= 1")
        if c.schedule not in PYRAMID_VARIANTS:
            raise ConfigError(f"method.schedule={c.schedule!r}: accepted values are {', '.join(PYRAMID_VARIANTS)}")

    def min_budget(self) -> int:
        return self.window_size + 1

    def plan(self, n_tokens: int, budget: float, layout: HeadLayout) -> Plan:
        """Pyramid budgets over the compressible layers (``compress=False`` when m ≥ n)."""
        c = self.config
        return pyramid_plan(n_tokens, budget, layout, self.window_size, c.beta, c.schedule)

    # compress(): inherited from SnapKV, with this layer's budget from the plan.
