"""PSGD 'pro': distributed-kron 2.0's generation-2 PSGD recipe as an optax optimizer.

Per parameter (after its leading layer axis when it is a scanned layer), the
momentum m̂ is read as a vector (a 0-D or 1-D parameter, or one whose dims are
all 1 but one) or as a matrix (dims merged into the two most balanced groups) and
preconditioned by P = Q_lᵀQ_l ⊗ Q_rᵀQ_r, a Kronecker product of two factors:

* a side of at most ``max_size_dense`` is *dense* and split into blocks of
  ``block_size``: each block has its own dense factors, a larger side keeps one
  diagonal factor (a vector) along its whole length;
* a vector parameter has one diagonal factor.

Each step fits every block's factors to the noisy momentum G̃ = m̂ + (δ + ε|m̂|)⊙V
(δ = ``noise_scale``, V ~ N(0, I)) with the generation-2 rule
(:func:`precond.jax._core.factor_kernels.update_factors_gen2`: 'PRO', 'QUAD' or
'QEQ', step size ``preconditioner_lr`` over a smoothed Lipschitz estimate, no
triangular solves), rebalances the two factors' norms every 100 steps, and returns
U = clip(P·m̂) with each tensor's RMS clipped to 1.1, divided by 5 when
``lr_style='adam'`` so that Adam's learning rates carry over.

Random draws come from fixed keys folded with the step count: every device and
every resumed run draws the same. With ``draws='distributed_kron'`` (the
default) they are those of distributed-kron 2.0.0, draw for draw, which is what
its trajectory-parity tests check.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

# The layout (merged shapes, blocks, stacks) and the recipe's constants are
# shared with precond.torch.Pro.
from precond._common.kron_constants import MAX_UPDATE_RMS
from precond._common.pro_arguments import PRO_SHARED_ARGUMENT_CHECKS
from precond._common.pro_layout import (  # noqa: F401  (re-exported)
    ADAM_STYLE_DIVISOR,
    BALANCE_EVERY,
    _Plan,
    _plan,
    _Region,
    _Stack,
    merged_shape,
    stream_kind,
)
from precond._common.validation import (
    check_choice,
    check_int,
    is_concrete_number,
)
from precond.jax._core import factor_kernels as km
from precond.jax._core import normal_draws
from precond.jax._core.alias import (
    ALIAS_ARGUMENT_CHECKS,
    arguments_for,
    with_mask_checked_at_init,
)
from precond.jax._core.argument_trees import (
    check_fits_params,
    check_partition_specs_tree,
    check_per_parameter_bools,
    check_scanned_layers,
)
from precond.jax._core.blocks import cut, join
from precond.jax._core.guards import (
    accepting_scalars,
    check_parameter_dtypes,
    check_state_matches,
    is_params_placeholder,
)
from precond.jax._core.mesh_placement import (
    is_box,
    partition_specs_only,
    with_auto_axes,
)
from precond.jax._core.step_policy import (
    SkipWarning,
    fields_unless_skipped,
    keep_if_overflowed,
    next_count,
    skip_counted,
    step_is_usable,
    step_key,
    zeros_unless_usable,
)

# Each key stream's seed (distributed-kron 2.0.0's): blocks of matrices with two
# dense sides share one stream; every other parameter has its own.
_STREAM_SEEDS = {"dense": 42, "diagonal": 43, "columns": 44, "rows": 45, "vector": 46}
DRAWS = ("distributed_kron", "compact")


class ProState(NamedTuple):
    """State of :func:`scale_by_pro`.

    ``factors[s]`` holds stack s's factors, one array per side: (units, d, d) for
    a dense side, (units, d) for a diagonal one (``lipschitz[s]``: (units,) each,
    float32). Stacks group blocks of one shape (see ``_plan``).
    """

    count: jax.Array  # [] int32: steps taken
    mu: Any  # momentum like the params, in ``dtype``; None when b1 == 0
    # Both one placeholder array in the state optax.tree.map_params sees.
    factors: tuple | jax.Array
    lipschitz: tuple | jax.Array
    update_counter: jax.Array  # [] int32: steps since the factors were fitted
    skipped: jax.Array  # [] int32: steps skipped (unusable gradients)


# ------------------------------------------------------------------ the fit


def _padded_draw(width: int) -> Callable:
    """``draw(key, shape, dtype)`` for the sampled norm bounds that draws
    ``width`` columns and keeps the first shape[-1]: distributed-kron's draws on
    its zero-padded blocks (whose padding the estimate never sees)."""

    def draw(key, shape, dtype):
        W = normal_draws.standard_normal(key, (*shape[:-1], width), dtype)
        return W[..., : shape[-1]]

    return draw


def _fit_unit(factors, lipschitz, G, key, *, style, lr, noise_scale, draw_shape):
    """One block's generation-2 fit; returns (factors, lipschitz, P·G).

    ``draw_shape``: the zero-padded block distributed-kron draws for (its draws
    are taken and cut to the block), or None to draw for the block itself.
    """
    diagonal = [km.is_diagonal(Q) for Q in factors]
    dense = [not d for d in diagonal]
    keys, draw = None, None
    if G.ndim == 1:
        Gn = G + noise_scale * normal_draws.standard_normal(key, G.shape, G.dtype)
    else:
        fit_key, noise_key = jax.random.split(key)
        V = normal_draws.standard_normal(noise_key, draw_shape or G.shape, G.dtype)
        V = V[tuple(slice(0, d) for d in G.shape)]
        Gn = km.add_relative_damping_noise(G, V, noise_scale)
        if all(dense):
            keys = list(jax.random.split(fit_key))
        else:
            keys = [fit_key if d else None for d in dense]
        if draw_shape is not None and any(dense):
            draw = _padded_draw(draw_shape[dense.index(True)])
    targets = km.whitening_targets([jnp.ones(d, bool) for d in G.shape], diagonal)
    new_factors, new_lipschitz = km.update_factors_gen2(
        list(factors), list(lipschitz), Gn, targets, lr, style, keys, draw
    )
    new_factors, new_lipschitz = keep_if_overflowed(
        (tuple(new_factors), tuple(new_lipschitz)), (tuple(factors), tuple(lipschitz))
    )
    return new_factors, new_lipschitz, km.precondition(list(new_factors), G)


# ------------------------------------------------------------------ arguments


def _check_dtype(name: str, value) -> None:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"Invalid {name}={value!r}: must be float32 or bfloat16 (a dtype or "
            "its name)"
        )


def _check_optional_axis(name: str, value) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"Invalid {name}={value!r}: must be None or a mesh axis name")


# Every argument of scale_by_pro (and pro's own, from the alias table), with the
# check run at construction: Invalid <name>=<value!r>: must be <rule>, in
# signature order. The arguments precond.torch.Pro takes under the same name and
# rule are checked by precond._common.pro_arguments; the rest are JAX's own and
# checked here: dtype (a jnp dtype), scanned_layers, the pipeline axis, the
# params' partition specs and draws.
_SHARED = PRO_SHARED_ARGUMENT_CHECKS
PRO_ARGUMENT_CHECKS = {
    "lr_style": _SHARED["lr_style"],
    "b1": _SHARED["b1"],
    "normalize_grads": _SHARED["normalize_grads"],
    "max_size_dense": _SHARED["max_size_dense"],
    "preconditioner_lr": _SHARED["preconditioner_lr"],
    "preconditioner_init_scale": _SHARED["preconditioner_init_scale"],
    "preconditioner_update_style": _SHARED["preconditioner_update_style"],
    "dtype": _check_dtype,
    "scanned_layers": check_scanned_layers,
    "block_size": _SHARED["block_size"],
    "pipeline_axis_name": _check_optional_axis,
    "pipeline_axis_size": lambda n, v: check_int(n, v, low=1),
    "params_partition_specs": check_partition_specs_tree,
    "noise_scale": _SHARED["noise_scale"],
    "draws": lambda n, v: check_choice(n, v, DRAWS),
    "preconditioner_update_probability": _SHARED["preconditioner_update_probability"],
}
# Arguments that fix shapes or code paths: static under optax.inject_hyperparams.
PRO_STATIC_ARGS = (
    "lr_style",
    "normalize_grads",
    "max_size_dense",
    "preconditioner_update_style",
    "dtype",
    "scanned_layers",
    "block_size",
    "pipeline_axis_name",
    "pipeline_axis_size",
    "params_partition_specs",
    "draws",
)


# ------------------------------------------------------------------ transform


def _unboxed(tree):
    """(leaves with flax boxes unboxed, treedef, the boxes or None)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_box)
    if not any(is_box(x) for x in leaves):
        return leaves, treedef, None
    return [x.unbox() if is_box(x) else x for x in leaves], treedef, leaves


