"""The validators raise ``Invalid <name>=<value!r>: must be <rule>`` (DESIGN.md §9)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from precond._common.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
    is_concrete_number,
)


def raised(error, fn, *args, **kwargs) -> str:
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --- is_concrete_number -------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [0, 1, -2.5, math.inf, math.nan, np.float32(1), np.int64(3), Fraction(1, 3)],
)
def test_concrete_numbers(value):
    assert is_concrete_number(value)


@pytest.mark.parametrize(
    "value", [True, False, np.bool_(True), "1", None, np.array(1.0), [1.0], abs]
)
def test_not_concrete_numbers(value):
    assert not is_concrete_number(value)


# --- check_real ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        ({}, 0.0),
        ({}, -1e300),
        ({"low": 0}, 0),
        ({"low": 0}, 0.5),
        ({"low": 0, "high": 1}, 1.0),
        ({"low": 0, "high": 1, "low_inclusive": False}, 1e-12),
        ({"low": 0, "high": 1, "high_inclusive": False}, 0.999),
        ({"low": 0, "high": 1}, np.float32(0.5)),
        ({"low": 0, "high": 1}, Fraction(1, 2)),
    ],
)
def test_check_real_accepts_values_in_range(kwargs, value):
    check_real("x", value, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"low": 0}, -1.0, "Invalid lr=-1.0: must be >= 0"),
        ({"low": 0.0}, -1, "Invalid lr=-1: must be >= 0.0"),
        (
            {"low": 0, "low_inclusive": False},
            0.0,
            "Invalid lr=0.0: must be > 0",
        ),
        ({"low": 0, "high": 1}, 1.5, "Invalid lr=1.5: must be in [0, 1]"),
        (
            {"low": 0, "high": 1, "high_inclusive": False},
            1.0,
            "Invalid lr=1.0: must be in [0, 1)",
        ),
        ({"high": 1}, 2, "Invalid lr=2: must be <= 1"),
        ({"low": 0}, math.nan, "Invalid lr=nan: must be finite and >= 0"),
        ({}, math.nan, "Invalid lr=nan: must be finite"),
        ({"low": 0}, math.inf, "Invalid lr=inf: must be finite and >= 0"),
        ({}, -math.inf, "Invalid lr=-inf: must be finite"),
        ({"low": 0, "high": 1}, math.inf, "Invalid lr=inf: must be in [0, 1]"),
    ],
)
def test_check_real_rejects_with_name_value_and_range(kwargs, value, message):
    assert raised(ValueError, check_real, "lr", value, **kwargs) == message


def test_check_real_checks_numpy_scalars():
    message = raised(ValueError, check_real, "b1", np.float64(1.5), low=0, high=1)
    assert message.startswith(f"Invalid b1={np.float64(1.5)!r}: must be in [0, 1]")


@pytest.mark.parametrize("value", [True, False, "0.1", None])
def test_check_real_rejects_non_numbers_with_type_error(value):
    message = raised(TypeError, check_real, "lr", value, low=0)
    assert message == f"Invalid lr={value!r}: must be a number"
    message = raised(TypeError, check_real, "lr", value, allow_schedule=True)
    assert message == f"Invalid lr={value!r}: must be a number or a schedule (callable)"


def test_check_real_schedules():
    def schedule(count):
        return 0.1

    message = raised(TypeError, check_real, "lr", schedule, low=0)
    assert message == f"Invalid lr={schedule!r}: must be a number, not a callable"
    check_real("lr", schedule, low=0, allow_schedule=True)


def test_check_real_leaves_arrays_to_the_caller():
    # Arrays may be traced (optax.inject_hyperparams): unchecked, even out of range.
    check_real("lr", np.array(-1.0), low=0)
    check_real("lr", np.array([2.0, 3.0]), low=0, high=1)


# --- check_int ----------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 5, np.int64(7), np.int32(0)])
def test_check_int_accepts_integers(value):
    check_int("n", value, low=0)


def test_check_int_rejects_below_low():
    assert raised(ValueError, check_int, "n", -1, low=0) == "Invalid n=-1: must be >= 0"
    assert raised(ValueError, check_int, "n", 1, low=2) == "Invalid n=1: must be >= 2"
    check_int("n", -(10**9))  # no lower bound


@pytest.mark.parametrize("value", [1.0, True, False, "3", None, 2.5])
def test_check_int_rejects_non_integers_with_type_error(value):
    message = raised(TypeError, check_int, "n", value, low=0)
    assert message.startswith(f"Invalid n={value!r}: must be ")
    assert "int" in message


def test_check_int_on_arrays_explains_static_args():
    message = raised(TypeError, check_int, "n", np.array(3))
    assert message.startswith("Invalid n=array(3): must be ")
    assert "static_args" in message


# --- check_choice -------------------------------------------------------------


def test_check_choice():
    check_choice("mode", None, (None, "a", "b"))
    check_choice("mode", "b", iter(["a", "b"]))  # any iterable, consumed once
    message = raised(ValueError, check_choice, "mode", "c", (None, "a", "b"))
    assert message == "Invalid mode='c': must be one of None, 'a', 'b'"
    message = raised(ValueError, check_choice, "k", 3, range(3))
    assert message == "Invalid k=3: must be one of 0, 1, 2"


# --- check_bool ---------------------------------------------------------------


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_check_bool_accepts_bools(value):
    check_bool("flag", value)


@pytest.mark.parametrize("value", ["no", "True", 0, 1, 1.0, None, np.array([True])])
def test_check_bool_refuses_everything_else(value):
    assert raised(TypeError, check_bool, "flag", value) == (
        f"Invalid flag={value!r}: must be True or False"
    )
