"""One-line checks of single config values: types against dataclass fields, integers, unknown keys.

Every error is a :class:`methods.base.ConfigError` whose message starts with ``<key>=<value>:``
as the user would type it on the command line (see :mod:`kvbench.validate`).
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from methods.base import ConfigError


def did_you_mean(key: str, accepted: typing.Iterable[str]) -> str:
    """`` (did you mean <close key>?)`` for a likely typo (case ignored: ``SnapKV`` → ``snapkv``), else ``""``."""
    accepted = list(accepted)
    by_lower = {a.lower(): a for a in accepted}
    if key.lower() in by_lower:
        return f" (did you mean {by_lower[key.lower()]}?)"
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]}?)" if close else ""


def unknown_key_error(prefix: str, key: str, value: Any, accepted: typing.Iterable[str], what: str) -> ConfigError:
    """The one-line error for a key that the node does not define."""
    accepted = sorted(accepted)
    full = f"{prefix}{key}"
    return ConfigError(
        f"{full}={show(value)}: unknown {what}{did_you_mean(key, accepted)}; accepted keys are "
        f"{', '.join(accepted) or '(none)'}"
    )


def show(value: Any) -> str:
    """A value as the user typed it on the command line (strings unquoted unless empty)."""
    if isinstance(value, str):
        return value if value and value.strip() == value else repr(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def describe(hint: Any) -> str:
    """A type annotation in words (``an integer``, ``a number or null``, ``one of avg, max``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(describe(a) for a in inner)
        return text + (" or null" if len(inner) < len(args) else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (list, tuple) or hint in (list, tuple):
        return "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a dataclass field type; return it (an int becomes a float for ``float``).

    Accepts ``int`` (not bool), ``float`` (int or float, finite), ``str``, ``bool``, ``Literal``,
    ``Optional``/unions, lists/tuples (items checked) and dicts; other types pass unchecked.

    Raises:
        ConfigError: ``<key>=<value>: must be <type>``.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ConfigError(f"{key}={show(value)}: must be {describe(hint)}")
    if hint is Any or hint is None:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, value, arg)
            except ConfigError:
                continue
        raise bad
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}={show(value)}: accepted values are {', '.join(map(str, args))}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={show(value)}: must be {describe(hint)}{_whole_hint(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf"):
            return float(value)
        raise bad
    if hint is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        if args and origin is list:
            return [coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
        return value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise bad
        return value
    return value


def _whole_hint(value: Any) -> str:
    """`` (write 16, not 16.0)`` for a whole float given for an integer key (``1.6e1`` reads as
    16.0 in YAML), else ``""``."""
    if isinstance(value, float) and value.is_integer():
        return f" (write {int(value)}, not {value!r})"
    return ""


def check_int(cfg: dict, key: str, *, minimum: int | None = None, allow_none: bool = False, label: str | None = None) -> int | None:
    """``cfg[key]`` as an integer (not a bool) >= ``minimum`` (None allowed if ``allow_none``).

    Raises:
        ConfigError: ``<label or key>=<value>: must be an integer [>= minimum] [or null]``.
    """
    value = cfg.get(key)
    name = label or key
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={show(value)}: must be an integer" + (" or null" if allow_none else "")
                          + _whole_hint(value))
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value}: must be an integer >= {minimum}" + (" or null" if allow_none else ""))
    return value
