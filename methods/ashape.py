"""A-shape and Tri-shape: the static sparse prefill patterns SCBench compares (Li et al., 2025, arXiv 2412.10319;
microsoft/MInference ``minference/ops/streaming_kernel.py`` at commit fb56c91, ``a_shape_kernel``, ``tri_shape_kernel``).

The whole cache is kept and decoding is dense; only the prefill attention of each compressible layer is sparse.
Query i (position p_i = T − q + i over T keys) attends key j ≤ p_i when

    A-shape:    p_i − j < n_local   or   j < n_init                   (local window + attention sinks)
    Tri-shape:  A-shape, or i is one of the last n_last queries       (min(n_last, q − 1); they attend every key)

with n_local = budget − n_init (MInference's defaults: n_init = 128, n_local = 3968, budget 4096; Tri-shape's
n_last = 100). The budget is read as n_init + n_local tokens, as StreamingLLM's. Computed by SDPA over blocks of
1,024 queries with the pattern as a boolean mask (no q × T mask at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Budget, HeadLayout, Method, MethodConfig, Plan, require

_BLOCK = 1024  # query rows per SDPA call


@dataclass
class AShapeConfig(MethodConfig):
    """Attributes:
        n_init: sink tokens every query attends (MInference: 128).
        n_last: Tri-shape's last queries that attend everything (MInference: 100); 0 = A-shape.
    """

    n_init: int = 128
    n_last: int = 0

    def check(self) -> None:
        require(self.n_init >= 0, "n_init", self.n_init, "must be an integer >= 0")
        require(self.n_last >= 0, "n_last", self.n_last, "must be an integer >= 0")


def pattern(q: int, t: int, n_init: int, n_local: int, n_last: int, rows: slice = slice(None)) -> torch.Tensor:
    """``(rows, t)`` bool: which keys the query rows ``rows`` of a q-query prefill over t keys attend."""
    i = torch.arange(q)[rows].unsqueeze(1)
    p, j = i + (t - q), torch.arange(t)
    last = i >= q - min(n_last, q - 1)  # Tri-shape's dense rows (none for n_last = 0)
    return (j <= p) & ((p - j < n_local) | (j < n_init) | last)


class AShape(Method):
    """Sparse prefill (:meth:`prefill_attention`), whole cache, dense decode."""

    Config = AShapeConfig
    sparse_prefill = True

    def min_budget(self) -> int:
        return self.config.n_init + 1

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """The budget n_init + n_local per layer; nothing is compressed."""
        return Plan([budget.of(n_tokens)] * layout.num_layers, compress=False)

    def prefill_attention(self, query, key, value, scaling, budget):
        q, t, cfg = query.shape[2], key.shape[2], self.config
        return torch.cat([
            F.scaled_dot_product_attention(
                query[:, :, s : s + _BLOCK], key, value, scale=scaling, enable_gqa=True,
                attn_mask=pattern(q, t, cfg.n_init, budget - cfg.n_init, cfg.n_last, slice(s, s + _BLOCK)).to(key.device))
            for s in range(0, q, _BLOCK)], dim=2)
