"""Shampoo's state: its containers, how its arrays are stored and sharded, init.

Per-parameter buffers are trees like the params; statistics and roots are
(K, n, n) stacks (see ``shampoo._layout``). In memory mode momenta are int8 and
stacks int16 (:class:`~precond.jax.shampoo._math.QuantizedArray`): :func:`load`
and :func:`store` convert. Stacks may be split over devices by their rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec

from precond.jax._core.guards import check_parameter_dtypes
from precond.jax._core.mesh_placement import explicit_specs
from precond.jax.shampoo._config import Config
from precond.jax.shampoo._layout import Layout, padded_rows, plan_layout
from precond.jax.shampoo._math import QuantizedArray, dequantize, quantize


class TrainingMetrics(NamedTuple):
    """What the optimizer reports about itself; a field of :class:`ShampooState`.

    Attributes:
        inverse_pth_root_errors: per parameter, float32 (max(statistics, 1),): the error
            max|H^p·A − I| of each statistic's latest inverse root (NaN or >=
            ``inverse_failure_threshold``: the root failed and the previous one was
            kept).
    """

    # Per parameter: (max(statistics, 1),) float32, max|H^p·A − I| of each
    # statistic's latest inverse root (NaN or >= inverse_failure_threshold: the
    # root failed and the previous preconditioner was kept).
    inverse_pth_root_errors: Any


class InitFnState(NamedTuple):
    """What ``init`` returns with ``shard_optimizer_states`` (the seed's triple):
    ``init_fn(params)`` gives the state, ``pspec_fn(params, params_partition_spec,
    partition_spec_for_statistics=None)`` its partition specs (for
    ``jax.jit(init_fn, out_shardings=...)``) and ``shape_and_dtype_fn(params)``
    its shapes and dtypes.

    Attributes:
        init_fn: ``init_fn(params)``: the state.
        pspec_fn: ``pspec_fn(params, params_partition_spec,
            partition_spec_for_statistics=None)``: the state's partition specs.
        shape_and_dtype_fn: ``shape_and_dtype_fn(params)``: the state's shapes and
            dtypes.
    """

    init_fn: Callable
    pspec_fn: Callable
    shape_and_dtype_fn: Callable


class ShampooState(NamedTuple):
    """State of ``distributed_shampoo`` and ``scale_by_shampoo`` (the same).

    Per-parameter fields are trees like the params (``None`` where a grafting
    type has no such buffer); the statistics of all parameters are stacked.

    Attributes:
        count: int32 scalar: the steps taken.
        momentum: like the params, float32 (an int8 :class:`QuantizedArray` in memory
            mode).
        diagonal_momentum: like the params: the grafting momentum (None for SQRT_N).
        diagonal_statistics: like the params: the AdaGrad/RMSProp accumulator, or None.
        statistics: per (n, p) stack: (K, n, n) moving averages of the grams.
        preconditioners: per (n, p) stack: (K, n, n) inverse p-th roots.
        training_metrics: a :class:`TrainingMetrics`, or ``optax.MaskedNode()`` without
            ``generate_training_metrics``.
        skipped: int32 scalar: the steps skipped for unusable gradients.
    """

    count: jax.Array  # [] int32: steps taken
    momentum: Any  # like params, float32 (int8 QuantizedArray in memory mode)
    diagonal_momentum: Any  # like params: grafting momentum (None for SQRT_N)
    diagonal_statistics: Any  # like params: AdaGrad/RMSProp accumulator, or None
    statistics: tuple  # per (n, p) stack: (K, n, n) gram EMAs
    preconditioners: tuple  # per (n, p) stack: (K, n, n) inverse p-th roots
    # optax.MaskedNode() without generate_training_metrics
    training_metrics: TrainingMetrics | optax.MaskedNode
    skipped: jax.Array  # [] int32: steps skipped (unusable gradients)


def root_errors(metrics: TrainingMetrics | optax.MaskedNode) -> Any:
    """``metrics.inverse_pth_root_errors``, of a state made with
    ``generate_training_metrics`` (else its metrics are a ``MaskedNode``)."""
    assert isinstance(metrics, TrainingMetrics)
    return metrics.inverse_pth_root_errors


# ------------------------------------------------------------------ stored arrays


def load(x) -> jax.Array:
    return dequantize(x) if isinstance(x, QuantizedArray) else x


def store(x: jax.Array, like):
    """``x`` in the storage format of ``like`` (quantized or a float dtype)."""
    if isinstance(like, QuantizedArray):
        return quantize(
            x, like.values.dtype, extract_diagonal=like.diagonal is not None
        )
    return x.astype(like.dtype)


def load_momentum(x, shape) -> jax.Array:
    """A momentum buffer as a float array of its parameter's ``shape``."""
    if not isinstance(x, QuantizedArray):
        return x
    return jnp.moveaxis(dequantize(x), -2, 0) if len(shape) > 2 else dequantize(x)


def store_momentum(x: jax.Array, like):
    """``x`` stored like ``like``. int8 momenta are quantized with one scale per
    slice along the first axis (as Google's code): for rank > 2 the first axis is
    moved to position -2, where :func:`quantize` takes its column maxima."""
    if not isinstance(like, QuantizedArray):
        return x.astype(like.dtype)
    if x.ndim > 2:
        x = jnp.moveaxis(x, 0, -2)
    return quantize(x, like.values.dtype)


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def sharded_in_types(tree) -> bool:
    """Some leaf of ``tree`` is split over a mesh with Explicit axes."""
    specs = explicit_specs(tree)
    return specs is not None and any(
        any(axis is not None for axis in spec)
        for spec in jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
    )


def explicit_axes(spec) -> bool:
    """Whether ``spec`` lives on a mesh whose axes are ``AxisType.Explicit``
    (sharding in types), where a sharding change must be a ``reshard``."""
    mesh = (
        spec.mesh
        if isinstance(spec, jax.sharding.NamedSharding)
        else jax.sharding.get_abstract_mesh()
    )
    types = getattr(mesh, "axis_types", ()) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def with_sharding(x: jax.Array, spec) -> jax.Array:
    """``x`` laid out by ``spec``: a constraint on auto meshes, a reshard on
    explicit ones (where a constraint only asserts)."""
    if explicit_axes(spec):
        return jax.sharding.reshard(x, spec)
    return lax.with_sharding_constraint(x, spec)


@overload
def constrain_stack(x: jax.Array, spec) -> jax.Array: ...
@overload
def constrain_stack(x: QuantizedArray, spec) -> QuantizedArray: ...
def constrain_stack(x, spec):
    """``x`` (a (K, n, n) stack, maybe quantized) constrained to ``spec``."""
    if spec is None:
        return x
    if not isinstance(x, QuantizedArray):
        return with_sharding(x, spec)
    if isinstance(spec, jax.sharding.NamedSharding):
        row_spec = jax.sharding.NamedSharding(spec.mesh, PartitionSpec(*spec.spec[:1]))
    elif isinstance(spec, PartitionSpec):
        row_spec = PartitionSpec(*spec[:1])
    else:
        row_spec = spec
    return QuantizedArray(
        with_sharding(x.values, spec),
        with_sharding(x.scales, row_spec),
        None if x.diagonal is None else with_sharding(x.diagonal, row_spec),
    )


def replicate(x: jax.Array, config: Config) -> jax.Array:
    """``x`` on every device, when the stacks are split (an explicit all-gather,
    so that XLA does not propagate the split into the per-parameter math)."""
    spec = config.preconditioner_partition_spec or config.statistics_partition_spec
    if spec is None:
        return x
    if isinstance(spec, jax.sharding.NamedSharding):
        return with_sharding(x, jax.sharding.NamedSharding(spec.mesh, PartitionSpec()))
    return with_sharding(x, PartitionSpec())


def state_float_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


# ------------------------------------------------------------------ init


class _NotParams:
    """Marks, in :func:`_params_placeholder_state`, a field that is not shaped
    like the params (a leaf, so it prefixes the field's whole subtree)."""


def _is_params_placeholder(params) -> bool:
    """optax.tree.map_params calls ``init`` with a leafless placeholder object."""
    return type(params).__name__ == "_ParamsPlaceholder" and not jax.tree.leaves(params)


def _params_placeholder_state(placeholder, config: Config) -> ShampooState:
    """The state's structure with ``placeholder`` where trees like the params
    are, for ``optax.tree.map_params``."""
    # A tree shaped like a state, not a state: its leaves are not arrays.
    return ShampooState(
        count=_NotParams(),  # pyright: ignore[reportArgumentType]
        momentum=placeholder,
        diagonal_momentum=placeholder if config.has_diagonal_momentum else _NotParams(),
        diagonal_statistics=(
            placeholder if config.has_diagonal_statistics else _NotParams()
        ),
        statistics=_NotParams(),  # pyright: ignore[reportArgumentType]
        preconditioners=_NotParams(),  # pyright: ignore[reportArgumentType]
        training_metrics=_NotParams(),  # pyright: ignore[reportArgumentType]
        skipped=_NotParams(),  # pyright: ignore[reportArgumentType]
    )


def init_state(params, config: Config, *, constrain: bool = True) -> ShampooState:
    """The state before step 0: momenta and diagonal statistics at 0, every
    statistic at ε·I and every root at I (padding rows at I), errors at 0.
    ``constrain=False`` leaves the stacks unconstrained (for ``jax.eval_shape``
    in ``check_state_matches``: no mesh needed)."""
    if _is_params_placeholder(params):
        return _params_placeholder_state(params, config)
    check_parameter_dtypes(params, "distributed_shampoo", complex_ok=False)
    leaves, treedef = jax.tree.flatten(params)
    layout = plan_layout([p.shape for p in leaves], config)
    float_dtypes = [state_float_dtype(p.dtype) for p in leaves]
    quantized = config.best_effort_memory_usage_reduction
    momentum = [
        _zero_momentum(p, d, quantized)
        for p, d in zip(leaves, float_dtypes, strict=True)
    ]
    diagonal_momentum = [
        _zero_momentum(p, d, quantized) if config.has_diagonal_momentum else None
        for p, d in zip(leaves, float_dtypes, strict=True)
    ]
    diagonal_statistics = [
        jnp.zeros(p.shape, d) if config.has_diagonal_statistics else None
        for p, d in zip(leaves, float_dtypes, strict=True)
    ]
    statistics, preconditioners = _initial_stacks(
        layout,
        config,
        jnp.result_type(jnp.float32, *float_dtypes),
        config.statistics_partition_spec if constrain else None,
    )
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
        statistics=statistics,
        preconditioners=preconditioners,
        training_metrics=(
            TrainingMetrics(unflatten(errors))
            if config.generate_training_metrics
            else optax.MaskedNode()
        ),
        skipped=jnp.zeros([], jnp.int32),
    )


