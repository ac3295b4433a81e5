"""Quest (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Quest keeps the whole cache and reads a query-dependent part of it at every decode step. The cache of a layer is cut
into pages of P = ``page_size`` consecutive tokens (page j holds positions [jP, (j+1)P), the last one partial); page j
is summarised by the per-channel minimum m_j and maximum M_j of its keys, and the current query q bounds every q·k of
the page from above by

    U_j = Σ_i max(q_i · M_{j,i}, q_i · m_{j,i})                                   (paper Sec. 3.2, Alg. 1)

(Quest's evaluation code: ``sign(q)·k`` maxed over the page, times ``|q|``; sign(0) = −1). Each query head reads the top
k = min(max(3, ⌊B/P⌋), pages) pages by U (``evaluation/quest_attention.py``'s ``local_heavy_hitter_mask``, B the
token budget), plus the current (last) page (``current_page``: the page Quest's kernels always read; false: the
evaluation code exactly), so a step reads at most max(3P, B) + P tokens per query head. With GQA (G > 1 query heads
per KV head) every query head chooses its own pages (``per_query_head``), as the reference does: Quest's evaluation
code and MInference's quest path (SCBench) repeat the keys to the query heads before the bound (``repeat_kv``), and
Quest's kernels are MHA only; a KV head then reads the union of its query heads' pages (``read_tokens``). False: one
set per KV head, ranked by its query heads' largest bound. The first ``dense_layers`` layers and every forward of
more than one token (prefill, the query part) read everything (``layer_id < 2``, ``q_len > 1`` in the reference).

The engine calls :meth:`Quest.select` at each decode step of every compressible layer (``Method.reads``) and masks
the attention to the chosen slots; nothing is evicted, unless ``keep`` is set: SnapKV (W=32, K=5, avg pooling)
then keeps ``keep`` prompt tokens per KV head at the end of prefill and Quest reads pages of what it kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .base import Budget, CompressResult, HeadLayout, LayerContext, Method, MethodConfig, Plan, require


@dataclass
class QuestConfig(MethodConfig):
    """Attributes:
        page_size: P, tokens per page (Quest's ``chunk_size``; its scripts: 16).
        dense_layers: the first layers that read the whole cache (Quest's evaluation: 2).
        current_page: the page of the current token is always read (Quest's kernels); false: it competes.
        keep: prompt tokens per KV head SnapKV keeps first (> its window of 32), or null: the whole prompt.
        per_query_head: with GQA each query head reads its own top pages (the reference: keys repeated); false: a KV
            head's query heads share one set, ranked by their largest bound. MHA: the same pages either way.
    """

    page_size: int = 16
    dense_layers: int = 2
    current_page: bool = True
    keep: int | None = None
    per_query_head: bool = True

    def check(self) -> None:
        require(self.page_size >= 1, "page_size", self.page_size, "must be an integer >= 1")
        require(self.dense_layers >= 0, "dense_layers", self.dense_layers, "must be an integer >= 0")
        require(self.keep is None or self.keep > 32, "keep", self.keep, "must be an integer > 32 (SnapKV's window) or null")


def page_bounds(query: torch.Tensor, keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Quest's bound U ``(B, H_kv, G, pages)`` of every page for each query head g of each KV head (query head
    kv·G + g) for one query ``(B, H_q, 1, d)`` over keys ``(B, H_kv, T, d)``,
    float32: ``|q| · S`` with S_i = M_i where q_i > 0, else −m_i (= max over the page of sign(q_i)·k_i, as the
    reference computes it; M, m over the page's tokens only)."""
    (b, h_kv, _, d), pad = keys.shape, -keys.shape[2] % page_size
    fill = torch.finfo(keys.dtype)
    top = F.pad(keys, (0, 0, 0, pad), value=fill.min).unflatten(2, (-1, page_size)).amax(3)  # M (B, H_kv, pages, d)
    low = F.pad(keys, (0, 0, 0, pad), value=fill.max).unflatten(2, (-1, page_size)).amin(3)  # m
    q = query.view(b, h_kv, -1, 1, d)  # (B, H_kv, G, 1, d)
    signed = torch.where(q > 0, top.unsqueeze(2), -low.unsqueeze(2))  # (B, H_kv, G, pages, d)
    return torch.matmul(q.abs().float(), signed.float().transpose(-1, -2)).squeeze(3)


def select_pages(bounds: torch.Tensor, budget: int, page_size: int, t: int, current_page: bool) -> torch.Tensor:
    """``(..., t)`` bool: the tokens of the top min(max(3, ⌊budget/P⌋), pages) pages of ``bounds`` ``(..., pages)``
    (and the last page when ``current_page``)."""
    pages = bounds.shape[-1]
    k = min(max(3, min(t, budget) // page_size), pages)
    top = bounds.topk(k, dim=-1).indices
    chosen = torch.zeros_like(bounds, dtype=torch.bool).scatter_(-1, top, True)
    if current_page:
        chosen[..., -1] = True
    return chosen.repeat_interleave(page_size, -1)[..., :t]


class Quest(Method):
    """Whole cache, top pages read per decode step (:meth:`select`); the prompt left whole (or SnapKV's ``keep``)."""

    Config = QuestConfig
    reads = True

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        self.evictor = None
        if self.config.keep is not None:
            from .snapkv import SnapKV

            self.evictor = SnapKV(None, layout, artifacts)

    @property
    def window_size(self) -> int:
        return self.evictor.window_size if self.evictor else 0

    def min_budget(self) -> int:
        return self.config.page_size

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """The budget per layer (read at each step by :meth:`select`); the prompt is compressed only to ``keep``."""
        plan = super().plan(n_tokens, budget, layout)
        return Plan(plan.layer_budgets, compress=self.evictor is not None and n_tokens > self.config.keep)

    def compress(self, ctx: LayerContext) -> CompressResult:
        return self.evictor.compress(replace(ctx, budget=self.config.keep))

    def stored_budget(self, ctx: LayerContext) -> int:
        return self.config.keep  # the cache keeps `keep`; each step reads the budget

    def select(self, ctx: LayerContext) -> torch.Tensor | None:
        """``(B, H_kv, G, T)`` bool: the slots each query head reads (``ctx.window_queries``: the step's query), or
        ``(B, H_kv, 1, T)``, each KV head's, without ``per_query_head``."""
        if ctx.layer_idx < self.config.dense_layers:
            return None
        bounds = page_bounds(ctx.window_queries, ctx.keys, self.config.page_size)  # (B, H_kv, G, pages)
        if not self.config.per_query_head:  # a KV head: its query heads' largest bound
            bounds = bounds.amax(2, keepdim=True)
        return select_pages(bounds, ctx.budget, self.config.page_size, ctx.keys.shape[2],
                            self.config.current_page)
