"""Quest: page choices against Quest's evaluation code, and the engine's sparse reading on a tiny model.

Reference: mit-han-lab/Quest at commit 01c1623bf9395009520874e989e29f683203b357, ``evaluation/quest_attention.py``
(``forward``'s bound, ``local_heavy_hitter_mask``), transcribed step by step in :func:`reference_mask`: the bound per
token (``|q|·`` the page's max of ``sign(q)·k``, the last page padded with the dtype's minimum), its max per page,
the top min(max(3, budget // P), pages) pages, their tokens.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.generate import Engine
from methods import build_method
from methods.quest import Quest, QuestConfig
from tests.conftest import loaded_for, tiny_model


def reference_mask(q: torch.Tensor, k: torch.Tensor, budget: int, page: int) -> torch.Tensor:
    """``(B, H, 1, T)`` bool: Quest's evaluation-code selection for one decode query (MHA: keys already repeated)."""
    b, h, t, d = k.shape
    sign = (q > 0).long() + (~(q > 0)).long() * -1
    signed, positive = k * sign, q * sign
    pad = page - ((t - 1) % page + 1)
    signed = torch.cat([signed, torch.full((b, h, pad, d), torch.finfo(k.dtype).min)], 2)
    page_max = signed.view(b, h, -1, page, d).amax(-2)  # (B, H, pages, d)
    per_token = page_max.unsqueeze(-2).repeat(1, 1, 1, page, 1).view(b, h, -1, d)[:, :, :t]
    weight = torch.matmul(positive.float(), per_token.transpose(2, 3))  # (B, H, 1, T)
    weight = torch.cat([weight, torch.full((b, h, 1, pad), torch.finfo(weight.dtype).min)], -1)
    pages = weight.view(b, h, 1, -1, page).amax(-1)
    top = pages.topk(min(max(3, min(t, budget) // page), pages.shape[-1]), dim=-1).indices
    idx = (top.unsqueeze(-1) * page + torch.arange(page)).view(b, h, 1, -1)
    return torch.zeros_like(weight, dtype=torch.bool).scatter_(-1, idx, True)[..., :t]


def context(q, k, budget, layer=2):
    from methods.base import HeadLayout, LayerContext

    layout = HeadLayout(4, q.shape[1], k.shape[1], k.shape[-1], (0, 1, 2, 3))
    return LayerContext(layer, layout, k, k, q, 0.25, budget, decoding=1)


@pytest.mark.parametrize("t", [17, 64, 100, 257])
@pytest.mark.parametrize("budget", [16, 64, 100])
def test_pages_equal_quest_evaluation_code(t, budget):
    gen = torch.Generator().manual_seed(t * 1000 + budget)
    q, k = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 4, t, 16, generator=gen)
    ref = reference_mask(q, k, budget, 16)[:, :, 0]
    exact = Quest(QuestConfig(current_page=False)).select(context(q, k, budget))
    assert torch.equal(exact, ref)
    # the default adds the current page; the pages read are then at most budget // P (at least 3) plus that one
    with_last = Quest().select(context(q, k, budget))
    last = torch.arange(t) >= (t - 1) // 16 * 16
    assert torch.equal(with_last, ref | last)
    assert int(with_last.sum(-1).max()) <= max(3 * 16, min(t, budget) // 16 * 16) + 16


def test_gqa_head_reads_the_pages_of_its_query_heads_largest_bound():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 96, 16, generator=gen)
    same = Quest(QuestConfig(current_page=False)).select(context(q[:, ::2].repeat_interleave(2, 1), k, 48))
    assert torch.equal(same, reference_mask(q[:, ::2], k, 48, 16)[:, :, 0])  # equal query heads: MHA's pages
    k[0, 1, 40] = 50 * q[0, 3, 0].sign()  # one query head of KV head 1 bounds page 2 far above every other page
    assert bool(Quest(QuestConfig(current_page=False)).select(context(q, k, 48))[0, 1, 32:48].all())


def test_dense_layers_read_everything():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 80, 16)
    assert Quest().select(context(q, k, 16, layer=1)) is None  # dense_layers = 2


def test_engine_stores_everything_and_reads_budget_plus_a_page():
    model = tiny_model("llama", layers=4)
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    method = build_method({"name": "quest", "page_size": 16}, loaded.layout)
    res = Engine(loaded, method, 64).generate(ids, 6, stop_ids=[])
    rec = res.record()
    assert not res.compressed and rec["stored_tokens"] == {"mean": 200.0, "min": 200, "max": 200}
    # layers 0, 1 read their whole cache (201 … 205 tokens over the 5 steps: 203), 2 and 3 at most five pages
    assert rec["read_tokens"]["max"] == 203.0
    assert 64 <= rec["read_tokens"]["min"] <= 64 + 13  # 4 top pages + the current one (9 … 13 tokens) unless a top one
    full = Engine(loaded, build_method({"name": "full"}, loaded.layout), 64).generate(ids, 6, stop_ids=[]).record()
    assert full["read_tokens"] == {"mean": 203.0, "min": 203.0, "max": 203.0}  # eviction reads what it stores
    assert full["read_bytes"] == 4 * 2 * 2 * 16 * 4 * 203  # layers · K,V · heads · d · float32 · tokens
    assert rec["read_bytes"] < full["read_bytes"]


def test_masked_decode_equals_the_reference_attention_and_differs_from_full():
    loaded = loaded_for(tiny_model("llama", layers=3))  # GQA: 4 query heads on 2 KV heads
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = []
    for method, reference in (("quest", False), ("quest", True), ("full", False)):
        eng = Engine(loaded, build_method({"name": method, "dense_layers": 0} if method == "quest" else {"name": method},
                                          loaded.layout), 32)
        eng.record_logits, eng.reference_decode = True, reference
        eng.generate(ids, 4, stop_ids=[])
        logits.append(torch.stack(eng.last_logits[1:]))  # the steps after the first decode forward
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)  # SDPA with the mask = float32 reference
    assert (logits[0] - logits[2]).abs().max() > 1e-3  # it read fewer tokens than the full cache


