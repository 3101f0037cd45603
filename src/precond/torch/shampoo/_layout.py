"""Where Shampoo's statistics live in torch: the block plan of a parameter and
the statistics' grams and the preconditioned gradient, on the block algebra of
:mod:`precond.torch._core.blocks`.

The plan is ``precond.jax.shampoo._layout``'s, from the same shared pieces
(:func:`precond._common.factor_plan.merge_small_dims`,
:mod:`precond._common.blocking`): a parameter is reshaped to its merged shape
and cut into blocks of at most ``block_size`` per axis; blocks of one shape form
a region, whose statistics for axis k are one (count, n_k, n_k) tensor.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from precond._common.blocking import Region, axis_segments, grid_regions
from precond._common.factor_plan import merge_small_dims
from precond.torch._core.blocks import along_each, cut, gram, paste
from precond.torch.shampoo._arguments import PreconditionerType

# The group arguments a plan reads.
PLAN_ARGUMENTS = (
    "block_size",
    "best_effort_shape_interpretation",
    "merge_small_dims_block_size",
    "skip_preconditioning_dim_size_gt",
    "skip_preconditioning_rank_lt",
    "precondtioner_type",
    "exponent_override",
)


class ParameterPlan(NamedTuple):
    merged_shape: tuple[int, ...]
    regions: tuple[Region, ...]  # regions of equal blocks
    exponent: int  # p of the inverse roots
    axes: tuple[int, ...]  # the merged axes that get a preconditioner

    @property
    def entries(self) -> list[tuple[int, int]]:
        """(region, axis) of each statistic, in state order."""
        return [(r, k) for r in range(len(self.regions)) for k in self.axes]


def plan_of(shape: torch.Size, group: dict[str, Any]) -> ParameterPlan | None:
    """The plan of a parameter of ``shape`` under ``group``'s arguments."""
    return _plan(tuple(shape), *(group[name] for name in PLAN_ARGUMENTS))


@functools.cache
def _plan(
    shape: tuple[int, ...],
    block_size: int,
    merge: bool,
    merge_limit: int | None,
    skip_dim_gt: int,
    skip_rank_lt: int,
    kind: int,
    exponent_override: int,
) -> ParameterPlan | None:
    """How a parameter is blocked, or None when it takes the grafting step alone
    (a rank below ``skip_preconditioning_rank_lt`` or 1, an empty tensor, or a
    dim above ``skip_preconditioning_dim_size_gt``)."""
    if len(shape) < max(skip_rank_lt, 1) or math.prod(shape) == 0:
        return None
    if max(shape) > skip_dim_gt:
        return None
    limit = block_size if merge_limit is None else merge_limit
    merged = merge_small_dims(shape, limit) if merge else shape
    regions = tuple(grid_regions([axis_segments(d, block_size) for d in merged]))
    rank = len(merged)
    if kind == PreconditionerType.ALL or rank <= 1:
        axes = tuple(range(rank))
    elif kind == PreconditionerType.INPUT:
        axes = tuple(range(rank - 1))
    else:
        axes = (rank - 1,)
    exponent = exponent_override or 2 * len(axes)
    return ParameterPlan(merged, regions, exponent, axes)


def preconditioned(
    g: torch.Tensor, plan: ParameterPlan, roots: list[torch.Tensor]
) -> torch.Tensor:
    """P(G): every block's axes multiplied by its inverse roots (``roots`` in
    the plan's entry order), merged back to ``g``'s shape."""
    x = g.to(roots[0].dtype).reshape(plan.merged_shape)
    out = torch.empty_like(x)
    for r, region in enumerate(plan.regions):
        mine = [
            root for (e, _), root in zip(plan.entries, roots, strict=True) if e == r
        ]
        paste(out, along_each(cut(x, region), plan.axes, mine), region)
    return out.reshape(g.shape)


def statistics_grams(g: torch.Tensor, plan: ParameterPlan, dtype) -> list:
    """Each statistic's gram of this gradient, in the plan's entry order."""
    x = g.to(dtype).reshape(plan.merged_shape)
    blocks = [cut(x, region) for region in plan.regions]
    return [gram(blocks[r], k) for r, k in plan.entries]
