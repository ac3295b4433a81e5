"""One-shot compression engine: prefill with SDPA, compress once, decode greedily.

The protocol of every paper reproduced here: batch size 1, greedy decoding, the prompt's
KV cache compressed once at the end of prefill (each layer right after its own prefill
attention, so that every layer's prefill output is computed with the full cache), new
tokens appended uncompressed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from methods.base import Method, apply_budget_floor

from .attention import CompressionState, build_decode_bias
from .fused_decode import FusedDecoder, has_hooks
from .heap import keep_freed_heap
from .kvcache import PreallocatedLayer, preallocated_cache
from .models import LoadedModel

log = logging.getLogger(__name__)


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or inf logits; the sample is recorded as failed, never scored."""


@dataclass
class GenerationResult:
    """Output and measurements of one generation.

    Attributes:
        tokens: generated token ids (stop token excluded).
        text: decoded text (special tokens skipped).
        prompt_tokens: n, prompt length in tokens.
        compressed: whether the cache was compressed (False when n ≤ budget or method=full).
        kept_tokens / stored_tokens: per compressible layer, mean/min/max of logical kept tokens
            (valid slots, averaged over KV heads) and of stored slots per KV head.
        cache_bytes_before / cache_bytes_after: KV cache bytes of all layers right after prefill,
            before and after compression (bias buffers included after).
        prefill_s: prefill seconds excluding compression (a score computed inside the
            prefill attention, LOOK-M's ``fused_score``, is prefill); compress_s: compression seconds;
        decode_s: seconds from the first decode step to the last; generated_tokens;
        decode_tok_s: generated tokens per decode second.
        peak_rss_bytes: process peak resident memory so far (CPU) or peak CUDA memory.
        method_stats: method statistics summed over layers (merged, dropped, ...).
    """

    tokens: list[int]
    text: str
    prompt_tokens: int
    compressed: bool
    kept_tokens: dict[str, float]
    stored_tokens: dict[str, float]
    cache_bytes_before: int
    cache_bytes_after: int
    prefill_s: float
    compress_s: float
    decode_s: float
    generated_tokens: int
    decode_tok_s: float
    peak_rss_bytes: int
    method_stats: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The fields stored in ``predictions.jsonl``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "compressed": self.compressed,
            "kept_tokens": self.kept_tokens,
            "stored_tokens": self.stored_tokens,
            "cache_bytes_before": self.cache_bytes_before,
            "cache_bytes_after": self.cache_bytes_after,
            "prefill_s": round(self.prefill_s, 6),
            "compress_s": round(self.compress_s, 6),
            "decode_s": round(self.decode_s, 6),
            "generated_tokens": self.generated_tokens,
            "decode_tok_s": round(self.decode_tok_s, 4),
            "method_stats": self.method_stats,
        }


def cache_bytes(cache: Any) -> int:
    """Bytes held by the keys and values of every layer of a transformers cache."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (bytes): ``VmHWM`` of ``/proc/self/status``.

    ``ru_maxrss`` (the fallback where ``/proc`` is missing) is not used on Linux because a
    child process inherits its parent's resident set size at ``fork`` as its starting peak: a
    worker started by a 3 GB parent reported a 3 GB peak whatever it did. ``VmHWM`` belongs to
    the process's own address space, and :func:`reset_peak_rss` can restart it.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Restart the peak of :func:`peak_rss_bytes` at the current resident set size.

    Writes ``5`` to ``/proc/self/clear_refs`` (Linux ≥ 4.0). Returns False where that is not
    possible (other systems, restricted ``/proc``): the peak then stays the process's peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory on CUDA, else the process's peak resident set size (bytes, :func:`peak_rss_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": round(sum(values) / len(values), 3), "min": min(values), "max": max(values)}


def _last_row_forward(forward):
    """``forward`` applied to the last row of its input ``(B, q, ·)`` only: ``(B, 1, ·)`` out."""

    def last_row(hidden_states, *args, **kwargs):
        return forward(hidden_states[:, -1:], *args, **kwargs)

    return last_row


@contextlib.contextmanager
def last_row_prefill(model: torch.nn.Module, state: CompressionState):
    """During one prefill, compute the model's last layer for the prompt's last token only.

    Only the last prompt token's logits are used (``logits_to_keep=1``), so of the last
    decoder layer only its keys and values (the cache) and the last token's path matter. Within
    this context that layer's attention output (:func:`kvbench.attention.kvbench_attention`,
    via ``state.last_row_layer``), ``o_proj`` and MLP see the last row only; the residual adds
    broadcast it over the other rows, which nothing reads. Every layer's cache and every
    method's scores (computed from the layer's queries and keys) are unchanged; the logits equal
    the full computation's within float32 rounding (a one-row product instead of a row of a
    matrix product). Saves about 1/L of the prefill (L layers; measured on SmolLM2-135M: see
    ``benchmarks/README.md``).

    Applies to decoder layers with ``self_attn.o_proj`` and ``mlp`` modules (Llama, Mistral,
    Qwen2/3, Gemma 2/3) when no forward hook is registered anywhere in the model (hooks see the
    calls they expect); otherwise a no-op. The modules' ``forward`` is overridden on the
    instances for the duration and restored on exit, exceptions included.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    layer = layers[-1] if layers is not None and len(layers) else None
    attn = getattr(layer, "self_attn", None)
    o_proj, mlp = getattr(attn, "o_proj", None), getattr(layer, "mlp", None)
    idx = getattr(attn, "layer_idx", None)
    modules = [m for m in (o_proj, mlp) if isinstance(m, torch.nn.Module)]
    if len(modules) != 2 or idx is None or has_hooks(model):
        yield
        return
    saved = [(m, m.__dict__.get("forward")) for m in modules]
    for m in modules:
        m.forward = _last_row_forward(m.forward)
    state.last_row_layer = idx
    try:
        yield
    finally:
        state.last_row_layer = None
        for m, own in saved:
            if own is None:
                del m.forward
            else:
                m.forward = own


