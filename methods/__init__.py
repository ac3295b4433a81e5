"""Compression methods: a registry of :class:`methods.base.Method` subclasses.

Add a method by writing one module with a config dataclass and a ``Method`` subclass, and
naming it in ``_MODULES`` below; its Hydra node is ``conf/method/<name>.yaml``.
"""

from __future__ import annotations

import importlib

from .base import CompressResult, ConfigError, HeadLayout, LayerContext, Method, Plan

# name -> "module:Class"; modules are imported lazily so one broken optional method
# cannot break the others.
_MODULES: dict[str, str] = {
    "full": "methods.full:FullCache",
    "selkv": "methods.selkv:SelKV",
    "snapkv": "methods.snapkv:SnapKV",
    "streamingllm": "methods.streamingllm:StreamingLLM",
    "pyramidkv": "methods.pyramidkv:PyramidKV",
    "adakv": "methods.adakv:AdaKV",
    "lookm": "methods.lookm:LookM",
    "headkv": "methods.headkv:HeadKV",
    "compresskv": "methods.compresskv:CompressKV",
}


def available() -> list[str]:
    """Registered method names, sorted."""
    return sorted(_MODULES)


def get_method_class(name: str) -> type[Method]:
    """The class registered as ``name``.

    Raises:
        ConfigError: unknown name (lists the accepted ones).
    """
    if name not in _MODULES:
        raise ConfigError(f"method.name={name!r}: unknown method; accepted values are {', '.join(available())}")
    mod, cls = _MODULES[name].split(":")
    return getattr(importlib.import_module(mod), cls)


__all__ = ["CompressResult", "ConfigError", "HeadLayout", "LayerContext", "Method", "Plan", "available", "get_method_class"]


def build_method(method_cfg: dict, layout: HeadLayout | None = None) -> Method:  # TEMP: replaced by the methods branch
    import dataclasses
    cls = get_method_class(str(method_cfg.get("name")))
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    values = {k: v for k, v in method_cfg.items() if k not in ("name", "label")}
    for k in values:
        if k not in fields:
            raise ConfigError(f"method.{k}: unknown key for method {method_cfg['name']}; accepted keys are {', '.join(sorted(fields | {'label'}))}")
    return cls(cls.Config(**values), layout)
