"""One step of Kron: momentum, the update decision, the factor fit and the
preconditioned, RMS-clipped update (``scale_by_kron``'s ``update``).

Every function takes the :class:`~precond.jax.kron._config.KronConfig` first;
arrays move between the parameters' layout and stacks of equal units
(``kron._layout``), on which the single-unit kernels of ``factor_kernels`` are
vmapped.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from precond._common.kron_constants import BALANCE_PROBABILITY, MAX_UPDATE_RMS
from precond._common.kron_plan import seed_factor_sizes
from precond.jax._core import factor_kernels as km
from precond.jax._core import normal_draws
from precond.jax._core.guards import (
    all_finite,
    check_state_matches,
    gradients_are_usable,
)
from precond.jax._core.momentum import bias_correction, moving_average
from precond.jax._core.newton import newton_arguments
from precond.jax._core.precision import matmul_precision
from precond.jax._core.step_policy import (
    SkipWarning,
    next_count,
    saturating_increment,
    skip_counted,
    step_key,
)
from precond.jax.kron import _layout as layout
from precond.jax.kron._config import (
    KronConfig,
    TreePlan,
    leads,
    plan_tree,
    probability_at,
)
from precond.jax.kron._randomness import fit_randomness, unit_noise
from precond.jax.kron._stacks import _over_units, _per_stack, _stacked, _Step
from precond.jax.kron._state import (
    KronState,
    factor_of,
    gram_of,
    init,
    state_specs,
    stored_factor,
    working,
)

__all__ = ["update"]


def _seed_layout_draws(
    config: KronConfig, step: _Step, count: jax.Array, tensors: list
) -> tuple[jax.Array, list[jax.Array]]:
    """distributed-kron's draws at this step: its balancing decision and one
    normal array per parameter in its (layers?, blocks?, *block) layout, cut to
    each unit's block and stacked."""
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), count - 1)
    _, key = jax.random.split(key)
    key, balance_key = jax.random.split(key)
    balance = jax.random.uniform(balance_key) <= BALANCE_PROBABILITY
    _, noise_key = jax.random.split(key)
    keys = jax.random.split(noise_key, len(tensors))
    blocked = config.partition_grads_into_blocks
    noise = []
    parameters = zip(keys, tensors, step.tree.plans, step.leads, strict=True)
    for k, x, plan, lead in parameters:
        sizes = seed_factor_sizes(plan, blocked, config.block_size)
        blocks = (math.prod(plan.blocks_per_axis),) if blocked else ()
        V = normal_draws.standard_normal(k, (*lead, *blocks, *sizes), x.dtype)
        V = V.reshape(-1, *sizes)
        V = V[(slice(None), *(slice(0, b) for b in plan.block_shape))]
        noise.append(working(config, V))
    stacked_noise = _per_stack(
        step,
        noise,
        lambda n, stack, like: jnp.zeros((n, *stack.block_shape), like.dtype),
    )
    sharding = step.sharding
    return balance, [sharding.constrain(V, sharding.stack_spec) for V in stacked_noise]


def _damping_scale(config: KronConfig, x: jax.Array, plan, lead) -> jax.Array:
    """Each unit's mean|x| over its parameter (its layer, with
    independent_scanned_layers)."""
    magnitude = jnp.abs(x)
    magnitude = magnitude.astype(jnp.promote_types(magnitude.dtype, jnp.float32))
    # Fitted padding counts in the mean (as distributed-kron's).
    per_layer = math.prod(plan.padded_shape if plan.fitted_padding else plan.shape)
    if config.independent_scanned_layers and lead:
        total = jnp.sum(magnitude.reshape(lead[0], -1), axis=1)
        mean = total / per_layer
    else:
        mean = jnp.sum(magnitude) / (per_layer * math.prod(lead))
        mean = jnp.broadcast_to(mean, lead)
    return jnp.repeat(mean, math.prod(plan.blocks_per_axis))


def _damping_scales(config: KronConfig, step: _Step, tensors: list) -> list:
    """Per stack, each unit's damping scale (:func:`_damping_scale`)."""
    # A parameter with no entries is in no stack.
    means = [
        None if x.size == 0 else _damping_scale(config, x, plan, lead)
        for x, plan, lead in zip(tensors, step.tree.plans, step.leads, strict=True)
    ]
    return _per_stack(step, means, lambda n, _, like: jnp.zeros(n, like.dtype))


