"""KVzip (Kim et al., NeurIPS 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416; official code snu-mllab/KVzip).

A KV pair matters as much as the model needs it to repeat the context. After the prefill the model is prompted
to reconstruct it, chunk by chunk (``model/wrapper.py`` ``self_task``): for each chunk c_i of ≤ ``chunk_size``
context tokens the engine feeds ``repeat prompt (+ the last ``overlap`` tokens of c_{i-1}) + the template's tail +
c_i`` on top of the full cache (:mod:`kvbench.engine.reconstruct`). The score of pair t in layer l, KV head h is the most
attention any fed query of its GQA group gives it (``attention/score.py`` ``_get_score``)::

    S[l, h, t] = max_{g, i} softmax_{t' ∈ sinks ∪ c_i ∪ fed}( q_{(h,g), i} · k_{h, t'} / √d ),   t ∈ c_i

over the sink keys, the chunk's keys and the fed tokens' own (causal among those), softmax in the model's dtype.
KVzip+ (``plus``; kvpress ``kvzip_plus_normalization``) scales each weight by ||W_O^{(h,g)} v_t|| / ||h_i||
(h_i: query i's attention input) before the max.

Eviction (``attention/kvcache.py`` ``prune``), budget m tokens per KV head per layer, sinks included:

* ``level: pair`` (official default, the paper's non-uniform head budgets): one ranking of all pairs of all layers
  and KV heads; the L·H_kv·m best are kept.
* ``level: layer`` (kvpress ``layerwise=True``): each layer keeps its H_kv·m best, shared among its heads.
* ``level: pair_uniform`` (official ``pair-uniform``): each KV head keeps its own m best.
* ``level: head`` (official ``head``, paper Sec. 3: head score = max_t S[l, h, t]): whole KV heads in head-score
  order while L·H_kv·m pairs last; the other heads keep their sinks. The scores are this sample's (the official
  code can load head scores saved from another sample instead, then runs no reconstruction).

Sinks (``n_sink``): null: the template's head (system prompt, user header), never evicted and attended by every
reconstruction query, as the official code's system prompt; an integer s (kvpress: 4): the first s tokens, the
fed queries attend the first min(s, start) (kvpress's ``n_sink``). Heads keep different numbers of tokens: the
cache stores each head's own (:func:`methods.base.pack_kept`). Cost: about two prefills more; the record's
``reconstruct_s`` and ``reconstruct_tokens``. Differences from the official code and kvpress:
docs/METHODS.md#kvzip-methodkvzip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Optional, Sequence

import torch

from .allocation import keep_topk_per_head
from .base import (CompressResult, LayerContext, Method, MethodConfig, Plan, PromptFormat, Reconstruction,
                   ReconstructionContext, pack_kept, require)

FIRST = "\n\nRepeat the previous context exactly."  # model/wrapper.py self_task
NEXT = "\n\nRepeat the part of the previous context exactly, starting with "
NO_TEMPLATE_TAIL = "\n\nAnswer: "  # model/template.py for a model without a template


@dataclass
class KVzipConfig(MethodConfig):
    """KVzip settings.

    Attributes:
        level: ``pair``, ``layer``, ``pair_uniform`` or ``head`` (module docstring).
        plus: KVzip+ normalisation of the scores.
        chunk_size: context tokens reconstructed per forward (official 2000; kvpress 2048).
        overlap: tokens of the previous chunk quoted in the next repeat prompt (official ``prev_postfix_size``).
        n_sink: null (the template's head) or the number of first tokens kept as attention sinks (kvpress: 4).
    """

    level: Literal["pair", "layer", "pair_uniform", "head"] = "pair"
    plus: bool = False
    chunk_size: int = 2000
    overlap: int = 8
    n_sink: Optional[int] = None

    def check(self) -> None:
        require(self.chunk_size >= 1, "chunk_size", self.chunk_size, "must be an integer >= 1 (tokens)")
        require(self.overlap >= 0, "overlap", self.overlap, "must be an integer >= 0 (tokens)")
        require(self.n_sink is None or self.n_sink >= 0, "n_sink", self.n_sink, "must be null or an integer >= 0")


class KVzip(Method):
    """Context-reconstruction scores, one ranking over layers and heads (``level``), per-head storage."""

    Config = KVzipConfig
    per_head_lengths = True  # every level keeps each head's own tokens (pack_kept)

    def reconstruction(self, ids: Sequence[int], fmt: PromptFormat) -> Reconstruction:
        """One forward per chunk of the tokens after the template's head (official ``self_task``)."""
        c = self.config
        head = next((i for i, (a, b) in enumerate(zip(ids, fmt.head)) if a != b), min(len(ids), len(fmt.head)))
        tail = list(fmt.tail) or fmt.encode(NO_TEMPLATE_TAIL)
        first, after = fmt.encode(FIRST), fmt.encode(NEXT)
        inputs = []
        for start in range(head, len(ids), c.chunk_size):
            chunk = list(ids[start : start + c.chunk_size])
            prompt = first if start == head else after + list(ids[start - min(c.overlap, c.chunk_size) : start])
            inputs.append((prompt + tail + chunk, start, start + len(chunk)))
        return Reconstruction(inputs, head if c.n_sink is None else c.n_sink)

    def reconstruction_score(self, ctx: ReconstructionContext) -> torch.Tensor:
        """``(B, H_kv, end - start)``: the max over the GQA group and the fed queries of their attention to each chunk
        token, over the keys of the sinks, the chunk and the fed tokens (``_get_score``; KVzip+ as kvpress)."""
        q, keys, values = ctx.queries, ctx.keys, ctx.values
        b, h_kv, _, d = keys.shape
        fed, sink, length = q.shape[2], min(ctx.sinks, ctx.start), ctx.end - ctx.start
        pick = lambda x: torch.cat([x[:, :, :sink], x[:, :, ctx.start : ctx.end], x[:, :, -fed:]], dim=2)  # noqa: E731
        logits = q.view(b, h_kv, -1, fed, d) @ pick(keys).unsqueeze(2).transpose(-1, -2) / math.sqrt(d)
        logits[..., -fed:] += torch.full((fed, fed), torch.finfo(logits.dtype).min, device=q.device).triu(1)
        weights = torch.softmax(logits, dim=-1)[..., sink : sink + length]  # (B, H_kv, G, fed, length)
        if self.config.plus:  # ÷ ||h_i|| per row, × ||W_O^{(h,g)} v_t|| per column
            w_o = ctx.out_proj.view(ctx.out_proj.shape[0], h_kv, -1, d)  # (hidden, H_kv, G, d)
            v_out = torch.einsum("jhgi,bhti->bhgtj", w_o, values[:, :, ctx.start : ctx.end]).norm(dim=-1)
            weights = weights * (1 / ctx.hidden_norm).view(b, 1, 1, fed, 1) * v_out.unsqueeze(3)
        return weights.amax(dim=(2, 3))

    def allocate(self, plan: Plan, scores: Mapping[int, torch.Tensor], reconstruction: Reconstruction) -> Plan:
        """Per-head budgets ``(L, H_kv)`` from the scores (``level``); the sinks' scores are set to +inf."""
        layers = sorted(scores)
        for i in layers:
            scores[i][..., : reconstruction.sinks] = torch.inf
        s = torch.stack([scores[i][0] for i in layers])  # (L', H_kv, n): batch 1, the protocol's
        n_layers, h, n = s.shape
        sinks = min(reconstruction.sinks, n)
        m = torch.tensor([plan.layer_budgets[i] for i in layers], device=s.device)  # (L',) tokens per head
        level = self.config.level
        if level == "pair_uniform":
            counts = m.view(-1, 1).expand(n_layers, h)
        elif level == "head":  # as many whole heads, by head score, as the context pairs of the budget pay for
            whole = torch.tensor([[h * int(m.sum() - n_layers * sinks) // max(1, n - sinks)]], device=s.device)
            best = keep_topk_per_head(s[..., sinks:].amax(-1).view(1, 1, -1), whole.clamp(max=n_layers * h))
            counts = torch.where(best.view(n_layers, h), n, sinks)
        else:  # pair: one ranking of every layer's and head's pairs; layer: one per layer
            rows = s.view(1, 1, -1) if level == "pair" else s.view(1, n_layers, -1)
            keep = keep_topk_per_head(rows, (h * m).sum().view(1, 1) if level == "pair" else (h * m).view(1, -1))
            counts = keep.view(n_layers, h, n).sum(-1)
        budgets = torch.tensor(plan.layer_budgets, device=s.device).view(-1, 1).repeat(1, h)
        budgets[layers] = counts.clamp(sinks, n).to(budgets.dtype)
        return Plan(plan.layer_budgets, budgets, plan.compress)

    def compress(self, ctx: LayerContext) -> CompressResult:
        """Each KV head keeps its ``head_budget`` best-scored tokens (sinks first), packed per head; a prompt that is
        all template head (no reconstruction, no scores) is kept whole."""
        if ctx.reconstruction_scores is None:
            return CompressResult(ctx.keys, ctx.values)
        counts = ctx.head_budget.view(1, -1).expand(ctx.keys.shape[0], -1)
        return pack_kept(ctx.keys, ctx.values, keep_topk_per_head(ctx.reconstruction_scores, counts))
