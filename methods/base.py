"""The method contract: what the engine hands a compression method and what it gets back.

A method is one module ``methods/<name>.py`` with a :class:`MethodConfig` dataclass (its
fields are the Hydra node ``conf/method/<name>.yaml``) and a :class:`Method` subclass:

* :meth:`Method.plan`, once per sample before prefill: tokens kept per layer (and per head)
  as a :class:`Plan`; the default is a uniform budget.
* :meth:`Method.compress`, once per compressible layer at the end of prefill:
  :class:`LayerContext` in, :class:`CompressResult` out. A :class:`ScoreMethod` only writes
  :meth:`ScoreMethod.score`.
* :meth:`Method.finalize`, once per sample after the last layer (SelKV's global compensation).
* Methods that score by prompting the model (KVzip's context reconstruction) say what to feed in
  :meth:`Method.reconstruction`; the engine then runs those forwards after the prefill, collects
  :meth:`Method.reconstruction_score` per layer, asks :meth:`Method.allocate` for the budgets and
  compresses each layer from the scores (``LayerContext.reconstruction_scores``).
* :meth:`Method.prefill_hooks` (instead of ``compress``): a method that compresses through the model's
  own modules (kvpress's forward hooks) gets the model and the engine's state around the prefill forward.

Methods are pure functions of tensors: they never see tasks, prompts or files (artifacts
such as head scores are parsed by :mod:`methods.artifacts`).

Budgets (ARCHITECTURE.md, "Budgets"): a float in (0, 1] is a retention ratio ρ of the prompt
length n (m = ⌊ρ·n⌋, SelKV Sec. 3.2); an integer ≥ 2 is the average number of tokens kept per
layer per KV head, recent window included (KVCache-Factory / AdaKV / HeadKV / CompressKV). A
prompt no longer than its budget is not compressed.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

if TYPE_CHECKING:  # annotations only: budget checks do not import torch
    import torch


class ConfigError(ValueError):
    """A user-caused configuration problem; the message is one line naming key and accepted values."""


class ContractError(RuntimeError):
    """A method's output breaks the contract (:func:`check_result`): one line naming the method, layer and clause."""


