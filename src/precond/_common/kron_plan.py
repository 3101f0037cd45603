"""Kron's plan of a parameter tree, on shapes alone (shared by both frameworks).

Every parameter becomes *units*, each preconditioned by its own Kronecker factors:
one unit per layer of a scanned parameter, times one per block when large axes are
partitioned. Units of equal block shape and factor structure, from all parameters,
are grouped into *stacks*, so that a single batched program fits or applies all of
their preconditioners. Blocks on the edge are zero-padded to the full block shape;
each unit's valid extent per axis keeps that padding inert. A stack split over
devices is padded with empty units (extent 0) to a multiple of the shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from precond._common.factor_plan import (
    merge_dims,
    merge_dims_by_loss,
    plan_diagonal_axes,
)

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


def merge_planned_axes(
    shape: tuple[int, ...],
    diagonal: tuple[bool, ...],
    *,
    target_merged_dim_size: int,
    max_size_triangular: int,
    merge_rule: str = "balanced",
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """``merge_small_dims``: (merged shape, diagonal per merged axis) of a layer
    whose factor structure ``diagonal`` was decided on its unmerged ``shape``.

    Adjacent axes are grouped by ``merge_rule``: 'balanced' (:func:`merge_dims`,
    up to ``target_merged_dim_size``) or 'distributed_kron'
    (:func:`merge_dims_by_loss`). A merged axis is diagonal iff all its source
    axes are, or (``merge_rule='balanced'``) if it exceeds
    ``max_size_triangular``. Used by :func:`plan_tensor` and by
    ``precond.torch.Kron``, whose kron-torch rules (skew, 'smart_one_diag')
    decide the diagonal axes before the merge.

    Example:
        >>> merge_planned_axes(
        ...     (10, 20, 30), (False, False, False),
        ...     target_merged_dim_size=600, max_size_triangular=100,
        ... )
        ((200, 30), (True, False))
    """
    balanced = merge_rule == "balanced"
    rule = merge_dims if balanced else merge_dims_by_loss
    groups = rule(shape, target_merged_dim_size)
    merged = tuple(math.prod(shape[a] for a in g) for g in groups)
    merged_diagonal = tuple(
        all(diagonal[a] for a in g) or (balanced and size > max_size_triangular)
        for g, size in zip(groups, merged, strict=True)
    )
    return merged, merged_diagonal


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
        layer_shape, diagonal = merge_planned_axes(
            layer_shape,
            diagonal,
            target_merged_dim_size=target_merged_dim_size,
            max_size_triangular=max_size_triangular,
            merge_rule=merge_rule,
        )
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


def seed_factor_sizes(plan: TensorPlan, blocked: bool, block_size: int) -> list[int]:
    """distributed-kron's factor size per axis: with blocking, every axis is
    padded up to a multiple of ``block_size`` (cut ones to exactly one block)."""
    if not blocked:
        return list(plan.block_shape)
    return [
        b if (not diagonal and d > block_size) else -(-d // block_size) * block_size
        for d, b, diagonal in zip(
            plan.shape, plan.block_shape, plan.diagonal, strict=True
        )
    ]


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
