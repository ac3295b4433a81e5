"""A method against the contract on tiny random models: ``kvbench check-method <overrides>`` and, in a user's own
tests, :func:`check_method` (the pytest fixture ``check_method``: ``pytest -p kvbench.testing``, or
``from kvbench.testing import check_method`` in a conftest). docs/METHODS.md, "Test it".

Each case runs the engine as a job does (prefill, compression, the query part, greedy decoding) on a 2-layer random
Llama (head dim 16, 128-token context, 32-token query part, budget 0.25 or W + 8 tokens) and the engine's contract check
(:func:`methods.base.check_result`) on every compression; a case the method does not take (decoding for a method
that does not decode, a quantized cache with per-head lengths) is ``n/a``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

CASES = ("prefill GQA", "prefill MHA", "query-agnostic", "multi-turn", "decoding", "quantized cache")


def _run(case: str, method_cfg: dict) -> str:
    """``ok``, ``n/a (...)`` or raises: ``case`` run with the method of ``method_cfg``."""
    import torch
    import transformers as tf

    import methods
    from kvbench.engine.attention import ATTN_IMPLEMENTATION, register
    from kvbench.engine.generate import Engine
    from kvbench.engine.models import LoadedModel, head_layout
    from kvbench.job.config import Cache, Decode

    torch.manual_seed(0)
    n_kv = 4 if case == "prefill MHA" else 2
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                            num_attention_heads=4, num_key_value_heads=n_kv, max_position_embeddings=512)
    register()
    config._attn_implementation = ATTN_IMPLEMENTATION
    layout = head_layout(config, "tiny")
    method = methods.build_method(method_cfg, layout)
    method.check_layout(layout)
    decode = Decode(interval=4) if case == "decoding" else None
    if decode and not method.decodes:
        return "n/a (does not decode)"
    if case == "quantized cache" and method.per_head_lengths:
        return "n/a (per-head lengths)"
    tokenizer = type("Tokenizer", (), {"decode": lambda self, ids, **kw: " ".join(map(str, ids)),
                                       "encode": lambda self, text, **kw: [int(t) for t in text.split()]})()
    loaded = LoadedModel(model=tf.LlamaForCausalLM(config).eval(), tokenizer=tokenizer, layout=layout,
                         device=torch.device("cpu"), dtype=torch.float32, stop_ids=[], chat_template=None,
                         max_input_length=512, source="random")
    engine = Engine(loaded, method, method.min_budget() + 8 if decode else 0.25, decode)
    engine.quant = Cache(bits=4, group_size=16, residual=16) if case == "quantized cache" else None
    ids = torch.randint(3, 128, (160,)).tolist()
    split = 128 if case in ("query-agnostic", "multi-turn") else 160
    ctx = engine.open(ids[:split], 24)
    if split < len(ids):
        engine.feed(ctx, ids[split:])
    engine.decode(ctx, 8)
    if case == "multi-turn":
        engine.feed(ctx, ids[:6])
        engine.decode(ctx, 4)
    if not (engine.last_state.results or decode and engine.last_state.compressions):
        raise AssertionError("nothing was compressed (the plan's compress is false at budget 0.25)")
    return "ok"


def check_method(overrides: list[str] | dict) -> dict[str, str]:
    """The method of ``overrides`` (``["method=plugin", "method.target=my_module:MyMethod", ...]`` or a method config
    dict) through :data:`CASES`: ``{case: "ok" | "n/a (why)" | "<Error>: <message>"}``.

    Raises:
        ConfigError: a bad method setting (one line naming the key).
    """
    if isinstance(overrides, dict):
        cfg = overrides
    else:
        from omegaconf import OmegaConf

        from kvbench.job.config import compose

        cfg = OmegaConf.to_container(compose([o for o in overrides if o.startswith("method")]).method, resolve=True,
                                     enum_to_str=True)
    rows = {}
    for case in CASES:
        try:
            rows[case] = _run(case, cfg)
        except Exception as e:  # noqa: BLE001 - each case's failure is a row
            if type(e).__name__ == "ConfigError" and case == CASES[0]:
                raise
            rows[case] = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return rows


def main(argv: list[str]) -> int:
    """``kvbench check-method <overrides>``: the table of :func:`check_method`; exit 0 when every case holds (or is
    n/a), 1 when one fails, 2 for a bad setting (one line)."""
    from methods.base import ConfigError

    try:
        rows = check_method(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for case, result in rows.items():
        print(f"{case:<16} {result}")
    return int(any(not (r == "ok" or r.startswith("n/a")) for r in rows.values()))


try:
    import pytest

    @pytest.fixture(name="check_method")
    def check_method_fixture() -> Callable[[Any], dict[str, str]]:
        """pytest fixture: :func:`check_method` that fails the test with the table when a case fails."""
        def check(overrides: Any) -> dict[str, str]:
            rows = check_method(overrides)
            bad = {c: r for c, r in rows.items() if not (r == "ok" or r.startswith("n/a"))}
            assert not bad, "\n".join(f"{c}: {r}" for c, r in bad.items())
            return rows
        return check
except ImportError:  # pytest is only needed for the fixture
    pass
