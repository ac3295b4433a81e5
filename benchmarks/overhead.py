"""Harness overhead: per-sample wall time of a ``full`` job vs plain transformers ``generate``.

Same process, same weights, same prompt, same number of new tokens, greedy:

* kvbench: ``Engine(loaded, full, 1.0).generate(ids, T, stop_ids, min_new_tokens=T)``
  (attention ``kvbench``);
* transformers: the same model switched to ``attn_implementation="sdpa"``, ``model.generate``
  with ``do_sample=False``, ``max_new_tokens=min_new_tokens=T`` and the same stop ids as eos.

Both suppress the stop ids for T steps (transformers' min-new-tokens rule), so both generate
exactly T tokens, and the same ones.

The two alternate (ABAB…, the order flipped every repetition) after one warm-up each; the
ratio of the medians is reported. Target: kvbench ≤ 1.05 × transformers.
"""

from __future__ import annotations

import statistics
import time

from .common import QUICK_LENGTHS, BenchResult, Target, build_method, build_prompt, log
from .context import Context

NAME = "overhead"
TITLE = "Harness overhead: full job vs plain transformers generate"
TARGET = 1.05


def run(ctx: Context) -> BenchResult:
    import torch
    from transformers import GenerationConfig

    from kvbench.attention import ATTN_IMPLEMENTATION
    from kvbench.engine import Engine

    s = ctx.settings
    loaded = ctx.loaded
    model = loaded.model
    n = QUICK_LENGTHS[0] if s.quick else 1024  # not --lengths: the ratio is measured at one length
    new = s.new_tokens
    prompt = build_prompt(loaded.tokenizer, n)
    ids = prompt.ids
    engine = Engine(loaded, build_method("full", loaded.layout), 1.0)
    input_ids = torch.tensor([ids], device=loaded.device)
    stops = list(loaded.stop_ids)
    gen_cfg = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=new, min_new_tokens=new, eos_token_id=stops,
        pad_token_id=loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else stops[0],
    )
    outputs: dict[str, list[int]] = {}

    def ours():
        outputs["kvbench"] = engine.generate(ids, new, stop_ids=stops, min_new_tokens=new).tokens

    def plain():
        model.set_attn_implementation("sdpa")
        try:
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_cfg)
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        outputs["transformers"] = out[0, len(ids):].tolist()

    times: dict[str, list[float]] = {"kvbench": [], "transformers": []}
    fns = {"kvbench": ours, "transformers": plain}
    for name in fns:  # warm-up
        fns[name]()
    for rep in range(s.reps):
        order = ["kvbench", "transformers"] if rep % 2 == 0 else ["transformers", "kvbench"]
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        log(f"overhead rep {rep + 1}/{s.reps}: kvbench {times['kvbench'][-1]:.2f} s, "
            f"transformers {times['transformers'][-1]:.2f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["kvbench"] / med["transformers"]
    same = outputs["kvbench"] == outputs["transformers"]
    res = BenchResult(
        NAME, TITLE,
        headers=["path", "prompt tokens", "new tokens", "median s/sample", "min s", "max s", "reps"],
        rows=[[k, len(ids), new, med[k], min(v), max(v), len(v)] for k, v in times.items()],
        targets=[Target(
            "harness overhead (full job / transformers generate)", f"{ratio:.3f}×", f"≤ {TARGET}×", ratio <= TARGET,
            note="" if same else "generated tokens differ",
        )],
        data={"times_s": times, "median_s": med, "ratio": ratio, "same_tokens": same, "prompt_tokens": len(ids)},
    )
    res.notes.append(f"ratio kvbench/transformers = {ratio:.3f}; identical generated tokens: {same}")
    return res
