"""Any prefill press of kvpress 0.5.x (extra ``kvbench[kvpress]``) as a method (docs/METHODS.md), on one of two paths.

* **Scorer path**: a ``ScorerPress`` that needs nothing of the model but a layer's tensors (and ``AdaKVPress`` around
  one): ``score`` runs once per layer at the end of prefill inside kvbench's attention function, on inputs rebuilt
  from the layer (:func:`press_inputs`); the top m are kept (AdaKVPress: its safeguard + global top-k set, per-head
  lengths), m from the budget (:func:`compression_ratio`).
* **Hook path**: every other prefill press runs its own code on the model, as kvpress's pipeline runs it
  (:mod:`methods.kvpress_hooks`, :meth:`KVPress.prefill_hooks`).

Scorer-path presses also compress while decoding (``decode.*``: kvpress's DecodingPress / PrefillDecodingPress,
docs/DECODING.md): the press scores the layer's whole cache from the buffered queries, keeps exactly the budget in
kvpress's top-k slot order.

A press is a Hydra node: ``press`` (the class name) and ``press_kwargs`` (its arguments); inside ``press_kwargs`` a
node ``{press: <name>, press_kwargs: {...}}``, or a list of them, is a press (a wrapper's ``press``/``base_press``,
ComposedPress's ``presses``); a wrapper's ``press: <name>`` may take its arguments beside it as ``press_kwargs``.
The budget sets ``compression_ratio`` (every component's in a ComposedPress); ThinKPress
(``key_channel_compression_ratio``), DuoAttentionPress (``head_compression_ratio``) and DMSPress (``threshold``)
take their own knob from ``press_kwargs``, as kvpress's evaluate.py takes it from a flag of its own.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from .allocation import safeguard_keep_mask
from .base import (CompressResult, ConfigError, LayerContext, Method, MethodConfig, gather_tokens, masked_scores,
                   pack_kept, require)

DECODING = ("decode-time compression is the engine's decode.* settings: DecodingPress(base_press, "
            "compression_interval, target_size) is method.press=<base_press> decode.interval=<compression_interval> "
            "budget=<target_size> decode.schedule=steps decode.prefill=false (true: PrefillDecodingPress)")
PREFILL_ONLY = ("CompactorPress", "LeverageScorePress", "NonCausalAttnPress")  # kvpress asserts they only prefill
REFUSED = {  # presses kvbench cannot run, and why
    "BasePress": "abstract base class", "ScorerPress": "abstract base class",
    "DecodingPress": DECODING, "PrefillDecodingPress": DECODING, "CompressionRatioDecodingPress": DECODING,
    "CAMPress": "merges values at decode time (a DecodingPress): " + DECODING}


#: kvpress 0.5.5's PRESS_REGISTRY (evaluation/evaluate_registry.py) as it writes each press: ``method.press=<key>``
KEYS = {
    "adakv_snapkv": "AdaKVPress(SnapKVPress())", "block_keydiff": "BlockPress(press=KeyDiffPress(), block_size=128)",
    "chunkkv": "ChunkKVPress(press=SnapKVPress(), chunk_length=20)",
    "critical_adakv_expected_attention": "CriticalAdaKVPress(ExpectedAttentionPress(use_vnorm=False))",
    "critical_adakv_snapkv": "CriticalAdaKVPress(SnapKVPress())",
    "critical_expected_attention": "CriticalKVPress(ExpectedAttentionPress(use_vnorm=False))",
    "critical_snapkv": "CriticalKVPress(SnapKVPress())", "cur": "CURPress()", "duo_attention": "DuoAttentionPress()",
    "duo_attention_on_the_fly": "DuoAttentionPress(on_the_fly_scoring=True)",
    "entropy_gated_chunkkv": "EntropyGatedChunkKVPress(press=SnapKVPress())",
    "expected_attention": "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))", "fastkvzip": "FastKVzipPress()",
    "finch": "FinchPress()", "keydiff": "KeyDiffPress()", "kvcompose": "KVComposePress()",
    "kvcompose_unstructured": "KVComposePress(structured=False)", "kvzip": "KVzipPress()",
    "kvzip_plus": "KVzipPress(kvzip_plus_normalization=True)",
    "kvzap_linear": 'DMSPress(press=KVzapPress(model_type="linear"))', "kvzap_mlp": 'DMSPress(press=KVzapPress(model_type="mlp"))',
    "kvzap_mlp_head": 'KVzapPress(model_type="mlp")', "kvzap_mlp_layer": 'AdaKVPress(KVzapPress(model_type="mlp"))',
    "lagkv": "LagKVPress()", "lukv": "LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1)",
    "knorm": "KnormPress()", "observed_attention": "ObservedAttentionPress()", "pyramidkv": "PyramidKVPress()",
    "qfilter": "QFilterPress()", "random": "RandomPress()", "RestoreKV": "RestoreKVPress()",
    "RestoreKV_plus": "RestoreKVPress(kvzip_plus_normalization=True)",
    "snap_think": "ComposedPress([SnapKVPress(), ThinKPress()])", "snapkv": "SnapKVPress()",
    "streaming_llm": "StreamingLLMPress()", "think": "ThinKPress()", "tova": "TOVAPress()",
    "compactor": "CompactorPress()", "adakv_compactor": "AdaKVPress(CompactorPress())",
    "merging_knorm": "MergingPress(KnormPress())", "merging_snapkv": "MergingPress(SnapKVPress())",
    "merging_expected_attention": "MergingPress(ExpectedAttentionPress(epsilon=1e-2))",
    "merging_kvzap_mlp": 'MergingPress(KVzapPress(model_type="mlp"))',
    **{f"decoding_{k}": f"DecodingPress(base_press={p})" for k, p in (
        ("knorm", "KnormPress()"), ("streaming_llm", "StreamingLLMPress()"), ("tova", "TOVAPress()"),
        ("qfilter", "QFilterPress()"), ("adakv_snapkv", "AdaKVPress(SnapKVPress())"), ("keydiff", "KeyDiffPress()"),
        ("adakv_expected_attention_e2", "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"))},
}


def registry_node(key: str) -> dict:
    """The press node ``{press, press_kwargs}`` of kvpress's registry ``key`` (:data:`KEYS`): a positional argument is
    ``press`` (ComposedPress: ``presses``)."""
    def node(e: ast.expr) -> Any:
        if isinstance(e, ast.Call):
            kwargs = {k.arg: node(k.value) for k in e.keywords}
            kwargs.update({"presses" if e.func.id == "ComposedPress" else "press": node(a) for a in e.args})
            return {"press": e.func.id, "press_kwargs": kwargs}
        return [node(x) for x in e.elts] if isinstance(e, ast.List) else ast.literal_eval(e)
    return node(ast.parse(KEYS[key], mode="eval").body)


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


def press_class(name: str) -> Any:
    """The press class ``name``: kvpress's, or ``module:Class`` (a user's own, :func:`methods.resolve`); None if none."""
    from . import resolve

    kp = _kvpress()
    if ":" in name:
        return resolve(name, "method.press", "kvbench.presses", kp.BasePress)
    return getattr(kp, name, None) if name in kp.__all__ else None


def refusal(name: str) -> str | None:
    """Why kvbench cannot run the press class ``name`` (``unknown press`` if there is none); None if it can."""
    kp, cls = _kvpress(), press_class(name)
    if not (isinstance(cls, type) and issubclass(cls, kp.BasePress)):
        return "unknown press"
    return REFUSED.get(name)


def supported() -> list[str]:
    """Names of the presses ``method=kvpress`` runs, sorted."""
    return sorted(n for n in _kvpress().__all__ if refusal(n) is None)


def _plain_scorer(cls: type) -> bool:
    """A ScorerPress class with kvpress's own ``compress``, no ``post_init_from_model`` (nothing loaded from the
    model or the Hub), reading no attention weights: its ``score`` needs a layer's tensors only."""
    kp = _kvpress()
    return (issubclass(cls, kp.ScorerPress) and cls.compress is kp.ScorerPress.compress and not issubclass(
        cls, kp.ObservedAttentionPress) and cls.post_init_from_model is kp.BasePress.post_init_from_model)


