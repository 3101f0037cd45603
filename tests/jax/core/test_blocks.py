"""The blocking engine shared by Kron, pro and Shampoo (``_common.blocking`` and
``jax._blocks``), against index arithmetic done by hand.

* ``axis_segments`` tiles [0, d) with full blocks then one shorter remainder;
  the blocks' ``first`` indices count them.
* ``cut`` puts element x[l, i_0, …] of block (j_0, …) of a region at unit
  l·count + ravel(j) and offset (i_0 − start_0 − j_0·b_0, …) within it;
  ``join`` of every region's ``cut`` is the tensor, for any leading axes.
"""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from precond._common.blocking import axis_segments, grid_regions
from precond.jax._core.blocks import cut, join, units_of

SHAPES = [(7,), (8,), (10, 3), (4, 4), (9, 10), (5, 6, 7), (1, 9), (3, 1, 5)]
BLOCKS = [None, 2, 3, 16]
LEADS = [(), (2, 3)]


@pytest.mark.parametrize("d", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("block", [None, 0, -1, 1, 2, 3, 4, 8, 16])
def test_segments_tile_the_axis(d, block):
    segments = axis_segments(d, block)
    covered = [
        (s.start + j * s.size, s.size, s.first + j)
        for s in segments
        for j in range(s.count)
    ]
    assert [start for start, _, _ in covered] == list(
        itertools.accumulate([size for _, size, _ in covered[:-1]], initial=0)
    )
    assert sum(size for _, size, _ in covered) == d
    assert [first for _, _, first in covered] == list(range(len(covered)))
    if block is not None and 0 < block < d:
        assert all(size == block for _, size, _ in covered[:-1])
        assert 0 < covered[-1][1] <= block
    else:
        assert covered == [(0, d, 0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("lead", LEADS)
def test_cut_places_every_element_and_join_inverts_it(shape, block, lead):
    x = np.arange(math.prod(lead + shape), dtype=np.float64).reshape(lead + shape)
    regions = grid_regions([axis_segments(d, block) for d in shape])
    pieces = []
    for region in regions:
        units = np.asarray(cut(jnp.asarray(x), region, len(lead)))
        assert units.shape == (units_of(region, lead), *region.block_shape)
        for index in np.ndindex(*lead):
            flat_lead = int(np.ravel_multi_index(index, lead)) if lead else 0
            for j in np.ndindex(*region.grid):
                unit = flat_lead * region.count + int(
                    np.ravel_multi_index(j, region.grid)
                )
                window = tuple(
                    slice(s + i * b, s + (i + 1) * b)
                    for s, i, b in zip(
                        region.starts, j, region.block_shape, strict=True
                    )
                )
                np.testing.assert_array_equal(units[unit], x[index + window])
        pieces.append((region, jnp.asarray(units)))
    np.testing.assert_array_equal(np.asarray(join(pieces, lead)), x)
    reversed_pieces = pieces[::-1]  # join does not depend on the regions' order
    np.testing.assert_array_equal(np.asarray(join(reversed_pieces, lead)), x)
