"""``kvbench check-method`` and the fixture ``check_method``: a method on tiny random Llamas (docs/METHODS.md)."""

import sys
from types import SimpleNamespace

import torch
import transformers as tf
from omegaconf import OmegaConf

import methods
from methods.base import ConfigError

from kvbench.cli import ArgParser, parse_with_overrides
from kvbench.engine.attention import register
from kvbench.engine.generate import Engine
from kvbench.engine.models import LoadedModel, head_layout
from kvbench.job.config import Cache, Decode, compose

try:
    import pytest
except ImportError:  # a command-1 install: no test extra
    pytest = None

CASES = ("prefill GQA", "prefill MHA", "query-agnostic", "multi-turn", "decoding", "quantized cache")


def _run(case: str, method_cfg: dict) -> str:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                            num_attention_heads=4, num_key_value_heads=4 if case == "prefill MHA" else 2)
    register()
    config._attn_implementation = "kvbench"
    method = methods.build_method(method_cfg, layout := head_layout(config, "tiny"))
    method.check_layout(layout)
    if case == "decoding" and not method.decodes or case == "quantized cache" and method.per_head_lengths:
        return "n/a (does not decode)" if case == "decoding" else "n/a (per-head lengths)"
    loaded = LoadedModel(tf.LlamaForCausalLM(config).eval(), SimpleNamespace(decode=lambda ids, **kw: ""), layout,
                         torch.device("cpu"), torch.float32, [], None, 512, "random")
    engine = Engine(loaded, method, method.min_budget() + 8 if case == "decoding" else 0.25,
                    Decode(interval=4) if case == "decoding" else None)
    engine.quant = Cache(bits=4, group_size=16, residual=16) if case == "quantized cache" else None
    ids, split = torch.randint(3, 128, (160,)).tolist(), 128 if case in ("query-agnostic", "multi-turn") else 160
    ctx = engine.open(ids[:split], 24)
    for part in [ids[split:]] + [ids[:6]] * (case == "multi-turn"):  # the query part, then a second turn
        engine.feed(ctx, part) if part else None
        engine.decode(ctx, 4)
    return "ok"


def check_method(overrides: list[str] | dict) -> dict[str, str]:
    """``{case: "ok" | "n/a (why)" | "<Error>: <message>"}`` for a method's overrides or config dict (ConfigError)."""
    cfg = overrides if isinstance(overrides, dict) else OmegaConf.to_container(compose(list(overrides)).method,
                                                                                 resolve=True, enum_to_str=True)
    methods.build_method(cfg)  # a bad setting: ConfigError, before any case
    rows = {}
    for case in CASES:
        try:
            rows[case] = _run(case, cfg)
        except Exception as e:  # noqa: BLE001 - each case's failure is a row
            rows[case] = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return rows


def main(argv: list[str]) -> int:
    """Print :func:`check_method`'s table; exit 0, 1 when a case fails, 2: a bad setting."""
    p = ArgParser(prog="kvbench check-method", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("overrides", nargs="*", help="method=NAME (or method=plugin method.target=module:Class), method.*")
    try:
        rows = check_method(parse_with_overrides(p, argv).overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"{case:<16} {result}" for case, result in rows.items()))
    return int(any(r != "ok" and not r.startswith("n/a") for r in rows.values()))


if pytest is not None:  # the fixture needs pytest; ``kvbench check-method`` runs without it
    @pytest.fixture(name="check_method")
    def check_method_fixture():
        """:func:`check_method`, failing on a failed case (``-p kvbench.testing`` or imported in a ``conftest.py``)."""
        def check(overrides: list[str] | dict) -> dict[str, str]:
            rows = check_method(overrides)
            assert all(r == "ok" or r.startswith("n/a") for r in rows.values()), rows
            return rows
        return check
