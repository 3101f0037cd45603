"""Gradients and Hessian-vector products for Newton-mode PSGD, in one pass.

``hessian_helper`` returns what an optimizer's ``update`` takes in Newton mode
(``Hvp``, ``vector``, ``update_preconditioner``), as psgd-jax's helper does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precond._common.validation import check_bool, check_real, is_concrete_number
from precond.jax._core.factor_kernels import conj

_HELPER_PARAMETERS = (
    "key",
    "train_step",
    "loss_fn",
    "params",
    "loss_fn_extra_args",
    "has_aux",
    "preconditioner_update_probability",
)
_HELPER_DEFAULTS = {
    "loss_fn_extra_args": (),
    "has_aux": False,
    "preconditioner_update_probability": 1.0,
}


def _bind_helper_arguments(args: tuple, kwargs: dict) -> dict:
    """psgd-jax's ``(key, train_step, loss_fn, params, ...)``, or, when the second
    positional argument is the loss function (psgd-jax's README and precond's
    older form), ``(key, loss_fn, params, ...)`` with an optional ``train_step``
    keyword."""
    names: list[str] = list(_HELPER_PARAMETERS)
    if len(args) >= 2 and callable(args[1]):
        names.remove("train_step")
    if len(args) > len(names):
        raise TypeError(
            f"hessian_helper() takes at most {len(names)} positional arguments "
            f"({len(args)} given)"
        )
    bound: dict[str, Any] = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name not in _HELPER_PARAMETERS:
            raise TypeError(
                f"hessian_helper() got an unexpected keyword argument {name!r}"
            )
        if name in bound:
            raise TypeError(
                f"hessian_helper() got multiple values for argument {name!r}"
            )
        bound[name] = value
    for name, default in _HELPER_DEFAULTS.items():
        bound.setdefault(name, default)
    bound.setdefault("train_step", None)
    missing = [name for name in ("key", "loss_fn", "params") if name not in bound]
    if missing:
        raise TypeError(f"hessian_helper() missing required arguments: {missing}")
    return bound


def hessian_helper(*args, **kwargs) -> tuple[Any, Any, Any, Any, jax.Array]:
    """Loss, gradients and, on preconditioner-update steps, a Hessian-vector product.

    Called as psgd-jax's ``hessian_helper(key, train_step, loss_fn, params,
    loss_fn_extra_args=(), has_aux=False, preconditioner_update_probability=1.0)``
    (its signature, which ``inspect.signature`` reports); ``(key, loss_fn,
    params, ...)`` without ``train_step`` (or with it as a keyword) works too.

    With v ~ N(0, I) drawn like the parameters (``optax.tree.random_like``),
    g(θ) = ∇L(θ) and h = H·v = ∂g/∂θ·v, g and h come from one forward-over-reverse
    ``jax.jvp`` of g. The key is split as psgd-jax splits it (v from the first
    half, the decision from the second), so the same key gives psgd-jax's v and
    decision. The step updates the preconditioner with probability
    ``preconditioner_update_probability``, and always while ``train_step`` < 2;
    otherwise a ``lax.cond`` computes only the loss and g, and h and v are zeros
    (as psgd-jax returns them). Without ``train_step`` a concrete probability 0
    traces no Hessian-vector product at all.

    Complex parameters: ``jax.grad`` of a real loss returns the conjugate of the
    descent direction (conj of 2∂L/∂z̄), and optax applies updates as p + u, so,
    as optax's own complex-valued tests do, complex leaves of ``grads`` and
    ``hvp`` are returned conjugated: g = 2∂L/∂z̄ and h = H·v with the Hermitian
    Hessian H; ``vector`` is circular complex normal (E|v|² = 1). Real leaves
    are untouched.

    Args:
        key: PRNG key of this step (the update decision and v).
        train_step: the step count (an int or int array): steps 0 and 1 always
            update the preconditioner. May be omitted (see above).
        loss_fn: ``loss_fn(params, *loss_fn_extra_args)`` → loss, or (loss, aux)
            with ``has_aux``.
        params: the parameters θ.
        loss_fn_extra_args: further positional arguments of ``loss_fn``.
        has_aux: ``loss_fn`` returns (loss, aux).
        preconditioner_update_probability: probability in [0, 1] of an update.

    Returns:
        ``(loss_out, grads, hvp, vector, update_preconditioner)``, where
        ``loss_out`` is the loss or (loss, aux); pass the last three to
        ``optimizer.update(grads, state, params, Hvp=hvp, vector=vector,
        update_preconditioner=update_preconditioner)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def loss_fn(params):
        ...     return jnp.sum(params["w"] ** 2)
        >>> loss_out, grads, hvp, vector, update = hessian_helper(
        ...     jax.random.PRNGKey(0), 0, loss_fn, {"w": jnp.ones(3)})
        >>> float(loss_out)
        3.0
    """
    bound = _bind_helper_arguments(args, kwargs)
    key, train_step = bound["key"], bound["train_step"]
    loss_fn, params = bound["loss_fn"], bound["params"]
    loss_fn_extra_args, has_aux = bound["loss_fn_extra_args"], bound["has_aux"]
    preconditioner_update_probability = bound["preconditioner_update_probability"]
    _check_helper_arguments(bound)
    vector_key, decision_key = jax.random.split(key)
    value_and_grad = jax.value_and_grad(
        _checked_loss(loss_fn, has_aux), has_aux=has_aux
    )
    gradients = (value_and_grad, loss_fn_extra_args)
    without_hvp = functools.partial(_gradients_without_hvp, *gradients)
    with_hvp = functools.partial(_gradients_with_hvp, *gradients, vector_key)
    never = train_step is None and (
        is_concrete_number(preconditioner_update_probability)
        and preconditioner_update_probability == 0
    )
    if never:
        return (*without_hvp(params), jnp.asarray(False))
    update = jax.random.uniform(decision_key) < preconditioner_update_probability
    if train_step is not None:
        update = update | (jnp.asarray(train_step) < 2)
    loss_out, grads, hvp, vector = jax.lax.cond(update, with_hvp, without_hvp, params)
    return loss_out, grads, hvp, vector, update


def _check_helper_arguments(bound: dict) -> None:
    """``hessian_helper``'s arguments (bound by name): ``loss_fn`` a callable
    that ``(params, *loss_fn_extra_args)`` fits (where its signature is known),
    ``loss_fn_extra_args`` a tuple or list, ``has_aux`` a bool, the probability
    in [0, 1]: errors naming the argument."""
    check_real(
        "preconditioner_update_probability",
        bound["preconditioner_update_probability"],
        low=0.0,
        high=1.0,
    )
    loss_fn, params = bound["loss_fn"], bound["params"]
    extra_args, has_aux = bound["loss_fn_extra_args"], bound["has_aux"]
    if not callable(loss_fn):
        raise TypeError(
            f"Invalid loss_fn={loss_fn!r}: must be a callable "
            "loss_fn(params, *loss_fn_extra_args)"
        )
    if not isinstance(extra_args, tuple | list):
        raise TypeError(
            f"Invalid loss_fn_extra_args={extra_args!r}: must be a tuple (or list) "
            "of loss_fn's positional arguments after params"
        )
    check_bool("has_aux", has_aux)
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin, or a callable without one
        return
    try:
        signature.bind(params, *extra_args)
    except TypeError as error:
        raise TypeError(
            f"Invalid loss_fn_extra_args={extra_args!r}: loss_fn{signature} is "
            f"called as loss_fn(params, *loss_fn_extra_args): {error}"
        ) from None


def _kind_of(value) -> str:
    if hasattr(value, "shape"):
        return f"an array of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _checked_loss(loss_fn, has_aux):
    """``loss_fn``, with its output checked where it is traced: (loss, aux)
    with ``has_aux``, else the loss alone, a scalar either way."""

    def loss(params, *extra_args):
        out = loss_fn(params, *extra_args)
        is_pair = isinstance(out, tuple | list) and len(out) == 2
        if has_aux and not is_pair:
            raise TypeError(
                "Invalid has_aux=True: loss_fn must then return (loss, aux); it "
                f"returned {_kind_of(out)}"
            )
        if not has_aux and isinstance(out, tuple | list):
            raise TypeError(
                f"Invalid has_aux=False: loss_fn returned a {type(out).__name__}; "
                "pass has_aux=True if it is (loss, aux)"
            )
        shape = np.shape(out[0] if has_aux else out)
        if shape != ():
            raise TypeError(f"loss_fn must return a scalar loss; got shape {shape}")
        return out

    return loss


def _gradients_without_hvp(value_and_grad, extra_args, params):
    """(loss_out, conj(g), 0, 0): the loss and gradients only."""
    loss_out, grads = value_and_grad(params, *extra_args)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return loss_out, jax.tree.map(conj, grads), zeros, zeros


def _gradients_with_hvp(value_and_grad, extra_args, vector_key, params):
    """(loss_out, conj(g), conj(H·v), v) with v ~ N(0, I) drawn from
    ``vector_key``: one forward-over-reverse ``jax.jvp`` of g."""
    vector = optax.tree.random_like(vector_key, params, jax.random.normal)
    (loss_out, grads), (_, hvp) = jax.jvp(
        lambda p: value_and_grad(p, *extra_args), (params,), (vector,)
    )
    return loss_out, jax.tree.map(conj, grads), jax.tree.map(conj, hvp), vector


hessian_helper.__signature__ = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for name in _HELPER_PARAMETERS[:4]
    ]
    + [
        inspect.Parameter(
            name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=_HELPER_DEFAULTS[name],
        )
        for name in _HELPER_PARAMETERS[4:]
    ]
)
