"""Per-step head scores of the retrieval-head detection protocol, and the layer error of Eq. 4.

Each decoding step t of a needle-in-a-haystack prompt gives the attention row of the step's query
over the n cached positions, ``attn (L, H_q, n)`` (probabilities, float32), the generated token
y_t and the needle span [start, end). ``python -m methods.calibrate`` sums a sample's steps and
keeps the sums only if the answer is right.

* :func:`trh_step_scores`: traditional retrieval heads (Wu et al. 2025; HeadKV): a head whose
  top-1 position lies in the span and holds y_t gets ``1 / span length``.
* :func:`srh_step_scores`: Semantic Retrieval Heads, CompressKV Eq. 1: if y_t is in the span,
  every head gets its attention mass over the span (the reference adds it once per span position
  holding y_t; Eq. 1 once).
* :func:`r2_step_scores`: HeadKV retrieval-reasoning heads: each of a head's top-k positions
  (k = span length) inside the span adds ``attention / k``, whatever y_t.
"""

from __future__ import annotations

import torch


def find_span(prompt_ids: list[int], needle_ids: list[int]) -> tuple[int, int]:
    """``(start, end)``, ``end − start == len(needle_ids)``: the first prompt window whose token set
    overlaps most with the needle's (HeadKV's ``find_needle_idx``; border tokens may merge).

    Raises:
        ValueError: the needle is empty, longer than the prompt or shares no token with it.
    """
    span, target = len(needle_ids), set(needle_ids)
    if span == 0 or span > len(prompt_ids):
        raise ValueError("needle is empty or longer than the prompt")
    overlaps = [len(target.intersection(prompt_ids[i : i + span])) for i in range(len(prompt_ids) - span + 1)]
    best = max(range(len(overlaps)), key=overlaps.__getitem__)  # the first best window
    if overlaps[best] == 0:
        raise ValueError("the needle shares no token with the prompt")
    return best, best + span


def _check(attn: torch.Tensor, start: int, end: int) -> None:
    if attn.dim() != 3 or not (0 <= start < end <= attn.shape[-1]):
        raise ValueError(f"attn must be (L, H, n) and 0 <= start < end <= n; got {tuple(attn.shape)}, [{start}, {end})")


def trh_step_scores(attn: torch.Tensor, prompt_ids: torch.Tensor, start: int, end: int, token: int) -> torch.Tensor:
    """Top-1 copy score of one step: ``(L, H)`` float32, ``1/(end−start)`` where the argmax of
    ``attn (L, H, n)`` is in [start, end) and ``prompt_ids (p,)`` holds ``token`` there."""
    _check(attn, start, end)
    top = attn.argmax(dim=-1)  # (L, H)
    copied = prompt_ids.to(top.device)[top.clamp(max=prompt_ids.numel() - 1)] == token
    return ((top >= start) & (top < end) & copied).float() / (end - start)


def srh_step_scores(attn: torch.Tensor, prompt_ids: torch.Tensor, start: int, end: int, token: int) -> torch.Tensor:
    """CompressKV Eq. 1 for one step: ``1{y_t ∈ A} · Σ_{j ∈ A} a_{t,j}``, ``(L, H)`` float32."""
    _check(attn, start, end)
    if not bool((prompt_ids[start:end] == token).any()):
        return attn.new_zeros(attn.shape[:2], dtype=torch.float32)
    return attn[..., start:end].float().sum(dim=-1)


def r2_step_scores(attn: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """HeadKV R2 score of one step (``retrieval_head_detection_r2.py``), ``(L, H)`` float32."""
    _check(attn, start, end)
    values, idx = attn.float().topk(min(end - start, attn.shape[-1]), dim=-1)  # (L, H, k)
    return (values * ((idx >= start) & (idx < end))).sum(dim=-1) / (end - start)


def relative_output_error(full: torch.Tensor, compressed: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One step's term of CompressKV Eq. 4, ``‖O_full − O_comp‖_F / (‖O_full‖_F + ε)``: a float32
    scalar from two ``(..., D)`` attention-block outputs (after W_O)."""
    full = full.float()
    return torch.linalg.vector_norm(full - compressed.float()) / (torch.linalg.vector_norm(full) + eps)
