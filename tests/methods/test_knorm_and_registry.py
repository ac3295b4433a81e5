"""knorm (lowest key norm + recent window), ScoreMethod and build_method's one-line config errors."""

from pathlib import Path

import pytest
import torch

from methods import build_method, check_min_budget, get_method_class
from methods.base import ConfigError, HeadLayout, LayerContext
from methods.knorm import Knorm, KnormConfig
from methods.base import check_budget

LAYOUT = HeadLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=2)


def _ctx(keys, budget):
    return LayerContext(layer_idx=0, layout=LAYOUT, keys=keys, values=keys + 100, budget=budget,
                        window_queries=keys[:, :, :0], scaling=1.0)


def test_knorm_keeps_lowest_key_norms_per_head_and_the_recent_window():
    norms = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 9.0], [1.0, 6.0, 2.0, 7.0, 8.0, 9.0]])
    keys = torch.stack([norms, torch.zeros_like(norms)], dim=-1).unsqueeze(0)  # (1, 2, 6, 2), ‖k‖ = norms
    res = Knorm(KnormConfig(recent_window=1)).compress(_ctx(keys, budget=3))
    assert res.kept_indices.tolist() == [[[1, 3, 5], [0, 2, 5]]]
    assert torch.equal(res.values[0, 0, :, 0], torch.tensor([101.0, 102.0, 109.0]))
    res = build_method({"name": "knorm", "label": "Knorm", "recent_window": 0}).compress(_ctx(keys, budget=2))
    assert res.kept_indices.tolist() == [[[1, 3], [0, 2]]]


def test_build_method_uses_the_registry_and_the_yaml_defaults():
    method = build_method({"name": "snapkv", "window_size": 8, "kernel_size": 7, "pooling": "max"})
    assert type(method) is get_method_class("snapkv") and method.name == "snapkv"
    assert (method.window_size, method.recent_window, method.min_budget()) == (8, 8, 8)
    assert build_method({"name": "pyramidkv", "recent_window": 4}).min_budget() == 5
    assert build_method({"name": "selkv", "alpha": 1}).config.alpha == 1.0  # int -> float field
    with pytest.raises(ConfigError, match="^method.gate"):  # YAML's unquoted off is false: quote it
        build_method({"name": "selkv", "gate": False})
    assert build_method({"name": "streamingllm"}).window_size == 0


@pytest.mark.parametrize("cfg,key", [
    ({"name": "snapkv2"}, "method.name"),
    ({"name": "snapkv", "windw_size": 8}, "method.windw_size"),
    ({"name": "snapkv", "window_size": 8.0}, "method.window_size"),
    ({"name": "snapkv", "window_size": True}, "method.window_size"),
    ({"name": "snapkv", "pooling": "mean"}, "method.pooling"),
    ({"name": "snapkv", "kernel_size": 4}, "method.kernel_size"),
    ({"name": "headkv", "head_scores": "both"}, "method.head_scores"),
    ({"name": "selkv", "alpha": float("nan")}, "method.alpha"),
    ({"name": "knorm", "recent_window": -1}, "method.recent_window"),
    ({"name": "knorm", "label": ""}, "method.label"),
])
def test_build_method_errors_name_the_key(cfg, key):
    with pytest.raises(ConfigError) as err:
        build_method(cfg)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_min_budget_check():
    method = build_method({"name": "snapkv"})
    check_min_budget(method, check_budget(32))
    check_min_budget(method, check_budget(0.01))  # ratios are floored at run time
    with pytest.raises(ConfigError, match="^budget=31"):
        check_min_budget(method, check_budget(31))


PRESETS = sorted((Path(__file__).resolve().parents[2] / "conf" / "method").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_method_preset_builds(path):
    from omegaconf import OmegaConf

    from tests.kvbench.cli_util import compose

    given = {"kvpress": ["method.press=KnormPress"], "plugin": ["method.target=methods.knorm:Knorm"]}.get(path.stem, [])
    node = OmegaConf.to_container(compose([f"method={path.stem}", *given]).method, resolve=True, enum_to_str=True)
    if node["name"] == "kvpress_press":
        pytest.importorskip("kvpress", reason="method=kvpress needs the kvpress extra (pip install 'kvbench[kvpress]')")
    assert build_method(node).name == ("knorm" if path.stem == "plugin" else node["name"])


def test_snapkv_recent_window_is_separate_from_the_observation_window():
    torch.manual_seed(0)
    layout = HeadLayout(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8)
    ctx = LayerContext(layer_idx=0, layout=layout, keys=torch.randn(1, 2, 40, 8), values=torch.randn(1, 2, 40, 8),
                       window_queries=torch.randn(1, 4, 8, 8), scaling=8**-0.5, budget=12)
    default = build_method({"name": "snapkv", "window_size": 8, "kernel_size": 3}).compress(ctx).kept_indices
    same = build_method({"name": "snapkv", "window_size": 8, "recent_window": 8, "kernel_size": 3}).compress(ctx)
    assert torch.equal(default, same.kept_indices) and (default[..., -8:] == torch.arange(32, 40)).all()
    short = build_method({"name": "snapkv", "window_size": 8, "recent_window": 2, "kernel_size": 3}).compress(ctx)
    kept = short.kept_indices
    assert kept.shape == (1, 2, 12) and (kept[..., -2:] == torch.tensor([38, 39])).all()
    assert not torch.equal(kept, default)  # 10 ranked slots now reach into the observation window