def _zero_momentum(p, dtype, quantized: bool):
    """A zero momentum buffer for ``p``: int8 (memory mode, rank > 1) or float."""
    zeros = jnp.zeros(p.shape, dtype)
    if quantized and p.ndim > 1 and p.size:
        return store_momentum(zeros, quantize(zeros[:1, :1], jnp.int8))
    return zeros


def _initial_stacks(layout: Layout, config: Config, dtype, spec):
    """(statistics, roots): per stack, (K, n, n) ε·I (real rows; I for padding
    rows) and I, int16 when the statistics are quantized, laid out by ``spec``."""
    statistics, preconditioners = [], []
    for (n, _), rows in zip(layout.keys, layout.rows, strict=True):
        total = padded_rows(rows, config.stack_multiple)
        eye = jnp.broadcast_to(jnp.eye(n, dtype=dtype), (total, n, n))
        real = (jnp.arange(total) < rows)[:, None, None]
        stats = jnp.where(real, config.matrix_epsilon * eye, eye).astype(dtype)
        if config.statistics_quantized:
            stats = quantize(stats, jnp.int16, extract_diagonal=True)
            eye = quantize(eye, jnp.int16, extract_diagonal=True)
        statistics.append(constrain_stack(stats, spec))
        preconditioners.append(constrain_stack(eye, spec))
    return tuple(statistics), tuple(preconditioners)


