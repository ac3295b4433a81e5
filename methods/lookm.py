"""LOOK-M, text-only (Wan et al., 2024, "LOOK-M: Look-Once Optimization in KV Cache for
Efficient Multimodal Long-Context Inference"), as the SelKV paper uses it as a baseline.

Eviction: every prompt token is scored by the attention it accumulates from the prompt's
queries (LOOK-M's H2O-style cumulative score; ``window_size`` > 0 restricts it to the last W
queries); the first ``n_sinks`` tokens and the most recent ``⌊f·m⌋`` tokens are always kept,
the remaining ``m − ⌊f·m⌋`` slots go to the highest scores (per KV head; GQA: scores averaged
over the group).

Merging (LOOK-M's compensation): each evicted key/value is merged into the kept token whose
key is most cosine-similar (its merge target t), as in the LOOK-M code
(``scatter_reduce(mean, include_self=True)``)::

    x_t ← (x_t + Σ_{j→t} w_j·c_j) / (1 + Σ_{j→t} w_j)

with the contribution c_j of evicted token j (x = key or value)

* ``avg``:      c_j = x_j
* ``pivot``:    c_j = (x_j + x_t) / 2          (pivotal merging, LOOK-M's headline variant)
* ``weighted``: c_j = s_j·x_j,  s_j = cos(k_j, k_t)

and w_j = 1, except that (a) the similarity filter of the reference code (on for ``avg`` and
``weighted``, off for ``pivot``) keeps only evicted slots whose head-mean max similarity is at
least the layer mean (w_j = 0 otherwise; the code compares the j-th evicted slot of every head),
and (b) ``gate: soft`` multiplies w_j by SelKV's soft cosine gate g_j = max(cos(v_j, v_t), 0)
(SelKV Eq. 4; g = 0 drops, g = 1 merges fully).

Cost: the whole-prompt score is the column sums of the causal attention matrix, H_q·d·n²/2
MACs per layer: a second pass over QK^T (:func:`cumulative_attention`), or with ``fused_score``
the prefill attention itself (:func:`attention_with_column_sums`, output and sums in one pass),
in query blocks sized for the device (:func:`block_elems`). In a bf16/fp16 model QK^T multiplies in
the model's dtype (on CUDA tensor cores, float32 accumulation and output: ``torch.bmm(out_dtype=float32)``);
a product of two bf16/fp16 values is exact in float32, so the logits differ from the float32 path's
only in summation order, and the scaling and softmax stay float32: not TF32, which is a process-wide
switch, nor bf16 logits, which round them.

Deviation from the reference code, on purpose: its ``avg`` variant pairs the filtered targets
with the first evicted rows (``src`` unfiltered, ``index`` filtered); here each filtered token
goes to its own target. Budget split: LOOK-M sets the heavy-hitter and recent shares as
fractions of n (0.1 + 0.1 in its scripts); here ``recent_fraction`` of the budget m is recent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .base import CompressResult, LayerContext, Method, MethodConfig, gather_tokens, require
from .merging import soft_cosine_gate
from .scoring import group_scores

_WHOLE_PROMPT = 1 << 40  # window_size=0: the engine caps W at n, i.e. every prompt query
# float32 logits per query block: 8 MiB on CPU (cache-sized), 512 MiB on CUDA (few large kernels)
BLOCK_ELEMS = {"cpu": 1 << 21, "cuda": 1 << 27}


@dataclass
class LookMConfig(MethodConfig):
    """LOOK-M hyper-parameters.

    Attributes:
        window_size: W, queries whose attention is accumulated; 0 = every prompt query (LOOK-M).
        recent_fraction: share of the budget m kept as the most recent tokens (LOOK-M: 0.5,
            hh_ratio = recent_ratio).
        n_sinks: first tokens always kept (LOOK-M code: 4).
        merge: ``avg``, ``pivot`` or ``weighted``.
        similarity_filter: ``auto`` (as the reference code: on for avg/weighted, off for pivot),
            ``on`` or ``off``.
        gate: ``none`` or ``soft`` (SelKV soft cosine gate on values).
        gqa_aggregation: ``mean`` or ``max`` over the G query heads of a KV head.
        query_chunk: at most this many queries per block when accumulating attention (tokens);
            blocks are also capped at :func:`block_elems` logits, which bounds memory.
        merge_chunk: evicted tokens per block when finding merge targets (bounds memory).
        fused_score: ``auto`` (on for a CPU prefill), ``on`` or ``off``: with ``window_size: 0``
            compute the same score inside the prefill attention (:func:`attention_with_column_sums`,
            one pass over QK^T instead of SDPA plus a second pass); ``auto`` leaves CUDA on SDPA.
    """

    window_size: int = 0
    recent_fraction: float = 0.5
    n_sinks: int = 4
    merge: Literal["avg", "pivot", "weighted"] = "pivot"
    similarity_filter: Literal["auto", "on", "off"] = "auto"
    gate: Literal["none", "soft"] = "none"
    gqa_aggregation: Literal["mean", "max"] = "mean"
    query_chunk: int = 512
    merge_chunk: int = 1024
    fused_score: Literal["auto", "on", "off"] = "auto"

    def check(self) -> None:
        require(self.window_size >= 0, "window_size", self.window_size, "must be an integer >= 0 (0 = whole prompt)")
        require(0.0 <= self.recent_fraction <= 1.0, "recent_fraction", self.recent_fraction, "must be in [0, 1]")
        require(self.n_sinks >= 0, "n_sinks", self.n_sinks, "must be an integer >= 0")
        for key in ("query_chunk", "merge_chunk"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "must be an integer >= 1")


def block_elems(device_type: str) -> int:
    """Float32 logits per query block on a device kind (``cpu``, ``cuda``, other: as CPU)."""
    return BLOCK_ELEMS.get(device_type, BLOCK_ELEMS["cpu"])


def _query_blocks(first: int, w: int, h_q: int, chunk: int, elems: int) -> list[tuple[int, int]]:
    """Query blocks ``[start, stop)`` (window rows) whose causal logits fit in ``elems`` floats.

    Row ``start`` of the window is at absolute position ``first + start``; a block of c rows
    sees ``first + stop`` keys, so it holds ``H_q · c · (first + stop)`` logits. Blocks get
    shorter as the prompt advances (each at least one row, at most ``chunk`` rows).
    """
    blocks, start = [], 0
    while start < w:
        rows = max(1, min(chunk, w - start, elems // (h_q * min(first + start + chunk, first + w))))
        blocks.append((start, start + rows))
        start += rows
    return blocks


def cumulative_attention(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None, chunk: int
) -> torch.Tensor:
    """Attention each key receives, summed over the given (last) prompt queries (H2O score).

    s_j = Σ_i softmax(q_i·K^T·scaling + causal mask)_j over the W query rows i (absolute
    positions n−W … n−1); with W = n (LOOK-M) every prompt query, i.e. the column sums of the
    whole causal attention matrix. Exact, in float32 (half-precision inputs: see the module's Cost). A block of query rows at positions
    ``[p, p + c)`` multiplies only the keys ``[0, p + c)`` it may see (the causal triangle);
    the G query heads of a KV head are rows of one matmul against un-repeated keys; blocks hold
    at most :func:`block_elems` logits for the device, in reused buffers.

    Args:
        queries: ``(B, H_q, W, d)``, the last W prompt queries after RoPE.
        keys: ``(B, H_kv, n, d)``.
        scaling, softcap: as in :func:`methods.scoring.window_attention`.
        chunk: at most this many query rows per block (tokens).

    Returns:
        ``(B, H_q, n)`` float32.
    """
    return _blocked_attention(queries, keys, None, scaling, softcap, chunk)[0]


def attention_with_column_sums(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, softcap: float | None, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prompt attention and, from the same probabilities, LOOK-M's cumulative score.

    One pass computes the prefill's ``softmax(QK^T·scaling + causal mask)·V`` and the column
    sums of the softmax matrix, bit-equal to :func:`cumulative_attention` with W = n (same
    blocks and float32 arithmetic): :meth:`LookM.prompt_attention`, which the engine calls when
    ``wants_prompt_attention`` is true.

    Args:
        query: ``(B, H_q, n, d)``, every prompt query after RoPE.
        key, value: ``(B, H_kv, n, d)``.
        scaling, softcap: as in :func:`methods.scoring.window_attention`.
        chunk: at most this many query rows per block (tokens).

    Returns:
        ``(out (B, H_q, n, d) in value's dtype, sums (B, H_q, n) float32)``.

    Raises:
        ValueError: if the query count differs from the key count (a prefill continuing a cache).
    """
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"attention_with_column_sums: {query.shape[2]} queries for {key.shape[2]} keys (must be equal)")
    total, out = _blocked_attention(query, key, value, scaling, softcap, chunk)
    return out.to(value.dtype), total


