"""Budget allocation shared by layer-wise and head-wise methods.

* :func:`pyramid_layer_budgets`: PyramidKV's linear layer schedule (β = 20), in the
  KVCache-Factory form (the PyramidKV authors' code, integer arithmetic, window added on top)
  or the kvpress form (float arithmetic, window counted inside).
* :func:`adaptive_head_budgets`: AdaKV's head-wise allocation within a layer: a global top-k
  over all heads' (optionally normalised) scores, then a per-head floor.
* :func:`safeguard_keep_mask`: kvpress's AdaKV variant (each head's own top α·m protected,
  the rest chosen by one global top-k).
* :func:`keep_topk_per_head`: turns per-head token counts into a keep mask.

HeadKV / CompressKV compositions reuse these; per-head variable-length results are stored
with :func:`methods.base.pack_kept`. Budgets are tokens per KV head (window included unless a
function says otherwise).
"""

from __future__ import annotations

import torch

from .base import Budget, HeadLayout, Plan


def pyramid_layer_budgets(
    budget: int, n_tokens: int, num_layers: int, window: int, beta: int = 20, variant: str = "kvcf"
) -> list[int]:
    """PyramidKV layer budgets (tokens per KV head, window included), bottom layer first.

    ``variant="kvcf"`` follows the PyramidKV authors' code (KVCache-Factory,
    ``PyramidKVCluster.update_kv``) with m = ``budget`` (their ``max_capacity_prompt``) and
    b = m − W::

        n <  m            → no compression: every layer keeps n
        n <  2·b or b ≤ 0 → uniform fall-back: every layer keeps m
        otherwise           min = b // β,  max = 2·b − min
                            if max ≥ n − W:  max = n − W,  min = 2·b − max
                            step = (max − min) // (L − 1)
                            layer l keeps  max − l·step + W

    (integer division throughout: the floored step leaves the upper layers slightly above the
    exact line, so the total can exceed L·m by less than L·(L − 1)/2 tokens).

    ``variant="kvpress"`` follows kvpress 0.5.x ``PyramidKVPress.get_layer_budget`` with its
    ``q_len·(1 − compression_ratio)`` equal to m (a float: :func:`pyramid_plan` passes the
    unrounded n·ρ): float arithmetic, the window counted inside the budget, ``round`` per
    layer, and a uniform fall-back to round(m) unless n ≥ max ≥ min ≥ W::

        min = m / β,  max = 2·m − min;  if max ≥ n − W: max = n − W, min = 2·m − max
        layer l keeps round(max − l·(max − min)/(L − 1))

    Args:
        budget: m, average tokens kept per KV head per layer (window included), ≥ 1 (a float
            for ``kvpress``).
        n_tokens: n, prompt length (tokens).
        num_layers: L, layers sharing the schedule.
        window: W, observation-window tokens (always kept).
        beta: β, the pyramid's steepness (min layer budget ≈ (m − W)/β).
        variant: ``kvcf`` or ``kvpress``.

    Returns:
        L token counts, each ≤ n.
    """
    m, n, L, w = int(budget), int(n_tokens), int(num_layers), int(window)
    if variant == "kvpress":
        kept = (w + float(budget)) - w  # kvpress: max_capacity_prompt - window_size, the float rounding included
        min_num = kept / beta
        max_num = kept * 2 - min_num
        if max_num >= n - w:
            max_num = n - w
            min_num = kept * 2 - max_num
        if not (n >= max_num >= min_num >= w):
            return [min(n, max(1, round(float(budget))))] * L
        step = (max_num - min_num) / (L - 1) if L > 1 else 0.0
        return [round(max_num - layer * step) for layer in range(L)]
    if n < m:
        return [n] * L
    base = m - w
    if base <= 0 or n < 2 * base:  # (the reference asserts m > W; a short ratio budget falls back)
        return [m] * L
    min_num = base // beta
    max_num = 2 * base - min_num
    if max_num >= n - w:
        max_num = n - w
        min_num = 2 * base - max_num
    step = (max_num - min_num) // (L - 1) if L > 1 else 0
    return [max_num - layer * step + w for layer in range(L)]