class Engine:
    """Greedy generation with one-shot KV-cache compression.

    Args:
        loaded: a :class:`kvbench.models.LoadedModel`.
        method: the compression method (``methods.full.FullCache`` for none).
        budget: the job's budget (ratio < 1 or tokens ≥ 1, see ARCHITECTURE.md).
    """

    def __init__(self, loaded: LoadedModel, method: Method, budget: float):
        self.loaded = loaded
        self.model = loaded.model
        self.method = method
        self.budget = budget
        self._rotary = self._make_rotary()
        self.record_logits = False  # tests: keep every step's logits in ``last_logits``
        self.preallocate = True  # decode into a preallocated cache (kvbench.kvcache); False: DynamicCache
        self.reference_decode = False  # tests: decode attention through the reference path
        # The last layer's prefill for the last prompt token only (last_row_prefill); False:
        # the whole layer, as the model computes it (tests, cross-checks).
        self.last_row_prefill = True
        # Decode steps through kvbench.fused_decode (Llama/Mistral/Qwen2/Qwen3) instead of the
        # model's modules; False (tests, cross-checks): always the module path.
        self.fused_decode = True
        self.on_decode_step = None  # callable(step) before each decode step (benchmarks: memory by phase)
        self.last_decode_path = ""  # "fused" or "modules": how the last generation decoded
        FusedDecoder.for_model(self.model)  # fuse the weights now (once per model), not inside a timed sample
        if self.loaded.device.type == "cpu":
            # Freed activations stay in the C heap: no page faults per prefill (kvbench.heap;
            # KVBENCH_KEEP_HEAP=0 turns it off).
            keep_freed_heap()
        self.last_state: CompressionState | None = None  # the state of the last generation (tests, cross-checks)
        self._replay: dict[str, Any] | None = None  # what decode_again repeats (see generate)
        self.last_logits: list[torch.Tensor] = []
        self._floor_warned = False  # the budget-floor warning is logged once per engine

    def _make_rotary(self):
        """Callable positions (k,) → (cos, sin) ``(k, d)`` of the full-attention layers' RoPE."""
        base = getattr(self.model, "model", self.model)
        rope = getattr(base, "rotary_emb", None)
        if rope is None:
            return None
        takes_type = "layer_type" in inspect.signature(rope.forward).parameters
        dtype = self.loaded.dtype

        def rotary(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.zeros(1, dtype=dtype, device=positions.device)
            args = (x, positions.view(1, -1))
            cos, sin = rope(*args, "full_attention") if takes_type else rope(*args)
            return cos[0].float(), sin[0].float()

        return rotary

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: list[int] | None = None,
        min_new_tokens: int = 0,
    ) -> GenerationResult:
        """Prefill ``prompt_ids``, compress the cache once, decode greedily.

        Args:
            prompt_ids: prompt token ids (already truncated by the task).
            max_new_tokens: generation limit (tokens).
            stop_ids: ids that end generation (defaults to the model's stop ids).
            min_new_tokens: steps during which stop ids cannot be chosen (their logits are −inf),
                as ``generate(min_length=prompt + k)`` does.

        Returns:
            A :class:`GenerationResult`.

        Raises:
            NonFiniteLogitsError: NaN/inf logits at any step.
        """
        from transformers import DynamicCache

        model, layout, dev = self.model, self.loaded.layout, self.loaded.device
        stops = set(self.loaded.stop_ids if stop_ids is None else stop_ids)
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: nothing to prefill")
        # The previous sample's state holds its whole cache: release it before this prefill
        # (else a job's peak memory holds two samples' caches).
        self.last_state, self.last_logits, self._replay = None, [], None
        if self.preallocate:
            cache = preallocated_cache(model.config, reserve=max_new_tokens + 1)
        else:
            cache = DynamicCache(config=model.config)
        planned = self.method.plan(n, self.budget, layout)
        plan = apply_budget_floor(planned, n, self.method.min_budget())
        if plan is not planned and not self._floor_warned:
            self._floor_warned = True
            log.warning(
                "budget=%s: fewer tokens than the %d that method %s always keeps (window, recent, sinks) at a "
                "%d-token prompt; such layers keep min(n, %d)%s",
                self.budget, self.method.min_budget(), self.method.name, n, self.method.min_budget(),
                "" if plan.compress else " (here all n: the cache is not compressed)",
            )
        state = CompressionState(
            method=self.method, plan=plan, layout=layout, cache=cache, rotary=self._rotary,
            max_new_tokens=max_new_tokens, reference_decode=self.reference_decode,
        )
        sync = dev.type == "cuda"
        if sync:
            torch.cuda.reset_peak_memory_stats(dev)
        input_ids = torch.tensor([prompt_ids], device=dev)
        trim = last_row_prefill(model, state) if self.last_row_prefill and n > 1 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with trim:
            out = model(
                input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1, kvbench_state=state
            )
        logits = out.logits[0, -1]
        if sync:
            torch.cuda.synchronize()
        prefill_total = time.perf_counter() - t0
        before = cache_bytes(cache) if not state.results else self._bytes_before(cache, state, n)
        finalize = getattr(self.method, "finalize", None)
        if state.results and callable(finalize):
            finalize(state.results)
        build_decode_bias(state, model.dtype)
        after = cache_bytes(cache) + sum(b.numel() * b.element_size() for b in state.bias.values())
        next_pos = n
        repositioned = [r.next_position for r in state.results.values() if r.next_position is not None]
        if repositioned:
            next_pos = max(repositioned)
        kept, stored, mstats = self._cache_stats(state, n)

        state.phase = "decode"
        self.last_state = state
        # what decode_again needs to run this decode once more on the same compressed cache
        self._replay = dict(logits=logits, next_pos=next_pos, stops=stops, min_new_tokens=min_new_tokens,
                            lengths=[layer.keys.shape[-2] if layer.keys is not None else 0 for layer in cache.layers],
                            n=n, kept=kept, stored=stored, mstats=mstats, before=before, after=after,
                            prefill_s=max(0.0, prefill_total - state.compress_s), compress_s=state.compress_s)
        tokens, decode_s = self._decode(state, logits, next_pos, max_new_tokens, stops, min_new_tokens)
        return self._result(tokens, decode_s)

    def _result(self, tokens: list[int], decode_s: float) -> GenerationResult:
        r = self._replay
        return GenerationResult(
            tokens=tokens,
            text=self.loaded.tokenizer.decode(tokens, skip_special_tokens=True),
            prompt_tokens=r["n"],
            compressed=bool(self.last_state.results),
            kept_tokens=r["kept"],
            stored_tokens=r["stored"],
            cache_bytes_before=r["before"],
            cache_bytes_after=r["after"],
            prefill_s=r["prefill_s"],
            compress_s=r["compress_s"],
            decode_s=decode_s,
            generated_tokens=len(tokens),
            decode_tok_s=len(tokens) / decode_s if decode_s > 0 else 0.0,
            peak_rss_bytes=peak_memory_bytes(self.loaded.device),
            method_stats=r["mstats"],
        )

    @torch.inference_mode()
    def decode_again(self, max_new_tokens: int) -> GenerationResult:
        """Decode the last generation's compressed cache once more, from the prefill's logits.

        For decode measurements (the benchmarks' A/B rounds): the cache is cut back to what it
        held after compression (the decoded tokens' slots are overwritten), so every round
        decodes the same cache without another prefill. Prefill and compression fields of the
        result are the last generation's.

        Args:
            max_new_tokens: decode steps (tokens), at most the last generation's ``max_new_tokens``
                (the cache's reserve).

        Returns:
            A :class:`GenerationResult`.

        Raises:
            RuntimeError: no generation to repeat, the last one decoded through the model's
                modules (only the fused step leaves the state as compression left it), or a
                cache layer that cannot be cut back (e.g. a sliding window).
        """
        state = self.last_state
        if state is None or self._replay is None:
            raise RuntimeError("decode_again: no generation to repeat (generate first)")
        if self.last_decode_path != "fused":
            raise RuntimeError("decode_again: the last generation decoded through the model's modules")
        if max_new_tokens > state.max_new_tokens:
            raise RuntimeError(f"decode_again: {max_new_tokens} tokens > the cache's reserve ({state.max_new_tokens})")
        r = self._replay
        for layer, m in zip(state.cache.layers, r["lengths"]):
            if not isinstance(layer, PreallocatedLayer):
                raise RuntimeError(f"decode_again: a {type(layer).__name__} cannot be cut back")
            layer.truncate(m)
        tokens, decode_s = self._decode(state, r["logits"], r["next_pos"], max_new_tokens, r["stops"],
                                        r["min_new_tokens"])
        return self._result(tokens, decode_s)

    def _decode(self, state: CompressionState, logits: torch.Tensor, next_pos: int, max_new_tokens: int,
                stops: set[int], min_new_tokens: int) -> tuple[list[int], float]:
        """Greedy decode loop from the prefill's ``logits`` ``(V,)``; returns (tokens, seconds)."""
        model, dev, cache = self.model, self.loaded.device, state.cache
        sync = dev.type == "cuda"
        self.last_logits = []
        tokens: list[int] = []
        # Decode inputs stay on the device: the next token is the argmax tensor itself and the
        # positions are slices of one tensor, so a step's only host-device sync is reading the
        # token (and the finiteness flag with it) for the stop test.
        positions = torch.arange(next_pos, next_pos + max(1, max_new_tokens), device=dev)
        stop_index = torch.tensor(sorted(stops), dtype=torch.long, device=dev)
        fused = self._decoder()
        self.last_decode_path = "fused" if fused is not None else "modules"
        t1 = time.perf_counter()
        for step in range(max_new_tokens):
            if self.on_decode_step is not None:
                self.on_decode_step(step)
            if self.record_logits:
                self.last_logits.append(logits.float().clone())
            masked = logits.index_fill(0, stop_index, float("-inf")) if step < min_new_tokens and stops else logits
            next_tok = masked.argmax().view(1, 1)
            tok, finite = torch.stack([next_tok[0, 0], torch.isfinite(logits).all().long()]).tolist()
            if not finite:
                raise NonFiniteLogitsError(f"non-finite logits at decode step {step}")
            if tok in stops:
                break
            tokens.append(tok)
            if step == max_new_tokens - 1:
                break
            pos = positions[step : step + 1]
            if fused is not None:
                logits = fused.step(next_tok, pos, cache, state.bias)
            else:
                out = model(
                    input_ids=next_tok,
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=pos.view(1, 1),
                    cache_position=pos,
                    kvbench_state=state,
                )
                logits = out.logits[0, -1]
        if sync:
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - t1

    def _decoder(self) -> FusedDecoder | None:
        """The fused decode step for this generation, or None to decode through the model's modules
        (unsupported model, preallocation or fused decoding switched off, reference decoding, or a
        forward hook registered anywhere in the model: hooks must see the calls they expect)."""
        if not (self.fused_decode and self.preallocate) or self.reference_decode or has_hooks(self.model):
            return None
        return FusedDecoder.for_model(self.model)

    @staticmethod
    def _bytes_before(cache: Any, state: CompressionState, n: int) -> int:
        """Cache bytes as they were before compression (compressed layers counted at n tokens)."""
        total = 0
        for i, layer in enumerate(cache.layers):
            k = layer.keys
            per_token = k.numel() // max(1, k.shape[-2]) * k.element_size() * 2
            total += per_token * (n if i in state.results else k.shape[-2])
        return total

    def _cache_stats(self, state: CompressionState, n: int):
        kept, stored = [], []
        mstats: dict[str, float] = {}
        for res in state.results.values():
            m = res.keys.shape[-2]
            stored.append(m)
            kept.append(float(res.valid.float().sum(-1).mean()) if res.valid is not None else float(m))
            for k, v in res.stats.items():
                mstats[k] = mstats.get(k, 0.0) + float(v)
        if not state.results:
            comp = len(self.loaded.layout.compressible_layers)
            kept, stored = [float(n)] * comp, [n] * comp
        return _stats(kept), _stats(stored), mstats
