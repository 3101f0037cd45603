"""Shampoo's arguments for torch: the grafting and preconditioner types (the
values of ``precond.jax``'s), each argument's check (``Invalid <name>=<value!r>:
must be ...``, the rules of ``precond.jax.distributed_shampoo``), and the checks
of the parameters and gradients it takes."""

from __future__ import annotations

import enum
import functools
import numbers
from collections.abc import Callable
from typing import Any

from precond._common.shampoo_types import GraftingType, PreconditionerType
from precond._common.validation import check_bool, check_int, check_real
from precond.torch._core.optimizer import check_lr, tensor_checks
from precond.torch.kron.strategies import check_strategy

__all__ = [
    "ENUM_ARGUMENTS",
    "GROUP_ARGUMENTS",
    "GraftingType",
    "PreconditionerType",
    "check_beta1",
    "check_gradient",
    "check_parameter",
    "check_strategy",
]


def _check_enum(kind: type[enum.IntEnum]) -> Callable[[str, Any], None]:
    """A member of ``kind`` or its int value."""

    def check(name: str, value: Any) -> None:
        values = [int(m) for m in kind]
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or int(value) not in values
        ):
            members = ", ".join(f"{kind.__name__}.{m.name} ({int(m)})" for m in kind)
            raise ValueError(f"Invalid {name}={value!r}: must be one of {members}")

    return check


def _optional(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    def check_optional(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return check_optional


_positive = functools.partial(check_real, low=0.0, low_inclusive=False)
check_beta1 = functools.partial(check_real, low=0.0, high=1.0)

# Every argument (all may be set per param group) and its check, in the
# signature's order (the order of ``defaults``): precond.jax's rules.
GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", check_lr),
    ("block_size", functools.partial(check_int, low=0)),
    ("beta1", check_beta1),
    ("beta2", functools.partial(check_real, low=0.0, high=1.0)),
    ("diagonal_epsilon", functools.partial(check_real, low=0.0)),
    ("matrix_epsilon", functools.partial(check_real, low=0.0)),
    ("weight_decay", functools.partial(check_real, low=0.0)),
    ("start_preconditioning_step", functools.partial(check_int, low=0)),
    ("preconditioning_compute_steps", functools.partial(check_int, low=1)),
    ("statistics_compute_steps", functools.partial(check_int, low=1)),
    ("best_effort_shape_interpretation", check_bool),
    ("graft_type", _check_enum(GraftingType)),
    ("nesterov", check_bool),
    ("exponent_override", functools.partial(check_int, low=0)),
    ("inverse_failure_threshold", _positive),
    ("moving_average_for_momentum", check_bool),
    ("skip_preconditioning_dim_size_gt", functools.partial(check_int, low=1)),
    ("clip_by_scaled_gradient_norm", _optional(_positive)),
    ("relative_matrix_epsilon", check_bool),
    ("merge_small_dims_block_size", _optional(functools.partial(check_int, low=1))),
    ("precondtioner_type", _check_enum(PreconditionerType)),
    ("skip_preconditioning_rank_lt", functools.partial(check_int, low=0)),
    ("decoupled_learning_rate", check_bool),
    ("decoupled_weight_decay", check_bool),
    ("eigh", check_bool),
    ("separate_grafting_momentum", check_bool),
    ("precondition_with_previous_roots", _optional(check_bool)),
)
# Stored as plain ints in the groups, so that state dicts load with
# torch.load(weights_only=True).
ENUM_ARGUMENTS = ("graft_type", "precondtioner_type")


check_parameter, check_gradient = tensor_checks("Shampoo", complex_allowed=False)