def _scanned_flags(scanned_layers, params, treedef) -> list[bool]:
    """Per leaf of ``params``, whether it stacks layers: ``scanned_layers``
    (called on ``params`` if callable), checked against them."""
    if scanned_layers is None:
        return [False] * treedef.num_leaves
    flags = scanned_layers(params) if callable(scanned_layers) else scanned_layers
    try:
        entries = treedef.flatten_up_to(flags)
    except (ValueError, TypeError):
        check_fits_params("scanned_layers", flags, params, prefix=False)
        raise
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
    check_per_parameter_bools("scanned_layers", entries, paths)
    return [bool(f) for f in entries]


class _Recipe(NamedTuple):
    """scale_by_pro's arguments as its step uses them (b1 and the rates may be
    arrays under ``optax.inject_hyperparams``)."""

    lr_style: str | None
    b1: Any
    keep_momentum: bool
    normalize_grads: bool
    preconditioner_lr: Any
    style: str
    dtype: jnp.dtype
    noise_scale: Any
    padded_draws: bool  # draws='distributed_kron'
    update_probability: Any
    always_fit: bool  # a concrete update probability of 1
    pipeline_spec: PartitionSpec | None
    params_partition_specs: Any
    init_scale: float
    scanned_layers: Any
    max_size_dense: int
    block_size: int
    pipeline_axis_size: int
    skip_warning: SkipWarning  # this optimizer's, logged at its first skipped step


