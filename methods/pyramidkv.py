"""PyramidKV (Cai et al., 2025, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

Lower layers attend broadly, upper layers focus on few tokens, so the budget falls linearly
from the bottom layer to the top one around the same total as SnapKV's uniform budget
(:func:`methods.allocation.pyramid_layer_budgets`, β = 20, including the reference code's
fall-back to uniform budgets when the prompt is short). Inside a layer tokens are chosen as
in SnapKV (:func:`methods.snapkv.snapkv_scores`). ``budget`` m is the average kept per KV head
per layer, window included; the schedule runs over the compressible layers.

Presets: ``pyramidkv`` (SelKV Sec. 4 setting: W = 32, K = 5, avg pooling),
``pyramidkv_kvcf`` (KVCache-Factory LongBench script: W = 8, K = 7, max pooling),
``pyramidkv_compresskv`` (CompressKV Sec. 4: W = 8, K = 5, avg pooling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .allocation import pyramid_plan
from .base import Budget, HeadLayout, Plan, require
from .snapkv import SnapKV, SnapKVConfig


@dataclass
class PyramidKVConfig(SnapKVConfig):
    """PyramidKV hyper-parameters: SnapKV's, and

    Attributes:
        group_before_pooling: as SnapKV's, default true (KVCache-Factory order).
        beta: β, pyramid steepness: the top layer keeps about (m − W)/β + W tokens.
        schedule: ``kvcf`` (the authors' KVCache-Factory arithmetic) or ``kvpress`` (kvpress
            0.5.x PyramidKVPress arithmetic from the unrounded n·ρ, the top layer may keep just
            its W window tokens: as kvpress, for the cross-check).
    """

    group_before_pooling: bool = True
    beta: int = 20
    schedule: Literal["kvcf", "kvpress"] = "kvcf"

    def check(self) -> None:
        super().check()
        require(self.beta >= 1, "beta", self.beta, "must be an integer >= 1")


class PyramidKV(SnapKV):
    """Pyramidal layer budgets + SnapKV token selection."""

    Config = PyramidKVConfig

    def min_budget(self) -> int:
        """W + 1 (KVCache-Factory asserts m > W); W for ``schedule: kvpress`` (its top layer keeps W)."""
        return self.recent_window + (self.config.schedule == "kvcf")

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """Pyramid budgets over the compressible layers (``compress=False`` when m ≥ n)."""
        return pyramid_plan(n_tokens, budget, layout, self.recent_window, self.config.beta, self.config.schedule)
