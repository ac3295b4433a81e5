"""AdaKV: head budgets (global top-k, floor, normalize), kvpress safeguard, packed output."""

import pytest
import torch

from methods.adakv import AdaKV, AdaKVConfig
from methods.allocation import adaptive_head_budgets, keep_topk_per_head, safeguard_keep_mask
from methods.base import ConfigError, HeadLayout, LayerContext
from methods.base import check_budget

PEAKED = [0.4, 0.3, 0.2, 0.1]


def _scores(*rows):
    return torch.tensor([rows], dtype=torch.float32)  # (1, H, N)


def test_global_topk_without_floor():
    s = _scores([0.9, 0.8, 0.7, 0.6], [0.1, 0.05, 0.02, 0.01])
    assert adaptive_head_budgets(s, total=4, floor_ratio=0.0).tolist() == [[4, 0]]


def test_floor_share():
    # counts [4, 0], b = 2, floor = int(0.5 * 2) = 1: round(4*0.5 + 1) = 3, round(0*0.5 + 1) = 1
    s = _scores([0.9, 0.8, 0.7, 0.6], [0.1, 0.05, 0.02, 0.01])
    assert adaptive_head_budgets(s, total=4, floor_ratio=0.5).tolist() == [[3, 1]]


def test_normalize_reweights_by_top_mass():
    s = _scores(PEAKED, [0.25, 0.15, 0.0, 0.0])
    # raw top-4: .4 .3 .25 .2 -> [3, 1]; head 0 scaled by its top-2 mass .7: .28 .21 .14 .07
    # against .25 .15 -> top-4: .28 .25 .21 .15 -> [2, 2]
    assert adaptive_head_budgets(s, 4, 0.0).tolist() == [[3, 1]]
    assert adaptive_head_budgets(s, 4, 0.0, normalize=True).tolist() == [[2, 2]]


def test_budgets_sum_and_floor_on_random_scores():
    torch.manual_seed(0)
    s = torch.rand(2, 8, 100) ** 4
    budgets = adaptive_head_budgets(s, total=8 * 30, floor_ratio=0.2)
    assert (budgets >= 6).all()  # floor int(0.2 * 30) = 6
    assert ((budgets.sum(-1) - 240).abs() <= 4).all()  # rounding of 8 heads, at most ±H/2


def test_keep_topk_per_head_counts():
    keep = keep_topk_per_head(_scores([0.1, 0.9, 0.5], [0.3, 0.2, 0.1]), torch.tensor([[2, 1]]))
    assert keep.tolist() == [[[False, True, True], [True, False, False]]]


def test_safeguard_protects_each_head_then_global_topk():
    # m = 2 per head, α = 0.5 -> each head's top 1 protected; 4 kept in total
    keep = safeguard_keep_mask(_scores([0.9, 0.8, 0.7, 0.6], [0.1, 0.05, 0.02, 0.01]), 2, 0.5)
    assert keep.tolist() == [[[True, True, True, False], [True, False, False, False]]]
    assert safeguard_keep_mask(_scores([0.9, 0.8, 0.7, 0.6], [0.1, 0.05, 0.02, 0.01]), 2, 0.0).sum(-1).tolist() == [[4, 0]]


