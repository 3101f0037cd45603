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
from precond.jax._kron_math import conj

# Extra arguments of an optimizer's ``update`` that switch its fit to Newton mode.
NEWTON_ARGS = ("Hvp", "vector", "update_preconditioner")


def newton_arguments(updates: Any, extra_args: dict) -> dict | None:
    """The Newton-mode extra arguments of ``update``, checked; None if absent.

    All three of :data:`NEWTON_ARGS` or none; ``Hvp`` and ``vector`` must have the
    gradients' structure and shapes.
    """
    given = {name: extra_args.get(name) for name in NEWTON_ARGS}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == len(NEWTON_ARGS):
        return None
    if missing:
        raise ValueError(
            f"Newton-mode fitting needs {', '.join(NEWTON_ARGS)} together; "
            f"missing {', '.join(missing)} (precond.jax.hessian_helper returns "
            "all three)"
        )
    treedef = jax.tree.structure(updates)
    for name in ("Hvp", "vector"):
        if jax.tree.structure(given[name]) != treedef:
            raise ValueError(
                f"Invalid {name}: must have the structure of the gradients "
                f"({treedef}); got {jax.tree.structure(given[name])}"
            )
        for (path, x), g in zip(
            jax.tree_util.tree_flatten_with_path(given[name])[0],
            jax.tree.leaves(updates),
            strict=True,
        ):
            if x.shape != g.shape:
                raise ValueError(
                    f"Invalid {name}{jax.tree_util.keystr(path)}: shape "
                    f"{x.shape} differs from the gradient's {g.shape}"
                )
    return given


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

    Complex parameters: ``jax.grad`` of a real loss returns the conjugate of the
    descent direction (conj of 2∂L/∂z̄), and optax applies updates as p + u, so,
    as optax's own complex-valued tests do, complex leaves of ``grads`` and
    ``hvp`` are returned conjugated: g = 2∂L/∂z̄ and h = H·v with the Hermitian
    Hessian H; ``vector`` is circular complex normal (E|v|² = 1). Real leaves
    are untouched.

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
        return loss_out, jax.tree.map(conj, grads), jax.tree.map(jnp.zeros_like, params)

    def with_hvp(params):
        (loss_out, grads), (_, hvp) = jax.jvp(
            lambda p: value_and_grad(p, *loss_fn_extra_args), (params,), (vector,)
        )
        return loss_out, jax.tree.map(conj, grads), jax.tree.map(conj, hvp)

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
