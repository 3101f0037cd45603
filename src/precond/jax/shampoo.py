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
    "ShampooState",
    "TrainingMetrics",
    "distributed_shampoo",
    "distributed_shampoo_partition_specs",
    "distributed_shampoo_state_shapes",
]


class GraftingType(enum.IntEnum):
    """The first-order method whose step size per parameter Shampoo borrows."""

    SGD = 1
    ADAGRAD = 2
    RMSPROP = 3
    RMSPROP_NORMALIZED = 4
    SQRT_N = 5  # sign(G): every entry moves by 1 (norm √n)
    ADAGRAD_NORMALIZED = 6


class TrainingMetrics(NamedTuple):
    """What the optimizer reports about itself; a field of :class:`ShampooState`."""

    # Per parameter: (max(statistics, 1),) float32, max|H^p·A − I| of each
    # statistic's latest inverse root (NaN or >= inverse_failure_threshold: the
    # root failed and the previous preconditioner was kept).
    inverse_pth_root_errors: Any


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
    "eigh",
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
    eigh: bool

    @property
    def has_diagonal_statistics(self) -> bool:
        return self.graft_type not in (GraftingType.SGD, GraftingType.SQRT_N)

    @property
    def has_diagonal_momentum(self) -> bool:
        return self.graft_type != GraftingType.SQRT_N

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
    "eigh": check_bool,
}


