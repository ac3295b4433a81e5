"""Compression overhead per method: compression time as a fraction of prefill time, and its scaling.

For each prompt length one prefill runs through the engine with a recording method that
keeps everything and stores each layer's :class:`methods.base.LayerContext` (its own
``prefill_s`` excludes the recording). Then every available method compresses those same
contexts, as the engine does at the end of each layer's prefill: ``plan``, per compressible
layer ``compress`` plus writing the result into a (preallocated) cache layer, then
``finalize`` when the method has one. That time over the prefill time is the overhead.
Budget: 25 % retention ratio. Target: ≤ 5 % at 4k for every method. The exponent of
compression time vs prompt length is the least-squares slope of log time on log length
(1 = linear; we flag > 1.2).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, ClassVar

from .common import (RATIO_25, BenchResult, Target, build_method, build_prompt, log, method_available, off_target_length,
                     off_target_lengths)
from .context import Context

NAME = "compression"
TITLE = "Compression overhead per method (fraction of prefill time) and scaling with prompt length"
METHODS = ["snapkv", "pyramidkv", "adakv", "headkv", "lookm", "selkv", "compresskv"]
FULL_LENGTHS = [2048, 4096, 8000]
TARGET_FRACTION = 0.05
TARGET_LENGTH = 4096
MAX_EXPONENT = 1.2
SLOW_S = 5.0  # methods slower than this per pass are timed once


def _recorder(layout, window: int):
    from methods.base import CompressResult, Method, Plan

    class Recorder(Method):
        """Keeps every token and records each layer's context (window = the largest any method needs)."""

        name: ClassVar[str] = "recorder"

        def __init__(self):
            super().__init__(None, layout)
            self.contexts: dict[int, Any] = {}

        @property
        def window_size(self) -> int:
            return window

        def plan(self, n_tokens, budget, layout_):
            return Plan(layer_budgets=[n_tokens] * layout_.num_layers, compress=True)

        def compress(self, ctx):
            self.contexts[ctx.layer_idx] = ctx
            return CompressResult(keys=ctx.keys, values=ctx.values)

    return Recorder()


def _compress_all(method, contexts: dict[int, Any], n: int, layout, reserve: int) -> tuple[float, float]:
    """Seconds to plan and compress every recorded layer with ``method`` (as the engine would).

    Returns ``(total, in_prefill)``: the total includes ``in_prefill``, the extra time of a
    score computed inside the prefill attention (:func:`_in_prefill_scores`; 0 for most methods).
    """
    from kvbench.kvcache import PreallocatedLayer, store_layer

    sums, in_prefill_s = _in_prefill_scores(method, contexts)
    t0 = time.perf_counter()
    plan = method.plan(n, RATIO_25, layout)
    results = {}
    for i, ctx in contexts.items():
        w = min(method.window_size, n)
        layer_ctx = dataclasses.replace(
            ctx,
            window_queries=ctx.window_queries[:, :, ctx.window_queries.shape[2] - w:],
            budget=int(plan.layer_budgets[i]),
            head_budget=plan.head_budgets[i] if plan.head_budgets is not None else None,
            artifacts=method.artifacts,
            prompt_attention=sums.get(i),
        )
        result = method.compress(layer_ctx)
        result.keys, result.values = store_layer(PreallocatedLayer(reserve), result.keys, result.values)
        results[i] = result
    finalize = getattr(method, "finalize", None)
    if callable(finalize):
        finalize(results)
    return time.perf_counter() - t0 + in_prefill_s, in_prefill_s


