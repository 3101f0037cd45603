"""Layout of PSGD 'pro' (``precond.jax.pro``, ``precond.torch.Pro``): pure Python
on shapes, shared by both frameworks.

A parameter is read as a vector or as a matrix (:func:`merged_shape`); a matrix
side of at most ``max_size_dense`` is dense and cut into blocks of
``block_size`` (full blocks, then the remainder), a longer side keeps one
diagonal factor. :func:`_plan` groups equal blocks of the whole model into
*stacks* that one batched call fits (blocks of different parameters too, as
Kron's stacks do), and gives each block its place in distributed-kron 2.0's key
streams (which the JAX transform uses to reproduce its draws).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from precond._common.blocking import Region, axis_segments, grid_regions

BALANCE_EVERY = 100  # steps between rebalancing a block's two factors
# Each tensor's update is clipped to RMS kron_constants.MAX_UPDATE_RMS, Kron's rule.
ADAM_STYLE_DIVISOR = 5.0  # lr_style='adam': U/5 has the scale of Adam's update


def merged_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter's preconditioner sees: () or (n,) for vectors (and
    for shapes whose dims are 1 but one), a 2-D shape as it is, and a higher
    one split into two groups of adjacent dims whose sizes have the smallest
    ratio (the first such split; a zero-size group counts as size 1 in the
    ratio, so a zero-size shape splits too)."""
    if len(shape) < 2:
        return tuple(shape)
    if math.prod(shape) == max(shape):
        return (max(shape),)
    if len(shape) == 2:
        return tuple(shape)
    ratios = [
        max(math.prod(shape[:s]), math.prod(shape[s:]))
        / max(min(math.prod(shape[:s]), math.prod(shape[s:])), 1)
        for s in range(1, len(shape))
    ]
    split = 1 + int(np.argmin(ratios))
    return (math.prod(shape[:split]), math.prod(shape[split:]))


class _Region(NamedTuple):
    """Equal blocks cut from one parameter: ``counts`` blocks of ``shape`` per
    side, starting at block index ``first`` and element ``offset`` of each side."""

    leaf: int
    counts: tuple[int, ...]
    shape: tuple[int, ...]
    first: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def blocks(self) -> Region:
        """The blocks as the blocking engine's region of the merged parameter."""
        return Region(self.offset, self.counts, self.shape)


class _Stack(NamedTuple):
    """Blocks of one shape and side kinds, fitted by one vmapped call.

    ``keys`` says where each unit's key comes from: runs of consecutive units
    (padding last), each a key stream (a key of ``_Plan.stream_sizes``) and the
    units' indices in it. The blocks of one parameter, or all blocks with two
    dense sides, share a stream (distributed-kron 2.0's draws); a stack holds
    blocks of several parameters when their shapes agree.
    """

    diagonal: tuple[bool, ...]  # per side
    shape: tuple[int, ...]  # block shape
    draw_shape: tuple[int, ...]  # shape of distributed-kron's padded block
    regions: tuple[_Region, ...]
    keys: tuple[tuple[str | tuple, np.ndarray], ...]  # (stream, indices) runs
    padding: int  # units added so the stack splits evenly over the pipeline axis

    @property
    def units(self) -> int:
        """The number of blocks fitted together, padding included."""
        return sum(len(index) for _, index in self.keys)


class _Plan(NamedTuple):
    batch: tuple[int, ...]  # per leaf: its layer count (1 when not scanned)
    merged: tuple[tuple[int, ...] | None, ...]  # None: a 0-size parameter
    stacks: tuple[_Stack, ...]
    stream_sizes: dict  # stream name (per leaf but 'dense') -> number of keys


_SIDE_KINDS = {  # (diagonal per side) -> the name of its key stream
    (False, False): "dense",
    (True, True): "diagonal",
    (True, False): "columns",
    (False, True): "rows",
}


def _leaf_layout(inner, leaf, max_size_dense, block_size):
    """(merged shape, key stream, diagonal per side, block length per side or
    None) of a parameter of (per-layer) shape ``inner`` with entries: a vector
    has one diagonal side; a matrix side longer than ``max_size_dense`` is
    diagonal, a shorter one dense and cut into blocks of ``block_size``. The
    stream is 'dense' (shared) or (kind, leaf)."""
    merged = merged_shape(inner)
    if len(merged) <= 1:
        return (math.prod(inner),), ("vector", leaf), (True,), (None,)
    diagonal = tuple(d > max_size_dense for d in merged)
    blocked = tuple(None if diag else block_size for diag in diagonal)
    name = _SIDE_KINDS[diagonal]
    stream = "dense" if name == "dense" else (name, leaf)
    return merged, stream, diagonal, blocked


