"""The one rule that refuses ``cache.bits`` before a model loads (kvbench.job.config.check): a method whose results may
hold per-head lengths (``CompressResult.valid``) says so in ``Method.per_head_lengths``. Checked on every method preset
that runs without artifact files, through the engine on a tiny GQA Llama, and on kvpress's AdaKVPress."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import methods  # noqa: E402
from kvbench.engine.generate import Engine  # noqa: E402
from kvbench.job.config import CONF, preset  # noqa: E402
from methods.base import ConfigError, PromptFormat  # noqa: E402
from tests.conftest import loaded_for, tiny_model  # noqa: E402

PRESETS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))


@pytest.fixture(scope="module")
def loaded():
    return loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2))


@pytest.mark.parametrize("cfg", [*PRESETS, {"name": "kvpress_press", "press": "AdaKVPress",
                                            "press_kwargs": {"press": "SnapKVPress", "press_kwargs": {"window_size": 4}}}],
                         ids=[*PRESETS, "kvpress-AdaKVPress"])
def test_a_method_that_keeps_per_head_lengths_declares_it(loaded, cfg):
    cfg = preset("method", cfg) if isinstance(cfg, str) else cfg
    try:
        method = methods.build_method({k: v for k, v in cfg.items() if k != "label"}, loaded.layout)
        method.check_layout(loaded.layout)
    except ConfigError:
        pytest.skip("needs artifact files")
    budget = max(24, method.min_budget())
    engine = Engine(loaded, method, budget)
    engine.prompt_format = PromptFormat(lambda text: [1 + ord(c) % 120 for c in text])  # KVzip's repeat prompts
    engine.generate([1 + i % 120 for i in range(budget + 56)], 2, stop_ids=[])
    results = engine.last_state.results
    if not results:  # sparse attention (Quest, A-shape): every token stays stored
        pytest.skip("evicts nothing")
    if any(r.valid is not None for r in results.values()):
        assert method.per_head_lengths