def _in_prefill_scores(method, contexts: dict[int, Any]) -> tuple[dict[int, Any], float]:
    """Column sums the engine would compute inside the prefill attention, and what that costs.

    For a method whose ``wants_prompt_attention`` is true on the contexts' device (LOOK-M on
    CPU) the engine replaces each compressible layer's SDPA call by
    :func:`methods.lookm.attention_with_column_sums`; that extra prefill time belongs to the
    method. Per layer, the engine's SDPA prefill attention and the fused one run back to back
    on the recorded queries, keys and values, the fused one first in every other layer (the
    second call of a pair finds the tensors in the cache); the returned seconds are the summed
    difference. (Each one twice, SDPA-fused-fused-SDPA with the faster runs counted, measured
    the same, 0.23–0.30 s over 30 layers at 4096 tokens on a 2-core AMD EPYC, and added 80 s to
    the suite at 8000 tokens.)
    Other methods: ``({}, 0.0)``.
    """
    from kvbench.attention import _prefill_attention, fuse_prompt_attention, fused_prefill_attention

    sums, extra = {}, 0.0
    for i, ctx in contexts.items():
        q, k, v = ctx.window_queries, ctx.keys, ctx.values
        if not fuse_prompt_attention(method, q, k, None, ctx.softcap):
            continue
        times: dict[str, float] = {}
        # the order alternates layer by layer (the second call finds q, k, v in the cache);
        # len(sums) = the layers timed so far
        for which in ("fused", "sdpa") if len(sums) % 2 else ("sdpa", "fused"):
            t0 = time.perf_counter()
            if which == "sdpa":
                _prefill_attention(None, q, k, v, None, ctx.scaling, ctx.softcap)
            else:
                _out, sums[i] = fused_prefill_attention(method, q, k, v, ctx.scaling, ctx.softcap)
            times[which] = time.perf_counter() - t0
        extra += times["fused"] - times["sdpa"]
    return sums, extra


