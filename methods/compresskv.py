"""CompressKV (Semantic-Retrieval-Guided KV-Cache Compression), Sections 3.2–3.4 and 4.

Token selection (Sec. 3.3): in each layer the SnapKV scores (observation window W = 8,
pooling width K = 5, average pooling) of the layer's top-k Semantic Retrieval Heads (k = 4;
ranked offline by the SRH score of Eq. 1, ``kvbench calibrate heads``) are averaged;
the top ``budget − W`` prefix tokens of that one score vector plus the window form **one kept
set shared by every head of the layer**.

Layer budgets (Sec. 3.4, Eq. 2–4, Sec. 4): offline per-layer error scores ẽ
(``kvbench calibrate layers``); every layer gets at least m = 32 and at most
M = 3 × the average budget, the rest of the total L × average in proportion to ẽ. See
:func:`error_aware_layer_budgets` for the exact integer rule.

Switches (ablations and compositions):

* ``selection``: ``srh`` (paper), ``trh`` (top-1 retrieval heads, Table 2b) or ``snapkv``
  (plain per-KV-head SnapKV scores with the same W, K, pooling: the Table 3a baseline).
* ``layer_allocation``: ``error_aware`` (paper) or ``uniform``.
* ``num_heads``: selection heads per layer (Table 3b sweeps 2/4/6/12/24).
* ``head_allocation``: ``none`` (paper), ``headkv`` (HeadCompressKV, Sec. 4.6: HeadKV head
  budgets, each KV head keeps its top-b_{l,h} tokens of the layer's shared SRH ranking) or
  ``adakv`` (AdaCompressKV, Sec. 4.6: error-aware layer budgets; inside a layer AdaKV splits
  H_kv·(m_l − W) among the KV heads by a global top-k over their SnapKV scores with floor α
  (:func:`methods.allocation.adaptive_head_budgets`); each head then keeps its share from the
  layer's shared SRH ranking, plus the window. The paper gives no more detail; this is our
  reading of "our token selection with error-aware layer-wise allocation on AdaKV").

Budget: ``budget >= 1`` is the average tokens per layer per KV head (window included), as in
the paper's 128 … 2048; ``budget < 1`` a retention ratio of the prompt. A layer whose budget
is ≥ the prompt length keeps every token.

Faithfulness notes: as in the reference code the token scores are pooled over the prefix only
(the window is excluded before pooling, zero padding at the edges).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .allocation import adaptive_head_budgets, keep_topk_per_head
from .artifacts import artifact_path, keyed_errors, load_head_ranking, load_layer_scores
from .base import (
    Budget, CompressResult, ConfigError, HeadLayout, LayerContext, Method, MethodConfig, Plan, gather_tokens, pack_kept,
    require,
)
from .headkv import HeadKV, HeadKVConfig, headkv_head_budgets, pack_head_budgets
from .scoring import group_scores, pool_scores, topk_keep_window, window_attention


@dataclass
class CompressKVConfig(MethodConfig):
    """CompressKV hyper-parameters (paper defaults).

    Attributes:
        window_size: W, observation-window queries (tokens), always kept.
        kernel_size: K, pooling width of the token scores (odd, tokens).
        pooling: ``avg`` or ``max``.
        num_heads: k, selection heads per layer (top-k of the ranking).
        selection: ``srh``, ``trh`` or ``snapkv``.
        layer_allocation: ``error_aware`` or ``uniform``.
        min_layer_budget: m, the least tokens a layer keeps (per KV head).
        max_layer_factor: M = factor × average budget, the most a layer keeps.
        head_allocation: ``none``, ``headkv`` (HeadCompressKV) or ``adakv`` (AdaCompressKV).
        head_idx_path: SRH ranking ``{layer: [head ids]}``; ``None`` = methods/artifacts/<model>/srh_head_idx.json.
        trh_idx_path: TRH ranking; ``None`` = methods/artifacts/<model>/trh_head_idx.json.
        layer_score_path: layer error scores; ``None`` = methods/artifacts/<model>/layer_score.jsonl.
        layer_score_key: which list of the layer-score file to use (``avg_score`` or a dataset).
        headkv_scores: HeadCompressKV head scores, ``retrieval_reasoning`` or ``retrieval``.
        headkv_scores_path: explicit HeadKV head-score file (``None`` = default artifacts).
        headkv_beta: HeadKV β for HeadCompressKV.
        headkv_temp: HeadKV temperature for HeadCompressKV.
        ada_floor_ratio: AdaKV α for AdaCompressKV (share of a head's average budget it is guaranteed).
        ada_normalize: AdaKV ``normalize`` for AdaCompressKV.
    """

    window_size: int = 8
    kernel_size: int = 5
    pooling: Literal["avg", "max"] = "avg"
    num_heads: int = 4
    selection: Literal["srh", "trh", "snapkv"] = "srh"
    layer_allocation: Literal["error_aware", "uniform"] = "error_aware"
    min_layer_budget: int = 32
    max_layer_factor: float = 3.0
    head_allocation: Literal["none", "headkv", "adakv"] = "none"
    head_idx_path: str | None = None
    trh_idx_path: str | None = None
    layer_score_path: str | None = None
    layer_score_key: str = "avg_score"
    headkv_scores: Literal["retrieval_reasoning", "retrieval"] = "retrieval_reasoning"
    headkv_scores_path: str | None = None
    headkv_beta: float = 1.5
    headkv_temp: float = 1.0
    ada_floor_ratio: float = 0.2
    ada_normalize: bool = False

    def check(self) -> None:
        require(self.window_size >= 1, "window_size", self.window_size, "must be an integer >= 1")
        require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", self.kernel_size,
                "must be an odd integer >= 1")
        require(self.num_heads >= 1, "num_heads", self.num_heads, "must be an integer >= 1")
        require(self.min_layer_budget >= self.window_size, "min_layer_budget", self.min_layer_budget,
                f"must be >= window_size={self.window_size}")
        require(self.max_layer_factor >= 1, "max_layer_factor", self.max_layer_factor, "must be >= 1")
        require(0.0 <= self.ada_floor_ratio <= 1.0, "ada_floor_ratio", self.ada_floor_ratio, "must be in [0, 1]")
        require(self.head_allocation != "headkv" or self.layer_allocation == "uniform", "layer_allocation",
                self.layer_allocation, "with head_allocation=headkv HeadKV allocates across layers itself; "
                "accepted value: uniform")


def window_token_scores(window_queries: torch.Tensor, keys: torch.Tensor, scaling: float, kernel_size: int,
                        pooling: str, softcap: float | None = None) -> torch.Tensor:
    """SnapKV scores of every prompt token, pooled over the prefix only (CompressKV reference).

    ``window_queries`` ``(B, H, W, d)`` and ``keys`` ``(B, H_kv, n, d)`` after RoPE (H a multiple
    of H_kv, GQA grouping); ``pooling``: ``avg`` (zero padding counted) or ``max`` of width K.

    Returns:
        ``(B, H, n)`` float32: attention summed over the window, pooled over positions
        0..n−W−1; the W window positions are +inf.
    """
    attn = window_attention(window_queries, keys, scaling, softcap)  # (B, H, W, n)
    b, h, w, n = attn.shape
    prefix = attn[..., : n - w].sum(dim=2)  # (B, H, n - W)
    if prefix.shape[-1] > 0:
        prefix = pool_scores(prefix, kernel_size, pooling)
    return torch.cat([prefix, prefix.new_full((b, h, w), float("inf"))], dim=-1)


def selection_scores(ctx: LayerContext, head_ids: list[int] | None, cfg: CompressKVConfig) -> torch.Tensor:
    """Token scores that drive the layer's selection.

    Args:
        ctx: the layer context.
        head_ids: query-head ids whose scores are averaged (SRH / TRH selection), or ``None`` for
            per-KV-head SnapKV scores (mean over each GQA group).
        cfg: window, kernel and pooling settings.

    Returns:
        ``(B, 1, n)`` shared scores for head selection, ``(B, H_kv, n)`` for SnapKV; window +inf.
    """
    q = ctx.window_queries
    if head_ids is None:
        s = window_token_scores(q, ctx.keys, ctx.scaling, cfg.kernel_size, cfg.pooling, ctx.softcap)
        return group_scores(s, ctx.layout.num_kv_heads, "mean")
    ids = torch.as_tensor(head_ids, dtype=torch.long, device=q.device)
    kv_ids = ids // ctx.layout.group_size  # the KV head each selected query head reads
    s = window_token_scores(q[:, ids], ctx.keys[:, kv_ids], ctx.scaling, cfg.kernel_size, cfg.pooling, ctx.softcap)
    return s.mean(dim=1, keepdim=True)  # (B, 1, n); +inf stays +inf on the window


def error_aware_layer_budgets(scores: torch.Tensor, total: int, min_budget: int, max_budget: int) -> list[int]:
    """Error-aware layer budgets (CompressKV Sec. 3.4): floor m, cap M, rest ∝ error scores.

    Every layer first gets ``min_budget``; the remaining ``total − L·m`` tokens are split in
    proportion to the scores with water-filling at the cap (a layer whose share would pass
    ``max_budget`` is fixed there and the excess is re-split over the others in proportion);
    the fractional shares are rounded by largest remainder (ties: higher score, then lower
    layer). Layers with zero score get only the floor unless the others are all capped.
    Result: sum == total exactly, every budget in [m, M], and budgets are non-decreasing in
    the score. (The reference rounds each share, clips to [m, M] and then fixes the sum one
    token at a time in score order; without clipping both agree up to one token per layer.)

    Args:
        scores: ``(L,)`` non-negative error scores ẽ (normalised or not).
        total: total tokens over the L layers (L × the average budget).
        min_budget: m.
        max_budget: M ≥ m.

    Returns:
        L integer budgets.

    Raises:
        ValueError: ``total`` outside [L·m, L·M], or negative / non-finite scores.
    """
    s = scores.double().flatten()
    n_layers = s.numel()
    if not (n_layers * min_budget <= total <= n_layers * max_budget):
        raise ValueError(f"total={total} not in [{n_layers}*{min_budget}, {n_layers}*{max_budget}]")
    if (s < 0).any() or not torch.isfinite(s).all():
        raise ValueError("layer scores must be finite and >= 0")
    remaining = float(total - n_layers * min_budget)
    cap = float(max_budget - min_budget)
    extra = torch.zeros_like(s)
    free = torch.ones(n_layers, dtype=torch.bool)
    for _ in range(n_layers):  # water-filling: at most L rounds, each caps ≥ 1 layer or ends
        left = remaining - extra[~free].sum().item()
        weight = torch.where(free, s, torch.zeros_like(s))
        if weight.sum() <= 0:  # only zero-score layers are still free: split evenly
            weight = free.double()
        share = left * weight / weight.sum()
        over = free & (share > cap)
        if not over.any():
            extra = torch.where(free, share, extra)
            break
        extra[over] = cap
        free &= ~over
    base = torch.floor(extra + 1e-9).clamp(max=cap)
    deficit = int(round(remaining - base.sum().item()))
    frac = (extra - base).clamp(min=0)
    # largest remainder; ties by higher score, then lower layer index (stable sort)
    order = sorted(range(n_layers), key=lambda i: (-round(frac[i].item(), 9), -s[i].item()))
    for i in order:
        if deficit <= 0:
            break
        if base[i] < cap:
            base[i] += 1
            deficit -= 1
    return [min_budget + int(x) for x in base.tolist()]


class CompressKV(Method):
    """SRH-driven shared token selection with error-aware layer budgets."""

    Config = CompressKVConfig

    @property
    def per_head_lengths(self) -> bool:  # HeadCompressKV, AdaCompressKV
        return self.config.head_allocation != "none"

    def __init__(self, config=None, layout=None, artifacts=None):
        super().__init__(config, layout, artifacts)
        self._head_budgets: torch.Tensor | None = None
        if layout is not None and not self.artifacts:
            self.check_layout(layout)

    def check_layout(self, layout: HeadLayout) -> None:
        """Check ``num_heads`` against the model and load its artifacts (before the model loads).

        Raises:
            ConfigError: too many selection heads, or a missing / malformed artifact.
        """
        if self.config.selection != "snapkv" and self.config.num_heads > layout.num_q_heads:
            raise ConfigError(
                f"method.num_heads={self.config.num_heads}: model {layout.model_name or '?'} has only "
                f"{layout.num_q_heads} query heads per layer"
            )
        self.artifacts = self.load_artifacts(self.config, layout)

    def load_artifacts(self, config: CompressKVConfig, layout: HeadLayout) -> dict:
        """Read the artifacts the configuration needs for ``layout.model_name``.

        Returns:
            ``ranking`` (L lists of query-head ids, for ``srh``/``trh``), ``layer_scores``
            (``(L,)`` float64, for ``error_aware``), ``kv_head_scores`` (for ``headkv``).

        Raises:
            ConfigError: a missing or malformed file (the message names the command that makes it).
        """
        out: dict = {}
        name = layout.model_name
        if config.selection in ("srh", "trh"):
            key = "head_idx_path" if config.selection == "srh" else "trh_idx_path"
            path = artifact_path(f"{config.selection}_head_idx", name, getattr(config, key), f"method.{key}")
            with keyed_errors(f"method.{key}", path):
                out["ranking"] = load_head_ranking(path, layout)
        if config.head_allocation != "headkv" and config.layer_allocation == "error_aware":
            path = artifact_path("layer_score", name, config.layer_score_path, "method.layer_score_path")
            with keyed_errors("method.layer_score_path", path):
                out["layer_scores"] = load_layer_scores(path, layout, config.layer_score_key)
        if config.head_allocation == "headkv":
            headkv = HeadKVConfig(head_scores=config.headkv_scores, head_scores_path=config.headkv_scores_path,
                                  beta=config.headkv_beta, temp=config.headkv_temp, window_size=config.window_size)
            out.update(HeadKV.load_artifacts(headkv, layout))
        return out

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """Per-layer budgets (uniform, error-aware, or the longest head under HeadKV budgets)."""
        if not self.artifacts:
            self.check_layout(layout)
        c = self.config
        m = budget.of(n_tokens)
        layers = list(layout.compressible_layers) or list(range(layout.num_layers))
        budgets = torch.full((layout.num_layers,), m, dtype=torch.long)
        head_budgets = None
        if c.head_allocation == "headkv":
            w = c.window_size
            heads = torch.full((layout.num_layers, layout.num_kv_heads), n_tokens, dtype=torch.long)
            prefix = headkv_head_budgets(self.artifacts["kv_head_scores"][layers], max(m - w, 0), c.headkv_beta, c.headkv_temp)
            heads[layers] = w + prefix
            head_budgets = heads.clamp(max=n_tokens)
            budgets = head_budgets.amax(dim=1)
        elif c.layer_allocation == "error_aware":
            # the official script allocates a token budget before it sees the prompt, so on a prompt
            # shorter than the average budget the layers whose own budget is below n still compress
            avg = m if budget.tokens is None else budget.tokens
            scores = self.artifacts["layer_scores"][layers]
            lo = min(c.min_layer_budget, avg)
            hi = max(int(c.max_layer_factor * avg), lo)
            budgets[layers] = torch.tensor(error_aware_layer_budgets(scores, avg * len(layers), lo, hi))
        self._head_budgets = head_budgets
        compress = bool((budgets[layers] < n_tokens).any()) if head_budgets is None else m < n_tokens
        return Plan(layer_budgets=budgets.clamp(max=n_tokens).tolist(), head_budgets=head_budgets, compress=compress)

    def compress(self, ctx: LayerContext) -> CompressResult:
        n = ctx.n_tokens
        b, h_kv = ctx.keys.shape[:2]
        head_budget = ctx.head_budget
        if head_budget is None and self._head_budgets is not None:
            head_budget = self._head_budgets[ctx.layer_idx]
        if head_budget is None and ctx.budget >= n:  # this layer keeps everything
            idx = torch.arange(n, device=ctx.keys.device).expand(b, h_kv, n)
            return CompressResult(keys=ctx.keys, values=ctx.values, kept_indices=idx)
        ids = None if self.config.selection == "snapkv" else self.artifacts["ranking"][ctx.layer_idx][: self.config.num_heads]
        scores = selection_scores(ctx, ids, self.config)  # (B, 1 or H_kv, n), window +inf
        if head_budget is not None:  # HeadCompressKV: per-head lengths from the shared ranking
            return pack_head_budgets(ctx, scores.expand(b, h_kv, n), head_budget)
        w = ctx.window_queries.shape[2]
        if self.config.head_allocation == "adakv":
            return self._adakv_compress(ctx, scores.expand(b, h_kv, n), w)
        idx = topk_keep_window(scores, ctx.budget, w).expand(b, h_kv, -1)  # one set for every head
        return CompressResult(keys=gather_tokens(ctx.keys, idx), values=gather_tokens(ctx.values, idx), kept_indices=idx)

    def _adakv_compress(self, ctx: LayerContext, scores: torch.Tensor, w: int) -> CompressResult:
        """AdaCompressKV: AdaKV head shares of the layer budget, tokens from the shared ranking."""
        b, h_kv, n = scores.shape
        w = min(w, ctx.budget)
        base = max(0, ctx.budget - w)  # AdaKV allocates the prefix budget; every head keeps the window
        head_scores = selection_scores(ctx, None, self.config)[..., : n - w]  # per-KV-head SnapKV, (B, H_kv, n - W)
        counts = adaptive_head_budgets(head_scores, h_kv * base, self.config.ada_floor_ratio, self.config.ada_normalize)
        keep_prefix = keep_topk_per_head(scores[..., : n - w], counts)
        keep = torch.cat([keep_prefix, keep_prefix.new_ones(b, h_kv, w)], dim=-1)
        return pack_kept(ctx.keys, ctx.values, keep)
