"""Compression methods: one module ``methods/<name>.py`` and one ``conf/method/<name>.yaml`` each.

To add a method, write the module (a :class:`~methods.base.MethodConfig` and a
:class:`~methods.base.Method` or :class:`~methods.base.ScoreMethod` subclass, see
``methods/knorm.py``), its yaml, and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
import typing
from typing import Any, Mapping

from .base import CompressResult, ConfigError, HeadLayout, LayerContext, Method, Plan, is_ratio  # noqa: F401

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
    "kvpress_press": "KVPress",
}

_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def available() -> list[str]:
    """Registered method names, sorted."""
    return sorted(REGISTRY)


def get_method_class(name: str) -> type[Method]:
    """The class registered as ``name`` (its module is imported on first use).

    Raises:
        ConfigError: unknown name (lists the accepted ones).
    """
    if name not in REGISTRY:
        raise ConfigError(f"method.name={name!r}: unknown method; accepted values are {', '.join(available())}")
    return getattr(importlib.import_module(f"methods.{name}"), REGISTRY[name])


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against a config field's type (int, float, bool, str, optional); an int
    becomes a float for a float field. ``Literal`` choices are left to the config itself."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint in _TYPES and (type(value) is not hint or (hint is float and not math.isfinite(value))):
        raise ConfigError(f"method.{key}={value!r}: must be {_TYPES[hint]}" + (" or null" if optional else ""))
    return value


def build_method(method_cfg: Mapping[str, Any], layout: HeadLayout | None = None) -> Method:
    """The method named by ``method_cfg["name"]``, with the other keys as its config.

    ``label`` (the method's name in reports) is not a config field: a non-empty string or null.
    Every other key must be a field of the method's ``Config``, of its type; choices and ranges
    are checked by the config's ``__post_init__``.

    Raises:
        ConfigError: ``method.<key>=<value>: ...`` for an unknown method or key (with the
            accepted ones), a wrong type or a bad value.
    """
    values = dict(method_cfg)
    name = values.pop("name", None)
    cls = get_method_class(str(name))
    label = values.pop("label", None)
    if label is not None and not (isinstance(label, str) and label.strip()):
        raise ConfigError(f"method.label={label!r}: must be a non-empty string (the name in reports) or null")
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    hints = typing.get_type_hints(cls.Config)
    for key, value in values.items():
        if key not in fields:
            accepted = ", ".join(sorted(fields | {"label"}))
            raise ConfigError(f"method.{key}={value!r}: unknown key for method {name}; accepted keys are {accepted}")
        values[key] = _check_type(key, value, hints[key])
    try:
        return cls(cls.Config(**values), layout)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"method.name={name}: invalid configuration ({e})") from None


def check_min_budget(method: Method, budget: float | int) -> None:
    """Raise :class:`ConfigError` when a token ``budget`` is below :meth:`Method.min_budget`
    (the windows and sinks the method always keeps); ratios are floored at run time instead."""
    if not is_ratio(budget) and int(budget) < method.min_budget():
        raise ConfigError(f"budget={budget}: smaller than the {method.min_budget()} tokens method {method.name} "
                          f"always keeps (its windows and attention sinks); use budget >= {method.min_budget()}")
