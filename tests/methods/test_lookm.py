"""LOOK-M: merge variants on hand-computable tensors, targets, filter, gate, selection."""

import pytest
import torch

from methods import lookm
from methods.base import ConfigError, HeadLayout, LayerContext
from methods.lookm import (
    LookM,
    LookMConfig,
    cumulative_attention,
    merge_into_targets,
    nearest_kept,
    soft_cosine_gate,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32).view(1, 1, len(rows), -1)


KEPT = t([[1.0, 0.0], [0.0, 1.0]])
ONE_EVICTED = t([[2.0, 0.0]])
TARGET0 = torch.tensor([[[0]]])
W1 = torch.ones(1, 1, 1)


@pytest.mark.parametrize(
    "merge,sim,expected",
    [
        ("avg", 1.0, [1.5, 0.0]),  # (x_t + x_j)/2
        ("pivot", 1.0, [1.25, 0.0]),  # (x_t + (x_j + x_t)/2)/2
        ("weighted", 1.0, [1.5, 0.0]),  # (x_t + s*x_j)/2, s=1
        ("weighted", 0.5, [1.0, 0.0]),  # (1 + 0.5*2)/2
    ],
)
def test_merge_variants_one_token(merge, sim, expected):
    out = merge_into_targets(KEPT, ONE_EVICTED, TARGET0, W1, merge, torch.full((1, 1, 1), sim))
    assert out[0, 0, 0].tolist() == expected
    assert out[0, 0, 1].tolist() == [0.0, 1.0]  # untouched target


def test_avg_merge_of_two_tokens_and_gate_weight():
    ev = t([[2.0, 0.0], [4.0, 0.0]])
    tgt = torch.tensor([[[0, 0]]])
    out = merge_into_targets(KEPT, ev, tgt, torch.ones(1, 1, 2), "avg", torch.ones(1, 1, 2))
    assert out[0, 0, 0, 0].item() == pytest.approx(7 / 3)
    gated = merge_into_targets(KEPT, ev[:, :, :1], tgt[..., :1], torch.full((1, 1, 1), 0.5), "avg", torch.ones(1, 1, 1))
    assert gated[0, 0, 0, 0].item() == pytest.approx((1 + 0.5 * 2) / 1.5)
    dropped = merge_into_targets(KEPT, ev, tgt, torch.zeros(1, 1, 2), "pivot", torch.ones(1, 1, 2))
    assert torch.equal(dropped, KEPT)  # w = 0: pure eviction


def test_nearest_kept_is_cosine_argmax():
    kept = t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.1]])
    sim, target = nearest_kept(t([[2.0, 2.0], [0.0, 3.0], [-1.0, 0.0]]), kept, chunk=2)
    assert target.tolist() == [[[2, 1, 1]]]  # [-1, 0]: cos 0 with [0, 1], below 0 elsewhere
    assert sim[0, 0, 0].item() == pytest.approx((1 + 1.1) / (2**0.5 * (1 + 1.21) ** 0.5))
    assert sim[0, 0, 1:].tolist() == pytest.approx([1.0, 0.0])


def test_soft_cosine_gate_clamps_negative():
    g = soft_cosine_gate(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[1.0, 1.0], [-1.0, 0.0]]))
    assert g.tolist() == pytest.approx([2**-0.5, 0.0])


def test_cumulative_attention_chunks_match_one_block():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8)
    one = cumulative_attention(q, k, 0.3, None, chunk=12)
    assert torch.allclose(cumulative_attention(q, k, 0.3, None, chunk=5), one, atol=1e-6)
    # every query row sums to 1, so the column sums add up to the number of queries
    assert one.sum(-1).allclose(torch.full((1, 4), 12.0))
    assert one[..., 0].min() > 0  # the first token is seen by every query


