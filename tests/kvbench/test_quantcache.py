"""The quantized cache (kvbench/engine/quantcache.py): KIVI's quantizer, transformers' QuantizedCache, stored bytes."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from kvbench.engine.generate import Engine
from kvbench.engine import kvcache
from kvbench.engine.kvcache import store_layer
from kvbench.engine.quantcache import QuantizedLayer, dequantize, quantize
from methods.full import FullCache
from methods.snapkv import SnapKV, SnapKVConfig
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import job_dir, run_cli

SPEC = SimpleNamespace(bits=2, group_size=8, residual=16)


# --- KIVI's fake quantization, transcribed from jy-yuan/KIVI quant/new_pack.py (quant_and_pack_vcache /
# quant_and_pack_kcache, then unpack_and_dequant_*): min-max per group, scale = (mx - mn) / (2^b - 1)
def kivi_values(v: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per token: groups of ``group`` channels (the last dim)."""
    data = v.view(v.shape[:-1] + (v.shape[-1] // group, group))
    mn, mx = torch.min(data, dim=-1, keepdim=True)[0], torch.max(data, dim=-1, keepdim=True)[0]
    scale = (mx - mn) / (2**bits - 1)
    data = ((data - mn) / scale).clamp(0, 2**bits - 1).round()
    return (data * scale + mn).view(v.shape)


def kivi_keys(k: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per channel: groups of ``group`` tokens (B, nh, T, D) -> (B, nh, T // group, group, D), min over the group."""
    b, nh, t, d = k.shape
    data = k.view(b, nh, t // group, group, d)
    mn, mx = torch.min(data, dim=-2, keepdim=True)[0], torch.max(data, dim=-2, keepdim=True)[0]
    scale = (mx - mn) / (2**bits - 1)
    data = ((data - mn) / scale).clamp(0, 2**bits - 1).round()
    return (data * scale + mn).view(k.shape)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [16, 32])
def test_kivi_quantizer_equals_the_official_fake_quantization(bits, group):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(bits + group)) * 3 + 1
    for dim, official in ((-2, kivi_keys), (-1, kivi_values)):
        codes, scale, mn = quantize(x, bits, group, dim)
        assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 64, 64 * bits // 8)  # packed
        assert scale.numel() == mn.numel() == x.numel() // group
        back = dequantize(codes, scale, mn, bits, group, dim)
        assert (back - official(x, group, bits)).abs().max().item() == 0.0  # bit for bit at fp32
        assert 0 < (back - x).abs().max() <= scale.max() / 2 * 1.0001  # rounding error: at most half a step


def test_a_constant_group_reads_back_exactly():
    x = torch.ones(1, 1, 8, 8)
    assert torch.equal(dequantize(*quantize(x, 2, 8, -2), 2, 8, -2), x)  # KIVI divides by a zero scale here


def greedy(model, ids, steps, cache):
    """The unpatched model (SDPA as transformers ships it), greedy, on ``cache``; tokens and logits."""
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    logits, toks = [out.logits[0, -1]], []
    for step in range(steps):
        toks.append(int(logits[-1].argmax()))
        if step < steps - 1:
            logits.append(model(torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1])
    return toks, logits


@torch.inference_mode()
def test_full_cache_at_2_bits_equals_transformers_quantized_cache_with_quanto():
    pytest.importorskip("optimum.quanto", reason="the quanto extra: pip install -e '.[quanto]'")
    from transformers import QuantizedCache

    model = tiny_model("llama", layers=2)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(1)).tolist()  # 4 whole blocks
    hf = QuantizedCache(backend="quanto", config=ref.config, nbits=2, axis_key=-1, axis_value=0, q_group_size=8,
                        residual_length=16)  # KIVI's layout: keys per channel (axis -1), values per token (axis 0)
    ref_toks, ref_logits = greedy(ref, ids, 40, hf)  # 40 steps: two more blocks quantized while decoding
    loaded = loaded_for(model)
    eng = Engine(loaded, FullCache(layout=loaded.layout), 1.0)
    eng.quant, eng.record_logits = SPEC, True
    res = eng.generate(ids, 40, stop_ids=[])
    assert res.tokens == ref_toks
    torch.testing.assert_close(torch.stack(eng.last_logits), torch.stack(ref_logits), atol=1e-5, rtol=1e-5)
    fp = Engine(loaded, FullCache(layout=loaded.layout), 1.0).generate(ids, 40, stop_ids=[])
    assert fp.tokens != res.tokens  # 2 bits change this model's greedy tokens: the parity is not vacuous
    assert res.sdpa_backends["decode"] == {"quantized": "flash_attention"}
    per_head = 2 * 64 * 16 * 2 // 8 + 2 * 64 // 8 * 16 * 4 + 2 * 64 * 16 // 8 * 4  # codes, key and value scales/minima
    assert (res.cache_bytes_before, res.cache_bytes_after) == (2 * 2 * 64 * 2 * 16 * 4, 2 * 2 * per_head)


def test_blocks_residual_bytes_and_crop():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 37, 16, generator=g), torch.randn(1, 2, 37, 16, generator=g)
    layer = QuantizedLayer(SPEC)
    assert layer.update(k, v)[0] is k  # the first update (a prefill) attends to what it was given
    assert (layer.quantized, layer.keys.shape[-2], layer.get_seq_length()) == (32, 5, 37)
    news = []
    for _ in range(11):  # the 11th token fills the block: attended in full precision, then quantized
        news.append(torch.randn(1, 2, 1, 16, generator=g))
        keys, values = layer.update(news[-1], 2 * news[-1])
        assert torch.equal(keys[:, :, 32:], torch.cat([k[:, :, 32:], *news], 2))  # the residual and the new token
    assert (layer.quantized, layer.keys.shape[-2], keys.shape[-2]) == (48, 0, 48)
    assert torch.equal(keys[:, :, :32], dequantize(*quantize(k[:, :, :32], 2, 8, -2), 2, 8, -2))  # read back
    assert torch.equal(values[:, :, :32], dequantize(*quantize(v[:, :, :32], 2, 8, -1), 2, 8, -1))
    per_token = 2 * (16 * 2 // 8) + 2 * 16 * 4 // 8 + 2 * (16 // 8) * 4  # codes K+V, key and value scale/min
    assert layer.nbytes == 2 * 48 * per_token
    with pytest.raises(ValueError, match="quantized"):
        layer.crop(40)
    layer.update(k[:, :, :3], v[:, :, :3])
    layer.crop(-2)
    assert layer.get_seq_length() == 49


def test_a_compressed_layer_stored_quantized_keeps_its_bias_columns(monkeypatch):
    """SelKV's logit bias: the columns of the quantized tokens are kept beside them, in the model dtype, without
    the zero padding to the aligned width (CUDA's 8 here) that decoding reads."""
    monkeypatch.setitem(kvcache.ALIGN, "cpu", 8)
    g = torch.Generator().manual_seed(0)
    k, v, bias = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, generator=g)
    cache = kvcache.preallocated_cache(tiny_model("llama", layers=1).config, 4, SPEC)
    layer = kvcache.store_layer(cache, 0, k, v, bias_rows=1, scaling=0.25)
    assert cache.layers[0] is layer and (layer.quantized, layer.width, layer.keys.shape) == (16, 24, (1, 2, 4, 17))
    kvcache.write_bias(layer, bias, 16)
    keys, values = layer.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    assert keys.shape == values.shape == (1, 2, 21, 24) and not keys[..., 17:].any() and not values[..., 16:].any()
    assert torch.equal(keys[:, :, :20, 16], bias / 0.25) and keys[0, 0, 20, 16] == 0
    assert layer.extra.shape == (1, 2, 16, 1)
    with pytest.raises(ValueError, match="per-head lengths"):
        kvcache.store_layer(cache, 0, k, v, torch.ones(1, 2, 20, dtype=torch.bool))


@torch.inference_mode()
def test_a_layer_restored_mid_decode_is_quantized_again():
    """Decode-time compression re-stores a layer through store_layer: its kept tokens, read back, quantized anew."""
    loaded = loaded_for(tiny_model("llama", layers=2))
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 24)
    eng.quant = SPEC
    restored = []

    def cut(step):
        if step == 5:
            cache = eng.last_state.cache
            keys, values = cache.layers[1].dequantized()
            restored.append(store_layer(cache, 1, keys[:, :, -20:], values[:, :, -20:]))

    eng.on_decode_step = cut
    res = eng.generate(list(range(1, 61)), 9, stop_ids=[])
    assert res.compressed and res.stored_tokens["max"] == 24 and len(res.tokens) == 9
    assert isinstance(restored[0], QuantizedLayer) and restored[0].get_seq_length() == 20 + 3  # 3 steps after the cut
    assert eng.last_state.cache.layers[0].get_seq_length() == 24 + 8