def test_quest_over_a_snapkv_compressed_prompt():
    loaded = loaded_for(tiny_model("llama", layers=3))
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    method = build_method({"name": "quest", "keep": 100, "dense_layers": 0}, loaded.layout)
    rec = Engine(loaded, method, 48).generate(ids, 4, stop_ids=[]).record()
    snap = build_method({"name": "snapkv"}, loaded.layout)
    alone = Engine(loaded, snap, 100).generate(ids, 4, stop_ids=[]).record()
    assert rec["stored_tokens"] == alone["stored_tokens"] == {"mean": 100.0, "min": 100, "max": 100}
    assert rec["stored_bytes"] == alone["stored_bytes"]  # SnapKV's cache, read three pages + the current one per step
    assert alone["read_tokens"]["max"] == 102.0 and rec["read_tokens"]["max"] <= 48 + 16


def test_sampled_candidates_from_one_context_read_pages_too():
    from types import SimpleNamespace

    loaded = loaded_for(tiny_model("llama", layers=3))
    ids = torch.randint(0, 128, (160,), generator=torch.Generator().manual_seed(5)).tolist()
    eng = Engine(loaded, build_method({"name": "quest", "dense_layers": 0}, loaded.layout), 32)
    ctx, sampling = eng.open(ids, 5), SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0)
    saved, runs = eng.checkpoint(ctx), []
    for seed in (0, 0, 1):
        eng.restore(ctx, saved)
        res = eng.decode(ctx, 5, [], generator=torch.Generator().manual_seed(seed), sampling=sampling)
        runs.append((res.tokens, res.read_tokens))
    assert runs[0] == runs[1]  # a candidate is its seed's, whatever ran before
    assert all(r[1]["max"] <= 3 * 16 + 16 for r in runs)  # three pages (budget 32 < 3 pages) + the current one