def _naive_column_sums(q, k, scaling, softcap=None):
    """Σ_i softmax(q_i·K^T·scaling + causal mask): float64, keys repeated per query head, full n×n."""
    h_q, w, n = q.shape[1], q.shape[2], k.shape[2]
    keys = k.double().repeat_interleave(h_q // k.shape[1], dim=1)
    logits = q.double() @ keys.transpose(-1, -2) * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    query_pos = torch.arange(n - w, n).view(-1, 1)
    logits = logits.masked_fill(torch.arange(n).view(1, -1) > query_pos, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=2)


@pytest.mark.parametrize(
    "n,w,h_q,h_kv,chunk,block,softcap",
    [
        (48, 48, 4, 2, 512, 1 << 21, None),  # whole prompt, GQA, one block
        (48, 48, 4, 2, 7, 1 << 21, None),  # query_chunk caps the rows
        (48, 48, 6, 2, 512, 300, None),  # BLOCK_ELEMS caps the rows (blocks shrink as keys grow)
        (48, 48, 2, 2, 512, 1, None),  # one row per block (MHA)
        (48, 13, 6, 3, 5, 1 << 21, None),  # the last W queries only (window_size > 0)
        (40, 40, 3, 1, 9, 200, 5.0),  # soft-capping (Gemma 2)
    ],
)
def test_cumulative_attention_equals_naive_softmax_column_sums(monkeypatch, n, w, h_q, h_kv, chunk, block, softcap):
    monkeypatch.setitem(lookm.BLOCK_ELEMS, "cpu", block)
    g = torch.Generator().manual_seed(n + w + h_q)
    q, k = 2 * torch.randn(1, h_q, w, 8, generator=g), 2 * torch.randn(1, h_kv, n, 8, generator=g)
    out = cumulative_attention(q, k, 0.35, softcap, chunk)
    assert out.dtype == torch.float32 and out.shape == (1, h_q, n)
    torch.testing.assert_close(out.double(), _naive_column_sums(q, k, 0.35, softcap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_half_precision_scores_equal_float32_scores_of_the_same_values(monkeypatch, dtype, softcap):
    """A bf16/fp16 model's queries and keys multiply in their dtype (CUDA: float32 accumulation and output), the
    scaling and softmax in float32: the score and the prefill output equal the float32 path's on the same values."""
    monkeypatch.setitem(lookm.BLOCK_ELEMS, "cpu", 300)  # several blocks
    g = torch.Generator().manual_seed(3)
    q, k, v = (3 * torch.randn(1, h, 64, 16, generator=g).to(dtype) for h in (8, 2, 2))
    half, full = (lookm.attention_with_column_sums(*(x.to(t) for x in (q, k, v)), 0.25, softcap, 7) for t in (dtype, torch.float32))
    assert half[1].dtype == torch.float32 and half[0].dtype == dtype
    torch.testing.assert_close(half[1], full[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half[0], full[0].to(dtype))
    torch.testing.assert_close(cumulative_attention(q[:, :, -9:], k, 0.25, softcap, 7),
                               cumulative_attention(q[:, :, -9:].float(), k.float(), 0.25, softcap, 7), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half[1].double(), _naive_column_sums(q.float(), k.float(), 0.25, softcap), rtol=1e-5, atol=1e-5)


def test_query_blocks_cover_the_window_within_the_block_size():
    first, w, h_q = 30, 70, 4
    blocks = lookm._query_blocks(first, w, h_q, chunk=16, elems=1000)
    assert blocks[0][0] == 0 and blocks[-1][1] == w
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # contiguous, no overlap
    for start, stop in blocks:
        assert 1 <= stop - start <= 16
        assert stop - start == 1 or h_q * (stop - start) * (first + stop) <= 1000  # logits of the block


def test_compress_result_holds_only_the_kept_tokens():
    # nothing of size n per query head (scores) or n² (attention) survives compression
    layout, ctx = _ctx(n=120, budget=12, h_q=4, h_kv=2)
    res = LookM(LookMConfig(), layout).compress(ctx)
    tensors = {k: v for k, v in vars(res).items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == ["kept_indices", "keys", "values"]
    assert res.keys.shape == res.values.shape == (1, 2, 12, 4) and res.kept_indices.shape == (1, 2, 12)
    for t in tensors.values():
        assert t.untyped_storage().nbytes() <= res.keys.numel() * 4  # no view into a larger buffer
    assert all(isinstance(v, float) for v in res.stats.values())


def _ctx(n=40, budget=12, h_q=2, h_kv=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    layout = HeadLayout(num_layers=1, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=4, compressible_layers=(0,))
    return layout, LayerContext(
        layer_idx=0, layout=layout, keys=torch.randn(1, h_kv, n, 4, generator=g),
        values=torch.randn(1, h_kv, n, 4, generator=g), window_queries=torch.randn(1, h_q, n, 4, generator=g),
        scaling=0.5, budget=budget,
    )


def test_selection_keeps_sinks_recent_and_budget():
    layout, ctx = _ctx()
    method = LookM(LookMConfig(n_sinks=2, recent_fraction=0.5), layout)
    keep = method.select(ctx)
    assert keep.sum().item() == 12
    assert keep[0, 0, :2].all() and keep[0, 0, 34:].all()  # 2 sinks, 6 recent


def test_avg_merge_conserves_mass_without_filter():
    # sum_t x_t_new * (1 + count_t) = sum of kept + sum of evicted rows (filter off, no gate)
    layout, ctx = _ctx()
    res = LookM(LookMConfig(merge="avg", similarity_filter="off"), layout).compress(ctx)
    assert res.stats == {"merged": 28.0, "dropped": 0.0}
    counts = 1 + (res.values.new_zeros(12))
    kept_idx = res.kept_indices[0, 0]
    evicted = sorted(set(range(40)) - set(kept_idx.tolist()))
    sims = torch.nn.functional.normalize(ctx.keys[0, 0, evicted], dim=-1) @ torch.nn.functional.normalize(
        ctx.keys[0, 0, kept_idx], dim=-1
    ).T
    counts += torch.bincount(sims.argmax(-1), minlength=12)
    total = (res.values[0, 0] * counts.unsqueeze(-1)).sum(0)
    assert torch.allclose(total, ctx.values[0, 0].sum(0), atol=1e-5)


def test_filter_drops_below_mean_similarity():
    # one head, two evicted slots with similarity 0.9 and 0.1: mean 0.5, only the first merges
    kept = t([[1.0, 0.0], [0.0, 1.0]])
    layout = HeadLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=2, compressible_layers=(0,))
    keys = torch.cat([kept, t([[0.9, (1 - 0.81) ** 0.5], [0.1, -(1 - 0.01) ** 0.5]])], dim=2)
    ctx = LayerContext(layer_idx=0, layout=layout, keys=keys, values=keys.clone(),
                       window_queries=torch.zeros(1, 1, 4, 2), scaling=1.0, budget=2)
    method = LookM(LookMConfig(n_sinks=2, recent_fraction=0.0, merge="weighted"), layout)
    res = method.compress(ctx)
    assert res.stats == {"merged": 1.0, "dropped": 1.0}
    # weighted: (x_0 + 0.9 * k_2) / 2
    assert torch.allclose(res.keys[0, 0, 0], (kept[0, 0, 0] + 0.9 * keys[0, 0, 2]) / 2, atol=1e-6)
    assert torch.equal(res.keys[0, 0, 1], kept[0, 0, 1])  # token 3 (sim 0.1 to x_0) was dropped


def test_config_errors_and_whole_prompt_window():
    with pytest.raises(ConfigError, match="method.merge='max'"):
        LookM(LookMConfig(merge="max"))
    with pytest.raises(ConfigError, match="method.gate"):
        LookM(LookMConfig(gate="hard"))
    assert LookM(LookMConfig(window_size=0)).window_size > 10**9
    assert LookM(LookMConfig(window_size=32)).window_size == 32
    with pytest.raises(ConfigError, match="method.fused_score='yes'.*auto, on, off"):
        LookM(LookMConfig(fused_score="yes"))


@pytest.mark.parametrize("fused,window,device,expected", [
    ("auto", 0, "cpu", True), ("auto", 0, "cuda", False), ("on", 0, "cuda", True),
    ("off", 0, "cpu", False), ("auto", 32, "cpu", False),  # a window score is not the column sums
])
def test_wants_prompt_attention(fused, window, device, expected):
    method = LookM(LookMConfig(fused_score=fused, window_size=window))
    assert method.wants_prompt_attention(torch.device(device)) is expected


@pytest.mark.parametrize("n,h_q,h_kv,chunk,block", [
    (48, 4, 2, 512, 1 << 21),  # GQA, one block
    (48, 6, 2, 7, 300),  # rows capped by query_chunk and by BLOCK_ELEMS
    (33, 2, 2, 512, 1),  # MHA, one row per block
])
def test_attention_with_column_sums_is_sdpa_and_the_cumulative_score(monkeypatch, n, h_q, h_kv, chunk, block):
    monkeypatch.setitem(lookm.BLOCK_ELEMS, "cpu", block)
    g = torch.Generator().manual_seed(n + h_q)
    q, k, v = (2 * torch.randn(1, h, n, 8, generator=g) for h in (h_q, h_kv, h_kv))
    out, sums = lookm.attention_with_column_sums(q, k, v, 0.35, None, chunk)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.35, enable_gqa=True)
    assert out.shape == (1, h_q, n, 8) and sums.shape == (1, h_q, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(sums, cumulative_attention(q, k, 0.35, None, chunk))  # the same blocks, bit-equal
    torch.testing.assert_close(sums.double(), _naive_column_sums(q, k, 0.35, None), rtol=1e-5, atol=1e-5)


def test_attention_with_column_sums_refuses_a_continued_prefill():
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="3 queries for 5 keys"):
        lookm.attention_with_column_sums(q, kv, kv, 0.35, None, 16)


def block_count(n, heads, device_type, chunk=512):
    return len(lookm._query_blocks(0, n, heads, chunk, lookm.block_elems(device_type)))


def test_block_count_is_sized_for_the_device():
    """A 128k prompt on an 8B model (32 query heads): CPU-sized 8 MiB blocks are ~1 row each (a
    Python iteration per token); CUDA blocks hold 2^27 logits, a few thousand per layer."""
    n, heads = 128 * 1024, 32
    cpu, cuda = block_count(n, heads, "cpu"), block_count(n, heads, "cuda")
    assert cpu > 100_000  # 2^21 // (32 · 128k) = 0: one row per block for the last 120k rows
    assert 256 <= cuda <= 3000  # ≥ n / query_chunk; ≈ H_q·n²/2 / 2^27 ≈ 2048
    assert block_count(n, heads, "mps") == cpu  # other devices: as CPU
    assert block_count(1000, 4, "cuda") == 2  # short prompt: query_chunk (512) rows per block
