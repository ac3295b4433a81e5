"""KVzip (``method=kvzip``) through kvbench's engine on a tiny Llama, against

* an independent transcription of the official code (snu-mllab/KVzip): ``model/wrapper.py`` ``self_task`` (the
  chunked repeat prompts), ``attention/score.py`` ``_get_score`` (the scores) and ``_threshold`` /
  ``_threshold_uniform`` (the kept pairs), computed on the model's own prefill + reconstruction forwards run through
  a plain ``DynamicCache`` here;
* kvpress 0.5.5's ``KVzipPress`` (``score_kvzip`` and ``compress_post``) on the very tensors its forward hook sees
  in those forwards (the attention input, RoPE tables, the cache with the fed tokens).

The kept sets are compared at equal counts: kvbench keeps exactly its budget (sinks included); the official
threshold keeps int(N·ratio) − 1 context pairs and never evicts the system prompt; kvpress prunes int(N·ratio).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.engine.generate import Engine
from methods import build_method
from methods.base import ConfigError, PromptFormat
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import byte_tokenizer

LAYERS, H_KV, N, HEAD, BUDGET, CHUNK = 3, 2, 100, 6, 0.25, 40
TOKENIZER = byte_tokenizer()
FORMAT = PromptFormat(lambda s: TOKENIZER.encode(s, add_special_tokens=False), tuple(range(1, HEAD + 1)), (7, 8, 9))
IDS = list(FORMAT.head) + [int(i) for i in torch.randint(10, 250, (N - HEAD,), generator=torch.Generator().manual_seed(3))]


def run(**method) -> Engine:
    """kvbench's engine on IDS (3 layers, GQA 2×2) with ``method=kvzip`` and ``method``; returns the engine."""
    torch.manual_seed(0)
    engine = Engine(loaded_for(tiny_model("llama", n_kv=H_KV, n_q=4, layers=LAYERS, vocab_size=258)),
                    build_method({"name": "kvzip", "chunk_size": CHUNK, **method}), BUDGET)
    engine.prompt_format = FORMAT
    engine.generate(IDS, 3)
    return engine


def kept(engine: Engine) -> torch.Tensor:
    """``(L, H_kv, N)`` bool: the pairs the engine's cache holds."""
    out = torch.zeros(LAYERS, H_KV, N, dtype=torch.bool)
    for layer, res in engine.last_state.results.items():
        for h in range(H_KV):
            out[layer, h, res.kept_indices[0, h][res.valid[0, h]]] = True
    return out


def official_inputs(first_chunk_prompt: str, next_prompt: str) -> list[tuple[list[int], int, int]]:
    """``self_task``: chunks of the context after the system prompt, the repeat prompt, the last 8 tokens of the
    previous chunk, the template's postfix, the chunk; (ids, start, end) in prefilled positions."""
    ctx, encode = IDS[HEAD:], FORMAT.encode
    chunks = [ctx[i : i + CHUNK] for i in range(0, len(ctx), CHUNK)] if len(ctx) > CHUNK else [ctx]
    out = []
    for i, chunk in enumerate(chunks):
        q = encode(first_chunk_prompt) if i == 0 else encode(next_prompt) + chunks[i - 1][-8:]
        out.append((q + list(FORMAT.tail) + chunk, HEAD + i * CHUNK, HEAD + i * CHUNK + len(chunk)))
    return out