def _region_key_index(region: _Region, B: int, grid: list[int]) -> np.ndarray:
    """Each unit's (layer b, then blocks in row-major order) index among the
    B·∏grid units of its parameter, the order of its key stream."""
    sides = len(region.counts)
    index = np.arange(B).reshape((B,) + (1,) * sides) * math.prod(grid)
    stride = 1
    for axis in reversed(range(sides)):
        blocks = region.first[axis] + np.arange(region.counts[axis])
        shape = [1] * (sides + 1)
        shape[axis + 1] = -1
        index = index + stride * blocks.reshape(shape)
        stride *= grid[axis]
    return index.reshape(-1)


def _leaf_regions(leaf, merged, blocked):
    """(regions of equal blocks, blocks per side) of one parameter: full blocks,
    then the remainder, per blocked side (:func:`axis_segments`)."""
    per_side = [axis_segments(d, b) for d, b in zip(merged, blocked, strict=True)]
    grid = [sum(s.count for s in side) for side in per_side]
    regions = [
        _Region(
            leaf,
            counts=region.grid,
            shape=region.block_shape,
            first=tuple(s.first for s in combo),
            offset=region.starts,
        )
        for region, combo in zip(
            grid_regions(per_side), itertools.product(*per_side), strict=True
        )
    ]
    return regions, grid


def stream_kind(stream: str | tuple) -> str:
    """The kind of a key stream ('dense', 'diagonal', 'columns', 'rows' or
    'vector'): the name of its seed."""
    return "dense" if stream == "dense" else str(stream[0])


def _key_runs(members: list, padding: int) -> tuple:
    """(stream, indices) runs of a stack's members (region, stream, indices),
    consecutive members of one stream joined; the padding units take index 0 of
    the last stream."""
    runs: list[tuple] = []
    for _, stream, index in members:
        if runs and runs[-1][0] == stream:
            runs[-1] = (stream, np.concatenate([runs[-1][1], index]))
        else:
            runs.append((stream, index))
    if padding:
        stream, index = runs[-1]
        runs[-1] = (stream, np.concatenate([index, np.zeros(padding, int)]))
    return tuple(runs)


def _stacks(groups: dict, pipeline_size: int) -> tuple[_Stack, ...]:
    """One stack per group of equal blocks, padded (but the vectors') to a
    multiple of the pipeline size."""
    stacks = []
    for (kind, diagonal, shape, draw_shape), members in groups.items():
        units = sum(len(index) for _, _, index in members)
        padding = 0 if kind == "vector" else -units % pipeline_size
        stacks.append(
            _Stack(
                diagonal=diagonal,
                shape=shape,
                draw_shape=draw_shape,
                regions=tuple(region for region, _, _ in members),
                keys=_key_runs(members, padding),
                padding=padding,
            )
        )
    return tuple(stacks)


def _plan(
    shapes: list[tuple[int, ...]],
    scanned: list[bool],
    max_size_dense: int,
    block_size: int,
    pipeline_size: int,
) -> _Plan:
    """The layout of parameters of ``shapes`` (a leading layer axis where
    ``scanned``): per leaf its layer count and merged shape, the stacks of
    equal blocks, and the size of each key stream (distributed-kron 2.0's:
    one 'dense' stream shared by all blocks with two dense sides, one stream
    per other parameter)."""
    batch, merged_shapes = [], []
    groups: dict[tuple, list] = {}  # (kind, diagonal, shape, draw) -> members
    stream_sizes: dict = {}
    dense_units = 0
    for leaf, (shape, is_scanned) in enumerate(zip(shapes, scanned, strict=True)):
        B = shape[0] if is_scanned else 1
        batch.append(B)
        if math.prod(shape) == 0:
            merged_shapes.append(None)
            continue
        inner = tuple(shape[1:]) if is_scanned else tuple(shape)
        merged, stream, diagonal, blocked = _leaf_layout(
            inner, leaf, max_size_dense, block_size
        )
        merged_shapes.append(merged)
        regions, grid = _leaf_regions(leaf, merged, blocked)
        units = B * math.prod(grid)
        if stream == "dense":
            base, dense_units = dense_units, dense_units + units
        else:
            base = 0
            stream_sizes[stream] = units
        draw_shape = tuple(
            d if b is None else b for d, b in zip(merged, blocked, strict=False)
        )
        for region in regions:
            key = (stream_kind(stream), diagonal, region.shape, draw_shape)
            index = base + _region_key_index(region, B, grid)
            groups.setdefault(key, []).append((region, stream, index))
    if dense_units:
        stream_sizes["dense"] = dense_units
    # distributed-kron pads every stream but the vectors' to the pipeline size.
    for stream in stream_sizes:
        if stream == "dense" or stream[0] != "vector":
            stream_sizes[stream] += -stream_sizes[stream] % pipeline_size
    return _Plan(
        tuple(batch), tuple(merged_shapes), _stacks(groups, pipeline_size), stream_sizes
    )
