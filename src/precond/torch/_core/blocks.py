"""Blocks of a tensor as stacks, and the block algebra of Kronecker-factored
statistics (Shampoo, SOAP): a region of equal blocks
(:class:`precond._common.blocking.Region`) is cut out of a tensor as one
(count, *block) stack and pasted back; per block axis k, a stack's grams
``G ⋅_{¬k} G`` and its mode products with a (count, d, d) stack of matrices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from precond._common.blocking import Region


def _window(region: Region) -> tuple[slice, ...]:
    return tuple(
        slice(s, s + e) for s, e in zip(region.starts, region.extent, strict=True)
    )


def _interleaved(region: Region) -> list[int]:
    """(grid_0, block_0, grid_1, block_1, ...): a region's elements by block."""
    return [
        n for pair in zip(region.grid, region.block_shape, strict=True) for n in pair
    ]


def cut(x: torch.Tensor, region: Region) -> torch.Tensor:
    """``region``'s blocks of ``x`` as a (count, *block_shape) stack, row-major
    over the region's grid."""
    r = len(region.grid)
    part = x[_window(region)].reshape(_interleaved(region))
    order = [*range(0, 2 * r, 2), *range(1, 2 * r, 2)]
    return part.permute(order).reshape(region.count, *region.block_shape)


def paste(out: torch.Tensor, blocks: torch.Tensor, region: Region) -> None:
    """Writes a (count, *block_shape) stack into ``region`` of ``out`` (the
    inverse of :func:`cut`)."""
    r = len(region.grid)
    grid = blocks.reshape((*region.grid, *region.block_shape))
    order = [i for k in range(r) for i in (k, r + k)]
    out[_window(region)] = grid.permute(order).reshape(region.extent)


def along(X: torch.Tensor, M: torch.Tensor, axis: int) -> torch.Tensor:
    """Block axis ``axis`` of the stack X contracted with the rows of the
    (count, d, d) stack M: ``out[b, ..., j, ...] = Σ_i X[b, ..., i, ...]·M[b, i, j]``
    (X ×_k Mᵀ in mode-product notation)."""
    moved = X.movedim(axis + 1, -1)
    shape = moved.shape
    out = torch.bmm(moved.reshape(shape[0], -1, shape[-1]), M)
    return out.reshape(shape).movedim(-1, axis + 1)


def along_each(
    X: torch.Tensor, axes: Sequence[int], matrices: Sequence[torch.Tensor]
) -> torch.Tensor:
    """:func:`along` for each axis of ``axes`` with its stack of ``matrices``."""
    for k, M in zip(axes, matrices, strict=True):
        X = along(X, M, k)
    return X


def gram(G: torch.Tensor, axis: int) -> torch.Tensor:
    """``G ⋅_{¬k} G`` per block of the stack G: each block contracted with itself
    over every block axis but ``axis``, (count, d, d)."""
    moved = G.movedim(axis + 1, 1)
    rows = moved.reshape(moved.shape[0], moved.shape[1], -1)
    return torch.bmm(rows, rows.transpose(-1, -2))
