"""Argument checks: a user's number as a float or an int, or a ConfigError that names the
argument, the bound it breaks and a hint.

Plain and below everything that takes options: kernels (`dsfn.ops`), optimizers
(`dsfn.optim`) and schedules use the same checks, so the same bad value gets the same message.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any

from dsfn.errors import ConfigError

__all__ = ["check_int", "check_real"]


def check_real(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = False, hint: str = "") -> float:
    """`value` as a float, or ConfigError if it is not a finite real number within the bounds."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ConfigError(f"{name}={value!r}: expected a finite number{hint}")
    v = float(value)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ConfigError(f"{name}={value!r}: must be {'>' if lo_open else '>='} {lo}{hint}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise ConfigError(f"{name}={value!r}: must be {'<' if hi_open else '<='} {hi}{hint}")
    return v


def check_int(name: str, value: Any, *, lo: int | None = None, hint: str = "") -> int:
    """`value` as an int, or ConfigError if it is not an integer >= lo."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r}: expected an integer{hint}")
    if lo is not None and value < lo:
        raise ConfigError(f"{name}={value!r}: must be >= {lo}{hint}")
    return int(value)