def _float32_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (float32) ← a @ b for float32 or half-precision a, b: on CUDA in their dtype with float32
    accumulation and output (tensor cores), elsewhere upcast (the same products: CPU has no such kernel)."""
    if a.dtype == torch.float32 or not a.is_cuda:
        torch.bmm(a.float(), b.float(), out=out)
    else:
        torch.bmm(a, b, out_dtype=torch.float32, out=out)


def _blocked_attention(queries, keys, values, scaling, softcap, chunk):
    """Column sums ``(B, H_q, n)`` and, when ``values`` is given, the output ``(B, H_q, W, d)``."""
    (b, h_q, w, d), (h_kv, n), dev = queries.shape, keys.shape[1:3], keys.device
    g, bh, first = h_q // h_kv, b * h_kv, n - w
    half = queries.dtype == keys.dtype and keys.dtype in (torch.bfloat16, torch.float16)  # QK^T in the model's dtype
    k = (keys if half else keys.float()).reshape(bh, n, d)
    q = (queries if half else queries.float()).reshape(bh, g, w, d)
    v = values.float().reshape(bh, n, d) if values is not None else None
    out = torch.empty(bh, g, w, d, device=dev) if v is not None else None
    if not softcap and not half:  # scale the W·d queries instead of the W·n logits (half: exact q, float32 logits)
        q = q * scaling
    blocks = _query_blocks(first, w, h_q, chunk, block_elems(dev.type))
    size = max(bh * g * (stop - start) * (first + stop) for start, stop in blocks)
    logits_buf, probs_buf = torch.empty(size, device=dev), torch.empty(size, device=dev)
    rows_max = max(stop - start for start, stop in blocks)
    ones = torch.ones(bh * g, 1, rows_max, device=dev)
    future = torch.ones(rows_max, rows_max, dtype=torch.bool, device=dev).triu_(1)  # its [:c, :c] is c×c's
    total = torch.zeros(bh * g, 1, n, dtype=torch.float32, device=dev)
    for start, stop in blocks:  # loop over query blocks, not tokens
        c, end = stop - start, first + stop
        logits = logits_buf[: bh * g * c * end].view(bh, g * c, end)
        _float32_bmm(q[:, :, start:stop].reshape(bh, g * c, d), k[:, :end].transpose(1, 2), logits)
        if softcap:
            logits.mul_(scaling / softcap).tanh_().mul_(softcap)
        elif half:
            logits.mul_(scaling)
        rows = logits.view(bh * g, c, end)
        rows[:, :, end - c :].masked_fill_(future[:c, :c], float("-inf"))
        probs = probs_buf[: bh * g * c * end].view(bh * g, c, end)
        torch.softmax(rows, dim=-1, out=probs)
        total[:, :, :end].baddbmm_(ones[:, :, :c], probs)  # column sums over the block's query rows
        if out is not None:
            out[:, :, start:stop] = torch.bmm(probs.view(bh, g * c, end), v[:, :end]).view(bh, g, c, d)
    return total.view(b, h_q, n), (out.view(b, h_q, w, d) if out is not None else None)


def nearest_kept(evicted_keys: torch.Tensor, kept_keys: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Most cosine-similar kept key of every evicted key (LOOK-M merge target); E·m·d MACs per head.

    Args:
        evicted_keys: ``(B, H, E, d)``; kept_keys: ``(B, H, m ≥ 1, d)``.
        chunk: evicted rows per block (memory ``B·H·chunk·m`` floats).

    Returns:
        ``(max_similarity (B, H, E) float32, target (B, H, E) long index into m)``.
    """
    kept = F.normalize(kept_keys.float(), dim=-1, eps=1e-6)
    best = [torch.matmul(F.normalize(ev.float(), dim=-1, eps=1e-6), kept.transpose(-1, -2)).max(dim=-1)
            for ev in evicted_keys.split(chunk, dim=2)]  # blocks of evicted tokens
    return torch.cat([s for s, _ in best], dim=-1), torch.cat([t for _, t in best], dim=-1)


