"""Kron's arguments: each one's check (``Invalid <name>=<value!r>: must be
...``), per group or for the whole optimizer, in the signature's order, and the
checks of the parameters and gradients it takes."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from precond._common.factor_plan import MEMORY_SAVE_MODES
from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.validation import check_bool, check_choice, check_real
from precond.torch._core.optimizer import check_lr, tensor_checks
from precond.torch.kron.strategies import Strategy

# memory_save_mode values: precond's plan's, plus kron-torch 0.3.3's 'smart_one_diag'
# (torch only: distributed-kron, and so precond.jax.kron, has no such mode).
TORCH_MEMORY_SAVE_MODES = tuple(dict.fromkeys((*MEMORY_SAVE_MODES, "smart_one_diag")))


def _check_probability(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        check_real(name, value, low=0.0, high=1.0, low_inclusive=False)


def _check_dtype(name: str, value: Any) -> None:
    if value is not None and not (
        isinstance(value, torch.dtype) and value.is_floating_point
    ):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a floating torch.dtype"
        )


def _check_skew(name: str, value: Any) -> None:
    if value != float("inf"):
        check_real(name, value, low=0.0)


# The update clippings of ``Kron(update_clipping=...)``.
UPDATE_CLIPPINGS = ("norm_and_value", "rms")


def _check_seed(name: str, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral)
    ):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None (torch's global generator) or "
            "a Python int"
        )


def _check_strategy(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, Strategy):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a precond.torch.Strategy "
            "(Replicated() or ShardedPreconditioning())"
        )


# The optimizer-wide arguments (not per group) and their checks.
OPTIMIZER_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("seed", _check_seed),
    ("strategy", _check_strategy),
    ("compile_kernels", check_bool),
)


# Every per-group argument and its check: (name, check(name, value)), in the
# signature's order (which is the order of ``defaults``). The arguments that
# precond.jax.kron takes under the same name and rule are checked by
# precond._common.kron_arguments; the rest are kron-torch's own and checked here:
# lr and weight_decay (the alias's in JAX), a probability in (0, 1] or None for
# the default schedule (JAX: a schedule or [0, 1]), kron-torch's precond_lr and
# precond_init_scale (distributed-kron's preconditioner_lr / _init_scale),
# torch dtypes, memory_save_mode with kron-torch 0.3.3's 'smart_one_diag', and
# the kron-torch rules JAX lacks (max_skew_triangular, merge_dims,
# update_clipping, store_debiased_momentum, damping).
_SHARED = KRON_SHARED_ARGUMENT_CHECKS


GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", check_lr),
    ("b1", _SHARED["b1"]),
    ("weight_decay", lambda n, v: check_real(n, v, low=0.0)),
    ("preconditioner_update_probability", _check_probability),
    ("max_size_triangular", _SHARED["max_size_triangular"]),
    ("max_skew_triangular", _check_skew),
    ("mu_dtype", _check_dtype),
    ("precond_dtype", _check_dtype),
    ("min_ndim_triangular", _SHARED["min_ndim_triangular"]),
    ("memory_save_mode", lambda n, v: check_choice(n, v, TORCH_MEMORY_SAVE_MODES)),
    ("momentum_into_precond_update", _SHARED["momentum_into_precond_update"]),
    ("precond_lr", lambda n, v: check_real(n, v, low=0.0)),
    ("precond_init_scale", lambda n, v: check_real(n, v, low=0.0, low_inclusive=False)),
    ("merge_dims", check_bool),
    ("update_clipping", lambda n, v: check_choice(n, v, UPDATE_CLIPPINGS)),
    ("store_debiased_momentum", check_bool),
    ("damping", check_bool),
    ("merge_small_dims", _SHARED["merge_small_dims"]),
    ("target_merged_dim_size", _SHARED["target_merged_dim_size"]),
    ("preconditioner_update_style", _SHARED["preconditioner_update_style"]),
    ("preconditioner_cache", _SHARED["preconditioner_cache"]),
)


check_parameter, check_gradient = tensor_checks("Kron", complex_allowed=True)
