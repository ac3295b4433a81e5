"""LOOK-M, text-only (Wan et al., 2024, "LOOK-M: Look-Once Optimization in KV Cache for
Efficient Multimodal Long-Context Inference"), as the SelKV paper uses it as a baseline.

Eviction: every prompt token is scored by the attention it accumulates from the prompt's
queries (LOOK-M's H2O-style cumulative score; ``window_size`` > 0 restricts it to the last W
queries); the first ``n_sinks`` tokens and the most recent ``⌊f·m⌋`` tokens are always kept,
the remaining ``m − ⌊f·m⌋`` slots go to the highest scores (per KV head; GQA: scores averaged
over the group).

Merging (LOOK-M's compensation): each evicted key/value is merged into the kept token whose
key is most cosine-similar (its merge target t), as in the LOOK-M code
(``scatter_reduce(mean, include_self=True)``)::

    x_t ← (x_t + Σ_{j→t} w_j·c_j) / (1 + Σ_{j→t} w_j)

with the contribution c_j of evicted token j (x = key or value)

* ``avg``:      c_j = x_j
* ``pivot``:    c_j = (x_j + x_t) / 2          (pivotal merging, LOOK-M's headline variant)
* ``weighted``: c_j = s_j·x_j,  s_j = cos(k_j, k_t)

and w_j = 1, except that (a) the similarity filter of the reference code (on for ``avg`` and
``weighted``, off for ``pivot``) keeps only evicted slots whose head-mean max similarity is at
least the layer mean (w_j = 0 otherwise; the code compares the j-th evicted slot of every head),
and (b) ``gate: soft`` multiplies w_j by SelKV's soft cosine gate g_j = max(cos(v_j, v_t), 0)
(SelKV Eq. 4; g = 0 drops, g = 1 merges fully).

Deviation from the reference code, on purpose: its ``avg`` variant pairs the filtered targets
with the first evicted rows (``src`` unfiltered, ``index`` filtered); here each filtered token
goes to its own target. Budget split: LOOK-M sets the heavy-hitter and recent shares as
fractions of n (0.1 + 0.1 in its scripts); here ``recent_fraction`` of the budget m is recent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import CompressResult, ConfigError, LayerContext, Method, gather_tokens
from .merging import soft_cosine_gate
from .scoring import group_scores, window_attention

MERGES = ("avg", "pivot", "weighted")
FILTERS = ("auto", "on", "off")
GATES = ("none", "soft")
_WHOLE_PROMPT = 1 << 40  # window_size=0: the engine caps W at n, i.e. every prompt query


@dataclass
class LookMConfig:
    """LOOK-M hyper-parameters.

    Attributes:
        window_size: W, queries whose attention is accumulated; 0 = every prompt query (LOOK-M).
        recent_fraction: share of the budget m kept as the most recent tokens (LOOK-M: 0.5,
            hh_ratio = recent_ratio).
        n_sinks: first tokens always kept (LOOK-M code: 4).
        merge: ``avg``, ``pivot`` or ``weighted``.
        similarity_filter: ``auto`` (as the reference code: on for avg/weighted, off for pivot),
            ``on`` or ``off``.
        gate: ``none`` or ``soft`` (SelKV soft cosine gate on values).
        gqa_aggregation: ``mean`` or ``max`` over the G query heads of a KV head.
        query_chunk: queries per block when accumulating attention (bounds memory, tokens).
        merge_chunk: evicted tokens per block when finding merge targets (bounds memory).
    """

    window_size: int = 0
    recent_fraction: float = 0.5
    n_sinks: int = 4
    merge: str = "pivot"
    similarity_filter: str = "auto"
    gate: str = "none"
    gqa_aggregation: str = "mean"
    query_chunk: int = 512
    merge_chunk: int = 1024


def cumulative_attention(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None, chunk: int
) -> torch.Tensor:
    """Attention each key receives, summed over the given (last) prompt queries (H2O score).

    Args:
        queries: ``(B, H_q, W, d)``, the last W prompt queries after RoPE.
        keys: ``(B, H_kv, n, d)``.
        scaling, softcap: as in :func:`methods.scoring.window_attention`.
        chunk: queries per block (memory is ``B·H_q·chunk·n`` floats).

    Returns:
        ``(B, H_q, n)`` float32.
    """
    b, h_q, w, _ = queries.shape
    n = keys.shape[2]
    total = torch.zeros(b, h_q, n, dtype=torch.float32, device=keys.device)
    for start in range(0, w, chunk):  # loop over query blocks, not tokens
        block = queries[:, :, start : start + chunk]
        total += window_attention(block, keys, scaling, softcap, first_position=n - w + start).sum(dim=2)
    return total


def nearest_kept(evicted_keys: torch.Tensor, kept_keys: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Most cosine-similar kept key of every evicted key (LOOK-M merge target).

    Args:
        evicted_keys: ``(B, H, E, d)``.
        kept_keys: ``(B, H, m, d)``.
        chunk: evicted rows per block (memory ``B·H·chunk·m`` floats).

    Returns:
        ``(max_similarity (B, H, E) float32, target (B, H, E) long index into m)``.
    """
    kept = F.normalize(kept_keys.float(), dim=-1, eps=1e-6)
    sims, targets = [], []
    for start in range(0, evicted_keys.shape[2], chunk):  # loop over blocks of evicted tokens
        ev = F.normalize(evicted_keys[:, :, start : start + chunk].float(), dim=-1, eps=1e-6)
        s, t = torch.matmul(ev, kept.transpose(-1, -2)).max(dim=-1)
        sims.append(s)
        targets.append(t)
    return torch.cat(sims, dim=-1), torch.cat(targets, dim=-1)