def _recipe(arguments: dict[str, Any]) -> _Recipe:
    """The recipe of scale_by_pro's (checked) arguments."""
    b1, prob = arguments["b1"], arguments["preconditioner_update_probability"]
    axis = arguments["pipeline_axis_name"]
    return _Recipe(
        lr_style=arguments["lr_style"],
        b1=b1,
        # b1 may be an array under optax.inject_hyperparams: only a concrete 0
        # drops the momentum buffer.
        keep_momentum=not (is_concrete_number(b1) and b1 == 0),
        normalize_grads=arguments["normalize_grads"],
        preconditioner_lr=arguments["preconditioner_lr"],
        style=arguments["preconditioner_update_style"],
        dtype=jnp.dtype(arguments["dtype"]),
        noise_scale=arguments["noise_scale"],
        padded_draws=arguments["draws"] == "distributed_kron",
        update_probability=prob,
        always_fit=is_concrete_number(prob) and prob == 1,
        pipeline_spec=None if axis is None else PartitionSpec(axis),
        params_partition_specs=arguments["params_partition_specs"],
        init_scale=arguments["preconditioner_init_scale"],
        scanned_layers=arguments["scanned_layers"],
        max_size_dense=arguments["max_size_dense"],
        block_size=arguments["block_size"],
        pipeline_axis_size=arguments["pipeline_axis_size"],
        skip_warning=SkipWarning("pro"),
    )


