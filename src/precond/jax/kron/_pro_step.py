"""PSGD pro's init and step: every block's generation-2 fit on the noisy momentum,
the rebalancing, the preconditioned and RMS-clipped update, the skipped steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from precond._common.kron_constants import MAX_UPDATE_RMS
from precond._common.pro_layout import (
    ADAM_STYLE_DIVISOR,
    BALANCE_EVERY,
    _Plan,
    _plan,
    _Stack,
    stream_kind,
)
from precond.jax._core import factor_kernels as km
from precond.jax._core import normal_draws
from precond.jax._core.blocks import cut, join
from precond.jax._core.guards import (
    check_parameter_dtypes,
    check_state_matches,
    is_params_placeholder,
)
from precond.jax._core.mesh_placement import (
    is_box,
    partition_specs_only,
    with_auto_axes,
)
from precond.jax._core.momentum import bias_correction, moving_average
from precond.jax._core.step_policy import (
    fields_unless_skipped,
    keep_if_overflowed,
    next_count,
    skip_counted,
    step_is_usable,
    step_key,
    zeros_unless_usable,
)
from precond.jax.kron._pro_config import ProState, _Recipe, _scanned_flags, _unboxed

# Each key stream's seed (distributed-kron 2.0.0's): blocks of matrices with two
# dense sides share one stream; every other parameter has its own.
_STREAM_SEEDS = {"dense": 42, "diagonal": 43, "columns": 44, "rows": 45, "vector": 46}


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
            moving_average(m.astype(jnp.float32), g.astype(jnp.float32), b1)
            for m, g in zip(mu, grads, strict=True)
        ]
        correction = bias_correction(b1, count, jnp.float32)
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
