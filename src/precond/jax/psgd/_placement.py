"""Where the state of PSGD XMat, LRA and Affine lives on a device mesh.

Three keyword-only arguments, as Kron's: ``params_partition_specs`` (a
PartitionSpec per parameter; or boxed params, or the params' types on an
explicit mesh), ``preconditioner_partition_spec`` (the mesh axes that split
the factors) and ``mesh`` (else the context mesh of ``jax.set_mesh``).

* The momentum (and the update) follow their parameter.
* Every factor is split along its first axis: the n entries of XMat's a, b and
  of LRA's U, V, d (all parameters flattened), the rows of Affine's Q_l, Q_r.
  That axis is zero-padded to a multiple of the number of pieces k, so each
  device holds 1/k of it. The fit and P·m see the factors without the padding,
  so the math is the unsharded one: the compiler moves entries where a step
  needs them (XMat's anti-diagonal pairs entry i with n−1−i; LRA's Uᵀm sums
  over all n), and only the order of those sums changes.

Without any of the three arguments nothing is placed or padded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from precond.jax._core.mesh_placement import ShardingPlan, plan_sharding

PLACEMENT_ARGUMENTS = (
    "params_partition_specs",
    "preconditioner_partition_spec",
    "mesh",
)


def psgd_sharding(tree: Any, arguments: dict[str, Any]) -> ShardingPlan | None:
    """The placement of a state for params like ``tree``; None when none of
    :data:`PLACEMENT_ARGUMENTS` is given (their values in ``arguments``).
    Factors are split only over the axes ``preconditioner_partition_spec`` names."""
    if all(arguments[name] is None for name in PLACEMENT_ARGUMENTS):
        return None
    plan = plan_sharding(
        tree, **{name: arguments[name] for name in PLACEMENT_ARGUMENTS}
    )
    if arguments["preconditioner_partition_spec"] is None:
        plan = plan._replace(unit_axes=())
    return plan


def _placed(x: jax.Array, spec: PartitionSpec, plan: ShardingPlan) -> jax.Array:
    if not plan.explicit:
        return plan.constrain(x, spec)
    on_mesh = isinstance(plan.mesh, jax.sharding.Mesh)
    return jax.sharding.reshard(x, NamedSharding(plan.mesh, spec) if on_mesh else spec)


def placed_like_params(tree: Any, plan: ShardingPlan | None) -> Any:
    """``tree`` (like the params: momentum, update) placed as the params."""
    if tree is None or plan is None or plan.param_specs is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(
        [_placed(x, s, plan) for x, s in zip(leaves, plan.param_specs, strict=True)]
    )


def placed_factors(factors: Any, plan: ShardingPlan | None) -> Any:
    """Every factor's first axis zero-padded to a multiple of the plan's pieces
    and split over its unit axes (the factors as they are without a plan)."""
    if plan is None or not plan.unit_axes:
        return factors
    shards = plan.shards

    def place(x):
        if x.ndim == 0:
            return x
        extra = -x.shape[0] % shards
        if extra:
            x = jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1))
        return _placed(x, plan.stack_spec, plan)

    return jax.tree.map(place, factors)


def unpadded_factors(factors: Any, shapes: Any) -> Any:
    """Inverse of :func:`placed_factors`'s padding: each factor cut to the first
    axis of its shape in ``shapes`` (a tree like ``factors``)."""
    return jax.tree.map(
        lambda x, s: x if x.shape == s.shape else x[: s.shape[0]], factors, shapes
    )
