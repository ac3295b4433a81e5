"""Any score-based press of NVIDIA kvpress 0.5.x (optional extra ``kvbench[kvpress]``) as a method.

``method=kvpress method.press=SnapKVPress 'method.press_kwargs={window_size:64}'`` runs the press's
own ``score`` once per layer at the end of prefill, inside kvbench's engine. The press sees what
its forward hook would see (kvpress ``BasePress.forward_hook``), rebuilt from the layer's tensors:
keys and values; an attention module that carries the config, layer index, head dim and RoPE
(``rotary_emb``), and whose ``q_proj`` / ``k_proj`` read the layer's pre-RoPE queries and keys
(the model's own after RoPE, rotated back by −θ) out of stand-in hidden states; and
``kwargs["position_embeddings"]``. Attention weights are never built (``attentions=None``).

Budget: kvbench keeps m tokens per KV head (m = ⌊ρ·n⌋ for a ratio ρ, the count for an integer)
and sets the press's ``compression_ratio`` (the fraction removed) to ``cr = 1 − m/n``, nudged so
that kvpress's own ``n_kept = max(1, int(n·(1 − cr)))`` is exactly m. So ``budget=ρ`` equals kvpress
``compression_ratio=1 − ρ`` whenever ``1 − (1 − ρ) == ρ`` in floating point (0.25, 0.5, …).
Kept tokens: ``scores.topk(m)`` as ``ScorerPress.compress``; ``AdaKVPress(press=…)`` keeps kvpress's
safeguard + global top-k set (:func:`methods.allocation.safeguard_keep_mask`) as kvbench's
per-head variable-length cache, not kvpress's masked fake keys.
``python -m methods.kvpress_press`` lists the presses that run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from .allocation import safeguard_keep_mask
from .base import CompressResult, ConfigError, LayerContext, Method, MethodConfig, gather_tokens, require
from .packing import pack_kept, packing_stats

REFUSED = {  # ScorerPress subclasses kvbench cannot run, and why
    "ObservedAttentionPress": "needs the n x n prefill attention weights (eager attention)",
    "QFilterPress": "needs learned Q-filters downloaded from the Hub",
    "KVzapPress": "needs a trained scorer model downloaded from the Hub",
    "ExpectedAttentionStatsPress": "needs query statistics downloaded from the Hub",
    "PyramidKVPress": "sets its own layer budgets inside compress(); use method=pyramidkv_kvpress",
    "CriticalKVPress": "needs the attention module's output projection (kvbench methods see tensors only)",
}
NOT_SCORER = ("not a score-based press: kvbench runs ScorerPress subclasses and AdaKVPress once at the end of "
              "prefill (no decoding-time, model-rewriting or other wrapper presses)")


def _kvpress():
    """The kvpress package, imported without letting it wrap kvbench's attention function."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ours = ALL_ATTENTION_FUNCTIONS.get("kvbench")
        import kvpress
    except ImportError as e:
        raise ConfigError(f"method.press: kvpress is not installed ({e}); pip install -e '.[kvpress]'") from None
    if ours is not None:  # kvpress wraps every registered attention function at import
        ALL_ATTENTION_FUNCTIONS["kvbench"] = ours
    return kvpress


def refusal(name: str) -> str | None:
    """Why kvbench cannot run the press class ``name`` (None: it can; ``unknown press``: no such press)."""
    kp = _kvpress()
    cls = getattr(kp, name, None) if name in kp.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, kp.BasePress)):
        return "unknown press"
    if name in REFUSED:
        return REFUSED[name]
    return None if cls is kp.AdaKVPress or (issubclass(cls, kp.ScorerPress) and cls is not kp.ScorerPress) else NOT_SCORER


def supported() -> list[str]:
    """Names of the kvpress presses ``method=kvpress`` runs, sorted."""
    return sorted(n for n in _kvpress().__all__ if refusal(n) is None)


def make_press(name: Any, kwargs: Any, key: str = "press") -> Any:
    """The press ``name(**kwargs)``; ``AdaKVPress`` takes its scorer as ``press`` (a name) and ``press_kwargs``.

    Raises:
        ConfigError: ``method.<key>=...`` for an unknown or unsupported press, a
            ``compression_ratio`` (set by the budget), an unknown keyword or a value the press rejects.
    """
    kp, why = _kvpress(), refusal(str(name))
    if why is not None:
        raise ConfigError(f"method.{key}={name!r}: {why}; accepted values are {', '.join(supported())}")
    require(isinstance(kwargs, Mapping), f"{key}_kwargs", kwargs, "must be a mapping of the press's arguments")
    cls, kwargs = getattr(kp, name), dict(kwargs)
    args = {f.name for f in dataclasses.fields(cls) if f.init} - {"compression_ratio"}
    for k in kwargs:
        require(k in args or (k == "press_kwargs" and "press" in args), f"{key}_kwargs.{k}", kwargs[k],
                f"unknown argument of {name}" + ("; compression_ratio is set by budget" if k == "compression_ratio"
                                                  else f"; accepted keys are {', '.join(sorted(args))}"))
    if cls is kp.AdaKVPress:
        inner = make_press(kwargs.pop("press", "SnapKVPress"), kwargs.pop("press_kwargs", {}), f"{key}_kwargs.press")
        require(not isinstance(inner, kp.AdaKVPress), f"{key}_kwargs.press", "AdaKVPress", "must be a ScorerPress")
        kwargs["press"] = inner
    try:
        return cls(**kwargs)
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(f"method.{key}_kwargs={kwargs!r}: {name} rejects them ({e})") from None