def _constrain(x, spec):
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def _init_factors(plan: _Plan, dtype, init_scale: float, pipeline_spec) -> tuple:
    """(factors, lipschitz) per stack: Q = init_scale·I per side (a vector of
    init_scale for a diagonal side), Lipschitz estimates 0."""
    factors, lipschitz = [], []
    for stack in plan.stacks:
        units = stack.units
        sides = []
        for d, diag in zip(stack.shape, stack.diagonal, strict=True):
            one = jnp.ones(d, dtype) if diag else jnp.eye(d, dtype=dtype)
            Q = jnp.broadcast_to(init_scale * one, (units, *one.shape)).astype(dtype)
            sides.append(_constrain(Q, pipeline_spec))
        factors.append(tuple(sides))
        lipschitz.append(
            tuple(
                _constrain(jnp.zeros(units, jnp.float32), pipeline_spec)
                for _ in stack.shape
            )
        )
    return tuple(factors), tuple(lipschitz)


def _placeholder_state(params, keep_momentum: bool) -> ProState:
    """The state ``optax.tree.map_params`` sees: the momentum is the one tree
    like the params; one leaf stands for all the factor stacks (a prefix of
    any)."""
    empty = jnp.zeros([], jnp.int32)
    return ProState(
        count=empty,
        mu=params if keep_momentum else None,
        factors=empty,
        lipschitz=empty,
        update_counter=empty,
        skipped=empty,
    )


def _momentum(grads, mu, count, recipe: _Recipe) -> tuple[list | None, list]:
    """(new m, m̂) as lists of leaves: m ← β₁m + (1−β₁)g in float32, stored in
    ``dtype``; m̂ = m/(1−β₁ⁿ) (g itself when b1 = 0), divided by its norm
    (+1e-6) with ``normalize_grads``."""
    b1, dtype = recipe.b1, recipe.dtype
    if recipe.keep_momentum:
        mu = [
            (b1 * m.astype(jnp.float32) + (1 - b1) * g.astype(jnp.float32))
            for m, g in zip(mu, grads, strict=True)
        ]
        correction = 1 - jnp.asarray(b1, jnp.float32) ** count
        momentum = [(m / correction).astype(dtype) for m in mu]
        mu = [m.astype(dtype) for m in mu]
    else:
        mu, momentum = None, [g.astype(dtype) for g in grads]
    if recipe.normalize_grads:
        momentum = [m / (jnp.linalg.norm(m) + 1e-6) for m in momentum]
    return mu, momentum


def _fit_decision(count, update_counter, usable, recipe: _Recipe):
    """(fit now, steps since the last fit): the first step always fits (the
    factors start as identities), then once 1/p steps have passed; never on a
    step that is not ``usable`` (a skipped step)."""
    update_counter = update_counter + 1
    if recipe.always_fit:
        do_fit = usable
    else:
        prob = recipe.update_probability
        prob = prob(count) if callable(prob) else prob
        due = update_counter.astype(jnp.float32) >= 1.0 / jnp.asarray(prob, jnp.float32)
        do_fit = usable & ((count == 1) | due)
    return do_fit, jnp.where(do_fit, 0, update_counter)


def _stack_input(stack: _Stack, views: list) -> jax.Array:
    """The stack's blocks of the momentum views, zero units appended as padding."""
    G = jnp.concatenate([cut(views[r.leaf], r.blocks, 1) for r in stack.regions])
    if stack.padding:
        G = jnp.concatenate([G, jnp.zeros((stack.padding, *G.shape[1:]), G.dtype)])
    return G


def _unit_keys(stack: _Stack, stream_sizes: dict, count, pipeline_spec) -> jax.Array:
    """Each unit's key at step ``count``: its index in its stream's split of
    step_key(stream seed, count) (distributed-kron 2.0.0's draws)."""
    splits: dict[tuple, jax.Array] = {}  # a stream's keys depend on (seed, size)
    runs = []
    for stream, index in stack.keys:
        seed, size = _STREAM_SEEDS[stream_kind(stream)], stream_sizes[stream]
        if (seed, size) not in splits:
            splits[seed, size] = jax.random.split(step_key(seed, count), size)
        runs.append(splits[seed, size][index])
    return _constrain(jnp.concatenate(runs), pipeline_spec)