def merge_into_targets(
    kept: torch.Tensor, evicted: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, merge: str, sim: torch.Tensor,
) -> torch.Tensor:
    """x_t ← (x_t + Σ_{j→t} w_j·c_j) / (1 + Σ_{j→t} w_j) for one of the LOOK-M variants.

    Args:
        kept: ``(B, H, m, d)`` kept rows (keys or values); evicted: ``(B, H, E, d)`` evicted rows.
        target: ``(B, H, E)`` long merge target of each evicted row; weight: ``(B, H, E)`` float32
            w_j (0 = not merged); merge: ``avg``, ``pivot`` or ``weighted``; sim: ``(B, H, E)``
            float32 cosine similarity to the target (``weighted``).

    Returns:
        ``(B, H, m, d)`` merged rows, in ``kept``'s dtype.
    """
    x_t, x_j = kept.float(), evicted.float()
    idx = target.unsqueeze(-1).expand_as(x_j)
    if merge == "avg":
        contrib = x_j
    elif merge == "pivot":
        contrib = (x_j + x_t.gather(2, idx)) / 2
    else:  # weighted
        contrib = sim.unsqueeze(-1) * x_j
    num = x_t.scatter_add(2, idx, weight.unsqueeze(-1) * contrib)
    den = torch.ones_like(x_t[..., :1]).scatter_add(2, target.unsqueeze(-1), weight.unsqueeze(-1))
    return (num / den).to(kept.dtype)