@dataclass
class KVPressConfig(MethodConfig):
    """Attributes:
        press: a kvpress press class name (``python -m methods.kvpress_press`` lists them).
        press_kwargs: its arguments, ``compression_ratio`` excepted (set from the budget).
    """

    press: str = "KnormPress"
    press_kwargs: dict = field(default_factory=dict)

    def check(self) -> None:
        make_press(self.press, self.press_kwargs)


def compression_ratio(n: int, m: int) -> float:
    """kvpress ``compression_ratio`` (fraction removed) that keeps exactly m of n tokens (1 ≤ m ≤ n):
    1 − m/n, nudged down until kvpress's ``n_kept = int(n·(1 − cr))`` is m."""
    cr = 1 - m / n
    while cr > 0 and int(n * (1 - cr)) < m:
        cr = math.nextafter(cr, 0.0)
    return cr


def press_inputs(ctx: LayerContext) -> tuple[Any, torch.Tensor, dict]:
    """``(module, hidden_states (B, n, (H_q + H_kv)·d), kwargs)`` for a press's ``score``.

    ``ctx.window_queries`` must hold all n queries. ``module.q_proj`` / ``k_proj`` read the pre-RoPE
    queries / keys out of ``hidden_states``; ``kwargs["position_embeddings"]`` is ``(cos, sin)``,
    each ``(1, n, d)``, the model's RoPE tables at ``ctx.positions``.
    """
    from transformers.models.llama.modeling_llama import rotate_half

    q, k, lay = ctx.window_queries, ctx.keys, ctx.layout
    b, n, dt = k.shape[0], k.shape[2], k.dtype
    if q.shape[2] != n:
        raise ValueError(f"kvpress presses need all {n} prompt queries, got {q.shape[2]}")
    pos = ctx.positions if ctx.positions is not None else torch.arange(n, device=k.device)
    ones = torch.ones(n, k.shape[-1], device=k.device)
    cos, sin = ctx.rotary(pos) if ctx.rotary is not None else (ones, ones * 0)
    c64, s64 = cos.double(), sin.double()
    pre = [(x.double() * c64 - rotate_half(x.double()) * s64).to(dt).transpose(1, 2).reshape(b, n, -1) for x in (q, k)]
    split = lay.num_q_heads * lay.head_dim
    module = SimpleNamespace(
        layer_idx=ctx.layer_idx, head_dim=lay.head_dim, scaling=ctx.scaling, num_key_value_groups=lay.group_size,
        config=SimpleNamespace(num_attention_heads=lay.num_q_heads, num_key_value_heads=lay.num_kv_heads,
                               head_dim=lay.head_dim, num_hidden_layers=lay.num_layers, _attn_implementation="kvbench"),
        q_proj=lambda h: h[..., :split], k_proj=lambda h: h[..., split:],
        rotary_emb=lambda x, ids: tuple(t[None].to(x.dtype) for t in ctx.rotary(ids.reshape(-1))),
    )
    kwargs = {"position_embeddings": (cos[None].to(dt), sin[None].to(dt)), "cache_position": pos,
              "position_ids": pos[None], "attention_mask": None}
    return module, torch.cat(pre, dim=-1), kwargs


class KVPress(Method):
    """A kvpress ``ScorerPress`` (or ``AdaKVPress`` around one) scoring every prompt token once."""

    Config = KVPressConfig

    def __init__(self, config: Any = None, layout: Any = None, artifacts: dict | None = None):
        super().__init__(config, layout, artifacts)
        self.press = make_press(self.config.press, self.config.press_kwargs)
        self.ada = type(self.press).__name__ == "AdaKVPress"

    @property
    def window_size(self) -> int:
        return 1 << 62  # every prompt query (the engine caps W at n): presses rebuild what they need

    def min_budget(self) -> int:
        return 1  # kvpress keeps max(1, int(n·(1 − cr)))

    def compress(self, ctx: LayerContext) -> CompressResult:
        m = ctx.budget
        self.press.compression_ratio = compression_ratio(ctx.n_tokens, m)  # StreamingLLM reads it in score()
        module, hidden, kwargs = press_inputs(ctx)
        scorer = self.press.press if self.ada else self.press
        scores = scorer.score(module, hidden, ctx.keys, ctx.values, None, kwargs)  # (B, H_kv, n)
        if self.ada:
            packed = pack_kept(ctx.keys, ctx.values, safeguard_keep_mask(scores, m, self.press.alpha_safeguard))
            return CompressResult(keys=packed.keys, values=packed.values, valid=packed.valid,
                                  kept_indices=packed.indices, stats=packing_stats(packed.valid))
        idx = scores.topk(m, dim=-1).indices.sort(dim=-1).values  # ScorerPress.compress's set, original order
        return CompressResult(keys=gather_tokens(ctx.keys, idx), values=gather_tokens(ctx.values, idx), kept_indices=idx)


if __name__ == "__main__":
    print("\n".join(supported()))