def structured(schema: type, node: Any, prefix: str = "") -> Any:
    """``node`` (a dict) checked against the dataclass ``schema`` by OmegaConf (as Hydra checks a composed
    config): an instance of it.

    Raises:
        ConfigError: unknown key (the accepted keys listed), wrong type or choice, or ``__post_init__``'s error.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as e:
        key, first = f"{prefix}{e.full_key}", str(e.msg).splitlines()[0]
        if "not in" in first or "Missing key" in first:
            accepted = sorted(OmegaConf.structured(schema).keys())
            raise ConfigError(f"{key}: unknown key; accepted keys are {', '.join(accepted)}") from None
        raise ConfigError(f"{key}={e.value!r}: {first}") from None


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """Raise ``ConfigError("method.<key>=<value>: <rule>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"method.{key}={value!r}: {rule}")


@dataclass
class MethodConfig:
    """Base of a method's config dataclass; its fields are the Hydra node ``conf/method/<name>.yaml``.

    On construction every ``Literal[...]`` field is checked against its choices, then
    :meth:`check` runs the method's range checks.

    Raises:
        ConfigError: ``method.<key>=<value>: accepted values are ...`` or ``: must be ...``.
    """

    def __post_init__(self) -> None:
        for key, hint in typing.get_type_hints(type(self)).items():
            choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
            if choices and getattr(self, key) not in choices:
                require(False, key, getattr(self, key), f"accepted values are {', '.join(map(str, choices))}")
        self.check()

    def check(self) -> None:
        """Range checks of the fields (override; raise with :func:`require`)."""


@dataclass(frozen=True)
class HeadLayout:
    """Attention layout of a model, as the methods need it.

    Attributes:
        num_layers: number of decoder layers L.
        num_q_heads: query heads per layer H_q.
        num_kv_heads: key/value heads per layer H_kv (H_q for MHA).
        head_dim: d, channels per head.
        compressible_layers: indices of layers whose cache may be compressed (full-attention
            layers; sliding-window layers of Gemma 2/3 are left alone).
        model_name: a short name used to look up artifacts (e.g. ``smollm2``).
        sliding_window: with ``model.compress_sliding_layers: true``, the window (tokens) of the
            sliding-window layers, else 0: see :meth:`for_prompt`.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    compressible_layers: tuple[int, ...] = ()
    model_name: str = ""
    sliding_window: int = 0

    def for_prompt(self, n_tokens: int, max_new_tokens: int) -> HeadLayout:
        """This layout, or every layer compressible when ``sliding_window`` is set and
        n + max_new_tokens ≤ it (the sliding layers then see the whole prompt and every decoded token)."""
        if not self.sliding_window or n_tokens + max_new_tokens > self.sliding_window:
            return self
        return dataclasses.replace(self, compressible_layers=tuple(range(self.num_layers)))

    @property
    def group_size(self) -> int:
        """GQA group size G = H_q / H_kv (1 for MHA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def is_gqa(self) -> bool:
        return self.group_size > 1


@dataclass
class Plan:
    """Per-sample budget plan returned by :meth:`Method.plan`.

    Attributes:
        layer_budgets: tokens kept per KV head for each layer, length L (layers that are not
            compressible may hold any value; they are ignored).
        head_budgets: optional ``(L, H_kv)`` long tensor of per-head token counts for
            head-wise allocation across layers (HeadKV); ``None`` otherwise.
        compress: False when the prompt is no longer than the budget (no compression).
    """

    layer_budgets: list[int]
    head_budgets: torch.Tensor | None = None
    compress: bool = True


@dataclass
class LayerContext:
    """Everything a method sees for one layer at the end of prefill, or at a decode-time compression.

    Shapes: B batch (always 1 in the protocol), H_kv KV heads, H_q query heads, n prompt
    tokens (at decode time: the tokens the layer holds, the newest last), W observation-window
    queries, d head dim.

    Attributes:
        layer_idx: index of this layer.
        layout: the model's :class:`HeadLayout`.
        keys: ``(B, H_kv, n, d)`` cached keys, after RoPE (and key norm where the model has one).
        values: ``(B, H_kv, n, d)`` cached values.
        window_queries: ``(B, H_q, W, d)`` queries of the last W prompt positions, after q-norm
            and RoPE, rebuilt by the engine (W = the method's ``window_size``, capped at n).
        scaling: the attention scale (usually d^-0.5; Gemma 2 uses query_pre_attn_scalar^-0.5).
        softcap: attention logit soft-capping value (Gemma 2) or ``None``.
        budget: tokens to keep per KV head in this layer (from the plan).
        head_budget: ``(H_kv,)`` long tensor of per-head budgets, or ``None``.
        positions: ``(n,)`` long tensor, the RoPE positions of the cached tokens.
        rotary: callable ``positions (k,) -> (cos, sin)`` each ``(k, d)``, the model's RoPE
            tables, for methods that re-position keys (SelKV Eq. 7); ``None`` if unavailable.
        artifacts: parsed artifacts (head scores, layer scores) or empty.
        prompt_attention: ``(B, H_q, n)`` float32 column sums of the whole causal prompt
            attention (the H2O / LOOK-M cumulative score), computed by the engine inside the
            prefill attention when the method's :meth:`Method.wants_prompt_attention` is
            true; ``None`` otherwise (the method then computes what it needs itself).
        valid: ``(B, H_kv, n)`` bool, the slots that hold a token, or ``None`` (all). Set at decode time for a
            layer whose heads hold different numbers of tokens: each head's tokens right-aligned (its newest
            token in the last slot), the empty slots first with zero keys and values.
        decoding: at a decode-time compression (``decode.interval``, docs/DECODING.md) the tokens its forward fed
            (1 for a decode step, the query part's q), else 0: ``keys`` are the layer's whole cache, the current
            token last; ``window_queries`` the queries of the last W tokens fed (W = :attr:`Method.decode_window`;
            the prompt's last ones, then each forward's); ``positions`` their positions ``(W,)``, the last the
            current token's.
        recompressed: the cache will be compressed again while decoding (always at a decode-time compression): the
            order of the returned tokens is the stored slot order the next compression sees.
        reconstruction_scores: ``(B, H_kv, n)`` this layer's :meth:`Method.reconstruction_score` of every
            token, as :meth:`Method.allocate` left them (0 where no forward scored), or ``None``.
    """

    layer_idx: int
    layout: HeadLayout
    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor
    scaling: float
    budget: int
    softcap: float | None = None
    head_budget: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)
    prompt_attention: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    decoding: int = 0
    recompressed: bool = False
    reconstruction_scores: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[-2]


@dataclass
class CompressResult:
    """What a method returns for one layer.

    Attributes:
        keys: ``(B, H_kv, m, d)`` kept (possibly merged or re-positioned) keys.
        values: ``(B, H_kv, m, d)`` kept (possibly merged) values.
        valid: optional ``(B, H_kv, m)`` bool mask for per-head variable lengths (heads padded
            to the layer's longest head); False slots are never attended.
        logit_bias: optional ``(B, H_kv, m)`` or ``(B, H_q, m)`` float32 additive bias on the
            attention logits of the kept positions at decode (SelKV Eq. 6 compensation).
        kept_indices: optional ``(B, H_kv, m)`` long tensor of the original positions kept
            (for statistics, tests and the kvpress cross-check).
        next_position: if the method re-positioned keys to contiguous positions (SelKV Eq. 7),
            the position decoding continues from in this layer; else ``None``.
        stats: scalar statistics (e.g. ``merged``, ``dropped``) summed over layers by the engine.
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None
    kept_indices: torch.Tensor | None = None
    next_position: int | None = None
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptFormat:
    """The model's prompt format around one user turn, for methods that prompt the model (:meth:`Method.reconstruction`):
    ``head`` the ids before the turn's text (system prompt, user header), ``tail`` after it (end of turn, generation
    prompt); ``encode(text)``: the tokenizer's ids of ``text``, no special tokens added."""

    encode: Callable[[str], list[int]]
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()


