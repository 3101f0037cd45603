"""Distributed Shampoo with grafting, for optax (Google's ``distributed_shampoo``).

For a parameter W with gradient G, cut (after merging small dims) into blocks
G_b, Shampoo keeps one statistic per block and axis,
S_{b,k} ← β2·S_{b,k} + (1−β2)·G_b ⋅_{¬k} G_b (contraction over every other axis),
and preconditions with their inverse p-th roots, p = 2·rank:
P(G)_b = G_b ×_0 S_{b,0}^{-1/p} ×_1 S_{b,1}^{-1/p} … . The direction is grafted
to the norm of a first-order method's step u_g (SGD, AdaGrad, RMSProp, …):
u = P(G)·‖u_g‖/‖P(G)‖, then momentum (optionally Nesterov) and −lr.

Every statistic of every parameter lives in one stack per (size, exponent), so
the inverse roots of all of them run as one vmapped program, which a partition
spec or a ``batch_axis_name`` spreads over devices.

References:
    V. Gupta, T. Koren, Y. Singer, *Shampoo: Preconditioned Stochastic Tensor
    Optimization*, ICML 2018.
    R. Anil, V. Gupta, T. Koren, K. Regan, Y. Singer, *Scalable Second Order
    Optimization for Deep Learning*, arXiv:2002.09018.
"""

from __future__ import annotations

import enum
import functools
import inspect
import itertools
import math
import string
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from precond._common.factor_plan import merge_small_dims
from precond._common.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
    is_concrete_number,
)
from precond.jax._guards import (
    check_parameter_dtypes,
    check_state_matches,
    gradients_are_usable,
)
from precond.jax._kron_sharding import explicit_specs
from precond.jax._psgd_transform import with_auto_axes
from precond.jax._shampoo_math import (
    QuantizedArray,
    dequantize,
    matrix_inverse_pth_root,
    matrix_inverse_pth_root_eigh,
    quantize,
)

__all__ = [
    "SHAMPOO_STATIC_ARGS",
    "GraftingType",
    "InitFnState",
    "ParameterStats",
    "PreconditionerType",
    "SeedShampooState",
    "ShampooState",
    "TrainingMetrics",
    "distributed_shampoo",
    "distributed_shampoo_partition_specs",
    "distributed_shampoo_state_shapes",
    "seed_parameter_stats",
    "shampoo_state_from_seed",
]


class GraftingType(enum.IntEnum):
    """The first-order method whose step size per parameter Shampoo borrows."""

    SGD = 1
    ADAGRAD = 2
    RMSPROP = 3
    RMSPROP_NORMALIZED = 4
    SQRT_N = 5  # sign(G): every entry moves by 1 (norm √n)
    ADAGRAD_NORMALIZED = 6


class PreconditionerType(enum.IntEnum):
    """Which axes of each (merged) block get a preconditioner (Google's newer
    ``precondtioner_type`` argument); rank-1 blocks always get one."""

    ALL = 1  # every axis
    INPUT = 2  # every axis but the last (the last is taken as the output axis)
    OUTPUT = 3  # the last axis only


class TrainingMetrics(NamedTuple):
    """What the optimizer reports about itself; a field of :class:`ShampooState`."""

    # Per parameter: (max(statistics, 1),) float32, max|H^p·A − I| of each
    # statistic's latest inverse root (NaN or >= inverse_failure_threshold: the
    # root failed and the previous preconditioner was kept).
    inverse_pth_root_errors: Any


class InitFnState(NamedTuple):
    """What ``init`` returns with ``shard_optimizer_states`` (the seed's triple):
    ``init_fn(params)`` gives the state, ``pspec_fn(params, params_partition_spec,
    partition_spec_for_statistics=None)`` its partition specs (for
    ``jax.jit(init_fn, out_shardings=...)``) and ``shape_and_dtype_fn(params)``
    its shapes and dtypes."""

    init_fn: Callable
    pspec_fn: Callable
    shape_and_dtype_fn: Callable


class ShampooState(NamedTuple):
    """State of :func:`distributed_shampoo`.

    Per-parameter fields are trees like the params (``None`` where a grafting
    type has no such buffer); the statistics of all parameters are stacked.
    """

    count: jax.Array  # [] int32: steps taken
    momentum: Any  # like params, float32 (int8 QuantizedArray in memory mode)
    diagonal_momentum: Any  # like params: grafting momentum (None for SQRT_N)
    diagonal_statistics: Any  # like params: AdaGrad/RMSProp accumulator, or None
    statistics: tuple  # per (n, p) stack: (K, n, n) gram EMAs
    preconditioners: tuple  # per (n, p) stack: (K, n, n) inverse p-th roots
    training_metrics: TrainingMetrics


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
)
_PRECISIONS = {
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
}


class _Config(NamedTuple):
    """The validated arguments of :func:`distributed_shampoo`."""

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
_ARGUMENT_CHECKS = {
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
}


def _validated(**args) -> _Config:
    for name, check in _ARGUMENT_CHECKS.items():
        check(name, args[name])
    args["graft_type"] = GraftingType(args["graft_type"])
    args["precondtioner_type"] = PreconditionerType(args["precondtioner_type"])
    for name in ("precision", "tensordot_precision"):
        if isinstance(args[name], str):
            args[name] = _PRECISIONS[args[name].lower()]
    if args["shard_optimizer_states"]:
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
        args["statistics_partition_spec"] = (
            args["statistics_partition_spec"] or args["preconditioner_partition_spec"]
        )
    else:
        # Only the sharded mode stores the stacks split (Google's code ignores
        # the spec otherwise too).
        args["statistics_partition_spec"] = None
    if args["batch_axis_name"] is not None and args["shard_optimizer_states"]:
        raise ValueError(
            f"Invalid batch_axis_name={args['batch_axis_name']!r} with "
            "shard_optimizer_states=True: the data-parallel (shard_map/pmap) mode "
            "keeps a full copy of the state per device; use one mode or the other"
        )
    return _Config(**args)


# --------------------------------------------------------------------------- plans


class _BlockGroup(NamedTuple):
    """Blocks of one parameter that share a shape: a grid cut from one region."""

    starts: tuple[int, ...]  # where the region starts, per merged axis
    grid: tuple[int, ...]  # blocks per axis
    block_shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.grid)


class _ParameterPlan(NamedTuple):
    merged_shape: tuple[int, ...]
    groups: tuple[_BlockGroup, ...]
    exponent: int
    axes: tuple[int, ...]  # the merged axes that get a preconditioner

    @property
    def entries(self) -> list[tuple[int, int]]:
        """(group, axis) of each statistic entry, in state order."""
        return [(g, k) for g in range(len(self.groups)) for k in self.axes]


def _axis_segments(d: int, block_size: int) -> list[tuple[int, int, int]]:
    """(start, blocks, block size) runs of one axis: full blocks, then the rest."""
    if not 0 < block_size < d:
        return [(0, 1, d)]
    full = (d - 1) // block_size
    rest = d - full * block_size
    if rest == block_size:
        return [(0, full + 1, block_size)]
    return [(0, full, block_size), (full * block_size, 1, rest)]


