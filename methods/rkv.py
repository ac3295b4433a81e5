"""R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv 2505.24133;
official code Zefan-Cai/R-KV: ``rkv/compression/r1_kv.py`` ``R1KV.update_kv``, ``rkv/utils.py``).

Made for decoding (reasoning traces): each time the layer's cache is cut back, every KV head keeps its last α tokens
(the observation window, whose queries score the rest) and the ``budget − α`` earlier tokens of highest

    Z_j = λ·I_j − (1 − λ)·R_j                                                                  (Sec. 3.4)

* importance I (Sec. 3.2): the α window queries' attention over the T − α earlier tokens, the logits of a GQA
  group's query heads reduced by their max before the softmax (the official ``compute_attention_scores``):
  A_{t,j} = softmax_{j < T−α}( max_{g ∈ group} q_{g,t}·k_j / √d ),  Ĩ_j = (1/α)·Σ_t A_{t,j},
  I = max-pool of Ĩ over K neighbouring slots;
* redundancy R (Sec. 3.3): cosine similarities of the keys S_{ij} = k̂_i·k̂_j (k̂ = k / (‖k‖ + 1e-8)), S_ii = 0;
  in every row i one entry is zeroed, S_{i,r(i)} = 0 with r(i) the last (``retain_direction: last``) slot j whose
  S_ij > τ, 0 when none is (``first``: the official minimum over the same candidates, which is always slot 0);
  R_j = softmax_j((1/T)·Σ_i S_ij) over all T slots, the window included.

Everything follows the official code, dtypes included: logits in the cache's dtype, the softmax in float32 then
cast back, Z in the cache's dtype (bf16 on CUDA). A cache shorter than the budget is left alone; one of exactly
``budget`` tokens is still rescored (its order changes). The kept tokens are returned in the official stored
order: the ``budget − α`` selected tokens in descending Z (top-k order), then the window in order. That order
matters: the max-pooling and the "last similar slot" of the next compression run over the stored slots, so the
cache must keep the returned order (``kept_indices`` is not sorted).

Defaults are the official ones used for the paper's numbers: α = 8 (``window_size``), K = 7 (``kernel_size``,
``R1KV``'s default, not set by ``run_math.py``), λ = 0.07 (``mix_lambda``: ``run_math.py``'s and ``R1KV``'s
default; the README's table says 0.1), τ = 0.5 (``threshold``, ``cal_similarity``'s default). ``run_math.py``'s
``retain_ratio`` (read only by the ``*_percent`` directions, which it does not offer) and ``first_tokens``
(ignored by ``R1KV``) have no field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .base import Budget, CompressResult, HeadLayout, LayerContext, Method, MethodConfig, Plan, gather_tokens, require


@dataclass
class RKVConfig(MethodConfig):
    """R-KV hyper-parameters (official names in brackets).

    Attributes:
        window_size: α, observation-window queries and the recent tokens always kept [window_size].
        kernel_size: K, max-pooling width of the importance (odd) [kernel_size].
        mix_lambda: λ in [0, 1], weight of importance against redundancy [mix_lambda].
        threshold: τ, cosine similarity above which two keys count as similar [cal_similarity's threshold].
        retain_direction: which similar slot of each row is not counted as redundancy: ``last`` (the most
            recent one, the official default) or ``first`` [retain_direction].
    """

    window_size: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.07
    threshold: float = 0.5
    retain_direction: Literal["last", "first"] = "last"

    def check(self) -> None:
        require(self.window_size >= 1, "window_size", self.window_size, "must be an integer >= 1")
        require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", self.kernel_size,
                "must be an odd integer >= 1")
        require(0 <= self.mix_lambda <= 1, "mix_lambda", self.mix_lambda, "must be in [0, 1]")
        require(-1 <= self.threshold <= 1, "threshold", self.threshold, "must be a cosine similarity in [-1, 1]")


def rkv_scores(keys: torch.Tensor, window_queries: torch.Tensor, cfg: RKVConfig) -> torch.Tensor:
    """Z of the T − α tokens before the window.

    Args:
        keys: ``(B, H_kv, T, d)`` the cache, its last α slots the window's tokens.
        window_queries: ``(B, H_q, w, d)`` the last w ≥ α queries (after RoPE), same dtype as ``keys``.
        cfg: α, K, λ, τ and the retain direction.

    Returns:
        ``(B, H_kv, T − α)`` in ``keys``' dtype.
    """
    (b, h_kv, t, d), (w, a) = keys.shape, (window_queries.shape[2], cfg.window_size)
    q = window_queries.reshape(b, h_kv, -1, w, d)  # (B, H_kv, G, w, d): the query heads of each GQA group
    logits = torch.matmul(q, keys.unsqueeze(2).transpose(3, 4)) / math.sqrt(d)  # (B, H_kv, G, w, T)
    logits = logits.amax(dim=2)[..., -a:, :-a]
    attn = torch.softmax(logits, dim=-1, dtype=torch.float32).mean(dim=-2).to(window_queries.dtype)  # (B, H_kv, T−α)
    importance = F.max_pool1d(attn, cfg.kernel_size, stride=1, padding=cfg.kernel_size // 2)

    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    sim = torch.matmul(unit, unit.transpose(-1, -2))  # (B, H_kv, T, T)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    slots = torch.where(sim > cfg.threshold, torch.arange(t, device=keys.device), 0)
    kept = slots.amax(-1) if cfg.retain_direction == "last" else slots.amin(-1)  # (B, H_kv, T)
    sim.scatter_(-1, kept.unsqueeze(-1), 0)
    redundancy = sim.mean(dim=-2).softmax(dim=-1)[..., :-a]
    return importance * cfg.mix_lambda - redundancy * (1 - cfg.mix_lambda)


class RKV(Method):
    """R-KV: importance (window attention) minus redundancy (key similarity), per-KV-head top-k + the window."""

    Config = RKVConfig
    decodes = decode_only = True

    def min_budget(self) -> int:
        return self.window_size + 1  # the official asserts budget > window_size

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """The uniform plan; a prompt of exactly ``budget`` tokens is compressed too (reordered), as the official."""
        plan = super().plan(n_tokens, budget, layout)
        plan.compress = plan.compress or n_tokens == budget.tokens
        return plan

    def compress(self, ctx: LayerContext) -> CompressResult:
        """The official ``update_kv``: ``kept_indices`` ``(B, H_kv, budget)`` in stored order (top-k by Z, then
        the window); a cache of T < budget slots is returned whole."""
        keys, t, a = ctx.keys, ctx.n_tokens, self.window_size
        if t < ctx.budget:
            idx = torch.arange(t, device=keys.device).expand(*keys.shape[:2], t)
            return CompressResult(keys, ctx.values, kept_indices=idx)
        top = rkv_scores(keys, ctx.window_queries, self.config).topk(ctx.budget - a, dim=-1).indices
        idx = torch.cat([top, torch.arange(t - a, t, device=keys.device).expand(*top.shape[:2], a)], dim=-1)
        return CompressResult(gather_tokens(keys, idx), gather_tokens(ctx.values, idx), kept_indices=idx)
