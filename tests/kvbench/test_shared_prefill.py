"""Sweeps that prefill once (issue #33.3): every variant of a shared prefill generates exactly what it
generates alone, in the engine and through ``python run.py -m ... sweep.share_prefill=true``."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine import Engine, prefill
from methods import build_method
from tests.conftest import loaded_for, tiny_model

VARIANTS = [("snapkv", {}, 0.5), ("selkv", {}, 0.3), ("pyramidkv", {}, 40), ("lookm", {}, 0.5),
            ("lookm", {"fused_score": "off"}, 0.25), ("streamingllm", {}, 0.5), ("full", {}, 1.0),
            ("snapkv", {}, 1.0)]  # budget 1.0: a variant that keeps every layer whole


def engines(loaded):
    out = []
    for name, extra, budget in VARIANTS:
        cfg = {"name": name, **({"window_size": 4} if name in ("snapkv", "pyramidkv") else {}), **extra}
        out.append(Engine(loaded, build_method(cfg, loaded.layout), budget))
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers are copied, not compressed
def test_a_shared_prefill_generates_what_each_variant_generates_alone(family):
    loaded = loaded_for(tiny_model(family, layers=3))
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    alone, shared_engines = engines(loaded), engines(loaded)
    for e in alone + shared_engines:
        e.record_logits = True
    parts = prefill(shared_engines, ids, 6)
    for e, p, lone in zip(shared_engines, parts, alone):
        ref, res = lone.generate(ids, 6, stop_ids=[]), e.generate(ids, 6, stop_ids=[], prefilled=p)
        assert res.tokens == ref.tokens and len(res.tokens) == 6
        assert all(torch.equal(a, b) for a, b in zip(e.last_logits, lone.last_logits))  # bit for bit
        assert (res.kept_tokens, res.stored_tokens, res.compressed) == (ref.kept_tokens, ref.stored_tokens, ref.compressed)
        assert (res.cache_bytes_before, res.cache_bytes_after, res.method_stats) == (
            ref.cache_bytes_before, ref.cache_bytes_after, ref.method_stats)
    assert [p.state.compressing for p in parts] == [True] * 6 + [False, False]
