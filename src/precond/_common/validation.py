"""Argument validation with one error phrasing for every optimizer.

Every check raises ``ValueError("Invalid <name>=<value!r>: must be <rule>")`` (or
``TypeError`` for a wrong type), so users see the argument, its value and the valid
range. Values that are not concrete Python numbers (JAX arrays or tracers passed by
``optax.inject_hyperparams``, schedules) are left to the caller: they cannot be
checked at construction.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np


def _fail(name: str, value: Any, rule: str, error: type[Exception] = ValueError):
    raise error(f"Invalid {name}={value!r}: must be {rule}")


def is_concrete_number(value: Any) -> bool:
    """True for Python/NumPy real numbers (not bools, arrays, tracers or callables)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_schedule: bool = False,
) -> None:
    """Checks a real hyperparameter lies in the interval [low, high] (ends as given).

    Callables are accepted when ``allow_schedule`` is set (they are schedules of the
    step count). Array values (e.g. from ``optax.inject_hyperparams``) are accepted
    unchecked, since they may be traced.
    """
    if callable(value):
        if not allow_schedule:
            _fail(name, value, "a number, not a callable", TypeError)
        return
    if not is_concrete_number(value):
        if getattr(getattr(value, "dtype", None), "kind", None) in ("f", "i", "u"):
            return  # a numeric array, maybe traced: checked by the math, not here
        kind = "a number or a schedule (callable)" if allow_schedule else "a number"
        _fail(name, value, kind, TypeError)
    if low is not None and high is not None:
        lo = "[" if low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        rule = f"in {lo}{low}, {high}{hi}"
    elif low is not None:
        rule = f"{'>=' if low_inclusive else '>'} {low}"
    elif high is not None:
        rule = f"{'<=' if high_inclusive else '<'} {high}"
    else:
        rule = "finite"
    if math.isnan(value):
        _fail(name, value, rule if rule == "finite" else f"finite and {rule}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        _fail(name, value, rule)
    if high is not None and (value > high or (value == high and not high_inclusive)):
        _fail(name, value, rule)
    if math.isinf(value):
        _fail(name, value, rule if rule == "finite" else f"finite and {rule}")


def check_int(name: str, value: Any, *, low: int | None = None) -> None:
    """Checks ``value`` is an integer (not a bool or float) and ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        rule = "a Python int"
        if hasattr(value, "shape"):  # an array, e.g. from optax.inject_hyperparams
            rule += (
                " (it fixes shapes or seeds at trace time; with"
                " optax.inject_hyperparams, list it in static_args)"
            )
        _fail(name, value, rule, TypeError)
    if low is not None and value < low:
        _fail(name, value, f">= {low}")


def check_bool(name: str, value: Any) -> None:
    """Checks ``value`` is a bool (Python or NumPy): a flag given as a string or a
    number is refused (``"no"`` would otherwise behave as True)."""
    if not isinstance(value, bool | np.bool_):
        _fail(name, value, "True or False", TypeError)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Checks ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        _fail(name, value, "one of " + ", ".join(repr(c) for c in choices))
