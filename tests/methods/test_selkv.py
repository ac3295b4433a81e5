"""SelKV, equation by equation, on tiny tensors with the expected values worked out here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from methods import get_method_class
from methods.base import CompressResult, ConfigError, HeadLayout, LayerContext, Method
from methods.merging import attention_ratio, compensation_bias, gated_merge, merge_counts, soft_cosine_gate
from methods.selkv import SelKV, SelKVConfig, bucket_targets, evicted_positions, select_tokens, window_statistics

ROOT = Path(__file__).resolve().parents[2]


def make_ctx(h_q=4, h_kv=2, n=40, w=6, d=8, budget=12, seed=0, **kw) -> LayerContext:
    g = torch.Generator().manual_seed(seed)
    layout = HeadLayout(num_layers=2, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=d)
    return LayerContext(
        layer_idx=0,
        layout=layout,
        keys=torch.randn(1, h_kv, n, d, generator=g),
        values=torch.randn(1, h_kv, n, d, generator=g),
        window_queries=torch.randn(1, h_q, w, d, generator=g),
        scaling=d**-0.5,
        budget=budget,
        **kw,
    )


def manual_window_attention(ctx: LayerContext) -> torch.Tensor:
    """A[h, i, j] with plain loops and math.exp (causal inside the window)."""
    q, k = ctx.window_queries[0], ctx.keys[0]
    h_q, w, _ = q.shape
    n = k.shape[1]
    group = h_q // k.shape[0]
    attn = torch.zeros(h_q, w, n)
    for h in range(h_q):
        for i in range(w):
            visible = n - w + i + 1
            logits = [float(q[h, i] @ k[h // group, j]) * ctx.scaling for j in range(visible)]
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            for j in range(visible):
                attn[h, i, j] = e[j] / sum(e)
    return attn


# --- Eq. 1: contribution score ------------------------------------------------------------


@pytest.mark.parametrize("score,kernel", [("contribution", 3), ("contribution", 1), ("attention", 5)])
def test_scores_eq1_pooled_and_group_averaged(score, kernel):
    ctx = make_ctx(n=10, w=4, d=4)
    attn = manual_window_attention(ctx)
    h_q, _, n = attn.shape
    group = 2
    c = torch.zeros(h_q, n)
    a = torch.zeros(h_q, n)
    for h in range(h_q):
        for j in range(n):
            a[h, j] = sum(attn[h, i, j] for i in range(attn.shape[1]))
            norm = math.sqrt(sum(float(x) ** 2 for x in ctx.values[0, h // group, j]))
            c[h, j] = a[h, j] * (norm if score == "contribution" else 1.0)
    pooled = torch.zeros(h_q, n)
    for h in range(h_q):
        for j in range(n):  # zero padding, divided by K (count_include_pad)
            pooled[h, j] = sum(c[h, t] for t in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= t < n) / kernel
    want_c = torch.stack([(pooled[2 * g] + pooled[2 * g + 1]) / 2 for g in range(2)])
    want_a = torch.stack([(a[2 * g] + a[2 * g + 1]) / 2 for g in range(2)])
    got_a, got_c = window_statistics(ctx, score, kernel)
    assert got_c.dtype == torch.float32
    torch.testing.assert_close(got_c[0], want_c, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_a[0], want_a, atol=1e-6, rtol=1e-5)


# --- Eq. 2 and Sec. 3.3: selection ---------------------------------------------------------

# prefix positions 0..7 (recent window = 8, 9); m = 5 so m_s = 3
SCORES = torch.tensor(
    [
        [
            [10.0, 9.0, 0.0, 6.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0],  # head 0 top-3: 0, 1, 6
            [0.0, 0.0, 9.5, 6.0, 10.0, 0.0, 0.0, 8.0, 0.0, 0.0],  # head 1 top-3: 4, 2, 7
        ]
    ]
)


def test_union_then_trim_by_mean_score():
    # union {0, 1, 2, 4, 6, 7} > m_s = 3; means 0: 5, 4: 5, 2: 4.75, 1: 4.5, 6: 4, 7: 4.
    # Token 3 has the highest mean (6) but no head picked it: not in the union, not kept.
    got = select_tokens(SCORES, budget=5, recent=2, mode="union")
    assert got.tolist() == [[[0, 2, 4, 8, 9], [0, 2, 4, 8, 9]]]


def test_per_head_and_shared_selection():
    assert select_tokens(SCORES, 5, 2, "per_head").tolist() == [[[0, 1, 6, 8, 9], [2, 4, 7, 8, 9]]]
    assert select_tokens(SCORES, 5, 2, "shared").tolist() == [[[0, 3, 4, 8, 9], [0, 3, 4, 8, 9]]]


def test_recent_window_capped_by_budget():
    assert select_tokens(SCORES, 2, 4, "union").tolist() == [[[8, 9], [8, 9]]]


def test_evicted_positions_is_the_complement():
    kept = torch.tensor([[[0, 3, 5], [1, 2, 5]]])
    assert evicted_positions(kept, 7).tolist() == [[[1, 2, 4, 6], [0, 3, 4, 6]]]


# --- Eq. 3: bucket routing -----------------------------------------------------------------


def routing_case():
    # n = 16, B = 4: buckets {0-3}, {4-7}, {8-11}, {12-15}; kept slots 0..4 = positions 1, 2, 10, 14, 15
    kept = torch.tensor([1, 2, 10, 14, 15]).expand(1, 2, 5)
    evicted = torch.tensor([0, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13]).expand(1, 2, 11)
    a = torch.full((1, 2, 16), 0.01)
    a[0, :, 1], a[0, :, 2], a[0, :, 10] = 0.2, 0.5, 0.1
    a[0, 0, 14], a[0, 0, 15] = 0.3, 0.3  # tie: the earlier kept token wins
    a[0, 1, 14], a[0, 1, 15] = 0.3, 0.9
    return kept, evicted, a


def test_bucket_routing_highest_attention_and_empty_bucket_nearest():
    kept, evicted, a = routing_case()
    got = bucket_targets(kept, evicted, a, bucket_size=4, empty="nearest")
    # bucket 0 -> position 2 (slot 1); bucket 1 holds no kept token: 4, 5 are nearest to
    # position 2, 6 is 4 from both 2 and 10 (tie -> earlier, slot 1), 7 is nearest to 10;
    # bucket 2 -> slot 2; bucket 3 -> slot 3 (head 0, tie) / slot 4 (head 1).
    assert got[0, 0].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert got[0, 1].tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4]


def test_bucket_routing_empty_bucket_drop():
    kept, evicted, a = routing_case()
    got = bucket_targets(kept, evicted, a, bucket_size=4, empty="drop")
    assert got[0, 0].tolist() == [1, 1, -1, -1, -1, -1, 2, 2, 2, 3, 3]


def test_bucket_routing_no_kept_token_after():
    kept = torch.tensor([[[0, 1]]])
    evicted = torch.tensor([[[5, 9]]])
    got = bucket_targets(kept, evicted, torch.rand(1, 1, 10), bucket_size=2, empty="nearest")
    assert got.tolist() == [[[1, 1]]]


def test_cosine_routing_picks_most_similar_kept_value():
    ctx = make_ctx(h_q=4, h_kv=2, n=12, w=4, d=4, budget=4)
    cfg = SelKVConfig(window_size=4, recent_window=1, routing="cosine", gate="none", compensation="count", alpha=1.0)
    res = SelKV(cfg).compress(ctx)
    counts = torch.zeros(2, 4)  # M_i per KV head: evicted tokens whose most similar kept value is slot i
    for h in range(2):
        kept = res.kept_indices[0, h].tolist()
        for j in range(12):
            if j in kept:
                continue
            v = ctx.values[0, h, j]
            cos = [float(v @ ctx.values[0, h, i]) / float(v.norm() * ctx.values[0, h, i].norm()) for i in kept]
            counts[h, cos.index(max(cos))] += 1
    # KeepKV count compensation with alpha = 1; GQA union: 1 + M averaged over the KV heads
    want = torch.log((1 + counts).mean(dim=0))
    torch.testing.assert_close(res.logit_bias[0, 0], want)
    torch.testing.assert_close(res.logit_bias[0, 1], want)
    assert res.stats["merged"] == 2 * 8


# --- Eq. 4: soft cosine gate ---------------------------------------------------------------


def test_soft_cosine_gate():
    g = torch.Generator().manual_seed(1)
    ev = torch.randn(2, 3, 5, 8, generator=g)
    tg = torch.randn(2, 3, 5, 8, generator=g)
    tg[0, 0, 0] = -2.0 * ev[0, 0, 0]  # opposite: dropped
    tg[0, 0, 1] = 3.0 * ev[0, 0, 1]  # same direction: fully merged
    ev[0, 0, 2] = 0.0  # zero vector: dropped
    got = soft_cosine_gate(ev, tg)
    want = torch.zeros(2, 3, 5)
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(5)).tolist():
        x, y = ev[tuple(idx)], tg[tuple(idx)]
        nx, ny = math.sqrt(float((x * x).sum())), math.sqrt(float((y * y).sum()))
        want[tuple(idx)] = max(float((x * y).sum()) / (nx * ny), 0.0) if nx > 0 else 0.0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got[0, 0, 0] == 0 and got[0, 0, 2] == 0
    assert abs(float(got[0, 0, 1]) - 1.0) < 1e-6


# --- Eq. 5: gated merge; Eq. 6: attention ratio --------------------------------------------


def merge_case():
    g = torch.Generator().manual_seed(2)
    kept_values = torch.randn(1, 2, 3, 4, generator=g)
    a_kept = torch.rand(1, 2, 3, generator=g) + 0.1
    ev_values = torch.randn(1, 2, 5, 4, generator=g)
    a_ev = torch.rand(1, 2, 5, generator=g) + 0.1
    targets = torch.tensor([[[0, 0, 2, -1, 2], [1, 1, 1, 0, -1]]])
    gate = torch.rand(1, 2, 5, generator=g)
    return kept_values, a_kept, ev_values, a_ev, targets, gate


def manual_merge(kept_values, a_kept, ev_values, a_ev, targets, gate):
    merged = kept_values.clone()
    ratio = torch.ones(a_kept.shape)
    for h in range(2):
        for i in range(3):
            num = a_kept[0, h, i] * kept_values[0, h, i]
            den = a_kept[0, h, i]
            for j in range(5):
                if targets[0, h, j] == i:
                    num = num + gate[0, h, j] * a_ev[0, h, j] * ev_values[0, h, j]
                    den = den + gate[0, h, j] * a_ev[0, h, j]
            merged[0, h, i] = num / den
            ratio[0, h, i] = den / a_kept[0, h, i]
    return merged, ratio


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_gate_zero_is_exact_eviction(dtype):
    kept_values, a_kept, ev_values, a_ev, targets, _ = merge_case()
    kept_values = kept_values.to(dtype)
    merged, absorbed = gated_merge(kept_values, a_kept, ev_values.to(dtype), 0.0 * a_ev, targets)
    assert merged.dtype == dtype and torch.equal(merged, kept_values)
    assert torch.equal(attention_ratio(a_kept, absorbed), torch.ones(1, 2, 3))


@pytest.mark.parametrize("which", ["ones", "soft"])
def test_merge_eq5_and_ratio_eq6(which):
    kept_values, a_kept, ev_values, a_ev, targets, gate = merge_case()
    if which == "ones":
        gate = torch.ones_like(gate)  # plain attention-weighted merging
    want_v, want_r = manual_merge(kept_values, a_kept, ev_values, a_ev, targets, gate)
    merged, absorbed = gated_merge(kept_values, a_kept, ev_values, gate * a_ev, targets)
    torch.testing.assert_close(merged, want_v, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attention_ratio(a_kept, absorbed), want_r, atol=1e-6, rtol=1e-5)


def test_compensation_bias_shared_and_per_head():
    ratio = torch.tensor([[[1.0, 2.0, 4.0], [3.0, 2.0, 1.0]]])
    shared = compensation_bias(ratio, 0.5, shared_heads=True)
    want = [0.5 * math.log(2.0), 0.5 * math.log(2.0), 0.5 * math.log(2.5)]
    for h in range(2):
        torch.testing.assert_close(shared[0, h], torch.tensor(want))
    torch.testing.assert_close(compensation_bias(ratio, 0.5, shared_heads=False), 0.5 * torch.log(ratio))


def test_merge_counts():
    targets = torch.tensor([[[0, 0, 2, -1, 2]]])
    merged = torch.tensor([[[True, True, False, True, True]]])
    assert merge_counts(targets, merged, 3).tolist() == [[[2.0, 0.0, 1.0]]]


# --- the whole layer ------------------------------------------------------------------------


def test_compress_gate_off_is_eviction():
    ctx = make_ctx()
    res = SelKV(SelKVConfig(window_size=6, gate="off", compensation="layer")).compress(ctx)
    idx = res.kept_indices
    assert idx.shape == (1, 2, 12) and torch.equal(idx[0, 0], idx[0, 1])  # GQA -> union
    for h in range(2):
        assert torch.equal(res.values[0, h], ctx.values[0, h, idx[0, h]])
        assert torch.equal(res.keys[0, h], ctx.keys[0, h, idx[0, h]])
    assert torch.equal(res.logit_bias, torch.zeros(1, 2, 12))
    assert res.stats == {"kept": 24.0, "merged": 0.0, "dropped": 56.0, "gate_sum": 0.0}
    assert res.next_position is None


@pytest.mark.parametrize("h_q,h_kv,selection", [(4, 2, "auto"), (2, 2, "auto")])
def test_compress_single_bucket_merge_all(h_q, h_kv, selection):
    """B ≥ n: one bucket, every evicted token merges (g = 1) into the kept token with the largest a."""
    ctx = make_ctx(h_q=h_q, h_kv=h_kv, n=20, w=4, d=4, budget=5, seed=3)
    cfg = SelKVConfig(window_size=4, kernel_size=3, recent_window=2, bucket_size=64, gate="none", compensation="layer", selection=selection)
    res = SelKV(cfg).compress(ctx)
    attn = manual_window_attention(ctx)
    group = h_q // h_kv
    ratios = []
    for h in range(h_kv):
        a = attn[h * group : (h + 1) * group].sum(dim=1).mean(dim=0)  # (n,)
        kept = res.kept_indices[0, h].tolist()
        best = max(range(5), key=lambda s: (float(a[kept[s]]), -s))
        evicted = [j for j in range(20) if j not in kept]
        i = kept[best]
        num = a[i] * ctx.values[0, h, i] + sum(a[j] * ctx.values[0, h, j] for j in evicted)
        den = a[i] + sum(a[j] for j in evicted)
        want = ctx.values[0, h, kept].clone()
        want[best] = num / den
        torch.testing.assert_close(res.values[0, h], want, atol=1e-5, rtol=1e-5)
        r = torch.ones(5)
        r[best] = den / a[i]
        ratios.append(r)
    ratios = torch.stack(ratios)
    if h_q == h_kv:  # MHA -> per-head selection, per-head bias
        assert not torch.equal(res.kept_indices[0, 0], res.kept_indices[0, 1])
        want_bias = 0.5 * torch.log(ratios)
    else:  # GQA -> union, bias of R averaged across KV heads
        want_bias = 0.5 * torch.log(ratios.mean(dim=0)).expand(h_kv, 5)
    torch.testing.assert_close(res.logit_bias[0], want_bias, atol=1e-5, rtol=1e-5)
    assert res.stats["merged"] == h_kv * 15 and res.stats["dropped"] == 0


def test_stats_add_up():
    ctx = make_ctx(n=64, budget=16, seed=5)
    res = SelKV(SelKVConfig(window_size=6, bucket_size=8)).compress(ctx)
    s = res.stats
    assert s["kept"] == 32 and s["merged"] + s["dropped"] == 2 * 48
    assert 0 < s["gate_sum"] <= s["merged"]


# --- Eq. 7: RoPE repositioning ---------------------------------------------------------------


def rope_tables(d, base=10000.0, scale=1.0):
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)

    def rotary(positions):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * scale, emb.sin() * scale

    return rotary


def apply_rope(x, positions, rotary):
    cos, sin = rotary(positions)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_repositioned_keys_equal_keys_embedded_at_new_positions(scale):
    d, n, m, offset = 16, 50, 12, 7
    rotary = rope_tables(d, scale=scale)
    g = torch.Generator().manual_seed(4)
    raw = torch.randn(1, 2, n, d, generator=g)
    positions = torch.arange(offset, offset + n)  # cache positions need not start at 0
    ctx = make_ctx(h_q=2, h_kv=2, n=n, w=8, d=d, budget=m, positions=positions, rotary=rotary)
    ctx.keys = apply_rope(raw, positions, rotary)
    res = SelKV(SelKVConfig(window_size=8, gate="off", reposition=True, compensation="off")).compress(ctx)
    assert res.next_position == m and res.logit_bias is None
    for h in range(2):
        want = apply_rope(raw[0, h, res.kept_indices[0, h]], torch.arange(m), rotary)
        torch.testing.assert_close(res.keys[0, h], want, atol=1e-4, rtol=1e-4)


def test_reposition_without_rotary_is_a_config_error():
    with pytest.raises(ConfigError, match="reposition"):
        SelKV(SelKVConfig(window_size=6, reposition=True)).compress(make_ctx())


# --- compensation over layers: finalize ----------------------------------------------------


def test_finalize_global_averages_ratio_over_layers():
    r1 = torch.tensor([[[1.0, 3.0], [1.0, 3.0]]])
    r2 = torch.tensor([[[2.0, 1.0], [2.0, 1.0]]])
    results = [CompressResult(keys=None, values=None, logit_bias=0.5 * torch.log(r)) for r in (r1, r2)] + [None]
    method = SelKV(SelKVConfig(compensation="global"))
    method.finalize(results)
    want = 0.5 * torch.log(torch.tensor([1.5, 2.0]))
    for r in results[:2]:
        torch.testing.assert_close(r.logit_bias[0, 0], want)
        torch.testing.assert_close(r.logit_bias[0, 1], want)
    method.finalize(results)  # idempotent
    torch.testing.assert_close(results[0].logit_bias[0, 0], want)
    # the engine passes {layer index: result}
    by_layer = {3: CompressResult(keys=None, values=None, logit_bias=0.5 * torch.log(r1)),
                7: CompressResult(keys=None, values=None, logit_bias=0.5 * torch.log(r2))}
    method.finalize(by_layer)
    torch.testing.assert_close(by_layer[7].logit_bias[0, 1], want)


def test_finalize_layer_mode_and_base_are_no_ops():
    bias = torch.tensor([[[0.1, 0.2]]])
    results = [CompressResult(keys=None, values=None, logit_bias=bias.clone()), CompressResult(keys=None, values=None, logit_bias=bias * 3)]
    SelKV(SelKVConfig(compensation="layer")).finalize(results)
    Method().finalize(results)
    assert torch.equal(results[0].logit_bias, bias) and torch.equal(results[1].logit_bias, bias * 3)


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value",
    [
        ("window_size", 0),
        ("kernel_size", 4),
        ("kernel_size", 0),
        ("bucket_size", 0),
        ("alpha", -0.1),
        ("recent_window", -1),
        ("selection", "heads"),
        ("routing", "random"),
        ("gate", "hard"),
        ("compensation", "both"),
        ("empty_bucket", "skip"),
        ("score", "norm"),
    ],
)
def test_invalid_config_is_one_line_config_error(key, value):
    with pytest.raises(ConfigError) as err:
        SelKV(SelKVConfig(**{key: value}))
    assert f"method.{key}=" in str(err.value) and "\n" not in str(err.value)


def test_registry_defaults_and_layout_rules():
    assert get_method_class("selkv") is SelKV
    method = SelKV()
    c = method.config
    assert (c.window_size, c.kernel_size, c.bucket_size, c.recent_window, c.alpha, c.reposition) == (32, 5, 32, 16, 0.5, False)
    assert method.min_budget() == 16
    gqa = HeadLayout(num_layers=1, num_q_heads=9, num_kv_heads=3, head_dim=64)
    mha = HeadLayout(num_layers=1, num_q_heads=4, num_kv_heads=4, head_dim=64)
    assert method.selection_mode(gqa) == "union" and method.selection_mode(mha) == "per_head"
    method.check_layout(gqa)
    method.check_layout(mha)
    gemma = HeadLayout(num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=64, compressible_layers=(1, 3))
    SelKV(SelKVConfig(reposition=False)).check_layout(gemma)
    with pytest.raises(ConfigError, match="method.reposition=true"):
        SelKV(SelKVConfig(reposition=True)).check_layout(gemma)
    SelKV(SelKVConfig(reposition=True)).check_layout(HeadLayout(2, 4, 2, 64, compressible_layers=(0, 1)))


PRESETS = ["selkv", "selkv_evict", "selkv_merge_all", "selkv_gate", "selkv_gate_comp", "selkv_repos", "selkv_keepkv"]


def compose_method(preset: str) -> dict:
    """The method node Hydra composes for ``method=<preset>`` (presets inherit selkv.yaml)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=[f"method={preset}"]).method, enum_to_str=True)


