"""How a tensor is cut into equal blocks: the plan shared by Kron, pro and Shampoo.

An axis of length d cut into blocks of length b gives full blocks, then one
shorter remainder block when b does not divide d (:func:`axis_segments`). Over
several axes the segments combine into :class:`Region` s: rectangular grids of
equal blocks, which stack as units of one shape (:func:`grid_regions`). Kron
pads its axes to a multiple of b first, so each of its tensors is one region;
pro and Shampoo keep the remainders as regions of their own.

The arrays are moved between a tensor and its regions' blocks by
``precond.jax._core.blocks`` (``cut`` and ``join``). This module is framework-free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple


class Segment(NamedTuple):
    """``count`` blocks of length ``size`` along one axis, from element ``start``
    (block index ``first`` of the axis)."""

    start: int
    count: int
    size: int
    first: int


class Region(NamedTuple):
    """A grid of equal blocks cut from a tensor: ``grid`` blocks per axis of
    ``block_shape``, from element ``starts`` of each axis."""

    starts: tuple[int, ...]
    grid: tuple[int, ...]
    block_shape: tuple[int, ...]

    @property
    def count(self) -> int:
        """Number of blocks."""
        return math.prod(self.grid)

    @property
    def extent(self) -> tuple[int, ...]:
        """Elements covered per axis."""
        return tuple(n * b for n, b in zip(self.grid, self.block_shape, strict=True))


def axis_segments(d: int, block: int | None) -> list[Segment]:
    """The segments of an axis of length ``d``: whole when ``block`` is None, not
    positive or at least d; else ⌊d/b⌋ full blocks, then the remainder (if any).

    Example:
        >>> [tuple(s) for s in axis_segments(10, 4)]
        [(0, 2, 4, 0), (8, 1, 2, 2)]
    """
    if block is None or not 0 < block < d:
        return [Segment(0, 1, d, 0)]
    full, rest = divmod(d, block)
    segments = [Segment(0, full, block, 0)]
    if rest:
        segments.append(Segment(full * block, 1, rest, full))
    return segments


def grid_regions(segments: Sequence[Sequence[Segment]]) -> list[Region]:
    """The regions of a tensor whose axes have ``segments``: one per combination
    of a segment on every axis, in row-major order of the combinations.

    Example:
        >>> grid_regions([axis_segments(10, 4), axis_segments(3, 4)])
        [Region(starts=(0, 0), grid=(2, 1), block_shape=(4, 3)), Region(starts=(8, 0), grid=(1, 1), block_shape=(2, 3))]
    """  # noqa: E501
    return [
        Region(
            tuple(s.start for s in combo),
            tuple(s.count for s in combo),
            tuple(s.size for s in combo),
        )
        for combo in itertools.product(*segments)
    ]
