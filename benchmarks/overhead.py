"""Harness overhead: per-sample time of a ``full`` job vs plain transformers ``generate`` (SDPA, greedy, both
forced to exactly T new tokens), alternating in one process. Target: median kvbench / transformers ≤ 1.05."""

from __future__ import annotations

import statistics
import time

from .common import QUICK_LENGTHS, BenchResult, Context, Target, build_method, build_prompt, log

NAME = "overhead"
TITLE = "Harness overhead: full job vs plain transformers generate"
TARGET = 1.05
PROMPT_TOKENS = 1024


def alternate(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds of each ``fns[name]()`` over ``reps`` repetitions after one warm-up each, the
    order flipped every repetition (ABBA...): both sides see the same drift of the machine."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name in list(fns) if rep % 2 == 0 else list(fns)[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    return times


def ratio_result(name: str, title: str, times: dict[str, list[float]], target: str, bound: float, prompt_tokens: int,
                 new_tokens: int, note: str = "", **data) -> BenchResult:
    """The table and the target of a two-sided timing: ratio of the medians, first side / second ≤ ``bound``."""
    med = {k: statistics.median(v) for k, v in times.items()}
    first, second = times
    ratio = med[first] / med[second]
    return BenchResult(
        name, title, headers=["path", "prompt tokens", "new tokens", "median s/sample", "min s", "max s", "reps"],
        rows=[[k, prompt_tokens, new_tokens, med[k], min(v), max(v), len(v)] for k, v in times.items()],
        targets=[Target(target, f"{ratio:.3f}×", f"≤ {bound}×", ratio <= bound, note)],
        data=dict(data, times_s=times, median_s=med, ratio=ratio, prompt_tokens=prompt_tokens))


def run(ctx: Context) -> BenchResult:
    import torch
    from transformers import GenerationConfig

    from kvbench.engine.generate import Engine

    s, loaded = ctx.settings, ctx.loaded
    model = loaded.model
    ids = build_prompt(loaded.tokenizer, QUICK_LENGTHS[0] if s.quick else PROMPT_TOKENS)[1]
    new = s.new_tokens
    engine = Engine(loaded, build_method("full", loaded.layout), 1.0)
    input_ids = torch.tensor([ids], device=loaded.device)
    stops = list(loaded.stop_ids)
    pad = loaded.tokenizer.pad_token_id
    gen_cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=new, min_new_tokens=new,
                               eos_token_id=stops, pad_token_id=stops[0] if pad is None else pad)
    outputs: dict[str, list[int]] = {}

    def ours():
        outputs["kvbench"] = engine.generate(ids, new, stop_ids=stops, min_new_tokens=new).tokens

    def plain():
        own = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_cfg)
        finally:
            model.set_attn_implementation(own)
        outputs["transformers"] = out[0, len(ids):].tolist()

    times = alternate({"kvbench": ours, "transformers": plain}, s.reps)
    same = outputs["kvbench"] == outputs["transformers"]
    return ratio_result(NAME, TITLE, times, "harness overhead (full job / transformers generate)", TARGET, len(ids),
                        new, "" if same else "generated tokens differ", same_tokens=same)
