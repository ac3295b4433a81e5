"""Compiled decode (``compile``, issue #32 point 6): torch.compile with inductor (gcc on CPU) over the
model's own forward and kvbench's preallocated cache gives eager's greedy tokens, in one graph for
every step and sample, with a logit bias (SelKV) and per-head lengths (AdaKV); a job records it.
Compilation is timed apart (``compile_s``, not ``decode_s``) and a compile failure is recorded as eager (#41)."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from torch._dynamo.utils import counters

from kvbench.engine.generate import Engine
from methods import build_method
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import (
    make_haystack_dir,
    make_tiny_model_dir,
    tiny_model_args,
)


@pytest.fixture(scope="module")
def loaded():
    return loaded_for(tiny_model("llama", layers=2).eval())


@pytest.mark.parametrize("name", ["full", "selkv", "adakv"])
def test_compiled_decode_equals_eager(loaded, name):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (160, 131)]
    engine = Engine(loaded, build_method({"name": name}, loaded.layout), 1.0 if name == "full" else 0.5)
    engine.record_logits = True
    eager = [(engine.generate(p, 8).tokens, engine.last_logits) for p in prompts]
    results = engine.last_state.results
    assert engine.decode_forward() is loaded.model
    engine.compile_decode = True
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = [(engine.generate(p, 8).tokens, engine.last_logits) for p in prompts]
    assert engine.decode_forward() is not loaded.model
    for (tokens, logits), (c_tokens, c_logits) in zip(eager, compiled):
        assert len(tokens) == 8 and c_tokens == tokens
        torch.testing.assert_close(torch.stack(c_logits), torch.stack(logits), atol=1e-4, rtol=1e-4)
    # at most one new graph (a method with a bias on every layer reuses another's) for 14 steps of two prompts
    # of different lengths: no graph break, no recompile per step or sample
    assert counters["stats"]["unique_graphs"] - graphs <= 1
    assert sum(counters["graph_break"].values()) == breaks
    if name == "selkv":  # the bias path is exercised: every layer compressed with a logit bias
        assert len(results) == 2 and all(r.logit_bias is not None for r in results.values())
    if name == "adakv":  # per-head lengths: padded slots, and two layers of different stored lengths
        assert all(r.valid is not None and not r.valid.all() for r in results.values())
        assert len({r.valid.shape[-1] for r in results.values()}) == 2


@pytest.fixture
def backend(monkeypatch):
    """``backend(fn)``: ``torch.compile`` as the engine calls it, with test backend ``fn``; a fresh dynamo cache
    before and after (its graphs, and the frames it marked skip by failing, are not left to later tests)."""
    real = torch.compile
    torch._dynamo.reset()
    yield lambda fn: monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=fn, **kw))
    torch._dynamo.reset()


def test_compile_time_is_apart_from_decode_time(backend):
    def slow(gm, example_inputs):  # a deliberately slow compile of the first step's graph
        time.sleep(1.5)
        return gm.forward

    backend(slow)
    loaded = loaded_for(tiny_model("llama", layers=2).eval())
    engine = Engine(loaded, build_method({"name": "snapkv"}, loaded.layout), 0.5)
    engine.compile_decode = True
    prompt = [1 + i % 120 for i in range(150)]
    first, second = engine.generate(prompt, 6, stop_ids=[]), engine.generate(prompt, 6, stop_ids=[])
    assert first.decode_compiled and second.decode_compiled and first.tokens == second.tokens
    assert first.compile_s >= 1.5 > first.decode_s and first.generated_tokens == 6
    assert second.compile_s == 0 and second.record()["compile_s"] == 0  # one graph: no compile in the second sample
    assert first.decode_tok_s > 0


def test_compile_failure_is_recorded_as_eager(backend):
    def broken(gm, example_inputs):
        raise RuntimeError("forced compile failure")

    backend(broken)
    loaded = loaded_for(tiny_model("llama", layers=2).eval())
    engine = Engine(loaded, build_method({"name": "selkv"}, loaded.layout), 0.5)
    prompt = [1 + i % 120 for i in range(150)]
    eager = engine.generate(prompt, 6, stop_ids=[])
    engine.compile_decode = True
    failed = engine.generate(prompt, 6, stop_ids=[])
    assert not failed.decode_compiled and failed.record()["decode_compiled"] is False
    assert engine.compile_error and not engine.compile_decode and failed.tokens == eager.tokens
    assert torch._dynamo.config.suppress_errors is False  # the setting was scoped to the decode steps
    assert not engine.generate(prompt, 6, stop_ids=[]).decode_compiled  # eager from then on
    # the failure leaves no frame marked skip: a later engine (a working compiler) compiles the decoder layers
    ops = set()
    backend(lambda gm, example_inputs: ops.update(n.target for n in gm.graph.nodes) or gm.forward)
    again = Engine(loaded, build_method({"name": "selkv"}, loaded.layout), 0.5)
    again.compile_decode = True
    result = again.generate(prompt, 6, stop_ids=[])
    assert result.decode_compiled and result.compile_s > 0 and result.tokens == eager.tokens
    assert torch.nn.functional.silu in ops  # the MLP ran compiled, not eager


def test_job_records_compiled_decode_and_same_predictions(tmp_path, monkeypatch, backend):
    import run

    model, hay = make_tiny_model_dir(tmp_path / "model"), make_haystack_dir(tmp_path / "hay")
    common = [*tiny_model_args(model), "max_samples=1", "task.context_lengths=[256]", "task.depth_percents=[50]",
              "task.max_new_tokens=6", f"task.haystack_dir={hay}", "quiet=true", "threads=1"]
    runs = {}
    for setting in ("true", "auto", "fail"):
        out = tmp_path / setting
        if setting == "fail":  # a compiler that fails: the job runs eager and says so
            backend(lambda *a: 1 / 0)
        monkeypatch.setattr(sys, "argv", ["run.py", *common, f"compile={'true' if setting == 'fail' else setting}",
                                          f"output_root={out}"])
        with pytest.raises(SystemExit) as done:
            run.main()
        assert done.value.code == 0
        (pred,) = out.rglob("predictions.jsonl")
        runs[setting] = (json.loads(pred.read_text()), json.loads((pred.parent / "env.json").read_text()))
    assert runs["true"][1]["decode_compiled"] is True and runs["true"][0]["decode_compiled"] is True
    assert runs["true"][0]["compile_s"] > 0 and runs["true"][1]["load_s"] > 0  # make_joblist --cost reads load_s
    assert runs["auto"][1]["decode_compiled"] is False  # auto: CUDA only, and this is a CPU run
    assert runs["fail"][1]["decode_compiled"] is False and "eager" in runs["fail"][1]["compile_error"]
    assert runs["fail"][0]["decode_compiled"] is False
    assert runs["true"][0]["prediction"] and {r[0]["prediction"] for r in runs.values()} == {runs["true"][0]["prediction"]}
