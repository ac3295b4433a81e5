"""Compiled decode (``compile``, issue #32 point 6): torch.compile with inductor (gcc on CPU) over the
model's own forward and kvbench's preallocated cache gives eager's greedy tokens, in one graph for
every step and sample, with a logit bias (SelKV) and per-head lengths (AdaKV); a job records it."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from kvbench.engine import Engine
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


def test_job_records_compiled_decode_and_same_predictions(tmp_path, monkeypatch):
    import run

    model, hay = make_tiny_model_dir(tmp_path / "model"), make_haystack_dir(tmp_path / "hay")
    common = [*tiny_model_args(model), "max_samples=1", "task.context_lengths=[256]", "task.depth_percents=[50]",
              "task.max_new_tokens=6", f"task.haystack_dir={hay}", "quiet=true", "threads=1"]
    runs = {}
    for setting in ("true", "auto"):
        out = tmp_path / setting
        monkeypatch.setattr(sys, "argv", ["run.py", *common, f"compile={setting}", f"output_root={out}"])
        with pytest.raises(SystemExit) as done:
            run.main()
        assert done.value.code == 0
        (pred,) = out.rglob("predictions.jsonl")
        runs[setting] = (json.loads(pred.read_text())["prediction"], json.loads((pred.parent / "env.json").read_text()))
    assert runs["true"][1]["decode_compiled"] is True
    assert runs["auto"][1]["decode_compiled"] is False  # auto: CUDA only, and this is a CPU run
    assert runs["true"][0] and runs["true"][0] == runs["auto"][0]