@dataclass
class Reconstruction:
    """Forwards the engine runs on the whole prefilled cache before it compresses (:meth:`Method.reconstruction`).

    Attributes:
        inputs: ``[(input_ids, start, end), ...]``: one forward each, fed on top of the n prefilled tokens
            (positions n, n + 1, ...; the cache is cut back to n after each); it scores prefilled positions [start, end).
        sinks: the first ``sinks`` prefilled tokens are attention sinks, always kept.
    """

    inputs: list[tuple[list[int], int, int]]
    sinks: int = 0


@dataclass
class ReconstructionContext:
    """One compressible layer in one reconstruction forward (:meth:`Method.reconstruction_score`). B batch, q fed
    tokens, n prefilled tokens.

    Attributes:
        queries: ``(B, H_q, q, d)`` the fed tokens' queries after q-norm and RoPE.
        keys, values: ``(B, H_kv, n + q, d)`` the layer's cache: the prefilled tokens, then the fed ones.
        start, end, sinks: the forward's scored positions [start, end) and :attr:`Reconstruction.sinks`.
        hidden_norm: ``(B, q)`` L2 norm of each fed token's attention input (after the layer's input norm).
        out_proj: ``(hidden, H_q · d)`` the layer's output projection W_O.
    """

    layer_idx: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    start: int
    end: int
    sinks: int
    hidden_norm: torch.Tensor | None = None
    out_proj: torch.Tensor | None = None


@dataclass(frozen=True)
class Budget:
    """A checked budget (:func:`check_budget` makes it): a retention ratio ρ in (0, 1] of the prompt
    length (``ratio``), or ``tokens``, the average number kept per layer per KV head, recent window
    included (an integer ≥ 2). Exactly one is set; ``value`` is the one set (as in ``config.yaml``)."""

    ratio: float | None = None
    tokens: int | None = None

    @property
    def value(self) -> float | int:
        return self.tokens if self.ratio is None else self.ratio

    def __str__(self) -> str:
        return str(self.value)

    def of(self, n_tokens: int) -> int:
        """m, tokens per KV head for an n-token prompt, capped at n: ⌊ρ·n⌋ (SelKV Sec. 3.2) or the count."""
        return min(n_tokens, self.tokens if self.ratio is None else math.floor(self.ratio * n_tokens))


