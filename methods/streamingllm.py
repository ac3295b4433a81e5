"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first ``n_sinks`` tokens (attention sinks) and the most recent ``budget - n_sinks``
tokens; needs no attention scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CompressResult, ConfigError, LayerContext, Method, gather_tokens


@dataclass
class StreamingLLMConfig:
    """Attributes:
        n_sinks: attention-sink tokens kept at the start of the prompt (paper: 4).
    """

    n_sinks: int = 4


class StreamingLLM(Method):
    """Attention sinks + recent window."""

    name: ClassVar[str] = "streamingllm"
    Config = StreamingLLMConfig

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        if self.config.n_sinks < 0:
            raise ConfigError(f"method.n_sinks={self.config.n_sinks}: must be an integer >= 0")

    @property
    def window_size(self) -> int:  # no window queries needed
        return 0

    def min_budget(self) -> int:
        return self.config.n_sinks + 1

    def compress(self, ctx: LayerContext) -> CompressResult:
        b, h, n, _ = ctx.keys.shape
        sinks = min(self.config.n_sinks, ctx.budget)
        recent = ctx.budget - sinks
        idx = torch.cat(
            [torch.arange(sinks, device=ctx.keys.device), torch.arange(n - recent, n, device=ctx.keys.device)]
        ).expand(b, h, -1)
        return CompressResult(keys=gather_tokens(ctx.keys, idx), values=gather_tokens(ctx.values, idx), kept_indices=idx)