def _fit_stack(stack, keys, factors, lipschitz, G, balance, do_fit, recipe):
    """(factors, lipschitz, P·G) of one stack: balanced (two sides, when
    ``balance``), then fitted unit by unit when ``do_fit``, else only applied
    (a skipped step has neither, so its factors stay as they were)."""
    if len(factors) == 2:
        factors = jax.lax.cond(
            balance,
            lambda f: tuple(jax.vmap(km.balance_factors)(list(f))),
            lambda f: f,
            factors,
        )
    fit = functools.partial(
        _fit_unit,
        style=recipe.style,
        lr=recipe.preconditioner_lr,
        noise_scale=recipe.noise_scale,
        draw_shape=stack.draw_shape if recipe.padded_draws else None,
    )

    def fitted(factors, lipschitz):
        return jax.vmap(fit)(factors, lipschitz, G, keys)

    def kept(factors, lipschitz):
        PG = jax.vmap(lambda f, g: km.precondition(list(f), g))(factors, G)
        return factors, lipschitz, PG

    return jax.lax.cond(do_fit, fitted, kept, factors, lipschitz)


def _fit_all_stacks(plan: _Plan, state: ProState, views, count, do_fit, usable, recipe):
    """(factors, lipschitz, pieces): every stack fitted when ``do_fit`` (factors
    rebalanced every ``BALANCE_EVERY`` steps of a ``usable`` step), and per leaf
    its regions' blocks of P·m̂."""
    balance = usable & (count % BALANCE_EVERY == 0)
    spec = recipe.pipeline_spec
    pieces: dict[int, list] = {}
    new_factors, new_lipschitz = [], []
    for stack, factors, lipschitz in zip(
        plan.stacks, state.factors, state.lipschitz, strict=True
    ):
        keys = _unit_keys(stack, plan.stream_sizes, count, spec)
        G = _constrain(_stack_input(stack, views), spec)
        fitted, fitted_lipschitz, PG = _fit_stack(
            stack, keys, factors, lipschitz, G, balance, do_fit, recipe
        )
        new_factors.append(tuple(_constrain(Q, spec) for Q in fitted))
        new_lipschitz.append(tuple(_constrain(L, spec) for L in fitted_lipschitz))
        start = 0
        for region in stack.regions:
            B = plan.batch[region.leaf]
            units = B * math.prod(region.counts)
            pieces.setdefault(region.leaf, []).append(
                (region.blocks, PG[start : start + units])
            )
            start += units
    return tuple(new_factors), tuple(new_lipschitz), pieces


def _clipped_updates(grads, plan: _Plan, pieces, recipe: _Recipe) -> list:
    """Each leaf's P·m̂ assembled from its pieces, its RMS clipped to MAX_UPDATE_RMS,
    divided by ADAM_STYLE_DIVISOR with lr_style='adam' (zeros for a leaf with
    no entries)."""
    out = []
    for i, (g, merged) in enumerate(zip(grads, plan.merged, strict=True)):
        if merged is None:
            out.append(jnp.zeros_like(g))
            continue
        u = join(pieces[i], (plan.batch[i],)).reshape(g.shape)
        rms = jnp.sqrt(jnp.mean(jnp.square(u.astype(jnp.float32))))
        u = u * (MAX_UPDATE_RMS / jnp.maximum(rms, MAX_UPDATE_RMS)).astype(u.dtype)
        if recipe.lr_style == "adam":
            u = u / jnp.asarray(ADAM_STYLE_DIVISOR, u.dtype)
        out.append(u)
    return out


