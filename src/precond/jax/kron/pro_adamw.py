"""pro on the hidden weight matrices and AdamW on the rest, in one call: the
setting measured best on ``precond bench``'s workloads (BENCHMARKS.md), first
found as an ``optax.multi_transform`` of :func:`precond.jax.pro` and
``optax.adamw`` written by hand.

The parts are ``optax.multi_transform`` of ``pro(learning_rate ×
pro_lr_multiplier, ...)`` and AdamW (``scale_by_adam``, decoupled weight decay,
``learning_rate``) under one step policy: a step with an unusable gradient
anywhere (NaN, ±Inf, or a squared norm that overflows) is skipped by both parts
(state unchanged, parameters moved by weight decay alone), as each of precond's
optimizers skips it; pro's state counts the skipped steps
(:func:`precond.jax.skipped_steps`) and, when asked for, pro logs the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from precond._common import pro_adamw_recipe as recipe
from precond.jax._core.alias import ALIAS_ARGUMENT_CHECKS
from precond.jax._core.argument_trees import check_bool_leaves, check_fits_params
from precond.jax._core.guards import (
    accepting_scalars,
    check_parameter_dtypes,
    check_state_matches,
    is_params_placeholder,
)
from precond.jax._core.step_policy import state_unless_skipped, step_is_usable
from precond.jax.kron._pro_config import PRO_ARGUMENT_CHECKS, PRO_STATIC_ARGS
from precond.jax.kron.pro import pro
from precond.jax.kron.transform import precond_update_prob_schedule

# The labels of optax.multi_transform: Pro's part and AdamW's.
PRO, ADAMW = "pro", "adamw"
PRECONDITIONED_RULE = (
    "None, a pytree of bools (a prefix of the params' tree) or a callable of the "
    "params returning one"
)


def _check_preconditioned(name: str, value: Any) -> None:
    if value is None or callable(value):
        return
    check_bool_leaves(name, value, PRECONDITIONED_RULE)


def _check_probability(name: str, value: Any) -> None:
    recipe.check_probability_or_none(name, value, PRO_ARGUMENT_CHECKS[name])


# Every argument of pro_adamw and its check at construction (Invalid
# <name>=<value!r>: must be <rule>), in signature order: the learning rate and
# decay as the aliases check them, pro's own as pro checks them, and the
# recipe's.
PRO_ADAMW_ARGUMENT_CHECKS = {
    "learning_rate": ALIAS_ARGUMENT_CHECKS["learning_rate"],
    "b1": PRO_ARGUMENT_CHECKS["b1"],
    "adam_b1": recipe.PRO_ADAMW_ARGUMENT_CHECKS["adam_b1"],
    "adam_b2": recipe.PRO_ADAMW_ARGUMENT_CHECKS["adam_b2"],
    "adam_eps": recipe.PRO_ADAMW_ARGUMENT_CHECKS["adam_eps"],
    "weight_decay": ALIAS_ARGUMENT_CHECKS["weight_decay"],
    "pro_lr_multiplier": recipe.PRO_ADAMW_ARGUMENT_CHECKS["pro_lr_multiplier"],
    "preconditioned": _check_preconditioned,
    "preconditioner_update_style": PRO_ARGUMENT_CHECKS["preconditioner_update_style"],
    "preconditioner_update_probability": _check_probability,
    "preconditioner_lr": PRO_ARGUMENT_CHECKS["preconditioner_lr"],
    "preconditioner_init_scale": PRO_ARGUMENT_CHECKS["preconditioner_init_scale"],
    "normalize_grads": PRO_ARGUMENT_CHECKS["normalize_grads"],
    "max_size_dense": PRO_ARGUMENT_CHECKS["max_size_dense"],
    "block_size": PRO_ARGUMENT_CHECKS["block_size"],
    "noise_scale": PRO_ARGUMENT_CHECKS["noise_scale"],
    "dtype": PRO_ARGUMENT_CHECKS["dtype"],
    "draws": PRO_ARGUMENT_CHECKS["draws"],
}
# Arguments that fix shapes, code paths or the split: static under
# optax.inject_hyperparams (a callable ``preconditioned`` would be taken for a
# schedule).
PRO_ADAMW_STATIC_ARGS = (
    "preconditioned",
    *(name for name in PRO_STATIC_ARGS if name in PRO_ADAMW_ARGUMENT_CHECKS),
)


def _path_names(path) -> list[str]:
    """The names along a tree path: dict keys and attribute names (sequence
    positions are not names)."""
    names = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            names.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            names.append(entry.name)
    return names


def pro_adamw_hidden_matrices(params: Any) -> Any:
    """The default split of :func:`pro_adamw`: a tree of bools like ``params``,
    True for the hidden-layer weight matrices (see ``preconditioned`` there).

    Args:
        params: the parameters (arrays, ``jax.ShapeDtypeStruct``s or flax boxes).

    Returns:
        A tree of bools like ``params``.

    Example:
        >>> params = {"embed": jnp.zeros((10, 4)), "mlp": jnp.zeros((4, 4)),
        ...           "bias": jnp.zeros(4), "head": jnp.zeros((4, 10))}
        >>> pro_adamw_hidden_matrices(params)
        {'bias': False, 'embed': False, 'head': False, 'mlp': True}
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: recipe.is_hidden_matrix(
            _path_names(path), len(getattr(x, "shape", ()))
        ),
        params,
    )


