"""How Kron lays parameters out for its kernels: plans, blocks and stacks.

Every parameter becomes *units*, each preconditioned by its own Kronecker factors:
one unit per layer of a scanned parameter, times one per block when large axes are
partitioned. Units of equal block shape and factor structure, from all parameters,
are stacked into one array so that a single vmapped program fits or applies all of
their preconditioners (fewer, larger kernels; one place to shard the work).

Blocks on the edge are zero-padded to the full block shape. Kernels receive each
unit's valid extent per axis so that padding stays inert: padded rows never get
noise, never count in damping or balancing, and never touch the real part. When a
stack is split over devices, it is padded with empty units (extent 0) to a multiple
of the number of shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precond._common.factor_plan import (
    merge_dims,
    merge_dims_by_loss,
    plan_diagonal_axes,
)

# How merge_small_dims groups axes (see scale_by_kron's merge_rule).
MERGE_RULES = ("balanced", "distributed_kron")
# How blocking pads (see scale_by_kron's block_padding).
BLOCK_PADDINGS = ("inert", "distributed_kron")

# Parameter index of the empty units that pad a stack to a multiple of the shards.
PADDING_UNIT = np.iinfo(np.int32).max


class TensorPlan(NamedTuple):
    """How one parameter is preconditioned; derived from its shape at trace time."""

    scanned: bool  # the leading axis stacks layers: one unit per layer
    shape: tuple[int, ...]  # shape of one layer after merging
    diagonal: tuple[bool, ...]  # per axis of ``shape``: diagonal factor or triangular
    block_shape: tuple[int, ...]  # shape of one unit: ``shape`` cut to the block size
    complex: bool = False  # complex entries: complex factors, in their own stacks
    fitted_padding: bool = False  # padding is fitted like real entries (noise,
    # balancing), as distributed-kron does; otherwise it is inert

    @property
    def blocks_per_axis(self) -> tuple[int, ...]:
        return tuple(
            -(-d // b) if b else 0
            for d, b in zip(self.shape, self.block_shape, strict=True)
        )

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """``shape`` rounded up to whole blocks."""
        return tuple(
            n * b for n, b in zip(self.blocks_per_axis, self.block_shape, strict=True)
        )

    def lead(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The layer axis of a scanned parameter, () otherwise."""
        return param_shape[:1] if self.scanned else ()


class StackPlan(NamedTuple):
    """Units of several parameters that share a block shape and factor structure."""

    block_shape: tuple[int, ...]
    diagonal: tuple[bool, ...]
    members: tuple[int, ...]  # indices of the parameters whose units it holds, in order
    extents: np.ndarray  # (units, ndim) int32: valid size of each unit along each axis
    unit_ids: np.ndarray  # (units, 2) int32: (parameter index, unit index within it);
    # the noise of a unit is drawn from these, so it is the same however the stack is
    # split; empty padding units get (PADDING_UNIT, i)
    complex: bool = False  # units of complex parameters (complex factors)

    @property
    def real_units(self) -> int:
        """Units that hold parameter entries (the rest is padding for sharding)."""
        return int(np.sum(self.unit_ids[:, 0] != PADDING_UNIT))


