"""Moves arrays between a tensor and the blocks of its regions (JAX).

The one blocking engine of Kron, pro, Shampoo and SOAP: a region
(:class:`precond._common.blocking.Region`) of a tensor with leading axes
``lead`` becomes a stack of ``prod(lead)·region.count`` units of the region's
block shape, leading index first, then the blocks in row-major order of the
region's grid; :func:`join` puts the regions' units back. The block algebra of
Kronecker-factored statistics (Shampoo, SOAP) works on such stacks: per block axis
k, the grams ``G ⋅_{¬k} G`` (:func:`block_grams`) and the products with a stack of
(n_k, n_k) matrices (:func:`along_each`).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from precond._common.blocking import Region


def cut(x: jax.Array, region: Region, lead_ndim: int = 0) -> jax.Array:
    """(*lead, *shape) → (units, *block_shape): ``region``'s blocks of ``x``.

    Example:
        >>> x = jnp.arange(12.0).reshape(3, 4)
        >>> cut(x, Region((0, 0), (1, 2), (3, 2)))[1].tolist()
        [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]
    """
    lead = x.shape[:lead_ndim]
    if region.extent != x.shape[lead_ndim:]:
        window = zip(region.starts, region.extent, strict=True)
        x = x[(slice(None),) * lead_ndim + tuple(slice(s, s + e) for s, e in window)]
    k = len(region.grid)
    split = lead + tuple(
        v for nb in zip(region.grid, region.block_shape, strict=True) for v in nb
    )
    order = (
        tuple(range(lead_ndim))
        + tuple(lead_ndim + 2 * i for i in range(k))
        + tuple(lead_ndim + 2 * i + 1 for i in range(k))
    )
    return x.reshape(split).transpose(order).reshape((-1, *region.block_shape))


def _uncut(units: jax.Array, region: Region, lead: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`cut` for one region: (*lead, *region.extent)."""
    k = len(region.grid)
    n = len(lead)
    order = tuple(range(n)) + tuple(
        axis for i in range(k) for axis in (n + i, n + k + i)
    )
    grid = lead + region.grid + region.block_shape
    return units.reshape(grid).transpose(order).reshape(lead + region.extent)


def join(
    pieces: Sequence[tuple[Region, jax.Array]], lead: tuple[int, ...] = ()
) -> jax.Array:
    """Inverse of :func:`cut` over regions that tile a tensor: the (*lead, *shape)
    tensor from each region's units.

    Example:
        >>> x = jnp.arange(12.0).reshape(3, 4)
        >>> regions = [Region((0, 0), (1, 1), (3, 3)), Region((0, 3), (1, 1), (3, 1))]
        >>> bool((join([(r, cut(x, r)) for r in regions]) == x).all())
        True
    """
    blocks = {r.starts: _uncut(units, r, lead) for r, units in pieces}
    if len(blocks) == 1:
        return next(iter(blocks.values()))
    return _concatenated(blocks, len(lead), ())


def _concatenated(blocks: dict, axis: int, prefix: tuple[int, ...]) -> jax.Array:
    """The blocks whose starts begin with ``prefix``, concatenated along
    ``axis`` and the axes after it, in order of their starts."""
    rank = len(next(iter(blocks)))
    if len(prefix) == rank:
        return blocks[prefix]
    starts = sorted({s[len(prefix)] for s in blocks if s[: len(prefix)] == prefix})
    parts = [_concatenated(blocks, axis + 1, (*prefix, s)) for s in starts]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def units_of(region: Region, lead: tuple[int, ...]) -> int:
    """Number of units :func:`cut` makes of ``region`` with leading axes ``lead``."""
    return math.prod(lead) * region.count


def _letters(rank: int) -> str:
    return string.ascii_lowercase[:rank]


def block_grams(blocks: jax.Array, axes, precision) -> dict[int, jax.Array]:
    """Per axis k in ``axes``: (units, n_k, n_k), each block of the stack
    ``blocks`` contracted with itself over every other axis (G_b·G_bᵀ along k),
    at matmul ``precision``."""
    letters = _letters(blocks.ndim - 1)
    grams = {}
    for k in axes:
        a = letters[k]
        other = letters.replace(a, "A")
        spec = f"z{letters},z{other}->z{a}A"
        grams[k] = jnp.einsum(spec, blocks, blocks, precision=precision)
    return grams


def along_each(
    blocks: jax.Array, axes, matrices: list[jax.Array], precision
) -> jax.Array:
    """``G_b ×_k M_kᵀ`` for each axis k of ``axes``: that axis of every block of
    the stack contracted with the rows of its (units, n_k, n_k) matrix
    (``out[..., j, ...] = Σ_i G[..., i, ...]·M[i, j]``; the other axes are left as
    they are), at matmul ``precision``."""
    letters = _letters(blocks.ndim - 1)
    for k, matrix in zip(axes, matrices, strict=True):
        a = letters[k]
        out = letters.replace(a, "A")
        blocks = jnp.einsum(
            f"z{letters},z{a}A->z{out}", blocks, matrix, precision=precision
        )
    return blocks
