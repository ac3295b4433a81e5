"""HeadKV (Fu et al., 2025, "Not All Heads Matter: A Head-Level KV Cache Compression Method
with Integrated Retrieval and Reasoning").

Head budgets come from offline head-importance scores (retrieval heads, or retrieval-reasoning
"R2" heads: ``kvbench calibrate heads``). With ``b = budget − W`` prefix tokens per
head on average (W = observation window, always kept), the reference code
(``headkv/snapkv_utils.py``, ``ReasonSnapKVCluster``) gives head (l, h)

    s_{l,h} = mean score of head (l, h);  s ← s / Σ s;  s ← s^temp / Σ s^temp
    pool    = (b // β) · L · H                  (the shared budget pool)
    floor   = b − b // β                        (what every head keeps)
    b_{l,h} = round(s_{l,h} · pool + floor)     (prefix tokens; + W window tokens)

over all L × H heads of the model at once (Python ``//`` on a float β, ``torch.round``
half-to-even, as the reference). A head keeps the window plus its top ``b_{l,h}`` prefix
tokens by SnapKV score; a head whose budget exceeds the prefix keeps the whole prefix.
Because of the rounding the total may differ from L·H·b by a few tokens, as in the reference.

GQA: the reference repeats KV heads and compresses per query head. Here (like the CompressKV
paper's baselines, "applied at the GQA-group granularity") budgets are per KV head: a KV
head's score is the **mean of its G query heads' mean scores** (identical to their sum after
the normalisation above, for any temperature) or their max (``gqa_score_aggregation``).

Heads of one layer keep different numbers of tokens; the layer stores them packed and padded
to its longest head with a validity mask (:func:`methods.base.pack_kept`).

Presets: ``conf/method/headkv.yaml`` (HeadKV-R2, the paper's main method, reference-code
defaults W=8, K=7, max pooling, β=1.5, temp=1) and ``headkv_retrieval.yaml`` (retrieval heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .allocation import keep_topk_per_head
from .artifacts import artifact_path, keyed_errors, load_head_scores
from .base import Budget, CompressResult, ConfigError, HeadLayout, LayerContext, Plan, pack_kept, require
from .snapkv import SnapKV, SnapKVConfig


_SCORE_FILES = {"retrieval_reasoning": "retrieval_reasoning_heads", "retrieval": "retrieval_heads"}


@dataclass
class HeadKVConfig(SnapKVConfig):
    """HeadKV hyper-parameters: SnapKV's token scores (W = 8, K = 7, max pooling), and

    Attributes:
        head_scores: ``retrieval_reasoning`` (HeadKV-R2) or ``retrieval`` (retrieval heads).
        head_scores_path: explicit head-score file; ``None`` reads
            ``methods/artifacts/<model>/<kind>_heads.json``.
        beta: β ≥ 1, sets the shared pool: each head keeps b − b//β, the pool is (b//β)·L·H.
        temp: temperature applied to the normalised scores (s^temp, renormalised).
        gqa_score_aggregation: ``mean`` (≡ sum) or ``max`` of the query-head scores of a GQA group.
    """

    window_size: int = 8
    kernel_size: int = 7
    pooling: Literal["avg", "max"] = "max"
    head_scores: Literal["retrieval_reasoning", "retrieval"] = "retrieval_reasoning"
    head_scores_path: str | None = None
    beta: float = 1.5
    temp: float = 1.0
    gqa_score_aggregation: Literal["mean", "max"] = "mean"

    def check(self) -> None:
        super().check()
        require(self.beta >= 1, "beta", self.beta, "must be a number >= 1 (reference sweep: 1.005 ... 10)")
        require(self.temp > 0, "temp", self.temp, "must be > 0")
        require(self.gqa_aggregation != "per_query_head", "gqa_aggregation", self.gqa_aggregation,
                "accepted values are mean, max")


def kv_head_scores(q_head_scores: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Aggregate per-query-head importance scores to per-KV-head scores over each GQA group.

    Args:
        q_head_scores: ``(L, H_q)`` mean scores (query heads of group g are g·G .. g·G+G-1).
        num_kv_heads: H_kv.
        how: ``mean`` or ``max``.

    Returns:
        ``(L, H_kv)`` float64.
    """
    n_layers, h_q = q_head_scores.shape
    grouped = q_head_scores.double().view(n_layers, num_kv_heads, h_q // num_kv_heads)
    return grouped.mean(dim=-1) if how == "mean" else grouped.amax(dim=-1)


def headkv_head_budgets(scores: torch.Tensor, base: int, beta: float, temp: float) -> torch.Tensor:
    """HeadKV head budgets (prefix tokens, window excluded) for every head of the model.

    Implements the reference allocation (module docstring): normalise the mean scores over all
    heads, apply the temperature, split the pool ``(base // beta) · #heads`` in proportion and
    add the floor ``base − base // beta`` to every head, rounded half-to-even.

    Args:
        scores: ``(L, H)`` non-negative head scores (not all zero).
        base: b, the average prefix budget per head (budget − W), ≥ 0.
        beta: β ≥ 1.
        temp: temperature > 0.

    Returns:
        ``(L, H)`` long tensor of prefix budgets.
    """
    s = scores.double()
    s = s / s.sum()
    s = s.pow(temp)
    s = s / s.sum()
    pool_per_head = base // beta  # Python floor division on a float, as the reference
    floor = base - pool_per_head
    pool = pool_per_head * s.numel()
    return torch.round(s * pool + floor).long()


def pack_head_budgets(ctx: LayerContext, scores: torch.Tensor, head_budget: torch.Tensor) -> CompressResult:
    """Keep each KV head's top ``head_budget[h]`` tokens by ``scores`` and store them packed.

    Args:
        ctx: the layer context (keys, values ``(B, H_kv, n, d)``).
        scores: ``(B, H_kv, n)`` token scores, window positions +inf (always kept).
        head_budget: ``(H_kv,)`` long tokens per head (window included), each ≤ n.

    Returns:
        A :class:`CompressResult` padded to the longest head, with ``valid`` and packing stats.
    """
    counts = head_budget.to(scores.device).clamp(max=scores.shape[-1]).expand(scores.shape[0], -1)
    return pack_kept(ctx.keys, ctx.values, keep_topk_per_head(scores, counts))


class HeadKV(SnapKV):
    """Head-level budgets from head-importance scores; SnapKV token scores inside each head."""

    Config = HeadKVConfig
    decodes = False  # head budgets come from the prompt-time plan
    per_head_lengths = True

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        self._head_budgets: torch.Tensor | None = None
        if layout is not None and not self.artifacts:
            self.check_layout(layout)

    def check_layout(self, layout: HeadLayout) -> None:
        """Load the head scores for this model (before the model loads); raise ConfigError if unusable."""
        self.artifacts = self.load_artifacts(self.config, layout)

    @staticmethod
    def load_artifacts(config: HeadKVConfig, layout: HeadLayout) -> dict:
        """Read the head-score file for ``layout.model_name`` (or ``config.head_scores_path``).

        Returns:
            ``{"kv_head_scores": (L, H_kv) float64}``.

        Raises:
            ConfigError: missing or malformed file, grid not matching the model, all-zero scores.
        """
        kind = _SCORE_FILES[config.head_scores]
        path = artifact_path(kind, layout.model_name, config.head_scores_path, "method.head_scores_path")
        with keyed_errors("method.head_scores_path", path):
            q_scores = load_head_scores(path, layout)
        scores = kv_head_scores(q_scores, layout.num_kv_heads, config.gqa_score_aggregation)
        layers = list(layout.compressible_layers) or list(range(layout.num_layers))
        if not (scores[layers] > 0).any():
            raise ConfigError(f"method.head_scores_path={str(path)!r}: every head score is zero")
        return {"kv_head_scores": scores}

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """Head budgets ``(L, H_kv)`` (window included, capped at n); layer budget = longest head.

        Non-compressible layers get n (they are left alone).
        """
        if not self.artifacts:
            self.check_layout(layout)
        m = budget.of(n_tokens)
        w = self.recent_window
        scores = self.artifacts["kv_head_scores"]
        layers = list(layout.compressible_layers) or list(range(layout.num_layers))
        heads = torch.full((layout.num_layers, layout.num_kv_heads), n_tokens, dtype=torch.long)
        prefix = headkv_head_budgets(scores[layers], max(m - w, 0), self.config.beta, self.config.temp)
        heads[layers] = w + prefix.clamp(max=max(n_tokens - w, 0))
        heads = heads.clamp(max=n_tokens)
        self._head_budgets = heads
        return Plan(layer_budgets=heads.amax(dim=1).tolist(), head_budgets=heads, compress=m < n_tokens)

    def compress(self, ctx: LayerContext) -> CompressResult:
        hb = ctx.head_budget
        if hb is None:
            if self._head_budgets is None:
                raise RuntimeError("HeadKV.compress needs ctx.head_budget or a prior plan() call")
            hb = self._head_budgets[ctx.layer_idx]
        return pack_head_budgets(ctx, self.score(ctx), hb)  # scores (B, H_kv, n), recent window +inf
