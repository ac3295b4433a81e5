"""CompressKV: shared per-layer kept sets, SRH-driven selection, error-aware layer budgets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from methods.allocation import adaptive_head_budgets
from methods.base import ConfigError, HeadLayout, LayerContext
from methods.compresskv import CompressKV, CompressKVConfig, error_aware_layer_budgets, window_token_scores
from methods.base import check_budget

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVBENCH_SHARED_DATA") or ROOT / ".." / "shared" / "data")
CKV = SHARED / "head_scores" / "compresskv"


def _files(tmp_path, ranking: dict, layer_scores: list[float] | None = None) -> dict:
    idx = tmp_path / "idx.json"
    idx.write_text(json.dumps(ranking))
    out = {"head_idx_path": str(idx), "trh_idx_path": str(idx)}
    if layer_scores is not None:
        ls = tmp_path / "ls.jsonl"
        ls.write_text(json.dumps({"avg_score": layer_scores}))
        out["layer_score_path"] = str(ls)
    return out


def _ctx(layout, layer, n, budget, w=4, seed=0, head_budget=None):
    g = torch.Generator().manual_seed(seed)
    d = layout.head_dim
    return LayerContext(
        layer_idx=layer, layout=layout,
        keys=torch.randn(1, layout.num_kv_heads, n, d, generator=g),
        values=torch.randn(1, layout.num_kv_heads, n, d, generator=g),
        window_queries=torch.randn(1, layout.num_q_heads, w, d, generator=g),
        scaling=d ** -0.5, budget=budget, head_budget=head_budget,
    )


# --------------------------------------------------------------------------- layer budgets
def test_layer_budgets_hand_computed():
    # m = 32 each (96), remaining 204 split 1:1:2 -> 51, 51, 102
    assert error_aware_layer_budgets(torch.tensor([1.0, 1.0, 2.0]), 300, 32, 300) == [83, 83, 134]
    # 4 left over, shares 4/3 each: floors 1, the last token to the first layer (tie -> lower index)
    assert error_aware_layer_budgets(torch.tensor([1.0, 1.0, 1.0]), 100, 32, 96) == [34, 33, 33]
    # a larger fraction wins: shares 4 * [.2, .5, .3] = [.8, 2, 1.2] -> floors [0, 2, 1], +1 to layer 0
    assert error_aware_layer_budgets(torch.tensor([0.2, 0.5, 0.3]), 100, 32, 96) == [33, 34, 33]


def test_layer_budgets_cap_redistributes_in_proportion():
    # remaining 204: shares [20.4, 40.8, 142.8]; cap M - m = 118 -> layer 2 fixed at 150,
    # 86 left split 1:2 over the others -> 28.67, 57.33 -> [61, 89, 150]
    assert error_aware_layer_budgets(torch.tensor([1.0, 2.0, 7.0]), 300, 32, 150) == [61, 89, 150]
    # only zero-score layers left free: split evenly (as the reference's one-by-one fix-up)
    assert error_aware_layer_budgets(torch.tensor([0.0, 0.0, 1.0]), 300, 32, 150) == [75, 75, 150]


@pytest.mark.parametrize("seed", range(5))
def test_layer_budgets_properties_random(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(30, generator=g) ** 3  # skewed
    for avg in (64, 128, 256, 1024):
        total, lo, hi = 30 * avg, 32, 3 * avg
        b = error_aware_layer_budgets(scores, total, lo, hi)
        assert sum(b) == total
        assert min(b) >= lo and max(b) <= hi
        order = scores.argsort()
        assert all(b[order[i]] <= b[order[i + 1]] for i in range(29))  # follows the scores' order


def test_layer_budgets_reject_infeasible_total():
    with pytest.raises(ValueError):
        error_aware_layer_budgets(torch.ones(4), 100, 32, 96)


@pytest.mark.skipif(not CKV.is_dir(), reason=f"published CompressKV files not found at {CKV}")
def test_plan_with_published_mistral_scores():
    layout = HeadLayout(32, 32, 8, 128, tuple(range(32)), "mistral")
    cfg = CompressKVConfig(head_idx_path=str(CKV / "Mistral-7B-Instruct-v0.3_head_idx.json"),
                           layer_score_path=str(CKV / "Mistral-7B-Instruct-v0.3_layer_score.jsonl"))
    m = CompressKV(cfg, layout)
    scores = json.loads((CKV / "Mistral-7B-Instruct-v0.3_layer_score.jsonl").read_text())["avg_score"]
    for budget in (128, 256, 2048):
        plan = m.plan(10000, check_budget(budget), layout)
        assert sum(plan.layer_budgets) == 32 * budget
        assert min(plan.layer_budgets) >= 32 and max(plan.layer_budgets) <= 3 * budget
        hi = max(range(32), key=lambda i: scores[i])
        lo = min(range(32), key=lambda i: scores[i])
        assert plan.layer_budgets[hi] == max(plan.layer_budgets)
        assert plan.layer_budgets[lo] == min(plan.layer_budgets)


@pytest.mark.skipif(not CKV.is_dir(), reason=f"published CompressKV files not found at {CKV}")
def test_a_prompt_shorter_than_the_average_budget_compresses_the_layers_whose_own_budget_is_below_it():
    """Issue #31.3: n=1500 at an average of 2048 tokens on Llama-3.1-8B's published layer scores. The
    official script allocates the budgets from 2048 before it sees the prompt and compresses each
    layer whose own budget is below n: 6 of the 32 layers; the other 26 keep every token."""
    layout = HeadLayout(32, 32, 8, 128, tuple(range(32)), "llama31")
    cfg = CompressKVConfig(head_idx_path=str(CKV / "Llama-3.1-8B-Instruct_head_idx.json"),
                           layer_score_path=str(CKV / "Llama-3.1-8B-Instruct_layer_score.jsonl"))
    m = CompressKV(cfg, layout)
    full = m.plan(100_000, check_budget(2048), layout).layer_budgets  # the allocation itself (no layer capped by n)
    plan = m.plan(1500, check_budget(2048), layout)
    assert plan.compress and sum(b < 1500 for b in full) == 6
    assert plan.layer_budgets == [min(b, 1500) for b in full]
    assert not m.plan(100, check_budget(2048), layout).compress  # every layer's budget >= n: nothing to compress


def test_plan_ratio_budget_and_compressible_subset(tmp_path):
    layout = HeadLayout(4, 2, 1, 8, (1, 3), "x")
    files = _files(tmp_path, {str(i): [0, 1] for i in range(4)}, [0.0, 1.0, 0.0, 3.0])
    m = CompressKV(CompressKVConfig(window_size=4, num_heads=2, **files), layout)
    plan = m.plan(1000, check_budget(0.1), layout)  # m = 100 per layer on average over the 2 compressible layers
    # remaining 200 - 64 = 136 split 1:3 -> 34, 102 (cap 300 - 32 not reached)
    assert plan.layer_budgets[1] == 66 and plan.layer_budgets[3] == 134
    short = m.plan(80, check_budget(100), layout)  # the official rule: layer 1's own budget (66) is below n, layer 3's (134) is not
    assert short.compress and short.layer_budgets[1] == 66 and short.layer_budgets[3] == 80


# --------------------------------------------------------------------------- token selection
def test_all_heads_of_a_layer_share_one_kept_set(tmp_path):
    layout = HeadLayout(2, 6, 3, 8, (0, 1), "x")
    m = CompressKV(CompressKVConfig(window_size=4, layer_allocation="uniform", num_heads=2,
                                    **_files(tmp_path, {"0": [5, 1, 0, 2, 3, 4], "1": [0, 1, 2, 3, 4, 5]})), layout)
    res = m.compress(_ctx(layout, 0, 50, 12))
    assert res.kept_indices.shape == (1, 3, 12)
    for h in (1, 2):
        assert torch.equal(res.kept_indices[0, h], res.kept_indices[0, 0])
    assert set(range(46, 50)) <= set(res.kept_indices[0, 0].tolist())  # window kept
    assert res.valid is None


def test_srh_selection_follows_the_selected_heads(tmp_path):
    # query head 4 (KV head 2 in groups of 2) attends to position 7; every other head to position 20
    layout = HeadLayout(1, 6, 3, 4, (0,), "x")
    n, w = 40, 4
    keys = torch.zeros(1, 3, n, 4)
    keys[0, :, 20, 0] = 10.0  # the "streaming" attractor for heads reading their own KV head
    keys[0, 2, 7, 1] = 10.0
    keys[0, 2, 20, 0] = 0.0
    q = torch.zeros(1, 6, w, 4)
    q[..., 0] = 1.0
    q[0, 4, :, 0], q[0, 4, :, 1] = 0.0, 1.0
    ctx = LayerContext(layer_idx=0, layout=layout, keys=keys, values=torch.randn(1, 3, n, 4),
                       window_queries=q, scaling=1.0, budget=w + 1)
    ranked_4 = {"0": [4, 0, 1, 2, 3, 5]}
    srh = CompressKV(CompressKVConfig(window_size=w, kernel_size=1, layer_allocation="uniform", num_heads=1,
                                      **_files(tmp_path, ranked_4)), layout)
    assert srh.compress(ctx).kept_indices[0, 0].tolist() == [7, 36, 37, 38, 39]
    ranked_0 = {"0": [0, 4, 1, 2, 3, 5]}
    other = CompressKV(CompressKVConfig(window_size=w, kernel_size=1, layer_allocation="uniform", num_heads=1,
                                        **_files(tmp_path, ranked_0)), layout)
    assert other.compress(ctx).kept_indices[0, 0].tolist() == [20, 36, 37, 38, 39]


def test_window_scores_pool_prefix_only():
    # one head, window of 1 query attending uniformly to n = 6 keys: attn = 1/6 everywhere
    q = torch.zeros(1, 1, 1, 2)
    k = torch.zeros(1, 1, 6, 2)
    s = window_token_scores(q, k, 1.0, kernel_size=3, pooling="avg")
    # prefix = 5 positions of 1/6; avg pool K=3 with zero padding: edges 2/3 of the value
    expected = [1 / 9, 1 / 6, 1 / 6, 1 / 6, 1 / 9]
    assert s[0, 0, :5].tolist() == pytest.approx(expected)
    assert s[0, 0, 5].item() == float("inf")


def test_snapkv_selection_is_per_kv_head(tmp_path):
    layout = HeadLayout(1, 4, 2, 8, (0,), "x")
    m = CompressKV(CompressKVConfig(window_size=4, selection="snapkv", layer_allocation="uniform"), layout)
    ctx = _ctx(layout, 0, 60, 10, seed=3)
    res = m.compress(ctx)
    s = window_token_scores(ctx.window_queries, ctx.keys, ctx.scaling, 5, "avg").view(1, 2, 2, 60).mean(2)
    for h in range(2):
        assert sorted(res.kept_indices[0, h].tolist()) == sorted(s[0, h].topk(10).indices.tolist())


def test_layer_budget_above_prompt_keeps_everything(tmp_path):
    layout = HeadLayout(1, 2, 1, 8, (0,), "x")
    m = CompressKV(CompressKVConfig(window_size=4, num_heads=2, layer_allocation="uniform", **_files(tmp_path, {"0": [0, 1]})), layout)
    res = m.compress(_ctx(layout, 0, 20, 25))
    assert res.kept_indices[0, 0].tolist() == list(range(20))


def test_headcompresskv_per_head_lengths_nested(tmp_path):
    layout = HeadLayout(2, 4, 2, 8, (0, 1), "x")
    hs = tmp_path / "hk.json"
    hs.write_text(json.dumps({f"{l}-{h}": [float(1 + h + 4 * l)] for l in range(2) for h in range(4)}))
    cfg = CompressKVConfig(window_size=4, layer_allocation="uniform", head_allocation="headkv",
                           headkv_scores_path=str(hs), headkv_beta=2.0,
                           **_files(tmp_path, {"0": [3, 2, 1, 0], "1": [0, 1, 2, 3]}))
    m = CompressKV(cfg, layout)
    plan = m.plan(64, check_budget(16), layout)
    assert plan.head_budgets.shape == (2, 2)
    hb = plan.head_budgets[1]
    res = m.compress(_ctx(layout, 1, 64, plan.layer_budgets[1], head_budget=hb))
    sets = [set(res.kept_indices[0, h][res.valid[0, h]].tolist()) for h in range(2)]
    assert [len(s) for s in sets] == hb.tolist()
    small, big = sorted(sets, key=len)
    assert small <= big  # one shared ranking: a shorter head keeps a prefix of the longer head's set


def test_adacompresskv_adakv_shares_from_shared_ranking(tmp_path):
    layout = HeadLayout(1, 6, 3, 8, (0,), "x")
    cfg = CompressKVConfig(window_size=4, num_heads=2, head_allocation="adakv", layer_allocation="uniform",
                           **_files(tmp_path, {"0": [5, 1, 0, 2, 3, 4]}))
    m = CompressKV(cfg, layout)
    n, budget = 80, 20
    ctx = _ctx(layout, 0, n, budget, seed=7)
    res = m.compress(ctx)
    # AdaKV counts over the per-KV-head SnapKV scores of the prefix (window excluded), floor α = 0.2
    per_kv = window_token_scores(ctx.window_queries, ctx.keys, ctx.scaling, 5, "avg").view(1, 3, 2, n).mean(2)
    counts = adaptive_head_budgets(per_kv[..., : n - 4], 3 * (budget - 4), 0.2)[0]
    assert res.valid.sum(-1)[0].tolist() == (counts + 4).tolist()
    shared = window_token_scores(ctx.window_queries[:, [5, 1]], ctx.keys[:, [2, 0]], ctx.scaling, 5, "avg").mean(1)[0]
    order = shared[: n - 4].argsort(descending=True).tolist()
    for h in range(3):
        kept = set(res.kept_indices[0, h][res.valid[0, h]].tolist())
        assert kept == set(order[: int(counts[h])]) | set(range(n - 4, n))


@pytest.mark.skipif(not CKV.is_dir(), reason=f"published CompressKV files not found at {CKV}")
def test_published_artifacts_found_by_model_name(monkeypatch):
    monkeypatch.setenv("KVBENCH_SHARED_DATA", str(SHARED))
    layout = HeadLayout(32, 32, 8, 128, tuple(range(32)), "mistral")
    m = CompressKV(CompressKVConfig(), layout)  # no paths: published files of Mistral-7B-Instruct-v0.3
    assert len(m.artifacts["ranking"]) == 32 and m.artifacts["layer_scores"].shape == (32,)
    trh = CompressKV(CompressKVConfig(selection="trh", layer_allocation="uniform"), layout)
    assert sorted(trh.artifacts["ranking"][0]) == list(range(32))


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="ada_floor_ratio"):
        CompressKV(CompressKVConfig(head_allocation="adakv", ada_floor_ratio=1.5))
    with pytest.raises(ConfigError, match="method.selection"):
        CompressKV(CompressKVConfig(selection="random"))
    with pytest.raises(ConfigError, match="layer_allocation"):
        CompressKV(CompressKVConfig(head_allocation="headkv"))
    layout = HeadLayout(2, 2, 1, 8, (0, 1), "x")
    with pytest.raises(ConfigError, match="num_heads"):
        CompressKV(CompressKVConfig(num_heads=4, layer_allocation="uniform", **_files(tmp_path, {"0": [0, 1], "1": [1, 0]})), layout)
    with pytest.raises(ConfigError, match="calibrate layers"):
        idx = _files(tmp_path, {"0": [0, 1], "1": [1, 0]})["head_idx_path"]
        CompressKV(CompressKVConfig(num_heads=2, head_idx_path=idx), HeadLayout(2, 2, 1, 8, (0, 1), "no_such_model_xyz"))
