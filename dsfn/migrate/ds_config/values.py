"""Typed readers of ds_config values: each returns the value or raises a ConfigError naming its key."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from dsfn.errors import ConfigError, DsfnError


def is_disabled(block: Any) -> bool:
    """Whether `block` is an object written `"enabled": false`."""
    return isinstance(block, Mapping) and block.get("enabled", True) is False


def whole_number(key: str, v: Any) -> int:
    """A whole number >= 0 (5e8 counts), as an int."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"ds_config {key}={v!r}: expected a whole number >= 0 (e.g. 5e8)")
    return int(v)


def number(key: str, v: Any, minimum: float = 0.0, above: bool = False) -> float:
    """A finite number >= minimum (> with `above`), or a ConfigError naming the key."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < minimum or (above and v == minimum):
        raise ConfigError(f"ds_config {key}={v!r}: expected a number {'>' if above else '>='} {minimum:g}")
    return float(v)


def flag(key: str, v: Any) -> bool:
    """true / false (or 0 / 1)."""
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise ConfigError(f"ds_config {key}={v!r}: expected true or false")


def section(key: str, v: Any) -> dict:
    """An object (a private dict copy); null is an empty one."""
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"ds_config {key}={v!r}: expected an object ({{...}}) or null")
    return dict(v)


def beta_pair(key: str, v: Any) -> tuple[float, float]:
    """Two numbers in [0, 1), e.g. Adam's betas."""
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"ds_config {key}={v!r}: expected two numbers in [0, 1), e.g. [0.9, 0.999]")
    out = tuple(number(f"{key}[{i}]", b) for i, b in enumerate(v))
    if not all(b < 1 for b in out):
        raise ConfigError(f"ds_config {key}={v!r}: each beta is in [0, 1)")
    return out


def build(key: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a transform, optimizer or schedule built from the block `key`);
    an error it raises on a value becomes a ConfigError naming the block."""
    try:
        return fn(*args, **kwargs)
    except (DsfnError, TypeError, ValueError, OverflowError, KeyError, AttributeError) as e:
        raise ConfigError(f"ds_config {key}: {e}") from None