def test_a_query_part_on_a_quantized_cache_equals_its_ids_fed_one_by_one():
    """task.compress=context on SelKV's compressed, quantized layers (bias columns): the query part in one forward
    gives the logits and tokens of feeding its ids one by one (no block fills inside the query part)."""
    from kvbench.engine.attention import attach_bias
    from kvbench.engine.generate import prefill
    from methods import build_method

    loaded = loaded_for(tiny_model("llama", layers=2))
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    one = Engine(loaded, build_method({"name": "selkv"}, loaded.layout), 0.3)
    one.quant, one.record_logits = SPEC, True
    res = one.generate(ids, 4, stop_ids=[], query_tokens=10)  # 21 kept: 16 quantized, then 5 + 10 in full precision
    assert res.compressed and one.last_state.cache.layers[0].quantized == 32
    ref = Engine(loaded, build_method({"name": "selkv"}, loaded.layout), 0.3)
    ref.quant = SPEC
    state, tokens = prefill([ref], ids[:70], 14)[0].state, []
    with torch.inference_mode():
        ref.method.finalize(state.results)
        attach_bias(state)
        state.phase = "decode"
        for pos, tok in enumerate(ids[70:] + [None] * 3, start=70):
            logits = loaded.model(input_ids=torch.tensor([[tok if tok is not None else tokens[-1]]]), past_key_values=state.cache,
                                  use_cache=True, position_ids=torch.tensor([[pos]]), kvbench_state=state).logits[0, -1]
            if pos >= 79:
                torch.testing.assert_close(logits, one.last_logits[pos - 79], atol=1e-5, rtol=1e-5)
                tokens.append(int(logits.argmax()))
    assert tokens == res.tokens


