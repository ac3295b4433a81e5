"""The paper presets in conf/experiment/ compose into valid job configs.

Each preset is composed with Hydra (``+experiment=NAME`` plus the first value of each swept key)
and, where its model is local (the embedded one), checked by ``kvbench.config.check`` as a job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONF = Path(__file__).resolve().parents[1] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
SWEPT_GROUPS = ("model", "method", "task")


def references(name: str) -> tuple[dict, list[Path]]:
    """The preset's sweep params and the config files it needs (defaults overrides, swept groups)."""
    data = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    needed = []
    for entry in data.get("defaults", []):
        if isinstance(entry, dict):
            for key, value in entry.items():
                group = key.replace("override", "").strip().strip("/")
                needed.append(CONF / group / f"{value}.yaml")
    params = (((data.get("hydra") or {}).get("sweeper") or {}).get("params")) or {}
    for group in SWEPT_GROUPS:
        needed += [CONF / group / f"{v.strip()}.yaml" for v in str(params.get(group, "")).split(",") if v.strip()]
    return params, needed


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_and_its_first_job_passes_the_check(name, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvbench.config import check

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n"), "a preset overrides the root config"
    params, needed = references(name)
    missing = [str(p.relative_to(CONF)) for p in needed if not p.is_file()]
    if missing:
        pytest.skip(f"not on this branch yet: {', '.join(sorted(set(missing)))}")
    first = [f"{k}={str(v).split(',')[0].strip()}" for k, v in params.items()]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        node = compose("config", overrides=[f"+experiment={name}", *first])
    cfg = OmegaConf.to_container(node, resolve=True)
    budget = cfg["budget"]
    assert budget > 0 and (budget <= 1 or float(budget).is_integer())
    assert cfg["model"]["name"] and cfg["method"]["name"] and cfg["task"]["name"]
    if name.endswith("_smoke"):
        assert cfg["model"]["name"] == "smollm2", "smoke presets run on the embedded model"
    if name.startswith("selkv_fig3"):
        assert cfg["latency"]["methods"] and cfg["latency"]["lengths"]
    else:
        assert params, "a paper preset is a whole sweep (hydra.sweeper.params)"
    local_data = cfg["task"]["name"] == "niah" or Path(cfg["task"].get("data_dir") or "/nonexistent").is_dir()
    if cfg["model"]["source"].startswith("pypi") and local_data:  # the model and the data are on this machine
        job = check(node, str(params.get("method", "")).split(",")[0].strip() or None)
        assert job.relpath.startswith(f"{cfg['task']['name']}/{cfg['model']['name']}/")


def test_smoke_presets_use_shared_data_by_path():
    for name in PRESETS:
        data = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
        data_dir = (data.get("task") or {}).get("data_dir")
        if data_dir:
            assert data_dir == "../shared/data/longbench", name


def test_method_presets_have_distinct_labels_without_comment_text():
    """Reports key rows by label: two presets sharing one would merge in a cell, and a YAML comment
    without a space before '#' becomes part of the label."""
    import yaml

    labels = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "conf" / "method").glob("*.yaml")):
        label = (yaml.safe_load(path.read_text()) or {}).get("label")
        assert label is None or "#" not in str(label), f"{path.name}: label {label!r}"
        if label is not None:
            assert label not in labels, f"{path.name} and {labels[label]} share the label {label!r}"
            labels[label] = path.name
    assert labels["PyramidKV (CompressKV)"] == "pyramidkv_compresskv.yaml"