class LookM(Method):
    """Cumulative-attention eviction with cosine-nearest merging of the evicted tokens."""

    Config = LookMConfig

    @property
    def window_size(self) -> int:
        return self.config.window_size if self.config.window_size > 0 else _WHOLE_PROMPT

    def min_budget(self) -> int:
        return self.config.n_sinks + 1

    def wants_prompt_attention(self, device: torch.device) -> bool:
        """True for the whole-prompt score (``window_size: 0``) with ``fused_score`` on (auto: CPU)."""
        c = self.config
        return c.window_size == 0 and (c.fused_score == "on" or (c.fused_score == "auto" and device.type == "cpu"))

    def prompt_attention(self, query, key, value, scaling, softcap):
        return attention_with_column_sums(query, key, value, scaling, softcap, self.config.query_chunk)

    def select(self, ctx: LayerContext) -> torch.Tensor:
        """Keep mask ``(B, H_kv, n)``: sinks, top cumulative-attention tokens, recent tokens."""
        c = self.config
        n, m = ctx.n_tokens, min(ctx.budget, ctx.n_tokens)
        if ctx.prompt_attention is not None:  # computed with the prefill attention (same sums)
            scores = ctx.prompt_attention.clone()
        else:
            scores = cumulative_attention(ctx.window_queries, ctx.keys, ctx.scaling, ctx.softcap, c.query_chunk)
        scores = group_scores(scores, ctx.layout.num_kv_heads, c.gqa_aggregation)  # (B, H_kv, n)
        recent = min(int(m * c.recent_fraction), m)
        scores[..., : c.n_sinks] = float("inf")
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[..., n - recent :] = True
        if m > recent:
            keep.scatter_(-1, scores[..., : n - recent].topk(m - recent, dim=-1).indices, True)
        return keep

    def compress(self, ctx: LayerContext) -> CompressResult:
        c = self.config
        keep = self.select(ctx)
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices  # kept first, ascending
        m = int(keep[0, 0].sum())
        # (B, H, m), (B, H, E); the kept indices are stored in the result: a copy, not a view of all n
        kept_idx, evicted_idx = order[..., :m].clone(), order[..., m:]
        keys, values = gather_tokens(ctx.keys, kept_idx), gather_tokens(ctx.values, kept_idx)
        if evicted_idx.shape[-1] == 0:
            return CompressResult(keys=keys, values=values, kept_indices=kept_idx, stats={"merged": 0.0, "dropped": 0.0})
        ev_keys, ev_values = gather_tokens(ctx.keys, evicted_idx), gather_tokens(ctx.values, evicted_idx)
        sim, target = nearest_kept(ev_keys, keys, c.merge_chunk)  # (B, H, E)
        weight = torch.ones_like(sim)
        use_filter = c.similarity_filter == "on" or (c.similarity_filter == "auto" and c.merge != "pivot")
        if use_filter:  # reference code: slot-wise head-mean max similarity ≥ layer mean
            slot_mean = sim.mean(dim=1, keepdim=True)  # (B, 1, E)
            weight = weight * (slot_mean >= sim.mean(dim=(1, 2), keepdim=True)).float()
        if c.gate == "soft":
            weight = weight * soft_cosine_gate(ev_values, values.gather(2, target.unsqueeze(-1).expand_as(ev_values)))
        merged_keys = merge_into_targets(keys, ev_keys, target, weight, c.merge, sim)
        merged_values = merge_into_targets(values, ev_values, target, weight, c.merge, sim)
        n_merged = float((weight > 0).sum())
        return CompressResult(
            keys=merged_keys,
            values=merged_values,
            kept_indices=kept_idx,
            stats={"merged": n_merged, "dropped": float(weight.numel()) - n_merged},
        )
