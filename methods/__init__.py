"""Compression methods: one module ``methods/<name>.py`` and one ``conf/method/<name>.yaml`` each.

To add a method, write the module (a :class:`~methods.base.MethodConfig` and a
:class:`~methods.base.Method` or :class:`~methods.base.ScoreMethod` subclass, see
``methods/knorm.py``), its yaml, and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import types
import typing
from typing import Any, Mapping, Optional

from .base import Budget, CompressResult, ConfigError, HeadLayout, LayerContext, Method, Plan, structured  # noqa: F401

# method name (= module methods/<name>.py = `name:` of its yaml) -> class name
REGISTRY: dict[str, str] = {
    "full": "FullCache",
    "snapkv": "SnapKV",
    "pyramidkv": "PyramidKV",
    "streamingllm": "StreamingLLM",
    "adakv": "AdaKV",
    "headkv": "HeadKV",
    "compresskv": "CompressKV",
    "selkv": "SelKV",
    "lookm": "LookM",
    "knorm": "Knorm",
    "rkv": "RKV",
    "kvpress_press": "KVPress",
    "kvzip": "KVzip",
    "quest": "Quest",
    "ashape": "AShape",
}


def available() -> list[str]:
    """Registered method names, sorted."""
    return sorted(REGISTRY)


def get_method_class(name: str) -> type[Method]:
    """The class registered as ``name`` (its module is imported on first use). ConfigError: unknown name (lists the
    accepted ones)."""
    if name not in REGISTRY:
        raise ConfigError(f"method.name={name!r}: unknown method; accepted values are {', '.join(available())}")
    return getattr(importlib.import_module(f"methods.{name}"), REGISTRY[name])


@functools.cache
def schema(name: str) -> type:
    """The Hydra node of method ``name``, which ``conf/method/*.yaml`` extend (``kvbench.job.config.register`` stores it
    in Hydra's ConfigStore as ``schema/method/<name>``): ``name``, ``label`` (the name in reports) and the fields of
    the method's config dataclass, a ``Literal`` field as an Enum so that OmegaConf checks its choices. ConfigError:
    unknown method (lists the accepted ones)."""
    config = get_method_class(name).Config
    hints, fields = typing.get_type_hints(config), [("name", str, name), ("label", Optional[str], None)]
    for f in dataclasses.fields(config):
        hint, default = hints[f.name], f.default
        if typing.get_origin(hint) is typing.Literal:
            hint = enum.Enum(f"{name}.{f.name}", {c: c for c in typing.get_args(hint)})
            default = hint(default)
        elif typing.get_origin(hint) is types.UnionType:  # X | None
            hint = Optional[typing.get_args(hint)[0]]
        fields.append((f.name, hint, dataclasses.field(default=default, default_factory=f.default_factory)))
    return dataclasses.make_dataclass(f"{config.__name__}Node", fields)


def build_method(method_cfg: Mapping[str, Any], layout: HeadLayout | None = None) -> Method:
    """The method named by ``method_cfg["name"]``, with the other keys as its config. Keys, types and choices are
    checked against the method's :func:`schema` by OmegaConf (as Hydra checks them when it composes ``conf/``),
    ranges by the config's ``__post_init__``. ConfigError: ``method.<key>...`` for an unknown method or key (with the
    accepted ones), a wrong type or a bad value (``label``: a non-empty string or null)."""
    name = str(method_cfg.get("name"))
    cls, node = get_method_class(name), structured(schema(name), dict(method_cfg), "method.")
    values = {k: v.value if isinstance(v, enum.Enum) else v for k, v in vars(node).items() if k not in ("name", "label")}
    if node.label is not None and not node.label.strip():
        raise ConfigError(f"method.label={node.label!r}: must be a non-empty string (the name in reports) or null")
    try:
        return cls(cls.Config(**values), layout)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"method.name={name}: invalid configuration ({e})") from None


def check_min_budget(method: Method, budget: Budget) -> None:
    """Raise :class:`ConfigError` when a token ``budget`` is below :meth:`Method.min_budget`
    (the windows and sinks the method always keeps); ratios are floored at run time instead."""
    if budget.tokens is not None and budget.tokens < method.min_budget():
        raise ConfigError(f"budget={budget}: smaller than the {method.min_budget()} tokens method {method.name} "
                          f"always keeps (its windows and attention sinks); use budget >= {method.min_budget()}")