# ------------------------------------------------------------------ factor fit


def _unit_mask(valid: list[jax.Array], ndim: int) -> jax.Array:
    """The entries of a unit inside its extent along every axis."""
    return functools.reduce(
        jnp.logical_and,
        [
            v.reshape([-1 if a == i else 1 for a in range(ndim)])
            for i, v in enumerate(valid)
        ],
    )


def _damped_pair(config: KronConfig, G, V, valid, ids, damping, noise_key):
    """Whitening's pair (G̃, V): V drawn (:func:`unit_noise`) unless given, zero
    outside the unit's extent, and G̃ = G + damping noise."""
    inside = _unit_mask(valid, G.ndim)
    if V is None:
        V = unit_noise(noise_key, ids[0], ids[1], G.shape, G.dtype)
    V = jnp.where(inside, V, 0)
    if config.generation_2:
        G = km.add_relative_damping_noise(G, V)
    else:
        G = G + km.DAMPING_SCALE * damping.astype(G.dtype) * V
    return G, V


def _fitted_factors(config: KronConfig, Qs, lipschitz, G, V, valid, newton):
    """One factor-update step on the (balanced) factors Qs from the pair (G, V)."""
    if not config.generation_2:
        return km.update_factors(Qs, G, V, config.preconditioner_lr), lipschitz
    diagonal = [km.is_diagonal(Q) for Q in Qs]
    if newton:
        targets = [km.unfold_gram(V, i, d) for i, d in enumerate(diagonal)]
    else:
        targets = km.whitening_targets(valid, diagonal)
    return km.update_factors_gen2(
        Qs,
        lipschitz,
        G,
        targets,
        config.preconditioner_lr,
        config.preconditioner_update_style,
    )


def _fit_unit(
    config: KronConfig, factors, lipschitz, G, V, ids, extent, damping, draws, newton
):
    """One factor update of one unit from the pair (G, V).

    Whitening (not ``newton``): V is drawn (:func:`unit_noise` from the noise
    key in ``draws = (balance, noise_key)``) unless given, and G gets damping
    noise. Newton: (G, V) = (H·v, v) as given. ``extent`` is the unit's real
    size per axis: padding beyond it holds zeros in G and V, gets no noise, and
    is kept out of the balancing norms and the generation-2 targets. ``damping``
    is mean|G| over the unit's parameter (or layer: see
    ``independent_scanned_layers``). Returns the new factors and Lipschitz
    estimates; a fit that overflowed keeps the unit's old ones.
    """
    balance, noise_key = draws
    valid = [jnp.arange(size) < extent[i] for i, size in enumerate(G.shape)]
    if not newton:
        G, V = _damped_pair(config, G, V, valid, ids, damping, noise_key)
    Qs = [factor_of(config, F) for F in factors]
    if len(Qs) > 1:
        balanced = km.balance_factors(Qs, valid)
        Qs = [jnp.where(balance, b, Q) for b, Q in zip(balanced, Qs, strict=True)]
    Qs, new_lipschitz = _fitted_factors(config, Qs, lipschitz, G, V, valid, newton)
    new_factors = tuple(stored_factor(config, Q) for Q in Qs)
    # A fit that overflowed (a gradient too large for the grams, yet usable:
    # guards) keeps the unit's old factors, as the other PSGD variants do.
    fitted = all_finite(new_factors, new_lipschitz)

    def keep(new, old):
        if new is None:
            return None
        return tuple(jnp.where(fitted, n, o) for n, o in zip(new, old, strict=True))

    return keep(new_factors, factors), keep(new_lipschitz, lipschitz)


# The most memory one batch of a stack's fit may take for its temporaries on a
# CPU (by _fit_batch_size's estimate), where a unit is smaller than its largest
# factor: such a stack whose fit would take more is fitted batch by batch.
# XLA:CPU maps a program's temporaries afresh at every call, so each page a
# step touches is a page fault, and the fit of thin units (distributed-kron's
# blocks of one vector, each with a d×d factor) is bound by its d×d temporaries.
# Where a unit is as large as its factors the products dominate, and batches
# were slower in ad-hoc trials. Other backends fit each stack in one vmap (not
# measured there).
# Measured in BENCHMARKS.md's git history, "Kron's fit in batches".
FIT_BATCH_BYTES = 64 * 2**20


