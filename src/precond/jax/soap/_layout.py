"""Where SOAP's statistics and eigenbases live: block plans and stacks.

A parameter's working shape is its own, or with ``merge_dims`` the greedy merge
of adjacent dims up to ``max_precond_dim`` (:func:`merge_small_dims`, the
authors' rule); with ``block_size`` it is cut into blocks by the engine shared
with Kron, pro and Shampoo (:mod:`precond._common.blocking`,
:mod:`precond.jax._core.blocks`), each block its own SOAP. Every block axis of
length at most ``max_precond_dim`` has a statistic S and a basis Q, a row of the
(K, n, n) stack of its length n; the other axes keep the identity (one-sided
SOAP), and a block with none is trained by Adam. Plans are functions of shapes
and the config alone (static at trace time, never stored).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from precond._common.blocking import Region, axis_segments, grid_regions
from precond._common.factor_plan import merge_small_dims
from precond.jax._core.blocks import along_each
from precond.jax.soap._config import Config


class Group(NamedTuple):
    """A region of equal blocks and the block axes that have a statistic."""

    region: Region
    axes: tuple[int, ...]


class ParameterPlan(NamedTuple):
    work_shape: tuple[int, ...]
    groups: tuple[Group, ...]

    @property
    def entries(self) -> list[tuple[int, int]]:
        """(group, axis) of each statistic, in stack-slot order."""
        return [(g, k) for g, group in enumerate(self.groups) for k in group.axes]


def plan_parameter(shape: tuple[int, ...], config: Config) -> ParameterPlan:
    """The working shape, its regions of blocks and their preconditioned axes."""
    shape = tuple(int(d) for d in shape)
    work = shape
    if len(shape) >= 2 and config.merge_dims:
        work = merge_small_dims(shape, config.max_precond_dim)
    regions = grid_regions([axis_segments(d, config.block_size) for d in work])
    rank_ok = len(shape) >= 2 or (len(shape) == 1 and config.precondition_1d)
    groups = tuple(
        Group(
            region,
            tuple(
                k
                for k, d in enumerate(region.block_shape)
                if rank_ok and math.prod(shape) > 0 and d <= config.max_precond_dim
            ),
        )
        for region in regions
    )
    return ParameterPlan(work, groups)


class Layout(NamedTuple):
    """Where every statistic of every parameter lives in the stacks."""

    plans: tuple[ParameterPlan, ...]  # per parameter
    sizes: tuple[int, ...]  # n of each stack, ascending
    rows: tuple[int, ...]  # real rows per stack (before padding)
    # per parameter, per entry: (stack index, first row, rows)
    slots: tuple[tuple[tuple[int, int, int], ...], ...]
    multiple: int  # stacks are padded to a multiple of this many rows

    def padded(self, stack: int) -> int:
        return -(-self.rows[stack] // self.multiple) * self.multiple


def plan_layout(shapes: list[tuple[int, ...]], config: Config, multiple: int) -> Layout:
    plans = tuple(plan_parameter(tuple(s), config) for s in shapes)
    sizes = sorted(
        {p.groups[g].region.block_shape[k] for p in plans for g, k in p.entries}
    )
    rows = dict.fromkeys(sizes, 0)
    slots = []
    for plan in plans:
        entries = []
        for g, k in plan.entries:
            group = plan.groups[g]
            n = group.region.block_shape[k]
            entries.append((sizes.index(n), rows[n], group.region.count))
            rows[n] += group.region.count
        slots.append(tuple(entries))
    return Layout(
        plans, tuple(sizes), tuple(rows[n] for n in sizes), tuple(slots), multiple
    )


def group_rows(plan: ParameterPlan, slots, group: int) -> dict[int, tuple]:
    """Per preconditioned axis of ``group``: (stack, first, rows) of its rows."""
    return {
        k: slot for (g, k), slot in zip(plan.entries, slots, strict=True) if g == group
    }


def along(blocks: jax.Array, bases: dict[int, jax.Array], transpose: bool = False):
    """Every block (units, *block_shape) with each axis k in ``bases`` contracted
    with the first index of its (units, n, n) basis Q_k (``x ×_k Q_kᵀ``: into
    the eigenbasis), or with that of Q_kᵀ when ``transpose`` (back out of it):
    the engine's block product (:func:`precond.jax._core.blocks.along_each`)."""
    if not bases:
        return blocks
    axes = tuple(bases)
    factors = [jnp.swapaxes(q, -1, -2) if transpose else q for q in bases.values()]
    return along_each(blocks, axes, factors, None)


def permuted(blocks: jax.Array, orders: dict[int, jax.Array]) -> jax.Array:
    """Every block with its entries along each axis k in ``orders`` taken in the
    block's order (units, n_k) of that axis."""
    for k, order in orders.items():
        shape = [order.shape[0]] + [1] * (blocks.ndim - 1)
        shape[k + 1] = order.shape[1]
        blocks = jnp.take_along_axis(blocks, order.reshape(shape), axis=k + 1)
    return blocks