def reference_forwards(model, inputs):
    """Prefill IDS into a DynamicCache, then each fed forward on top of it (cut back after): per forward and layer,
    the attention module, its input hidden states, RoPE tables and the cache (fed tokens included)."""
    cache, seen = DynamicCache(config=model.config), []
    model(input_ids=torch.tensor([IDS]), past_key_values=cache, use_cache=True)
    hook = lambda mod, args, kw, out: step.__setitem__(mod.layer_idx, (mod, kw["hidden_states"], kw["position_embeddings"]))  # noqa: E731
    for ids, start, end in inputs:
        step = {}
        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        for h in handles:
            h.remove()
        seen.append({i: (*step[i], cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in step})
        cache.crop(N)
    return seen


def official_scores(seen, inputs, sink: int) -> torch.Tensor:
    """``_get_score`` per forward, concatenated over chunks: ``(L, 1, H_kv, N - HEAD)``."""
    per_layer = [[] for _ in range(LAYERS)]
    for step, (_ids, start, end) in zip(seen, inputs):
        for i, (mod, hidden, (cos, sin), keys, _values) in step.items():
            q = mod.q_proj(hidden).view(1, hidden.shape[1], -1, mod.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            bsz, _nh, q_len, hd = q.shape
            q = q.view(bsz, H_KV, -1, q_len, hd)
            k = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q_len:]], dim=2)
            a = torch.matmul(q, k.unsqueeze(2).transpose(-2, -1)) / math.sqrt(hd)
            mask = torch.full((q_len, q_len), torch.finfo(a.dtype).min)
            mask.masked_fill_(torch.arange(q_len) < (torch.arange(q_len) + 1).view(q_len, 1), 0)
            a[..., -q_len:, -q_len:] += mask[None, None, None]
            per_layer[i].append(torch.softmax(a, dim=-1)[..., sink : sink + end - start].amax(dim=(-3, -2)))
    return torch.stack([torch.cat(s, dim=-1) for s in per_layer])


def official_kept(score: torch.Tensor, ratio: float, uniform: bool = False) -> torch.Tensor:
    """``_threshold`` (one threshold over every pair, ``>``) or ``_threshold_uniform`` (each head's top k), as
    ``(L, H_kv, N)`` with the system prompt kept (``valid_pad``)."""
    if uniform:
        valid = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(int(score.shape[-1] * ratio)).indices, True)
    else:
        srt = torch.sort(score.reshape(-1), descending=True).values
        valid = score > srt[max(int(len(srt) * ratio) - 1, 0)].item()
    return torch.cat([torch.ones(LAYERS, 1, H_KV, HEAD, dtype=torch.bool), valid], dim=-1)[:, 0]


def context_ratio(level: str) -> float:
    """The official ratio whose kept context pairs equal kvbench's budget after the system prompt."""
    m = math.floor(BUDGET * N)
    if level == "pair_uniform":
        return (m - HEAD + 0.5) / (N - HEAD)
    return (LAYERS * H_KV * (m - HEAD) + 1.5) / (LAYERS * H_KV * (N - HEAD))


def test_reconstruction_inputs_are_the_official_self_task():
    method = build_method({"name": "kvzip", "chunk_size": CHUNK})
    rec = method.reconstruction(IDS, FORMAT)
    assert rec.inputs == official_inputs("\n\nRepeat the previous context exactly.",
                                         "\n\nRepeat the part of the previous context exactly, starting with ")
    assert rec.sinks == HEAD and [e - s for _, s, e in rec.inputs] == [40, 40, 14]
    assert build_method({"name": "kvzip", "n_sink": 4}).reconstruction(IDS, FORMAT).sinks == 4


@pytest.mark.parametrize("level", ["pair", "pair_uniform", "head"])
def test_scores_and_kept_sets_equal_the_official_code(level):
    engine = run(level=level)
    inputs = engine.last_state.scoring.reconstruction.inputs
    seen = reference_forwards(engine.model, inputs)
    score = official_scores(seen, inputs, sink=HEAD)
    ours = torch.stack([engine.last_state.scoring.scores[i][..., HEAD:] for i in range(LAYERS)])
    torch.testing.assert_close(ours, score, rtol=1e-5, atol=1e-6)
    if level == "head":  # --level head: the head score (--save_head_score's amax), spread over the context
        score = score.amax(-1, keepdim=True).expand_as(score)
    expected = official_kept(score, context_ratio(level), uniform=level == "pair_uniform")
    assert torch.equal(kept(engine), expected)
    assert engine.last_state.scoring.tokens == sum(len(ids) for ids, _, _ in inputs)