def merge_into_targets(
    kept: torch.Tensor, evicted: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, merge: str, sim: torch.Tensor
) -> torch.Tensor:
    """x_t ← (x_t + Σ_{j→t} w_j·c_j) / (1 + Σ_{j→t} w_j) for one of the LOOK-M variants.

    Args:
        kept: ``(B, H, m, d)`` kept rows (keys or values).
        evicted: ``(B, H, E, d)`` evicted rows.
        target: ``(B, H, E)`` long merge target of each evicted row.
        weight: ``(B, H, E)`` float32 w_j (0 = not merged).
        merge: ``avg``, ``pivot`` or ``weighted``.
        sim: ``(B, H, E)`` float32 cosine similarity to the target (``weighted``).

    Returns:
        ``(B, H, m, d)`` merged rows, in ``kept``'s dtype.
    """
    x_t = kept.float()
    x_j = evicted.float()
    idx = target.unsqueeze(-1).expand_as(x_j)
    if merge == "avg":
        contrib = x_j
    elif merge == "pivot":
        contrib = (x_j + x_t.gather(2, idx)) / 2
    else:  # weighted
        contrib = sim.unsqueeze(-1) * x_j
    num = x_t.scatter_add(2, idx, weight.unsqueeze(-1) * contrib)
    den = torch.ones_like(x_t[..., :1]).scatter_add(2, target.unsqueeze(-1), weight.unsqueeze(-1))
    return (num / den).to(kept.dtype)


class LookM(Method):
    """Cumulative-attention eviction with cosine-nearest merging of the evicted tokens."""

    name: ClassVar[str] = "lookm"
    Config = LookMConfig

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        c = self.config
        checks = [
            (c.window_size >= 0, f"method.window_size={c.window_size}: must be an integer >= 0 (0 = whole prompt)"),
            (0.0 <= c.recent_fraction <= 1.0, f"method.recent_fraction={c.recent_fraction}: must be in [0, 1]"),
            (c.n_sinks >= 0, f"method.n_sinks={c.n_sinks}: must be an integer >= 0"),
            (c.merge in MERGES, f"method.merge={c.merge!r}: accepted values are {', '.join(MERGES)}"),
            (c.similarity_filter in FILTERS, f"method.similarity_filter={c.similarity_filter!r}: accepted values are {', '.join(FILTERS)}"),
            (c.gate in GATES, f"method.gate={c.gate!r}: accepted values are {', '.join(GATES)}"),
            (c.gqa_aggregation in ("mean", "max"), f"method.gqa_aggregation={c.gqa_aggregation!r}: accepted values are mean, max"),
            (c.query_chunk >= 1 and c.merge_chunk >= 1, "method.query_chunk/merge_chunk: must be integers >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def window_size(self) -> int:
        return self.config.window_size if self.config.window_size > 0 else _WHOLE_PROMPT

    def min_budget(self) -> int:
        return self.config.n_sinks + 1

    def select(self, ctx: LayerContext) -> torch.Tensor:
        """Keep mask ``(B, H_kv, n)``: sinks, top cumulative-attention tokens, recent tokens."""
        c = self.config
        n, m = ctx.n_tokens, min(ctx.budget, ctx.n_tokens)
        scores = cumulative_attention(ctx.window_queries, ctx.keys, ctx.scaling, ctx.softcap, c.query_chunk)
        scores = group_scores(scores, ctx.layout.num_kv_heads, c.gqa_aggregation)  # (B, H_kv, n)
        recent = min(int(m * c.recent_fraction), m)
        scores[..., : c.n_sinks] = float("inf")
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[..., n - recent :] = True
        if m > recent:
            keep.scatter_(-1, scores[..., : n - recent].topk(m - recent, dim=-1).indices, True)
        return keep

    def compress(self, ctx: LayerContext) -> CompressResult:
        c = self.config
        keep = self.select(ctx)
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices  # kept first, ascending
        m = int(keep[0, 0].sum())
        kept_idx, evicted_idx = order[..., :m], order[..., m:]  # (B, H, m), (B, H, E)
        keys, values = gather_tokens(ctx.keys, kept_idx), gather_tokens(ctx.values, kept_idx)
        if evicted_idx.shape[-1] == 0:
            return CompressResult(keys=keys, values=values, kept_indices=kept_idx, stats={"merged": 0.0, "dropped": 0.0})
        ev_keys, ev_values = gather_tokens(ctx.keys, evicted_idx), gather_tokens(ctx.values, evicted_idx)
        sim, target = nearest_kept(ev_keys, keys, c.merge_chunk)  # (B, H, E)
        weight = torch.ones_like(sim)
        use_filter = c.similarity_filter == "on" or (c.similarity_filter == "auto" and c.merge != "pivot")
        if use_filter:  # reference code: slot-wise head-mean max similarity ≥ layer mean
            slot_mean = sim.mean(dim=1, keepdim=True)  # (B, 1, E)
            weight = weight * (slot_mean >= sim.mean(dim=(1, 2), keepdim=True)).float()
        if c.gate == "soft":
            weight = weight * soft_cosine_gate(ev_values, values.gather(2, target.unsqueeze(-1).expand_as(ev_values)))
        merged_keys = merge_into_targets(keys, ev_keys, target, weight, c.merge, sim)
        merged_values = merge_into_targets(values, ev_values, target, weight, c.merge, sim)
        n_merged = float((weight > 0).sum())
        return CompressResult(
            keys=merged_keys,
            values=merged_values,
            kept_indices=kept_idx,
            stats={"merged": n_merged, "dropped": float(weight.numel()) - n_merged},
        )