def _plan_parameter(shape: tuple[int, ...], config: _Config) -> _ParameterPlan | None:
    """How a parameter is blocked, or None when it is not preconditioned (a
    scalar, an empty tensor, or a dim above ``skip_preconditioning_dim_size_gt``)."""
    if (
        len(shape) < max(config.skip_preconditioning_rank_lt, 1)
        or math.prod(shape) == 0
        or max(shape) > config.skip_preconditioning_dim_size_gt
    ):
        return None
    merge_limit = config.merge_small_dims_block_size
    if merge_limit is None:
        merge_limit = config.block_size
    merged = (
        merge_small_dims(shape, merge_limit)
        if config.best_effort_shape_interpretation
        else tuple(shape)
    )
    groups = tuple(
        _BlockGroup(
            tuple(s[0] for s in combo),
            tuple(s[1] for s in combo),
            tuple(s[2] for s in combo),
        )
        for combo in itertools.product(
            *(_axis_segments(d, config.block_size) for d in merged)
        )
    )
    rank = len(merged)
    kind = config.precondtioner_type
    if kind == PreconditionerType.ALL or rank <= 1:
        axes = tuple(range(rank))
    elif kind == PreconditionerType.INPUT:
        axes = tuple(range(rank - 1))
    else:
        axes = (rank - 1,)
    exponent = config.exponent_override or 2 * len(axes)
    return _ParameterPlan(merged, groups, exponent, axes)


class _Layout(NamedTuple):
    """Where every statistic of every parameter lives in the stacks."""

    plans: tuple  # per parameter: _ParameterPlan or None
    keys: tuple[tuple[int, int], ...]  # (n, p) of each stack, sorted
    rows: tuple[int, ...]  # real rows per stack (before padding)
    # per parameter, per entry: (stack index, first row, rows)
    slots: tuple[tuple[tuple[int, int, int], ...], ...]


def _layout(shapes: list[tuple[int, ...]], config: _Config) -> _Layout:
    plans = tuple(_plan_parameter(tuple(s), config) for s in shapes)
    keys = sorted(
        {
            (plan.groups[g].block_shape[k], plan.exponent)
            for plan in plans
            if plan is not None
            for g, k in plan.entries
        }
    )
    rows = dict.fromkeys(keys, 0)
    slots = []
    for plan in plans:
        entries = []
        for g, k in plan.entries if plan is not None else []:
            group = plan.groups[g]
            key = (group.block_shape[k], plan.exponent)
            entries.append((keys.index(key), rows[key], group.count))
            rows[key] += group.count
        slots.append(tuple(entries))
    return _Layout(plans, tuple(keys), tuple(rows[k] for k in keys), tuple(slots))


