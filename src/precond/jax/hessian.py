"""Gradients and Hessian-vector products for Newton-mode PSGD, in one pass.

``hessian_helper`` returns what an optimizer's ``update`` takes in Newton mode
(``Hvp``, ``vector``, ``update_preconditioner``), as psgd-jax's helper does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from precond._common.validation import check_real, is_concrete_number


def hessian_helper(
    key: jax.Array,
    loss_fn: Callable,
    params: Any,
    loss_fn_extra_args: tuple = (),
    has_aux: bool = False,
    preconditioner_update_probability: float = 1.0,
    *,
    train_step: jax.Array | int | None = None,
) -> tuple[Any, Any, Any, Any, jax.Array]:
    """Loss, gradients and, on preconditioner-update steps, a Hessian-vector product.

    With v ~ N(0, I) (one draw per parameter), g(θ) = ∇L(θ) and h = H·v = ∂g/∂θ·v,
    g and h come from one forward-over-reverse ``jax.jvp`` of g. With probability
    1 − ``preconditioner_update_probability`` (and always for a concrete 0) the
    step does not update the preconditioner: a ``lax.cond`` computes only the loss
    and g, and h is zeros.

    Args:
        key: PRNG key of this step (the update decision and v).
        loss_fn: ``loss_fn(params, *loss_fn_extra_args)`` → loss, or (loss, aux)
            with ``has_aux``.
        params: the parameters θ.
        loss_fn_extra_args: further positional arguments of ``loss_fn``.
        has_aux: ``loss_fn`` returns (loss, aux).
        preconditioner_update_probability: probability in [0, 1] of an update.
        train_step: psgd-jax's step count: steps 0 and 1 always update. (psgd-jax
            takes it as the second positional argument; here it is a keyword.)

    Returns:
        ``(loss_out, grads, hvp, vector, update_preconditioner)``, where
        ``loss_out`` is the loss or (loss, aux); pass the last three to
        ``optimizer.update(grads, state, params, Hvp=hvp, vector=vector,
        update_preconditioner=update_preconditioner)``.

    Example:
        >>> loss_out, grads, hvp, vector, update = hessian_helper(
        ...     key, loss_fn, params)  # doctest: +SKIP
    """
    check_real(
        "preconditioner_update_probability",
        preconditioner_update_probability,
        low=0.0,
        high=1.0,
    )
    decision_key, vector_key = jax.random.split(key)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(vector_key, len(leaves))
    vector = treedef.unflatten(
        [
            jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ]
    )
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def without_hvp(params):
        loss_out, grads = value_and_grad(params, *loss_fn_extra_args)
        return loss_out, grads, jax.tree.map(jnp.zeros_like, params)

    def with_hvp(params):
        (loss_out, grads), (_, hvp) = jax.jvp(
            lambda p: value_and_grad(p, *loss_fn_extra_args), (params,), (vector,)
        )
        return loss_out, grads, hvp

    never = train_step is None and (
        is_concrete_number(preconditioner_update_probability)
        and preconditioner_update_probability == 0
    )
    if never:
        return (*without_hvp(params), vector, jnp.asarray(False))
    update = jax.random.uniform(decision_key) < preconditioner_update_probability
    if train_step is not None:
        update = update | (jnp.asarray(train_step) < 2)
    loss_out, grads, hvp = jax.lax.cond(update, with_hvp, without_hvp, params)
    return loss_out, grads, hvp, vector, update
