"""How Kron lays parameters out for its kernels: plans, blocks and stacks.

The plans are made on shapes alone by :mod:`precond._common.kron_plan`
(re-exported here); this module moves arrays between the parameters' layout and
the stacks' with the blocking engine shared with pro and Shampoo
(:mod:`precond.jax._core.blocks`): a padded tensor is one region of equal blocks.

Padding (edge blocks, empty units) is zeros here; see the plan for its rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from precond._common.blocking import Region
from precond._common.kron_constants import BLOCK_PADDINGS, MERGE_RULES
from precond._common.kron_plan import (
    PADDING_UNIT,
    StackPlan,
    TensorPlan,
    plan_stacks,
    plan_tensor,
    unit_extents,
)
from precond.jax._core.blocks import cut, join

__all__ = [
    "BLOCK_PADDINGS",
    "MERGE_RULES",
    "PADDING_UNIT",
    "StackPlan",
    "TensorPlan",
    "from_stacks",
    "from_units",
    "plan_stacks",
    "plan_tensor",
    "to_stacks",
    "to_units",
    "unit_extents",
]


def _region(plan: TensorPlan) -> Region:
    """The plan's padded tensor as one region of equal blocks."""
    return Region((0,) * len(plan.shape), plan.blocks_per_axis, plan.block_shape)


def to_units(x: jax.Array, plan: TensorPlan) -> jax.Array:
    """(*lead, *plan.shape) → (units, *plan.block_shape), zero-padding edge blocks."""
    lead_ndim = x.ndim - len(plan.shape)
    padded = plan.padded_shape
    if padded != plan.shape:
        x = jnp.pad(
            x,
            [(0, 0)] * lead_ndim
            + [(0, p - d) for p, d in zip(padded, plan.shape, strict=True)],
        )
    return cut(x, _region(plan), lead_ndim)


def from_units(units: jax.Array, plan: TensorPlan, lead: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`to_units`: (units, *block_shape) → (*lead, *plan.shape)."""
    x = join([(_region(plan), units)], lead)
    if plan.padded_shape != plan.shape:
        x = x[(..., *tuple(slice(0, d) for d in plan.shape))]
    return x


def to_stacks(
    tensors: Sequence[jax.Array],
    plans: Sequence[TensorPlan],
    stacks: Sequence[StackPlan],
) -> list[jax.Array]:
    """Per-parameter (*lead, *shape) arrays → one (units, *block_shape) per stack.

    Padding units are zeros.
    """
    stacked = []
    for stack in stacks:
        parts = [to_units(tensors[i], plans[i]) for i in stack.members]
        padding = len(stack.extents) - stack.real_units
        if padding:
            parts.append(jnp.zeros((padding, *stack.block_shape), parts[0].dtype))
        stacked.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
    return stacked


def from_stacks(
    stacked: Sequence[jax.Array],
    plans: Sequence[TensorPlan],
    stacks: Sequence[StackPlan],
    leads: Sequence[tuple[int, ...]],
) -> list[jax.Array | None]:
    """Inverse of :func:`to_stacks`: per-parameter (*lead, *shape) arrays.

    Parameters in no stack (no entries) get None.
    """
    out: list[jax.Array | None] = [None] * len(plans)
    for stack, array in zip(stacks, stacked, strict=True):
        start = 0
        for i in stack.members:
            count = math.prod(leads[i]) * math.prod(plans[i].blocks_per_axis)
            out[i] = from_units(array[start : start + count], plans[i], leads[i])
            start += count
    return out