def _padded_rows(rows: int, multiple: int) -> int:
    return -(-rows // multiple) * multiple


# ------------------------------------------------------------------ block algebra


def _to_blocks(x: jax.Array, group: _BlockGroup) -> jax.Array:
    """(count, *block_shape): the blocks of ``group`` cut from ``x``, row-major."""
    region = x[
        tuple(
            slice(s, s + n * b)
            for s, n, b in zip(group.starts, group.grid, group.block_shape, strict=True)
        )
    ]
    rank = len(group.grid)
    interleaved = region.reshape(
        [v for nb in zip(group.grid, group.block_shape, strict=True) for v in nb]
    )
    order = [2 * i for i in range(rank)] + [2 * i + 1 for i in range(rank)]
    return interleaved.transpose(order).reshape((group.count, *group.block_shape))


def _from_blocks(blocks: list[jax.Array], plan: _ParameterPlan) -> jax.Array:
    """Inverse of :func:`_to_blocks` over all groups: the merged-shape tensor."""
    regions = {}
    for group, x in zip(plan.groups, blocks, strict=True):
        rank = len(group.grid)
        x = x.reshape(group.grid + group.block_shape)
        order = [v for i in range(rank) for v in (i, rank + i)]
        shape = [n * b for n, b in zip(group.grid, group.block_shape, strict=True)]
        regions[group.starts] = x.transpose(order).reshape(shape)
    starts_per_axis = [
        sorted({g.starts[k] for g in plan.groups})
        for k in range(len(plan.merged_shape))
    ]

    def nest(prefix):
        axis = len(prefix)
        if axis == len(starts_per_axis):
            return regions[tuple(prefix)]
        return [nest([*prefix, s]) for s in starts_per_axis[axis]]

    return jnp.block(nest([]))


def _letters(rank: int) -> str:
    return string.ascii_lowercase[:rank]


def _block_grams(blocks: jax.Array, axes, precision) -> dict[int, jax.Array]:
    """Per axis k in ``axes``: (count, n_k, n_k) = Σ over the other axes of
    G_b·G_bᵀ."""
    letters = _letters(blocks.ndim - 1)
    grams = {}
    for k in axes:
        a = letters[k]
        other = letters.replace(a, "A")
        spec = f"z{letters},z{other}->z{a}A"
        grams[k] = jnp.einsum(spec, blocks, blocks, precision=precision)
    return grams


def _precondition_blocks(
    blocks: jax.Array, axes, roots: list[jax.Array], precision
) -> jax.Array:
    """G_b ×_0 P_0 ×_1 P_1 …: every preconditioned axis of the block contracted
    with its P's rows (the other axes are left as they are)."""
    letters = _letters(blocks.ndim - 1)
    for k, root in zip(axes, roots, strict=True):
        a = letters[k]
        out = letters.replace(a, "A")
        blocks = jnp.einsum(
            f"z{letters},z{a}A->z{out}", blocks, root, precision=precision
        )
    return blocks


# ------------------------------------------------------------------ stored arrays


def _load(x) -> jax.Array:
    return dequantize(x) if isinstance(x, QuantizedArray) else x


def _store(x: jax.Array, like):
    """``x`` in the storage format of ``like`` (quantized or a float dtype)."""
    if isinstance(like, QuantizedArray):
        return quantize(
            x, like.values.dtype, extract_diagonal=like.diagonal is not None
        )
    return x.astype(like.dtype)


def _load_momentum(x, shape) -> jax.Array:
    """A momentum buffer as a float array of its parameter's ``shape``."""
    if not isinstance(x, QuantizedArray):
        return x
    return jnp.moveaxis(dequantize(x), -2, 0) if len(shape) > 2 else dequantize(x)


def _store_momentum(x: jax.Array, like):
    """``x`` stored like ``like``. int8 momenta are quantized with one scale per
    slice along the first axis (as Google's code): for rank > 2 the first axis is
    moved to position -2, where :func:`quantize` takes its column maxima."""
    if not isinstance(like, QuantizedArray):
        return x.astype(like.dtype)
    if x.ndim > 2:
        x = jnp.moveaxis(x, 0, -2)
    return quantize(x, like.values.dtype)


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def _sharded_in_types(tree) -> bool:
    """Some leaf of ``tree`` is split over a mesh with Explicit axes."""
    specs = explicit_specs(tree)
    return specs is not None and any(
        any(axis is not None for axis in spec)
        for spec in jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
    )


def _explicit_axes(spec) -> bool:
    """Whether ``spec`` lives on a mesh whose axes are ``AxisType.Explicit``
    (sharding in types), where a sharding change must be a ``reshard``."""
    mesh = (
        spec.mesh
        if isinstance(spec, jax.sharding.NamedSharding)
        else jax.sharding.get_abstract_mesh()
    )
    types = getattr(mesh, "axis_types", ()) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _with_sharding(x: jax.Array, spec) -> jax.Array:
    """``x`` laid out by ``spec``: a constraint on auto meshes, a reshard on
    explicit ones (where a constraint only asserts)."""
    if _explicit_axes(spec):
        return jax.sharding.reshard(x, spec)
    return lax.with_sharding_constraint(x, spec)


def _constrain(x, spec):
    """``x`` (a (K, n, n) stack, maybe quantized) constrained to ``spec``."""
    if spec is None:
        return x
    if not isinstance(x, QuantizedArray):
        return _with_sharding(x, spec)
    if isinstance(spec, jax.sharding.NamedSharding):
        row_spec = jax.sharding.NamedSharding(spec.mesh, PartitionSpec(*spec.spec[:1]))
    elif isinstance(spec, PartitionSpec):
        row_spec = PartitionSpec(*spec[:1])
    else:
        row_spec = spec
    return QuantizedArray(
        _with_sharding(x.values, spec),
        _with_sharding(x.scales, row_spec),
        None if x.diagonal is None else _with_sharding(x.diagonal, row_spec),
    )


def _replicate(x: jax.Array, config: _Config) -> jax.Array:
    """``x`` on every device, when the stacks are split (an explicit all-gather,
    so that XLA does not propagate the split into the per-parameter math)."""
    spec = config.preconditioner_partition_spec or config.statistics_partition_spec
    if spec is None:
        return x
    if isinstance(spec, jax.sharding.NamedSharding):
        return _with_sharding(x, jax.sharding.NamedSharding(spec.mesh, PartitionSpec()))
    return _with_sharding(x, PartitionSpec())


def _state_float_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


# ------------------------------------------------------------------ the transform


class _NotParams:
    """Marks, in :func:`_params_placeholder_state`, a field that is not shaped
    like the params (a leaf, so it prefixes the field's whole subtree)."""


def _is_params_placeholder(params) -> bool:
    """optax.tree.map_params calls ``init`` with a leafless placeholder object."""
    return type(params).__name__ == "_ParamsPlaceholder" and not jax.tree.leaves(params)


def _params_placeholder_state(placeholder, config: _Config) -> ShampooState:
    """The state's structure with ``placeholder`` where trees like the params
    are, for ``optax.tree.map_params``."""
    return ShampooState(
        count=_NotParams(),
        momentum=placeholder,
        diagonal_momentum=placeholder if config.has_diagonal_momentum else _NotParams(),
        diagonal_statistics=(
            placeholder if config.has_diagonal_statistics else _NotParams()
        ),
        statistics=_NotParams(),
        preconditioners=_NotParams(),
        training_metrics=_NotParams(),
    )


def _init(params, config: _Config, *, constrain: bool = True) -> ShampooState:
    if _is_params_placeholder(params):
        return _params_placeholder_state(params, config)
    check_parameter_dtypes(params, "distributed_shampoo", complex_ok=False)
    # constrain=False: for jax.eval_shape in check_state_matches (no mesh needed).
    spec = config.statistics_partition_spec if constrain else None
    leaves, treedef = jax.tree.flatten(params)
    layout = _layout([p.shape for p in leaves], config)
    memory_mode = config.best_effort_memory_usage_reduction
    float_dtypes = [_state_float_dtype(p.dtype) for p in leaves]
    stack_dtype = jnp.result_type(jnp.float32, *float_dtypes)

    def momentum_buffer(p, dtype):
        zeros = jnp.zeros(p.shape, dtype)
        if memory_mode and p.ndim > 1 and p.size:
            return _store_momentum(zeros, quantize(zeros[:1, :1], jnp.int8))
        return zeros

    momentum = [
        momentum_buffer(p, d) for p, d in zip(leaves, float_dtypes, strict=True)
    ]
    diagonal_momentum = [
        momentum_buffer(p, d) if config.has_diagonal_momentum else None
        for p, d in zip(leaves, float_dtypes, strict=True)
    ]
    diagonal_statistics = [
        jnp.zeros(p.shape, d) if config.has_diagonal_statistics else None
        for p, d in zip(leaves, float_dtypes, strict=True)
    ]
    statistics, preconditioners = [], []
    for (n, _), rows in zip(layout.keys, layout.rows, strict=True):
        total = _padded_rows(rows, config.stack_multiple)
        eye = jnp.broadcast_to(jnp.eye(n, dtype=stack_dtype), (total, n, n))
        real = (jnp.arange(total) < rows)[:, None, None]
        stats = jnp.where(real, config.matrix_epsilon * eye, eye).astype(stack_dtype)
        if config.statistics_quantized:
            stats = quantize(stats, jnp.int16, extract_diagonal=True)
            eye = quantize(eye, jnp.int16, extract_diagonal=True)
        statistics.append(_constrain(stats, spec))
        preconditioners.append(_constrain(eye, spec))
    errors = [
        jnp.zeros((max(sum(r for _, _, r in slots), 1),), jnp.float32)
        for slots in layout.slots
    ]
    unflatten = functools.partial(jax.tree.unflatten, treedef)
    metrics = (
        TrainingMetrics(unflatten(errors))
        if config.generate_training_metrics
        else optax.MaskedNode()
    )
    return ShampooState(
        count=jnp.zeros([], jnp.int32),
        momentum=unflatten(momentum),
        diagonal_momentum=unflatten(diagonal_momentum),
        diagonal_statistics=unflatten(diagonal_statistics),
        statistics=tuple(statistics),
        preconditioners=tuple(preconditioners),
        training_metrics=metrics,
    )


def _stack_roots(stack: jax.Array, p: int, config: _Config):
    """Inverse p-th roots and errors of a (K, n, n) stack, spread over devices.

    With ``batch_axis_name`` (inside shard_map/pmap) each device computes one
    contiguous share of the rows and an all-gather reassembles them; with a
    ``preconditioner_partition_spec`` the stack is split along its rows and XLA's
    partitioner gives each device its share.
    """
    if config.eigh:
        root = functools.partial(
            matrix_inverse_pth_root_eigh,
            p=p,
            relative_matrix_epsilon=config.relative_matrix_epsilon,
        )
    else:
        root = functools.partial(
            matrix_inverse_pth_root,
            p=p,
            relative_matrix_epsilon=config.relative_matrix_epsilon,
            lobpcg_topk_precondition=config.lobpcg_topk_precondition,
            lobpcg_max_iter=config.lobpcg_max_iter,
        )
    roots_of = jax.vmap(
        functools.partial(
            root, ridge_epsilon=config.matrix_epsilon, precision=config.precision
        )
    )
    if config.batch_axis_name is None:
        spec = config.preconditioner_partition_spec
        stack = _constrain(stack, spec)
        stored = (
            config.statistics_partition_spec if config.shard_optimizer_states else None
        )
        typed = spec if spec is not None else stored
        if typed is not None and _explicit_axes(typed):
            # Sharding in types: each device roots its own rows in a shard_map
            # (a vmapped while_loop over a typed-sharded stack is refused).
            roots, errors = _rows_on_their_devices(roots_of, stack, typed)
            errors = _replicate(errors, config)
        else:
            roots, errors = roots_of(stack)
        return _constrain(roots, spec), errors
    axis = config.batch_axis_name
    devices = lax.axis_size(axis)
    rows, n = stack.shape[0], stack.shape[-1]
    padding = _padded_rows(rows, devices) - rows
    eye = jnp.broadcast_to(jnp.eye(n, dtype=stack.dtype), (padding, n, n))
    shares = jnp.concatenate([stack, eye]).reshape(devices, -1, n, n)
    mine = lax.dynamic_index_in_dim(shares, lax.axis_index(axis), keepdims=False)
    roots, errors = roots_of(mine)
    roots = lax.all_gather(roots, axis, tiled=True)[:rows]
    return roots, lax.all_gather(errors, axis, tiled=True)[:rows]


def _rows_on_their_devices(roots_of, stack: jax.Array, spec):
    """``roots_of(stack)`` with each device computing the rows it holds under
    ``spec`` (a PartitionSpec of the current mesh or a NamedSharding)."""
    if isinstance(spec, jax.sharding.NamedSharding):
        mesh, spec = spec.mesh, spec.spec
    else:
        mesh = jax.sharding.get_abstract_mesh()
    rows = PartitionSpec(*tuple(spec)[:1])
    return jax.shard_map(
        roots_of,
        mesh=mesh,
        in_specs=PartitionSpec(*tuple(spec)[:1], None, None),
        out_specs=(PartitionSpec(*tuple(spec)[:1], None, None), rows),
        check_vma=False,  # the kernels' loops start from device-invariant constants
    )(stack)


def _grafting_direction(g, diagonal, config: _Config):
    """(u_g, new accumulator): the first-order step whose norm Shampoo borrows."""
    kind = config.graft_type
    if kind == GraftingType.SGD:
        return g, diagonal
    if kind == GraftingType.SQRT_N:
        return jnp.sign(g), diagonal
    if kind in (GraftingType.ADAGRAD_NORMALIZED, GraftingType.RMSPROP_NORMALIZED):
        g = g / (jnp.linalg.norm(g) + 1e-16)
    if kind in (GraftingType.ADAGRAD, GraftingType.ADAGRAD_NORMALIZED):
        diagonal = diagonal + jnp.square(g)
    else:
        diagonal = config.beta2 * diagonal + _statistics_weight(config) * jnp.square(g)
    direction = g / (jnp.sqrt(diagonal) + config.diagonal_epsilon)
    clip = config.clip_by_scaled_gradient_norm
    if clip is not None and kind in (
        GraftingType.RMSPROP,
        GraftingType.RMSPROP_NORMALIZED,
    ):
        scaled_norm = jnp.linalg.norm(direction) / math.sqrt(max(direction.size, 1))
        direction = direction / jnp.maximum(1.0, scaled_norm / clip)
    return direction, diagonal


def _statistics_weight(config: _Config):
    """Weight of the new gram in the EMA: 1 − β2, or 1 when β2 = 1 (a sum)."""
    return jnp.where(jnp.asarray(config.beta2) == 1.0, 1.0, 1.0 - config.beta2)


def _new_statistics(grads, state, layout: _Layout, config: _Config):
    """S ← β2·S + c·G_b ⋅_{¬k} G_b for every block and axis, in stack order."""
    pieces = [[] for _ in layout.keys]
    for g, plan, slots in zip(grads, layout.plans, layout.slots, strict=True):
        if plan is None:
            continue
        x = g.astype(_stack_dtype(state)).reshape(plan.merged_shape)
        grams = [
            _block_grams(_to_blocks(x, group), plan.axes, config.gram_precision)
            for group in plan.groups
        ]
        for (group, axis), (stack, _, _) in zip(plan.entries, slots, strict=True):
            pieces[stack].append(grams[group][axis])
    out = []
    for stack, old, rows in zip(pieces, state.statistics, layout.rows, strict=True):
        previous = _load(old)
        gram = _replicate(jnp.concatenate(stack), config)
        gram = jnp.pad(gram, ((0, previous.shape[0] - rows), (0, 0), (0, 0)))
        ema = config.beta2 * previous + _statistics_weight(config) * gram
        real = (jnp.arange(previous.shape[0]) < rows)[:, None, None]
        # A statistic that would overflow (a sum with β2 = 1 of huge but finite
        # gradients) keeps its previous value, like a failed root.
        usable = real & jnp.all(jnp.isfinite(ema), axis=(1, 2), keepdims=True)
        new = _store(jnp.where(usable, ema, previous), old)
        out.append(_constrain(new, config.statistics_partition_spec))
    return tuple(out)


def _new_preconditioners(statistics, state, layout: _Layout, config: _Config):
    """Inverse roots of every stack; a failed root keeps the previous one."""
    roots, errors = [], []
    for (_, p), rows, stats, old in zip(
        layout.keys, layout.rows, statistics, state.preconditioners, strict=True
    ):
        new, error = _stack_roots(_load(stats), p, config)
        usable = jnp.isfinite(error) & (error < config.inverse_failure_threshold)
        usable = usable & jnp.all(jnp.isfinite(new), axis=(1, 2))
        # Padding rows (a stack split over devices) keep their identity, so the
        # state is a function of the real rows alone (shampoo_state_from_seed).
        usable = usable & (jnp.arange(new.shape[0]) < rows)
        new = jnp.where(usable[:, None, None], new, _load(old))
        roots.append(_constrain(_store(new, old), config.statistics_partition_spec))
        errors.append(error)
    return tuple(roots), tuple(errors)


def _stack_dtype(state: ShampooState):
    if not state.statistics:
        return jnp.float32
    first = state.statistics[0]
    return jnp.float32 if _is_quantized(first) else first.dtype


def _norm(x: jax.Array) -> jax.Array:
    """‖x‖₂ as max|x|·‖x/max|x|‖: the plain sum of squares overflows float32 once
    an entry passes ~1.8e19 (possible for P(G) with an old, large root P)."""
    if not x.size:
        return jnp.zeros((), x.dtype)
    largest = jnp.max(jnp.abs(x))
    scale = jnp.where(largest > 0, largest, 1)
    return scale * jnp.linalg.norm(x / scale)


def _preconditioned(g, plan: _ParameterPlan, slots, roots, precision):
    """P(G): every block's axes multiplied by its inverse roots, merged back."""
    x = g.astype(roots[0].dtype).reshape(plan.merged_shape)
    blocks = []
    for g_index, group in enumerate(plan.groups):
        factors = [
            roots[stack][first : first + rows]
            for (entry_group, _), (stack, first, rows) in zip(
                plan.entries, slots, strict=True
            )
            if entry_group == g_index
        ]
        blocks.append(
            _precondition_blocks(_to_blocks(x, group), plan.axes, factors, precision)
        )
    return _from_blocks(blocks, plan).reshape(g.shape)


def _update(updates, state: ShampooState, params, config: _Config):
    grads, treedef = jax.tree.flatten(updates)
    layout = _layout([g.shape for g in grads], config)
    leaves_of = treedef.flatten_up_to
    decays = not (is_concrete_number(config.weight_decay) and config.weight_decay == 0)
    if decays and params is None:
        raise ValueError(
            "distributed_shampoo with weight_decay != 0 needs the params: call "
            "update(grads, state, params)"
        )
    weights = leaves_of(params) if params is not None else [None] * len(grads)
    check_state_matches(
        state,
        functools.partial(_init, config=config, constrain=False),
        params,
        updates,
        "distributed_shampoo",
    )
    step = state.count
    usable = gradients_are_usable(grads)

    with jax.named_scope("precond/shampoo/statistics"):
        if config.statistics_compute_steps == 1:
            statistics = _new_statistics(grads, state, layout, config)
        else:
            statistics = lax.cond(
                step % config.statistics_compute_steps == 0,
                lambda: _new_statistics(grads, state, layout, config),
                lambda: state.statistics,
            )
    with jax.named_scope("precond/shampoo/inverse_roots"):
        refresh = step % config.preconditioning_compute_steps == 0
        if config.preconditioning_compute_steps == 1:
            preconditioners, errors = _new_preconditioners(
                statistics, state, layout, config
            )
        else:
            preconditioners, errors = lax.cond(
                refresh,
                lambda: _new_preconditioners(statistics, state, layout, config),
                lambda: (
                    state.preconditioners,
                    tuple(
                        jnp.zeros(_load(s).shape[:1], jnp.float32) for s in statistics
                    ),
                ),
            )
        new_errors = None
        if config.generate_training_metrics:
            old_errors = leaves_of(state.training_metrics.inverse_pth_root_errors)
            new_errors = []
            for slots, old in zip(layout.slots, old_errors, strict=True):
                if not slots:
                    new_errors.append(old)
                    continue
                mine = jnp.concatenate(
                    [
                        errors[stack][first : first + rows]
                        for stack, first, rows in slots
                    ]
                )
                new_errors.append(jnp.where(refresh, mine, old))
        # Google's sharded mode preconditions with the stored roots and only
        # then computes the new ones (kept for the next step).
        used = state.preconditioners if config.uses_previous_roots else preconditioners
        roots = [_replicate(_load(p), config) for p in used]

    lr = config.learning_rate
    lr = lr(step) if callable(lr) else lr
    # Coupled learning rate (decoupled_learning_rate=False): lr scales the
    # directions before momentum; decoupled: it scales the result.
    inner_lr, outer_lr = (1.0, lr) if config.decoupled_learning_rate else (lr, 1.0)
    coupled_decay = decays and not config.decoupled_weight_decay
    beta1 = config.beta1
    w = (1.0 - beta1) if config.moving_average_for_momentum else 1.0
    running = step >= config.start_preconditioning_step
    outputs, momenta, diagonal_momenta, diagonals = [], [], [], []
    old_momenta = leaves_of(state.momentum)
    old_diagonal_momenta = leaves_of(state.diagonal_momentum)
    old_diagonals = leaves_of(state.diagonal_statistics)
    with jax.named_scope("precond/shampoo/direction"):
        for i, g in enumerate(grads):
            old_momentum = old_momenta[i]
            old_diagonal_momentum = old_diagonal_momenta[i]
            old_diagonal = old_diagonals[i]
            gf = g.astype(_state_float_dtype(g.dtype))
            graft, diagonal = _grafting_direction(gf, old_diagonal, config)
            graft = inner_lr * graft
            plan = layout.plans[i]
            if plan is None:
                direction = graft
            else:
                direction = _preconditioned(
                    gf, plan, layout.slots[i], roots, config.precision
                ).astype(gf.dtype)
            shampoo = direction * (jnp.linalg.norm(graft) / (_norm(direction) + 1e-16))
            if coupled_decay:
                shampoo = shampoo + config.weight_decay * weights[i]
                graft = graft + config.weight_decay * weights[i]
            momentum = beta1 * _load_momentum(old_momentum, g.shape) + w * shampoo
            if config.has_diagonal_momentum:
                graft_momentum = (
                    beta1 * _load_momentum(old_diagonal_momentum, g.shape) + w * graft
                )
            else:
                graft_momentum = (
                    beta1 * _load_momentum(old_momentum, g.shape) + w * graft
                )
            mixed_momentum = jnp.where(running, momentum, graft_momentum)
            mixed = jnp.where(running, shampoo, graft)
            v = (
                w * mixed + beta1 * mixed_momentum
                if config.nesterov
                else mixed_momentum
            )
            if decays and config.decoupled_weight_decay:
                # As Google's newer code: λ·lr·W, then the outer lr as well.
                v = v + lr * config.weight_decay * weights[i]
            outputs.append((-outer_lr * v).astype(g.dtype))
            if config.has_diagonal_momentum:
                momenta.append(_store_momentum(momentum, old_momentum))
                diagonal_momenta.append(
                    _store_momentum(graft_momentum, old_diagonal_momentum)
                )
            else:
                momenta.append(_store_momentum(mixed_momentum, old_momentum))
                diagonal_momenta.append(None)
            diagonals.append(
                None if old_diagonal is None else diagonal.astype(old_diagonal.dtype)
            )
    # The step is skipped (see the docstring) when the gradients are unusable.
    ok = usable
    outputs = [jnp.where(ok, u, jnp.zeros_like(u)) for u in outputs]

    unflatten = functools.partial(jax.tree.unflatten, treedef)
    new_state = ShampooState(
        count=optax.safe_int32_increment(step),
        momentum=unflatten(momenta),
        diagonal_momentum=unflatten(diagonal_momenta),
        diagonal_statistics=unflatten(diagonals),
        statistics=statistics,
        preconditioners=preconditioners,
        training_metrics=(
            optax.MaskedNode()
            if new_errors is None
            else TrainingMetrics(unflatten(new_errors))
        ),
    )
    # A skipped step leaves everything as it was (see the docstring).
    new_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
    return unflatten(outputs), new_state


def distributed_shampoo(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    block_size: int,
    beta1: float = 0.9,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    weight_decay: float = 0.0,
    start_preconditioning_step: int = 5,
    preconditioning_compute_steps: int = 1,
    statistics_compute_steps: int = 1,
    best_effort_shape_interpretation: bool = True,
    graft_type: GraftingType = GraftingType.SGD,
    nesterov: bool = True,
    exponent_override: int = 0,
    batch_axis_name: Any = None,
    statistics_partition_spec: PartitionSpec | None = None,
    preconditioner_partition_spec: PartitionSpec | None = None,
    num_devices_for_pjit: int | None = None,
    shard_optimizer_states: bool = False,
    best_effort_memory_usage_reduction: bool = False,
    inverse_failure_threshold: float = 0.1,
    moving_average_for_momentum: bool = False,
    skip_preconditioning_dim_size_gt: int = 4096,
    clip_by_scaled_gradient_norm: float | None = None,
    precision: lax.Precision = lax.Precision.HIGHEST,
    *,
    tensordot_precision: lax.Precision | None = None,
    relative_matrix_epsilon: bool = True,
    merge_small_dims_block_size: int | None = None,
    lobpcg_topk_precondition: int = 0,
    lobpcg_max_iter: int = 0,
    precondtioner_type: PreconditionerType = PreconditionerType.ALL,
    skip_preconditioning_rank_lt: int = 1,
    decoupled_learning_rate: bool = True,
    decoupled_weight_decay: bool = False,
    generate_training_metrics: bool = True,
    reuse_preconditioner: bool = False,
    eigh: bool = False,
    separate_grafting_momentum: bool = False,
    quantize_statistics: bool | None = None,
    sharded_init_fns: bool = True,
    precondition_with_previous_roots: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Distributed Shampoo (Anil et al. 2020), with Google's arguments and defaults.

    At step t (0-based), for each parameter W, gradient G, block b and axis k:

        S_{b,k} ← β2·S_{b,k} + (1−β2)·G_b ⋅_{¬k} G_b        if t % stat_steps = 0
        P_{b,k} ← (S_{b,k} + ε·λ_max·I)^{-1/p}               if t % precond_steps = 0
        u_s = P(G)·‖u_g‖/‖P(G)‖,  P(G)_b = G_b ×_0 P_{b,0} ×_1 P_{b,1} …
        m_s ← β1·m_s + w·(u_s + λW),  m_g ← β1·m_g + w·(u_g + λW)
        m, u = (m_s, u_s) if t >= start_preconditioning_step else (m_g, u_g)
        ΔW = −lr(t)·(w·u + β1·m if nesterov else m)

    with u_g the grafting method's step, p = 2·rank (``exponent_override``) and
    w = 1−β1 with ``moving_average_for_momentum`` else 1 (with
    ``shard_optimizer_states``, P(G) uses the P of step t − 1, as Google's sharded
    mode; see ``precondition_with_previous_roots``). S starts at ε·I and P
    at I. A root whose error max|P^p·(S+ε'I) − I| is NaN or >=
    ``inverse_failure_threshold`` is not used: the previous P stays, and the error
    shows in ``state.training_metrics.inverse_pth_root_errors``; a statistic
    that would overflow keeps its previous value too, and roots of statistics up
    to the dtype's largest value are computed on a power-of-two rescaling.

    Bad steps are skipped: when some gradient leaf has a squared norm ‖G‖² that
    is not finite in float32 (float64 for float64 leaves) -- NaN or ±Inf entries,
    or finite ones from about 1.8e19, whose squares would overflow the
    statistics -- the step returns zero updates and leaves the whole state
    unchanged (count included), as the PSGD optimizers do. The updates
    include −lr: add them to W.

    Parameters must be real floating-point arrays (complex and integer ones are
    refused at ``init``); scalars, empty tensors and tensors with a dim above
    ``skip_preconditioning_dim_size_gt`` take the grafting step alone. ``update``
    refuses, when it is traced, a state whose structure or shapes (and dtypes,
    when ``params`` are given) differ from what ``init`` gives for these
    parameters, e.g. another model's checkpoint, naming the first such leaf.

    Args:
        learning_rate: step size, or a schedule of the step count t.
        block_size: axes longer than this are cut into blocks of this size (the
            last one shorter); 0 keeps axes whole. Small adjacent dims are merged
            up to this size first (``best_effort_shape_interpretation``).
        beta1: momentum.
        beta2: EMA factor of the statistics (and of RMSProp grafting); 1 sums them.
        diagonal_epsilon: ε of AdaGrad/RMSProp grafting: G/(√D + ε).
        matrix_epsilon: relative ridge: roots of S + ε·max(λ_max(S), 1e-6)·I.
        weight_decay: λ, added to both directions before momentum (coupled).
        start_preconditioning_step: steps before this one use the grafting
            method alone (the statistics are still accumulated).
        preconditioning_compute_steps: recompute the roots every this many steps.
        statistics_compute_steps: update the statistics every this many steps.
        best_effort_shape_interpretation: merge small adjacent dims, e.g.
            (1, 2, 512, 1, 2048, 1, 3, 4) → (1024, 2048, 12) for block 1024.
        graft_type: a :class:`GraftingType`.
        nesterov: Nesterov momentum.
        exponent_override: p of the inverse roots if > 0, else 2·rank.
        batch_axis_name: the mapped axis name when this runs inside ``shard_map``
            or ``pmap`` data parallelism: the root computation is split over that
            axis and all-gathered. Gradients must already be averaged over it
            (``lax.pmean``), as with the optimizer this replaces.
        statistics_partition_spec: sharding of the stored (K, n, n) stacks of
            statistics and roots with ``shard_optimizer_states`` (ignored
            without it, as in Google's code).
        preconditioner_partition_spec: sharding of the stacks while their roots
            are computed: split the leading axis so each device computes its
            share, e.g. ``PartitionSpec('data', None, None)``. Needs an active mesh
            (``jax.set_mesh``) unless given as a ``NamedSharding``.
        num_devices_for_pjit: stacks are padded to a multiple of this (default:
            ``jax.device_count()``) when a partition spec is given.
        shard_optimizer_states: store the stacks sharded by
            ``statistics_partition_spec`` (defaults to the preconditioner spec).
        best_effort_memory_usage_reduction: momenta of rank > 1 parameters in int8,
            statistics and roots in int16 with their diagonals in float32 (per
            column scales; see ``quantize`` in ``_shampoo_math``), the int16
            part only with ``batch_axis_name`` as Google's (see
            ``quantize_statistics``).
        inverse_failure_threshold: roots with a larger error are rejected.
        moving_average_for_momentum: w = 1 − β1 instead of 1.
        skip_preconditioning_dim_size_gt: parameters with a dim larger than this
            (before merging and blocking), and scalars, use the grafting step.
        clip_by_scaled_gradient_norm: with RMSProp grafting, divide u_g by
            max(1, RMS(u_g)/clip).
        precision: ``lax.Precision`` of the matrix products (or 'default',
            'high', 'highest').
        tensordot_precision: precision of the statistics' products; None uses
            ``precision`` (Google's code uses the backend default for them).
        relative_matrix_epsilon: the ridge is ε·max(λ_max, 1e-6); False: ε.
        merge_small_dims_block_size: merge small dims up to this size; None
            (default) merges up to ``block_size`` as the seed revision does
            (Google's 0.0.6 defaults to 4096).
        lobpcg_topk_precondition: k > 0 deflates the k largest eigenpairs of each
            statistic (LOBPCG) before its Newton root and restores them after;
            statistics with at most 5k rows are rooted as they are.
        lobpcg_max_iter: LOBPCG iterations (0: k).
        precondtioner_type: a :class:`PreconditionerType` (Google's spelling):
            ALL axes, INPUT (all but the last) or OUTPUT (the last only); p is
            twice the number of preconditioned axes.
        skip_preconditioning_rank_lt: parameters of lower rank take the grafting
            step alone.
        decoupled_learning_rate: lr scales the final update (True, the seed's
            behaviour) or the directions before momentum (False).
        decoupled_weight_decay: add lr·λ·W after momentum (scaled by lr again
            when the learning rate is decoupled, as Google's code) instead of
            λ·W before it.
        generate_training_metrics: keep ``training_metrics`` (else it is an
            ``optax.MaskedNode``).
        reuse_preconditioner: accepted for Google's current code, where it hands
            each previous root to the inverse-root routine as a warm start that
            the routine then discards; results are the same either way, and
            precond computes every root from the statistic alone.
        eigh: compute roots by an eigendecomposition instead of coupled Newton.
        separate_grafting_momentum: with SQRT_N grafting, keep a grafting
            momentum of its own, as Google's 0.0.6 does (the seed shares one).
        quantize_statistics: store statistics and roots in int16 (with
            ``best_effort_memory_usage_reduction``); None: only with
            ``batch_axis_name``, where Google's code does.
        sharded_init_fns: with ``shard_optimizer_states``, ``init`` returns the
            seed's :class:`InitFnState` triple (ignoring its argument); False:
            ``init(params)`` returns the state itself.
        precondition_with_previous_roots: precondition step t with the roots
            computed at step t − 1 (and store step t's for the next step), as
            Google's sharded mode does; None (default): only with
            ``shard_optimizer_states``, as Google's code. False with
            ``shard_optimizer_states`` gives the same steps as unsharded.

    Returns:
        An optax ``GradientTransformationExtraArgs``; ``update(grads, state,
        params, **extra_args)`` needs ``params`` only when ``weight_decay`` is
        not 0 and ignores extra keyword arguments. Its state is a
        :class:`ShampooState`; :func:`distributed_shampoo_partition_specs` and
        :func:`distributed_shampoo_state_shapes` describe it for ``jit``;
        :func:`seed_parameter_stats` shows it in the seed's per-parameter
        layout and :func:`shampoo_state_from_seed` loads a state (checkpoint)
        written in that layout by Google's optimizer.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> import precond.jax as pj
        >>> opt = pj.distributed_shampoo(learning_rate=0.1, block_size=128)
        >>> params = {"w": jnp.ones((4, 3))}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, state, params)
        >>> params = optax.apply_updates(params, updates)
    """
    arguments = dict(locals())
    config = _validated(**arguments)

    def update(updates, state, params=None, **extra_args):
        del extra_args  # optax's GradientTransformationExtraArgs contract
        if not _sharded_in_types(updates):
            return _update(updates, state, params, config)
        # Gradients split over a mesh with Explicit axes (shardings in their
        # types): the step runs under auto_axes, which its reshapes and grams
        # need, and its outputs are sharded as its inputs.
        return with_auto_axes(
            lambda u, s, p: _update(u, s, p, config),
            (updates, state),
            updates,
            state,
            params,
        )

    init = functools.partial(_init, config=config)
    if config.shard_optimizer_states and config.sharded_init_fns:
        state_init = init
        plain = {**arguments, "sharded_init_fns": False}

        def pspec_fn(params, params_partition_spec, partition_spec_for_statistics=None):
            spec = partition_spec_for_statistics or config.statistics_partition_spec
            return distributed_shampoo_partition_specs(
                params,
                params_partition_spec,
                **{**plain, "statistics_partition_spec": spec},
            )

        def init(params):
            del params  # the seed's init_fn is called with anything
            return InitFnState(
                init_fn=state_init,
                pspec_fn=pspec_fn,
                shape_and_dtype_fn=functools.partial(
                    distributed_shampoo_state_shapes, **plain
                ),
            )

    return optax.GradientTransformationExtraArgs(init, update)


def distributed_shampoo_state_shapes(params, *args, **kwargs) -> ShampooState:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of the state that
    ``distributed_shampoo(*args, **kwargs).init(params)`` returns (params may be
    abstract); the seed's ``shape_and_dtype_fn``."""
    kwargs = {**kwargs, "sharded_init_fns": False}
    return jax.eval_shape(distributed_shampoo(*args, **kwargs).init, params)


def distributed_shampoo_partition_specs(
    params, params_partition_spec, *args, **kwargs
) -> ShampooState:
    """The ``PartitionSpec`` of every leaf of ``distributed_shampoo(*args,
    **kwargs).init(params)``: per-parameter buffers follow their parameter's spec
    (``params_partition_spec``, a tree like ``params``), the stacks follow
    ``statistics_partition_spec`` (replicated without one), the rest replicates.
    Use it for ``jax.jit(..., out_shardings=...)``; the seed's ``pspec_fn``.
    """
    bound = inspect.signature(distributed_shampoo).bind(*args, **kwargs)
    bound.apply_defaults()
    config = _validated(**bound.arguments)
    shapes = distributed_shampoo_state_shapes(params, *args, **kwargs)
    treedef = jax.tree.structure(params)
    param_specs = treedef.flatten_up_to(params_partition_spec)
    leaves = treedef.flatten_up_to(params)

    def full(spec, ndim):
        spec = tuple(spec or ())
        return spec + (None,) * (ndim - len(spec))

    def like_param(field):
        out = []
        for buffer, spec, p in zip(
            treedef.flatten_up_to(field), param_specs, leaves, strict=True
        ):
            spec = full(spec, len(p.shape))
            if buffer is None:
                out.append(None)
            elif _is_quantized(buffer):
                # Stored with the first axis at position -2 (_store_momentum).
                moved = (*spec[1:-1], spec[0], spec[-1]) if len(spec) > 2 else spec
                out.append(
                    QuantizedArray(
                        PartitionSpec(*moved), PartitionSpec(*spec[1:]), None
                    )
                )
            else:
                out.append(PartitionSpec(*spec))
        return jax.tree.unflatten(treedef, out)

    stack_spec = config.statistics_partition_spec
    if isinstance(stack_spec, jax.sharding.NamedSharding):
        stack_spec = stack_spec.spec
    stack_spec = PartitionSpec(*full(stack_spec, 3))

    def for_stack(stack):
        if not _is_quantized(stack):
            return stack_spec
        rows = PartitionSpec(stack_spec[0], None)
        return QuantizedArray(
            stack_spec, rows, None if stack.diagonal is None else rows
        )

    return ShampooState(
        count=PartitionSpec(),
        momentum=like_param(shapes.momentum),
        diagonal_momentum=like_param(shapes.diagonal_momentum),
        diagonal_statistics=like_param(shapes.diagonal_statistics),
        statistics=tuple(for_stack(s) for s in shapes.statistics),
        preconditioners=tuple(for_stack(s) for s in shapes.preconditioners),
        training_metrics=(
            TrainingMetrics(
                jax.tree.map(
                    lambda _: PartitionSpec(),
                    shapes.training_metrics.inverse_pth_root_errors,
                )
            )
            if config.generate_training_metrics
            else optax.MaskedNode()
        ),
    )


class ParameterStats(NamedTuple):
    """One parameter's state in the seed's per-parameter layout (a read-only
    view made by :func:`seed_parameter_stats`; arrays in float32)."""

    diagonal_statistics: Any  # like the param, or None
    statistics: list  # per block (row-major over the block grid), per axis: (n, n)
    preconditioners: list  # the same order: (n, n) inverse roots
    diagonal_momentum: Any  # like the param, or None (SQRT_N sharing)
    momentum: Any  # like the param
    training_metrics: Any  # TrainingMetrics of this parameter's statistics


class SeedShampooState(NamedTuple):
    """The seed's state layout: what :func:`shampoo_state_from_seed` reads.

    ``stats`` is a tree like the params of :class:`ParameterStats` (the seed's
    or 0.0.6's own objects, members possibly their ``QuantizedValue``), or the
    sharded mode's ``ShardedShampooStats(global_stats, local_stats)``.
    """

    count: Any  # [] int: steps taken
    stats: Any


def _bound_config(args, kwargs) -> _Config:
    bound = inspect.signature(distributed_shampoo).bind(*args, **kwargs)
    bound.apply_defaults()
    return _validated(**bound.arguments)


def _seed_order(plan: _ParameterPlan, slots, config: _Config):
    """(stack, row, position in the parameter's errors) of each statistic of a
    parameter, in the seed's order: blocks row-major over the parameter's whole
    block grid, and within a block its preconditioned axes in order."""
    segments = [_axis_segments(d, config.block_size) for d in plan.merged_shape]
    starts = [
        list(itertools.accumulate((n for _, n, _ in axis), initial=0))
        for axis in segments
    ]
    grid = tuple(axis_starts[-1] for axis_starts in starts)
    combos = list(itertools.product(*(range(len(a)) for a in segments)))
    entries = {}  # (global block index, axis) -> (stack, row, position)
    position = 0
    for (g, k), (stack, first, rows) in zip(plan.entries, slots, strict=True):
        group = plan.groups[g]
        for local in range(rows):
            coords = np.unravel_index(local, group.grid)
            block = int(
                np.ravel_multi_index(
                    tuple(
                        starts[a][combos[g][a]] + int(c) for a, c in enumerate(coords)
                    ),
                    grid,
                )
            )
            entries[block, k] = (stack, first + local, position + local)
        position += rows
    return [entries[key] for key in sorted(entries)]


def seed_parameter_stats(state: ShampooState, params, *args, **kwargs):
    """``state`` seen as the seed's ``ShampooState.stats``: a tree like ``params``
    of :class:`ParameterStats`, for code that reads the seed's per-parameter
    fields (``stats[name].statistics[i]``, ``.training_metrics`` …). ``args`` and
    ``kwargs`` are the ``distributed_shampoo`` arguments the state was made with.
    :func:`shampoo_state_from_seed` is the inverse.

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"w": jnp.ones((4, 3))}
        >>> state = distributed_shampoo(0.1, block_size=128).init(params)
        >>> stats = seed_parameter_stats(state, params, 0.1, block_size=128)
        >>> errors = stats["w"].training_metrics.inverse_pth_root_errors
    """
    config = _bound_config(args, kwargs)
    leaves, treedef = jax.tree.flatten(params)
    layout = _layout([p.shape for p in leaves], config)
    statistics = [_load(s) for s in state.statistics]
    roots = [_load(r) for r in state.preconditioners]
    flat = treedef.flatten_up_to
    momenta = flat(state.momentum)
    diagonal_momenta = flat(state.diagonal_momentum)
    diagonals = flat(state.diagonal_statistics)
    errors = (
        flat(state.training_metrics.inverse_pth_root_errors)
        if config.generate_training_metrics
        else [None] * len(leaves)
    )
    out = []
    for i, p in enumerate(leaves):
        plan = layout.plans[i]
        order = [] if plan is None else _seed_order(plan, layout.slots[i], config)
        metrics = None
        if errors[i] is not None:
            picked = [where for _, _, where in order] or [0]
            metrics = TrainingMetrics(errors[i][np.asarray(picked)])
        out.append(
            ParameterStats(
                diagonal_statistics=diagonals[i],
                statistics=[statistics[stack][row] for stack, row, _ in order],
                preconditioners=[roots[stack][row] for stack, row, _ in order],
                diagonal_momentum=None
                if diagonal_momenta[i] is None
                else _load_momentum(diagonal_momenta[i], p.shape),
                momentum=_load_momentum(momenta[i], p.shape),
                training_metrics=metrics,
            )
        )
    return jax.tree.unflatten(treedef, out)


def _seed_array(x):
    """A member of the seed's state as a float32 array, or None when absent
    (``None``, ``[]``, ``optax.MaskedNode``). A ``QuantizedValue`` (fields
    ``quantized``, ``diagonal``, ``bucket_size``, ``extract_diagonal``) is
    dequantized: quantized·bucket_size per column, plus diag(diagonal)."""
    if x is None or isinstance(x, optax.MaskedNode):
        return None
    if isinstance(x, list | tuple) and not x:
        return None
    if hasattr(x, "quantized") and hasattr(x, "bucket_size"):
        values = x.quantized
        if isinstance(values, list | tuple) and not values:
            return None
        values = jnp.asarray(values)
        if jnp.issubdtype(values.dtype, jnp.floating):
            return values.astype(jnp.float32)
        out = values.astype(jnp.float32) * jnp.asarray(x.bucket_size, jnp.float32)
        if getattr(x, "extract_diagonal", False):
            out = out + jnp.diag(jnp.asarray(x.diagonal, jnp.float32))
        return out
    return jnp.asarray(x, jnp.float32)


def _seed_entries(stats, treedef) -> list:
    """Per parameter, the seed's ``ParameterStats`` (or an equivalent built
    from the sharded mode's global stack and local stats)."""
    if hasattr(stats, "global_stats") and hasattr(stats, "local_stats"):
        stacked = stats.global_stats
        out = []
        for local in treedef.flatten_up_to(stats.local_stats):
            start = int(local.index_start)
            sizes = [int(n) for n in local.sizes]
            out.append(
                ParameterStats(
                    diagonal_statistics=local.diagonal_statistics,
                    statistics=[
                        stacked.statistics[start + j][:n, :n]
                        for j, n in enumerate(sizes)
                    ],
                    preconditioners=[
                        stacked.preconditioners[start + j][:n, :n]
                        for j, n in enumerate(sizes)
                    ],
                    diagonal_momentum=local.diagonal_momentum,
                    momentum=local.momentum,
                    training_metrics=local.training_metrics,
                )
            )
        return out
    return treedef.flatten_up_to(stats)


def shampoo_state_from_seed(seed_state, params, *args, **kwargs) -> ShampooState:
    """The :class:`ShampooState` holding what a state in the seed's layout holds:
    load a checkpoint written by Google's ``distributed_shampoo`` (the seed
    revision or optax-shampoo 0.0.6) into precond. The inverse of
    :func:`seed_parameter_stats`.

    ``seed_state`` has ``count`` and ``stats`` (the seed's ``ShampooState``, or
    :class:`SeedShampooState`): ``stats`` is a tree like ``params`` of
    ``ParameterStats(diagonal_statistics, statistics, preconditioners,
    diagonal_momentum, momentum, training_metrics)``, or with
    ``shard_optimizer_states`` the seed's ``ShardedShampooStats(global_stats,
    local_stats)``. Members may be the seed's ``QuantizedValue`` (memory mode):
    they are dequantized (values·bucket sizes per column, plus the diagonal) and
    stored as ``distributed_shampoo(*args, **kwargs)`` stores them (int8 momenta
    and int16 statistics requantize to the same integers). ``args`` and
    ``kwargs`` are the arguments precond's optimizer will run with (those the
    checkpoint was written with, plus 0.0.6's values where they differ, e.g.
    ``merge_small_dims_block_size=4096``): they fix which statistics each
    parameter has, and a checkpoint that does not fit them is refused naming
    the parameter. Only ``inverse_pth_root_errors`` of the training metrics is
    kept; with ``generate_training_metrics`` and none in the checkpoint it
    starts at 0.

    Example (``seed_state`` would come from a checkpoint of the seed, e.g.
    ``orbax_checkpointer.restore(path, item=google_state)``; here it is
    :func:`seed_parameter_stats` of a precond state):
        >>> import jax.numpy as jnp
        >>> params = {"w": jnp.ones((4, 3))}
        >>> opt = distributed_shampoo(0.1, block_size=128)
        >>> stats = seed_parameter_stats(opt.init(params), params, 0.1, block_size=128)
        >>> seed_state = SeedShampooState(count=jnp.zeros([], jnp.int32), stats=stats)
        >>> state = shampoo_state_from_seed(seed_state, params, 0.1, block_size=128)
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, state, params)
    """
    config = _bound_config(args, kwargs)
    count, stats = seed_state.count, seed_state.stats
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [p for _, p in paths_and_leaves]
    names = [jax.tree_util.keystr(path) or "params" for path, _ in paths_and_leaves]
    layout = _layout([p.shape for p in leaves], config)
    template = _init(params, config, constrain=False)
    entries = _seed_entries(stats, treedef)
    flat = treedef.flatten_up_to

    def refuse(i, what):
        raise ValueError(
            f"Invalid seed_state: {names[i]} (shape {tuple(leaves[i].shape)}) "
            f"{what}; it does not fit these distributed_shampoo arguments"
        )

    def like_param(i, x, field):
        value = _seed_array(x)
        if value is None:
            refuse(i, f"has no {field}")
        if value.shape != tuple(leaves[i].shape):
            refuse(i, f"has a {field} of shape {value.shape}")
        return value

    statistics = [_load(s) for s in template.statistics]
    roots = [_load(r) for r in template.preconditioners]
    placed = [([], [], []) for _ in statistics]  # rows, statistics, roots
    momenta, diagonal_momenta, diagonals, errors = [], [], [], []
    old_errors = (
        flat(template.training_metrics.inverse_pth_root_errors)
        if config.generate_training_metrics
        else None
    )
    zipped = zip(
        entries,
        flat(template.momentum),
        flat(template.diagonal_momentum),
        flat(template.diagonal_statistics),
        strict=True,
    )
    for i, (entry, momentum, diagonal_momentum, diagonal) in enumerate(zipped):
        plan = layout.plans[i]
        order = [] if plan is None else _seed_order(plan, layout.slots[i], config)
        given = list(entry.statistics or []), list(entry.preconditioners or [])
        if any(len(g) != len(order) for g in given):
            refuse(
                i,
                f"has {len(given[0])} statistics and {len(given[1])} "
                f"preconditioners where {len(order)} are expected",
            )
        for (stack, row, _), s, r in zip(order, *given, strict=True):
            n = statistics[stack].shape[-1]
            s, r = _seed_array(s), _seed_array(r)
            if s.shape != (n, n) or r.shape != (n, n):
                refuse(i, f"has a {s.shape} statistic where ({n}, {n}) is expected")
            placed[stack][0].append(row)
            placed[stack][1].append(s)
            placed[stack][2].append(r)
        momenta.append(
            _store_momentum(like_param(i, entry.momentum, "momentum"), momentum)
        )
        diagonal_momenta.append(
            None
            if diagonal_momentum is None
            else _store_momentum(
                like_param(i, entry.diagonal_momentum, "diagonal_momentum"),
                diagonal_momentum,
            )
        )
        diagonals.append(
            None
            if diagonal is None
            else like_param(i, entry.diagonal_statistics, "diagonal_statistics").astype(
                diagonal.dtype
            )
        )
        if old_errors is not None:
            metrics = entry.training_metrics
            seed_errors = _seed_array(getattr(metrics, "inverse_pth_root_errors", None))
            out = old_errors[i]
            if seed_errors is not None and order:
                where = np.asarray([position for _, _, position in order])
                out = out.at[where].set(seed_errors.reshape(-1)[: len(order)])
            errors.append(out)

    def filled(stacks, which, like):
        out = []
        for stack, rows, old in zip(stacks, placed, like, strict=True):
            if rows[0]:
                values = jnp.stack(rows[which]).astype(stack.dtype)
                stack = stack.at[np.asarray(rows[0])].set(values)
            out.append(_store(stack, old))
        return tuple(out)

    unflatten = functools.partial(jax.tree.unflatten, treedef)
    return ShampooState(
        count=jnp.asarray(count, jnp.int32),
        momentum=unflatten(momenta),
        diagonal_momentum=unflatten(diagonal_momenta),
        diagonal_statistics=unflatten(diagonals),
        statistics=filled(statistics, 1, template.statistics),
        preconditioners=filled(roots, 2, template.preconditioners),
        training_metrics=(
            TrainingMetrics(unflatten(errors))
            if config.generate_training_metrics
            else optax.MaskedNode()
        ),
    )
