"""SelKV's open choices (docs/selkv.md): the empty-bucket statistic and the sensitivity preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.methods.test_selkv import make_ctx
from methods.selkv import SelKV, SelKVConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bucket,want", [(8, 48), (32, 32)])
def test_empty_bucket_count_when_only_the_recent_window_is_kept(bucket, want):
    # budget = recent window: kept = positions 48..63. B = 8: buckets 6, 7 hold them, all 48
    # evicted tokens lie in empty buckets 0..5; B = 32: bucket 1 (32..63) is occupied, only
    # 0..31 (bucket 0) are in an empty bucket. Two KV heads.
    ctx = make_ctx(n=64, budget=16)
    for empty in ("nearest", "drop"):
        res = SelKV(SelKVConfig(window_size=6, recent_window=16, bucket_size=bucket, empty_bucket=empty)).compress(ctx)
        assert res.stats["empty_bucket"] == 2 * want
        if empty == "drop":
            assert res.stats["dropped"] >= 2 * want
    res = SelKV(SelKVConfig(window_size=6, recent_window=16, bucket_size=8, empty_bucket="drop")).compress(ctx)
    assert res.stats["merged"] == 0  # every evicted token had an empty bucket: nothing to merge into


def test_empty_bucket_count_matches_a_loop_and_finalize_records_the_layer_range():
    method = SelKV(SelKVConfig(window_size=6, recent_window=4, bucket_size=8))
    results = {}
    for layer, seed in ((2, 5), (5, 6), (7, 7)):
        res = method.compress(make_ctx(n=64, budget=16, seed=seed))
        want = 0
        for h in range(2):
            kept = res.kept_indices[0, h].tolist()
            occupied = {j // 8 for j in kept}
            want += sum(j // 8 not in occupied for j in range(64) if j not in kept)
        assert res.stats["empty_bucket"] == want
        results[layer] = res
    fracs = [r.stats["empty_bucket"] / 96 for r in results.values()]  # 2 heads x 48 evicted
    assert 0 < min(fracs) < max(fracs) < 1
    method.finalize(results)
    summed = {k: sum(r.stats.get(k, 0.0) for r in results.values()) for k in ("empty_frac_min", "empty_frac_max")}
    assert summed == {"empty_frac_min": min(fracs), "empty_frac_max": max(fracs)}  # as the engine records them
    assert "empty_frac_min" in results[2].stats and "empty_frac_min" not in results[5].stats


def test_cosine_routing_and_gate_off_have_no_empty_bucket_statistic():
    for cfg in (SelKVConfig(window_size=6, routing="cosine"), SelKVConfig(window_size=6, gate="off")):
        method = SelKV(cfg)
        results = [method.compress(make_ctx(n=64, budget=16))]
        method.finalize(results)
        assert "empty_bucket" not in results[0].stats and "empty_frac_min" not in results[0].stats


def test_sensitivity_preset_composes_into_the_grid_of_jobs(monkeypatch):
    from hydra import compose, initialize_config_dir

    from kvbench.job.config import check

    data = ROOT.parent / "shared" / "data" / "longbench"
    if not data.is_dir():
        pytest.skip(f"{data} (shared LongBench files) not on this machine")
    monkeypatch.chdir(ROOT)  # the preset's data_dir is relative to the launch directory
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = yaml.safe_load((ROOT / "conf" / "experiment" / "selkv_sensitivity.yaml").read_text())["hydra"]["sweeper"]["params"]
    assert params == {"method.empty_bucket": "nearest,drop", "method.compensation": "global,layer"}
    jobs = {}
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for empty in ("nearest", "drop"):
            for comp in ("global", "layer"):
                node = compose("config", overrides=["+experiment=selkv_sensitivity",
                                                    f"method.empty_bucket={empty}", f"method.compensation={comp}"])
                job = check(node)
                assert (job.method.config.empty_bucket, job.method.config.compensation) == (empty, comp)
                cfg = job.cfg
                assert (cfg["model"]["name"], cfg["method"]["name"], cfg["budget"]) == ("smollm2", "selkv", 0.25)
                assert cfg["task"]["datasets"] == ["multi_news", "multifieldqa_zh"]
                jobs[job.relpath] = (empty, comp)
    assert len(jobs) == 4  # four distinct job folders