def kvpress_kept(engine: Engine, layerwise: bool, plus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzipPress's ``score_kvzip`` on each forward's captured tensors, then ``compress_post``: (scores, kept)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS)
    kvpress = pytest.importorskip("kvpress", reason="kvpress not installed (pip install -e '.[kvpress]')")
    ALL_ATTENTION_FUNCTIONS.update(saved)  # kvpress wraps every attention function at import (kvbench's too)
    model, inputs = engine.model, engine.last_state.scoring.reconstruction.inputs
    press = kvpress.KVzipPress(compression_ratio=1 - BUDGET, layerwise=layerwise, n_sink=4,
                               kvzip_plus_normalization=plus)
    press.context_length = N
    press.score_val = torch.zeros(LAYERS, 1, H_KV, N)
    for step, (_ids, start, end) in zip(reference_forwards(model, inputs), inputs):
        press.start_idx, press.end_idx = start, end
        for mod, hidden, pe, keys, values in step.values():
            press.score_kvzip(mod, hidden, keys, values, None, {"position_embeddings": pe})
    scores = press.score_val[:, 0].clone()
    press.compress_post(model)
    out = torch.ones(LAYERS, H_KV, N, dtype=torch.bool)
    for i, layer in enumerate(model.model.layers):
        _, heads, seq = layer.self_attn.masked_key_indices
        out[i, heads, seq] = False
        del layer.self_attn.masked_key_indices
    return scores, out


@pytest.mark.parametrize("level, plus", [("pair", False), ("layer", False), ("pair", True), ("layer", True)])
def test_kept_sets_equal_kvpress_kvzip_press(level, plus):
    engine = run(level=level, plus=plus, n_sink=4)
    scores, expected = kvpress_kept(engine, layerwise=level == "layer", plus=plus)
    ours = torch.stack([engine.last_state.scoring.scores[i][0] for i in range(LAYERS)])
    torch.testing.assert_close(ours[..., 4:], scores[..., 4:], rtol=1e-5, atol=1e-6)  # sinks: +inf / max + 1
    assert torch.equal(kept(engine), expected)


def test_memory_is_freed_and_the_cost_recorded():
    engine = run()
    res = engine.generate(IDS, 3)
    assert res.compressed and res.stored_tokens == res.kept_tokens and res.stored_bytes == res.kept_bytes
    assert res.kept_tokens["mean"] == math.floor(BUDGET * N)  # per layer per KV head on average, sinks included
    assert res.kept_bytes == LAYERS * H_KV * math.floor(BUDGET * N) * 2 * 16 * 4  # K and V, d = 16, float32
    assert res.reconstruct_tokens == sum(len(i) for i, _, _ in engine.last_state.scoring.reconstruction.inputs) > N
    assert 0 < res.reconstruct_s <= res.compress_s
    record = res.record()
    assert record["reconstruct_s"] > 0 and record["reconstruct_tokens"] == res.reconstruct_tokens


def test_other_methods_do_not_reconstruct():
    torch.manual_seed(0)
    engine = Engine(loaded_for(tiny_model("llama", n_kv=H_KV, n_q=4, layers=LAYERS)), build_method({"name": "snapkv"}), 0.5)
    res = engine.generate([int(i) for i in torch.randint(0, 128, (80,))], 2)
    assert engine.last_state.scoring is None and res.reconstruct_s == 0 and res.reconstruct_tokens == 0


@pytest.mark.parametrize("key, value", [("chunk_size", 0), ("overlap", -1), ("n_sink", -2), ("level", "tokens")])
def test_bad_settings_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"method.{key}"):
        build_method({"name": "kvzip", key: value})


def test_sliding_window_layers_are_left_as_the_prefill_left_them():
    """Gemma 3's sliding-window layers take the fed tokens too (and drop old ones): restored after each forward."""
    ids, caches = [int(i) for i in torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(5))], []
    for name in ("full", "kvzip"):
        engine = Engine(loaded_for(tiny_model("gemma3", layers=4)), build_method({"name": name}), 0.25)
        engine.prompt_format = PromptFormat(lambda text: [ord(c) % 128 for c in text])
        engine.generate(ids, 1)  # no decode step: the cache as prefill (and compression) left it
        caches.append(engine.last_state.cache.layers)
    assert engine.last_state.scoring.tokens > 60 and sorted(engine.last_state.results) == [1, 3]
    for i in (0, 2):  # sliding layers
        assert torch.equal(caches[0][i].keys, caches[1][i].keys) and caches[1][i].cumulative_length == 60
