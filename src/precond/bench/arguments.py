"""argparse types shared by ``precond bench`` and the speed harness in ``benchmarks/``.

Each raises ``argparse.ArgumentTypeError`` with a message naming the bad value, so
argparse reports it as a one-line usage error.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import Any


def number(convert: type, low: float, strict: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)``, finite and >= ``low`` (> if strict)."""
    kind = "an integer" if convert is int else "a number"
    bound = f"> {low}" if strict else f">= {low}"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {kind} {bound}")
        return value

    return parse


positive_int = number(int, 1)
nonnegative_int = number(int, 0)
nonnegative_float = number(float, 0)
positive_float = number(float, 0, strict=True)


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. ``128,512,1024``."""
    return [positive_int(item) for item in text.split(",") if item.strip()]


def finite_positive(text: str, label: str) -> float:
    """``float(text)``, finite and > 0; the error names ``label`` and the text."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{label} {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{label} {text} must be a finite number > 0")
    return value


def multipliers(text: str) -> list[float]:
    """Comma-separated distinct numbers > 0, e.g. ``0.3,1,3`` (``--lr-sweep``)."""
    values = [finite_positive(item, "multiplier") for item in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError("a multiplier is given more than once")
    return values


def names(choices: Iterable[str], kind: str) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``choices``, none
    given twice."""
    choices = list(choices)

    def parse(text: str) -> list[str]:
        found = [name.strip() for name in text.split(",") if name.strip()]
        if not found:
            raise argparse.ArgumentTypeError(f"no {kind} names given")
        for name in found:
            if name not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {name!r}; choose from {', '.join(choices)}"
                )
        duplicates = sorted({n for n in found if found.count(n) > 1})
        if duplicates:
            raise argparse.ArgumentTypeError(
                f"{kind} {', '.join(map(repr, duplicates))} given more than once"
            )
        return found

    return parse


def learning_rate_grid(
    families: Iterable[str],
) -> Callable[[str], tuple[str, list[float]]]:
    """An argparse type for ``FAMILY=LR[,LR...]`` with FAMILY one of ``families``:
    (FAMILY, the rates sorted), every rate finite and > 0."""
    families = list(families)

    def parse(text: str) -> tuple[str, list[float]]:
        family, _, values = text.partition("=")
        family = family.strip()
        if family not in families:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give FAMILY=LR[,LR...] with FAMILY one of "
                + ", ".join(families)
            )
        try:
            rates = sorted(float(x) for x in values.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: learning rates not numbers"
            ) from None
        if not rates or not all(math.isfinite(x) and x > 0 for x in rates):
            raise argparse.ArgumentTypeError(f"{text!r}: learning rates must be > 0")
        return family, rates

    return parse


def transformer_shape(text: str) -> tuple[int, int]:
    """``WIDTHxLAYERS`` (e.g. ``256x4``): the width and depth of a char-lm
    transformer, the width a multiple of its attention heads."""
    from precond.bench.jax_models import CHAR_LM_HEADS

    width, sep, layers = text.strip().partition("x")
    try:
        shape = int(width), int(layers)
    except ValueError:
        shape = None
    if not sep or shape is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not of the form WIDTHxLAYERS")
    if shape[0] < 1 or shape[0] % CHAR_LM_HEADS or shape[1] < 1:
        raise argparse.ArgumentTypeError(
            f"{text}: the width must be a multiple of the {CHAR_LM_HEADS} heads "
            "and both numbers >= 1"
        )
    return shape


def transformer_shapes(text: str) -> list[tuple[int, int]]:
    """Comma-separated :func:`transformer_shape` items, e.g. ``64x2,256x4``."""
    return [transformer_shape(item) for item in text.split(",") if item.strip()]