def _ctx(budget, n=96, w=8, h_q=6, h_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    layout = HeadLayout(num_layers=4, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=16, compressible_layers=(0, 1, 2, 3))
    keys = torch.randn(1, h_kv, n, 16, generator=g)
    keys[:, 0] *= 4  # a peaked head next to a flat one
    return layout, LayerContext(
        layer_idx=0, layout=layout, keys=keys, values=torch.randn(1, h_kv, n, 16, generator=g),
        window_queries=torch.randn(1, h_q, w, 16, generator=g), scaling=0.25, budget=budget,
    )


def test_compress_packs_variable_heads_with_window_and_floor():
    layout, ctx = _ctx(budget=32)
    method = AdaKV(AdaKVConfig(window_size=8, kernel_size=3), layout)
    res = method.compress(ctx)
    per_head = res.valid.sum(-1)[0]
    assert per_head[0] != per_head[1]  # head-wise allocation actually varies
    # b = 24 per head, floor int(0.2*24) = 4: 2*8 + 0.8*48 + 2*4 = 62.4, ±1 from rounding
    assert abs(int(per_head.sum()) - 62.4) <= 1
    assert (per_head >= 8 + 4).all()  # window + floor
    assert res.keys.shape[2] == int(per_head.max())
    for h in range(2):
        kept = res.kept_indices[0, h, : per_head[h]]
        assert set(range(88, 96)) <= set(kept.tolist())  # the window
        assert torch.equal(res.values[0, h, : per_head[h]], ctx.values[0, h, kept])
    assert res.stats == {"kept_tokens": float(per_head.sum()), "stored_tokens": 2.0 * int(per_head.max())}


def test_safeguard_mode_keeps_exactly_h_times_m():
    layout, ctx = _ctx(budget=32)
    res = AdaKV(AdaKVConfig(window_size=8, kernel_size=3, floor_mode="safeguard"), layout).compress(ctx)
    assert int(res.valid.sum()) == 64
    assert (res.valid.sum(-1) >= 8).all()


def test_pyramid_layer_schedule_plan():
    layout, _ = _ctx(budget=32)
    method = AdaKV(AdaKVConfig(window_size=8, layer_schedule="pyramid"), layout)
    # m=128, W=8, 4 layers, n=1000: 242, 166, 90, 14 (see test_pyramidkv)
    assert method.plan(1000, check_budget(128), layout).layer_budgets == [242, 166, 90, 14]
    assert AdaKV(AdaKVConfig(window_size=8), layout).plan(1000, check_budget(128), layout).layer_budgets == [128] * 4


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="method.scorer='srh2'"):
        AdaKV(AdaKVConfig(scorer="srh2"))
    with pytest.raises(ConfigError, match="method.floor_mode"):
        AdaKV(AdaKVConfig(floor_mode="soft"))
    with pytest.raises(ConfigError, match="method.floor_ratio"):
        AdaKV(AdaKVConfig(floor_ratio=1.5))


def test_budget_below_window_keeps_the_last_m_tokens():
    layout, ctx = _ctx(budget=5)  # W = 8 > m = 5 (a small ratio budget on a short prompt)
    res = AdaKV(AdaKVConfig(window_size=8, kernel_size=3), layout).compress(ctx)
    assert res.valid.all() and res.kept_indices[0].tolist() == [list(range(91, 96))] * 2


@pytest.mark.parametrize("seed", range(6))
def test_floor_ratio_one_with_the_pyramid_schedule_is_pyramidkv(seed):
    """docs/METHODS.md: PyramidKV's schedule around any scorer is `method=adakv method.scorer=...
    method.layer_schedule=pyramid method.floor_ratio=1`; with SnapKV's scores it keeps PyramidKV's sets."""
    from methods.pyramidkv import PyramidKV, PyramidKVConfig

    g = torch.Generator().manual_seed(seed)
    layout = HeadLayout(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=8)
    pyramid = PyramidKV(PyramidKVConfig(window_size=6), layout)
    c = pyramid.config
    ada = AdaKV(AdaKVConfig(window_size=6, kernel_size=c.kernel_size, pooling=c.pooling, floor_ratio=1.0,
                            group_before_pooling=c.group_before_pooling, layer_schedule="pyramid"), layout)
    plans = [m.plan(300, check_budget(40), layout) for m in (pyramid, ada)]
    assert plans[0].layer_budgets == plans[1].layer_budgets and len(set(plans[0].layer_budgets)) == 4
    for layer, budget in enumerate(plans[0].layer_budgets):
        ctx = LayerContext(layer_idx=layer, layout=layout, keys=torch.randn(1, 2, 300, 8, generator=g),
                           values=torch.randn(1, 2, 300, 8, generator=g), scaling=8**-0.5, budget=budget,
                           window_queries=torch.randn(1, 4, 6, 8, generator=g))
        kept = [m.compress(ctx).kept_indices.sort(-1).values for m in (pyramid, ada)]
        assert torch.equal(*kept) and kept[0].shape[-1] == budget
