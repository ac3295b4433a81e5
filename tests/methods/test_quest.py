"""Quest: page choices against Quest's evaluation code, and the engine's sparse reading on a tiny model.

Reference: mit-han-lab/Quest at commit 01c1623bf9395009520874e989e29f683203b357, ``evaluation/quest_attention.py``
(``forward``'s bound, ``local_heavy_hitter_mask``), transcribed step by step in :func:`reference_mask`: the bound per
token (``|q|·`` the page's max of ``sign(q)·k``, the last page padded with the dtype's minimum), its max per page,
the top min(max(3, budget // P), pages) pages, their tokens. With GQA the keys are first repeated to the query heads
(``repeat_kv``; microsoft/MInference fb56c91 ``minference/modules/quest.py`` ``quest_decode_kernel``, SCBench's quest
path, gets them repeated by ``DynamicCacheWithRepeat``): each query head masks its own logits.
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
    ref = reference_mask(q, k, budget, 16)  # (B, H, 1, T): MHA, one query head per KV head
    exact = Quest(QuestConfig(current_page=False)).select(context(q, k, budget))
    assert torch.equal(exact, ref)
    # the default adds the current page; the pages read are then at most budget // P (at least 3) plus that one
    with_last = Quest().select(context(q, k, budget))
    last = torch.arange(t) >= (t - 1) // 16 * 16
    assert torch.equal(with_last, ref | last)
    assert int(with_last.sum(-1).max()) <= max(3 * 16, min(t, budget) // 16 * 16) + 16


@pytest.mark.parametrize("t,budget,g", [(96, 48, 2), (257, 64, 4), (40, 100, 3)])
def test_gqa_query_heads_read_the_reference_pages_and_attention(t, budget, g):
    """Each query head's pages are the reference's over the repeated keys; the decode attention (SDPA and the float32
    reference) masks each query head's logits with its own pages, as the reference does."""
    from kvbench.engine.attention import _decode_attention

    gen = torch.Generator().manual_seed(t + g)
    q, k, v = torch.randn(1, 2 * g, 1, 16, generator=gen), *torch.randn(2, 1, 2, t, 16, generator=gen)
    keep = Quest(QuestConfig(current_page=False)).select(context(q, k, budget))  # (B, H_kv, G, T)
    ref = reference_mask(q, k.repeat_interleave(g, 1), budget, 16)  # (B, H_q, 1, T)
    assert keep.shape == (1, 2, g, t) and torch.equal(keep.flatten(1, 2), ref[:, :, 0])
    logits = (q @ k.repeat_interleave(g, 1).transpose(-1, -2) * 0.25).masked_fill(~ref, float("-inf"))
    want = (logits.softmax(-1) @ v.repeat_interleave(g, 1)).transpose(1, 2)  # (B, 1, H_q, d)
    for reference in (False, True):
        got = _decode_attention(q, k, v, keep, 0.25, None, reference=reference)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gqa_per_kv_head_reads_the_pages_of_its_query_heads_largest_bound():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 96, 16, generator=gen)
    shared = QuestConfig(current_page=False, per_query_head=False)
    same = Quest(shared).select(context(q[:, ::2].repeat_interleave(2, 1), k, 48))
    assert torch.equal(same, reference_mask(q[:, ::2], k, 48, 16))  # equal query heads: MHA's pages
    k[0, 1, 40] = 50 * q[0, 3, 0].sign()  # one query head of KV head 1 bounds page 2 far above every other page
    assert bool(Quest(shared).select(context(q, k, 48))[0, 1, 0, 32:48].all())
    mha = context(torch.randn(1, 2, 1, 16, generator=gen), k, 48)  # one query head per KV head: the same pages
    assert torch.equal(Quest(shared).select(mha), Quest().select(mha))


def test_dense_layers_read_everything():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 80, 16)
    assert Quest().select(context(q, k, 16, layer=1)) is None  # dense_layers = 2


@pytest.mark.parametrize("per_query_head", [True, False])
def test_engine_stores_everything_and_reads_budget_plus_a_page(per_query_head):
    model = tiny_model("llama", layers=4)  # 2 query heads per KV head
    loaded = loaded_for(model)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    method = build_method({"name": "quest", "page_size": 16, "per_query_head": per_query_head}, loaded.layout)
    chosen, select = [], method.select
    method.select = lambda ctx: chosen.append(select(ctx)) or chosen[-1]
    res = Engine(loaded, method, 64).generate(ids, 6, stop_ids=[])
    rec = res.record()
    assert not res.compressed and rec["stored_tokens"] == {"mean": 200.0, "min": 200, "max": 200}
    # layers 0, 1 read their whole cache (201 … 205 tokens over the 5 steps: 203), 2 and 3 at most five pages per
    # query head (4 top pages + the current one, 9 … 13 tokens, unless a top one); a KV head reads its heads' union
    chosen = [c for c in chosen if c is not None]  # layers 2, 3 at each of the 5 one-token steps
    assert rec["read_tokens"]["max"] == 203.0 and len(chosen) == 2 * 5
    assert all(int(c.sum(-1).max()) <= 64 + 16 for c in chosen) and chosen[0].shape[2] == (2 if per_query_head else 1)
    union = [float(c.any(2).sum(-1).float().mean()) for c in chosen]  # tokens per KV head
    assert rec["read_tokens"]["min"] == round(min(sum(union[0::2]), sum(union[1::2])) / 5, 3)
    assert 64 <= rec["read_tokens"]["min"] <= (2 if per_query_head else 1) * (64 + 13)
    full = Engine(loaded, build_method({"name": "full"}, loaded.layout), 64).generate(ids, 6, stop_ids=[]).record()
    assert full["read_tokens"] == {"mean": 203.0, "min": 203.0, "max": 203.0}  # eviction reads what it stores
    assert full["read_bytes"] == 4 * 2 * 2 * 16 * 4 * 203  # layers · K,V · heads · d · float32 · tokens
    assert rec["read_bytes"] < full["read_bytes"]


def test_mha_reads_the_same_pages_either_way():
    loaded = loaded_for(tiny_model("llama", n_kv=4, n_q=4, layers=3))
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = []
    for per_query_head in (True, False):
        eng = Engine(loaded, build_method({"name": "quest", "dense_layers": 0, "per_query_head": per_query_head},
                                          loaded.layout), 32)
        eng.record_logits = True
        rec = eng.generate(ids, 5, stop_ids=[]).record()
        runs.append((torch.stack(eng.last_logits), rec["read_tokens"], rec["read_bytes"]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]


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
    assert alone["read_tokens"]["max"] == 102.0 and 48 < rec["read_tokens"]["max"] <= 2 * (48 + 16)  # 2 query heads


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
    # three pages (budget 32 < 3 pages) + the current one per query head, 2 per KV head
    assert all(r[1]["max"] <= 2 * (3 * 16 + 16) for r in runs)


def test_per_kv_head_jobs_keep_the_identity_of_jobs_stored_before_the_key():
    from kvbench.job.config import check, compose

    jobs = {v: check(compose(["method=quest", "budget=64", f"method.per_query_head={v}"])) for v in ("true", "false")}
    assert "per_query_head" not in jobs["false"].identity["method"]  # its pages are those of the earlier folders
    assert jobs["true"].identity["method"]["per_query_head"] is True and jobs["true"].relpath != jobs["false"].relpath
