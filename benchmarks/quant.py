"""Quantized cache (kvbench/engine/quantcache.py): decode tokens/s and stored bytes at 2 and 4 bits vs the model dtype's
cache, full cache (no eviction), at 4k and 16k prompt tokens (``--lengths``; ``--quick``: 256 and 512). One prefill
per length; each width decodes from the prompt's cache stored at that width (``kvbench.engine.kvcache.store_layer``).
Target: the stored bytes equal the packed size computed from the layout. ``benchmarks/gpu_check.py`` runs
:func:`rows` too. On CPU the quantized cache decodes slower: every step reads the whole layer back (unpack,
scale, add) before attention, as transformers' ``QuantizedCache`` does; no fused kernel."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import torch

from .common import MB, BenchResult, Context, Target

NAME = "quant"
TITLE = "Quantized cache: decode speed and stored bytes at 2 and 4 bits vs the model dtype"
LENGTHS, QUICK_LENGTHS = [4096, 16384], [256, 512]
WIDTHS = [None, 4, 2]  # cache.bits; None: the model dtype
SPEC = dict(group_size=32, residual=128)  # conf/config.yaml's defaults


def packed_bytes(layout, n: int, bits: int | None, itemsize: int, group_size: int = 32, residual: int = 128) -> int:
    """Bytes of an n-token cache on every layer of ``layout``: at ``bits``, the quantized blocks' packed K and V codes,
    key scales and minima per channel and ``group_size`` tokens, value ones per token and ``group_size`` channels, and the
    full-precision residual (the last ``n mod residual`` tokens); None: n tokens in the model dtype."""
    d, per_layer = layout.head_dim, layout.num_kv_heads * layout.num_layers
    if bits is None:
        return per_layer * 2 * n * d * itemsize
    g = group_size
    q = n // (residual or g) * (residual or g)
    return per_layer * (2 * q * d * bits // 8 + 2 * (q // g) * d * itemsize + 2 * q * (d // g) * itemsize
                        + 2 * (n - q) * d * itemsize)


@torch.inference_mode()
def rows(loaded, lengths: list[int], new_tokens: int) -> list[dict]:
    """Per length and width: decode tokens/s (eager), stored cache bytes and their analytic packed size, the
    generated tokens. Random prompt ids (speed and bytes do not depend on them); the engine is warmed up first."""
    from kvbench.engine.generate import Engine, prefill
    from kvbench.engine.kvcache import preallocated_cache, store_layer
    from methods.full import FullCache

    engine, out = Engine(loaded, FullCache(layout=loaded.layout), 1.0), []
    vocab, itemsize = loaded.model.config.vocab_size, loaded.dtype.itemsize
    engine.generate(list(range(100, 164)), 2, stop_ids=[])  # lazy initialisation
    for n in lengths:
        ids = torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        engine.quant = None  # the prompt's cache in the model dtype, stored at each width below
        base = prefill([engine], ids, new_tokens)[0]
        for bits in WIDTHS:
            engine.quant = SimpleNamespace(bits=bits, **SPEC) if bits else None
            state = copy.copy(base.state)
            state.cache = preallocated_cache(loaded.model.config, new_tokens + 1, engine.quant)
            for i, layer in enumerate(base.state.cache.layers):
                store_layer(state.cache, i, layer.keys, layer.values, reserve=new_tokens + 1)
            r = engine.generate(ids, new_tokens, stop_ids=[], prefilled=dataclasses.replace(base, state=state))
            out.append({"tokens": n, "bits": bits, "decode_tok_s": r.decode_tok_s, "stored_bytes": r.cache_bytes_after,
                        "analytic_bytes": packed_bytes(loaded.layout, n, bits, itemsize, **SPEC),
                        "model_dtype_bytes": r.cache_bytes_before, "generated": r.tokens})
            engine.last_state = state = None
        base = None
    return out


def run(ctx: Context) -> BenchResult:
    s = ctx.settings
    lengths = s.prompt_lengths or (QUICK_LENGTHS if s.quick else LENGTHS)
    res = BenchResult(NAME, TITLE, headers=["prompt tokens", "cache", "decode tok/s", "speed vs model dtype",
                                            "stored MB", "stored / model dtype", "analytic MB"])
    data = rows(ctx.loaded, lengths, s.new_tokens)
    for r in data:
        ref = next(x for x in data if x["tokens"] == r["tokens"] and x["bits"] is None)
        res.rows.append([r["tokens"], f"{r['bits']}-bit" if r["bits"] else str(ctx.loaded.dtype).replace("torch.", ""),
                         r["decode_tok_s"], r["decode_tok_s"] / ref["decode_tok_s"], r["stored_bytes"] / MB,
                         r["stored_bytes"] / r["model_dtype_bytes"], r["analytic_bytes"] / MB])
    exact = [r for r in data if r["stored_bytes"] == r["analytic_bytes"]]
    res.targets.append(Target("stored bytes = analytic packed size (codes, scales, minima, residual)",
                              f"{len(exact)}/{len(data)} rows equal", "all", len(exact) == len(data)))
    res.data = {"rows": data, **SPEC}
    res.notes.append(f"Full cache, {s.new_tokens} generated tokens, eager decode; cache.group_size={SPEC['group_size']}, "
                     f"cache.residual={SPEC['residual']}; MB = 10^6 bytes; stored = all layers right after prefill.")
    return res