def scorer_path(press: Any) -> bool:
    """Whether ``press`` runs on the scorer path: a plain scorer (:func:`_plain_scorer`), or AdaKVPress around one."""
    return _plain_scorer(type(press.press if type(press) is _kvpress().AdaKVPress else press))


def make_press(name: Any, kwargs: Any, key: str = "press") -> Any:
    """``name(**kwargs)``, nested press nodes built first (module docstring); ``artifact`` (a local path or Hub id)
    installed (:func:`methods.kvpress_hooks.install_artifact`). Raises ConfigError (``method.<key>...``): unknown or
    refused press, rejected arguments, an unreadable artefact, or one kvpress would fetch while the Hub is offline."""
    from huggingface_hub import constants

    from .kvpress_hooks import ARTIFACTS, install_artifact

    if name in KEYS:  # kvpress's registry key: its press, the arguments given added
        node = registry_node(str(name))
        if node["press"] == "DecodingPress":  # its base press; the schedule is kvbench's decode.* (KVPressConfig)
            node = node["press_kwargs"]["base_press"]
        name, kwargs = node["press"], {**node["press_kwargs"], **(kwargs or {})}
    why = refusal(str(name))
    if why is not None:
        raise ConfigError(f"method.{key}={name!r}: {why}; accepted values are {', '.join(supported())}, "
                          "kvpress's registry keys (chunkkv, snap_think, ...) or module:Class")
    kwargs = dict(kwargs or {})
    require("compression_ratio" not in kwargs, f"{key}_kwargs.compression_ratio", "set", "comes from budget; remove it")
    artifact, window = kwargs.pop("artifact", None), kwargs.pop("window_size", None) if name == "FinchPress" else None
    for sub in ("press", "base_press"):  # a wrapper's inner press by name, its arguments beside it
        if isinstance(kwargs.get(sub), str):
            kwargs[sub] = {"press": kwargs[sub], "press_kwargs": kwargs.pop(f"{sub}_kwargs", None) or {}}
    kwargs = {k: _nested(v, f"{key}_kwargs.{k}") for k, v in kwargs.items()}
    try:
        press = press_class(name)(**kwargs)
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(f"method.{key}_kwargs={kwargs!r}: {name} rejects them ({e})") from None
    require(not getattr(press, "decoding", False), f"{key}_kwargs.decoding", True, DECODING)
    require(name != "DMSPress" or press.threshold is not None, f"{key}_kwargs.threshold", None,
            "DMSPress evicts the tokens scoring below it: a number")
    if name == "FinchPress":  # kvpress finds the window after a delimiter token kvbench's prompts do not hold
        require(isinstance(window, int) and window > 0, f"{key}_kwargs.window_size", window,
                "FinchPress's observation window (the question's tokens): an integer > 0")
        press.window_size, press.delimiter_token_id = window, -1  # -1: no delimiter, the window stays as set
    if artifact is not None:
        require(ARTIFACTS.get(name, ("", None))[1] is not None, f"{key}_kwargs.artifact", artifact,
                f"{name} takes no local artefact")
        try:
            install_artifact(press, str(artifact))
        except Exception as e:  # noqa: BLE001 - any reader's error: one line
            raise ConfigError(f"method.{key}_kwargs.artifact={artifact!r}: cannot read it ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    fly = getattr(press, "on_the_fly_scoring", False)  # DuoAttention scoring its heads on kmfoda/booksum
    needs = "the kmfoda/booksum data set" if fly else (
        ARTIFACTS.get(name, ("",))[0] if artifact is None and not getattr(press, "stats_folder", None) else "")
    route = ("set it false and give press_kwargs.artifact=<a DuoAttention pattern folder>" if fly else
             "give press_kwargs.artifact=<a local copy>" if ARTIFACTS.get(name, ("", None))[1] else
             "kvbench takes no local copy of it: run it where the Hub is reachable")
    require(not (needs and constants.HF_HUB_OFFLINE), f"{key}_kwargs.{'on_the_fly_scoring' if fly else 'artifact'}",
            True if fly else artifact, f"{name} needs {needs}, which kvpress fetches, and the Hub is offline "
            f"(HF_HUB_OFFLINE=1): {route}")
    return press


def _nested(value: Any, key: str) -> Any:
    """A press node (a mapping with ``press``) as a press; a list element-wise; anything else as it is."""
    if isinstance(value, Mapping) and "press" in value:
        extra = sorted(set(value) - {"press", "press_kwargs"})
        require(not extra, f"{key}.{extra[0] if extra else ''}", value, "a press node has the keys press, press_kwargs")
        return make_press(value["press"], value.get("press_kwargs"), key)
    return [_nested(v, f"{key}[{i}]") for i, v in enumerate(value)] if isinstance(value, list) else value


@dataclass
class KVPressConfig(MethodConfig):
    """Attributes:
        press: a kvpress press class name (``python -m methods.kvpress_press`` lists them), a key of kvpress's
            registry (:data:`KEYS`) or ``module:Class`` (a press of one's own); required.
        press_kwargs: its arguments (null: none), ``compression_ratio`` excepted (set from the budget); nested press
            nodes; ``artifact``: a trained artefact's local path or Hub id; FinchPress: ``window_size``.
    """

    press: str = "???"  # OmegaConf's missing value: method=kvpress names its press
    press_kwargs: dict = field(default_factory=dict)

    def check(self) -> None:
        self.built = make_press(self.press, self.press_kwargs or {})  # the press object (not a field)
        # a decoding_* registry key: DecodingPress's defaults (compression_interval 512, prompt left whole), which the
        # job applies as decode.* unless decode.interval is given (kvbench/job/config.py); the budget is target_size
        self.implied_decode = {"interval": 512, "prefill": False, "schedule": "steps"} if str(self.press).startswith(
            "decoding_") and self.press in KEYS else None


def compression_ratio(n: int, m: int) -> float:
    """kvpress ``compression_ratio`` (fraction removed) keeping exactly m of n tokens (1 ≤ m ≤ n):
    1 − m/n, nudged down until kvpress's ``n_kept = int(n·(1 − cr))`` is m (kvpress ``compute_n_kept``)."""
    cr = 1 - m / n
    while cr > 0 and int(n * (1 - cr)) < m:
        cr = math.nextafter(cr, 0.0)
    return cr


def press_inputs(ctx: LayerContext) -> tuple[Any, torch.Tensor, dict]:
    """``(module, hidden_states (B, w, (H_q + H_kv)·d), kwargs)`` for a press's ``score`` (kvpress's forward hook) from
    the w queries handed over (``ctx.window_queries``: at prefill all n, beside the n keys) and keys: a stand-in
    module's ``q_proj`` / ``k_proj`` read them rotated back by −θ of their positions (pre-RoPE, float64);
    ``rotary_emb``, ``kwargs["position_embeddings"]`` (``(1, ·, d)`` each): RoPE of the forward's positions. At
    decode, as DecodingPress hands its buffer of the last forwards' inputs: the buffered queries, a zero key part (read
    only by prefill-only presses) and the compressing forward's ``ctx.decoding`` positions (a decode step's one, which
    kvpress's SnapKV applies to every window query)."""
    from transformers.models.llama.modeling_llama import rotate_half

    q, lay = ctx.window_queries, ctx.layout
    b, w, dt = q.shape[0], q.shape[2], ctx.keys.dtype
    pos = ctx.positions[-w:]
    cos, sin = ctx.rotary(pos)  # (w, d) float32 each

    def pre_rope(x: torch.Tensor) -> torch.Tensor:  # (B, H, w, d) -> (B, w, H·d)
        x = x.double() * cos.double() - rotate_half(x.double()) * sin.double()
        return x.to(dt).transpose(1, 2).reshape(b, w, -1)

    hidden = torch.cat([pre_rope(q), q.new_zeros(b, w, lay.num_kv_heads * lay.head_dim) if ctx.decoding
                        else pre_rope(ctx.keys)], dim=-1)
    if ctx.decoding:
        cos, sin = ctx.rotary(pos[-ctx.decoding:])
    split = lay.num_q_heads * lay.head_dim
    module = SimpleNamespace(
        head_dim=lay.head_dim, q_proj=lambda h: h[..., :split], k_proj=lambda h: h[..., split:],
        config=SimpleNamespace(num_attention_heads=lay.num_q_heads, num_key_value_heads=lay.num_kv_heads),
        rotary_emb=lambda x, ids: tuple(t[None].to(x.dtype) for t in ctx.rotary(ids.reshape(-1))))
    return module, hidden, {"position_embeddings": (cos[None].to(dt), sin[None].to(dt))}


class KVPress(Method):
    """A kvpress press: a scorer scoring every prompt token once (scorer path), or the press's own hooks."""

    Config = KVPressConfig

    window_size = 1 << 62  # the engine hands every prompt query (W capped at n)

    @property
    def decodes(self) -> bool:
        """Scorer-path presses compress while decoding (kvpress's DecodingPress), but those kvpress asserts prefill."""
        press = self.config.built
        return scorer_path(press) and type(getattr(press, "press", press)).__name__ not in PREFILL_ONLY

    @property
    def decode_window(self) -> int:
        """The queries of the last 256 tokens fed (DecodingPress's default ``hidden_states_buffer_size``; its buffer
        holds the forwards since its last compression), more for a press whose window is longer."""
        return max(_kvpress().DecodingPress.hidden_states_buffer_size, self.min_decode_budget() + 1)

    @property
    def per_head_lengths(self) -> bool:
        """AdaKVPress and hook-path presses: what they keep may differ per head (``module.masked_key_indices``)."""
        return not _plain_scorer(type(self.config.built))

    def min_budget(self) -> int:
        return 1  # kvpress keeps max(1, int(n·(1 − cr)))

    def min_decode_budget(self) -> int:
        """The scorer's observation window (SnapKVPress: 64): a decode-time cache no longer than it leaves the press no
        key to score (kvpress's SnapKV asserts more queries than its window)."""
        press = self.config.built
        return max(1, int(getattr(getattr(press, "press", press), "window_size", 0) or 0))

    def check_layout(self, layout: Any) -> None:
        from .kvpress_hooks import presses

        for press in presses(self.config.built):
            pattern = vars(press).get("load_attention_pattern")  # a local DuoAttention pattern (artifact)
            shape = pattern(None)[2].shape if pattern else None
            require(shape in (None, (layout.num_layers, layout.num_kv_heads)), "press_kwargs.artifact", shape,
                    f"a DuoAttention pattern of {layout.num_layers} layers x {layout.num_kv_heads} KV heads")

    def prefill_hooks(self, model: Any, state: Any, n_tokens: int) -> Any:
        """The press's own hooks around the prefill (:class:`methods.kvpress_hooks.PressHooks`), compressing to the
        plan's budget (``compression_ratio`` keeping m of n); None on the scorer path."""
        from .kvpress_hooks import PressHooks, presses

        press = self.config.built
        if scorer_path(press):
            return None
        m = max(state.plan.layer_budgets[i] for i in state.layout.compressible_layers)
        eager = any(isinstance(p, _kvpress().ObservedAttentionPress) for p in presses(press))
        return PressHooks(press, model, state, compression_ratio(n_tokens, m), eager)

    def compress(self, ctx: LayerContext) -> CompressResult:
        press, m = self.config.built, ctx.budget
        press.compression_ratio = compression_ratio(ctx.n_tokens, m)  # StreamingLLM reads it in score()
        scorer = press.press if hasattr(press, "alpha_safeguard") else press  # AdaKVPress wraps a scorer
        module, hidden, kwargs = press_inputs(ctx)
        scores = scorer.score(module, hidden, ctx.keys, ctx.values, None, kwargs)  # (B, H_kv, n)
        scores = masked_scores(scores, ctx.valid)  # a decode-time layer's empty slots: never kept
        if scorer is not press:
            keep = safeguard_keep_mask(scores, m, press.alpha_safeguard)
            return pack_kept(ctx.keys, ctx.values, keep if ctx.valid is None else keep & ctx.valid)
        idx = scores.topk(m, dim=-1).indices  # (B, H_kv, m): kvpress's stored order, kept when compressed again
        idx = idx if ctx.recompressed else idx.sort(dim=-1).values
        return CompressResult(gather_tokens(ctx.keys, idx), gather_tokens(ctx.values, idx), kept_indices=idx)


if __name__ == "__main__":  # what runs, on which path, and why not for the rest
    from .kvpress_hooks import ARTIFACTS

    kp = _kvpress()
    for name in sorted(n for n in kp.__all__ if refusal(n) != "unknown press"):
        cls, why = getattr(kp, name), refusal(name)
        path = ("scorer path" + ", prefill only" * (name in PREFILL_ONLY) if _plain_scorer(cls) else
                "scorer path around a plain scorer, else hook path" if cls is kp.AdaKVPress else "hook path")
        path += f"; needs {ARTIFACTS[name][0]}" if name in ARTIFACTS else ""
        print(f"{name}: {'refused: ' + why if why else path}")
