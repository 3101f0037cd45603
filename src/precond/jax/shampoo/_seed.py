"""Shampoo's state in the seed's per-parameter layout, both ways.

Google's ``distributed_shampoo`` keeps one ``ParameterStats`` per parameter
(its statistics as lists in block-major order); precond stacks them. The
view :func:`parameter_stats_view` and the loader :func:`state_from_seed`
(checkpoints of the seed or of optax-shampoo 0.0.6) map one to the other.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precond.jax.shampoo._config import Config
from precond.jax.shampoo._layout import ParameterPlan, axis_segments, plan_layout
from precond.jax.shampoo._state import (
    ShampooState,
    TrainingMetrics,
    init_state,
    load,
    load_momentum,
    root_errors,
    store,
    store_momentum,
)


class ParameterStats(NamedTuple):
    """One parameter's state in the seed's per-parameter layout (a read-only
    view made by ``seed_parameter_stats``; arrays in float32).

    Attributes:
        diagonal_statistics: like the parameter, or None.
        statistics: per block (row-major over the block grid), per axis: (n, n).
        preconditioners: the inverse roots, in the same order: (n, n).
        diagonal_momentum: like the parameter, or None (SQRT_N shares the momentum).
        momentum: like the parameter.
        training_metrics: the :class:`TrainingMetrics` of this parameter's statistics.
    """

    diagonal_statistics: Any  # like the param, or None
    statistics: list  # per block (row-major over the block grid), per axis: (n, n)
    preconditioners: list  # the same order: (n, n) inverse roots
    diagonal_momentum: Any  # like the param, or None (SQRT_N sharing)
    momentum: Any  # like the param
    training_metrics: Any  # TrainingMetrics of this parameter's statistics


class SeedShampooState(NamedTuple):
    """The seed's state layout: what ``shampoo_state_from_seed`` reads.

    ``stats`` is a tree like the params of :class:`ParameterStats` (the seed's
    or 0.0.6's own objects, members possibly their ``QuantizedValue``), or the
    sharded mode's ``ShardedShampooStats(global_stats, local_stats)``.

    Attributes:
        count: integer scalar: the steps taken.
        stats: a tree like the params of :class:`ParameterStats`, or the sharded mode's
            ``ShardedShampooStats``.
    """

    count: Any  # [] int: steps taken
    stats: Any


def _seed_order(plan: ParameterPlan, slots, config: Config):
    """(stack, row, position in the parameter's errors) of each statistic of a
    parameter, in the seed's order: blocks row-major over the parameter's whole
    block grid, and within a block its preconditioned axes in order."""
    segments = [axis_segments(d, config.block_size) for d in plan.merged_shape]
    starts = [
        list(itertools.accumulate((segment.count for segment in axis), initial=0))
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


def parameter_stats_view(state: ShampooState, params, config: Config):
    """``state`` as a tree like ``params`` of :class:`ParameterStats`, each
    statistic and root at its place in the seed's order (see :func:`_seed_order`)."""
    leaves, treedef = jax.tree.flatten(params)
    layout = plan_layout([p.shape for p in leaves], config)
    statistics = [load(s) for s in state.statistics]
    roots = [load(r) for r in state.preconditioners]
    flat = treedef.flatten_up_to
    momenta = flat(state.momentum)
    diagonal_momenta = flat(state.diagonal_momentum)
    diagonals = flat(state.diagonal_statistics)
    errors = (
        flat(root_errors(state.training_metrics))
        if config.generate_training_metrics
        else [None] * len(leaves)
    )
    out = []
    for i, p in enumerate(leaves):
        plan = layout.plans[i]
        order = [] if plan is None else _seed_order(plan, layout.slots[i], config)
        metrics, error = None, errors[i]
        if error is not None:
            picked = [where for _, _, where in order] or [0]
            metrics = TrainingMetrics(error[np.asarray(picked)])
        out.append(
            ParameterStats(
                diagonal_statistics=diagonals[i],
                statistics=[statistics[stack][row] for stack, row, _ in order],
                preconditioners=[roots[stack][row] for stack, row, _ in order],
                diagonal_momentum=None
                if diagonal_momenta[i] is None
                else load_momentum(diagonal_momenta[i], p.shape),
                momentum=load_momentum(momenta[i], p.shape),
                training_metrics=metrics,
            )
        )
    return jax.tree.unflatten(treedef, out)


def _seed_array(x: Any) -> jax.Array | None:
    """A member of the seed's state as a float32 array, or None when absent
    (``None``, ``[]``, ``optax.MaskedNode``). A ``QuantizedValue`` (fields
    ``quantized``, ``diagonal``, ``bucket_size``, ``extract_diagonal``) is
    dequantized: quantized·bucket_size per column, plus diag(diagonal)."""
    if x is None or isinstance(x, optax.MaskedNode):
        return None
    if isinstance(x, list | tuple) and not x:
        return None
    if hasattr(x, "quantized") and hasattr(x, "bucket_size"):
        return _dequantized_seed_value(x)
    return jnp.asarray(x, jnp.float32)


def _dequantized_seed_value(x: Any) -> jax.Array | None:
    """A seed's ``QuantizedValue`` as a float32 array (see :func:`_seed_array`)."""
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


def state_from_seed(seed_state, params, config: Config) -> ShampooState:
    """The :class:`ShampooState` for ``config`` holding what ``seed_state`` (the
    seed's layout) holds: each parameter's entry is checked against the
    statistics ``config`` gives it, refused naming the parameter if it does
    not fit, and stored as ``init_state`` stores it."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [p for _, p in paths_and_leaves]
    names = [jax.tree_util.keystr(path) or "params" for path, _ in paths_and_leaves]
    layout = plan_layout([p.shape for p in leaves], config)
    template = init_state(params, config, constrain=False)
    flat = treedef.flatten_up_to
    old_errors = (
        flat(root_errors(template.training_metrics))
        if config.generate_training_metrics
        else [None] * len(leaves)
    )
    stacks = [load(s) for s in template.statistics]
    rows, buffers, errors = [], [], []
    parameters = zip(
        _seed_entries(seed_state.stats, treedef),
        zip(
            flat(template.momentum),
            flat(template.diagonal_momentum),
            flat(template.diagonal_statistics),
            strict=True,
        ),
        old_errors,
        names,
        leaves,
        layout.plans,
        layout.slots,
        strict=True,
    )
    for entry, like, old, name, leaf, plan, slots in parameters:
        order = [] if plan is None else _seed_order(plan, slots, config)
        rows += _statistic_rows(entry, order, stacks, name, leaf)
        buffers.append(_parameter_buffers(entry, like, name, leaf))
        errors.append(old if old is None else _seed_errors(entry, order, old))
    unflatten = functools.partial(jax.tree.unflatten, treedef)
    columns = [list(c) for c in zip(*buffers, strict=True)] or [[]] * 3
    momenta, graft_momenta, diagonals = (unflatten(c) for c in columns)
    return ShampooState(
        count=jnp.asarray(seed_state.count, jnp.int32),
        momentum=momenta,
        diagonal_momentum=graft_momenta,
        diagonal_statistics=diagonals,
        statistics=_filled(stacks, rows, 2, template.statistics),
        preconditioners=_filled(
            [load(r) for r in template.preconditioners],
            rows,
            3,
            template.preconditioners,
        ),
        training_metrics=(
            TrainingMetrics(unflatten(errors))
            if config.generate_training_metrics
            else optax.MaskedNode()
        ),
        skipped=template.skipped,  # the seed counts no skipped steps
    )


def _refuse(name: str, leaf, what: str) -> NoReturn:
    raise ValueError(
        f"Invalid seed_state: {name} (shape {tuple(leaf.shape)}) {what}; it does "
        "not fit these distributed_shampoo arguments"
    )


def _like_param(x, name: str, leaf, field: str) -> jax.Array:
    """A per-parameter member of the seed's entry, checked to be shaped like
    its parameter."""
    value = _seed_array(x)
    if value is None:
        _refuse(name, leaf, f"has no {field}")
    if value.shape != tuple(leaf.shape):
        _refuse(name, leaf, f"has a {field} of shape {value.shape}")
    return value


def _statistic_rows(entry, order, stacks, name: str, leaf) -> list:
    """(stack, row, statistic, root) of each statistic of a parameter's seed
    entry, checked against ``order`` (:func:`_seed_order`) and the stack sizes."""
    given = list(entry.statistics or []), list(entry.preconditioners or [])
    if any(len(g) != len(order) for g in given):
        _refuse(
            name,
            leaf,
            f"has {len(given[0])} statistics and {len(given[1])} "
            f"preconditioners where {len(order)} are expected",
        )
    rows = []
    for (stack, row, _), s, r in zip(order, *given, strict=True):
        n = stacks[stack].shape[-1]
        s, r = _seed_array(s), _seed_array(r)
        if s is None or r is None:
            _refuse(name, leaf, "has an empty statistic or preconditioner")
        if s.shape != (n, n) or r.shape != (n, n):
            _refuse(
                name, leaf, f"has a {s.shape} statistic where ({n}, {n}) is expected"
            )
        rows.append((stack, row, s, r))
    return rows


def _parameter_buffers(entry, like, name: str, leaf) -> tuple:
    """(momentum, grafting momentum, accumulator) of a parameter's seed entry,
    stored as ``like`` (the template's three buffers; None: the config has none)."""
    momentum, graft_momentum, diagonal = like
    momentum = store_momentum(
        _like_param(entry.momentum, name, leaf, "momentum"), momentum
    )
    if graft_momentum is not None:
        graft_momentum = store_momentum(
            _like_param(entry.diagonal_momentum, name, leaf, "diagonal_momentum"),
            graft_momentum,
        )
    if diagonal is not None:
        diagonal = _like_param(
            entry.diagonal_statistics, name, leaf, "diagonal_statistics"
        ).astype(diagonal.dtype)
    return momentum, graft_momentum, diagonal


def _seed_errors(entry, order, old: jax.Array) -> jax.Array:
    """A parameter's root errors: the seed entry's where it has them, else
    ``old`` (zeros)."""
    metrics = entry.training_metrics
    seed_errors = _seed_array(getattr(metrics, "inverse_pth_root_errors", None))
    if seed_errors is None or not order:
        return old
    where = np.asarray([position for _, _, position in order])
    return old.at[where].set(seed_errors.reshape(-1)[: len(order)])


def _filled(stacks, rows, which: int, like) -> tuple:
    """The stacks with the seed's matrices (member ``which`` of each row of
    ``rows``) at their places, stored like ``like``."""
    out = []
    for index, (stack, old) in enumerate(zip(stacks, like, strict=True)):
        mine = [row for row in rows if row[0] == index]
        if mine:
            values = jnp.stack([row[which] for row in mine]).astype(stack.dtype)
            stack = stack.at[np.asarray([row[1] for row in mine])].set(values)
        out.append(store(stack, old))
    return tuple(out)