@torch.inference_mode()
def test_kept_tokens_and_bytes_count_the_quantized_blocks_too():
    """One accounting (issue 56.12): a quantized job keeps what the dtype job keeps (blocks + residual), stores less."""
    loaded = loaded_for(tiny_model("llama", layers=2))
    results = []
    for quant in (None, SPEC):
        eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 40)
        eng.quant = quant
        results.append(eng.generate(list(range(1, 101)), 3, stop_ids=[]))
    plain, quantized = results
    assert quantized.kept_tokens == plain.kept_tokens == {"mean": 40.0, "min": 40.0, "max": 40.0}  # 32 quantized + 8
    assert quantized.stored_tokens == plain.stored_tokens and quantized.kept_bytes == plain.kept_bytes == 2 * 40 * 2 * 2 * 16 * 4
    assert quantized.stored_bytes < plain.stored_bytes == plain.kept_bytes


@torch.inference_mode()
def test_off_is_todays_cache():
    loaded = loaded_for(tiny_model("llama", layers=2))
    eng = Engine(loaded, FullCache(layout=loaded.layout), 1.0)
    res = eng.generate(list(range(1, 41)), 3, stop_ids=[])
    assert not any(isinstance(x, QuantizedLayer) for x in eng.last_state.cache.layers)
    assert res.cache_bytes_after == res.cache_bytes_before == 2 * 40 * 2 * 2 * 16 * 4  # 2 layers, K and V, fp32


def test_snapkv_at_4_bits_on_the_embedded_model_stores_the_analytic_packed_size(tmp_path):
    """The issue's acceptance run: records' stored bytes against the packed size computed from the kept tokens."""
    args = ["method=snapkv", "budget=0.25", "cache.bits=4", "task.context_lengths=[600]", "task.depth_percents=[50]",
            "task.max_new_tokens=8", "threads=1", f"output_root={tmp_path}"]
    out = run_cli(args, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = job_dir(args)
    assert folder.name.startswith("b0.25-q4-")
    assert json.loads((folder / "identity.json").read_text())["cache"] == {"bits": 4, "group_size": 32, "residual": 128}
    (rec,) = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    m, h, d, layers = rec["stored_tokens"]["max"], 3, 64, 30  # SmolLM2-135M: 3 KV heads of 64 channels, 30 layers
    assert rec["compressed"] and rec["stored_tokens"]["min"] == m > 128
    q, r = m // 128 * 128, m % 128  # quantized tokens and the full-precision residual (float32 on CPU)
    analytic = layers * h * (2 * q * d * 4 // 8 + 2 * (q // 32) * d * 4 + 2 * q * (d // 32) * 4 + 2 * r * d * 4)
    assert abs(rec["stored_bytes"] - analytic) <= 0.01 * analytic
    assert rec["cache_bytes_after"] == rec["stored_bytes"] and rec["cache_bytes_before"] == layers * h * 2 * d * 4 * rec["prompt_tokens"]


@pytest.mark.parametrize("args,key", [
    (["cache.bits=3"], "cache.bits"),
    (["cache.bits=4", "cache.residual=40"], "cache.residual"),
    (["cache.bits=4", "cache.group_size=128"], "cache.group_size"),  # does not divide SmolLM2's head dim 64
    (["cache.bits=2", "method=adakv"], "cache.bits"),
    (["cache.bits=2", "method=headcompresskv", "budget=64"], "cache.bits"),
    (["cache.bits=4", "method=kvzip"], "cache.bits"),  # per-head lengths, whatever the method (Method.per_head_lengths)
    (["cache.bits=4", "method=adakv_kvpress"], "cache.bits"),
])
def test_bad_cache_settings_are_one_line_and_exit_2(tmp_path, args, key):
    out = run_cli([*args, f"output_root={tmp_path}"], timeout=120)
    lines = out.stderr.splitlines()
    assert (out.returncode, len(lines)) == (2, 1) and lines[0].startswith(f"error: {key}"), out.stderr[-2000:]
    assert not any(tmp_path.rglob("env.json"))