def _step(grads, state: ProState, plan: _Plan, treedef, recipe: _Recipe):
    """The update of the unboxed gradient leaves: (updates, new state). A step
    with unusable gradients (the JAX step policy) returns zeros and keeps the
    state, but for its count of skipped steps."""
    usable = step_is_usable(grads)
    count = next_count(state.count)
    mu = None if state.mu is None else treedef.flatten_up_to(state.mu)
    mu, momentum = _momentum(grads, mu, count, recipe)
    views = [
        None if merged is None else m.reshape((B, *merged))
        for m, B, merged in zip(momentum, plan.batch, plan.merged, strict=True)
    ]
    do_fit, update_counter = _fit_decision(count, state.update_counter, usable, recipe)
    factors, lipschitz, pieces = _fit_all_stacks(
        plan, state, views, count, do_fit, usable, recipe
    )
    if mu is not None:
        mu = _constrain(treedef.unflatten(mu), recipe.params_partition_specs)
    new_state = ProState(
        count=count,
        mu=mu,
        factors=factors,
        lipschitz=lipschitz,
        update_counter=update_counter,
        skipped=state.skipped,
    )
    updates = _clipped_updates(grads, plan, pieces, recipe)
    # The factors kept their old values in their own update (_fit_all_stacks):
    # a select over them would copy every factor on every step.
    guarded = fields_unless_skipped(
        usable, new_state, state, already_kept=("factors", "lipschitz")
    )
    return zeros_unless_usable(usable, updates, grads), skip_counted(
        usable, guarded, recipe.skip_warning
    )


def _with_boxes(updates, boxes, treedef):
    """``updates`` boxed again as the gradients were (flax partitioning)."""
    if boxes is None:
        return updates
    flat = jax.tree.leaves(updates)
    return treedef.unflatten(
        [
            b.replace_boxed(u) if is_box(b) else u
            for b, u in zip(boxes, flat, strict=False)
        ]
    )


def _plan_for(leaves, treedef, recipe: _Recipe) -> _Plan:
    """The layout of these (unboxed) leaves: merged shapes, blocks, stacks."""
    flags = _scanned_flags(recipe.scanned_layers, treedef.unflatten(leaves), treedef)
    shapes = [tuple(x.shape) for x in leaves]
    return _plan(
        shapes,
        flags,
        recipe.max_size_dense,
        recipe.block_size,
        recipe.pipeline_axis_size,
    )


def _init(params, *, recipe: _Recipe) -> ProState:
    """scale_by_pro's init: m = 0 (in ``dtype``), every factor init_scale·I."""
    if is_params_placeholder(params):
        return _placeholder_state(params, recipe.keep_momentum)
    leaves, treedef, _ = _unboxed(params)
    check_parameter_dtypes(treedef.unflatten(leaves), "PSGD pro", complex_ok=False)
    if recipe.params_partition_specs is not None:
        # Structure, rank, mesh axes and divisibility, against the context mesh
        # (which pro's sharding constraints name), each error naming the leaf.
        partition_specs_only(
            treedef.unflatten(leaves),
            params_partition_specs=recipe.params_partition_specs,
            preconditioner_partition_spec=None,
            mesh=None,
        )
    plan = _plan_for(leaves, treedef, recipe)
    mu = None
    if recipe.keep_momentum:
        mu = treedef.unflatten([jnp.zeros(x.shape, recipe.dtype) for x in leaves])
        mu = _constrain(mu, recipe.params_partition_specs)
    factors, lipschitz = _init_factors(
        plan, recipe.dtype, recipe.init_scale, recipe.pipeline_spec
    )
    return ProState(
        count=jnp.zeros([], jnp.int32),
        mu=mu,
        factors=factors,
        lipschitz=lipschitz,
        update_counter=jnp.zeros([], jnp.int32),
        skipped=jnp.zeros([], jnp.int32),
    )


def _update(updates, state: ProState, params=None, *, recipe: _Recipe, **extra_args):
    """scale_by_pro's update. A state that ``init`` would not make for these
    parameters (another model's) is refused with a ValueError naming the leaf.
    On a mesh with Explicit axes the step runs under auto_axes (its reshapes of
    sharded leaves need it), its outputs sharded as its inputs."""
    del extra_args
    check_state_matches(
        state, functools.partial(_init, recipe=recipe), params, updates, "PSGD pro"
    )
    del params
    grads, treedef, boxes = _unboxed(updates)
    plan = _plan_for(grads, treedef, recipe)
    out, new_state = with_auto_axes(
        lambda grads, state: _step(grads, state, plan, treedef, recipe),
        (grads, state),
        grads,
        state,
    )
    updates = _constrain(treedef.unflatten(out), recipe.params_partition_specs)
    return _with_boxes(updates, boxes, treedef), new_state