def check_budget(value: Any) -> Budget:
    """The one place a budget value gets its meaning: a float in (0, 1] is a ratio (rounded to 12
    significant digits: ``range(0.1, 0.4, 0.1)``'s 0.30000000000000004 is 0.3), an integer ≥ 2 or an
    integral float > 1 (``64.0``) a token count.

    Raises:
        ConfigError: neither (the integer 1, one token, would read as the ratio 1.0 in reports).
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if number and isinstance(value, float):
        value = float(f"{value:.12g}")
        if value <= 1:
            return Budget(ratio=value)
    if number and float(value).is_integer() and value >= 2:
        return Budget(tokens=int(value))
    raise ConfigError(f"budget={value!r}: must be a retention ratio in (0, 1] or an integer token count >= 2"
                      + ("; budget=1.0 keeps every token" if value == 1 and value is not True else ""))


def apply_budget_floor(plan: Plan, n_tokens: int, floor: int) -> Plan:
    """Raise every layer (and head) budget of ``plan`` to ``min(n, floor)``, ``floor`` =
    :meth:`Method.min_budget` (tokens per KV head).

    A small ratio can give fewer tokens than the windows and sinks the method always keeps
    (``budget=0.01`` of 200 tokens is 2, SnapKV keeps W = 32); as in KVCache-Factory such layers
    keep the floor. Token budgets below it are rejected up front (:func:`methods.check_min_budget`).

    Returns:
        ``plan`` itself when nothing is below the floor, else a new :class:`Plan`
        (``compress=False`` when every layer then keeps all n).
    """
    low = min(n_tokens, max(int(floor), 0))
    heads = plan.head_budgets
    if min(plan.layer_budgets, default=low) >= low and (heads is None or int(heads.min()) >= low):
        return plan
    layers = [max(int(b), low) for b in plan.layer_budgets]
    heads = None if heads is None else heads.clamp(min=low)
    return Plan(layer_budgets=layers, head_budgets=heads, compress=plan.compress and min(layers) < n_tokens)


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per-head token rows ``(B, H, m, d)``, contiguous: ``out[b, h, i] = x[b, h, indices[b, h, i]]``.

    ``x`` ``(B, H, n, d)``, ``indices`` ``(B, H, m)`` long. One ``index_select`` over a 2-D row
    view of ``x`` (several times faster on CPU than ``gather``; strided views such as the
    preallocated cache's ``[:, :, :n]`` are read in place), ``gather`` for other layouts.

    Raises:
        IndexError: an index outside [0, n).
    """
    import torch  # here, not at module level: config validation imports this module without torch

    b, h, n, d = x.shape
    s_b, s_h, s_n, s_d = x.stride()
    if (
        indices.shape[:2] != (b, h) or s_d != 1 or s_n < d or s_b % s_n or s_h % s_n or indices.numel() == 0
    ):
        return x.gather(2, indices.unsqueeze(-1).expand(*indices.shape, d))
    if bool(((indices < 0) | (indices >= n)).any()):
        raise IndexError(f"gather_tokens: index out of range for {n} tokens")
    first_row = (torch.arange(b, device=x.device).view(b, 1, 1) * (s_b // s_n)
                 + torch.arange(h, device=x.device).view(1, h, 1) * (s_h // s_n))
    n_rows = (b - 1) * (s_b // s_n) + (h - 1) * (s_h // s_n) + n
    rows = x.as_strided((n_rows, d), (s_n, 1))  # row r starts r·s_n elements after x's first
    return rows.index_select(0, (indices + first_row).reshape(-1)).view(b, h, indices.shape[-1], d)


def pack_kept(keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> CompressResult:
    """The result of a head-wise method (AdaKV, HeadKV, CompressKV compositions), whose KV heads keep
    different numbers of tokens: each head's kept rows in original order, padded to the layer's
    longest head m_max; ``valid`` marks the real slots (the engine never attends the padding).

    ``keys``/``values`` ``(B, H_kv, n, d)``, ``keep`` ``(B, H_kv, n)`` bool. ``kept_indices``
    ``(B, H_kv, m_max)``: valid slots ascending, padded slots arbitrary evicted positions. ``stats``:
    ``kept_tokens`` (valid slots) and ``stored_tokens`` (all slots), summed over layers by the engine.
    """
    import torch

    counts = keep.sum(-1)  # (B, H)
    m_max = int(counts.max()) if counts.numel() else 0
    # stable sort on "evicted" puts each head's kept positions first, in ascending order
    # (a copy: the indices outlive compression in the result, a view would hold all n of them)
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :m_max].clone()
    valid = torch.arange(m_max, device=keep.device) < counts.unsqueeze(-1)
    return CompressResult(gather_tokens(keys, order), gather_tokens(values, order), valid, kept_indices=order,
                          stats={"kept_tokens": float(valid.sum()), "stored_tokens": float(valid.numel())})


class Method:
    """Base class of a compression method.

    Subclasses set ``Config`` (a :class:`MethodConfig` dataclass) and implement :meth:`compress`.

    Attributes:
        name: registry name (``method.name``): the method's module name, e.g. ``snapkv``; a plugin's class name.
        window_size: W, how many trailing prompt queries the engine hands over (0 if none).
        decodes: whether :meth:`compress` takes decode-time contexts (``LayerContext.decoding``, ``valid``):
            the scoring methods; ``decode.interval > 0`` with another method is a configuration error.
        decode_only: a decode-time method (R-KV): ``decode.interval=0`` with it is a configuration error.
    """

    Config: ClassVar[type] = MethodConfig
    decodes: ClassVar[bool] = False
    decode_only: ClassVar[bool] = False
    #: whether :meth:`compress` returns per-head lengths (``CompressResult.valid``): read before a model loads
    per_head_lengths: ClassVar[bool] = False
    #: whether decode steps read a query-dependent part of the cache (:meth:`select`: Quest)
    reads: ClassVar[bool] = False
    #: whether the prefill attention follows a static sparse pattern (:meth:`prefill_attention`: A-shape, Tri-shape)
    sparse_prefill: ClassVar[bool] = False

    def __init__(self, config: Any = None, layout: HeadLayout | None = None, artifacts: dict | None = None):
        self.config = config if config is not None else self.Config()
        self.layout = layout
        self.artifacts = artifacts or {}

    @property
    def name(self) -> str:  # a built-in's module (its registry name), another's class (a plugin's module says less)
        module = type(self).__module__
        return module.rsplit(".", 1)[-1] if module.startswith("methods.") else type(self).__name__

    @property
    def window_size(self) -> int:
        return int(getattr(self.config, "window_size", 0) or 0)

    @property
    def decode_window(self) -> int:
        """W of decode-time compression: the queries of the last W tokens fed that the engine keeps per layer."""
        return self.window_size

    def min_budget(self) -> int:
        """Tokens the method always keeps (windows, sinks); a token budget below it is a config error."""
        return self.window_size

    def min_decode_budget(self) -> int:
        """The least token budget that decode-time compression can cut to (default :meth:`min_budget`)."""
        return self.min_budget()

    def check_layout(self, layout: HeadLayout) -> None:
        """Raise :class:`ConfigError` if the method cannot run on this attention layout."""

    def prefill_hooks(self, model: Any, state: Any, n_tokens: int) -> typing.ContextManager | None:
        """A context manager the engine enters around the prefill forward of an ``n_tokens`` prompt, for a method
        that compresses through the model's own modules (kvpress's forward hooks), or None (the default:
        :meth:`compress` per layer). The forward then runs without the engine's compression (its own prefill,
        never shared); ``state`` is the engine's per-sample state: ``plan``, ``layout``, ``cache`` (the
        transformers cache being filled). By its exit the method has put into ``state.results`` a
        :class:`CompressResult` per compressible layer (the keys/values the cache holds; ``valid`` for
        per-head lengths) and added its own seconds to ``state.compress_s``; the engine stores them as
        :meth:`compress`'s results."""
        return None

    def wants_prompt_attention(self, device: torch.device) -> bool:
        """Whether the engine computes a whole-prompt prefill with :meth:`prompt_attention` instead of
        SDPA and hands its column sums over (``LayerContext.prompt_attention``). Default: false."""
        return False

    def prompt_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                         softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal prefill attention and the column sums of its softmax in one pass, for a method whose
        score needs every prompt query (LOOK-M: :func:`methods.lookm.attention_with_column_sums`).

        Args:
            query: ``(B, H_q, n, d)`` every prompt query after RoPE; key, value: ``(B, H_kv, n, d)``.
            scaling, softcap: the layer's logit scale and soft-capping (None: none).

        Returns:
            ``(out (B, H_q, n, d) in value's dtype, sums (B, H_q, n) float32)``.
        """
        raise NotImplementedError(f"method {self.name} computes no prompt attention")

    def reconstruction(self, ids: Sequence[int], fmt: PromptFormat) -> Reconstruction | None:
        """The forwards to run after prefilling ``ids`` (the n compressed token ids) before compressing, or None
        (the default: each layer is compressed at the end of its prefill). With forwards the engine collects
        :meth:`reconstruction_score` per compressible layer, then :meth:`allocate`, then :meth:`compress` per layer."""
        return None

    def reconstruction_score(self, ctx: ReconstructionContext) -> torch.Tensor:
        """``(B, H_kv, end - start)`` scores of the prefilled tokens [start, end) from one reconstruction forward."""
        raise NotImplementedError(f"method {self.name} has no reconstruction score")

    def allocate(self, plan: Plan, scores: Mapping[int, torch.Tensor], reconstruction: Reconstruction) -> Plan:
        """The plan after the reconstruction forwards, from every compressible layer's scores ``{layer: (B, H_kv, n)}``
        (which it may change in place, e.g. sinks to +inf). Default: ``plan``."""
        return plan

    def select(self, ctx: LayerContext) -> torch.Tensor | None:
        """Sparse reading (``reads``), at each one-token decode step of a compressible layer: ``(B, H_kv, G, T)``
        bool, the slots each query head reads (query head h = kv·G + g, G = H_q / H_kv; a KV head reads the union of
        its G heads'), or ``(B, H_kv, 1, T)``, one set per KV head, or None (all). ``ctx.keys`` ``(B, H_kv, T, d)``:
        the layer's cache, the current token last; ``ctx.window_queries`` ``(B, H_q, 1, d)``: the step's query;
        ``ctx.budget``: the plan's."""
        return None

    def prefill_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          budget: int) -> torch.Tensor:
        """The prefill attention of a compressible layer under a static sparse pattern (``sparse_prefill``): ``query``
        ``(B, H_q, q, d)`` at positions T − q … T − 1, ``key``/``value`` ``(B, H_kv, T, d)``, ``budget`` the plan's.
        Returns ``(B, H_q, q, d)``."""
        raise NotImplementedError(f"method {self.name} has no sparse prefill")

    def plan(self, n_tokens: int, budget: Budget, layout: HeadLayout) -> Plan:
        """Uniform per-layer budget (override for layer/head-wise allocation); ``compress=False`` when n ≤ m."""
        m = budget.of(n_tokens)
        return Plan(layer_budgets=[m] * layout.num_layers, compress=m < n_tokens)

    def compress(self, ctx: LayerContext) -> CompressResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def stored_budget(self, ctx: LayerContext) -> int:
        """Tokens per KV head :meth:`compress` may keep of ``ctx`` (:func:`check_result`): ``ctx.budget``. A method that
        stores more than it reads (Quest: ``keep``) says so here."""
        return ctx.budget

    def finalize(self, results: Mapping[int, CompressResult] | Sequence[CompressResult | None]) -> None:
        """Called once per sample with every layer's result (``{layer: result}``, or a sequence with
        ``None`` for uncompressed layers), before decode; may rewrite them in place (SelKV's
        ``compensation: global``). Default: no-op."""


class ScoreMethod(Method):
    """A method that scores every prompt token and keeps the best ones per KV head (kvpress's ScorerPress).

    A subclass implements :meth:`score`. The base keeps, in every KV head, the last
    ``recent_window`` prompt tokens and the ``budget − recent_window`` highest-scoring tokens
    before them, and gathers their keys and values (original order kept).

    ``recent_window`` is read from the config (``recent_window``; ``None`` or absent: equal to
    ``window_size``, the observation window, as SnapKV keeps its window).

    At decode time a layer with per-head lengths (``ctx.valid``) keeps, per head, the valid slots among its
    top ``budget``: the empty slots score −inf (:func:`masked_scores`).
    """

    decodes = True

    @property
    def recent_window(self) -> int:
        recent = getattr(self.config, "recent_window", None)
        return self.window_size if recent is None else int(recent)

    def min_budget(self) -> int:
        return self.recent_window

    def score(self, ctx: LayerContext) -> torch.Tensor:  # pragma: no cover - abstract
        """``(B, H_kv, n)`` scores of every prompt token, higher = keep (the last ``recent_window``
        positions are kept whatever their score)."""
        raise NotImplementedError

    def compress(self, ctx: LayerContext) -> CompressResult:
        import torch

        from .scoring import topk_keep_window

        scores = self.score(ctx)
        if tuple(scores.shape) != (*ctx.keys.shape[:2], ctx.n_tokens) or bool(scores.isnan().any()):
            raise breach(self, ctx, f"score(ctx) must be (B, H_kv, n) = {(*ctx.keys.shape[:2], ctx.n_tokens)} without "
                                    f"NaN; got {tuple(scores.shape)}" + " with NaN" * bool(scores.isnan().any()))
        idx = topk_keep_window(masked_scores(scores, ctx.valid), ctx.budget,
                               min(self.recent_window, ctx.n_tokens))  # (B, H_kv, m)
        if ctx.valid is not None:  # each head keeps its valid slots among the top m
            keep = torch.zeros_like(ctx.valid).scatter_(-1, idx, True) & ctx.valid
            return pack_kept(ctx.keys, ctx.values, keep)
        return CompressResult(keys=gather_tokens(ctx.keys, idx), values=gather_tokens(ctx.values, idx), kept_indices=idx)


def breach(method: Method, ctx: LayerContext, clause: str) -> ContractError:
    """The :class:`ContractError` of ``method`` on ``ctx``'s layer: one line naming the method, layer and clause."""
    phase = f"decode-time compression (fed {ctx.decoding})" if ctx.decoding else "prefill"
    return ContractError(f"method {type(method).__name__}, layer {ctx.layer_idx} ({phase}, n={ctx.n_tokens}): {clause}")


def check_result(method: Method, ctx: LayerContext, result: CompressResult) -> None:
    """The engine's check of ``method.compress(ctx)``'s ``result`` (docs/METHODS.md, "The contract"): keys and values
    ``(B, H_kv, m, d)`` with ``ctx.keys``' B, H_kv, d; ``valid``/``kept_indices`` ``(B, H_kv, m)``, indices in
    [0, n); the tokens kept per KV head within the allocation: each head ≤ ``ctx.head_budget[h]`` when the plan has
    head budgets, else ≤ ``ctx.budget`` (a ``logit_bias`` per query head: ≤ G·budget, each query head's own), and for
    per-head lengths (``valid``) the layer's average ≤ ``ctx.budget`` (G·budget with such a bias) + ½. Shapes are
    read without a sync; ``valid`` and ``kept_indices`` cost one reduction each.

    Raises:
        ContractError: the first clause broken.
    """
    k, v, (b, h, n, d) = result.keys, result.values, ctx.keys.shape
    if k.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise breach(method, ctx, f"keys {tuple(k.shape)} and values {tuple(v.shape)} must be (B, H_kv, m, d) = "
                                  f"({b}, {h}, m, {d})")
    m, pad, idx = k.shape[2], (b, h, k.shape[2]), result.kept_indices
    for name, x in (("valid", result.valid), ("kept_indices", idx)):
        if x is not None and tuple(x.shape) != pad:
            raise breach(method, ctx, f"{name} {tuple(x.shape)} must be (B, H_kv, m) = {pad}")
    if idx is not None and bool(((idx < 0) | (idx >= n)).any()):
        raise breach(method, ctx, f"kept_indices must lie in [0, {n})")
    group, budget = 1 if result.logit_bias is None else max(1, result.logit_bias.shape[1] // h), method.stored_budget(ctx)
    counts = result.valid.sum(-1) if result.valid is not None else None  # (B, H_kv)
    if ctx.head_budget is not None:
        if bool(((counts if counts is not None else m) > ctx.head_budget.to(k.device) * group).any()):
            raise breach(method, ctx, f"keeps more tokens in a KV head than LayerContext.head_budget "
                                      f"{ctx.head_budget.tolist()}")
    elif counts is not None and float(counts.float().mean()) > budget * group + 0.5:
        raise breach(method, ctx, f"keeps {float(counts.float().mean()):.1f} tokens per KV head on average, over the "
                                  f"layer budget of {budget * group} (LayerContext.budget{f' x {group} query heads' * (group > 1)})")
    elif counts is None and m > budget * group:
        raise breach(method, ctx, f"keeps {m} tokens per KV head, over the layer budget of {budget} "
                                  "(LayerContext.budget: the job's budget as this layer's token count)")


def masked_scores(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``scores`` ``(B, H, n)`` with −inf where ``valid`` ``(B, H, n)`` is False (the empty slots of a decode-time
    context); ``scores`` itself when ``valid`` is None."""
    return scores if valid is None else scores.masked_fill(~valid, float("-inf"))
