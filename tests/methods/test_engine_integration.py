"""HeadKV and CompressKV through the kvbench engine on a tiny random Llama (per-head lengths, masks)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvbench.engine.generate import Engine  # noqa: E402
from methods.compresskv import CompressKV, CompressKVConfig  # noqa: E402
from methods.headkv import HeadKV, HeadKVConfig  # noqa: E402
from methods.base import check_budget  # noqa: E402
from tests.conftest import loaded_for, tiny_model  # noqa: E402

PROMPT = list(range(1, 61))


def _head_scores(tmp_path, layers=2, heads=4) -> str:
    p = tmp_path / "heads.json"
    p.write_text(json.dumps({f"{l}-{h}": [float((3 * l + 5 * h) % 7 + 1)] for l in range(layers) for h in range(heads)}))
    return str(p)


class GarbagePadding(HeadKV):
    """HeadKV whose padding slots hold huge keys/values: masked slots must not change anything."""

    def compress(self, ctx):
        res = super().compress(ctx)
        pad = ~res.valid
        res.keys = res.keys.masked_fill(pad.unsqueeze(-1), 1e4)
        res.values = res.values.masked_fill(pad.unsqueeze(-1), -1e4)
        return res


def test_headkv_variable_lengths_in_the_engine(tmp_path):
    loaded = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))
    cfg = HeadKVConfig(head_scores_path=_head_scores(tmp_path), beta=1.2, window_size=4, kernel_size=3)
    method = HeadKV(cfg, loaded.layout)
    plan = method.plan(len(PROMPT), check_budget(16), loaded.layout)
    assert len(set(plan.head_budgets.flatten().tolist())) > 1  # heads really differ
    eng = Engine(loaded, method, 16)
    eng.record_logits = True
    res = eng.generate(PROMPT, 4, stop_ids=[])
    assert res.compressed
    # flat per-head storage: stored slots and bytes are the kept ones (float32, K and V, d = 16)
    assert res.stored_tokens == res.kept_tokens and res.stored_bytes == res.kept_bytes == int(plan.head_budgets.sum()) * 2 * 16 * 4
    per_layer_kept = plan.head_budgets.float().mean(dim=1)
    assert res.kept_tokens["mean"] == pytest.approx(float(per_layer_kept.mean()), abs=1e-3)

    garbage = Engine(loaded, GarbagePadding(cfg, loaded.layout), 16)
    garbage.record_logits = True
    res2 = garbage.generate(PROMPT, 4, stop_ids=[])
    assert res2.tokens == res.tokens
    for a, b in zip(eng.last_logits, garbage.last_logits):
        torch.testing.assert_close(a, b)


def _ckv_files(tmp_path) -> dict:
    idx = tmp_path / "idx.json"
    idx.write_text(json.dumps({"0": [3, 1, 0, 2], "1": [0, 2, 1, 3]}))
    ls = tmp_path / "ls.jsonl"
    ls.write_text(json.dumps({"avg_score": [0.25, 0.75]}))
    return {"head_idx_path": str(idx), "layer_score_path": str(ls)}


def test_compresskv_error_aware_budgets_in_the_engine(tmp_path):
    loaded = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))
    cfg = CompressKVConfig(window_size=4, num_heads=2, **_ckv_files(tmp_path))
    method = CompressKV(cfg, loaded.layout)
    res = Engine(loaded, method, 40).generate(PROMPT, 3, stop_ids=[])
    # total 80: m = 32 each, 16 left split 1:3 -> [36, 44]
    assert res.kept_tokens == {"mean": 40.0, "min": 36.0, "max": 44.0}
    state_results = Engine(loaded, method, 40)
    state_results.generate(PROMPT, 1, stop_ids=[])
    for r in state_results.last_state.results.values():
        assert torch.equal(r.kept_indices[0, 0], r.kept_indices[0, 1])  # one set per layer


def test_headcompresskv_in_the_engine(tmp_path):
    loaded = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))
    cfg = CompressKVConfig(window_size=4, num_heads=2, head_idx_path=_ckv_files(tmp_path)["head_idx_path"], layer_allocation="uniform",
                           head_allocation="headkv", headkv_scores_path=_head_scores(tmp_path), headkv_beta=1.2)
    method = CompressKV(cfg, loaded.layout)
    plan = method.plan(len(PROMPT), check_budget(16), loaded.layout)
    res = Engine(loaded, method, 16).generate(PROMPT, 3, stop_ids=[])
    assert res.stored_tokens == res.kept_tokens and res.stored_bytes == res.kept_bytes == int(plan.head_budgets.sum()) * 2 * 16 * 4
    assert res.kept_tokens["mean"] == pytest.approx(float(plan.head_budgets.float().mean()), abs=1e-3)


def test_adacompresskv_in_the_engine(tmp_path):
    loaded = loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))
    cfg = CompressKVConfig(window_size=4, num_heads=2, head_allocation="adakv", **_ckv_files(tmp_path))
    eng = Engine(loaded, CompressKV(cfg, loaded.layout), 40)
    res = eng.generate(PROMPT, 3, stop_ids=[])
    assert res.compressed
    # layer budgets [36, 44] (as without AdaKV); AdaKV moves tokens between the 2 heads of a layer,
    # floor α·(m - W) rounding may drop up to 1 token per head
    kept = {i: int(r.valid.sum()) for i, r in eng.last_state.results.items()}
    assert 2 * 36 - 2 <= kept[0] <= 2 * 36 and 2 * 44 - 2 <= kept[1] <= 2 * 44
