"""Kron's state to and from distributed-kron 1.0.0's: its counts, momentum and
factors copied between the two layouts, for a checkpoint that moves either way.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from precond._common.kron_plan import StackPlan, TensorPlan, seed_factor_sizes
from precond.jax._core import factor_kernels as km
from precond.jax.kron._config import KronConfig, kron_config, plan_tree
from precond.jax.kron._state import KronState, factor_of, init, stored
from precond.jax.kron.transform import _core_arguments, scale_by_kron


def _seed_factors_of_parameter(
    config: KronConfig,
    plan: TensorPlan,
    lead: tuple[int, ...],
    stack: StackPlan,
    stored_stack: tuple,
    start: int,
    units: int,
) -> list[jax.Array]:
    """distributed-kron's factors (one per axis, shaped (layers?, blocks?,
    *factor)) of the parameter whose ``units`` units begin at ``start`` of
    ``stack``."""
    blocked = config.partition_grads_into_blocks
    sizes = seed_factor_sizes(plan, blocked, config.block_size)
    scale = float(config.preconditioner_init_scale) ** (1 / len(sizes))
    unit_axes = lead + ((math.prod(plan.blocks_per_axis),) if blocked else ())
    factors = []
    for axis, array in enumerate(stored_stack):
        Q = _padded_seed_factor(
            config,
            array[start : start + units],
            stack.diagonal[axis],
            stack.block_shape[axis],
            sizes[axis],
            scale,
        )
        factors.append(Q.astype(config.precond_dtype).reshape(*unit_axes, *Q.shape[1:]))
    return factors


def _padded_seed_factor(
    config: KronConfig,
    F: jax.Array,
    diagonal: bool,
    size: int,
    target: int,
    scale: float,
) -> jax.Array:
    """Factors Q (units, size[, size]) from their stored arrays ``F``, padded to
    distributed-kron's ``target`` size with the initial factor ``scale``·I."""
    if diagonal:
        Q = F.astype(jnp.float32 if not km.is_complex(F) else F.dtype)
        return jnp.pad(Q, [(0, 0), (0, target - size)], constant_values=scale)
    Q = jax.vmap(partial(factor_of, config))(F)
    padding = scale * jnp.eye(target, dtype=Q.dtype)
    return (
        jnp.broadcast_to(padding, (len(F), target, target)).at[:, :size, :size].set(Q)
    )


def _split_chain_state(state: Any) -> tuple[Any, Callable]:
    """The scale_by_kron state inside ``state`` (itself, or the first member of a
    ``kron`` chain's tuple) and a function that builds the same kind of state
    around a replacement (for a chain, its learning rate's state, the last
    member, follows; ``middle`` goes between them)."""
    if isinstance(state, tuple | list) and not isinstance(state, KronState):
        return state[0], lambda first, middle=(): type(state)(
            (first, *middle, state[-1])
        )
    return state, lambda first, middle=(): first


def _core_config(kwargs: dict) -> KronConfig:
    """The config of ``scale_by_kron`` given ``kron``'s arguments ``kwargs``
    (its own ignored), validated as ``scale_by_kron`` validates them."""
    bound = inspect.signature(scale_by_kron).bind(**_core_arguments(kwargs))
    bound.apply_defaults()
    return kron_config(bound.arguments)


def kron_state_from_distributed_kron(
    state: Any, params: Any, **kwargs: Any
) -> KronState | tuple:
    """Converts a distributed-kron 1.0.0 state (its dict, or its ``kron`` chain's
    tuple, e.g. from a checkpoint) into the state of ``kron(**kwargs)`` (or of
    ``scale_by_kron``, for a dict alone).

    ``kwargs`` are the arguments the state was made with (and precond's own, e.g.
    ``merge_rule='distributed_kron'`` for its factor shapes). Counts and momentum
    are copied; each factor Q is copied into precond's layout. Where
    distributed-kron padded an axis up to a multiple of ``block_size``, the
    factor's leading part is kept (Q is upper triangular, so that part alone
    determines the preconditioner of the real entries). Only the 'EQ' style
    (distributed-kron's) has an equivalent state.

    Example (``old_state`` would come from a distributed-kron checkpoint; here it
    is :func:`kron_state_to_distributed_kron` of a precond state):
        >>> import jax.numpy as jnp
        >>> from precond.jax import kron
        >>> params = {"w": jnp.ones((4, 3))}
        >>> kwargs = dict(merge_rule="distributed_kron")
        >>> ours = kron(**kwargs).init(params)
        >>> old_state = kron_state_to_distributed_kron(ours, params, **kwargs)
        >>> state = kron_state_from_distributed_kron(old_state, params, **kwargs)

    Args:
        state: the state to convert (a dict of distributed-kron's, or its chain's
            tuple).
        params: the parameters (or their shapes).
        **kwargs: the arguments of ``kron`` the state was made with.

    Returns:
        The :class:`KronState` (or the ``kron`` chain's state) holding the same counts,
        momentum and factors.
    """
    seed_state, put_back = _split_chain_state(state)
    config = _core_config(kwargs)
    template = init(config, params)
    if not isinstance(template.preconditioners, tuple):  # no parameters
        return put_back(template)
    treedef, _, stacks, _ = plan_tree(config, params)
    seed_factors = treedef.flatten_up_to(seed_state["Qs_preconditioners"])
    factors = tuple(
        _stack_from_seed_factors(config, stack, stored_stack, seed_factors)
        for stack, stored_stack in zip(stacks, template.preconditioners, strict=True)
    )
    mu = seed_state["mu"]
    if template.mu is not None:
        mu = jax.tree.map(lambda m, t: jnp.asarray(m, t.dtype), mu, template.mu)
    return put_back(
        template._replace(
            count=jnp.asarray(seed_state["count"], jnp.int32),
            mu=mu if template.mu is not None else None,
            preconditioners=factors,
            update_counter=jnp.asarray(seed_state["update_counter"], jnp.int32),
        )
    )


