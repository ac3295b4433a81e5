"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a low L2 norm draw high attention, so every KV head keeps its
lowest-norm tokens (kvpress ``KnormPress``: score = −‖k‖₂) plus the recent window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerContext, MethodConfig, ScoreMethod, require


@dataclass
class KnormConfig(MethodConfig):
    """Attributes:
        recent_window: trailing tokens always kept (0: none, as kvpress KnormPress).
    """

    recent_window: int = 32

    def check(self) -> None:
        require(self.recent_window >= 0, "recent_window", self.recent_window, "must be an integer >= 0")


class Knorm(ScoreMethod):
    """Keep the tokens whose keys have the lowest L2 norm."""

    Config = KnormConfig

    def score(self, ctx: LayerContext) -> torch.Tensor:
        return -torch.linalg.vector_norm(ctx.keys.float(), dim=-1)  # (B, H_kv, n)
