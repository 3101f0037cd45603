"""Kron's state: :class:`KronState`, how factors are stored, and ``init``.

A triangular factor Q is stored by the config's cache layout (see
``scale_by_kron``'s ``preconditioner_cache``): 'packed' (d + 1, d) with QᵀQ in
Q's unused lower triangle, 'dense' (2, d, d) Q and QᵀQ, or None: Q alone. A
diagonal factor q is stored as it is. Factors are kept in ``precond_dtype`` (its
complex counterpart for complex parameters) and worked on in at least float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from precond.jax._core import factor_kernels as km
from precond.jax._core.guards import check_parameter_dtypes
from precond.jax._core.mesh_placement import ShardingPlan
from precond.jax.kron._config import KronConfig, TreePlan, plan_tree
from precond.jax.kron._layout import StackPlan

__all__ = [
    "KronState",
    "factor_of",
    "gram_of",
    "init",
    "partition_specs",
    "state_specs",
    "storage_dtype",
    "stored",
    "working",
]


class KronState(NamedTuple):
    """State of :func:`scale_by_kron`: arrays only, so any checkpointer saves it.

    ``skipped`` counts the steps skipped for unusable gradients (see
    :func:`precond.jax.skipped_steps`).

    Attributes:
        count: int32 scalar: the steps taken (skipped steps not counted).
        mu: the momentum, a tree like the params in ``mu_dtype``; None when b1 == 0.
        preconditioners: per stack of equal-shaped units, a tuple of factors per axis,
            each with a leading unit axis (its stored form follows
            ``preconditioner_cache``).
        update_counter: int32 scalar: the steps since the factors were last fitted.
        skipped: int32 scalar: the steps skipped for unusable gradients.
        lipschitz: generation-2 styles only (None for 'EQ'): per stack and axis, the
            float32 Lipschitz estimates of the factor updates, one per unit.
    """

    count: jax.Array  # shape=(), dtype=int32: steps taken (skipped steps not counted)
    mu: optax.Updates | None  # like params, dtype=mu_dtype; None when b1 == 0
    # One empty array (here and in lipschitz) in the state of a tree with no arrays.
    preconditioners: tuple | jax.Array  # per stack of equal-shaped units (see
    # kron._layout), a tuple of factors per axis, each with a leading unit axis:
    # (units, b) diagonal; triangular by preconditioner_cache: None (units, b, b)
    # Q, 'packed' (units, b + 1, b) Q with QᵀQ in its lower triangle, 'dense'
    # (units, 2, b, b);
    # dtype precond_dtype, its complex counterpart in stacks of complex parameters
    update_counter: jax.Array  # shape=(), dtype=int32: steps since the last update
    skipped: jax.Array  # shape=(), dtype=int32: steps skipped (unusable gradients)
    # Generation-2 styles only (None for 'EQ'): per stack, per axis, the (units,)
    # float32 Lipschitz estimates L_i of the factor updates.
    lipschitz: tuple | jax.Array | None = None


# ------------------------------------------------------------------ factor storage


def storage_dtype(config: KronConfig, x: jax.Array) -> jnp.dtype:
    """precond_dtype, or its complex counterpart for complex factors."""
    if km.is_complex(x):
        return km.complex_dtype(config.precond_dtype)
    return config.precond_dtype


def working(config: KronConfig, x: jax.Array) -> jax.Array:
    """A stored factor (or a gradient view) in the compute dtype: at least
    float32, or its complex counterpart for complex arrays."""
    dtype = config.compute_dtype
    return x.astype(km.complex_dtype(dtype) if km.is_complex(x) else dtype)


def stored(config: KronConfig, Q: jax.Array) -> jax.Array:
    """The state array of a matrix factor Q, in the cache layout, precond_dtype."""
    if config.cache == "packed":
        Q = km.pack_factor(Q)
    elif config.cache == "dense":
        Q = jnp.stack([Q, km.factor_gram(Q)])
    return Q.astype(storage_dtype(config, Q))


def stored_factor(config: KronConfig, Q: jax.Array) -> jax.Array:
    """The state array of a factor: a diagonal one as it is, a matrix one by
    :func:`stored`."""
    if km.is_diagonal(Q):
        return Q.astype(storage_dtype(config, Q))
    return stored(config, Q)


def factor_of(config: KronConfig, F: jax.Array) -> jax.Array:
    """Q_i (or the diagonal q_i) from a factor's state array."""
    F = working(config, F)
    if km.is_diagonal(F) or config.cache is None:
        return F
    if config.cache == "dense":
        return F[0]
    Q = km.unpack_factor(F)  # its upper triangle
    if config.preconditioner_update_style == "QUAD":  # symmetric (Hermitian)
        Q = Q + km.conj_transpose(jnp.triu(Q, 1))
    return Q


def gram_of(config: KronConfig, F: jax.Array) -> jax.Array:
    """P_i = Q_iᵀQ_i (Q_iᴴQ_i) from a cached factor's state array."""
    F = working(config, F)
    if km.is_diagonal(F):
        return km.factor_gram(F)
    return km.unpack_gram(F) if config.cache == "packed" else F[1]


# ------------------------------------------------------------------ init


def _momentum_dtype(mu_dtype: Any | None, param: Any) -> jnp.dtype:
    """``mu_dtype`` (default the parameter's), complex for a complex parameter."""
    dtype = jnp.dtype(mu_dtype or param.dtype)
    return km.complex_dtype(dtype) if km.is_complex(param) else dtype


