"""Numerics and edges: float32 scores whatever the dtype, no compression below the budget,
budget=1.0 identical to the full cache, over-long NIAH lengths skipped and reported."""

from __future__ import annotations

import math

import pytest
import torch

from eval.niah import NIAHTask
from kvbench.engine.generate import Engine
from kvbench.job.run import summarize
from methods.base import HeadLayout, LayerContext
from methods.full import FullCache
from methods.scoring import window_attention
from methods.snapkv import SnapKV, SnapKVConfig, snapkv_scores
from methods.streamingllm import StreamingLLM, StreamingLLMConfig
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import byte_tokenizer


def reference_window_attention(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """float64 softmax(q·kᵀ·scale) of the last W queries with the causal mask, GQA by repetition."""
    b, h_q, w, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h_q // h_kv, dim=1)
    logits = torch.einsum("bhwd,bhnd->bhwn", q.double(), kk) * scaling
    for i in range(w):
        logits[:, :, i, n - w + i + 1 :] = -math.inf
    return torch.softmax(logits, dim=-1)


def test_window_attention_is_float32_for_bf16_inputs():
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 4, 3, 16, generator=g) * 3).to(torch.bfloat16)
    k = (torch.randn(1, 2, 40, 16, generator=g) * 3).to(torch.bfloat16)
    out = window_attention(q, k, scaling=0.25)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_window_attention(q, k, 0.25), atol=2e-6, rtol=1e-5)
    # a bf16 softmax would be off by ~1e-2: the float32 path is what keeps the ranking exact
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_snapkv_scores_are_float32_and_match_the_float32_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    layout = HeadLayout(2, 4, 2, 16, (0, 1))
    keys = torch.randn(1, 2, 50, 16, generator=g).to(dtype)
    q = torch.randn(1, 4, 8, 16, generator=g).to(dtype)

    def ctx(k, qq):
        return LayerContext(layer_idx=0, layout=layout, keys=k, values=k, window_queries=qq, scaling=0.25, budget=20)

    cfg = SnapKVConfig(window_size=8, kernel_size=5)
    low = snapkv_scores(ctx(keys, q), cfg)
    high = snapkv_scores(ctx(keys.float(), q.float()), cfg)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, high)  # the same numbers: scoring upcasts before any arithmetic


@pytest.fixture(scope="module")
def loaded():
    return loaded_for(tiny_model("llama", layers=2, seed=5))


IDS = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()


def generate(loaded, method, budget, steps=6):
    eng = Engine(loaded, method, budget)
    eng.record_logits = True
    res = eng.generate(IDS, steps, stop_ids=[])
    return res, eng.last_logits


@pytest.mark.parametrize("make", [
    lambda lay: SnapKV(SnapKVConfig(window_size=4, kernel_size=3), lay),
    lambda lay: StreamingLLM(StreamingLLMConfig(n_sinks=4), lay),
], ids=["snapkv", "streamingllm"])
def test_budget_one_gives_the_full_cache_predictions(loaded, make):
    full, full_logits = generate(loaded, FullCache(layout=loaded.layout), 1.0)
    res, logits = generate(loaded, make(loaded.layout), 1.0)
    assert res.compressed is False
    assert res.tokens == full.tokens
    for a, b in zip(logits, full_logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("budget", [40, 100, 1.0])
def test_prompt_not_longer_than_the_budget_is_not_compressed(loaded, budget):
    res, _ = generate(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), budget)
    assert res.compressed is False
    assert res.kept_tokens == {"mean": 40.0, "min": 40.0, "max": 40.0}
    assert res.record()["compressed"] is False
    shorter, _ = generate(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 39)
    assert shorter.compressed is True and shorter.kept_tokens["mean"] == 39.0


def test_niah_lengths_over_the_model_input_are_skipped_and_reported():
    tok = byte_tokenizer()
    cfg = {
        "name": "niah", "context_lengths": [300, 400, 500], "depth_percents": [0, 50], "haystack_source": "embedded",
        "haystack_dir": None, "needle": "\nThe secret code is 4711.\n", "question": "What is the secret code?",
        "answer": "4711", "prompt_style": "kvcf", "max_new_tokens": 4, "final_context_buffer": 0,
    }
    NIAHTask.validate(cfg)
    task = NIAHTask(cfg, tok, max_input_tokens=350)
    samples = list(task.samples())  # no exception for the lengths that do not fit
    assert [s.id for s in samples] == ["niah/300/0", "niah/300/50"]
    for s in samples:
        assert abs(len(tok.encode(s.prompt, add_special_tokens=False)) - 300) <= 4
    assert [(s["context_length"], s["samples"]) for s in task.skipped] == [(400, 2), (500, 2)]
    assert task.skipped[0]["reason"] == ("context length 400 tokens exceeds the prompt budget of 350 tokens "
                                         "(task.max_length, else model.max_input_length)")
    job = {"task": {"name": "niah"}, "model": {"name": "tiny"}, "method": {"name": "full"}, "budget": 1.0,
           "shard": {"index": 0, "count": 1}}
    summary = summarize(job, task, [], [s.id for s in samples], "job", task.skipped)
    assert summary["n_skipped"] == 4 and summary["skipped"] == task.skipped


def test_niah_lengths_too_short_for_a_haystack_are_skipped_and_reported():
    """A length that the template, question and needle alone fill would be a haystack-free prompt
    stored under that length's label: it is skipped with its reason, like an over-long one."""
    tok = byte_tokenizer()
    cfg = {
        "name": "niah", "context_lengths": [16, 300], "depth_percents": [50], "haystack_source": "embedded",
        "haystack_dir": None, "needle": "\nThe secret code is 4711.\n", "question": "What is the secret code?",
        "answer": "4711", "prompt_style": "kvcf", "max_new_tokens": 4, "final_context_buffer": 0,
    }
    task = NIAHTask(cfg, tok, max_input_tokens=1000)
    samples = list(task.samples())
    assert [s.id for s in samples] == ["niah/300/50"]
    from eval.niah import KVCF_TEMPLATE

    fixed = len(tok.encode(KVCF_TEMPLATE.format(context="", question=cfg["question"]), add_special_tokens=False))
    fixed += len(tok.encode(cfg["needle"], add_special_tokens=False))
    assert fixed > 16
    assert task.skipped == [{"context_length": 16, "samples": 1, "reason": (
        f"context length 16 tokens leaves no room for the haystack: the template, question and needle take {fixed} tokens")}]


def test_the_printed_summary_counts_samples_whose_prompt_was_within_the_budget(capsys, tmp_path):
    """budget=4096 tokens on prompts of 3000 and 5000 tokens: the 3000-token sample keeps its
    whole prompt, which the printed summary says; a full-cache job never gets the line."""
    from kvbench.job.run import print_summary

    summary = {
        "job": "niah/m/snapkv/b4096", "complete": True, "n_samples": 4, "n_expected": 4, "n_failed": 0,
        "method": "snapkv", "budget": 4096, "datasets": {"niah": {"score": 50.0, "n": 4}},
        "timings": {"prefill_s": None}, "cache": {"compressed_fraction": 0.25},
    }
    print_summary(summary, tmp_path)
    out = capsys.readouterr().out
    assert "not compressed: 3/4 samples (prompt within budget=4096: every prompt token kept)" in out.splitlines()
    assert "job niah/m/snapkv/b4096  (complete; 4/4 samples, 0 failed)" in out
    for method, frac in (("full", 0.0), ("snapkv", 1.0)):
        print_summary({**summary, "method": method, "cache": {"compressed_fraction": frac}}, tmp_path)
        assert "not compressed" not in capsys.readouterr().out
