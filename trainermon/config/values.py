"""The value checks every config section shares: each error names the key, the bad value and what is
allowed (`ConfigError`). Defaults come from the schema's dataclasses."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .schema import MonitorConfig

_DEFAULT = MonitorConfig()


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is allowed."""


def _type_name(value: Any) -> str:
    return type(value).__name__


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"config key '{key}': got {shown} ({_type_name(value)}); allowed: {allowed}")


def _bool(raw: dict, key: str) -> bool:
    value = raw[key] if key in raw else getattr(_DEFAULT, key)
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")
    return value


def _int(raw: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    """An integer in [lo, hi]; the default is the schema's (`default` for keys of a section)."""
    value = raw[key] if key in raw else getattr(_DEFAULT, key) if default is None else default
    # msprobe configs sometimes carry 1e8 as a float literal; accept integral floats.
    if isinstance(value, float) and value.is_integer() and lo <= value <= hi:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, value, f"an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise _fail(key, value, f"an integer in [{lo}, {hi}]")
    return value


def _seconds(raw: dict, key: str, hi: float) -> float:
    value = raw[key] if key in raw else getattr(_DEFAULT, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= hi:
        raise _fail(key, value, f"a number of seconds in [0, {hi:g}]")
    return float(value)


def _choice(raw: dict, key: str, allowed: tuple[str, ...]) -> str:
    value = raw[key] if key in raw else getattr(_DEFAULT, key)
    if value not in allowed:
        raise _fail(key, value, f"one of {list(allowed)}")
    return value


def _dict(raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(key, value, "a JSON object")
    return value


def _section(raw: dict, key: str, defaults: Any) -> dict[str, Any]:
    """The `key` section merged over the defaults of its dataclass; unknown sub-keys are refused."""
    value = _dict(raw, key)
    names = [f.name for f in fields(defaults)]
    for sub in value:
        if sub not in names:
            raise _fail(f"{key}.{sub}", value[sub], f"a key of the '{key}' section: {sorted(names)}")
    return {**{n: getattr(defaults, n) for n in names}, **value}


def _opt_str(section: str, values: dict, key: str) -> None:
    value = values[key]
    if value is not None and (not isinstance(value, str) or not value):
        raise _fail(f"{section}.{key}", value, "a non-empty string or null")


def _choices(section: str, values: dict, key: str, allowed: tuple[str, ...]) -> None:
    value = values[key]
    if value is None:
        return
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise _fail(f"{section}.{key}", value, f"null or a non-empty list of strings from {list(allowed)}")
    for item in value:
        if item not in allowed:
            raise _fail(f"{section}.{key}", item, f"each one of {list(allowed)}")
    values[key] = tuple(dict.fromkeys(value))
