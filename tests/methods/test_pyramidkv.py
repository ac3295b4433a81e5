"""PyramidKV: the β = 20 layer schedule (hand-computed), fall-backs, plan and selection."""

import pytest
import torch

from methods.allocation import pyramid_layer_budgets
from methods.base import ConfigError, HeadLayout, LayerContext
from methods.pyramidkv import PyramidKV, PyramidKVConfig
from methods.base import check_budget


def test_kvcf_schedule_hand_computed():
    # m=128, W=8: b=120, min=120//20=6, max=2*120-6=234, step=(234-6)//3=76
    assert pyramid_layer_budgets(128, 1000, 4, 8) == [234 + 8, 158 + 8, 82 + 8, 6 + 8]


def test_kvcf_schedule_total_and_integer_step():
    # m=256, W=32, L=30: b=224, min=11, max=437, step=426//29=14 (not 14.69): the top
    # layers keep more than the exact line, so the total exceeds L*m by sum(l*0.69...)
    budgets = pyramid_layer_budgets(256, 2000, 30, 32)
    assert budgets[0] == 437 + 32 and budgets[-1] == 437 - 29 * 14 + 32 == 63
    assert sum(budgets) == 30 * 437 - 14 * 435 + 30 * 32 == 7980
    assert all(a - b == 14 for a, b in zip(budgets, budgets[1:]))


def test_kvcf_schedule_clamps_max_to_prompt():
    # n=240: max=234 >= n-W=232 -> max=232, min=2*120-232=8, step=(232-8)//3=74
    assert pyramid_layer_budgets(128, 240, 4, 8) == [240, 166, 92, 18]


def test_kvcf_uniform_fallback_for_short_prompts():
    assert pyramid_layer_budgets(128, 239, 4, 8) == [128] * 4  # n < 2(m - W) = 240
    assert pyramid_layer_budgets(128, 100, 4, 8) == [100] * 4  # n < m: nothing evicted


def test_kvpress_schedule_hand_computed():
    # kvpress: min=256/20=12.8, max=512-12.8=499.2, step=486.4/29
    b = pyramid_layer_budgets(256, 512, 30, 8, variant="kvpress")
    assert b[0] == 499 and b[1] == 482 and b[29] == 13
    assert b[15] == round(499.2 - 15 * 486.4 / 29)


def test_kvpress_schedule_falls_back_unless_min_above_window():
    # min = 128/20 = 6.4 < W = 64: uniform m
    assert pyramid_layer_budgets(128, 512, 30, 64, variant="kvpress") == [128] * 30


def test_schedule_rejects_bad_settings():
    with pytest.raises(ConfigError, match="method.schedule"):
        PyramidKV(PyramidKVConfig(schedule="linear"))
    assert pyramid_layer_budgets(8, 1000, 4, 8) == [8] * 4  # m <= W (short ratio budget): uniform
    with pytest.raises(ConfigError, match="method.beta"):
        PyramidKV(PyramidKVConfig(beta=0))


def test_plan_spans_compressible_layers_only():
    layout = HeadLayout(num_layers=6, num_q_heads=4, num_kv_heads=2, head_dim=8, compressible_layers=(1, 3, 5))
    method = PyramidKV(PyramidKVConfig(window_size=8), layout)
    plan = method.plan(1000, check_budget(128), layout)
    assert plan.compress
    # 3 layers: min=6, max=234, step=(234-6)//2=114 -> 242, 128, 14
    assert [plan.layer_budgets[i] for i in (1, 3, 5)] == [242, 128, 14]
    assert [plan.layer_budgets[i] for i in (0, 2, 4)] == [1000] * 3
    assert not method.plan(100, check_budget(128), layout).compress
    # ratio budget: m = floor(0.25 * 1000) = 250
    assert method.plan(1000, check_budget(0.25), layout).layer_budgets[3] == 250


def test_compress_keeps_layer_budget_and_window():
    torch.manual_seed(0)
    layout = HeadLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, compressible_layers=(0, 1))
    method = PyramidKV(PyramidKVConfig(window_size=4, kernel_size=3), layout)
    n = 64
    keys, values = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    ctx = LayerContext(
        layer_idx=1, layout=layout, keys=keys, values=values,
        window_queries=torch.randn(1, 4, 4, 8), scaling=8**-0.5, budget=20,
    )
    res = method.compress(ctx)
    assert res.kept_indices.shape == (1, 2, 20)
    assert (res.kept_indices[..., -4:] == torch.arange(60, 64)).all()
    assert torch.equal(res.keys[0, 1, 0], keys[0, 1, res.kept_indices[0, 1, 0]])


def test_kvpress_plan_uses_the_unrounded_budget_and_keeps_w_on_top():
    # n=301, ρ=0.5: kvpress kept = 150.5, max = n - W = 237, min = 2·150.5 - 237 = 64 = W: a
    # pyramid (⌊150.5⌋ = 150 would give min = 63 < W: uniform), step (237 - 64)/3
    layout = HeadLayout(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=8, compressible_layers=(0, 1, 2, 3))
    method = PyramidKV(PyramidKVConfig(window_size=64, kernel_size=5, schedule="kvpress"), layout)
    assert method.plan(301, check_budget(0.5), layout).layer_budgets == [237, 179, 122, 64]
    assert pyramid_layer_budgets(150, 301, 4, 64, variant="kvpress") == [150] * 4
    assert method.plan(300, check_budget(0.5), layout).layer_budgets == [236, 179, 121, 64]
    assert method.min_budget() == 64  # the top layer keeps exactly W (kvpress), not W + 1
    assert PyramidKV(PyramidKVConfig(window_size=64), layout).min_budget() == 65  # kvcf: m > W