def test_selkv_presets_hold_only_what_differs_from_the_dataclass_defaults():
    for preset in PRESETS:
        node = yaml.safe_load((ROOT / "conf" / "method" / f"{preset}.yaml").read_text())
        assert node.pop("defaults") == ["/schema/method/selkv@_here_", "_self_"] and node.pop("label"), preset
        assert all(getattr(SelKVConfig(), k) != v for k, v in node.items()), preset


def test_presets_compose_and_switch_the_right_mechanisms():
    nodes = {}
    for preset in PRESETS:
        node = compose_method(preset)
        assert node.pop("name") == "selkv", preset
        node.pop("label")
        SelKV(SelKVConfig(**node))
        nodes[preset] = node
    assert nodes["selkv"] == SelKVConfig().__dict__  # yaml defaults = dataclass defaults
    switches = {p: (n["gate"], n["compensation"]) for p, n in nodes.items()}
    assert switches["selkv_evict"] == ("off", "off")
    assert switches["selkv_merge_all"] == ("none", "off")
    assert switches["selkv_gate"] == ("soft", "off")
    assert nodes["selkv_gate_comp"] == nodes["selkv"]
    assert nodes["selkv_repos"] == {**nodes["selkv"], "reposition": True}
    assert nodes["selkv_keepkv"] == {**nodes["selkv"], "compensation": "count", "alpha": 1.0}


def test_table3_sweep_preset():
    text = (ROOT / "conf" / "experiment" / "selkv_table3.yaml").read_text()
    assert text.startswith("# @package _global_")
    node = yaml.safe_load(text)
    assert node["hydra"]["sweeper"]["params"] == {"method.window_size": "16,32,64", "method.kernel_size": "3,5,7"}
    assert node["defaults"] == [{"override /method": "selkv"}, {"override /task": "longbench"}]
