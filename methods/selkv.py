"""SelKV (Bouyahiaoui et al., 2026, "Selective KV Cache Merging with Per-Token Merge-or-Drop
and Attention Compensation", arXiv 2607.16213), Sections 3.1-3.8 and Algorithm 1.

Per layer, once at the end of prefill (B batch, H_q query heads, H_kv KV heads, G = H_q/H_kv,
n prompt tokens, W window queries, m = budget, m_r recent window, m_s = m − m_r, d head dim):

1. Contribution score (Eq. 1): c_{h,j} = Σ_{i∈W} A_{h,i,j} · ‖v_{h,j}‖₂ per query head from
   the observation-window attention A ``(B, H_q, W, n)``, average-pooled with width K, then
   averaged over each GQA group to ``(B, H_kv, n)``.
2. Selection (Eq. 2): the last m_r tokens are always kept; m_s more are chosen from the rest
   ``per_head`` (each KV head its own top-m_s), ``union`` (each KV head's top-m_s, united and
   trimmed back to m_s by the mean score across KV heads) or ``shared`` (top-m_s of the mean
   score). ``auto`` = union on GQA, per-head on MHA (Appendix F).
3. Merge-target routing (Eq. 3): positional buckets of B tokens (by cache index j // B); an
   evicted token goes to the kept token of its bucket with the highest cumulative window
   attention a_i = Σ_{q∈W} A_{q,i} (per KV head: mean over its G query heads). The window
   queries are the only ones whose attention is materialized (Sec. 3.1), so "the attention
   it received" is a_i and every evicted token of a bucket shares that bucket's target.
   **Empty bucket** (no kept token in it; frequent, since selection clusters): the paper
   requires that every evicted token "must be assigned a merge target π(j) ∈ S" (Sec. 3.4),
   so by default it goes to the nearest kept token by position (the earlier one on a tie);
   the soft gate then decides whether it merges. ``empty_bucket: drop`` evicts it instead.
   ``routing: cosine`` routes to the kept token with the most similar value instead.
4. Soft cosine gate (Eq. 4), gated merge of values (Eq. 5), attention ratio R (Eq. 6): see
   :mod:`methods.merging`. Keys are not merged.
5. Compensation: ``logit_bias = α·log R_i`` on the kept positions at decode. R is averaged
   across KV heads when all heads keep the same set (union/shared), per head otherwise.
   ``layer`` keeps each layer's R; ``global`` averages R over layers slot by slot (the single
   "attention bias vector" of Algorithm 1): each layer first returns its own bias and
   :meth:`SelKV.finalize`, called by the engine once per sample after the last layer,
   rewrites them all (without that call ``global`` behaves as ``layer``). ``count`` is
   KeepKV's α·log(1 + M_i), M_i = evicted tokens merged (g > 0) into i (α = 1 is KeepKV).
6. RoPE repositioning (Eq. 7, off by default): kept keys are rotated back from their old
   positions and re-embedded at 0..m−1; decoding continues from position m.

Budget: m tokens per KV head including the recent window (``ctx.budget``, resolved by the
engine from ρ or a token count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import torch

from .base import CompressResult, ConfigError, LayerContext, Method, MethodConfig, gather_tokens, require
from .merging import attention_ratio, compensation_bias, gated_merge, merge_counts, soft_cosine_gate
from .scoring import group_scores, pool_scores, window_attention

@dataclass
class SelKVConfig(MethodConfig):
    """SelKV hyper-parameters (defaults: Appendix F).

    Attributes:
        window_size: W, observation-window queries (tokens) used for scores and weights.
        kernel_size: K, average-pooling width of the scores (odd; 1 disables pooling).
        recent_window: m_r, trailing tokens always kept (counted in the budget).
        bucket_size: B, positional bucket width for merge-target routing (tokens).
        alpha: α, compensation strength: bias α·log R.
        score: ``contribution`` (Eq. 1, attention × value norm) or ``attention`` (SnapKV's).
        selection: ``auto`` | ``per_head`` | ``union`` | ``shared``.
        routing: ``bucket`` (Eq. 3) or ``cosine`` (most similar kept value).
        empty_bucket: ``nearest`` (nearest kept token by position) or ``drop``.
        gate: ``soft`` (Eq. 4), ``none`` (g = 1, merge all) or ``off`` (g = 0, eviction only).
        compensation: ``global`` (R averaged over layers) | ``layer`` | ``count`` | ``off``.
        reposition: re-embed kept keys at contiguous positions (Eq. 7).
    """

    window_size: int = 32
    kernel_size: int = 5
    recent_window: int = 16
    bucket_size: int = 32
    alpha: float = 0.5
    score: Literal["contribution", "attention"] = "contribution"
    selection: Literal["auto", "per_head", "union", "shared"] = "auto"
    routing: Literal["bucket", "cosine"] = "bucket"
    empty_bucket: Literal["nearest", "drop"] = "nearest"
    gate: Literal["soft", "none", "off"] = "soft"
    compensation: Literal["global", "layer", "count", "off"] = "global"
    reposition: bool = False

    def check(self) -> None:
        for key, low in (("window_size", 1), ("bucket_size", 1), ("recent_window", 0)):
            require(getattr(self, key) >= low, key, getattr(self, key), f"must be an integer >= {low}")
        require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", self.kernel_size,
                "must be an odd integer >= 1")
        require(0 <= self.alpha < float("inf"), "alpha", self.alpha, "must be a finite number >= 0")


def window_statistics(ctx: LayerContext, score: str = "contribution", kernel_size: int = 5, value_norms=None):
    """Cumulative window attention and importance scores per KV head (Eq. 1).

    ``value_norms`` ``(B, H_kv, n)`` are ‖v_j‖₂ if the caller has them (computed otherwise).

    Returns:
        ``(a, c)``, both ``(B, H_kv, n)`` float32: a_j = Σ_{i∈W} A_{i,j} averaged over the GQA
        group (merge weights, routing), and c_j the pooled contribution score (selection):
        per query head Σ_i A_{h,i,j}·‖v_j‖₂ (or Σ_i A_{h,i,j} for ``score="attention"``),
        average-pooled with width K, then averaged over the group.
    """
    h_kv = ctx.layout.num_kv_heads
    attn = window_attention(ctx.window_queries, ctx.keys, ctx.scaling, ctx.softcap)  # (B, H_q, W, n)
    a_q = attn.sum(dim=2)  # (B, H_q, n)
    c_q = a_q
    if score == "contribution":
        if value_norms is None:
            value_norms = torch.linalg.vector_norm(ctx.values.float(), dim=-1)  # (B, H_kv, n)
        c_q = a_q * value_norms.repeat_interleave(a_q.shape[1] // h_kv, dim=1)
    c_q = pool_scores(c_q, kernel_size, "avg")
    return group_scores(a_q, h_kv, "mean"), group_scores(c_q, h_kv, "mean")


def select_tokens(scores: torch.Tensor, budget: int, recent: int, mode: str) -> torch.Tensor:
    """Kept positions (Eq. 2 and the union rule of Sec. 3.3).

    Args:
        scores: ``(B, H, n)`` per-KV-head scores.
        budget: m ≤ n, tokens kept per head including the recent window.
        recent: m_r, trailing tokens always kept (capped at m).
        mode: ``per_head``, ``union`` or ``shared``.

    Returns:
        ``(B, H, m)`` long positions sorted ascending; union/shared give every head the same set.
    """
    b, h, n = scores.shape
    recent = min(recent, budget)
    m_s = budget - recent
    prefix = scores[..., : n - recent].float()
    if mode == "per_head":
        top = prefix.topk(m_s, dim=-1).indices
    elif mode == "shared":
        top = prefix.mean(dim=1).topk(m_s, dim=-1).indices.unsqueeze(1).expand(b, h, m_s)
    else:  # union
        picked = torch.zeros_like(prefix, dtype=torch.bool)
        picked.scatter_(2, prefix.topk(m_s, dim=-1).indices, True)
        in_union = picked.any(dim=1)  # (B, n - recent), at least m_s per row
        mean = prefix.mean(dim=1).masked_fill(~in_union, float("-inf"))
        top = mean.topk(m_s, dim=-1).indices.unsqueeze(1).expand(b, h, m_s)  # trim by mean score
    tail = torch.arange(n - recent, n, device=scores.device).expand(b, h, recent)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values


def evicted_positions(kept: torch.Tensor, n: int) -> torch.Tensor:
    """Complement of ``kept`` ``(B, H, m)`` in 0..n−1: ``(B, H, n − m)`` long, ascending."""
    b, h, m = kept.shape
    mask = torch.ones(b, h, n, dtype=torch.bool, device=kept.device)
    mask.scatter_(2, kept, False)
    return mask.nonzero()[:, 2].view(b, h, n - m)


def bucket_targets(kept: torch.Tensor, evicted: torch.Tensor, a: torch.Tensor, bucket_size: int, empty: str = "nearest"):
    """Bucket-attention merge-target routing (Eq. 3).

    Args:
        kept: ``(B, H, m)`` kept positions, ascending.
        evicted: ``(B, H, E)`` evicted positions.
        a: ``(B, H, n)`` cumulative window attention.
        bucket_size: B; bucket of position j is j // B.
        empty: what an evicted token whose bucket holds no kept token gets: ``nearest`` (the
            nearest kept position, the earlier one on a tie) or ``drop`` (-1).

    Returns:
        ``(B, H, E)`` long target slots in [0, m) (index into ``kept``), -1 for none.
    """
    b, h, m = kept.shape
    n_buckets = a.shape[-1] // bucket_size + 1
    a_kept = a.gather(2, kept)
    kept_bucket = kept // bucket_size
    best = torch.full((b, h, n_buckets), float("-inf"), device=a.device)
    best.scatter_reduce_(2, kept_bucket, a_kept, "amax")
    slots = torch.arange(m, device=a.device).expand(b, h, m)
    is_best = a_kept == best.gather(2, kept_bucket)
    winner = torch.full((b, h, n_buckets), m, dtype=torch.long, device=a.device)
    winner.scatter_reduce_(2, kept_bucket, torch.where(is_best, slots, m), "amin")  # first best
    target = winner.gather(2, evicted // bucket_size)
    if empty == "drop":
        return torch.where(target == m, -1, target)
    right = torch.searchsorted(kept.contiguous(), evicted.contiguous()).clamp_max(m - 1)  # first kept position > j (if any)
    left = (right - 1).clamp_min(0)
    d_left = (evicted - kept.gather(2, left)).abs()
    d_right = (kept.gather(2, right) - evicted).abs()
    nearest = torch.where(d_left <= d_right, left, right)
    return torch.where(target == m, nearest, target)


def cosine_targets(kept_values: torch.Tensor, evicted_values: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Route each evicted token to the kept token with the most similar value (cosine).

    Args:
        kept_values: ``(B, H, m, d)``; evicted_values: ``(B, H, E, d)``.
        chunk: evicted tokens per matmul, bounding memory to ``B·H·chunk·m`` floats.

    Returns:
        ``(B, H, E)`` long target slots.
    """
    k = torch.nn.functional.normalize(kept_values.float(), dim=-1)
    e = torch.nn.functional.normalize(evicted_values.float(), dim=-1)
    parts = [torch.matmul(e[:, :, s : s + chunk], k.transpose(-1, -2)).argmax(-1) for s in range(0, e.shape[2], chunk)]
    return torch.cat(parts, dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def reposition_keys(keys: torch.Tensor, old_positions: torch.Tensor, rotary) -> torch.Tensor:
    """RoPE repositioning (Eq. 7): k̃ = RoPE(RoPE⁻¹(k, p_old), p_new), p_new = 0..m−1.

    Uses the ``x·cos + rotate_half(x)·sin`` convention of the tables ``rotary(pos) -> (cos,
    sin)``; the inverse divides by cos² + sin², so tables scaled by an attention factor (YaRN)
    are inverted exactly too.

    Args:
        keys: ``(B, H, m, d)`` kept keys after RoPE at ``old_positions``.
        old_positions: ``(B, H, m)`` long RoPE positions of the kept keys.
        rotary: callable ``positions (k,) -> (cos, sin)``, each ``(k, d)``.

    Returns:
        ``(B, H, m, d)`` keys in ``keys.dtype``.
    """
    b, h, m, d = keys.shape
    cos_o, sin_o = (t.float().view(b, h, m, d) for t in rotary(old_positions.reshape(-1)))
    cos_n, sin_n = (t.float() for t in rotary(torch.arange(m, device=keys.device)))
    k = keys.float()
    raw = (k * cos_o - _rotate_half(k) * sin_o) / (cos_o * cos_o + sin_o * sin_o)
    return (raw * cos_n + _rotate_half(raw) * sin_n).to(keys.dtype)


class SelKV(Method):
    """SelKV: contribution-score selection, bucket routing, soft-gated merge, attention compensation."""

    Config = SelKVConfig

    def min_budget(self) -> int:
        """What SelKV always keeps: the recent window m_r (the observation window is not kept)."""
        return max(self.config.recent_window, 1)

    def check_layout(self, layout) -> None:
        """Every selection works on MHA and GQA. Repositioning needs every layer compressed.

        Raises:
            ConfigError: ``reposition`` on a model with layers that are not compressed
                (the sliding-window layers of Gemma 2/3 keep positions up to n − 1 while
                decoding would continue at m for all layers).
        """
        skipped = layout.num_layers - len(layout.compressible_layers)
        if self.config.reposition and layout.compressible_layers and skipped > 0:
            raise ConfigError(
                f"method.reposition=true: not supported on this model ({skipped} of {layout.num_layers} layers "
                "are sliding-window layers that are not compressed); use method.reposition=false"
            )

    def selection_mode(self, layout) -> str:
        """``auto`` resolved: ``union`` on GQA layouts, ``per_head`` on MHA (Appendix F)."""
        if self.config.selection != "auto":
            return self.config.selection
        return "union" if layout.is_gqa else "per_head"

    def compress(self, ctx: LayerContext) -> CompressResult:
        """Compress one layer; see the module docstring for the pipeline.

        Raises:
            ConfigError: ``reposition`` is on and the engine provides no RoPE tables.
        """
        c = self.config
        b, h, n, d = ctx.keys.shape
        m = min(int(ctx.budget), n)
        mode = self.selection_mode(ctx.layout)
        v_norm = torch.linalg.vector_norm(ctx.values.float(), dim=-1)  # (B, H_kv, n), Eq. 1 and Eq. 4
        a, scores = window_statistics(ctx, c.score, c.kernel_size, v_norm)
        kept = select_tokens(scores, m, c.recent_window, mode)  # (B, H_kv, m)
        keys, values = gather_tokens(ctx.keys, kept), gather_tokens(ctx.values, kept)
        n_evicted = b * h * (n - m)
        stats = {"kept": float(b * h * m), "merged": 0.0, "dropped": float(n_evicted), "gate_sum": 0.0}
        ratio = torch.ones(b, h, m, device=ctx.keys.device)
        if c.gate != "off" and n > m:
            evicted = evicted_positions(kept, n)
            ev_values = gather_tokens(ctx.values, evicted)
            if c.routing == "bucket":
                targets = bucket_targets(kept, evicted, a, c.bucket_size, c.empty_bucket)
                occupied = torch.zeros(b, h, n // c.bucket_size + 1, dtype=torch.bool, device=a.device)
                occupied.scatter_(2, kept // c.bucket_size, True)
                stats["empty_bucket"] = float((~occupied.gather(2, evicted // c.bucket_size)).sum())
            else:
                targets = cosine_targets(values, ev_values)
            if c.gate == "soft":
                slot = targets.clamp_min(0)
                gate = soft_cosine_gate(
                    ev_values, gather_tokens(values, slot), v_norm.gather(2, evicted), v_norm.gather(2, kept).gather(2, slot)
                )
            else:
                gate = torch.ones(targets.shape, device=a.device)
            gate = torch.where(targets >= 0, gate, 0.0)
            a_kept = a.gather(2, kept)
            values, absorbed = gated_merge(values, a_kept, ev_values, gate * a.gather(2, evicted), targets)
            merged = gate > 0
            n_merged, gate_sum = torch.stack([merged.sum().float(), gate.sum()]).tolist()  # one host sync
            stats.update(merged=n_merged, dropped=n_evicted - n_merged, gate_sum=gate_sum)
            if c.compensation == "count":
                ratio = 1.0 + merge_counts(targets, merged, m)
            else:
                ratio = attention_ratio(a_kept, absorbed)
        bias = None
        if c.compensation != "off":
            bias = compensation_bias(ratio, c.alpha, shared_heads=mode != "per_head")
        next_position = None
        if c.reposition:
            if ctx.rotary is None:
                raise ConfigError("method.reposition=true: the model provides no RoPE tables (ctx.rotary is None)")
            positions = ctx.positions if ctx.positions is not None else torch.arange(n, device=kept.device)
            keys = reposition_keys(keys, positions[kept], ctx.rotary)
            next_position = m
        return CompressResult(
            keys=keys, values=values, logit_bias=bias, kept_indices=kept, next_position=next_position, stats=stats
        )

    def finalize(self, results: Mapping[int, CompressResult] | Sequence[CompressResult | None]) -> None:
        """``compensation: global``: replace each layer's bias by α·log of R averaged over layers.

        Called by the engine once per sample after every layer is compressed, with
        ``{layer index: result}`` (or a sequence, ``None`` for skipped layers). R_ℓ is recovered
        from each layer's bias (R = exp(bias/α)), averaged slot by slot over the layers whose
        bias has the same shape, and written back to every one of them (not for the other modes
        or α = 0). Idempotent. Every mode: the lowest and highest per-layer fraction of evicted
        tokens whose bucket keeps nothing (``empty_frac_min``/``_max``) go into the first layer's
        stats only, so the engine's sum over layers records them as they are.
        """
        rs = [r for r in (results.values() if isinstance(results, Mapping) else results) if r is not None]
        fracs = [r.stats["empty_bucket"] / (r.stats["merged"] + r.stats["dropped"]) for r in rs if "empty_bucket" in r.stats]
        if fracs:
            rs[0].stats.update(empty_frac_min=min(fracs), empty_frac_max=max(fracs))
        if self.config.compensation != "global" or self.config.alpha == 0:
            return
        alpha = float(self.config.alpha)
        groups: dict[tuple, list[CompressResult]] = {}
        for r in rs:
            if r.logit_bias is not None:
                groups.setdefault(tuple(r.logit_bias.shape), []).append(r)
        for members in groups.values():
            mean_ratio = torch.stack([torch.exp(r.logit_bias.float() / alpha) for r in members]).mean(dim=0)
            bias = alpha * torch.log(mean_ratio)
            for r in members:
                r.logit_bias = bias.clone()
