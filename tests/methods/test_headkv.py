"""HeadKV: head capacities from hand-made score files, per-head variable-length selection."""

from __future__ import annotations

import json

import pytest
import torch

from methods.base import ConfigError, HeadLayout, LayerContext
from methods.headkv import HeadKV, HeadKVConfig, headkv_head_budgets, kv_head_scores
from methods.snapkv import SnapKVConfig, snapkv_scores
from methods.base import check_budget


def _score_file(tmp_path, scores: dict) -> str:
    p = tmp_path / "heads.json"
    p.write_text(json.dumps(scores))
    return str(p)


# means: [[2, 0], [1, 5]] -> normalised [[.25, 0], [.125, .625]]
HAND = {"0-0": [1, 3], "0-1": [0, 0], "1-0": [1], "1-1": [5]}


def test_capacities_hand_computed(tmp_path):
    layout = HeadLayout(2, 2, 2, 4, (0, 1), "hand")
    m = HeadKV(HeadKVConfig(head_scores_path=_score_file(tmp_path, HAND), beta=2.0, window_size=8), layout)
    # b = 40 - 8 = 32; b // 2 = 16: floor 16, pool 16 * 4 = 64
    # caps = 64 * [.25, 0, .125, .625] + 16 = [32, 16, 24, 56]; + window 8
    plan = m.plan(1000, check_budget(40), layout)
    assert plan.head_budgets.tolist() == [[40, 24], [32, 64]]
    assert plan.layer_budgets == [40, 64]
    assert plan.compress
    assert int(plan.head_budgets.sum()) == 4 * 40  # no rounding here: total preserved


def test_capacities_temperature_and_float_beta():
    s = torch.tensor([[2.0, 0.0], [1.0, 5.0]], dtype=torch.float64)
    # temp 2: s^2 / sum = [.0625, 0, .015625, .390625] / .46875 = [2/15, 0, 1/30, 5/6]
    # pool 64, floor 16: [24.53, 16, 18.13, 69.33] -> round
    assert headkv_head_budgets(s, 32, 2.0, 2.0).tolist() == [[25, 16], [18, 69]]
    # b = 10, beta = 1.5: 10 // 1.5 = 6.0 (pool per head), floor 4.0; pool 24
    # caps = 24 * [.25, 0, .125, .625] + 4 = [10, 4, 7, 19]
    assert headkv_head_budgets(s, 10, 1.5, 1.0).tolist() == [[10, 4], [7, 19]]


def test_round_half_even_case():
    # b = 5, beta = 2: 5 // 2 = 2.0, floor 3.0, pool 2 * 4 = 8; shares [.0625, .0625, .4375, .4375]
    # -> 0.5 + 3 = 3.5 -> 4 (even), 3.5 + 3 = 6.5 -> 6 (even)
    s = torch.tensor([[1.0, 1.0], [7.0, 7.0]], dtype=torch.float64)
    assert headkv_head_budgets(s, 5, 2.0, 1.0).tolist() == [[4, 4], [6, 6]]


def test_gqa_scores_mean_of_group():
    q = torch.tensor([[1.0, 3.0, 0.0, 0.0], [1.0, 1.0, 4.0, 6.0]], dtype=torch.float64)
    assert kv_head_scores(q, 2, "mean").tolist() == [[2.0, 0.0], [1.0, 5.0]]
    assert kv_head_scores(q, 2, "max").tolist() == [[3.0, 0.0], [1.0, 6.0]]


def test_gqa_plan_matches_hand_values(tmp_path):
    q = {"0-0": [1], "0-1": [3], "0-2": [0], "0-3": [0], "1-0": [1], "1-1": [1], "1-2": [4], "1-3": [6]}
    layout = HeadLayout(2, 4, 2, 4, (0, 1), "hand")
    m = HeadKV(HeadKVConfig(head_scores_path=_score_file(tmp_path, q), beta=2.0, window_size=8), layout)
    assert m.plan(1000, check_budget(40), layout).head_budgets.tolist() == [[40, 24], [32, 64]]


def test_plan_caps_and_no_compression(tmp_path):
    layout = HeadLayout(2, 2, 2, 4, (0, 1), "hand")
    m = HeadKV(HeadKVConfig(head_scores_path=_score_file(tmp_path, HAND), beta=2.0, window_size=8), layout)
    plan = m.plan(50, check_budget(40), layout)  # head (1,1) would keep 64 > 50 tokens: capped at n
    assert plan.head_budgets.tolist() == [[40, 24], [32, 50]]
    assert not m.plan(30, check_budget(40), layout).compress


def test_compress_keeps_window_and_head_budgets(tmp_path):
    torch.manual_seed(0)
    layout = HeadLayout(2, 4, 2, 8, (0, 1), "hand")
    q = {f"{l}-{h}": [float(l * 4 + h + 1)] for l in range(2) for h in range(4)}
    m = HeadKV(HeadKVConfig(head_scores_path=_score_file(tmp_path, q), beta=1.5, window_size=4, kernel_size=3), layout)
    n = 40
    plan = m.plan(n, check_budget(12), layout)
    keys, values = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    ctx = LayerContext(layer_idx=1, layout=layout, keys=keys, values=values, window_queries=torch.randn(1, 4, 4, 8),
                       scaling=8 ** -0.5, budget=plan.layer_budgets[1], head_budget=plan.head_budgets[1])
    res = m.compress(ctx)
    hb = plan.head_budgets[1].tolist()
    assert res.keys.shape == (1, 2, max(hb), 8)  # padded to the longest head
    assert res.valid.sum(-1)[0].tolist() == hb
    assert res.stats == {"kept_tokens": float(sum(hb)), "stored_tokens": float(2 * max(hb))}
    expected = snapkv_scores(ctx, SnapKVConfig(window_size=4, kernel_size=3, pooling="max"))
    for h in range(2):
        kept = res.kept_indices[0, h][res.valid[0, h]]
        assert set(range(n - 4, n)) <= set(kept.tolist())  # the window, always
        top = expected[0, h].topk(hb[h]).indices
        assert sorted(kept.tolist()) == sorted(top.tolist())
        assert torch.equal(res.keys[0, h][res.valid[0, h]], keys[0, h, kept])


def test_config_errors(tmp_path):
    layout = HeadLayout(2, 2, 2, 4, (0, 1), "no_such_model_xyz")
    with pytest.raises(ConfigError, match="calibrate heads"):
        HeadKV(HeadKVConfig(), layout)
    with pytest.raises(ConfigError, match="method.beta"):
        HeadKV(HeadKVConfig(beta=0.5))
    with pytest.raises(ConfigError, match="method.head_scores"):
        HeadKV(HeadKVConfig(head_scores="copy"))
    zero = _score_file(tmp_path, {"0-0": [0], "0-1": [0], "1-0": [0], "1-1": [0]})
    with pytest.raises(ConfigError, match="zero"):
        HeadKV(HeadKVConfig(head_scores_path=zero), HeadLayout(2, 2, 2, 4, (0, 1), "x"))