def _fit_batch_size(units: int, G: jax.Array, factors) -> int | None:
    """Units per batch of the fit of a stack ``G`` (with its ``factors``) of
    ``units`` units per shard; None for one vmap. A unit's temporaries are taken
    as four arrays of its size (G̃, V, A = G̃·ΠQ, B = V·ΠQ⁻ᴴ) and eight of each
    factor's (T1, T2, the step, the new and the balanced factors...). The batch
    divides the units: lax.map would fit a remainder apart and concatenate the
    results, and the copies took back most of the memory saved."""
    dims, unit_size = G.shape[1:], math.prod(G.shape[1:])
    factor_sizes = [
        d if F.ndim == 2 else d * d  # a diagonal factor's stack: (units, d)
        for d, F in zip(dims, factors, strict=True)
    ]
    if jax.default_backend() != "cpu" or max(factor_sizes) <= unit_size:
        return None
    unit_bytes = (4 * unit_size + 8 * sum(factor_sizes)) * G.dtype.itemsize
    most = max(1, FIT_BATCH_BYTES // unit_bytes)
    if most >= units:
        return None
    return max(b for b in range(1, most + 1) if units % b == 0)


def _fit_stack(config: KronConfig, step: _Step, index: int, inputs, draws, newton):
    """One factor update of every unit of stack ``index``; ``inputs`` are its
    (factors, lipschitz, G, V or None, damping)."""
    sharding = step.sharding
    stack = step.tree.stacks[index]
    factors, lipschitz, G, V, damping = inputs
    ids = sharding.constrain(jnp.asarray(stack.unit_ids), sharding.stack_spec)
    extents = sharding.constrain(jnp.asarray(stack.extents), sharding.stack_spec)
    damping = sharding.constrain(damping, sharding.stack_spec)

    def fit(factors, lipschitz, G, ids, extent, damping, *newton_V):
        V = newton_V[0] if newton_V else None
        return _fit_unit(
            config, factors, lipschitz, G, V, ids, extent, damping, draws, newton
        )

    unit_inputs = (tuple(factors), lipschitz, G, ids, extents, damping)
    newton_V = () if V is None else (V,)
    fitted, lipschitz = _over_units(
        config,
        fit,
        sharding,
        *unit_inputs,
        *newton_V,
        batch_size=_fit_batch_size(G.shape[0] // sharding.shards, G, factors),
    )
    fitted = tuple(sharding.constrain(F, sharding.stack_spec) for F in fitted)
    if lipschitz is not None:
        lipschitz = tuple(sharding.constrain(L, sharding.stack_spec) for L in lipschitz)
    return fitted, lipschitz


def _fit_stacks(
    config: KronConfig,
    step: _Step,
    preconditioner_state: tuple,
    G_stacks: list,
    key: jax.Array,
    V_stacks: list | None = None,
    damping_stacks: list | None = None,
    drawn: tuple | None = None,
) -> tuple[tuple, tuple | None]:
    """One factor update of every unit (the 'update' branch of step 2);
    ``V_stacks`` are the Newton vectors (None: whitening, with the units'
    damping scales ``damping_stacks``). ``drawn``: whitening with the given
    (balancing decision, noise stacks) instead of drawing them from ``key``.
    Returns the new factors and Lipschitz estimates (None for 'EQ') of every
    stack."""
    stacks = step.tree.stacks
    all_factors, all_lipschitz = preconditioner_state
    newton = V_stacks is not None
    if drawn is None:
        draws = fit_randomness(key)
    else:
        balance, V_stacks = drawn
        draws = (balance, None)
    if V_stacks is None:
        V_stacks = [None] * len(stacks)
    if damping_stacks is None:
        damping_stacks = [jnp.zeros(len(s.extents)) for s in stacks]
    if all_lipschitz is None:
        all_lipschitz = [None] * len(stacks)
    inputs = zip(
        all_factors, all_lipschitz, G_stacks, V_stacks, damping_stacks, strict=True
    )
    new_factors, new_lipschitz = [], []
    for index, stack_inputs in enumerate(inputs):
        with jax.named_scope("precond/kron/update_factors"):
            fitted, lipschitz = _fit_stack(
                config, step, index, stack_inputs, draws, newton
            )
        new_factors.append(fitted)
        new_lipschitz.append(lipschitz)
    if not config.generation_2:
        return tuple(new_factors), None
    return tuple(new_factors), tuple(new_lipschitz)


def _fit(config: KronConfig, step: _Step, count, grads, mu_hats):
    """The factor update of this step (the ``true`` branch of its ``cond``):
    returns ``fit(preconditioner_state, mu_hat_stacks, newton)``."""

    def fit(preconditioner_state, mu_hat_stacks, newton):
        key = step_key(config.seed, count)
        if newton is not None:  # fit P to the pairs (H·v, v)
            hvp, vector = (
                _stacked(config, step, jax.tree.leaves(newton[name]))
                for name in ("Hvp", "vector")
            )
            return _fit_stacks(config, step, preconditioner_state, hvp, key, vector)
        if config.momentum_into_precond_update:
            targets, sources = mu_hat_stacks, mu_hats
        else:
            targets, sources = _stacked(config, step, grads), grads
        drawn = None
        if config.noise_draws == "distributed_kron":
            drawn = _seed_layout_draws(config, step, count, sources)
        return _fit_stacks(
            config,
            step,
            preconditioner_state,
            targets,
            key,
            damping_stacks=_damping_scales(config, step, sources),
            drawn=drawn,
        )

    return fit


def _keep(preconditioner_state, *_):
    """The ``false`` branch of the fit's ``cond``: the factors as they are."""
    factors, lipschitz = preconditioner_state
    return tuple(factors), lipschitz


# ------------------------------------------------------------------ the step


def _momentum(config: KronConfig, step: _Step, mu, grads, finite, count):
    """m ← β₁m + (1−β₁)g (kept when the step is skipped) and m̂ = m/(1 − β₁ⁿ);
    without momentum, (None, grads)."""
    if not config.keep_momentum:
        return None, grads
    b1 = config.b1
    mus = [
        jnp.where(finite, moving_average(m, g, b1), m).astype(m.dtype)
        for m, g in zip(step.tree.treedef.flatten_up_to(mu), grads, strict=True)
    ]
    mus = step.sharding.constrain_params(mus)
    mu_hats = []
    for m, g in zip(mus, grads, strict=True):
        dtype = jnp.promote_types(m.dtype, jnp.float32)
        correction = bias_correction(b1, count, km.real_dtype(dtype))
        mu_hat = (m.astype(dtype) / correction).astype(m.dtype)
        # A real gradient's complex momentum (mu_dtype complex) is real.
        real = km.is_complex(m) and not km.is_complex(g)
        mu_hats.append(jnp.real(mu_hat) if real else mu_hat)
    return mus, mu_hats


def _update_decision(config: KronConfig, state: KronState, count, finite, newton):
    """Whether this step fits the factors, and the new steps-since-update
    counter: every 1/p(n) steps (or as Newton's ``update_preconditioner``
    says), never on a skipped step."""
    update_counter = state.update_counter + 1
    if newton is None:
        prob = probability_at(config, count)
        do_update = finite & (
            update_counter.astype(jnp.float32) >= 1.0 / jnp.asarray(prob, jnp.float32)
        )
    else:
        do_update = finite & jnp.asarray(newton["update_preconditioner"], bool)
    update_counter = jnp.where(do_update, 0, update_counter)
    update_counter = jnp.where(finite, update_counter, state.update_counter)
    return do_update, update_counter


def _precondition_unit(config: KronConfig, factors, G):
    """U = P·G for one unit."""
    if config.cache is None:
        return km.precondition([factor_of(config, F) for F in factors], G)
    return km.precondition_with_grams([gram_of(config, F) for F in factors], G)


def _precondition_stacks(config: KronConfig, step: _Step, all_factors, G_stacks):
    """U = P·G for every unit of every stack."""
    sharding = step.sharding
    precondition_unit = functools.partial(_precondition_unit, config)
    with (
        matmul_precision(config.precond_grads_precision),
        jax.named_scope("precond/kron/precondition"),
    ):
        return [
            sharding.constrain(
                _over_units(config, precondition_unit, sharding, tuple(factors), G),
                sharding.stack_spec,
            )
            for factors, G in zip(all_factors, G_stacks, strict=True)
        ]


def _clipped_update(config: KronConfig, U, g, lead, finite):
    """U / max(1, RMS(U)/1.1) per parameter (per layer with
    independent_scanned_layers), in g's shape and dtype; zero on a skipped step."""
    if U is None:  # a parameter with no entries
        return jnp.zeros_like(g)
    start = len(lead) if config.independent_scanned_layers else 0
    axes = tuple(range(start, U.ndim))
    power = km.squared_magnitude(U) if km.is_complex(U) else jnp.square(U)
    rms = jnp.sqrt(jnp.mean(power, axis=axes, keepdims=True))
    U = jnp.where(finite, U / jnp.maximum(1.0, rms / MAX_UPDATE_RMS), 0)
    return U.reshape(g.shape).astype(g.dtype)


def _updates(config: KronConfig, step: _Step, U_stacks, grads, finite) -> list:
    """The preconditioned stacks back in the parameters' layout, clipped."""
    sharding, tree = step.sharding, step.tree
    per_parameter = layout.from_stacks(
        # Gathered whole, then cut to each parameter's sharding locally
        # (gathering each parameter's slice of a stack costs more: the
        # slices do not align with the shards).
        [sharding.constrain(U, PartitionSpec()) for U in U_stacks],
        tree.plans,
        tree.stacks,
        step.leads,
    )
    return [
        _clipped_update(config, U, g, lead, finite)
        for U, g, lead in zip(per_parameter, grads, step.leads, strict=True)
    ]


def _step(
    config: KronConfig,
    tree: TreePlan,
    updates,
    state: KronState,
    newton,
    warning: SkipWarning,
):
    """One step on a tree that has entries (see ``scale_by_kron``); a skipped
    step is counted and reported by ``warning``."""
    sharding = tree.sharding
    grads = sharding.constrain_params(jax.tree.leaves(updates))
    step = _Step(tree, leads(tree.plans, grads))
    # A step whose gradient is unusable (NaN/Inf, or so large its square
    # overflows: guards) keeps the old state and returns zeros. The guard is
    # fused into the elementwise work (no whole-state select or cond).
    checked = grads if newton is None else grads + jax.tree.leaves(newton["Hvp"])
    finite = gradients_are_usable(checked)
    count = next_count(state.count, finite)
    mus, mu_hats = _momentum(config, step, state.mu, grads, finite, count)
    do_update, update_counter = _update_decision(config, state, count, finite, newton)
    mu_hat_stacks = _stacked(config, step, mu_hats)
    with matmul_precision(config.precond_update_precision):
        all_factors, lipschitz = jax.lax.cond(
            do_update,
            _fit(config, step, count, grads, mu_hats),
            _keep,
            (state.preconditioners, state.lipschitz),
            mu_hat_stacks,
            newton,
        )
    U_stacks = _precondition_stacks(config, step, all_factors, mu_hat_stacks)
    new_updates = _updates(config, step, U_stacks, grads, finite)
    new_state = KronState(
        count=count,
        mu=None if mus is None else tree.treedef.unflatten(mus),
        preconditioners=all_factors,
        update_counter=update_counter,
        skipped=state.skipped,
        lipschitz=lipschitz,
    )
    new_updates = tree.treedef.unflatten(sharding.constrain_params(new_updates))
    return new_updates, skip_counted(finite, new_state, warning)


def update(
    config: KronConfig,
    warning: SkipWarning,
    updates,
    state: KronState,
    params=None,
    **extra_args,
):
    """``scale_by_kron``'s update: (preconditioned updates, new state); the
    first skipped step is logged by ``warning``, the optimizer's own.

    ``extra_args`` may hold Newton mode's ``Hvp``, ``vector`` and
    ``update_preconditioner`` (all three); anything else is ignored.
    """
    newton = newton_arguments(updates, extra_args)
    if not jax.tree.leaves(updates):
        return updates, state._replace(count=saturating_increment(state.count))
    tree = plan_tree(config, updates)
    check_state_matches(
        state, functools.partial(init, config), params, updates, "PSGD Kron"
    )
    del params

    def body(updates, state, newton):
        return _step(config, tree, updates, state, newton, warning)

    treedef = tree.treedef
    param_specs = tree.sharding.param_specs or [PartitionSpec()] * treedef.num_leaves
    out_specs = (treedef.unflatten(param_specs), state_specs(config, tree))
    return tree.sharding.run(body, out_specs, updates, state, newton)
