"""The arguments of Distributed Shampoo: their checks and the validated config.

:func:`validated` checks every argument of ``distributed_shampoo`` (or of
``scale_by_shampoo``, which leaves the learning rate to the chain) with one
error phrasing and returns the :class:`Config` the transform reads.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.sharding import PartitionSpec

from precond._common.shampoo_types import GraftingType, PreconditionerType
from precond._common.validation import check_bool, check_choice, check_int, check_real
from precond.jax._core.argument_trees import check_mesh, check_partition_specs_tree

# Arguments that fix shapes or code paths: static under optax.inject_hyperparams.
SHAMPOO_STATIC_ARGS = (
    "block_size",
    "start_preconditioning_step",
    "preconditioning_compute_steps",
    "statistics_compute_steps",
    "best_effort_shape_interpretation",
    "graft_type",
    "nesterov",
    "exponent_override",
    "batch_axis_name",
    "statistics_partition_spec",
    "preconditioner_partition_spec",
    "num_devices_for_pjit",
    "shard_optimizer_states",
    "best_effort_memory_usage_reduction",
    "moving_average_for_momentum",
    "skip_preconditioning_dim_size_gt",
    "clip_by_scaled_gradient_norm",
    "precision",
    "tensordot_precision",
    "relative_matrix_epsilon",
    "merge_small_dims_block_size",
    "lobpcg_topk_precondition",
    "lobpcg_max_iter",
    "precondtioner_type",
    "skip_preconditioning_rank_lt",
    "decoupled_learning_rate",
    "decoupled_weight_decay",
    "generate_training_metrics",
    "reuse_preconditioner",
    "eigh",
    "separate_grafting_momentum",
    "quantize_statistics",
    "sharded_init_fns",
    "precondition_with_previous_roots",
    "params_partition_specs",
    "mesh",
)
_PRECISIONS = {
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
}


class Config(NamedTuple):
    """The validated arguments of ``distributed_shampoo`` (``learning_rate`` is
    None for ``scale_by_shampoo``)."""

    learning_rate: Any
    block_size: int
    beta1: Any
    beta2: Any
    diagonal_epsilon: Any
    matrix_epsilon: Any
    weight_decay: Any
    start_preconditioning_step: Any
    preconditioning_compute_steps: int
    statistics_compute_steps: int
    best_effort_shape_interpretation: bool
    graft_type: GraftingType
    nesterov: bool
    exponent_override: int
    batch_axis_name: Any
    statistics_partition_spec: Any
    preconditioner_partition_spec: Any
    num_devices_for_pjit: int | None
    shard_optimizer_states: bool
    best_effort_memory_usage_reduction: bool
    inverse_failure_threshold: Any
    moving_average_for_momentum: bool
    skip_preconditioning_dim_size_gt: int
    clip_by_scaled_gradient_norm: Any
    precision: lax.Precision
    tensordot_precision: Any
    relative_matrix_epsilon: bool
    merge_small_dims_block_size: int | None
    lobpcg_topk_precondition: int
    lobpcg_max_iter: int
    precondtioner_type: PreconditionerType
    skip_preconditioning_rank_lt: int
    decoupled_learning_rate: bool
    decoupled_weight_decay: bool
    generate_training_metrics: bool
    reuse_preconditioner: bool
    eigh: bool
    separate_grafting_momentum: bool
    quantize_statistics: bool | None
    sharded_init_fns: bool
    precondition_with_previous_roots: bool | None
    params_partition_specs: Any  # a PartitionSpec (or None) per parameter, or None
    mesh: Any  # the jax.sharding.Mesh the specs name, or None

    @property
    def uses_previous_roots(self) -> bool:
        """Whether a step preconditions with the roots of the step before (the
        new ones are stored for the next step): asked for, or (by default) in
        the sharded mode, as Google's code does there."""
        if self.precondition_with_previous_roots is not None:
            return self.precondition_with_previous_roots
        return self.shard_optimizer_states

    @property
    def statistics_quantized(self) -> bool:
        """int16 statistics and roots: asked for, or (by default) memory mode
        inside shard_map/pmap (``batch_axis_name``), where Google's code does it."""
        if self.quantize_statistics is not None:
            return self.quantize_statistics
        return self.best_effort_memory_usage_reduction and (
            self.batch_axis_name is not None
        )

    @property
    def gram_precision(self):
        """Precision of the statistics' products: ``tensordot_precision``, else
        ``precision``."""
        if self.tensordot_precision is None:
            return self.precision
        return self.tensordot_precision

    @property
    def has_diagonal_statistics(self) -> bool:
        return self.graft_type not in (GraftingType.SGD, GraftingType.SQRT_N)

    @property
    def has_diagonal_momentum(self) -> bool:
        return self.graft_type != GraftingType.SQRT_N or self.separate_grafting_momentum

    @property
    def stack_multiple(self) -> int:
        """Stacks are padded to a multiple of this many rows (one share per device)."""
        if self.preconditioner_partition_spec is None and not (
            self.shard_optimizer_states
        ):
            return 1
        return self.num_devices_for_pjit or jax.device_count()


def _optional(check):
    """``check``, skipped for None."""

    def check_optional(name, value):
        if value is not None:
            check(name, value)

    return check_optional


def _check_precision(name: str, value) -> None:
    if isinstance(value, str) and value.lower() in _PRECISIONS:
        value = _PRECISIONS[value.lower()]
    check_choice(name, value, [None, *lax.Precision])


def _check_axis_name(name: str, value) -> None:
    names = value if isinstance(value, tuple) else (value,)
    if value is not None and not all(isinstance(v, str) for v in names):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None, a mapped axis name (str) or a "
            "tuple of them"
        )