def _labels(preconditioned: Any) -> Callable[[Any], Any]:
    """optax.multi_transform's labels: PRO where ``preconditioned`` (resolved on
    the params, or the default rule) is True, ADAMW elsewhere, checked to be
    bools that fit the params. ``optax.tree.map_params``'s placeholder passes
    through (masked's init lets it down to each part)."""

    def labels(params):
        if is_params_placeholder(params):
            return params
        if preconditioned is None:
            return jax.tree.map(
                lambda h: PRO if h else ADAMW, pro_adamw_hidden_matrices(params)
            )
        given = preconditioned
        mask = given(params) if callable(given) else given
        check_bool_leaves("preconditioned", mask, PRECONDITIONED_RULE)
        check_fits_params("preconditioned", mask, params, prefix=True)
        return jax.tree.map(lambda flag: PRO if bool(flag) else ADAMW, mask)

    return labels


def _skipping_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` that leaves its state as it was, and returns
    zeros, on an unusable step (its gradients are all NaN then: see
    :func:`_one_step_policy`)."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def update_fn(updates, state, params=None):
        usable = step_is_usable(updates)
        new_updates, new_state = adam.update(updates, state, params)
        new_updates = jax.tree.map(
            lambda u, g: jnp.where(usable, u, 0).astype(g.dtype), new_updates, updates
        )
        return new_updates, state_unless_skipped(usable, new_state, state)

    return optax.GradientTransformation(adam.init, update_fn)


def _one_step_policy(
    parts: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """``parts`` under one decision per step: when any gradient is unusable,
    every gradient is replaced by NaN, so that each part skips the step (Pro by
    its own guard, AdamW by :func:`_skipping_adam`). ``init`` refuses integer
    parameters, ``update`` a state made for other parameters."""

    def init_fn(params):
        if not is_params_placeholder(params):
            check_parameter_dtypes(params, "pro_adamw", complex_ok=True)
        return parts.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        check_state_matches(state, parts.init, params, updates, "pro_adamw")
        usable = step_is_usable(updates)
        updates = jax.tree.map(lambda g: jnp.where(usable, g, jnp.nan), updates)
        return parts.update(updates, state, params, **extra_args)

    return accepting_scalars(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _pro_learning_rate(learning_rate: Any, multiplier: Any) -> Any:
    if callable(learning_rate):
        return lambda count: multiplier * learning_rate(count)
    return multiplier * learning_rate


def _build(arguments: dict[str, Any]) -> optax.GradientTransformationExtraArgs:
    """pro_adamw's transformation from its (checked) arguments."""
    args = dict(arguments)
    learning_rate, decay = args.pop("learning_rate"), args.pop("weight_decay")
    adam = (args.pop("adam_b1"), args.pop("adam_b2"), args.pop("adam_eps"))
    multiplier = args.pop("pro_lr_multiplier")
    labels = _labels(args.pop("preconditioned"))
    if args["preconditioner_update_probability"] is None:
        args["preconditioner_update_probability"] = precond_update_prob_schedule(
            **recipe.PRO_UPDATE_PROBABILITY_SCHEDULE
        )
    pro_part = pro(
        _pro_learning_rate(learning_rate, multiplier),
        lr_style="adam",
        weight_decay=decay,
        **args,
    )
    adam_part = optax.chain(
        _skipping_adam(*adam),
        optax.add_decayed_weights(decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    parts = optax.multi_transform({PRO: pro_part, ADAMW: adam_part}, labels)
    return _one_step_policy(parts)


def pro_adamw(
    learning_rate: float | Callable = 1e-3,
    *,
    b1: float = recipe.PRO_B1,
    adam_b1: float = recipe.ADAM_B1,
    adam_b2: float = recipe.ADAM_B2,
    adam_eps: float = recipe.ADAM_EPS,
    weight_decay: float = recipe.WEIGHT_DECAY,
    pro_lr_multiplier: float = recipe.PRO_LR_MULTIPLIER,
    preconditioned: Any | Callable | None = None,
    preconditioner_update_style: str = recipe.PRO_UPDATE_STYLE,
    preconditioner_update_probability: float | Callable | None = None,
    preconditioner_lr: float = 0.5,
    preconditioner_init_scale: float = 1.0,
    normalize_grads: bool = False,
    max_size_dense: int = 16384,
    block_size: int = 256,
    noise_scale: float = 1e-9,
    dtype: Any = jnp.float32,
    draws: str = "distributed_kron",
) -> optax.GradientTransformationExtraArgs:
    """PSGD pro (:func:`precond.jax.pro`) on the hidden weight matrices and
    AdamW on everything else, given AdamW's learning rate: θ ← θ − c·lr·(U +
    λθ), with U pro's update and c = ``pro_lr_multiplier`` on the matrices, and
    U = m̂/(√v̂ + ε), c = 1 on the rest. A step with an unusable gradient
    anywhere changes no state and moves θ by weight decay alone.

    Complex parameters train in AdamW's part; pro's refuses them at ``init``.

    Args:
        learning_rate: AdamW's rate lr (a float or a schedule of the step); pro's is
            ``pro_lr_multiplier`` times it.
        b1: pro's momentum coefficient in [0, 1) (bias-corrected).
        adam_b1: AdamW's first-moment decay β₁.
        adam_b2: AdamW's second-moment decay β₂.
        adam_eps: AdamW's ε, added to √v̂.
        weight_decay: decoupled weight decay λ of both parts.
        pro_lr_multiplier: pro's rate over AdamW's (pro runs with ``lr_style='adam'``,
            which divides its update by 5).
        preconditioned: which leaves pro takes. None: the default rule
            (:func:`pro_adamw_hidden_matrices`), leaves of at least 2 dimensions whose
            path names no embedding (a word starting with 'emb' in any name) and, in its
            first name or last two, no position table or output head ('wte', 'wpe',
            'pos', 'position', 'positional', 'head', 'logits', 'output', 'classifier',
            'readout'). Else a pytree of bools (a prefix of the params' tree) or a
            callable of the params returning one, True for pro's leaves. AdamW takes the
            others.
        preconditioner_update_style: pro's fit, 'QEQ', 'PRO' or 'QUAD'.
        preconditioner_update_probability: p, or a schedule p(step): the factors are
            fitted once 1/p steps have passed since the last fit; None for
            ``precond_update_prob_schedule(min_prob=0.2, decay=0.005, flat_start=200)``.
        preconditioner_lr: the fit's step size η (over the Lipschitz estimate).
        preconditioner_init_scale: every factor starts as this times identity.
        normalize_grads: divide each of pro's momentum tensors by its norm first.
        max_size_dense: matrix sides longer than this get a diagonal factor.
        block_size: length of the blocks a dense side is split into.
        noise_scale: δ, the floor of the fit's damping noise.
        dtype: float32 or bfloat16, of pro's momentum and factors.
        draws: 'distributed_kron' or 'compact' (see :func:`precond.jax.pro`).

    Returns:
        An ``optax.GradientTransformationExtraArgs``: an ``optax.multi_transform`` of
        :func:`pro` on the preconditioned parameters and ``optax.adamw`` on the rest,
        both skipping a step together.

    Example:
        >>> optimizer = pro_adamw(learning_rate=3e-3)
        >>> params = {"embedding": jnp.zeros((16, 4)), "mlp": jnp.ones((4, 4))}
        >>> state = optimizer.init(params)
        >>> updates, state = optimizer.update(params, state, params)
    """
    arguments = dict(locals())
    for name, value in arguments.items():
        PRO_ADAMW_ARGUMENT_CHECKS[name](name, value)
    return _build(arguments)
