"""SOAP's state, where its arrays live on a mesh, and ``init``.

Per-parameter moments are trees like the params (each block's moments in its
eigenbasis, joined back into the parameter's shape); statistics and bases are
(K, n, n) stacks (see ``soap._layout``) split along K over the mesh axes that
``preconditioner_partition_spec`` names (else every mesh axis that shards a
parameter: :mod:`precond.jax._core.mesh_placement`), padded to a multiple of
the devices that split them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from precond.jax._core.guards import check_parameter_dtypes, is_params_placeholder
from precond.jax._core.mesh_placement import ShardingPlan, plan_sharding
from precond.jax.soap._config import Config
from precond.jax.soap._layout import Layout, plan_layout


class SoapState(NamedTuple):
    """State of ``soap`` and ``scale_by_soap``.

    Attributes:
        count: int32 scalar: the steps taken; the first only accumulates the
            statistics and takes their eigenbases, so the Adam step of a later
            step is its ``count`` then.
        mu: like the params: the first moment, in the eigenbasis.
        nu: like the params: the second moment, in the eigenbasis.
        statistics: per block length n, (K, n, n): the moving averages S of the
            grams of every block axis of that length.
        bases: per block length n, (K, n, n): their eigenbases Q (columns).
        skipped: int32 scalar: the steps skipped for unusable gradients.
    """

    count: jax.Array
    mu: Any
    nu: Any
    statistics: tuple
    bases: tuple
    skipped: jax.Array


class _NotParams:
    """A field that is not shaped like the params, for ``optax.tree.map_params``
    (a leaf, so it prefixes the field's whole subtree)."""


def placement(tree: Any, config: Config) -> ShardingPlan:
    """The mesh, every parameter's spec and the axes that split the stacks, for
    params (or gradients) like ``tree``."""
    return plan_sharding(
        tree,
        params_partition_specs=config.params_partition_specs,
        preconditioner_partition_spec=config.preconditioner_partition_spec,
        mesh=config.mesh,
    )


def layout_of(leaves: list, config: Config, sharding: ShardingPlan) -> Layout:
    return plan_layout([tuple(x.shape) for x in leaves], config, sharding.shards)


def stack_dtype(leaves: list, config: Config):
    """Statistics and bases: ``precond_dtype``, else float32 or wider params'."""
    if config.precond_dtype is not None:
        return jnp.dtype(config.precond_dtype)
    return jnp.result_type(jnp.float32, *(moment_dtype(x) for x in leaves))


def moment_dtype(x) -> Any:
    return jnp.promote_types(x.dtype, jnp.float32)


def state_specs(sharding: ShardingPlan, treedef, stacks: int) -> SoapState:
    """The PartitionSpec of every leaf of a state: moments like their parameter,
    stacks split along their rows, counters replicated."""
    specs = sharding.param_specs or [PartitionSpec()] * treedef.num_leaves
    like_params = jax.tree.unflatten(treedef, list(specs))
    rows = (sharding.stack_spec,) * stacks
    scalar: Any = PartitionSpec()  # specs in place of arrays
    return SoapState(scalar, like_params, like_params, rows, rows, scalar)


def init_state(params, config: Config, *, constrain: bool = True) -> SoapState:
    """Moments and statistics at 0, every basis at I, each leaf placed as
    :func:`state_specs` says; ``constrain=False`` places nothing (for
    ``jax.eval_shape`` in ``check_state_matches``)."""
    if is_params_placeholder(params):
        other: Any = _NotParams()
        return SoapState(other, params, params, other, other, other)
    check_parameter_dtypes(params, "soap", complex_ok=False)
    leaves, treedef = jax.tree.flatten(params)
    sharding = placement(params, config)
    layout = layout_of(leaves, config, sharding)
    dtype = stack_dtype(leaves, config)

    def body(leaves):
        def zeros():  # distinct arrays for μ and ν (a step may donate both)
            return [jnp.zeros(x.shape, moment_dtype(x)) for x in leaves]

        mu, nu = zeros(), zeros()
        statistics, bases = [], []
        for stack, n in enumerate(layout.sizes):
            rows = layout.padded(stack)
            statistics.append(jnp.zeros((rows, n, n), dtype))
            bases.append(jnp.broadcast_to(jnp.eye(n, dtype=dtype), (rows, n, n)))
        if constrain:
            mu, nu = sharding.constrain_params(mu), sharding.constrain_params(nu)
            statistics = [
                sharding.constrain(s, sharding.stack_spec) for s in statistics
            ]
            bases = [sharding.constrain(q, sharding.stack_spec) for q in bases]
        return SoapState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.unflatten(treedef, mu),
            nu=jax.tree.unflatten(treedef, nu),
            statistics=tuple(statistics),
            bases=tuple(bases),
            skipped=jnp.zeros([], jnp.int32),
        )

    if not constrain:
        return body(leaves)
    return sharding.run(body, state_specs(sharding, treedef, len(layout.sizes)), leaves)