def state_partition_specs(
    shapes: ShampooState, params, params_partition_spec, config: Config
) -> ShampooState:
    """The ``PartitionSpec`` of every leaf of a state of shapes ``shapes``:
    per-parameter buffers follow their parameter's spec (``params_partition_spec``,
    a tree like ``params``), the stacks follow ``statistics_partition_spec``
    (replicated without one), the rest replicates."""
    treedef = jax.tree.structure(params)
    param_specs = treedef.flatten_up_to(params_partition_spec)
    leaves = treedef.flatten_up_to(params)

    def like_param(field):
        buffers = treedef.flatten_up_to(field)
        return jax.tree.unflatten(
            treedef,
            [
                buffer_spec(b, full_spec(spec, len(p.shape)))
                for b, spec, p in zip(buffers, param_specs, leaves, strict=True)
            ],
        )

    stack_spec = config.statistics_partition_spec
    if isinstance(stack_spec, jax.sharding.NamedSharding):
        stack_spec = stack_spec.spec
    stack_spec = PartitionSpec(*full_spec(stack_spec, 3))
    # A tree shaped like a state whose leaves are specs, not arrays.
    return ShampooState(
        count=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        momentum=like_param(shapes.momentum),
        diagonal_momentum=like_param(shapes.diagonal_momentum),
        diagonal_statistics=like_param(shapes.diagonal_statistics),
        statistics=tuple(_stack_spec(s, stack_spec) for s in shapes.statistics),
        preconditioners=tuple(
            _stack_spec(s, stack_spec) for s in shapes.preconditioners
        ),
        training_metrics=(
            TrainingMetrics(
                jax.tree.map(
                    lambda _: PartitionSpec(),
                    root_errors(shapes.training_metrics),
                )
            )
            if config.generate_training_metrics
            else optax.MaskedNode()
        ),
        skipped=PartitionSpec(),  # pyright: ignore[reportArgumentType]
    )


def full_spec(spec, ndim: int) -> tuple:
    """``spec`` as a tuple of ``ndim`` entries (None for the unnamed ones)."""
    spec = tuple(spec or ())
    return spec + (None,) * (ndim - len(spec))


def buffer_spec(buffer, spec: tuple):
    """The spec of a per-parameter buffer whose parameter has ``spec``."""
    if buffer is None:
        return None
    if not is_quantized(buffer):
        return PartitionSpec(*spec)
    # Stored with the first axis at position -2 (store_momentum).
    moved = (*spec[1:-1], spec[0], spec[-1]) if len(spec) > 2 else spec
    # Specs in place of the arrays.
    values, scales = PartitionSpec(*moved), PartitionSpec(*spec[1:])
    return QuantizedArray(values, scales, None)  # pyright: ignore[reportArgumentType]


def _stack_spec(stack, spec: PartitionSpec):
    """The spec of a (K, n, n) stack (its rows' spec for a quantized one's
    scales and diagonal)."""
    if not is_quantized(stack):
        return spec
    rows = PartitionSpec(spec[0], None)
    diagonal = None if stack.diagonal is None else rows
    return QuantizedArray(spec, rows, diagonal)  # pyright: ignore[reportArgumentType]  # specs in place of arrays
