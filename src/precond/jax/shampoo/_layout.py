"""Where Shampoo's statistics live: block plans, the stack layout, block algebra.

A parameter is reshaped to its merged shape and cut into blocks by the engine
shared with Kron and pro (:mod:`precond.jax._core.blocks`); blocks of one shape form
a region (:class:`precond._common.blocking.Region`). Every statistic (one per
block and preconditioned axis) has a row in the stack of its (size n, exponent
p): the :class:`Layout` says which rows belong to which parameter. Plans are functions
of shapes and the config alone (static at trace time, never stored).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from precond._common.blocking import Region, axis_segments, grid_regions
from precond._common.factor_plan import merge_small_dims
from precond.jax._core.blocks import along_each, cut, join
from precond.jax.shampoo._config import Config, PreconditionerType


class ParameterPlan(NamedTuple):
    merged_shape: tuple[int, ...]
    groups: tuple[Region, ...]  # regions of equal blocks
    exponent: int
    axes: tuple[int, ...]  # the merged axes that get a preconditioner

    @property
    def entries(self) -> list[tuple[int, int]]:
        """(group, axis) of each statistic entry, in state order."""
        return [(g, k) for g in range(len(self.groups)) for k in self.axes]


def plan_parameter(shape: tuple[int, ...], config: Config) -> ParameterPlan | None:
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
    groups = tuple(grid_regions([axis_segments(d, config.block_size) for d in merged]))
    rank = len(merged)
    kind = config.precondtioner_type
    if kind == PreconditionerType.ALL or rank <= 1:
        axes = tuple(range(rank))
    elif kind == PreconditionerType.INPUT:
        axes = tuple(range(rank - 1))
    else:
        axes = (rank - 1,)
    exponent = config.exponent_override or 2 * len(axes)
    return ParameterPlan(merged, groups, exponent, axes)


class Layout(NamedTuple):
    """Where every statistic of every parameter lives in the stacks."""

    plans: tuple[ParameterPlan | None, ...]  # per parameter
    keys: tuple[tuple[int, int], ...]  # (n, p) of each stack, sorted
    rows: tuple[int, ...]  # real rows per stack (before padding)
    # per parameter, per entry: (stack index, first row, rows)
    slots: tuple[tuple[tuple[int, int, int], ...], ...]


def plan_layout(shapes: list[tuple[int, ...]], config: Config) -> Layout:
    plans = tuple(plan_parameter(tuple(s), config) for s in shapes)
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
        if plan is not None:
            for g, k in plan.entries:
                group = plan.groups[g]
                key = (group.block_shape[k], plan.exponent)
                entries.append((keys.index(key), rows[key], group.count))
                rows[key] += group.count
        slots.append(tuple(entries))
    return Layout(plans, tuple(keys), tuple(rows[k] for k in keys), tuple(slots))


def padded_rows(rows: int, multiple: int) -> int:
    return -(-rows // multiple) * multiple


def preconditioned(g, plan: ParameterPlan, slots, roots, precision):
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
        blocks.append((group, along_each(cut(x, group), plan.axes, factors, precision)))
    return join(blocks).reshape(g.shape)
