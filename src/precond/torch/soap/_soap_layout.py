"""Where SOAP's statistics live in a parameter: its working shape (with
``merge_dims``, adjacent dims merged while their product stays at most
``max_precond_dim``: the authors' rule, which is
:func:`precond._common.factor_plan.merge_small_dims`), the blocks that shape is cut
into (``block_size``: each block is a SOAP of its own, remainders their own
blocks, ``precond._common.blocking``), and which axes of a block get a statistic.
Blocks of one region are equal and kept as one (count, ...) stack."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from precond._common.blocking import Region, axis_segments, grid_regions
from precond._common.factor_plan import merge_small_dims


class Layout(NamedTuple):
    """A parameter's working shape, its regions (stacks of equal blocks) and,
    per region, the block axes that have a statistic (the others: identity)."""

    shape: tuple[int, ...]
    regions: tuple[Region, ...]
    axes: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=1024)
def _layout(
    shape: tuple[int, ...],
    max_precond_dim: int,
    merge_dims: bool,
    precondition_1d: bool,
    block_size: int | None,
) -> Layout:
    work = shape
    if merge_dims and len(shape) >= 2:
        work = merge_small_dims(shape, max_precond_dim)
    # Decided by the parameter's own rank: merging or blocking does not change it.
    preconditioned = len(shape) >= 2 or (len(shape) == 1 and precondition_1d)
    regions = tuple(grid_regions([axis_segments(d, block_size) for d in work]))
    axes = tuple(
        tuple(
            k
            for k, d in enumerate(r.block_shape)
            if preconditioned and d <= max_precond_dim
        )
        for r in regions
    )
    return Layout(work, regions, axes)


def layout(shape: Sequence[int], group: dict) -> Layout:
    """The layout of a parameter of ``shape`` under its group's arguments."""
    return _layout(
        tuple(int(d) for d in shape),
        group["max_precond_dim"],
        group["merge_dims"],
        group["precondition_1d"],
        group["block_size"],
    )


def statistic_count(lay: Layout) -> int:
    return sum(len(a) for a in lay.axes)


def numel(region: Region) -> int:
    return region.count * math.prod(region.block_shape)
