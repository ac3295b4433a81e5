"""Per-head variable-length KV storage: pack kept tokens, pad to the longest head, mask.

Head-wise methods (AdaKV, HeadKV, CompressKV compositions) keep a different number of tokens
in each KV head of a layer. The cache stores, per head, only that head's kept rows, padded to
the layer's longest head m_max; a validity mask marks the padded slots, which the engine's
decode attention never attends (−inf logit). Memory falls from n to m_max rows per head:
the saving is real, the padding is the price of a rectangular tensor.

Statistics (summed over layers by the engine): ``kept_tokens`` = valid slots (logical kept
tokens, all heads), ``stored_tokens`` = stored slots (m_max per head, all heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import gather_tokens


@dataclass
class PackedKV:
    """Kept tokens of one layer, packed per head.

    Attributes:
        keys: ``(B, H_kv, m_max, d)``.
        values: ``(B, H_kv, m_max, d)``.
        valid: ``(B, H_kv, m_max)`` bool; False marks padding (never attended).
        indices: ``(B, H_kv, m_max)`` long original positions; valid slots ascending, padded
            slots hold the positions of arbitrary evicted rows (their content is never used).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    indices: torch.Tensor


def pack_kept(keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> PackedKV:
    """Gather each head's kept tokens (original order) and pad to the layer's longest head.

    Args:
        keys: ``(B, H_kv, n, d)``.
        values: ``(B, H_kv, n, d)``.
        keep: ``(B, H_kv, n)`` bool, the kept token set of each head (sizes may differ).

    Returns:
        A :class:`PackedKV` with m_max = the largest per-head count (≥ 1 unless nothing is kept).
    """
    counts = keep.sum(-1)  # (B, H)
    m_max = int(counts.max()) if counts.numel() else 0
    # stable sort on "evicted" puts each head's kept positions first, in ascending order
    # (a copy: the indices outlive compression in the result, a view would hold all n of them)
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :m_max].clone()
    valid = torch.arange(m_max, device=keep.device) < counts.unsqueeze(-1)
    return PackedKV(gather_tokens(keys, order), gather_tokens(values, order), valid, order)


def packing_stats(valid: torch.Tensor) -> dict[str, float]:
    """``kept_tokens`` (valid slots) and ``stored_tokens`` (all slots) of one layer, all heads.

    Args:
        valid: ``(B, H_kv, m_max)`` bool.
    """
    return {"kept_tokens": float(valid.sum()), "stored_tokens": float(valid.numel())}
