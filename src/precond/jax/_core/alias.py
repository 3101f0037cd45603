"""The alias layer shared by precond's JAX optimizers (DESIGN.md §4.3)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import optax

from precond._common.validation import check_real, is_concrete_number
from precond.jax._core.argument_trees import check_bool_leaves, check_fits_params
from precond.jax._core.guards import is_params_placeholder

MASK_RULE = (
    "None, a pytree of bools (a prefix of the params' tree) or a callable of the "
    "params returning one"
)


def _check_mask(name: str, value: Any) -> None:
    """None, a callable of the params, or a pytree of bools (a prefix of the
    params' tree: :func:`with_mask_checked_at_init` matches it at ``init``)."""
    if value is None or callable(value):
        return
    check_bool_leaves(name, value, MASK_RULE)


def with_mask_checked_at_init(
    transform: optax.GradientTransformation, name: str, mask: Any
) -> optax.GradientTransformation:
    """``transform`` whose ``init`` first checks the mask argument ``name``
    against the params (a callable mask is called on them): a pytree of bools,
    a prefix of the params' tree (optax.masked's rule). Otherwise optax fails
    at the first update with a bare pytree error naming neither."""
    if mask is None:
        return transform

    def init_fn(params):
        if not is_params_placeholder(params):
            tree = mask(params) if callable(mask) else mask
            check_bool_leaves(name, tree, MASK_RULE)
            check_fits_params(name, tree, params, prefix=True)
        return transform.init(params)

    return transform._replace(init=init_fn)


# The arguments the aliases (kron, xmat, low_rank_approximation, affine) add to
# their cores, with their checks: Invalid <name>=<value!r>: must be <rule>.
ALIAS_ARGUMENT_CHECKS = {
    "learning_rate": functools.partial(check_real, low=0.0, allow_schedule=True),
    "weight_decay": functools.partial(check_real, low=0.0),
    "weight_decay_mask": _check_mask,  # kron's name
    "mask": _check_mask,  # psgd-jax's name
}


def with_decay_and_learning_rate(
    core: optax.GradientTransformation,
    learning_rate: float | Callable,
    weight_decay: float,
    weight_decay_mask: Any | Callable | None,
    *,
    mask_name: str = "weight_decay_mask",
) -> optax.GradientTransformationExtraArgs:
    """``chain(core, decay_and_learning_rate(...))``: θ ← θ − lr·(U + λ·mask⊙θ).

    The state is ``(core's state, the learning rate's state)`` whatever
    ``weight_decay`` is, so that ``optax.inject_hyperparams``, which passes λ as
    an array (it cannot know it is 0), gives the plain optimizer's state."""
    for name, value in (
        ("learning_rate", learning_rate),
        ("weight_decay", weight_decay),
        (mask_name, weight_decay_mask),
    ):
        ALIAS_ARGUMENT_CHECKS[name](name, value)
    decay = decay_and_learning_rate(learning_rate, weight_decay, weight_decay_mask)
    return optax.chain(
        core, with_mask_checked_at_init(decay, mask_name, weight_decay_mask)
    )


def decay_and_learning_rate(
    learning_rate: float | Callable,
    weight_decay: float,
    weight_decay_mask: Any | Callable | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.add_decayed_weights`` then ``optax.scale_by_learning_rate``, as one
    transformation with the state of the latter: U ↦ −lr·(U + λ·mask⊙θ). The
    decay is skipped (not computed) when λ is a concrete 0; either way the state
    is the same (the decay has none)."""
    scale = optax.scale_by_learning_rate(learning_rate)
    decay = None
    if not (is_concrete_number(weight_decay) and weight_decay == 0):
        decay = optax.add_decayed_weights(weight_decay, weight_decay_mask)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if decay is not None:
            if params is None:
                raise ValueError(
                    "weight_decay needs the parameters: call update(updates, state, "
                    "params)"
                )
            updates, _ = decay.update(updates, decay.init(params), params)
        return scale.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(scale.init, update_fn)


def arguments_for(function: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``arguments`` (an alias's ``locals()``) that ``function``
    takes, by name: how an alias passes its arguments on to its ``scale_by_*``."""
    names = inspect.signature(function).parameters
    return {name: value for name, value in arguments.items() if name in names}