def _validated(**args) -> _Config:
    for name, check in _ARGUMENT_CHECKS.items():
        check(name, args[name])
    args["graft_type"] = GraftingType(args["graft_type"])
    if isinstance(args["precision"], str):
        args["precision"] = _PRECISIONS[args["precision"].lower()]
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

    @property
    def entries(self) -> list[tuple[int, int]]:
        """(group, axis) of each statistic entry, in state order."""
        return [
            (g, k)
            for g, group in enumerate(self.groups)
            for k in range(len(group.block_shape))
        ]


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
        len(shape) < 1
        or math.prod(shape) == 0
        or max(shape) > config.skip_preconditioning_dim_size_gt
    ):
        return None
    merged = (
        merge_small_dims(shape, config.block_size)
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
    exponent = config.exponent_override or 2 * len(merged)
    return _ParameterPlan(merged, groups, exponent)


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
            (group.block_shape[k], plan.exponent)
            for plan in plans
            if plan is not None
            for group in plan.groups
            for k in range(len(group.block_shape))
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


def _block_grams(blocks: jax.Array, precision) -> list[jax.Array]:
    """Per axis k: (count, n_k, n_k) = Σ over all other axes of G_b·G_bᵀ."""
    letters = _letters(blocks.ndim - 1)
    grams = []
    for a in letters:
        other = letters.replace(a, "A")
        spec = f"z{letters},z{other}->z{a}A"
        grams.append(jnp.einsum(spec, blocks, blocks, precision=precision))
    return grams


def _precondition_blocks(
    blocks: jax.Array, roots: list[jax.Array], precision
) -> jax.Array:
    """G_b ×_0 P_0 ×_1 P_1 …: every axis a of the block contracted with P's rows."""
    letters = _letters(blocks.ndim - 1)
    for a, root in zip(letters, roots, strict=True):
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


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def _constrain(x, spec):
    """``x`` (a (K, n, n) stack, maybe quantized) constrained to ``spec``."""
    if spec is None:
        return x
    if not isinstance(x, QuantizedArray):
        return lax.with_sharding_constraint(x, spec)
    if isinstance(spec, jax.sharding.NamedSharding):
        row_spec = jax.sharding.NamedSharding(spec.mesh, PartitionSpec(*spec.spec[:1]))
    elif isinstance(spec, PartitionSpec):
        row_spec = PartitionSpec(*spec[:1])
    else:
        row_spec = spec
    return QuantizedArray(
        lax.with_sharding_constraint(x.values, spec),
        lax.with_sharding_constraint(x.scales, row_spec),
        None
        if x.diagonal is None
        else lax.with_sharding_constraint(x.diagonal, row_spec),
    )


def _replicate(x: jax.Array, config: _Config) -> jax.Array:
    """``x`` on every device, when the stacks are split (an explicit all-gather,
    so that XLA does not propagate the split into the per-parameter math)."""
    spec = config.preconditioner_partition_spec or config.statistics_partition_spec
    if spec is None:
        return x
    if isinstance(spec, jax.sharding.NamedSharding):
        return lax.with_sharding_constraint(
            x, jax.sharding.NamedSharding(spec.mesh, PartitionSpec())
        )
    return lax.with_sharding_constraint(x, PartitionSpec())


def _state_float_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


# ------------------------------------------------------------------ the transform


def _init(params, config: _Config, *, constrain: bool = True) -> ShampooState:
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
            return quantize(zeros, jnp.int8)
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
        if memory_mode:
            stats = quantize(stats, jnp.int16, extract_diagonal=True)
            eye = quantize(eye, jnp.int16, extract_diagonal=True)
        statistics.append(_constrain(stats, spec))
        preconditioners.append(_constrain(eye, spec))
    errors = [
        jnp.zeros((max(sum(r for _, _, r in slots), 1),), jnp.float32)
        for slots in layout.slots
    ]
    unflatten = functools.partial(jax.tree.unflatten, treedef)
    return ShampooState(
        count=jnp.zeros([], jnp.int32),
        momentum=unflatten(momentum),
        diagonal_momentum=unflatten(diagonal_momentum),
        diagonal_statistics=unflatten(diagonal_statistics),
        statistics=tuple(statistics),
        preconditioners=tuple(preconditioners),
        training_metrics=TrainingMetrics(unflatten(errors)),
    )


def _stack_roots(stack: jax.Array, p: int, config: _Config):
    """Inverse p-th roots and errors of a (K, n, n) stack, spread over devices.

    With ``batch_axis_name`` (inside shard_map/pmap) each device computes one
    contiguous share of the rows and an all-gather reassembles them; with a
    ``preconditioner_partition_spec`` the stack is split along its rows and XLA's
    partitioner gives each device its share.
    """
    if config.eigh:
        root = functools.partial(matrix_inverse_pth_root_eigh, p=p)
    else:
        root = functools.partial(matrix_inverse_pth_root, p=p)
    roots_of = jax.vmap(
        functools.partial(
            root, ridge_epsilon=config.matrix_epsilon, precision=config.precision
        )
    )
    if config.batch_axis_name is None:
        stack = _constrain(stack, config.preconditioner_partition_spec)
        roots, errors = roots_of(stack)
        return _constrain(roots, config.preconditioner_partition_spec), errors
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
            _block_grams(_to_blocks(x, group), config.precision)
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
    for (_, p), stats, old in zip(
        layout.keys, statistics, state.preconditioners, strict=True
    ):
        new, error = _stack_roots(_load(stats), p, config)
        usable = jnp.isfinite(error) & (error < config.inverse_failure_threshold)
        usable = usable & jnp.all(jnp.isfinite(new), axis=(1, 2))
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
        blocks.append(_precondition_blocks(_to_blocks(x, group), factors, precision))
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
        old_errors = leaves_of(state.training_metrics.inverse_pth_root_errors)
        new_errors = []
        for slots, old in zip(layout.slots, old_errors, strict=True):
            if not slots:
                new_errors.append(old)
                continue
            mine = jnp.concatenate(
                [errors[stack][first : first + rows] for stack, first, rows in slots]
            )
            new_errors.append(jnp.where(refresh, mine, old))
        roots = [_replicate(_load(p), config) for p in preconditioners]

    lr = config.learning_rate
    lr = lr(step) if callable(lr) else lr
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
            plan = layout.plans[i]
            if plan is None:
                direction = graft
            else:
                direction = _preconditioned(
                    gf, plan, layout.slots[i], roots, config.precision
                ).astype(gf.dtype)
            shampoo = direction * (jnp.linalg.norm(graft) / (_norm(direction) + 1e-16))
            if decays:
                shampoo = shampoo + config.weight_decay * weights[i]
                graft = graft + config.weight_decay * weights[i]
            momentum = beta1 * _load(old_momentum) + w * shampoo
            if config.has_diagonal_momentum:
                graft_momentum = beta1 * _load(old_diagonal_momentum) + w * graft
            else:
                graft_momentum = beta1 * _load(old_momentum) + w * graft
            mixed_momentum = jnp.where(running, momentum, graft_momentum)
            mixed = jnp.where(running, shampoo, graft)
            v = (
                w * mixed + beta1 * mixed_momentum
                if config.nesterov
                else mixed_momentum
            )
            outputs.append((-lr * v).astype(g.dtype))
            if config.has_diagonal_momentum:
                momenta.append(_store(momentum, old_momentum))
                diagonal_momenta.append(_store(graft_momentum, old_diagonal_momentum))
            else:
                momenta.append(_store(mixed_momentum, old_momentum))
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
        training_metrics=TrainingMetrics(unflatten(new_errors)),
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
    eigh: bool = False,
) -> optax.GradientTransformation:
    """Distributed Shampoo (Anil et al. 2020), with Google's arguments and defaults.

    At step t (0-based), for each parameter W, gradient G, block b and axis k:

        S_{b,k} ← β2·S_{b,k} + (1−β2)·G_b ⋅_{¬k} G_b        if t % stat_steps = 0
        P_{b,k} ← (S_{b,k} + ε·λ_max·I)^{-1/p}               if t % precond_steps = 0
        u_s = P(G)·‖u_g‖/‖P(G)‖,  P(G)_b = G_b ×_0 P_{b,0} ×_1 P_{b,1} …
        m_s ← β1·m_s + w·(u_s + λW),  m_g ← β1·m_g + w·(u_g + λW)
        m, u = (m_s, u_s) if t >= start_preconditioning_step else (m_g, u_g)
        ΔW = −lr(t)·(w·u + β1·m if nesterov else m)

    with u_g the grafting method's step, p = 2·rank (``exponent_override``) and
    w = 1−β1 with ``moving_average_for_momentum`` else 1. S starts at ε·I and P
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
            statistics and roots (with ``shard_optimizer_states``).
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
            column scales; see ``quantize`` in ``_shampoo_math``). Google applies
            the int16 part only in pmap mode; precond applies it in every mode.
        inverse_failure_threshold: roots with a larger error are rejected.
        moving_average_for_momentum: w = 1 − β1 instead of 1.
        skip_preconditioning_dim_size_gt: parameters with a dim larger than this
            (before merging and blocking), and scalars, use the grafting step.
        clip_by_scaled_gradient_norm: with RMSProp grafting, divide u_g by
            max(1, RMS(u_g)/clip).
        precision: ``lax.Precision`` of the matrix products (or 'default',
            'high', 'highest').
        eigh: compute roots by an eigendecomposition instead of coupled Newton.

    Returns:
        An optax ``GradientTransformation``; ``update(grads, state, params)``
        needs ``params`` only when ``weight_decay`` is not 0. Its state is a
        :class:`ShampooState`; :func:`distributed_shampoo_partition_specs` and
        :func:`distributed_shampoo_state_shapes` describe it for ``jit``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> import precond.jax as pj
        >>> opt = pj.distributed_shampoo(learning_rate=0.1, block_size=128)
        >>> params = {"w": jnp.ones((4, 3))}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, state, params)
        >>> params = optax.apply_updates(params, updates)
    """
    config = _validated(**locals())
    return optax.GradientTransformation(
        functools.partial(_init, config=config),
        lambda updates, state, params=None: _update(updates, state, params, config),
    )


def distributed_shampoo_state_shapes(params, *args, **kwargs) -> ShampooState:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of the state that
    ``distributed_shampoo(*args, **kwargs).init(params)`` returns (params may be
    abstract); the seed's ``shape_and_dtype_fn``."""
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
                out.append(
                    QuantizedArray(
                        PartitionSpec(*spec), PartitionSpec(*spec[:-2], spec[-1]), None
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
        training_metrics=TrainingMetrics(
            jax.tree.map(
                lambda _: PartitionSpec(),
                shapes.training_metrics.inverse_pth_root_errors,
            )
        ),
    )