def scale_by_pro(
    lr_style: str | None = "adam",
    b1: float = 0.95,
    normalize_grads: bool = False,
    max_size_dense: int = 16384,
    preconditioner_lr: float = 0.5,
    preconditioner_init_scale: float = 1.0,
    preconditioner_update_style: str = "PRO",
    dtype: Any = jnp.float32,
    scanned_layers: Any | Callable | None = None,
    block_size: int = 256,
    pipeline_axis_name: str | None = None,
    pipeline_axis_size: int = 1,
    params_partition_specs: Any | None = None,
    noise_scale: float = 1e-9,
    *,
    draws: str = "distributed_kron",
    preconditioner_update_probability: float | Callable = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """PSGD 'pro' preconditioning (the module docstring has the math).

    Args:
        lr_style: 'adam' divides the clipped update by 5 (use AdamW's learning
            rates); None leaves it.
        b1: momentum EMA coefficient (bias-corrected); 0 preconditions the gradient.
        normalize_grads: divide each momentum tensor by its norm (+1e-6) first.
        max_size_dense: sides longer than this get a diagonal factor.
        preconditioner_lr: the fit's step size η (over the Lipschitz estimate).
        preconditioner_init_scale: every factor starts as this times identity.
        preconditioner_update_style: 'PRO' (Procrustes-rotated Q), 'QUAD'
            (symmetric Q) or 'QEQ' (Q ← Q − μQE: one d³ product per dense
            factor where 'PRO' takes three; an addition of precond's, see
            BENCHMARKS.md).
        dtype: float32 or bfloat16, of the momentum and factors (and the fit).
        scanned_layers: None, a pytree of bools like the params, or a callable of
            the params returning one: True marks a parameter stacked along a
            leading layer axis (each layer gets its own factors).
        block_size: length of the blocks a dense side is split into.
        pipeline_axis_name: a mesh axis the factor stacks are split along.
        pipeline_axis_size: that axis's size (stacks are padded to its multiple).
        params_partition_specs: the params' PartitionSpecs (momentum and the
            update follow them).
        noise_scale: δ, the floor of the damping noise's scale.
        draws: 'distributed_kron' draws exactly distributed-kron 2.0.0's random
            numbers (cut from its zero-padded blocks); 'compact' draws as many as
            the blocks have entries (the same distribution, cheaper).
        preconditioner_update_probability: p, or a schedule p(step): the factors
            are fitted on the first step and then once 1/p steps have passed
            since the last fit (every step at p = 1, distributed-kron's
            behaviour); other steps precondition
            with the factors as they are, at a fraction of the cost.

    Example, with a schedule and clipping of one's own:

        >>> import optax
        >>> opt = optax.chain(
        ...     optax.clip_by_global_norm(1.0),
        ...     scale_by_pro(),
        ...     optax.scale_by_learning_rate(optax.cosine_decay_schedule(1e-3, 1000)),
        ... )
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, opt.init(params))
    """
    arguments = dict(locals())
    for name, value in arguments.items():
        PRO_ARGUMENT_CHECKS[name](name, value)
    recipe = _recipe(arguments)
    # optax's OptState (chex.ArrayTree) admits no state type narrower than any
    # ArrayTree.
    return accepting_scalars(
        optax.GradientTransformationExtraArgs(
            functools.partial(_init, recipe=recipe),
            functools.partial(_update, recipe=recipe),  # pyright: ignore[reportArgumentType]
        )
    )


def pro(
    learning_rate: float | Callable = 0.001,
    lr_style: str | None = "adam",
    b1: float = 0.95,
    weight_decay: float = 0.1,
    weight_decay_mask: Any | Callable | None = None,
    normalize_grads: bool = False,
    max_size_dense: int = 16384,
    preconditioner_lr: float = 0.5,
    preconditioner_init_scale: float = 1.0,
    preconditioner_update_style: str = "PRO",
    dtype: Any = jnp.float32,
    scanned_layers: Any | Callable | None = None,
    block_size: int = 256,
    pipeline_axis_name: str | None = None,
    pipeline_axis_size: int = 1,
    params_partition_specs: Any | None = None,
    noise_scale: float = 1e-9,
    *,
    draws: str = "distributed_kron",
    preconditioner_update_probability: float | Callable = 1.0,
) -> optax.GradientTransformationExtraArgs:
    """PSGD 'pro' (:func:`scale_by_pro`) with decoupled weight decay and a learning
    rate: θ ← θ − lr·(U + λ·mask⊙θ). A drop-in for distributed-kron 2.0's
    ``pro``: same arguments, order, defaults and trajectory (``draws`` and
    ``preconditioner_update_probability``, keyword only, are precond's). With
    ``lr_style='adam'`` use AdamW's learning rate.

    Example:
        >>> optimizer = pro(learning_rate=1e-3, weight_decay=0.1)
    """
    for name in ("learning_rate", "weight_decay", "weight_decay_mask"):
        ALIAS_ARGUMENT_CHECKS[name](name, locals()[name])
    transforms: list[optax.GradientTransformation] = [
        with_mask_checked_at_init(
            scale_by_pro(**arguments_for(scale_by_pro, locals())),
            "weight_decay_mask",
            weight_decay_mask,
        )
    ]
    if not (isinstance(weight_decay, int | float) and weight_decay <= 0):
        transforms.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
    transforms.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*transforms)