def _leafless_state(config: KronConfig, params: Any) -> KronState:
    """The state of a tree with no arrays, e.g. optax.tree.map_params's
    placeholder: momentum is that tree, and the factors (and Lipschitz estimates)
    one empty array each, a leaf that stands for the factors of any parameters, so
    that this state is a prefix of every real one."""
    return KronState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda x: x, params) if config.keep_momentum else None,
        preconditioners=jnp.zeros((0,), config.precond_dtype),
        update_counter=jnp.zeros([], jnp.int32),
        skipped=jnp.zeros([], jnp.int32),
        lipschitz=jnp.zeros((0,), jnp.float32) if config.generation_2 else None,
    )


def _factor_structure(stacks: list[StackPlan]) -> tuple:
    """A pytree shaped like ``KronState.preconditioners`` (one leaf per factor)."""
    return tuple(tuple(0 for _ in stack.block_shape) for stack in stacks)


def partition_specs(
    sharding: ShardingPlan,
    treedef: Any,
    factors: Any,
    keep_momentum: bool,
    lipschitz: bool,
) -> KronState:
    """The PartitionSpec of every leaf of a KronState: momentum like its parameter,
    factor stacks (and their Lipschitz estimates, if ``lipschitz``) split along
    their unit axis, counters replicated. ``factors`` is any pytree shaped like the
    state's preconditioners."""
    param_specs = sharding.param_specs
    if param_specs is None:
        param_specs = [PartitionSpec()] * treedef.num_leaves
    # A tree shaped like a state whose leaves are specs, not arrays.
    return KronState(
        count=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        mu=treedef.unflatten(param_specs) if keep_momentum else None,
        preconditioners=jax.tree.map(lambda _: sharding.stack_spec, factors),
        update_counter=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        skipped=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        lipschitz=(
            jax.tree.map(lambda _: sharding.stack_spec, factors) if lipschitz else None
        ),
    )


def state_specs(config: KronConfig, tree: TreePlan) -> KronState:
    """:func:`partition_specs` of the state of ``tree`` under ``config``."""
    return partition_specs(
        tree.sharding,
        tree.treedef,
        _factor_structure(tree.stacks),
        config.keep_momentum,
        config.generation_2,
    )


def _init_stack(
    config: KronConfig, stack: StackPlan, sharding: ShardingPlan
) -> tuple[jax.Array, ...]:
    """Factors of every unit of a stack: s^{1/k}·I (or s^{1/k}·1) per axis."""
    precond_dtype = config.precond_dtype
    units = len(stack.extents)
    dtype = km.complex_dtype(precond_dtype) if stack.complex else precond_dtype
    scale = jnp.asarray(config.preconditioner_init_scale, precond_dtype) ** (
        1.0 / len(stack.block_shape)
    )
    factors = []
    for size, diagonal in zip(stack.block_shape, stack.diagonal, strict=True):
        if diagonal:
            factor = (scale * jnp.ones((size,), precond_dtype)).astype(dtype)
        else:
            factor = stored(
                config, (scale * jnp.eye(size, dtype=precond_dtype)).astype(dtype)
            )
        factor = jnp.broadcast_to(factor, (units, *factor.shape))
        factors.append(sharding.constrain(factor, sharding.stack_spec))
    return tuple(factors)


def _initial_momentum(config: KronConfig, tree: TreePlan, params: Any) -> Any:
    """Zeros like the params in the momentum dtype, sharded like them."""
    if not config.keep_momentum:
        return None
    zeros = [
        jnp.zeros_like(p, dtype=_momentum_dtype(config.mu_dtype, p))
        for p in jax.tree.leaves(params)
    ]
    return tree.treedef.unflatten(tree.sharding.constrain_params(zeros))


def _initial_lipschitz(config: KronConfig, tree: TreePlan) -> tuple | None:
    """Zero Lipschitz estimates per stack and axis (generation-2 styles)."""
    if not config.generation_2:
        return None
    sharding = tree.sharding
    return tuple(
        tuple(
            sharding.constrain(
                jnp.zeros(len(s.extents), jnp.float32), sharding.stack_spec
            )
            for _ in s.block_shape
        )
        for s in tree.stacks
    )


def _initial_state(config: KronConfig, tree: TreePlan, params: Any) -> KronState:
    """The state before the first step (see :func:`init`)."""
    sharding = tree.sharding
    mu = _initial_momentum(config, tree, params)
    # Counters replicated like the update's outputs, so the first update
    # compiles for the same input shardings as every later one.
    # (Three arrays, not one: a donated state must not alias a buffer.)
    count, update_counter, skipped = (
        sharding.constrain(jnp.zeros([], jnp.int32), PartitionSpec()) for _ in range(3)
    )
    lipschitz = _initial_lipschitz(config, tree)
    return KronState(
        count=count,
        mu=mu,
        preconditioners=tuple(_init_stack(config, s, sharding) for s in tree.stacks),
        update_counter=update_counter,
        skipped=skipped,
        lipschitz=lipschitz,
    )


def init(config: KronConfig, params: optax.Params) -> KronState:
    """``scale_by_kron``'s init: zero momentum and counts, factors s^{1/k}·I, every
    leaf placed as :func:`state_specs` says."""
    if not jax.tree.leaves(params):
        return _leafless_state(config, params)
    check_parameter_dtypes(params, "PSGD Kron", complex_ok=True)
    tree = plan_tree(config, params)

    def body(params):
        return _initial_state(config, tree, params)

    # run returns what body returns.
    return cast(KronState, tree.sharding.run(body, state_specs(config, tree), params))