def fit_exponent(lengths: list[int], seconds: list[float]) -> float | None:
    """Least-squares slope of log(seconds) on log(length): t ∝ n^slope."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(lengths, seconds) if t and t > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def prefill_flops(config: Any, n: int) -> float:
    """FLOPs (2 per multiply-add) of a causal prefill of ``n`` tokens through a decoder-only model.

    Per layer and token: the q/k/v/o projections and a gated (SwiGLU/GeGLU: three matrices)
    MLP; per layer: QK^T and PV over the n(n+1)/2 causal (query, key) pairs; the LM head for
    the last token only (the engine asks for one logit row). Norms, RoPE and softmax are left
    out (no multiply-adds).

    Args:
        config: a transformers config (``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` (default hidden / heads), ``vocab_size``).
        n: prompt tokens.
    """
    hidden, layers, h_q = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    h_kv = getattr(config, "num_key_value_heads", None) or h_q
    d = getattr(config, "head_dim", None) or hidden // h_q
    per_token = hidden * h_q * d * 2 + hidden * h_kv * d * 2 + 3 * hidden * config.intermediate_size
    pairs = n * (n + 1) / 2
    return 2.0 * (layers * (per_token * n + 2 * h_q * d * pairs) + hidden * config.vocab_size)


def lookm_score_flops(config: Any, n: int) -> float:
    """FLOPs of LOOK-M's cumulative attention of all n prompt queries: QK^T over the causal triangle.

    ``H_q · d`` multiply-adds per causal (query, key) pair and layer, half of the prefill's
    attention (which also multiplies by V); the exp per pair (as many as in the prefill's own
    softmax) is not counted. Same ``config`` fields as :func:`prefill_flops`.
    """
    h_q = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // h_q
    return 2.0 * config.num_hidden_layers * h_q * d * n * (n + 1) / 2


def prepare_kernels(methods: dict[str, Any], device: Any) -> bool:
    """Build and load LOOK-M's compiled CPU kernels (:mod:`methods.cpu_kernels`) before anything is timed.

    A machine's first use compiles them (about 0.3 s, once: the library is cached under
    ``KVBENCH_CACHE_DIR``); inside the timing, that would be charged to LOOK-M's first length.
    Returns whether it loaded them (False: no LOOK-M, not CPU, or the kernels are unavailable,
    in which case LOOK-M runs its PyTorch operations and the log says why). Never raises.
    """
    if "lookm" not in methods or getattr(device, "type", str(device)) != "cpu":
        return False
    from methods.cpu_kernels import load as load_kernels

    return load_kernels() is not None


def run(ctx: Context) -> BenchResult:
    import torch

    from kvbench.engine import Engine

    s = ctx.settings
    outside = [m for m in s.methods or [] if m not in METHODS]
    why_outside = (f"--methods {', '.join(outside)}: not measured by this benchmark (it times the score-based "
                   f"methods: {', '.join(METHODS)})") if outside else None
    if outside:
        log(f"compression: {why_outside}")
    if not s.selected(METHODS):  # before the model loads
        return BenchResult(NAME, TITLE, skipped=why_outside)
    loaded = ctx.loaded
    layout = loaded.layout
    lengths = s.lengths if s.quick or s.prompt_lengths else FULL_LENGTHS
    methods: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for name in s.selected(METHODS):
        why = method_available(name)
        if why is None:
            try:
                methods[name] = build_method(name, layout)
            except Exception as e:  # noqa: BLE001 - any construction failure means "cannot benchmark it"
                why = f"not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        if why:
            unavailable[name] = why
            log(f"compression: {name}: {why}")
    prepare_kernels(methods, loaded.device)
    window = max([m.window_size for m in methods.values()] + [1])
    prefill: dict[int, float] = {}
    seconds: dict[str, dict[int, float]] = {m: {} for m in methods}
    in_prefill: dict[str, dict[int, float]] = {}  # of which: score inside the prefill attention
    for n in lengths:
        rec = _recorder(layout, window)
        prompt = build_prompt(loaded.tokenizer, n)
        Engine(loaded, rec, 1.0).generate(prompt.ids[:128], 1, stop_ids=[])  # warm-up
        rec.contexts.clear()
        r = Engine(loaded, rec, 1.0).generate(prompt.ids, 1, stop_ids=[])
        prefill[n] = r.prefill_s
        with torch.inference_mode():
            for name, m in list(methods.items()):
                try:
                    times = [_compress_all(m, rec.contexts, r.prompt_tokens, layout, s.new_tokens + 1)]
                    if times[0][0] < SLOW_S:  # a second pass for fast methods; slow ones once (time budget)
                        times.append(_compress_all(m, rec.contexts, r.prompt_tokens, layout, s.new_tokens + 1))
                except Exception as e:  # noqa: BLE001 - report the method as failed, keep the others
                    unavailable[name] = f"failed at n={n} ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                    log(f"compression: {name}: {unavailable[name]}")
                    del methods[name], seconds[name]
                    continue
                seconds[name][n] = sum(t for t, _ in times) / len(times)
                if any(p for _, p in times):
                    in_prefill.setdefault(name, {})[n] = sum(p for _, p in times) / len(times)
        log(f"compression: n={n} prefill {prefill[n]:.2f} s; " +
            ", ".join(f"{k} {v[n] * 1000:.0f} ms" for k, v in seconds.items()))
        del rec
    res = BenchResult(
        NAME, TITLE,
        headers=["method"] + [f"{n} tok: ms (% prefill)" for n in lengths] + ["exponent"],
        data={"prefill_s": prefill, "compress_s": seconds, "in_prefill_s": in_prefill, "unavailable": unavailable,
              "budget": RATIO_25},
    )
    if why_outside:
        res.notes.append(why_outside)
    target_n = TARGET_LENGTH if TARGET_LENGTH in lengths else lengths[-1]
    for name in s.selected(METHODS):
        if name in unavailable:
            res.rows.append([name] + [unavailable[name]] + [""] * len(lengths))
            res.targets.append(Target(f"{name}: compression / prefill at {target_n} tokens", "-",
                                      f"≤ {TARGET_FRACTION:.0%}", None, unavailable[name]))
            continue
        per = seconds[name]
        expo = fit_exponent(lengths, [per[n] for n in lengths])
        res.data.setdefault("exponent", {})[name] = expo
        res.rows.append([name] + [f"{per[n] * 1000:.1f} ({100 * per[n] / prefill[n]:.2f} %)" for n in lengths] + [expo])
        frac = per[target_n] / prefill[target_n]
        res.targets.append(Target(f"{name}: compression / prefill at {target_n} tokens", f"{100 * frac:.2f} %",
                                  f"≤ {TARGET_FRACTION:.0%}", frac <= TARGET_FRACTION,
                                  off_target=off_target_length(target_n, TARGET_LENGTH)))
        if expo is not None:
            res.targets.append(Target(f"{name}: exponent of compression time vs prompt length", f"{expo:.2f}",
                                      f"≈ 1 (≤ {MAX_EXPONENT})", expo <= MAX_EXPONENT,
                                      off_target=off_target_lengths(lengths, FULL_LENGTHS)))
    res.rows.append(["(prefill s)"] + [f"{prefill[n]:.2f}" for n in lengths] + [fit_exponent(lengths, [prefill[n] for n in lengths])])
    for name, per in in_prefill.items():
        res.notes.append(f"{name}: of which its score inside the prefill attention (extra time over SDPA): " +
                         ", ".join(f"{per[n]:.2f} s at {n}" for n in lengths if n in per) + " tokens.")
    if "lookm" in seconds:
        _lookm_floor(res, loaded.model.config, lengths, target_n,
                     methods["lookm"].wants_prompt_attention(loaded.model.device))
    res.notes.append("compression = plan + per-layer compress + write into the cache (+ finalize), on the contexts "
                     "recorded from one engine prefill per length; mean of 2 passes (one pass when a pass takes over "
                     f"{SLOW_S:.0f} s); budget 25 %.")
    return res


def _c_kernel() -> bool:
    """Whether LOOK-M's compiled CPU kernels (:mod:`methods.cpu_kernels`) load here."""
    from methods import cpu_kernels

    return cpu_kernels.unavailable_reason() is None


def _lookm_floor(res: BenchResult, config: Any, lengths: list[int], target_n: int, fused: bool) -> None:
    """Add LOOK-M's FLOP floor (score FLOPs / prefill FLOPs) to the data, its targets and the notes.

    ``fused``: whether the measured LOOK-M computed its score inside the prefill attention.
    """
    floor = {n: lookm_score_flops(config, n) / prefill_flops(config, n) for n in lengths}
    res.data["lookm_flop_floor"] = floor
    res.data["lookm_fused_score"] = fused
    how = ("score fused into the prefill attention (fused_score); " if fused else "")
    for t in res.targets:
        extra = ""
        if t.name.startswith("lookm: compression"):
            extra = f"{how}a separate score pass needs ≈ {floor[target_n]:.0%} of the prefill's FLOPs at {target_n} tokens, see notes"
        elif t.name.startswith("lookm: exponent"):
            extra = ("the score and the merge targets are quadratic in n by definition (every query × every "
                     "earlier key; every evicted × every kept key)")
        if extra:  # after a "not judged" note, if any
            t.note = "; ".join(x for x in (t.note, extra) if x)
    shares = ", ".join(f"{100 * floor[n]:.1f} % at {n}" for n in lengths)
    kernel = "the compiled CPU kernel (`methods.cpu_kernels`, `method.kernel: auto`)" if _c_kernel() else \
        "PyTorch operations (`methods.lookm._blocked_attention`; the compiled kernels are unavailable here)"
    fused_note = (
        "Here (CPU, LOOK-M's `fused_score: auto`) the engine computes the score inside the prefill attention "
        f"(`methods.lookm.attention_with_column_sums`, with {kernel}): each block of query rows gives the "
        "attention output and the column sums from the same probabilities, instead of SDPA plus that second "
        "pass. LOOK-M's time above = that attention's extra time over SDPA (both run back to "
        "back per layer on the recorded tensors, the fused one first in every other layer; it can be negative) + eviction and merging. What grows like n² is the merge: "
        "every evicted key is compared with every kept key (E·m·d multiply-adds per head, quadratic at a "
        "ratio budget), so the exponent target cannot be met by a faithful LOOK-M. "
        if fused else
        "This run scored in a separate pass (`method.fused_score=off`, or a device where `auto` keeps SDPA). ")
    res.notes.append(
        "LOOK-M: its score is the attention every prompt query pays to every earlier key (Wan et al. 2024, "
        "text-only), the column sums of the causal attention matrix. A separate pass after the prefill needs "
        "QK^T over the causal triangle once more — H_q·d multiply-adds and one exp per (query, key) pair and "
        f"layer, half of the prefill's attention matmuls: {shares} tokens of this model's prefill FLOPs "
        "(matmuls only). " + fused_note +
        "A faithful LOOK-M's time grows like n² (exponent → 2); `method.window_size=W > 0` (an opt-in, "
        "non-faithful variant) scores only the last W queries and costs like SnapKV."
    )
