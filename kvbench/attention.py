"""kvbench's attention function, registered with transformers' ``AttentionInterface``.

The model is loaded with ``attn_implementation="kvbench"``; no global monkey-patching. Each
forward call carries a :class:`CompressionState` in the model's keyword arguments
(``kvbench_state=...``), which transformers passes down to every attention call.

* **Prefill** (``state.phase == "prefill"``): attention is SDPA (or a chunked float32 path when
  the model soft-caps logits, Gemma 2). Then, for each compressible layer, the last W queries
  of the prompt — exactly the model's own queries after q-norm and RoPE, so every family's
  specifics are respected — and the full cache of the layer are handed to the method
  (:class:`methods.base.LayerContext`); its result replaces the layer's cache. Nothing n×n is
  built: the window attention is ``(H_q, W, n)``.
* **Decode**: each compressed layer's additive logit bias ``(B, H, m)`` (compensation, and −inf
  on invalid padded slots of per-head variable-length caches) is added to the first m
  positions' logits; tokens appended during decoding get bias 0. Grouped-query attention runs
  against the un-repeated cache (each GQA group's queries as rows of one SDPA call), never
  materialising repeated keys/values; on CPU, long caches are split into key chunks merged by
  log-sum-exp (:func:`_split_kv_attention`) so that every thread streams keys. The cache is
  preallocated (:mod:`kvbench.kvcache`): a decode step writes its key/value in place instead of
  copying the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from methods.base import CompressResult, HeadLayout, LayerContext, Method, Plan
from methods.lookm import attention_with_column_sums

from . import cpu_decode
from .kvcache import store_layer

ATTN_IMPLEMENTATION = "kvbench"
_PREFILL_CHUNK = 1024  # query rows per block in the soft-capping prefill path
# Split-KV decode on CPU (see _split_kv_attention): from this many cached tokens on (measured:
# no gain at 2k on SmolLM2-135M, 2 threads; 12 % of the attention time at 4k and 8k).
SPLIT_KV_MIN_TOKENS = 3072
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class CompressionState:
    """Per-generation state of the compressed cache, passed to the attention function.

    Attributes:
        method: the compression method (None for no compression).
        plan: the per-sample :class:`methods.base.Plan`.
        layout: the model's head layout.
        cache: the ``DynamicCache`` being filled.
        phase: ``prefill`` or ``decode``.
        results: per-layer :class:`CompressResult` of this sample (layer index → result).
        bias: per-layer decode bias ``(B, H, 1, m + max_new_tokens)`` in the query dtype.
        compress_s: seconds spent in the method during prefill (wall clock, synchronised); a
            score computed inside the prefill attention (LOOK-M's ``fused_score``) counts as
            prefill, not here.
        rotary: callable positions → (cos, sin) for methods that re-position keys.
        max_new_tokens: decode budget (tokens), the bias buffers' free slots.
        reference_decode: decode with :func:`grouped_attention` instead of the fast path (tests).
        last_row_layer: index of the layer whose prefill attention output is needed for the
            prompt's last token only (the model's last layer, see
            :func:`kvbench.engine.last_row_prefill`), or None.
    """

    method: Method | None
    plan: Plan | None
    layout: HeadLayout
    cache: Any
    phase: str = "prefill"
    results: dict[int, CompressResult] = field(default_factory=dict)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    compress_s: float = 0.0
    rotary: Any = None
    max_new_tokens: int = 0
    reference_decode: bool = False
    last_row_layer: int | None = None

    @property
    def compressing(self) -> bool:
        return self.method is not None and self.plan is not None and self.plan.compress


def _apply_mask(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return logits
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask, float("-inf"))
    return logits + mask


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    causal_offset: int | None = None,
) -> torch.Tensor:
    """Reference attention for GQA without repeating keys/values, float32 softmax.

    Args:
        query: ``(B, H_q, q, d)``.
        key, value: ``(B, H_kv, T, d)``.
        scaling: logit scale.
        bias: optional additive ``(B, H_q, q or 1, T)`` logits bias.
        mask: optional transformers mask ``(B, 1, q, T)`` (bool keep-mask or additive float).
        softcap: Gemma-2 logit soft-capping.
        causal_offset: if given, query row i (absolute position ``causal_offset + i``) sees keys
            ``j <= causal_offset + i`` (used when no mask is passed in prefill).

    Returns:
        ``(B, q, H_q, d)`` (transformers' attention output layout).
    """
    b, h_q, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = h_q // h_kv
    qg = query.reshape(b, h_kv, g * q, d)
    logits = torch.matmul(qg, key.transpose(-1, -2)).float().view(b, h_kv, g, q, t) * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.view(b, h_q, q, t)
    if bias is not None:
        logits = logits + bias
    logits = _apply_mask(logits, mask)
    if causal_offset is not None and mask is None and q > 1:
        rows = torch.arange(q, device=key.device).unsqueeze(1) + causal_offset
        cols = torch.arange(t, device=key.device).unsqueeze(0)
        logits = logits.masked_fill(cols > rows, float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(value.dtype).view(b, h_kv, g * q, t)
    out = torch.matmul(probs, value).view(b, h_q, q, d)
    return out.transpose(1, 2).contiguous()


def _prefill_attention(module, query, key, value, mask, scaling, softcap) -> torch.Tensor:
    """Prefill attention: SDPA with native GQA, or chunked float32 attention when soft-capping."""
    if not softcap:
        is_causal = mask is None and query.shape[2] > 1
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, is_causal=is_causal, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous()
    q_len, t = query.shape[2], key.shape[2]
    outs = []
    for start in range(0, q_len, _PREFILL_CHUNK):
        stop = min(q_len, start + _PREFILL_CHUNK)
        m = mask[:, :, start:stop] if mask is not None else None
        outs.append(
            grouped_attention(
                query[:, :, start:stop], key, value, scaling, mask=m, softcap=softcap, causal_offset=t - q_len + start
            )
        )
    return torch.cat(outs, dim=1)


def _decode_attention(query, key, value, mask, scaling, softcap, bias_buf, reference=False) -> torch.Tensor:
    """Decode attention over the (compressed) cache with the layer's logit bias.

    The fast path (one query token, no soft-capping) views the G query heads of each KV head
    as G query rows, ``(B, H_kv, G, d)``, and calls SDPA against the un-repeated cache
    ``(B, H_kv, T, d)``: no repeated keys/values, no GQA broadcast inside SDPA (measured
    fastest on CPU for q_len=1, ahead of SDPA ``enable_gqa`` and of a grouped matmul); on CPU in
    float32 without a mask, the compiled kernel :func:`kvbench.cpu_decode.attention` computes the
    same (split-K online softmax, read at close to the machine's bandwidth) when it is built. Query
    head h belongs to KV head h // G (transformers' ``repeat_kv`` order), so the bias
    ``(B, H_q, 1, T)`` views as ``(B, H_kv, G, T)``. ``reference=True``, soft-capping or
    several query tokens take :func:`grouped_attention` (float32 softmax).

    Args:
        query: ``(B, H_q, q, d)``; key, value: ``(B, H_kv, T, d)`` (views of a preallocated cache allowed).
        mask: transformers' mask ``(B, 1, q, T)`` (bool keep-mask or additive float) or None.
        bias_buf: the layer's bias buffer ``(B, H_q, 1, m + max_new)`` or None.

    Returns:
        ``(B, q, H_q, d)``.
    """
    b, h_q, q_len, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    bias = bias_buf[..., :t] if bias_buf is not None else None
    if reference or softcap or q_len > 1:
        return grouped_attention(query, key, value, scaling, bias=bias, mask=mask, softcap=softcap)
    g = h_q // h_kv
    rows = query.reshape(b, h_kv, g, d)  # (B, H_kv, G, d): the GQA group as query rows
    attn_bias = bias.view(b, h_kv, g, t) if bias is not None else None
    if mask is not None:  # (B, 1, 1, T) broadcasts over (B, H_kv, G, T)
        if attn_bias is None:
            attn_bias = mask
        elif mask.dtype == torch.bool:
            attn_bias = attn_bias.masked_fill(~mask, float("-inf"))
        else:
            attn_bias = attn_bias + mask
    if key.device.type == "cpu" and mask is None and key.dtype == torch.float32:
        kernels = cpu_decode.load()
        out = cpu_decode.attention(kernels, rows, key, value, attn_bias, scaling) if kernels is not None else None
        if out is not None:
            return out.reshape(b, 1, h_q, d)
    chunks = split_kv_chunks(b * h_kv, t) if key.device.type == "cpu" else 1
    if chunks > 1 and (attn_bias is None or attn_bias.is_floating_point()):
        out = _split_kv_attention(rows, key, value, attn_bias, scaling, chunks)
    else:
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attn_bias, scale=scaling)  # (B, H_kv, G, d)
    return out.reshape(b, 1, h_q, d)


def split_kv_chunks(heads: int, t: int) -> int:
    """Number of key chunks for :func:`_split_kv_attention` (1: no split).

    PyTorch's CPU flash attention runs one task per (batch, head) pair of the call: with 3 KV
    heads on 2 threads one thread reads two heads' keys while the other idles half the time.
    Splitting the keys into C chunks gives ``heads·C`` tasks; C is the smallest ≥ 2 with a
    multiple of the thread count and at least two tasks per thread. No split below
    :data:`SPLIT_KV_MIN_TOKENS` cached tokens, on one thread, or without the CPU flash kernel.

    Args:
        heads: ``B·H_kv`` (batch × KV heads).
        t: cached tokens.
    """
    threads = torch.get_num_threads()
    if _FLASH_CPU is None or t < SPLIT_KV_MIN_TOKENS or threads < 2:
        return 1
    c = 2
    while c < 2 * threads and ((heads * c) % threads or heads * c < 2 * threads):
        c += 1
    return c


def _flash_part(query, key, value, bias, chunks: int, size: int, scaling: float):
    """One flash call over ``chunks`` consecutive key chunks of ``size`` tokens each.

    query ``(B, H, G, d)``; key/value ``(B, H, chunks·size, d)`` (views allowed); bias ``(B, H|1,
    G|1, chunks·size)`` or None. Returns ``out (B·H, chunks, G, d)`` and ``lse (B·H, chunks, G)``
    (float32 natural-log sum of exp of the scaled, biased logits, −inf for a chunk whose keys
    are all masked: the kernel itself reports 0 there).
    """
    b, h, g, d = query.shape
    q = query.unsqueeze(2).expand(b, h, chunks, g, d).flatten(0, 1)  # (B·H, C, G, d)
    k = key.unflatten(2, (chunks, size)).flatten(0, 1)  # (B·H, C, n, d), a view of the cache
    v = value.unflatten(2, (chunks, size)).flatten(0, 1)
    m = None
    if bias is not None:
        m = bias.unflatten(-1, (chunks, size)).movedim(3, 2)  # (B, H|1, C, G|1, n)
        m = m.expand(b, h, chunks, g, size).flatten(0, 1)  # (B·H, C, G, n)
    out, lse = _FLASH_CPU(q, k, v, attn_mask=m, scale=scaling)
    if m is not None:
        lse = lse.masked_fill(torch.isneginf(m).all(-1), float("-inf"))
    return out, lse


def _split_kv_attention(rows, key, value, attn_bias, scaling: float, chunks: int) -> torch.Tensor:
    """Decode attention with the keys split into chunks, merged by log-sum-exp (flash-decoding).

    Each chunk's attention ``o_c`` and log-sum-exp ``l_c`` come from PyTorch's CPU flash kernel
    (the one ``F.scaled_dot_product_attention`` calls); the result is
    ``Σ_c softmax_c(l)·o_c``, which is the softmax over all keys (Dao et al. 2023,
    "Flash-Decoding for long-context inference"). Equal to one SDPA call within float32
    rounding (tests: ``tests/kvbench/test_decode_fastpath.py``).

    Args:
        rows: ``(B, H_kv, G, d)`` queries (a GQA group's heads as rows).
        key, value: ``(B, H_kv, T, d)``, views of the preallocated cache allowed.
        attn_bias: additive float ``(B, H_kv|1, G|1, T)`` or None (−inf: masked).
        chunks: key chunks (:func:`split_kv_chunks`); tokens beyond ``chunks·⌊T/chunks⌋`` get a call of their own.

    Returns:
        ``(B, H_kv, G, d)`` in the query dtype.
    """
    b, h, g, d = rows.shape
    t = key.shape[2]
    size = t // chunks
    main = size * chunks
    out, lse = _flash_part(rows, key[:, :, :main], value[:, :, :main],
                           attn_bias[..., :main] if attn_bias is not None else None, chunks, size, scaling)
    if main < t:
        o2, l2 = _flash_part(rows, key[:, :, main:], value[:, :, main:],
                             attn_bias[..., main:] if attn_bias is not None else None, 1, t - main, scaling)
        out, lse = torch.cat((out, o2), dim=1), torch.cat((lse, l2), dim=1)
    weights = torch.softmax(lse, dim=1).unsqueeze(-1)  # (B·H, C, G, 1)
    merged = (out.float() * weights).sum(dim=1)  # float32 merge (a no-op cast for float32)
    return merged.to(rows.dtype).view(b, h, g, d)


def fuse_prompt_attention(method: Method, query: torch.Tensor, key: torch.Tensor, mask, softcap) -> bool:
    """Whether this prefill call computes the method's column sums with the attention output.

    Args: the method, ``query (B, H_q, q, d)``, ``key (B, H_kv, T, d)``, the layer's mask
    (None when causal SDPA suffices) and soft-capping value of one prefill attention call.

    Only for a whole causal prompt in one call (queries = keys, no mask: transformers passes
    none when causal SDPA suffices) without soft-capping, and when the method asks for it.
    """
    return (mask is None and not softcap and query.shape[2] == key.shape[2] > 1
            and method.wants_prompt_attention(key.device))


def fused_prefill_attention(method: Method, query, key, value, scaling: float, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill attention of :func:`fuse_prompt_attention`'s case, with the method's column sums.

    :func:`methods.lookm.attention_with_column_sums` with the method's ``query_chunk`` and ``kernel``.

    Returns:
        ``(out (B, q, H_q, d), sums (B, H_q, n) float32)``: the output as the attention
        function returns it, the sums as ``LayerContext.prompt_attention``.
    """
    out, sums = attention_with_column_sums(query, key, value, scaling, softcap,
                                           getattr(method.config, "query_chunk", 512),
                                           getattr(method.config, "kernel", "auto"))
    return out.transpose(1, 2).contiguous(), sums


def _compress_layer(state: CompressionState, module, query, key, value, scaling, softcap, prompt_attention=None) -> None:
    """Run the method on one layer at the end of prefill and write its result into the cache.

    ``prompt_attention``: ``(B, H_q, n)`` column sums from the prefill attention, or None.
    """
    layer_idx = module.layer_idx
    sync = key.device.type == "cuda"
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = key.shape[2]
    w = min(state.method.window_size, n)
    plan = state.plan
    ctx = LayerContext(
        layer_idx=layer_idx,
        layout=state.layout,
        keys=key,
        values=value,
        window_queries=query[:, :, n - w :] if w > 0 else query[:, :, :0],
        scaling=float(scaling),
        budget=int(plan.layer_budgets[layer_idx]),
        softcap=softcap,
        head_budget=plan.head_budgets[layer_idx] if plan.head_budgets is not None else None,
        positions=torch.arange(n, device=key.device),
        rotary=state.rotary,
        artifacts=state.method.artifacts,
        prompt_attention=prompt_attention,
    )
    result = state.method.compress(ctx)
    # The cache keeps its own copy (a preallocated buffer with room for the decoded tokens);
    # the result points at it so that the method's tensors can be freed.
    result.keys, result.values = store_layer(state.cache.layers[layer_idx], result.keys, result.values)
    state.results[layer_idx] = result
    if sync:
        torch.cuda.synchronize()
    state.compress_s += time.perf_counter() - t0


def kvbench_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    kvbench_state: CompressionState | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function behind ``attn_implementation="kvbench"``.

    Args:
        module: the attention module (its ``layer_idx`` names the cache layer).
        query: ``(B, H_q, q, d)`` after q-norm and RoPE.
        key, value: ``(B, H_kv, T, d)``, the whole cache of the layer after the update.
        attention_mask: transformers' mask for this layer (None when causal SDPA suffices).
        scaling: logit scale; softcap: Gemma-2 soft-capping.
        kvbench_state: the :class:`CompressionState` of this generation (None: plain attention).

    Returns:
        ``(attn_output (B, q, H_q, d), None)``.
    """
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    state = kvbench_state
    if state is None or state.phase == "prefill":
        compress = state is not None and state.compressing and module.layer_idx in state.layout.compressible_layers
        # The model's last layer: only the last prompt token's output reaches the logits.
        last_only = state is not None and state.last_row_layer == module.layer_idx and query.shape[2] > 1
        sums = None
        if compress and fuse_prompt_attention(state.method, query, key, attention_mask, softcap):
            # the method's whole-prompt score comes out of this attention (LOOK-M): one pass, not two
            out, sums = fused_prefill_attention(state.method, query, key, value, scaling, softcap)
            if last_only:
                out = out[:, -1:]
        elif last_only:
            mask = attention_mask[:, :, -1:] if attention_mask is not None else None
            out = _prefill_attention(module, query[:, :, -1:], key, value, mask, scaling, softcap)
        else:
            out = _prefill_attention(module, query, key, value, attention_mask, scaling, softcap)
        if compress:
            _compress_layer(state, module, query, key, value, scaling, softcap, sums)
        if last_only:
            # (B, q, H_q, d) as the module expects; every row is the last token's (a stride-0
            # view; the module's o_proj reads only the last row under last_row_prefill)
            out = out.expand(out.shape[0], query.shape[2], *out.shape[2:])
        return out, None
    out = _decode_attention(
        query, key, value, attention_mask, scaling, softcap, state.bias.get(module.layer_idx), state.reference_decode
    )
    return out, None


def build_decode_bias(state: CompressionState, dtype: torch.dtype) -> None:
    """Turn per-layer method results into decode-time bias buffers ``(B, H, 1, m + max_new)``.

    The bias is the method's logit bias (0 where absent) with −inf on invalid slots; positions
    appended during decoding get 0. Layers without bias or mask get no buffer (plain SDPA).
    """
    g = state.layout.group_size
    for idx, res in state.results.items():
        if res.logit_bias is None and res.valid is None:
            continue
        b, h_kv, m, _ = res.keys.shape
        bias = res.logit_bias.float() if res.logit_bias is not None else torch.zeros(b, h_kv, m, device=res.keys.device)
        if res.valid is not None:
            valid = res.valid
            if bias.shape[1] != valid.shape[1]:
                valid = valid.repeat_interleave(bias.shape[1] // valid.shape[1], dim=1)
            bias = bias.masked_fill(~valid, float("-inf"))
        if bias.shape[1] != state.layout.num_q_heads:
            bias = bias.repeat_interleave(g, dim=1)
        buf = F.pad(bias, (0, state.max_new_tokens + 1)).unsqueeze(2)  # (B, H_q, 1, m + new)
        state.bias[idx] = buf.to(dtype)


_registered = False


def register() -> None:
    """Register ``kvbench`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True
