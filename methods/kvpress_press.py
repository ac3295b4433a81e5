"""Any score-based kvpress 0.5.x press (extra ``kvbench[kvpress]``) as a method (docs/METHODS.md): ``score`` runs
once per layer at the end of prefill on inputs rebuilt from the layer (:func:`press_inputs`); the top m are kept
(AdaKVPress: its safeguard + global top-k set, per-head lengths), m from the budget (:func:`compression_ratio`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from .allocation import safeguard_keep_mask
from .base import CompressResult, ConfigError, LayerContext, Method, MethodConfig, gather_tokens, pack_kept, require
from .scoring import topk_keep_window

HUB = "needs trained filters, weights or statistics downloaded from the Hub"
REFUSED = {  # ScorerPresses kvbench cannot run, and why
    "QFilterPress": HUB, "KVzapPress": HUB, "ExpectedAttentionStatsPress": HUB,
    "ObservedAttentionPress": "needs the n x n prefill attention weights (eager attention)",
    "PyramidKVPress": "sets its own layer budgets inside compress(); use method=pyramidkv_kvpress",
    "CriticalKVPress": "needs the attention module's output projection (kvbench methods see tensors only)"}


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
    """Why kvbench cannot run the press class ``name`` (``unknown press`` if there is none); None if it can."""
    kp = _kvpress()
    cls = getattr(kp, name, None) if name in kp.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, kp.BasePress)):
        return "unknown press"
    scorer = cls is kp.AdaKVPress or (issubclass(cls, kp.ScorerPress) and cls is not kp.ScorerPress)
    return REFUSED.get(name) or (None if scorer else "not score-based (kvbench runs ScorerPress subclasses and "
                                 "AdaKVPress once, at the end of prefill: no decoding-time or model-rewriting presses)")


def supported() -> list[str]:
    """Names of the presses ``method=kvpress`` runs, sorted."""
    return sorted(n for n in _kvpress().__all__ if refusal(n) is None)


def make_press(name: Any, kwargs: Any, key: str = "press") -> Any:
    """``name(**kwargs)``; ``AdaKVPress`` takes its scorer as ``press`` (a name; SnapKVPress) and
    ``press_kwargs``. Raises ConfigError (``method.<key>...``): unknown or refused press, rejected arguments."""
    kp, why = _kvpress(), refusal(str(name))
    if why is not None:
        raise ConfigError(f"method.{key}={name!r}: {why}; accepted values are {', '.join(supported())}")
    cls, kwargs = getattr(kp, name), dict(kwargs)
    require("compression_ratio" not in kwargs, f"{key}_kwargs.compression_ratio", "set", "comes from budget; remove it")
    if cls is kp.AdaKVPress:
        inner = kwargs.pop("press", "SnapKVPress"), kwargs.pop("press_kwargs", None) or {}
        kwargs["press"] = make_press(*inner, f"{key}_kwargs.press")
    try:
        return cls(**kwargs)
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(f"method.{key}_kwargs={kwargs!r}: {name} rejects them ({e})") from None


@dataclass
class KVPressConfig(MethodConfig):
    """Attributes:
        press: a kvpress press class name (``python -m methods.kvpress_press`` lists them).
        press_kwargs: its arguments (null: none), ``compression_ratio`` excepted (set from the budget).
    """

    press: str = "KnormPress"
    press_kwargs: dict = field(default_factory=dict)

    def check(self) -> None:
        self.built = make_press(self.press, self.press_kwargs or {})  # the press object (not a field)


def compression_ratio(n: int, m: int) -> float:
    """kvpress ``compression_ratio`` (fraction removed) keeping exactly m of n tokens (1 ≤ m ≤ n):
    1 − m/n, nudged down until kvpress's ``n_kept = int(n·(1 − cr))`` is m (kvpress ``compute_n_kept``)."""
    cr = 1 - m / n
    while cr > 0 and int(n * (1 - cr)) < m:
        cr = math.nextafter(cr, 0.0)
    return cr


def press_inputs(ctx: LayerContext) -> tuple[Any, torch.Tensor, dict]:
    """``(module, hidden_states (B, n, (H_q + H_kv)·d), kwargs)`` for a press's ``score`` (kvpress's forward hook) from
    all n queries (``ctx.window_queries``) and keys: a stand-in module's ``q_proj`` / ``k_proj`` read them rotated
    back by −θ (pre-RoPE, float64); ``rotary_emb``, ``kwargs["position_embeddings"]`` (``(1, n, d)`` each): RoPE."""
    from transformers.models.llama.modeling_llama import rotate_half

    q, k, lay = ctx.window_queries, ctx.keys, ctx.layout
    b, n, dt = k.shape[0], k.shape[2], k.dtype
    cos, sin = ctx.rotary(torch.arange(n, device=k.device))  # (n, d) float32 each
    pre = [(x.double() * cos.double() - rotate_half(x.double()) * sin.double()).to(dt).transpose(1, 2).reshape(b, n, -1)
           for x in (q, k)]
    split = lay.num_q_heads * lay.head_dim
    module = SimpleNamespace(
        head_dim=lay.head_dim, q_proj=lambda h: h[..., :split], k_proj=lambda h: h[..., split:],
        config=SimpleNamespace(num_attention_heads=lay.num_q_heads, num_key_value_heads=lay.num_kv_heads),
        rotary_emb=lambda x, ids: tuple(t[None].to(x.dtype) for t in ctx.rotary(ids.reshape(-1))))
    return module, torch.cat(pre, dim=-1), {"position_embeddings": (cos[None].to(dt), sin[None].to(dt))}


class KVPress(Method):
    """A kvpress ``ScorerPress`` (or ``AdaKVPress`` around one) scoring every prompt token once."""

    Config = KVPressConfig

    window_size = 1 << 62  # the engine hands every prompt query (W capped at n)

    def min_budget(self) -> int:
        return 1  # kvpress keeps max(1, int(n·(1 − cr)))

    def compress(self, ctx: LayerContext) -> CompressResult:
        press, m = self.config.built, ctx.budget
        press.compression_ratio = compression_ratio(ctx.n_tokens, m)  # StreamingLLM reads it in score()
        scorer = press.press if hasattr(press, "alpha_safeguard") else press  # AdaKVPress wraps a scorer
        module, hidden, kwargs = press_inputs(ctx)
        scores = scorer.score(module, hidden, ctx.keys, ctx.values, None, kwargs)  # (B, H_kv, n)
        if scorer is not press:
            return pack_kept(ctx.keys, ctx.values, safeguard_keep_mask(scores, m, press.alpha_safeguard))
        idx = topk_keep_window(scores, m, 0)  # (B, H_kv, m), original order
        return CompressResult(gather_tokens(ctx.keys, idx), gather_tokens(ctx.values, idx), kept_indices=idx)


if __name__ == "__main__":
    print("\n".join(supported()))
