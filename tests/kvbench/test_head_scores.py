"""Per-step retrieval-head scores (TRH, SRH Eq. 1, HeadKV R2) on hand-made attention patterns."""

from __future__ import annotations

import pytest
import torch

from eval.metrics import qa_f1_score as qa_f1
from kvbench.tools.calibrate import find_span, r2_step_scores, relative_output_error, srh_step_scores, trh_step_scores

# 1 layer x 3 heads over n = 6 positions; answer span = positions [2, 4) holding tokens 7, 8
PROMPT = torch.tensor([5, 6, 7, 8, 9, 10])
ATTN = torch.tensor([[
    [0.05, 0.05, 0.60, 0.20, 0.05, 0.05],  # head 0: top-1 on position 2 (token 7)
    [0.10, 0.10, 0.20, 0.30, 0.25, 0.05],  # head 1: top-1 on position 3 (token 8)
    [0.40, 0.10, 0.15, 0.15, 0.10, 0.10],  # head 2: top-1 outside the span
]])


def test_srh_adds_span_mass_when_token_in_span():
    s = srh_step_scores(ATTN, PROMPT, 2, 4, token=7)
    assert s[0].tolist() == pytest.approx([0.80, 0.50, 0.30])
    assert srh_step_scores(ATTN, PROMPT, 2, 4, token=8)[0].tolist() == pytest.approx([0.80, 0.50, 0.30])
    assert srh_step_scores(ATTN, PROMPT, 2, 4, token=99).tolist() == [[0.0, 0.0, 0.0]]
    assert srh_step_scores(ATTN, PROMPT, 2, 4, token=5).tolist() == [[0.0, 0.0, 0.0]]  # token outside the span


def test_trh_top1_copy_rule():
    # generating token 7: only head 0 looks (top-1) at the position holding 7 -> 1 / span length
    assert trh_step_scores(ATTN, PROMPT, 2, 4, token=7).tolist() == [[0.5, 0.0, 0.0]]
    # generating token 8: head 1 looks at position 3 holding 8
    assert trh_step_scores(ATTN, PROMPT, 2, 4, token=8).tolist() == [[0.0, 0.5, 0.0]]
    # head 2's top-1 is position 0 (token 5), outside the span: never credited
    assert trh_step_scores(ATTN, PROMPT, 2, 4, token=5).tolist() == [[0.0, 0.0, 0.0]]


def test_r2_topk_in_span():
    # k = 2: head 0 top-2 = positions 2 (0.6), 3 (0.2) both in span -> 0.8 / 2
    # head 1 top-2 = 3 (0.3), 4 (0.25) -> only 0.3 counts -> 0.15
    # head 2 top-2 = 0 (0.4), then 2 or 3 (0.15, a tie) -> 0.15 / 2
    assert r2_step_scores(ATTN, 2, 4)[0].tolist() == pytest.approx([0.4, 0.15, 0.075])


def test_step_scores_validate_span():
    with pytest.raises(ValueError):
        srh_step_scores(ATTN, PROMPT, 4, 4, token=7)
    with pytest.raises(ValueError):
        trh_step_scores(ATTN[0], PROMPT, 2, 4, token=7)


def test_find_span_tolerates_border_tokens():
    prompt = [1, 2, 3, 40, 11, 12, 13, 14, 5, 6]
    needle = [10, 11, 12, 13, 14]  # first token merged differently in the prompt
    assert find_span(prompt, needle) == (3, 8)
    assert find_span([7, 1, 7, 1], [7, 2]) == (0, 2)  # the first of equally good windows
    with pytest.raises(ValueError):
        find_span([1, 2], [3])


def test_relative_output_error_hand_computed():
    full, comp = torch.tensor([[3.0, 4.0]]), torch.tensor([[3.0, 0.0]])
    assert relative_output_error(full, comp, eps=0.0).item() == pytest.approx(0.8)
    assert relative_output_error(full, full).item() == 0.0


def test_qa_f1_of_r2_answers():  # HeadKV R2's success criterion is LongBench's QA-F1
    assert qa_f1("The cat sat.", "a cat sat") == 1.0
    assert qa_f1("cat", "cat sat") == pytest.approx(2 / 3)
    assert qa_f1("dog", "cat") == 0.0
