"""kvbench's attention function, registered with transformers' ``AttentionInterface``.

The model is loaded with ``attn_implementation="kvbench"``; no global monkey-patching. Every
forward call (prefill and each decode step) runs the model's own modules and carries a
:class:`CompressionState` in its keyword arguments (``kvbench_state=...``), which transformers
passes down to every attention call.

* **Prefill** (``state.phase == "prefill"``): SDPA (chunked float32 attention when the model
  soft-caps logits, Gemma 2). Then each compressible layer's last W queries (the model's own,
  after q-norm and RoPE) and full cache go to the method (:class:`methods.base.LayerContext`);
  its result replaces the layer's cache. Nothing n×n is built.
* **Decode**: each compressed layer's additive logit bias ``(B, H_q, m)`` (compensation, and −inf
  on invalid padded slots of per-head variable-length caches) is added to the first m logits;
  decoded tokens get bias 0. GQA runs against the un-repeated cache: the G query heads of a KV
  head are G query rows of one SDPA call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from methods.base import CompressResult, HeadLayout, LayerContext, Method, Plan
from methods.lookm import attention_with_column_sums

from .kvcache import store_layer

ATTN_IMPLEMENTATION = "kvbench"
_PREFILL_CHUNK = 1024  # query rows per block in the soft-capping prefill path


@dataclass
class CompressionState:
    """Per-generation state of the compressed cache, passed to the attention function.

    Attributes:
        method, plan, layout: the compression method, its per-sample :class:`methods.base.Plan`,
            the model's head layout.
        cache: the transformers cache being filled.
        phase: ``prefill`` or ``decode``.
        results: per-layer :class:`CompressResult` of this sample (layer index → result).
        bias: per-layer decode bias ``(B, H_q, 1, m + max_new_tokens + 1)`` in the model dtype.
        compress_s: seconds spent in the method during prefill (synchronised on CUDA); a score
            computed inside the prefill attention (LOOK-M's ``fused_score``) counts as prefill.
        rotary: callable positions → (cos, sin) for methods that re-position keys.
        max_new_tokens: decode budget (tokens), the bias buffers' free slots.
        reference_decode: decode with :func:`grouped_attention` (float32 softmax; tests).
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

    @property
    def compressing(self) -> bool:
        return self.method is not None and self.plan is not None and self.plan.compress


def _apply_mask(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with transformers' mask applied (bool keep-mask or additive float)."""
    if mask is None:
        return logits
    return logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask


def grouped_attention(query, key, value, scaling: float, bias=None, mask=None, softcap=None, causal_offset=None):
    """Reference attention for GQA without repeating keys/values, float32 softmax.

    Args:
        query: ``(B, H_q, q, d)``; key, value: ``(B, H_kv, T, d)`` (query head h uses KV head h // G).
        scaling: logit scale; softcap: Gemma-2 logit soft-capping (``tanh(x/c)·c``).
        bias: optional additive ``(B, H_q, q or 1, T)`` logit bias.
        mask: optional transformers mask ``(B, 1, q, T)`` (bool keep-mask or additive float).
        causal_offset: without a mask, query row i (position ``causal_offset + i``) sees keys ``≤`` it.

    Returns:
        ``(B, q, H_q, d)`` (transformers' attention output layout).
    """
    b, h_q, q, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    logits = torch.matmul(query.reshape(b, h_kv, -1, d), key.transpose(-1, -2)).float() * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = _apply_mask(logits.view(b, h_q, q, t) + (bias if bias is not None else 0), mask)
    if causal_offset is not None and mask is None and q > 1:
        rows = torch.arange(q, device=key.device).unsqueeze(1) + causal_offset
        logits = logits.masked_fill(torch.arange(t, device=key.device) > rows, float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(value.dtype).view(b, h_kv, -1, t)
    return torch.matmul(probs, value).view(b, h_q, q, d).transpose(1, 2).contiguous()


def _prefill_attention(query, key, value, mask, scaling, softcap) -> torch.Tensor:
    """Prefill attention ``(B, q, H_q, d)``: SDPA with native GQA, or blocked float32 when soft-capping."""
    if not softcap:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             is_causal=mask is None and query.shape[2] > 1, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    q_len, t = query.shape[2], key.shape[2]
    return torch.cat([
        grouped_attention(query[:, :, s : s + _PREFILL_CHUNK], key, value, scaling, softcap=softcap,
                          mask=mask[:, :, s : s + _PREFILL_CHUNK] if mask is not None else None,
                          causal_offset=t - q_len + s)
        for s in range(0, q_len, _PREFILL_CHUNK)
    ], dim=1)


def _decode_attention(query, key, value, mask, scaling, softcap, bias_buf, reference=False) -> torch.Tensor:
    """Decode attention over the (compressed) cache with the layer's logit bias.

    One query token without soft-capping: the G query heads of each KV head are viewed as G
    query rows ``(B, H_kv, G, d)`` of one SDPA call against the un-repeated cache
    ``(B, H_kv, T, d)`` (no repeated keys/values); the bias ``(B, H_q, 1, T)`` views as
    ``(B, H_kv, G, T)`` (query head h = kv·G + g, transformers' ``repeat_kv`` order). Otherwise
    (``reference``, soft-capping, several query tokens): :func:`grouped_attention`.

    Args:
        query: ``(B, H_q, q, d)``; key, value: ``(B, H_kv, T, d)`` (views of a preallocated cache allowed).
        mask: transformers' mask ``(B, 1, q, T)`` (bool keep-mask or additive float) or None.
        bias_buf: the layer's bias buffer ``(B, H_q, 1, ≥ T)`` or None.

    Returns:
        ``(B, q, H_q, d)``.
    """
    b, h_q, q_len, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    bias = bias_buf[..., :t] if bias_buf is not None else None
    if reference or softcap or q_len > 1:
        return grouped_attention(query, key, value, scaling, bias=bias, mask=mask, softcap=softcap)
    attn_bias = bias.view(b, h_kv, h_q // h_kv, t) if bias is not None else None
    if mask is not None:  # (B, 1, 1, T) broadcasts over (B, H_kv, G, T)
        attn_bias = mask if attn_bias is None else _apply_mask(attn_bias, mask)
    rows = query.reshape(b, h_kv, h_q // h_kv, d)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attn_bias, scale=scaling)
    return out.reshape(b, 1, h_q, d)


def fuse_prompt_attention(method: Method, query, key, mask, softcap) -> bool:
    """Whether this prefill call computes the method's column sums with its output (LOOK-M):
    a whole causal prompt in one call (queries = keys, no mask), no soft-capping, and the
    method asks for it (``wants_prompt_attention``)."""
    return (mask is None and not softcap and query.shape[2] == key.shape[2] > 1
            and method.wants_prompt_attention(key.device))


def _compress_layer(state: CompressionState, module, query, key, value, scaling, softcap, prompt_attention=None) -> None:
    """Run the method on one layer at the end of prefill and write its result into the cache.

    ``prompt_attention``: ``(B, H_q, n)`` column sums from the prefill attention, or None.
    """
    sync = key.device.type == "cuda"
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    idx, n, plan = module.layer_idx, key.shape[2], state.plan
    w = min(state.method.window_size, n)
    ctx = LayerContext(
        layer_idx=idx, layout=state.layout, keys=key, values=value, window_queries=query[:, :, n - w :],
        scaling=float(scaling), budget=int(plan.layer_budgets[idx]), softcap=softcap,
        head_budget=plan.head_budgets[idx] if plan.head_budgets is not None else None,
        positions=torch.arange(n, device=key.device), rotary=state.rotary, artifacts=state.method.artifacts,
        prompt_attention=prompt_attention,
    )
    result = state.method.compress(ctx)
    # the cache keeps its own copy (room for the decoded tokens); the result points at it
    result.keys, result.values = store_layer(state.cache.layers[idx], result.keys, result.values)
    state.results[idx] = result
    if sync:
        torch.cuda.synchronize()
    state.compress_s += time.perf_counter() - t0


def kvbench_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                      kvbench_state: CompressionState | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function behind ``attn_implementation="kvbench"``.

    Args:
        module: the attention module (its ``layer_idx`` names the cache layer).
        query: ``(B, H_q, q, d)`` after q-norm and RoPE; key, value: ``(B, H_kv, T, d)``, the
            layer's whole cache after the update.
        attention_mask: transformers' mask for this layer (None when causal SDPA suffices).
        scaling: logit scale; softcap: Gemma-2 soft-capping.
        kvbench_state: the :class:`CompressionState` of this generation (None: plain attention), or
            a list of them in a shared prefill (:func:`kvbench.engine.prefill`).

    Returns:
        ``(attn_output (B, q, H_q, d), None)``.
    """
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    state = kvbench_state
    if isinstance(state, CompressionState) and state.phase == "decode":
        bias = state.bias.get(module.layer_idx)
        return _decode_attention(query, key, value, attention_mask, scaling, softcap, bias, state.reference_decode), None
    states = [s for s in (state if isinstance(state, list) else [state])  # a shared prefill passes several
              if s is not None and s.compressing and module.layer_idx in s.layout.compressible_layers]
    sums = None
    if states and fuse_prompt_attention(states[0].method, query, key, attention_mask, softcap):
        # LOOK-M's whole-prompt score comes out of this attention: one pass over QK^T, not two
        out, sums = attention_with_column_sums(query, key, value, scaling, softcap,
                                               getattr(states[0].method.config, "query_chunk", 512))
        out = out.transpose(1, 2).contiguous()
    else:
        out = _prefill_attention(query, key, value, attention_mask, scaling, softcap)
    for s in states:  # each compresses the layer into its own cache
        _compress_layer(s, module, query, key, value, scaling, softcap, sums)
    return out, None


def build_decode_bias(state: CompressionState, dtype: torch.dtype) -> None:
    """Turn per-layer method results into decode bias buffers ``(B, H_q, 1, m + max_new_tokens + 1)``.

    The bias is the method's logit bias (0 where absent) with −inf on invalid slots; the slots
    of decoded tokens get 0. Layers without bias or validity mask get no buffer (plain SDPA).
    """
    for idx, res in state.results.items():
        if res.logit_bias is None and res.valid is None:
            continue
        b, h_kv, m, _ = res.keys.shape
        bias = res.logit_bias.float() if res.logit_bias is not None else torch.zeros(b, h_kv, m, device=res.keys.device)
        if res.valid is not None:
            bias = bias.masked_fill(~res.valid.repeat_interleave(bias.shape[1] // res.valid.shape[1], dim=1),
                                    float("-inf"))
        bias = bias.repeat_interleave(state.layout.num_q_heads // bias.shape[1], dim=1)
        state.bias[idx] = F.pad(bias, (0, state.max_new_tokens + 1)).unsqueeze(2).to(dtype)


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
