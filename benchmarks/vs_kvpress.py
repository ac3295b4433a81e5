"""Against kvpress: the same SnapKV setting (window 32, kernel 5, 25 % kept) through kvpress's pipeline and through
kvbench, alternating in one process. Target: median per-sample time kvbench / kvpress ≤ 1.05 on CPU (parity), ≤ 0.95
on a GPU (where kvbench must lead). Skipped without the optional extra (``pip install -e ".[kvpress]"``)."""

from __future__ import annotations

from .common import QUICK_LENGTHS, BenchResult, Context, Target, build_method, build_prompt, wrap
from .overhead import alternate, ratio_result

NAME = "kvpress"
TITLE = "Against kvpress: SnapKV through kvpress's pipeline vs kvbench"
TARGET_CPU, TARGET_GPU = 1.05, 0.95
WINDOW, KERNEL, KEEP = 32, 5, 0.25
PROMPT_TOKENS = 2048


def target(ctx: Context) -> float:
    """The bound of kvbench / kvpress on ``--device``: parity on CPU, a lead on a GPU."""
    import torch

    device = ctx.settings.device
    return TARGET_CPU if device == "cpu" or (device == "auto" and not torch.cuda.is_available()) else TARGET_GPU


def run(ctx: Context) -> BenchResult:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS)  # kvpress wraps every attention function at import (for
    try:  # head-wise presses, not SnapKV; its wrapper passes kvbench's attention a wrong argument)
        from kvpress import KVPressTextGenerationPipeline, SnapKVPress
    except ImportError as e:
        why = f"kvpress is not importable ({e}); install the optional extra: pip install -e \".[kvpress]\""
        return BenchResult(NAME, TITLE, skipped=why, targets=[
            Target("kvbench / kvpress per-sample time (SnapKV)", "-", f"≤ {target(ctx)}×", None, why)])
    finally:
        ALL_ATTENTION_FUNCTIONS.update(saved)
    import torch

    from kvbench.engine.generate import Engine

    s, loaded = ctx.settings, ctx.loaded
    model, tok = loaded.model, loaded.tokenizer
    context = build_prompt(tok, QUICK_LENGTHS[-1] if s.quick else PROMPT_TOKENS)[0]
    new = s.new_tokens
    engine = Engine(loaded, build_method("snapkv", loaded.layout, window_size=WINDOW, kernel_size=KERNEL,
                                         pooling="avg", gqa_aggregation="mean"), KEEP)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=loaded.device)
    press = SnapKVPress(compression_ratio=1 - KEEP, window_size=WINDOW, kernel_size=KERNEL)
    answers: dict[str, str] = {}

    def ours():
        r = engine.generate(tok.encode(wrap(tok, context), add_special_tokens=False), new, stop_ids=[])
        answers["kvbench"] = r.text

    def theirs():
        own, eos = model.config._attn_implementation, model.generation_config.eos_token_id
        model.set_attn_implementation("sdpa")
        model.generation_config.eos_token_id = []  # never stop: exactly `new` tokens, as kvbench
        try:
            with torch.inference_mode():
                answers["kvpress"] = pipe(context, question="", press=press, max_new_tokens=new)["answer"]
        finally:
            model.set_attn_implementation(own)
            model.generation_config.eos_token_id = eos

    times = alternate({"kvbench": ours, "kvpress": theirs}, s.reps)
    same = answers["kvbench"].strip() == answers["kvpress"].strip()
    return ratio_result(NAME, TITLE, times, "kvbench / kvpress per-sample time (SnapKV)", target(ctx),
                        len(tok.encode(wrap(tok, context), add_special_tokens=False)), new,
                        "" if same else "answers differ", answers=answers, same_answer=same,
                        setting={"window_size": WINDOW, "kernel_size": KERNEL, "pooling": "avg", "gqa": "mean", "keep": KEEP})