def _stack_from_seed_factors(
    config: KronConfig, stack: StackPlan, stored_stack: tuple, seed_factors: list
) -> tuple[jax.Array, ...]:
    """One stack's stored factors with distributed-kron's factors of its members
    (per parameter, per axis) cut to the stack's block and copied in."""
    axes = []
    for axis, array in enumerate(stored_stack):
        size, diagonal = stack.block_shape[axis], stack.diagonal[axis]
        q_ndim = 1 if diagonal else 2
        parts = []
        for i in stack.members:
            Q = jnp.asarray(seed_factors[i][axis])
            Q = Q.reshape(-1, *Q.shape[Q.ndim - q_ndim :])
            parts.append(Q[(slice(None), *[slice(0, size)] * q_ndim)])
        Q = jnp.concatenate(parts).astype(array.dtype)
        if not diagonal:
            Q = jax.vmap(partial(stored, config))(Q)
        axes.append(array.at[: len(Q)].set(Q.astype(array.dtype)))
    return tuple(axes)


def kron_state_to_distributed_kron(
    state: Any, params: Any, **kwargs: Any
) -> dict | tuple:
    """Converts the state of ``kron(**kwargs)`` (or of ``scale_by_kron``) into
    distributed-kron 1.0.0's layout: ``dict(count, mu, Qs_preconditioners,
    update_counter)``, its factors a tree like the params of per-axis lists of
    arrays shaped (layers?, blocks?, *factor). The inverse of
    :func:`kron_state_from_distributed_kron`; where distributed-kron pads an axis
    up to a multiple of ``block_size``, the padding gets its initial factor
    (identity times ``preconditioner_init_scale``^{1/k}). Only the 'EQ' style.

    Args:
        state: the state of ``kron(**kwargs)`` or of ``scale_by_kron``.
        params: the parameters (or their shapes).
        **kwargs: the arguments of ``kron`` the state was made with.

    Returns:
        distributed-kron's state: its dict, or the tuple of its ``kron`` chain.

    Example (a 4×3 matrix, one 256-wide block per axis as distributed-kron pads it):

        >>> import jax, jax.numpy as jnp
        >>> from precond.jax import kron
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> theirs = kron_state_to_distributed_kron(kron().init(params), params)
        >>> jax.tree.map(jnp.shape, theirs[0]["Qs_preconditioners"])
        {'w': [(1, 256, 256), (1, 256, 256)]}
    """
    kron_state, put_back = _split_chain_state(state)
    config = _core_config(kwargs)
    if config.preconditioner_update_style != "EQ":
        raise ValueError(
            "Invalid preconditioner_update_style="
            f"{config.preconditioner_update_style!r}: must be 'EQ' for a "
            "distributed-kron state"
        )
    treedef, plans, stacks, _ = plan_tree(config, params)
    param_leaves = treedef.flatten_up_to(params)
    leads = [p.lead(x.shape) for p, x in zip(plans, param_leaves, strict=True)]
    per_parameter_factors: list[list] = [[] for _ in plans]
    for stack, stored_stack in zip(stacks, kron_state.preconditioners, strict=True):
        start = 0
        for i in stack.members:
            units = math.prod(leads[i]) * math.prod(plans[i].blocks_per_axis)
            per_parameter_factors[i] = _seed_factors_of_parameter(
                config, plans[i], leads[i], stack, stored_stack, start, units
            )
            start += units
    mu = kron_state.mu
    # distributed-kron's chain has add_decayed_weights between its core and its
    # learning rate when weight_decay > 0 (precond's keeps the state of none).
    weight_decay = kwargs.get("weight_decay", 0.0)
    decay = ()
    if weight_decay > 0.0:
        decay_transform = optax.add_decayed_weights(
            weight_decay, kwargs.get("weight_decay_mask")
        )
        decay = (decay_transform.init(params),)
    return put_back(
        {
            "count": kron_state.count,
            "mu": mu,
            "Qs_preconditioners": treedef.unflatten(per_parameter_factors),
            "update_counter": kron_state.update_counter,
        },
        decay,
    )
