"""Compression methods: the built-in ones (:data:`REGISTRY`: ``methods/<name>.py`` and ``conf/method/<name>.yaml``
each), and ``method=plugin method.target=module:Class`` for a method class anywhere else (docs/METHODS.md).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import os
import types
from pathlib import Path
import typing
from typing import Any, Mapping, Optional

from .base import Budget, CompressResult, ConfigError, HeadLayout, LayerContext, Method, Plan, structured  # noqa: F401

PLUGIN = "plugin"  # method.name of a class named by method.target (module:Class or an entry point name)
#: classes by target that no import finds (``kvbench.run(method=cls)`` puts a notebook's class here)
CLASSES: dict[str, type] = {}

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


def resolve(target: str, key: str = "method.target", group: str = "kvbench.methods", base: type = Method) -> type:
    """The class ``target`` names: ``module:Class`` (imported; the module on ``PYTHONPATH`` or installed), the name of
    an entry point of ``group`` (an installed package's ``[project.entry-points."kvbench.methods"]``) or of
    :data:`CLASSES`. ConfigError naming ``key``: not importable, or not a subclass of ``base``."""
    points = {e.name: e for e in importlib.metadata.entry_points(group=group)}
    try:
        if target in CLASSES or target in points:
            cls = CLASSES[target] if target in CLASSES else points[target].load()
        else:
            module, _, name = str(target).partition(":")
            cls = functools.reduce(getattr, name.split("."), importlib.import_module(module)) if name else None
    except (ImportError, AttributeError) as e:
        cls = f"cannot import it ({type(e).__name__}: {e})"
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{key}={target!r}: {cls if isinstance(cls, str) else 'names no ' + base.__name__ + ' class'};"
                          f" accepted values are module:Class (on PYTHONPATH) or an entry point of {group}"
                          + (f" ({', '.join(sorted(points))})" if points else ""))
    return cls


def source_sha256(cls: type) -> str:
    """SHA-256 of the file that defines ``cls`` (a notebook cell's class: of its functions' sources and its Config's
    fields), in a plugin's job identity: an edited method is a new job. ConfigError: no source (``python -c``)."""
    try:
        path = inspect.getsourcefile(cls)
        if path and os.path.isfile(path):
            return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except (OSError, TypeError):  # a class of __main__ without a file (IPython)
        pass
    try:
        text = "".join(inspect.getsource(f) for f in vars(cls).values() if inspect.isfunction(f))
    except (OSError, TypeError):
        raise ConfigError(f"method.target={cls.__module__}:{cls.__qualname__}: its source cannot be read (the job "
                          "identity hashes it); define the class in a file or a notebook cell") from None
    fields = [(f.name, str(f.type), repr(f.default)) for f in dataclasses.fields(cls.Config)]
    return hashlib.sha256((text + repr(fields)).encode()).hexdigest()


def get_method_class(name: str, target: str | None = None) -> type[Method]:
    """The class registered as ``name`` (its module is imported on first use), or for ``name="plugin"`` the class
    ``target`` names (:func:`resolve`). ConfigError: unknown name (lists the accepted ones) or target."""
    if name == PLUGIN:
        return resolve(str(target))
    if name not in REGISTRY:
        raise ConfigError(f"method.name={name!r}: unknown method; accepted values are {', '.join(available())}, "
                          "plugin (with method.target=module:Class)")
    return getattr(importlib.import_module(f"methods.{name}"), REGISTRY[name])


@functools.cache
def schema(name: str, cls: type | None = None) -> type:
    """The Hydra node of method ``name``, which ``conf/method/*.yaml`` extend (``kvbench.job.config.register`` stores it
    in Hydra's ConfigStore as ``schema/method/<name>``): ``name``, ``label`` (the name in reports) and the fields of
    the method's config dataclass, a ``Literal`` field as an Enum so that OmegaConf checks its choices; with ``cls``
    (a plugin) ``target`` and the fields of ``cls.Config``. ConfigError: unknown method (lists the accepted ones)."""
    config = (cls or get_method_class(name)).Config
    hints, fields = typing.get_type_hints(config), [("name", str, name), ("label", Optional[str], None)]
    fields += [("target", str, "")] if cls else []
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
    cls = get_method_class(name, method_cfg.get("target"))
    node = structured(schema(name, cls if name == PLUGIN else None), dict(method_cfg), "method.")
    values = {k: v.value if isinstance(v, enum.Enum) else v for k, v in vars(node).items()
              if k not in ("name", "label", "target")}
    if node.label is not None and not node.label.strip():
        raise ConfigError(f"method.label={node.label!r}: must be a non-empty string (the name in reports) or null")
    try:
        return cls(cls.Config(**values), layout)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"method.name={name}: invalid configuration ({e})") from None


def check_min_budget(method: Method, budget: Budget, decoding: bool = False) -> None:
    """Raise :class:`ConfigError` when a token ``budget`` is below :meth:`Method.min_budget` (the windows and sinks the
    method always keeps; ``decoding``: :meth:`Method.min_decode_budget`, a kvpress press's window); ratios are floored
    at run time instead."""
    low = method.min_decode_budget() if decoding else method.min_budget()
    what = "needs to compress while decoding (windows, sinks, a press's window)" if decoding else \
        "always keeps (its windows and attention sinks)"
    if budget.tokens is not None and budget.tokens < low:
        raise ConfigError(f"budget={budget}: smaller than the {low} tokens method {method.name} {what}; use budget >= {low}")
