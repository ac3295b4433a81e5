"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first ``n_sinks`` tokens (attention sinks) and the most recent ``budget − n_sinks``
tokens; needs no attention scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerContext, MethodConfig, ScoreMethod, require


@dataclass
class StreamingLLMConfig(MethodConfig):
    """Attributes:
        n_sinks: attention-sink tokens kept at the start of the prompt (paper: 4).
    """

    n_sinks: int = 4

    def check(self) -> None:
        require(self.n_sinks >= 0, "n_sinks", self.n_sinks, "must be an integer >= 0")


class StreamingLLM(ScoreMethod):
    """Attention sinks + recent window, as a score: sinks first (earliest highest), then recency."""

    Config = StreamingLLMConfig

    def min_budget(self) -> int:
        return self.config.n_sinks + 1

    def score(self, ctx: LayerContext) -> torch.Tensor:
        n = ctx.n_tokens
        position = torch.arange(n, dtype=torch.float32, device=ctx.keys.device)
        score = torch.where(position < self.config.n_sinks, 2 * n - position, position)  # (n,)
        return score.expand(*ctx.keys.shape[:2], n)
