"""Merge primitives shared by merging methods: soft cosine gate, gated merge, attention ratio.

These are the method-independent parts of SelKV ("Selective KV Cache Merging with Per-Token
Merge-or-Drop and Attention Compensation", Sec. 3.5-3.6). They take tensors already routed
(every evicted token has a merge-target slot) so that other merging methods can use them as
plug-ins; the SelKV paper adds the gate to LOOK-M (Sec. 4.3) with :func:`soft_cosine_gate`.

Shapes: B batch, H heads (KV heads), m kept slots, E evicted tokens, d head dim. All
arithmetic is float32 whatever the input dtype; merged values are cast back to it.
"""

from __future__ import annotations

import torch


# Floor on cumulative attention before dividing by it: a kept token whose window attention
# underflowed to 0 in float32 then gets a large but finite ratio instead of inf/nan.
_TINY = torch.finfo(torch.float32).tiny


def soft_cosine_gate(
    evicted_values: torch.Tensor,
    target_values: torch.Tensor,
    evicted_norms: torch.Tensor | None = None,
    target_norms: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Soft cosine gate (SelKV Eq. 4): g_j = max(cos(v_j, v_π(j)), 0).

    Usable as a plug-in by any merging method: pass each evicted token's value and the
    (pre-merge) value of the kept token it is merged into.

    Args:
        evicted_values: ``(..., E, d)`` values of the evicted tokens.
        target_values: ``(..., E, d)`` values of their merge targets, same shape.
        evicted_norms, target_norms: optional ``(..., E)`` L2 norms of the two, when the
            caller already has them (SelKV computes every value norm for Eq. 1).
        eps: floor on the product of norms (a zero vector gets g = 0).

    Returns:
        ``(..., E)`` float32 gate in [0, 1]: 0 drops the token, 1 merges it fully.
    """
    ev, tg = evicted_values.float(), target_values.float()
    if evicted_norms is None:
        evicted_norms = torch.linalg.vector_norm(ev, dim=-1)
    if target_norms is None:
        target_norms = torch.linalg.vector_norm(tg, dim=-1)
    dot = torch.linalg.vecdot(ev, tg)
    return (dot / (evicted_norms.float() * target_norms.float()).clamp_min(eps)).clamp_(0.0, 1.0)


def gated_merge(
    kept_values: torch.Tensor,
    kept_weights: torch.Tensor,
    evicted_values: torch.Tensor,
    evicted_weights: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated attention-weighted merge (SelKV Eq. 5), vectorized with ``index_add_``.

    ṽ_i = (a_i v_i + Σ_{j→i} g_j a_j v_j) / (a_i + Σ_{j→i} g_j a_j), with w_j = g_j a_j given.
    A kept token that absorbed nothing (Σ_{j→i} w_j = 0) keeps v_i bit for bit, so w ≡ 0 (gate
    off) is exactly eviction; g ≡ 1 is plain attention-weighted merging.

    Args:
        kept_values: ``(B, H, m, d)`` values of the kept tokens (merge targets).
        kept_weights: ``(B, H, m)`` a_i ≥ 0, cumulative window attention of the kept tokens.
        evicted_values: ``(B, H, E, d)`` values of the evicted tokens.
        evicted_weights: ``(B, H, E)`` w_j = g_j · a_j ≥ 0.
        targets: ``(B, H, E)`` long, merge-target slot in [0, m) of each evicted token, or -1
            for a token with no target (dropped whatever its weight).

    Returns:
        ``(merged, absorbed)``: merged values ``(B, H, m, d)`` in ``kept_values.dtype`` and
        absorbed attention Σ_{j→i} w_j ``(B, H, m)`` float32 (the numerator term of Eq. 6).
    """
    b, h, m, d = kept_values.shape
    w = torch.where(targets >= 0, evicted_weights.float(), torch.zeros((), device=targets.device))
    # flat slot index over (B, H, m) so one index_add_ serves every head
    flat = (targets.clamp_min(0) + torch.arange(b * h, device=targets.device).view(b, h, 1) * m).reshape(-1)
    weighted = (w.unsqueeze(-1) * evicted_values.float()).reshape(-1, d)
    numerator = torch.zeros(b * h * m, d, device=kept_values.device).index_add_(0, flat, weighted).view(b, h, m, d)
    absorbed = torch.zeros(b * h * m, device=kept_values.device).index_add_(0, flat, w.reshape(-1)).view(b, h, m)
    a = kept_weights.float()
    v_kept = kept_values.float()
    merged = (a.unsqueeze(-1) * v_kept + numerator) / (a + absorbed).clamp_min(_TINY).unsqueeze(-1)
    merged = torch.where((absorbed > 0).unsqueeze(-1), merged.to(kept_values.dtype), kept_values)
    return merged, absorbed


def attention_ratio(kept_weights: torch.Tensor, absorbed: torch.Tensor) -> torch.Tensor:
    """Attention ratio of each kept position (SelKV Eq. 6).

    R_i = (a_i + Σ_{j→i} g_j a_j) / a_i, computed as 1 + absorbed_i / a_i so that a position
    that absorbed nothing gets exactly 1 (no bias).

    Args:
        kept_weights: ``(B, H, m)`` a_i, cumulative window attention of the kept tokens.
        absorbed: ``(B, H, m)`` Σ_{j→i} g_j a_j from :func:`gated_merge`.

    Returns:
        ``(B, H, m)`` float32, R ≥ 1.
    """
    return 1.0 + absorbed.float() / kept_weights.float().clamp_min(_TINY)


def merge_counts(targets: torch.Tensor, merged: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Merge count M_i: how many evicted tokens were merged (gate > 0) into each kept slot.

    KeepKV's count compensation adds log(1 + M_i); SelKV Sec. 3.6 compares against it.

    Args:
        targets: ``(B, H, E)`` long target slots, -1 for none.
        merged: ``(B, H, E)`` bool, whether the token was merged (g > 0 and a target).
        num_slots: m.

    Returns:
        ``(B, H, m)`` float32 counts.
    """
    hit = (merged & (targets >= 0)).float()
    out = torch.zeros(*targets.shape[:-1], num_slots, dtype=torch.float32, device=targets.device)
    return out.scatter_add_(2, targets.clamp_min(0), hit)


def compensation_bias(ratio: torch.Tensor, alpha: float, shared_heads: bool) -> torch.Tensor:
    """Decode-time logit bias α · log R_i (SelKV Sec. 3.6).

    Args:
        ratio: ``(B, H, m)`` R per head and kept slot (Eq. 6), or 1 + M_i for KeepKV.
        alpha: compensation strength α ≥ 0.
        shared_heads: True when every head keeps the same token set (GQA union / shared
            selection): R is averaged across heads before the log, as the paper states;
            False (per-head selection): the bias is per head.

    Returns:
        ``(B, H, m)`` float32 bias (rows identical when ``shared_heads``).
    """
    r = ratio.float()
    if shared_heads:
        r = r.mean(dim=1, keepdim=True).expand_as(ratio)
    return (alpha * torch.log(r)).contiguous()