def _check_stack_spec(name: str, value) -> None:
    if value is not None and not isinstance(
        value, PartitionSpec | jax.sharding.Sharding
    ):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None, a jax.sharding.PartitionSpec "
            "or a jax.sharding.Sharding for the stacked (K, n, n) matrices"
        )


_positive = functools.partial(check_real, low=0.0, low_inclusive=False)
# Every argument of distributed_shampoo and its check, in signature order. Numbers
# may be arrays (traced under optax.inject_hyperparams); int arguments fix shapes
# or code paths and must be Python ints (static).
ARGUMENT_CHECKS = {
    "learning_rate": functools.partial(check_real, low=0.0, allow_schedule=True),
    "block_size": functools.partial(check_int, low=0),
    "beta1": functools.partial(check_real, low=0.0, high=1.0),
    "beta2": functools.partial(check_real, low=0.0, high=1.0),
    "diagonal_epsilon": functools.partial(check_real, low=0.0),
    "matrix_epsilon": functools.partial(check_real, low=0.0),
    "weight_decay": functools.partial(check_real, low=0.0),
    "start_preconditioning_step": functools.partial(check_int, low=0),
    "preconditioning_compute_steps": functools.partial(check_int, low=1),
    "statistics_compute_steps": functools.partial(check_int, low=1),
    "best_effort_shape_interpretation": check_bool,
    "graft_type": functools.partial(
        check_choice, choices=[*GraftingType, *range(1, 7)]
    ),
    "nesterov": check_bool,
    "exponent_override": functools.partial(check_int, low=0),
    "batch_axis_name": _check_axis_name,
    "statistics_partition_spec": _check_stack_spec,
    "preconditioner_partition_spec": _check_stack_spec,
    "num_devices_for_pjit": _optional(functools.partial(check_int, low=1)),
    "shard_optimizer_states": check_bool,
    "best_effort_memory_usage_reduction": check_bool,
    "inverse_failure_threshold": _positive,
    "moving_average_for_momentum": check_bool,
    "skip_preconditioning_dim_size_gt": functools.partial(check_int, low=1),
    "clip_by_scaled_gradient_norm": _optional(_positive),
    "precision": _check_precision,
    "tensordot_precision": _check_precision,
    "relative_matrix_epsilon": check_bool,
    "merge_small_dims_block_size": _optional(functools.partial(check_int, low=1)),
    "lobpcg_topk_precondition": functools.partial(check_int, low=0),
    "lobpcg_max_iter": functools.partial(check_int, low=0),
    "precondtioner_type": functools.partial(
        check_choice, choices=[*PreconditionerType, *range(1, 4)]
    ),
    "skip_preconditioning_rank_lt": functools.partial(check_int, low=0),
    "decoupled_learning_rate": check_bool,
    "decoupled_weight_decay": check_bool,
    "generate_training_metrics": check_bool,
    "reuse_preconditioner": check_bool,
    "eigh": check_bool,
    "separate_grafting_momentum": check_bool,
    "quantize_statistics": _optional(check_bool),
    "sharded_init_fns": check_bool,
    "precondition_with_previous_roots": _optional(check_bool),
    # Keyword-only, precond's (see shampoo._placement).
    "params_partition_specs": check_partition_specs_tree,
    "mesh": check_mesh,
}


# What scale_by_shampoo leaves to the chain: it has no learning rate (the
# direction is returned unscaled), so no coupled learning rate and no weight
# decay scaled by it, and its init returns the state itself.
DIRECTION_ONLY = {
    "learning_rate": None,
    "decoupled_learning_rate": True,
    "decoupled_weight_decay": False,
    "sharded_init_fns": False,
}


# scale_by_shampoo's static arguments under optax.inject_hyperparams (optax
# refuses names that are not arguments of the factory).
SCALE_BY_SHAMPOO_STATIC_ARGS = tuple(
    name for name in SHAMPOO_STATIC_ARGS if name not in DIRECTION_ONLY
)


def validated(**args) -> Config:
    """The checked arguments as a :class:`Config`: every argument of
    ``distributed_shampoo``, or those of ``scale_by_shampoo`` (the rest from
    :data:`DIRECTION_ONLY`)."""
    for name, check in ARGUMENT_CHECKS.items():
        if name in args:
            check(name, args[name])
    args = {**DIRECTION_ONLY, **args}
    args["graft_type"] = GraftingType(args["graft_type"])
    args["precondtioner_type"] = PreconditionerType(args["precondtioner_type"])
    for name in ("precision", "tensordot_precision"):
        if isinstance(args[name], str):
            args[name] = _PRECISIONS[args[name].lower()]
    args["statistics_partition_spec"] = _stored_stack_spec(args)
    if args["batch_axis_name"] is not None and args["shard_optimizer_states"]:
        raise ValueError(
            f"Invalid batch_axis_name={args['batch_axis_name']!r} with "
            "shard_optimizer_states=True: the data-parallel (shard_map/pmap) mode "
            "keeps a full copy of the state per device; use one mode or the other"
        )
    return Config(**args)


def _stored_stack_spec(args: dict):
    """How the stacks are stored: split by ``statistics_partition_spec`` (or the
    preconditioner spec) in the sharded mode, whole otherwise (Google's code
    ignores the spec there too)."""
    if not args["shard_optimizer_states"]:
        return None
    if (
        args["statistics_partition_spec"]
        is None
        is args["preconditioner_partition_spec"]
    ):
        raise ValueError(
            "Invalid shard_optimizer_states=True: needs statistics_partition_spec "
            "or preconditioner_partition_spec, e.g. PartitionSpec('data', None, "
            "None) to split the stacked statistics over the 'data' mesh axis"
        )
    return args["statistics_partition_spec"] or args["preconditioner_partition_spec"]