def plan_tensor(
    shape: tuple[int, ...],
    *,
    scanned: bool,
    path: str,
    max_size_triangular: int,
    min_ndim_triangular: int,
    memory_save_mode: str | None,
    merge_small_dims: bool,
    target_merged_dim_size: int,
    block_size: int | None,
    complex: bool = False,
    merge_rule: str = "balanced",
    block_padding: str = "inert",
) -> TensorPlan:
    """Plans one parameter: its layers, merged shape, factor structure and blocks.

    Factor structure is decided on the (unmerged) layer shape; a merged axis is
    diagonal iff all its source axes are, or (``merge_rule='balanced'``) if it
    exceeds ``max_size_triangular``. ``merge_rule``: 'balanced'
    (:func:`merge_dims`) or 'distributed_kron' (:func:`merge_dims_by_loss`).
    ``block_size=None`` keeps every axis whole; diagonal axes are never cut.
    ``block_padding='distributed_kron'`` pads every axis (cut or not) up to a
    multiple of ``block_size`` and fits the padding like real entries, as
    distributed-kron does; 'inert' (default) pads only the edge blocks of cut
    axes, and the padding never changes the real part.
    ``complex``: the parameter is
    complex (its units get complex factors and are never stacked with real ones).
    """
    if scanned and not shape:
        raise ValueError(
            f"Invalid scanned_layers: parameter {path} is 0-d, so it has no leading "
            "layer axis to scan over"
        )
    layer_shape = (shape[1:] if scanned else shape) or (1,)
    diagonal = plan_diagonal_axes(
        layer_shape,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=memory_save_mode,
    )
    if merge_small_dims:
        balanced = merge_rule == "balanced"
        rule = merge_dims if balanced else merge_dims_by_loss
        groups = rule(layer_shape, target_merged_dim_size)
        merged = tuple(math.prod(layer_shape[a] for a in g) for g in groups)
        diagonal = tuple(
            all(diagonal[a] for a in g) or (balanced and size > max_size_triangular)
            for g, size in zip(groups, merged, strict=True)
        )
        layer_shape = merged
    # Diagonal axes stay whole (as distributed-kron's): cheap, and a diagonal
    # factor's step normaliser then spans the whole axis.
    fitted = block_size is not None and block_padding == "distributed_kron"

    def block_length(d: int, diagonal_axis: bool) -> int:
        if block_size is None:
            return d
        if fitted:  # every axis padded up to a multiple of the block size
            return -(-d // block_size) * block_size if diagonal_axis else block_size
        return d if diagonal_axis else min(d, block_size)

    block_shape = tuple(
        block_length(d, diag) for d, diag in zip(layer_shape, diagonal, strict=True)
    )
    return TensorPlan(scanned, layer_shape, diagonal, block_shape, complex, fitted)


def unit_extents(plan: TensorPlan, lead: tuple[int, ...]) -> np.ndarray:
    """(units, ndim): the valid size of each unit of a parameter along each axis."""
    per_axis = []
    for d, b, n in zip(plan.shape, plan.block_shape, plan.blocks_per_axis, strict=True):
        # Fitted padding counts as valid: it gets noise and enters the balancing.
        per_axis.append(
            [b if plan.fitted_padding else min(b, d - i * b) for i in range(n)]
        )
    grid = np.array(np.meshgrid(*per_axis, indexing="ij")).reshape(len(per_axis), -1)
    return np.tile(grid.T, (math.prod(lead), 1)).astype(np.int32)


def plan_stacks(
    plans: Sequence[TensorPlan], shapes: Sequence[tuple], units_multiple_of: int = 1
) -> list[StackPlan]:
    """Groups the units of all parameters by (block shape, factor structure, real
    or complex).

    Parameters with no entries have no units and belong to no stack. Each stack
    is padded with empty units to a multiple of ``units_multiple_of``.
    """
    groups: dict[tuple, list[int]] = {}
    for index, plan in enumerate(plans):
        if math.prod(shapes[index]) == 0:
            continue
        groups.setdefault((plan.block_shape, plan.diagonal, plan.complex), []).append(
            index
        )
    stacks = []
    for (block_shape, diagonal, complex_units), members in groups.items():
        extents = [unit_extents(plans[i], plans[i].lead(shapes[i])) for i in members]
        ids = [
            np.stack([np.full(len(e), i), np.arange(len(e))], axis=1)
            for i, e in zip(members, extents, strict=True)
        ]
        padding = -sum(map(len, extents)) % units_multiple_of
        extents.append(np.zeros((padding, len(block_shape)), np.int32))
        ids.append(
            np.stack([np.full(padding, PADDING_UNIT), np.arange(padding)], axis=1)
        )
        stacks.append(
            StackPlan(
                block_shape,
                diagonal,
                tuple(members),
                np.concatenate(extents).astype(np.int32),
                np.concatenate(ids).astype(np.int32),
                complex_units,
            )
        )
    return stacks


def to_units(x: jax.Array, plan: TensorPlan) -> jax.Array:
    """(*lead, *plan.shape) → (units, *plan.block_shape), zero-padding edge blocks."""
    k = len(plan.shape)
    lead = x.shape[: x.ndim - k]
    padded = plan.padded_shape
    if padded != plan.shape:
        x = jnp.pad(
            x,
            [(0, 0)] * len(lead)
            + [(0, p - d) for p, d in zip(padded, plan.shape, strict=True)],
        )
    split = lead + tuple(
        s
        for n, b in zip(plan.blocks_per_axis, plan.block_shape, strict=True)
        for s in (n, b)
    )
    order = (
        tuple(range(len(lead)))
        + tuple(len(lead) + 2 * i for i in range(k))
        + tuple(len(lead) + 2 * i + 1 for i in range(k))
    )
    return x.reshape(split).transpose(order).reshape((-1, *plan.block_shape))


def from_units(units: jax.Array, plan: TensorPlan, lead: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`to_units`: (units, *block_shape) → (*lead, *plan.shape)."""
    k = len(plan.shape)
    grid = lead + plan.blocks_per_axis + plan.block_shape
    order = tuple(range(len(lead))) + tuple(
        axis for i in range(k) for axis in (len(lead) + i, len(lead) + k + i)
    )
    padded = plan.padded_shape
    x = units.reshape(grid).transpose(order).reshape(lead + padded)
    if padded != plan.shape:
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
) -> list[jax.Array]:
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