def pyramid_plan(
    n_tokens: int, budget: Budget, layout: HeadLayout, window: int, beta: int = 20, variant: str = "kvcf"
) -> Plan:
    """A :class:`Plan` with PyramidKV budgets over the layout's compressible layers.

    Layers that are not compressible keep all n tokens. ``compress=False`` when m ≥ n.
    ``window`` is capped at n; other arguments as in :func:`pyramid_layer_budgets`. For
    ``kvpress`` a ratio ρ gives kvpress's unrounded n·(1 − cr), cr = 1 − ρ (at ρ = 0.5 and odd
    n, ⌊ρ·n⌋ would fall back to uniform budgets where kvpress builds a pyramid).
    """
    m = budget.of(n_tokens)
    budgets = [n_tokens] * layout.num_layers
    if m >= n_tokens:
        return Plan(layer_budgets=budgets, compress=False)
    layers = list(layout.compressible_layers) or list(range(layout.num_layers))
    kept = n_tokens * (1 - (1 - budget.ratio)) if variant == "kvpress" and budget.ratio is not None else m
    schedule = pyramid_layer_budgets(kept, n_tokens, len(layers), min(window, n_tokens), beta, variant)
    for layer, b in zip(layers, schedule):
        budgets[layer] = b
    return Plan(layer_budgets=budgets, compress=True)


def adaptive_head_budgets(
    scores: torch.Tensor, total: int, floor_ratio: float, normalize: bool = False
) -> torch.Tensor:
    """AdaKV head budgets for one layer (Feng et al., 2024, Alg. 1, as in the AdaKV code).

    The ``total`` = H·b highest scores over all heads of the layer are selected at once (a
    global top-k over the flattened ``(H, N)`` scores); head h wins c_h of them. Each head then
    gets ``round(c_h·(1 − α) + ⌊α·b⌋)`` tokens (the floor ⌊α·b⌋ guarantees every head a share,
    the rest follows the scores). With ``normalize`` each head's scores are first multiplied by
    the share of its mass inside its own top b (AdaKV's ``normalize`` option).

    Args:
        scores: ``(B, H, N)`` non-negative float32 scores of the selectable tokens (the
            observation window excluded); −inf: a slot that holds no token (decode time).
        total: H·b, tokens to share among the H heads (b = average per head, ≤ N).
        floor_ratio: α in [0, 1].
        normalize: rescale each head's scores by its top-b mass fraction first.

    Returns:
        ``(B, H)`` long budgets, each in [0, N]. They sum to (1 − α)·total + H·⌊α·b⌋ up to
        rounding (±H/2): exactly ``total`` when α·b is an integer, slightly less otherwise
        (as in the AdaKV code).
    """
    b_sz, h, n = scores.shape
    per_head = total // h
    s = scores.float()
    if normalize:
        mass = s.clamp_min(0)  # an empty slot weighs nothing
        top_mass = mass.topk(per_head, dim=-1).values.sum(-1, keepdim=True)
        s = s * (top_mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    winners = s.reshape(b_sz, h * n).topk(total, dim=-1).indices // n  # (B, total) head ids
    counts = torch.zeros(b_sz, h, dtype=torch.long, device=scores.device)
    counts.scatter_add_(1, winners, torch.ones_like(winners))
    floor = int(per_head * floor_ratio)
    budgets = torch.round(counts.double() * (1.0 - floor_ratio) + floor).long()
    return budgets.clamp_(0, n)


def keep_topk_per_head(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Keep mask of each head's ``counts[h]`` highest-scoring tokens.

    Args:
        scores: ``(B, H, N)``.
        counts: ``(B, H)`` long, each in [0, N].

    Returns:
        ``(B, H, N)`` bool, exactly ``counts[b, h]`` True per row.
    """
    order = scores.argsort(dim=-1, descending=True, stable=True)  # (B, H, N)
    rank_keep = torch.arange(scores.shape[-1], device=scores.device) < counts.unsqueeze(-1)
    return torch.zeros_like(rank_keep).scatter_(-1, order, rank_keep)


def safeguard_keep_mask(scores: torch.Tensor, per_head: int, alpha: float) -> torch.Tensor:
    """kvpress 0.5.x AdaKVPress selection: per-head safeguard, then one global top-k.

    Each head's own top ``max(1, ⌊α·m⌋)`` tokens are protected (α > 0); then the H·m
    highest-scoring tokens over all heads are kept, protected ones first. Heads keep between
    ⌊α·m⌋ and N tokens; the layer keeps exactly H·m.

    Args:
        scores: ``(B, H, N)`` scores of every token (observation window at +inf).
        per_head: m, average tokens kept per head.
        alpha: α in [0, 1] (kvpress ``alpha_safeguard``).

    Returns:
        ``(B, H, N)`` bool keep mask.
    """
    b_sz, h, n = scores.shape
    n_safe = int(per_head * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if per_head > 0 else 0
    s = scores.float().clone()
    if n_safe > 0:
        s.scatter_(-1, s.topk(n_safe, dim=-1).indices, float("inf"))
    flat = s.reshape(b_sz, h * n)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep.scatter_(1, flat.topk(h * per_head, dim=-1).indices, True)
    return keep.view(b_sz, h, n)
