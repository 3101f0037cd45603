"""Kron's step on stacks: what a traced step knows of its tree, parameters moved
into stacks of equal units, and a function mapped over every unit of a stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from precond.jax._core.mesh_placement import ShardingPlan
from precond.jax.kron import _layout as layout
from precond.jax.kron._config import (
    KronConfig,
    TreePlan,
)
from precond.jax.kron._state import (
    working,
)


class _Step(NamedTuple):
    """What one traced step knows about its tree: its plan and each leaf's
    layer axis."""

    tree: TreePlan
    leads: list[tuple[int, ...]]  # per leaf: (layers,) if scanned, ()

    @property
    def sharding(self) -> ShardingPlan:
        return self.tree.sharding


def _over_units(
    config: KronConfig,
    fn: Callable,
    sharding: ShardingPlan,
    *stacked,
    batch_size: int | None = None,
):
    """``fn`` applied to every unit of a stack: one vmap, or lax.map in batches
    of ``lax_map_batch_size`` units (``lax_map_scanned_layers``) or else of
    ``batch_size`` units, if given.

    A sharded stack is mapped shard by shard (a vmap over the shards of a
    lax.map over each shard's units), so that no device waits on another.
    """
    if config.lax_map_scanned_layers:
        batch_size = config.lax_map_batch_size
    if batch_size is None:
        return jax.vmap(fn)(*stacked)
    shards = sharding.shards

    def local_map(*xs):
        return jax.lax.map(lambda xs: fn(*xs), xs, batch_size=batch_size)

    if shards == 1:
        return local_map(*stacked)
    split = jax.tree.map(
        lambda x: sharding.constrain(
            x.reshape(shards, -1, *x.shape[1:]), sharding.stack_spec
        ),
        stacked,
    )
    out = jax.vmap(local_map)(*split)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)


def _stacked(config: KronConfig, step: _Step, tensors: list) -> list[jax.Array]:
    """Per-parameter tensors as stacks of units, in the factors' compute dtype."""
    tree, sharding = step.tree, step.sharding
    # Views of shape (layers?, *merged shape).
    views = [
        working(config, x.reshape(lead + plan.shape))
        for x, plan, lead in zip(tensors, tree.plans, step.leads, strict=True)
    ]
    # Gathered whole first: the SPMD partitioner moves a sharded tensor into
    # blocks only by full rematerialisation, and gathering is cheaper and
    # predictable (BENCHMARKS.md's git history, kron_sharded).
    views = [sharding.constrain(v, PartitionSpec()) for v in views]
    return [
        sharding.constrain(x, sharding.stack_spec)
        for x in layout.to_stacks(views, tree.plans, tree.stacks)
    ]


def _per_stack(step: _Step, per_parameter: list, padding_entry: Callable) -> list:
    """Per stack, the entries of its members concatenated, then
    ``padding_entry(n, like)`` for its n padding units."""
    out = []
    for stack in step.tree.stacks:
        parts = [per_parameter[i] for i in stack.members]
        padding = len(stack.extents) - stack.real_units
        parts.append(padding_entry(padding, stack, parts[0]))
        out.append(jnp.concatenate(parts))
    return out