def pro_opt_state_partition_specs(params, **pro_kwargs):
    """PartitionSpecs of ``pro(**pro_kwargs).init(params)``'s state, for
    ``jax.jit(..., out_shardings=...)``: the momentum follows
    ``params_partition_specs`` (replicated without them), factor stacks are split
    along ``pipeline_axis_name`` (replicated without it), the counters replicated.
    As distributed-kron 2.0's ``get_opt_state_partition_specs`` (a tuple of the
    chain's states; None for the stateless decay and learning rate).

    Example, the momentum sharded as its parameter on a mesh axis "data":

        >>> from jax.sharding import PartitionSpec
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> specs = pro_opt_state_partition_specs(
        ...     params, params_partition_specs={"w": PartitionSpec("data")}
        ... )
        >>> specs[0].mu["w"] == PartitionSpec("data"), specs[1:]
        (True, (None, None))
    """
    core = {
        k: v
        for k, v in pro_kwargs.items()
        if k in inspect.signature(scale_by_pro).parameters
    }
    axis = core.pop("pipeline_axis_name", None)
    param_specs = core.pop("params_partition_specs", None)
    shapes = jax.eval_shape(scale_by_pro(**core).init, params)

    def stack_spec(x):
        return PartitionSpec() if axis is None else PartitionSpec(axis)

    leaves, treedef, _ = _unboxed(params)
    mu = None
    if shapes.mu is not None:
        mu = param_specs or treedef.unflatten([PartitionSpec()] * len(leaves))
    # A tree shaped like a state whose leaves are specs, not arrays.
    specs = ProState(
        count=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        mu=mu,
        factors=jax.tree.map(stack_spec, shapes.factors),
        lipschitz=jax.tree.map(stack_spec, shapes.lipschitz),
        update_counter=PartitionSpec(),  # pyright: ignore[reportArgumentType]
        skipped=PartitionSpec(),  # pyright: ignore[reportArgumentType]
    )
    weight_decay = pro_kwargs.get("weight_decay", 0.1)
    if is_concrete_number(weight_decay) and weight_decay <= 0:
        return (specs, None)
    return (specs, None, None)


# distributed-kron 2.0's name, for `from distributed_kron.pro import ...` users.
get_opt_state_partition_specs = pro_opt_state_partition_specs
