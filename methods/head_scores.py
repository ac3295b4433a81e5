"""Per-step head scores of the retrieval-head detection protocol, and the layer error of Eq. 2–4.

Pure tensor functions used by ``python -m methods.calibrate``. Each decoding step t of a
needle-in-a-haystack prompt gives, per layer, the attention row of the step's query over all
cached positions, ``attn (L, H_q, n)`` (softmax probabilities, float32), the generated token
y_t and the needle span [start, end) located in the prompt. The scores below add one step's
contribution; the calibration sums them over the steps of a sample and keeps a sample's sums
only if the model's answer is right (ROUGE-1 recall / QA-F1 > 50, as the reference scripts).

* :func:`trh_step_scores`: traditional retrieval heads (Wu et al. 2025; HeadKV
  ``retrieval_heads``): a head whose top-1 attended position lies in the span and holds the
  token being generated gets ``1 / span length``.
* :func:`srh_step_scores`: Semantic Retrieval Heads, CompressKV Eq. 1: if y_t is a token of
  the span, every head gets its attention mass over the whole span.
* :func:`r2_step_scores`: HeadKV retrieval-reasoning heads: each of a head's top-k attended
  positions (k = span length) that lies in the span adds ``attention / span length``,
  whatever the generated token.
"""

from __future__ import annotations

import re
import string
from collections import Counter

import torch

__all__ = [
    "find_span",
    "trh_step_scores",
    "srh_step_scores",
    "r2_step_scores",
    "relative_output_error",
    "qa_f1",
]


def find_span(prompt_ids: list[int], needle_ids: list[int]) -> tuple[int, int]:
    """Locate the needle in the tokenised prompt: the window of ``len(needle_ids)`` tokens whose
    set of ids overlaps most with the needle's (first best window; HeadKV's ``find_needle_idx``).

    Tokenisation at the needle's borders can differ from the needle tokenised alone, hence the
    set-overlap search rather than an exact match.

    Args:
        prompt_ids: prompt token ids.
        needle_ids: the answer span's token ids (tokenised without special tokens).

    Returns:
        ``(start, end)`` with ``end − start == len(needle_ids)``.

    Raises:
        ValueError: the needle is longer than the prompt or shares no token with it.
    """
    span = len(needle_ids)
    if span == 0 or span > len(prompt_ids):
        raise ValueError("needle is empty or longer than the prompt")
    target = set(needle_ids)
    best, best_start = -1.0, 0
    for i in range(len(prompt_ids) - span + 1):  # offline, once per sample
        overlap = len(target.intersection(prompt_ids[i : i + span])) / len(target)
        if overlap > best:
            best, best_start = overlap, i
    if best <= 0:
        raise ValueError("the needle shares no token with the prompt")
    return best_start, best_start + span


def _check(attn: torch.Tensor, start: int, end: int) -> None:
    if attn.dim() != 3 or not (0 <= start < end <= attn.shape[-1]):
        raise ValueError(f"attn must be (L, H, n) and 0 <= start < end <= n; got {tuple(attn.shape)}, [{start}, {end})")


def trh_step_scores(attn: torch.Tensor, prompt_ids: torch.Tensor, start: int, end: int, token: int) -> torch.Tensor:
    """Traditional (top-1, copy-paste) retrieval-head score of one decoding step.

    Args:
        attn: ``(L, H, n)`` attention of the step's query over the n cached positions.
        prompt_ids: ``(p,)`` long, token ids of the prompt positions (p ≥ end).
        start, end: needle span [start, end) in prompt positions.
        token: y_t, the token generated at this step.

    Returns:
        ``(L, H)`` float32: ``1/(end−start)`` where argmax attention ∈ span and holds ``token``.
    """
    _check(attn, start, end)
    top = attn.argmax(dim=-1)  # (L, H)
    in_span = (top >= start) & (top < end)
    copied = prompt_ids.to(top.device)[top.clamp(max=prompt_ids.numel() - 1)] == token
    return (in_span & copied).float() / (end - start)


def srh_step_scores(attn: torch.Tensor, prompt_ids: torch.Tensor, start: int, end: int, token: int) -> torch.Tensor:
    """Semantic Retrieval Head score of one decoding step (CompressKV Eq. 1).

    ``1{y_t ∈ A} · Σ_{j ∈ A} a_{t,j}^{(h)}`` with A = the answer span [start, end). (The reference
    script adds the mass once per span position holding y_t; Eq. 1 adds it once.)

    Args:
        attn: ``(L, H, n)``.
        prompt_ids: ``(p,)`` prompt token ids (p ≥ end).
        start, end: answer span.
        token: y_t.

    Returns:
        ``(L, H)`` float32.
    """
    _check(attn, start, end)
    if not bool((prompt_ids[start:end] == token).any()):
        return attn.new_zeros(attn.shape[:2], dtype=torch.float32)
    return attn[..., start:end].float().sum(dim=-1)


def r2_step_scores(attn: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """HeadKV retrieval-reasoning head score of one decoding step.

    Each head's top-k positions (k = end − start) that fall inside the span add their attention
    weight divided by k (HeadKV ``retrieval_head_detection_r2.py``).

    Args:
        attn: ``(L, H, n)``.
        start, end: the needle's answer span.

    Returns:
        ``(L, H)`` float32.
    """
    _check(attn, start, end)
    k = min(end - start, attn.shape[-1])
    values, idx = attn.float().topk(k, dim=-1)  # (L, H, k)
    inside = (idx >= start) & (idx < end)
    return (values * inside).sum(dim=-1) / (end - start)


def relative_output_error(full: torch.Tensor, compressed: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One decoding step's term of Eq. 4: ``‖O_full − O_comp‖_F / (‖O_full‖_F + ε)``.

    Args:
        full: ``(..., D)`` attention-block output (after W_O) with the full cache.
        compressed: same shape, with the compressed cache.
        eps: ε of Eq. 4.

    Returns:
        A scalar float32 tensor.
    """
    full = full.float()
    return torch.linalg.vector_norm(full - compressed.float()) / (torch.linalg.vector_norm(full) + eps)


def _normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1(prediction: str, truth: str) -> float:
    """Token-level F1 after SQuAD normalisation (HeadKV R2's success criterion, in [0, 1])."""
    pred, gold = _normalize_answer(prediction).split(), _normalize_answer(truth).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
