"""The arguments of SOAP: their checks and the validated config.

:func:`validated` checks every argument of ``soap`` (or of ``scale_by_soap``,
which leaves the learning rate and weight decay to the chain) with one error
phrasing and returns the :class:`Config` the transform reads.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp

from precond._common.validation import check_bool, check_choice, check_int, check_real
from precond.jax._core.alias import ALIAS_ARGUMENT_CHECKS
from precond.jax._core.argument_trees import (
    check_mesh,
    check_partition_spec,
    check_partition_specs_tree,
)
from precond.jax._core.precision import MATMUL_PRECISIONS, check_floating_dtype

REFRESH_METHODS = ("qr", "eigh")
# Arguments that fix shapes or code paths: static under optax.inject_hyperparams.
SCALE_BY_SOAP_STATIC_ARGS = (
    "precondition_frequency",
    "max_precond_dim",
    "merge_dims",
    "precondition_1d",
    "normalize_grads",
    "correct_bias",
    "refresh",
    "block_size",
    "precond_dtype",
    "precision",
    "params_partition_specs",
    "preconditioner_partition_spec",
    "mesh",
)
SOAP_STATIC_ARGS = (*SCALE_BY_SOAP_STATIC_ARGS, "weight_decay_mask")


class Config(NamedTuple):
    """The validated arguments of ``scale_by_soap``."""

    b1: Any
    b2: Any
    shampoo_beta: Any
    eps: Any
    precondition_frequency: int
    max_precond_dim: int
    merge_dims: bool
    precondition_1d: bool
    normalize_grads: bool
    correct_bias: bool
    refresh: str
    block_size: int | None
    precond_dtype: Any
    precision: str | None
    params_partition_specs: Any
    preconditioner_partition_spec: Any
    mesh: Any

    @property
    def statistics_beta(self) -> Any:
        """β_s: ``shampoo_beta``, or ``b2`` when it is negative (the paper's
        default). Traced values (``inject_hyperparams``) are selected in the step."""
        if isinstance(self.shampoo_beta, int | float):
            return self.b2 if self.shampoo_beta < 0 else self.shampoo_beta
        return jnp.where(self.shampoo_beta < 0, self.b2, self.shampoo_beta)


def _optional(check):
    """``check``, skipped for None."""

    def check_optional(name, value):
        if value is not None:
            check(name, value)

    return check_optional


_below_one = functools.partial(check_real, low=0.0, high=1.0, high_inclusive=False)
# Every argument of soap and its check, in signature order. Numbers may be arrays
# (traced under optax.inject_hyperparams); int and bool arguments fix shapes or
# code paths and must be Python values (static).
ARGUMENT_CHECKS = {
    "learning_rate": ALIAS_ARGUMENT_CHECKS["learning_rate"],
    "b1": _below_one,
    "b2": _below_one,
    "shampoo_beta": functools.partial(
        check_real, high=1.0, high_inclusive=False
    ),  # negative: b2
    "eps": functools.partial(check_real, low=0.0),
    "weight_decay": ALIAS_ARGUMENT_CHECKS["weight_decay"],
    "precondition_frequency": functools.partial(check_int, low=1),
    "max_precond_dim": functools.partial(check_int, low=0),
    "merge_dims": check_bool,
    "precondition_1d": check_bool,
    "normalize_grads": check_bool,
    "correct_bias": check_bool,
    "refresh": functools.partial(check_choice, choices=REFRESH_METHODS),
    "block_size": _optional(functools.partial(check_int, low=1)),
    "weight_decay_mask": ALIAS_ARGUMENT_CHECKS["weight_decay_mask"],
    "precond_dtype": check_floating_dtype,
    "precision": functools.partial(check_choice, choices=MATMUL_PRECISIONS),
    "params_partition_specs": check_partition_specs_tree,
    "preconditioner_partition_spec": check_partition_spec,
    "mesh": check_mesh,
}
# What soap adds to scale_by_soap (checked there, passed to the alias layer).
ALIAS_ONLY = ("learning_rate", "weight_decay", "weight_decay_mask")


def check_arguments(args: dict[str, Any]) -> None:
    """Every argument in ``args`` (a ``locals()``), in signature order."""
    for name, check in ARGUMENT_CHECKS.items():
        if name in args:
            check(name, args[name])


def validated(**args) -> Config:
    """The checked arguments of ``scale_by_soap`` as a :class:`Config`."""
    check_arguments(args)
    return Config(**{k: v for k, v in args.items() if k not in ALIAS_ONLY})
