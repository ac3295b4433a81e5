"""kvbench's attention function, registered with transformers' ``AttentionInterface`` as ``"kvbench"``.

Every forward (prefill, score, each decode step) runs the model's own modules and carries a :class:`CompressionState`
(``kvbench_state=...``) down to every attention call. Prefill: SDPA (blocked float32 when the model soft-caps), then
each compressible layer's last W queries and full cache go to the method, whose result replaces the layer's cache; a
method scoring by reconstruction is called in the score phase instead (:mod:`kvbench.engine.reconstruct`). Decode:
SDPA without a mask, the G query heads of a KV head as G query rows of the un-repeated cache (:func:`decode_backend`);
decode-time compression cuts a flagged forward's layers back to the budget (docs/DECODING.md, docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from methods.base import Budget, CompressResult, check_result, HeadLayout, LayerContext, Method, Plan, Reconstruction, ReconstructionContext

from kvbench.engine.kvcache import RaggedLayer, stack_ragged, store_layer, write_bias
from kvbench.engine.quantcache import QuantizedLayer

try:  # PyTorch's own flash varlen kernel (CUDA, fp16/bf16); no flash-attn package needed
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None

ATTN_IMPLEMENTATION = "kvbench"
#: SDPA backends decode may use (the engine's ``sdpa_kernel`` around its decode steps), in PyTorch's order. Not cuDNN:
#: its graph cache is keyed on the KV length, which grows every step (pytorch/pytorch#155958); choosing here needs no
#: process-wide ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` and leaves cuDNN to prefill, where PyTorch may prefer it.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_PREFILL_CHUNK = 1024  # query rows per block in the soft-capping prefill path


@dataclass
class Scoring:
    """A method's reconstruction pass (:mod:`kvbench.engine.reconstruct`): its forwards and what they collect.

    Attributes:
        reconstruction: what the method asked for (:meth:`methods.base.Method.reconstruction`); forward: index of the
            running forward in ``reconstruction.inputs``; scores: compressible layer → ``(B, H_kv, n)`` scores of the
            prefilled tokens (0 where none scored); scaling: compressible layer → its ``(scaling, softcap)``;
            hidden_norms: layer → ``(B, q)`` attention-input norms of the running forward (a pre-hook's);
            seconds: wall time of the forwards (synchronised on CUDA); tokens: tokens fed by them.
    """

    reconstruction: Reconstruction
    forward: int = 0
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    scaling: dict[int, tuple[float, float | None]] = field(default_factory=dict)
    hidden_norms: dict[int, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0


@dataclass
class CompressionState:
    """Per-generation state of the compressed cache, passed to the attention function.

    Attributes:
        method, plan, layout: the method, its per-sample :class:`methods.base.Plan`, the model's head layout.
        cache: the transformers cache being filled; phase: ``prefill``, ``score`` (reconstruction) or ``decode``.
        results: layer index → this sample's :class:`CompressResult`.
        compress_s: seconds in the method during prefill (CUDA synchronised); a score computed inside the prefill
            attention (LOOK-M's) counts as prefill, reconstruction forwards (``scoring``) as compression.
        rotary: callable positions → (cos, sin) for methods that re-position keys.
        reserve: free slots per head a compressed layer keeps for the tokens fed until the next compression (more are
            made when needed); reference_decode: decode with :func:`grouped_attention` (float32 softmax; tests).
        backends: the attention PyTorch chose, ``prefill`` (first call) and ``decode`` (:func:`decode_backends`).
        decode_budget: the token budget of decode-time compression, None when off; then ``queries`` holds each
            compressible layer's last ``window`` queries ``(B, H_q, ≤ window, d)``, ``compress_now`` flags the forward
            that compresses, ``compressions`` counts layer compressions, ``decode_compress_s`` their seconds; ``held``:
            the most tokens a layer's longest head held when cut; ``position``: the current forward's last position;
            ``cut_at_budget``: a layer holding exactly the budget is cut too (R-KV's update_kv, ``schedule=length``).
        scoring: the method's reconstruction pass, or None; reads: layer → slots its attention read in the running
            decode step, summed over KV heads (``Method.select``).
    """

    method: Method | None
    plan: Plan | None
    layout: HeadLayout
    cache: Any
    phase: str = "prefill"
    results: dict[int, CompressResult] = field(default_factory=dict)
    compress_s: float = 0.0
    rotary: Any = None
    reserve: int = 1
    reference_decode: bool = False
    backends: dict[str, Any] = field(default_factory=dict)
    decode_budget: Budget | None = None
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    window: int = 0
    compress_now: bool = False
    compressions: int = 0
    decode_compress_s: float = 0.0
    held: int = 0
    position: int = 0
    cut_at_budget: bool = False
    scoring: Scoring | None = None
    reads: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def compressing(self) -> bool:
        return self.method is not None and self.plan is not None and self.plan.compress


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
    (b, h_q, q, d), (h_kv, t) = query.shape, key.shape[1:3]
    logits = torch.matmul(query.reshape(b, h_kv, -1, d), key.transpose(-1, -2)).float() * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.view(b, h_q, q, t) + (bias if bias is not None else 0)
    if mask is not None:  # bool keep-mask or additive float
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
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
    return torch.cat([grouped_attention(query[:, :, s : s + _PREFILL_CHUNK], key, value, scaling, softcap=softcap,
                                        mask=mask[:, :, s : s + _PREFILL_CHUNK] if mask is not None else None,
                                        causal_offset=t - q_len + s) for s in range(0, q_len, _PREFILL_CHUNK)], dim=1)


def decode_backend(layer: Any, key: torch.Tensor, reference: bool = False) -> str:
    """The decode attention of a cache layer: ``reference`` (:func:`grouped_attention`), ``flash varlen`` (ragged
    heads, CUDA, fp16/bf16), ``sdpa per head`` (ragged heads elsewhere), ``sdpa, bias columns`` or ``sdpa``."""
    if reference or not isinstance(layer, RaggedLayer):
        return "reference" if reference else "sdpa, bias columns" if getattr(layer, "bias_rows", 0) else "sdpa"
    half = key.is_cuda and key.dtype in (torch.float16, torch.bfloat16)
    return "flash varlen" if half and varlen_attn is not None else "sdpa per head"


def sdpa_backend(query, key, value, **kwargs: Any) -> str:
    """The backend ``F.scaled_dot_product_attention(query, key, value, **kwargs)`` picks under the current
    ``sdpa_kernel`` settings (``torch._fused_sdp_choice``; nothing computed): ``flash_attention`` (CPU: its own
    kernel), ``efficient_attention``, ``cudnn_attention``, ``math`` or ``overrideable``."""
    return SDPBackend(torch._fused_sdp_choice(query, key, value, **kwargs)).name.lower()


def decode_backends(state: CompressionState) -> dict[str, str]:
    """The attention of one decode step on each kind of layer of ``state.cache`` (``per-head lengths``, ``quantized``:
    read back in full, ``bias columns``, ``uniform``), as :func:`_decode_attention` calls it: ``flash varlen``
    (ragged heads on CUDA), ``reference`` (float32 :func:`grouped_attention`), else :func:`sdpa_backend` of the
    step's SDPA call (a ragged layer's first head on CPU). Call it under the decode's ``sdpa_kernel`` settings."""
    out, g = {}, state.layout.num_q_heads // state.layout.num_kv_heads
    for layer in state.cache.layers:
        kind = ("per-head lengths" if isinstance(layer, RaggedLayer) else "quantized" if isinstance(
            layer, QuantizedLayer) else "bias columns" if getattr(layer, "bias_rows", 0) else "uniform")
        if kind in out or not isinstance(key := layer.keys, torch.Tensor):
            continue
        backend = decode_backend(layer, key, state.reference_decode)
        if backend.startswith("sdpa"):  # the step's SDPA call: G query rows per KV head, no mask
            key = (key[: layer.lens_host[0] + layer.decoded].view(1, 1, -1, key.shape[-1]) if kind == "per-head lengths"
                   else key.new_zeros(*key.shape[:2], 1, layer.width) if kind == "quantized" else key)  # as read back
            backend = sdpa_backend(key.new_zeros(*key.shape[:2], g, key.shape[-1]), key, key)
        out[kind] = backend
    return out


def dense_layer(layer: Any, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor):
    """A layer's decode content in the padded reference layout: keys, values ``(B, H_kv, T, d)`` and the
    additive bias ``(B, H_q, 1, T)`` (from the bias columns; −inf on padded slots of ragged heads) or None."""
    (b, h_q, _, d), r = query.shape, getattr(layer, "bias_rows", 0)
    key, value, valid = layer.padded() if isinstance(layer, RaggedLayer) else (key, value, None)
    h_kv, t = key.shape[1], key.shape[2]
    bias = key[..., d : d + r].float().transpose(-1, -2) * layer.bias_scale if r else key.new_zeros(b, h_kv, 1, t).float()
    if valid is not None:
        bias = bias.masked_fill(~valid.unsqueeze(2), float("-inf"))
    bias = bias.expand(b, h_kv, h_q // h_kv, t).reshape(b, h_q, 1, t) if r or valid is not None else None
    return key[..., :d], value[..., :d], bias


def _decode_attention(query, key, value, mask, scaling, softcap, layer=None, reference=False) -> torch.Tensor:
    """Decode attention ``(B, q, H_q, d)`` over a cache layer (key, value: what ``layer.update`` returned), no
    ``attn_mask`` built; equals :func:`grouped_attention` over :func:`dense_layer` within rounding. One query, no
    soft-capping: the G query heads of a KV head are G query rows ``(B, H_kv, G, d)`` (head h = kv·G + g), given a 1
    (or a one-hot over G) for the bias columns. Else (``reference``, soft-capping, q > 1, a mask on a ragged layer):
    the reference, q > 1 queries without ``mask`` causal per head (row i sees a head's first L − q + i + 1 slots)."""
    (b, h_q, q_len, d), ragged = query.shape, isinstance(layer, RaggedLayer)
    backend = decode_backend(layer, key, reference or bool(softcap) or q_len > 1 or (ragged and mask is not None))
    if backend == "reference":
        k, v, bias = dense_layer(layer, key, value, query)
        offset = None  # q > 1 (the query part, task.compress=context): causal from each head's own length
        if q_len > 1 and mask is None:
            lens = torch.tensor(layer.lens_host, device=k.device) + (layer.decoded - q_len) if ragged else None
            offset = k.shape[2] - q_len if lens is None else lens.view(b, -1, 1, 1).repeat_interleave(h_q // layer.shape[1], 1)
        if mask is not None and q_len == 1:  # Method.select's (B, H_kv, 1 or G, T), as (B, H_q, 1, T)
            mask = mask.expand(-1, -1, h_q // mask.shape[1], -1).reshape(b, h_q, 1, -1)
        return grouped_attention(query, k, v, scaling, bias=bias, mask=mask, softcap=softcap, causal_offset=offset)
    h_kv = layer.shape[1] if ragged else key.shape[1]
    rows, r = query.reshape(b, h_kv, h_q // h_kv, d), getattr(layer, "bias_rows", 0)
    if r:
        hot = rows.new_ones(h_q // h_kv, 1) if r == 1 else torch.eye(r, dtype=rows.dtype, device=rows.device)
        rows = F.pad(torch.cat([rows, hot.expand(b, h_kv, -1, -1)], -1), (0, key.shape[-1] - d - r))
    if backend == "flash varlen":
        out = varlen_attn(rows.reshape(b * h_kv, -1, rows.shape[-1]), key, value, layer.cu_q, layer.cu, 1,
                          layer.get_seq_length(), scale=scaling, enable_gqa=True, seqused_k=layer.lengths)
    elif ragged:  # 4-D views as in the uniform path (3-D inputs left ~6 MB more resident on CPU)
        rows, t, w = rows.reshape(b * h_kv, 1, -1, rows.shape[-1]), layer.decoded, key.shape[-1]
        out = torch.cat([F.scaled_dot_product_attention(rows[i : i + 1], key[s : s + n + t].view(1, 1, -1, w),
                                                         value[s : s + n + t].view(1, 1, -1, w), scale=scaling)
                         for i, (s, n) in enumerate(zip(layer.cu_host, layer.lens_host))])
    else:  # mask (B, H_kv, 1 or G, T) broadcasts over (B, H_kv, G, T)
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out[..., :d].reshape(b, 1, h_q, d)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` (seconds) once the work queued on ``device`` is done (CUDA synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def compress_layer(state: CompressionState, idx: int, query, key, value, scaling, softcap, **scores) -> None:
    """Run the method on layer ``idx`` (its prefill's last queries ``query``, its cache ``key``/``value``) and write
    its result into the cache. ``scores``: ``prompt_attention`` ``(B, H_q, n)`` column sums from the prefill
    attention, or ``reconstruction_scores`` ``(B, H_kv, n)`` (:class:`methods.base.LayerContext`)."""
    t0, n, plan, w = clock(key.device), key.shape[2], state.plan, min(state.method.window_size, key.shape[2])
    heads = None if plan.head_budgets is None else plan.head_budgets[idx]
    ctx = LayerContext(layer_idx=idx, layout=state.layout, keys=key, values=value, scaling=float(scaling),
                       window_queries=query[:, :, query.shape[2] - w :], budget=int(plan.layer_budgets[idx]),
                       softcap=softcap, head_budget=heads, positions=torch.arange(n, device=key.device),
                       rotary=state.rotary, artifacts=state.method.artifacts,
                       recompressed=state.decode_budget is not None, **scores)
    check_result(state.method, ctx, result := state.method.compress(ctx))
    # the cache keeps its own copy (room for the decoded tokens); the result points at it
    rows = 0 if result.logit_bias is None else result.logit_bias.shape[1] // key.shape[1]
    layer = store_layer(state.cache, idx, result.keys, result.values, result.valid, rows, float(scaling), state.reserve)
    result.keys, result.values = layer.keys, layer.values
    state.results[idx] = result
    state.compress_s += clock(key.device) - t0


def _compress_decode(state: CompressionState, idx: int, scaling: float, softcap: float | None, fed: int) -> None:
    """Cut layer ``idx`` back to the decode budget when it holds more (docs/DECODING.md): the method sees its whole
    cache (a layer with per-head lengths left-padded, ``LayerContext.valid``) and the buffered queries (the forward
    fed ``fed`` tokens); the kept tokens are stored anew, in the order returned, with ``state.reserve`` free slots."""
    layer, d = state.cache.layers[idx], state.layout.head_dim
    t0, dev = clock(layer.keys.device), layer.keys.device
    keys, values, valid = layer.padded(left=True) if isinstance(layer, RaggedLayer) else (  # a quantized layer: whole
        *(layer.dequantized() if isinstance(layer, QuantizedLayer) else (layer.keys, layer.values)), None)
    plan = state.method.plan(keys.shape[2], state.decode_budget, state.layout)
    state.held, w = max(state.held, keys.shape[2]), state.queries[idx].shape[2]
    if keys.shape[2] > plan.layer_budgets[idx] or state.cut_at_budget and keys.shape[2] == plan.layer_budgets[idx]:
        heads, pos = None if plan.head_budgets is None else plan.head_budgets[idx], state.position + 1
        ctx = LayerContext(layer_idx=idx, layout=state.layout, keys=keys[..., :d], values=values[..., :d],
                           window_queries=state.queries[idx], scaling=scaling, budget=int(plan.layer_budgets[idx]),
                           softcap=softcap, head_budget=heads, positions=torch.arange(pos - w, pos, device=keys.device),
                           rotary=state.rotary, artifacts=state.method.artifacts, valid=valid, decoding=fed,
                           recompressed=True)
        check_result(state.method, ctx, result := state.method.compress(ctx))
        store_layer(state.cache, idx, result.keys, result.values, result.valid, 0, scaling, state.reserve)
        state.compressions += 1
    state.decode_compress_s += clock(dev) - t0


def kvbench_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                      kvbench_state: CompressionState | None = None, row_out: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function behind ``attn_implementation="kvbench"``.

    Args:
        module: the attention module (its ``layer_idx`` names the cache layer).
        query: ``(B, H_q, q, d)`` after q-norm and RoPE; key, value: ``(B, H_kv, T, d)``, the layer's whole cache.
        attention_mask: transformers' mask for this layer (None when causal SDPA suffices).
        scaling: logit scale; softcap: Gemma-2 soft-capping.
        kvbench_state: the :class:`CompressionState` of this generation (None: plain attention), or a list of them:
            in a shared prefill (:func:`kvbench.engine.generate.prefill`), or one per row of a decode batch (key,
            value: lists, one per row: :class:`kvbench.engine.kvcache.RowsCache`; rows whose layers all have per-head
            lengths attend in one flash varlen call on CUDA, :func:`kvbench.engine.kvcache.stack_ragged`).
        row_out: a decode row's attention output, computed with the batch's (the row's other decode work done here).

    Returns:
        ``(attn_output (B, q, H_q, d), None)``.
    """
    idx, state = getattr(module, "layer_idx", None), kvbench_state
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(state, CompressionState) and state.phase == "score":
        out, sc = _prefill_attention(query, key, value, attention_mask, scaling, softcap), state.scoring
        if idx in state.layout.compressible_layers:  # the method's scores of this forward's positions [start, end)
            _, start, end = sc.reconstruction.inputs[sc.forward]  # key: the n prefilled tokens, then the q fed ones
            ctx = ReconstructionContext(idx, query, key, value, start, end, sc.reconstruction.sinks,
                                        sc.hidden_norms.pop(idx, None),
                                        getattr(getattr(module, "o_proj", None), "weight", None))
            scores = sc.scores.setdefault(idx, key.new_zeros(*key.shape[:2], key.shape[2] - query.shape[2]))
            scores[..., start:end] = state.method.reconstruction_score(ctx)
            sc.scaling[idx] = (float(scaling), softcap)
        return out, None
    if isinstance(state, list) and state[0].phase == "decode":  # a decode batch: each row on its own cache
        layers, out = [s.cache.layers[idx] for s in state], [None] * len(state)
        if (not softcap and query.shape[2] == 1 and not any(s.reference_decode or s.method.reads for s in state)
                and all(isinstance(x, RaggedLayer) for x in layers) and len({x.keys.shape[-1] for x in layers}) == 1
                and decode_backend(layers[0], key[0]) == "flash varlen"):  # one varlen call for all rows' heads
            stacked = stack_ragged(layers)
            out = _decode_attention(query, stacked.keys, stacked.values, None, scaling, None, stacked).split(1)
        return torch.cat([kvbench_attention(module, query[r : r + 1], key[r], value[r], None, scaling, dropout, softcap,
                                            s, out[r])[0] for r, s in enumerate(state)]), None
    if isinstance(state, CompressionState) and state.phase == "decode":
        layer = state.cache.layers[idx]
        # one query sees every key its layer caches (a sliding layer caches its window only): no mask; traced
        # (torch.compile), transformers builds an all-True one sized by layer 0's cache, wrong for per-layer budgets.
        # Several (the query part): transformers' mask on a sliding layer, else causal per head (_decode_attention)
        mask = attention_mask if query.shape[2] > 1 and getattr(layer, "is_sliding", False) else None
        if state.method.reads and query.shape[2] == 1 and idx in state.layout.compressible_layers:
            keep = state.method.select(LayerContext(  # sparse reading (Quest): the slots each query head reads
                idx, state.layout, key[..., : query.shape[-1]], value, query, float(scaling),
                int(state.plan.layer_budgets[idx]), softcap, decoding=1))
            if keep is not None:  # (B, H_kv, 1 or G, T): a KV head reads the union of its query heads' slots
                mask, state.reads[idx] = keep, keep.any(2).sum()
        out = row_out if row_out is not None else _decode_attention(query, key, value, mask, scaling, softcap, layer,
                                                                    state.reference_decode)
        if state.decode_budget is not None and idx in state.layout.compressible_layers:
            buf = torch.cat([state.queries[idx], query], 2)  # the last ``window`` (≥ 0) queries fed
            state.queries[idx] = buf[:, :, max(0, buf.shape[2] - state.window) :]
            if state.compress_now:
                _compress_decode(state, idx, float(scaling), softcap, query.shape[2])
        return out, None
    every = state if isinstance(state, list) else [state] if state is not None else []  # a shared prefill: several
    states = [s for s in every if s.compressing and s.scoring is None and idx in s.layout.compressible_layers]
    out, sums, own = None, None, every[0] if every else None  # a sparse prefill is never shared (prefill)
    if (own is not None and own.plan is not None and own.method.sparse_prefill and attention_mask is None
            and query.shape[2] > 1 and idx in own.layout.compressible_layers):
        out = own.method.prefill_attention(query, key, value, scaling, int(own.plan.layer_budgets[idx]))
    elif (states and attention_mask is None and not softcap and query.shape[2] == key.shape[2] > 1
          and states[0].method.wants_prompt_attention(key.device)):  # a whole causal prompt in one call
        # the method's whole-prompt score (LOOK-M's) comes out of this attention: one pass over QK^T, not two
        out, sums = states[0].method.prompt_attention(query, key, value, scaling, softcap)
    out = (_prefill_attention(query, key, value, attention_mask, scaling, softcap) if out is None
           else out.transpose(1, 2).contiguous())  # (B, H_q, q, d) from a method's
    for s in every:
        s.backends.setdefault("prefill", "blocked float32 (column sums)" if sums is not None else "blocked float32"
                              if softcap else sdpa_backend(query, key, value, attn_mask=attention_mask, enable_gqa=True,
                                                           is_causal=attention_mask is None and query.shape[2] > 1))
        if s.decode_budget is not None and idx in s.layout.compressible_layers:  # R-KV's query cache: the prompt's
            s.queries[idx] = query[:, :, max(0, query.shape[2] - s.window) :].clone()
    for s in states:  # each compresses the layer into its own cache
        compress_layer(s, idx, query, key, value, scaling, softcap, prompt_attention=sums)
    if (probe := getattr(module, "kvbench_probe", None)) is not None:  # kvbench.tools.calibrate's, after each call
        probe(module, query, key, value, scaling, out)
    return out, None


def attach_bias(state: CompressionState) -> None:
    """Write each compressed layer's final logit bias (after ``method.finalize``) into its bias columns."""
    for idx, res in state.results.items():
        if res.logit_bias is not None:
            write_bias(state.cache.layers[idx], res.logit_bias, state.layout.head_dim, res.valid)


def register() -> None:
    """Register ``kvbench`` with transformers' attention and mask interfaces, again at every call: importing kvpress
    wraps every attention function registered at that moment (kvbench's too), and a model built after that must
    still run kvbench's own."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_attention)
    ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] = kvbench_attention  # over kvpress's wrapper (its local mapping)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
