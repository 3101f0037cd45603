"""SOAP's arguments: each one's check (``Invalid <name>=<value!r>: must be
...``), per group, in the signature's order, and the checks of the parameters
and gradients it takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from precond._common.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
)
from precond.torch._core.optimizer import check_lr, tensor_checks

# The ways a basis is refreshed: one QR power step, or a full eigendecomposition.
REFRESHES = ("qr", "eigh")


def _check_betas(name: str, value: Any) -> None:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(
            f"Invalid {name}={value!r}: must be a pair (beta1, beta2) of numbers "
            "in [0, 1)"
        )
    for i, beta in enumerate(value):
        check_real(f"{name}[{i}]", beta, low=0.0, high=1.0, high_inclusive=False)


def _check_shampoo_beta(name: str, value: Any) -> None:
    """Below 0 (betas[1] is used, the paper's -1) or in [0, 1)."""
    check_real(name, value, high=1.0, high_inclusive=False)


def _check_block_size(name: str, value: Any) -> None:
    if value is not None:
        check_int(name, value, low=1)


# Every per-group argument and its check, in the signature's order (the order of
# ``defaults``).
GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", check_lr),
    ("betas", _check_betas),
    ("shampoo_beta", _check_shampoo_beta),
    ("eps", lambda n, v: check_real(n, v, low=0.0)),
    ("weight_decay", lambda n, v: check_real(n, v, low=0.0)),
    ("precondition_frequency", lambda n, v: check_int(n, v, low=1)),
    ("max_precond_dim", lambda n, v: check_int(n, v, low=0)),
    ("merge_dims", check_bool),
    ("precondition_1d", check_bool),
    ("normalize_grads", check_bool),
    ("correct_bias", check_bool),
    ("refresh", lambda n, v: check_choice(n, v, REFRESHES)),
    ("block_size", _check_block_size),
)


check_parameter, check_gradient = tensor_checks("SOAP", complex_allowed=False)
