"""One-shot compression engine: prefill, compress once, decode greedily, all through the model's own modules.

The papers' protocol (docs/ARCHITECTURE.md): batch size 1, greedy decoding, each layer's prompt cache compressed
right after its own prefill attention, new tokens appended uncompressed. With ``query_tokens``
(``task.compress=context``) only the context is prefilled and compressed; the query part then follows in one forward
on the compressed cache, uncompressed. Every forward is the model's own with ``attn_implementation="kvbench"``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import logging
import resource
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from methods.base import Budget, Method, Plan, PromptFormat, apply_budget_floor, check_budget

from kvbench.engine.attention import DECODE_BACKENDS, CompressionState, Scoring, attach_bias, clock, decode_backends
from kvbench.engine.kvcache import RaggedLayer, RowsCache, preallocated_cache, store_layer
from kvbench.engine.models import LoadedModel, greedy_processors
from kvbench.engine.reconstruct import reconstruct
from kvbench.engine.quantcache import QuantizedLayer

log = logging.getLogger(__name__)


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or inf logits; the sample is recorded as failed, never scored."""


@dataclass
class GenerationResult:
    """Output and measurements of one generation: ``tokens`` (stop token excluded), ``text`` (special tokens skipped)
    and the record's fields, which docs/RESULTS.md defines (tokens and bytes of the cache, seconds, peaks, backends,
    ``cache_trace``, the decode-time compressions, ``read_tokens``/``read_bytes``: :func:`read_point`); ``compressed``
    is False when n ≤ budget or method=full."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    compressed: bool
    kept_tokens: dict[str, float]
    stored_tokens: dict[str, float]
    kept_bytes: int
    stored_bytes: int
    cache_bytes_before: int
    cache_bytes_after: int
    prefill_s: float
    compress_s: float
    decode_s: float
    generated_tokens: int
    decode_tok_s: float
    peak_prefill_bytes: int
    peak_decode_bytes: int
    compressed_tokens: int = 0
    compile_s: float = 0.0
    decode_compiled: bool = False
    sdpa_backends: dict[str, Any] = field(default_factory=dict)
    method_stats: dict[str, float] = field(default_factory=dict)
    cache_trace: list[list] = field(default_factory=list)
    peak_stored_tokens: int = 0
    decode_compressions: int = 0
    decode_compress_s: float = 0.0
    reconstruct_s: float = 0.0
    reconstruct_tokens: int = 0
    read_tokens: dict[str, float] | None = None
    read_bytes: int | None = None

    def record(self) -> dict[str, Any]:
        """The fields stored in ``predictions.jsonl``: all but ``tokens`` and ``text``, seconds to the µs."""
        return {k: round(v, 4 if k == "decode_tok_s" else 6) if k.endswith("_s") else v
                for k, v in vars(self).items() if k not in ("tokens", "text")}


def layer_bytes(layer: Any) -> int:
    """Bytes of a cache layer's filled key/value slots (a :class:`RaggedLayer`'s free reserve not counted; a
    :class:`~kvbench.engine.quantcache.QuantizedLayer`'s packed codes, scales, minima and residual)."""
    if isinstance(layer, QuantizedLayer):
        return layer.nbytes
    slots = sum(layer.lens_host) + len(layer.lens_host) * layer.decoded if isinstance(layer, RaggedLayer) else None
    return sum((t.numel() if slots is None else slots * t.shape[-1]) * t.element_size()
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def read_point(state: CompressionState) -> tuple[list, Any]:
    """(tokens read per KV head by each compressible layer, bytes read by every layer) in the decode step just run:
    each layer's slots after it (its new token included), or the slots :meth:`methods.base.Method.select` chose
    (``state.reads``, device tensors: summed without a sync); bytes pro rata of :func:`layer_bytes`."""
    tokens, nbytes, h = [], 0, state.layout.num_kv_heads
    for i, layer in enumerate(state.cache.layers):
        held = (sum(layer.lens_host) + len(layer.lens_host) * layer.decoded if isinstance(layer, RaggedLayer)
                else h * layer.get_seq_length())
        read = state.reads.pop(i, held)
        nbytes = nbytes + layer_bytes(layer) * read / max(held, 1)
        tokens += [read / h] if i in state.layout.compressible_layers else []
    return tokens, nbytes


@dataclass
class Context:
    """A prefilled (and compressed) context: where every answer from it starts (:meth:`Engine.open`, :func:`prefill`).

    Attributes:
        state: its :class:`CompressionState` (the cache); logits: ``(V,)`` after the last token fed; prefill_s,
            peak_bytes, compress_s: prefill seconds (compression excluded), peak memory (bytes, compression included)
            and compression seconds not yet charged to a result (the first answer's); next_pos: the next token's
            position; ids: every token fed so far; stats: the compression's :class:`GenerationResult` fields; steps:
            decode-phase forwards so far (``schedule=steps``).
    """

    state: CompressionState
    logits: torch.Tensor
    prefill_s: float
    peak_bytes: int = 0
    compress_s: float = 0.0
    next_pos: int = 0
    ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    steps: int = 0


@dataclass
class Row:
    """One answer of a decode batch (:meth:`Engine.decode_rows`): its context (decoded in place), limits, stop ids
    (None: the model's), sampling generator (None: greedy) and ``tag`` (the caller's); the decode's own fields are
    set when it starts."""

    ctx: Context
    max_new_tokens: int
    stop_ids: list[int] | None = None
    min_new_tokens: int = 0
    generator: torch.Generator | None = None
    tag: Any = None


def cache_bytes(cache: Any) -> int:
    """Bytes of the filled key/value slots of every layer of a transformers cache."""
    return sum(layer_bytes(layer) for layer in cache.layers)


def reset_peak_rss() -> None:
    """Restart the process's peak resident set size (``5`` to ``/proc/self/clear_refs``, Linux ≥ 4.0) where possible."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_memory_bytes(devices: list[torch.device]) -> int:
    """Peak memory since :func:`reset_peak_memory` (bytes), summed over ``devices`` (a model split by ``device_map``
    uses several): ``torch.cuda.max_memory_allocated`` of each CUDA device, plus once if any device is not CUDA the
    process's peak resident set size, ``VmHWM`` of ``/proc/self/status`` (its own, restartable: :func:`reset_peak_rss`;
    without ``/proc`` ``ru_maxrss``, which in a forked worker starts at its parent's)."""
    rss = 0
    if any(d.type != "cuda" for d in devices):
        try:
            with open("/proc/self/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))  # kB
        except (OSError, StopIteration):
            rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return sum(int(torch.cuda.max_memory_allocated(d)) for d in devices if d.type == "cuda") + rss


def reset_peak_memory(devices: list[torch.device]) -> None:
    """Restart the peaks of :func:`peak_memory_bytes` for ``devices`` at their current use."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
        else:
            reset_peak_rss()


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": round(sum(values) / len(values), 3) if values else 0.0, "min": min(values, default=0),
            "max": max(values, default=0)}


class Engine:
    """Greedy generation with one-shot KV-cache compression.

    Args:
        loaded: a :class:`kvbench.engine.models.LoadedModel` (loaded with ``attn_implementation="kvbench"``).
        method: the compression method (``methods.full.FullCache`` for none).
        budget: the job's :class:`~methods.base.Budget` (a number is made one by :func:`~methods.base.check_budget`).

    Switches (tests, benchmarks): ``record_logits`` keeps every step's logits in ``last_logits``; ``preallocate``
    (default True) decodes into :func:`kvbench.engine.kvcache.preallocated_cache`, else a ``DynamicCache``;
    ``reference_decode``: decode attention by :func:`kvbench.engine.attention.grouped_attention`; ``on_decode_step``
    is called with the step before each step; ``compile_decode``: decode steps through :meth:`decode_forward` (a
    compile failure sets it False and ``compile_error``); ``devices``: those whose peak memory is summed (the model's);
    ``prompt_format``: the :class:`~methods.base.PromptFormat` for methods that prompt the model (KVzip; default the
    tokenizer's ``encode``; a job sets the model's); ``quant``: a quantized cache's ``cache`` settings, None for the
    model dtype's. ``last_state`` holds the last generation's :class:`CompressionState`.
    """

    def __init__(self, loaded: LoadedModel, method: Method, budget: Budget | float | int, decode: Any = None):
        self.loaded, self.model, self.method = loaded, loaded.model, method
        self.budget = budget if isinstance(budget, Budget) else check_budget(budget)
        self.decoding = decode if decode is not None and decode.interval and method.decodes else None
        rope = getattr(getattr(self.model, "model", self.model), "rotary_emb", None)  # the full-attention layers' RoPE
        extra = ("full_attention",) if rope and "layer_type" in inspect.signature(rope.forward).parameters else ()
        self._rotary = None if rope is None else lambda pos: tuple(  # (k,) positions → (cos, sin) (k, d) float32
            x[0].float() for x in rope(pos.new_zeros(1, dtype=loaded.dtype), pos.view(1, -1), *extra))
        self.record_logits, self.preallocate, self.reference_decode, self.on_decode_step = False, True, False, None
        self.compile_decode, self.compile_error, self.quant, self._compiled = False, None, None, None
        self.devices = sorted({p.device for p in self.model.parameters()}, key=str) or [loaded.device]
        self.prompt_format = PromptFormat(lambda text: loaded.tokenizer.encode(text, add_special_tokens=False))
        self.last_state, self.last_logits = None, []
        self._floor_warned = False  # the budget-floor warning is logged once per engine

    def decode_forward(self):
        """The callable of a decode step: the model, or with ``compile_decode`` the model compiled once per engine by
        ``torch.compile(dynamic=True)`` (T symbolic: one graph for every cache length; its first call's step is
        ``compile_s``); greedy tokens equal eager's (tests/kvbench/test_compile_decode.py)."""
        if self.compile_decode and self._compiled is None:
            self._compiled = torch.compile(self.model, dynamic=True)
        return self._compiled if self.compile_decode else self.model

    def _start(self, ids: list[int], max_new_tokens: int, preallocate: bool) -> CompressionState:
        """This engine's state for a prompt: its plan (budget floor applied), empty cache and reconstruction pass."""
        self.last_state, self.last_logits = None, []  # free the previous sample's cache before this prefill
        d, n = self.decoding, len(ids)
        reserve = (max_new_tokens if d is None else min(max_new_tokens, d.interval)) + 1  # tokens until a compression
        cache = (preallocated_cache(self.model.config, reserve, self.quant) if preallocate or self.quant
                 else DynamicCache(config=self.model.config))
        layout = self.loaded.layout.for_prompt(n, max_new_tokens)  # model.compress_sliding_layers
        planned = self.method.plan(n, self.budget, layout)
        if d is not None and not d.prefill:  # decode-only: the prompt stays whole
            planned = Plan(planned.layer_budgets, planned.head_budgets, compress=False)
        plan = apply_budget_floor(planned, n, self.method.min_budget())
        if plan is not planned and not self._floor_warned:
            self._floor_warned = True
            log.warning("budget=%s: fewer tokens than the %d that method %s always keeps (window, recent, sinks) at a "
                        "%d-token prompt; such layers keep min(n, %d)%s", self.budget, self.method.min_budget(),
                        self.method.name, n, self.method.min_budget(),
                        "" if plan.compress else " (here all n: the cache is not compressed)")
        rec = self.method.reconstruction(ids, self.prompt_format) if plan.compress else None
        return CompressionState(method=self.method, plan=plan, layout=layout, cache=cache, reserve=reserve,
                                scoring=Scoring(rec) if rec is not None and rec.inputs else None,
                                rotary=self._rotary, reference_decode=self.reference_decode,
                                decode_budget=None if d is None else self.budget, window=self.method.decode_window,
                                cut_at_budget=d is not None and d.schedule == "length")  # R-KV rescores a full cache

    @torch.inference_mode()
    def open(self, prompt_ids: list[int], max_new_tokens: int, prefilled: Context | None = None) -> Context:
        """Prefill ``prompt_ids`` (the context) and compress the cache once (or take this engine's part of a shared
        :func:`prefill`): the :class:`Context` every answer from this context starts from. ``max_new_tokens``: the
        tokens fed after it (query part + generation), the room compressed layers keep. ValueError: empty prompt."""
        ctx = prefilled or prefill([self], prompt_ids, max_new_tokens)[0]
        state, c, layout, layers = ctx.state, len(prompt_ids), self.loaded.layout, ctx.state.cache.layers
        token = 2 * layout.num_kv_heads * layout.head_dim * self.model.dtype.itemsize  # K and V of one token, all heads
        kept, stored, mstats = [], [], {}  # tokens per KV head, read from the layers (quantized blocks + residual)
        for i, res in state.results.items():
            kept.append(float(layers[i].get_seq_length() if res.valid is None else res.valid.float().sum(-1).mean()))
            stored.append(kept[-1] if isinstance(layers[i], RaggedLayer) else layers[i].get_seq_length())
            for k, v in res.stats.items():
                mstats[k] = mstats.get(k, 0.0) + float(v)
        if state.results:  # after the stats: a method's finalize may rewrite its results (not the layers)
            self.method.finalize(state.results)
        attach_bias(state)
        whole = len(layout.compressible_layers)  # uncompressed: c tokens in each compressible layer
        sc = state.scoring or Scoring(None)
        stats = dict(compressed_tokens=c, compressed=bool(state.results), kept_bytes=round(sum(kept) * token),
                     kept_tokens=_stats(kept or [float(c)] * whole), stored_tokens=_stats(stored or [c] * whole),
                     method_stats=mstats, stored_bytes=sum(layer_bytes(layers[i]) for i in state.results),
                     cache_bytes_before=sum(token * c if i in state.results or isinstance(x, QuantizedLayer)
                                            else layer_bytes(x) for i, x in enumerate(layers)),
                     cache_bytes_after=cache_bytes(state.cache), reconstruct_s=sc.seconds, reconstruct_tokens=sc.tokens)
        ctx.next_pos = max([r.next_position for r in state.results.values() if r.next_position is not None], default=c)
        ctx.ids, ctx.stats, ctx.compress_s = list(prompt_ids), stats, state.compress_s
        state.phase, self.last_state = "decode", state
        return ctx

    @torch.inference_mode()
    def feed(self, ctx: Context, ids: list[int]) -> None:
        """Prefill ``ids`` on top of ``ctx``'s cache in one forward, uncompressed (causal per head), positions
        continuing (the query part of ``task.compress=context``; a follow-up turn); its time and peak are prefill's."""
        if not ids:
            return
        dev = self.loaded.device
        reset_peak_memory(self.devices)
        t0, pos = time.perf_counter(), torch.arange(ctx.next_pos, ctx.next_pos + len(ids), device=dev)
        self._schedule(ctx, len(ids), ctx.next_pos)
        ctx.logits = self.model(input_ids=torch.tensor([ids], device=dev), past_key_values=ctx.state.cache, use_cache=True,
                                position_ids=pos.view(1, -1), cache_position=pos, logits_to_keep=1,
                                kvbench_state=ctx.state).logits[0, -1]
        ctx.prefill_s += clock(dev) - t0
        ctx.peak_bytes = max(ctx.peak_bytes, peak_memory_bytes(self.devices))
        ctx.next_pos, ctx.ids = ctx.next_pos + len(ids), ctx.ids + list(ids)

    def _schedule(self, ctx: Context, q: int, first: int) -> None:
        """Flag whether the next decode-phase forward (``q`` tokens from position ``first``) compresses
        (``decode.schedule``, docs/DECODING.md): ``steps``, every interval-th such forward (kvpress DecodingPress);
        ``length``, when the tokens fed before it are a multiple of the interval (R-KV). ``steps`` counts from the last
        compression, and a forward of at least ``budget`` tokens compresses at once (DecodingPress's rule)."""
        st, d = ctx.state, self.decoding
        if st.decode_budget is None:
            return
        ctx.steps, st.position = ctx.steps + 1, first + q - 1
        st.compress_now = (len(ctx.ids) % d.interval == 0 if d.schedule == "length"
                           else ctx.steps >= d.interval or q >= st.decode_budget.tokens)
        ctx.steps = 0 if st.compress_now else ctx.steps

    @torch.inference_mode()
    def checkpoint(self, ctx: Context) -> tuple:
        """``ctx``'s state for :meth:`restore`: its cache's layers as they are (O(1): decoding writes past them)."""
        layers = [(x, dict(vars(x))) for x in ctx.state.cache.layers]
        return layers, dict(ctx.state.queries), ctx.logits, ctx.next_pos, list(ctx.ids), ctx.steps

    @torch.inference_mode()
    def restore(self, ctx: Context, saved: tuple) -> None:
        """Put ``ctx`` back as :meth:`checkpoint` saved it (any number of times: a shared context's next question)."""
        layers, queries, ctx.logits, ctx.next_pos, ids, ctx.steps = saved
        ctx.ids, ctx.state.queries, ctx.state.cache.layers = list(ids), dict(queries), [x for x, _ in layers]
        for layer, state in layers:
            layer.__dict__ = dict(state)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int] | None = None,
                 min_new_tokens: int = 0, prefilled: Context | None = None, query_tokens: int = 0) -> GenerationResult:
        """Prefill ``prompt_ids`` (truncated by the task), compress the cache once, decode up to ``max_new_tokens``:
        :meth:`open` on the first n − q ids, :meth:`feed` the last q (``query_tokens``, the query part), :meth:`decode`
        (``stop_ids`` default to the model's; no stop id in the first ``min_new_tokens`` steps). ``prefilled``: this
        engine's part of a shared :func:`prefill`. ValueError: an empty prompt; NonFiniteLogitsError: NaN/inf logits."""
        c = len(prompt_ids) - query_tokens
        ctx = self.open(prompt_ids[:c], max_new_tokens + query_tokens, prefilled)
        self.feed(ctx, prompt_ids[c:])
        return self.decode(ctx, max_new_tokens, stop_ids, min_new_tokens)

    @torch.inference_mode()
    def decode(self, ctx: Context, max_new_tokens: int, stop_ids: list[int] | None = None, min_new_tokens: int = 0,
               generator: torch.Generator | None = None, sampling: Any = None) -> GenerationResult:
        """Generate from ``ctx`` (its cache then holds the answer but its last token), a row of :meth:`decode_rows`:
        greedily, or with ``generator`` by sampling with ``sampling``'s temperature, top-p, top-k
        (:func:`kvbench.engine.models.greedy_processors`). The result carries the prefill time and peak ``ctx`` has not
        charged to an earlier result. NonFiniteLogitsError: NaN/inf logits at a step."""
        out: list = []
        self.decode_rows([Row(ctx, max_new_tokens, stop_ids, min_new_tokens, generator)], 1, sampling,
                         lambda row, result: out.append(result))
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    @torch.inference_mode()
    def fork(self, ctx: Context) -> Context:
        """A copy of ``ctx`` with a cache of its own, to decode beside others (a row of :meth:`decode_rows`); it takes
        over the costs ``ctx`` has not charged yet (:meth:`decode`): ``ctx`` then has none."""
        st = ctx.state
        out = replace(ctx, ids=list(ctx.ids), state=replace(st, cache=copy.deepcopy(st.cache), queries=dict(st.queries),
                                                            backends=dict(st.backends), reads={}))
        ctx.stats, ctx.prefill_s, ctx.peak_bytes, ctx.compress_s = {**ctx.stats, "reconstruct_s": 0.0}, 0.0, 0, 0.0
        return out

    @torch.inference_mode()
    def decode_rows(self, rows: Iterable[Row], batch_size: int | str = 1, sampling: Any = None,
                    on_result: Callable[[Row, Any], None] = lambda row, result: None,
                    max_bytes: int | None = None) -> None:
        """Decode ``rows`` (each its own context: :meth:`fork`), ``batch_size`` at a time: each step one forward of the
        live rows' tokens ``(B, 1)``, every row through its own cache (:class:`kvbench.engine.kvcache.RowsCache`) with
        its own decode-time compression schedule, stop ids, processors and generator (candidate k draws the stream it
        draws alone); a row leaves when it stops and the next takes its slot. ``on_result(row, result)`` as each row
        ends: its :class:`GenerationResult`, or the :class:`NonFiniteLogitsError` that ended it. Batched rows decode
        eagerly; their ``decode_s``: their time in the batch (not other rows' prefill), the peak memory the batch's.
        ``batch_size="auto"``: as many rows as their :meth:`row_bytes` fit in ``max_bytes`` (None: the CUDA device's
        free memory at the first row), at least one."""
        model, pending, live, cap, most = self.model, iter(rows), [], None, 0
        auto, batch_size = batch_size == "auto", 2**62 if batch_size == "auto" else batch_size
        reset_peak_memory(self.devices)  # the decode phase's own peak: the compressed cache and decoding
        forward = self.decode_forward() if batch_size == 1 else model
        with ExitStack() as scope:  # the decode's settings, restored on exit: nothing process-wide stays set
            scope.enter_context(sdpa_kernel(DECODE_BACKENDS))
            if forward is not model:  # a frame dynamo cannot compile runs eager, never a failed sample (compile_error)
                scope.enter_context(torch._dynamo.config.patch(suppress_errors=True))
                # no duck shapes: layers' lengths equal in one sample are no guard, hence no recompile, for the next
                scope.enter_context(fx_config.patch(use_duck_shape=False))
            while True:
                while len(live) < batch_size:
                    t_pull, row = time.perf_counter(), next(pending, None)  # the runner prefills a row as it is pulled
                    if row is None:
                        break
                    for r in live:  # another row's prefill is no part of this row's decode time
                        r.t1 += time.perf_counter() - t_pull
                    if auto:
                        cap = cap or max_bytes or torch.cuda.mem_get_info(self.loaded.device)[0]
                        row.bytes = self.row_bytes(row)
                        if live and sum(r.bytes for r in live) + row.bytes > cap:  # waits for a free slot
                            pending = itertools.chain([row], pending)
                            break
                    live.append(self._begin(row, sampling))
                most = max(most, len(live))
                if not live:
                    break
                t_step, frames = time.perf_counter(), (counters["frames"]["total"], counters["frames"]["ok"])
                if self.on_decode_step is not None:
                    self.on_decode_step(live[0].step)
                results = [self._choose(row, forward is not model) for row in live]
                for row, result in zip(live, results):
                    if result is not None:
                        on_result(row, result)
                live = [row for row, result in zip(live, results) if result is None]
                if not live:
                    continue
                pos, one = torch.cat([r.positions[r.step : r.step + 1] for r in live]), len(live) == 1
                try:
                    out = forward(input_ids=torch.cat([r.next_tok for r in live]), position_ids=pos.view(-1, 1),
                                  past_key_values=live[0].ctx.state.cache if one else RowsCache([r.ctx.state.cache for r in live]),
                                  use_cache=True, cache_position=pos[:1], kvbench_state=live[0].ctx.state if one else
                                  [r.ctx.state for r in live])
                except Exception as e:  # noqa: BLE001 - out of memory: half the batch, its rows again from their start
                    if type(e).__name__ == "UncompletedJobError":
                        raise  # submitit's preemption signal: the task must stop and be requeued
                    if one:  # a row alone fails
                        on_result(live.pop(), e)
                        continue
                    log.warning("a batch of %d rows failed (%s: %s): again with %d", len(live), type(e).__name__, e,
                                len(live) // 2)
                    for row in live:
                        self.restore(row.ctx, row.saved)
                        if row.generator is not None:
                            row.generator.set_state(row.gen_state)
                    batch_size, pending, live = len(live) // 2, itertools.chain(live, pending), []
                    torch.cuda.empty_cache()  # a no-op where CUDA is not in use
                    continue
                for i, row in enumerate(live):
                    row.logits, row.step = out.logits[i, -1], row.step + 1
                    row.ctx.ids.append(row.tokens[-1])
                    row.reads.append(read_point(row.ctx.state))
                    if row.ctx.state.compress_now:
                        row.trace.append(self._trace_point(row.ctx.state, len(row.tokens)))
                now = counters["frames"]["total"], counters["frames"]["ok"]  # frames dynamo tried, compiled
                if now != frames:  # this step compiled (a first call, a new layout): its time is compile_s
                    live[0].compile_s += clock(self.loaded.device) - t_step
                    live[0].compiling += 1
                if now[0] - now[1] != frames[0] - frames[1]:  # a frame failed to compile and ran eager
                    self.compile_error = "torch.compile failed on a decode frame (dynamo's warning in the log); eager"
                    log.warning("compile=true: %s from here on", self.compile_error)
                    self.compile_decode, forward = False, model
                    # dynamo marks a failed frame's code "skip" for the whole process: a later engine's compile
                    # would then run those frames eager, unseen by the counters, while recorded as compiled
                    torch._dynamo.reset()
        if auto:
            log.info("batch_size=auto: at most %d rows decoded together (cache cap %.0f bytes)", most, cap or 0)

    def row_bytes(self, row: Row) -> int:
        """Bytes ``row``'s cache holds at its peak: its filled slots now (:func:`cache_bytes`) plus every layer's
        keys and values of the tokens it may add, ``max_new_tokens`` (decode-time compression: budget + interval)."""
        lay, add = self.loaded.layout, row.max_new_tokens
        add = min(add, self.budget.tokens + self.decoding.interval) if self.decoding else add
        return cache_bytes(row.ctx.state.cache) + add * lay.num_layers * lay.num_kv_heads * lay.head_dim * 2 * (
            self.loaded.dtype.itemsize)

    def _begin(self, row: Row, sampling: Any) -> Row:
        """Start ``row``: its stop ids, positions, processors, the trace's first point, its clock."""
        ctx, state, dev = row.ctx, row.ctx.state, self.loaded.device
        row.stops = sorted(set(self.loaded.stop_ids if row.stop_ids is None else row.stop_ids))
        row.stop_index = torch.tensor(row.stops, dtype=torch.long, device=dev)
        # the next token is the argmax tensor itself and the positions are slices of one tensor, so a step's only
        # host-device sync is reading the token (and the finiteness flag)
        row.positions = torch.arange(ctx.next_pos, ctx.next_pos + max(1, row.max_new_tokens), device=dev)
        row.processors = self.loaded.processors if row.generator is None else greedy_processors(
            self.model, sampling, self.loaded.generation_config)
        row.n, row.logits, row.tokens, row.step, row.compile_s, row.compiling = len(ctx.ids), ctx.logits, [], 0, 0.0, 0
        row.seq = torch.tensor([ctx.ids + [0] * row.max_new_tokens], device=dev) if row.processors else None
        row.trace, row.compress_s0, state.held, row.reads = [self._trace_point(state, 0)], state.decode_compress_s, 0, []
        state.backends["decode"] = decode_backends(state)
        row.saved, row.gen_state = self.checkpoint(ctx), row.generator.get_state() if row.generator else None
        row.t1 = time.perf_counter()
        return row

    def _choose(self, row: Row, compiled: bool) -> Any:
        """Choose ``row``'s next token: None while the row goes on (a forward of it), else (a stop, its limit) its
        :meth:`_result`, or the :class:`NonFiniteLogitsError` that ended it."""
        step, ctx = row.step, row.ctx
        if step >= row.max_new_tokens:
            return self._result(row, compiled)
        if self.record_logits:
            self.last_logits.append(row.logits.float().clone())
        scores = row.logits
        for proc in row.processors:  # the model's generation config, as model.generate applies it
            scores = proc(row.seq[:, : row.n + step], scores.view(1, -1))[0]
        masked = scores.index_fill(0, row.stop_index, float("-inf")) if step < row.min_new_tokens and row.stops else scores
        next_tok = (masked.argmax() if row.generator is None else torch.multinomial(
            torch.softmax(masked.float(), -1), 1, generator=row.generator)[0]).view(1, 1)
        tok, finite = torch.stack([next_tok[0, 0], torch.isfinite(row.logits).all().long()]).tolist()
        if not finite:
            return NonFiniteLogitsError(f"non-finite logits at decode step {step}")
        if tok not in row.stops:
            row.tokens.append(tok)
        if tok in row.stops or step == row.max_new_tokens - 1:
            return self._result(row, compiled)
        if row.processors:
            row.seq[0, row.n + step] = next_tok[0, 0]
        row.next_tok = next_tok
        self._schedule(ctx, 1, ctx.next_pos + step)
        if ctx.state.compress_now:
            row.trace.append(self._trace_point(ctx.state, len(row.tokens)))
        return None

    def _result(self, row: Row, compiled: bool) -> GenerationResult:
        """``row``'s :class:`GenerationResult`; its context is left after the answer (the fed tokens)."""
        ctx, state, tokens, trace, reads = row.ctx, row.ctx.state, row.tokens, row.trace, row.reads
        decode_s, timed = clock(self.loaded.device) - row.t1 - row.compile_s, len(tokens) - row.compiling
        ctx.logits, ctx.next_pos = row.logits, ctx.next_pos + len(ctx.ids) - row.n  # the fed ones: not a stop, not the last
        trace.append(self._trace_point(state, len(tokens)))
        stats, prefill_s, peak, compress_s = ctx.stats, ctx.prefill_s, ctx.peak_bytes, ctx.compress_s  # charged once
        ctx.stats, ctx.prefill_s, ctx.peak_bytes, ctx.compress_s = {**ctx.stats, "reconstruct_s": 0.0}, 0.0, 0, 0.0
        return GenerationResult(
            tokens=tokens, text=self.loaded.tokenizer.decode(tokens, skip_special_tokens=True), prompt_tokens=row.n,
            **stats, prefill_s=prefill_s, compress_s=compress_s, decode_s=decode_s, generated_tokens=len(tokens),
            decode_tok_s=timed / decode_s if decode_s > 0 and timed > 0 else 0.0, compile_s=row.compile_s,
            decode_compiled=compiled, peak_prefill_bytes=peak, peak_decode_bytes=peak_memory_bytes(self.devices),
            sdpa_backends=dict(state.backends), decode_compress_s=state.decode_compress_s - row.compress_s0,
            cache_trace=[p[:3] for p in trace], peak_stored_tokens=max(state.held, *(p[3] for p in trace)),
            decode_compressions=sum(a[4] < b[4] for a, b in zip(trace[1:-1:2], trace[2:-1:2])),
            read_tokens=_stats([round(float(sum(t)) / len(reads), 3) for t in zip(*(r[0] for r in reads))]) if reads else None,
            read_bytes=round(float(sum(r[1] for r in reads)) / len(reads)) if reads else None,
        )

    def _trace_point(self, state: CompressionState, generated: int) -> list:
        """``[generated tokens, stored tokens per KV head (mean over compressible layers of the longest head),
        stored bytes of the whole cache, the longest head of any compressible layer, the layer compressions so far]``."""
        lens = [state.cache.layers[i].get_seq_length() for i in state.layout.compressible_layers]
        return [generated, round(sum(lens) / max(1, len(lens)), 3), cache_bytes(state.cache), max(lens, default=0),
                state.compressions]


@torch.inference_mode()
def prefill(engines: list[Engine], prompt_ids: list[int], max_new_tokens: int) -> list[Context]:
    """Prefill ``prompt_ids`` once for several engines on one loaded model (a shared sweep, docs/SWEEPS.md): at the end
    of each layer's prefill every engine's method compresses that layer into the engine's own cache; layers an engine
    leaves whole are copied after the prefill. A method computing the prefill attention itself (LOOK-M's
    ``prompt_attention``) gets a prefill per method config, so every engine sees the numbers it would see alone; a
    sparse prefill (A-shape) or hooks one per engine.

    Returns:
        One :class:`Context` per engine, in order, for its :meth:`Engine.open`.

    Raises:
        ValueError: an empty prompt.
    """
    n, first, dev = len(prompt_ids), engines[0], engines[0].loaded.device
    if n == 0:
        raise ValueError("empty prompt: nothing to prefill")
    states = [e._start(prompt_ids, max_new_tokens, e.preallocate or len(engines) > 1) for e in engines]
    kinds: dict[Any, list[int]] = {}
    hooks = [st.compressing and st.method.prefill_hooks(first.model, st, n) or None for st in states]
    for i, st in enumerate(states):
        fused, alone = st.compressing and st.method.wants_prompt_attention(dev), hooks[i] or st.method.sparse_prefill
        kinds.setdefault(i if alone else repr(st.method.config) if fused else None, []).append(i)
    out: list[Context | None] = [None] * len(engines)
    for group in kinds.values():
        mine, shared = [states[i] for i in group], len(group) > 1
        cache = preallocated_cache(first.model.config, max_new_tokens + 1, first.quant) if shared else mine[0].cache
        hooked = hooks[group[0]]  # the method compresses through the model's hooks (Method.prefill_hooks)
        reset_peak_memory(first.devices)
        t0 = time.perf_counter()
        with hooked or nullcontext():  # plan=None: the attention function compresses nothing, the hooks do
            logits = first.model(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True,
                                 logits_to_keep=1, kvbench_state=replace(mine[0], plan=None) if hooked else
                                 mine if shared else mine[0]).logits[0, -1]
        for idx, res in mine[0].results.items() if hooked else ():  # the hooks' layers, as _compress_layer stores
            layer = store_layer(cache, idx, res.keys, res.values, res.valid, reserve=mine[0].reserve)
            res.keys, res.values = layer.keys, layer.values
        prefill_s = max(0.0, clock(dev) - t0 - sum(st.compress_s for st in mine))
        for i, st in zip(group, mine):
            if shared:  # the layers this engine did not compress: its own copy of the prompt's cache
                st.cache.layers = [layer if j in st.results else copy.deepcopy(cache.layers[j])
                                   for j, layer in enumerate(st.cache.layers)]
            if st.scoring is not None:  # its forwards and compression, in its prefill's peak memory
                reconstruct(first.model, st, n)
            out[i] = Context(st, logits.clone() if shared else logits, prefill_s, peak_memory_bytes(first.devices))
    return out
