"""One step of Distributed Shampoo: statistics, inverse roots, grafted direction.

:func:`shampoo_update` is the transform of ``scale_by_shampoo`` and, with the
step's learning rate, of ``distributed_shampoo``: the learning rate enters only
through :class:`_LearningRates`, so both share every other operation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec

from precond._common.validation import is_concrete_number
from precond.jax._core.blocks import block_grams, cut
from precond.jax._core.guards import check_state_matches, gradients_are_usable
from precond.jax._core.step_policy import (
    SkipWarning,
    fields_unless_skipped,
    next_count,
    skip_counted,
    state_unless_skipped,
)
from precond.jax.shampoo._config import Config, GraftingType
from precond.jax.shampoo._layout import (
    Layout,
    padded_rows,
    plan_layout,
    preconditioned,
)
from precond.jax.shampoo._math import (
    matrix_inverse_pth_root,
    matrix_inverse_pth_root_eigh,
)
from precond.jax.shampoo._state import (
    ShampooState,
    TrainingMetrics,
    constrain_stack,
    explicit_axes,
    init_state,
    is_quantized,
    load,
    load_momentum,
    replicate,
    state_float_dtype,
    store,
    store_momentum,
)

# ------------------------------------------------------------ statistics and roots


def _stack_roots(stack: jax.Array, p: int, config: Config):
    """Inverse p-th roots and errors of a (K, n, n) stack, spread over devices.

    With ``batch_axis_name`` (inside shard_map/pmap) each device computes one
    contiguous share of the rows and an all-gather reassembles them; with a
    ``preconditioner_partition_spec`` the stack is split along its rows and XLA's
    partitioner gives each device its share.
    """
    roots_of = _vmapped_root(p, config)
    if config.batch_axis_name is None:
        spec = config.preconditioner_partition_spec
        stack = constrain_stack(stack, spec)
        stored = (
            config.statistics_partition_spec if config.shard_optimizer_states else None
        )
        typed = spec if spec is not None else stored
        if typed is not None and explicit_axes(typed):
            # Sharding in types: each device roots its own rows in a shard_map
            # (a vmapped while_loop over a typed-sharded stack is refused).
            roots, errors = _rows_on_their_devices(roots_of, stack, typed)
            errors = replicate(errors, config)
        else:
            roots, errors = roots_of(stack)
        return constrain_stack(roots, spec), errors
    axis = config.batch_axis_name
    devices = lax.axis_size(axis)
    rows, n = stack.shape[0], stack.shape[-1]
    padding = padded_rows(rows, devices) - rows
    eye = jnp.broadcast_to(jnp.eye(n, dtype=stack.dtype), (padding, n, n))
    shares = jnp.concatenate([stack, eye]).reshape(devices, -1, n, n)
    mine = lax.dynamic_index_in_dim(shares, lax.axis_index(axis), keepdims=False)
    roots, errors = roots_of(mine)
    roots = lax.all_gather(roots, axis, tiled=True)[:rows]
    return roots, lax.all_gather(errors, axis, tiled=True)[:rows]


def _vmapped_root(p: int, config: Config, **kernel_options) -> Callable:
    """(K, n, n) ↦ (roots, errors): the configured inverse-root kernel, vmapped;
    ``kernel_options`` are further arguments of the kernel (unmapped)."""
    if config.eigh:
        root = functools.partial(
            matrix_inverse_pth_root_eigh,
            p=p,
            relative_matrix_epsilon=config.relative_matrix_epsilon,
        )
    else:
        root = functools.partial(
            matrix_inverse_pth_root,
            p=p,
            relative_matrix_epsilon=config.relative_matrix_epsilon,
            lobpcg_topk_precondition=config.lobpcg_topk_precondition,
            lobpcg_max_iter=config.lobpcg_max_iter,
        )
    return jax.vmap(
        functools.partial(
            root,
            ridge_epsilon=config.matrix_epsilon,
            precision=config.precision,
            **kernel_options,
        )
    )


def _rows_on_their_devices(roots_of, stack: jax.Array, spec):
    """``roots_of(stack)`` with each device computing the rows it holds under
    ``spec`` (a PartitionSpec of the current mesh or a NamedSharding)."""
    if isinstance(spec, jax.sharding.NamedSharding):
        mesh, spec = spec.mesh, spec.spec
    else:
        mesh = jax.sharding.get_abstract_mesh()
    rows = PartitionSpec(*tuple(spec)[:1])
    return jax.shard_map(
        roots_of,
        mesh=mesh,
        in_specs=PartitionSpec(*tuple(spec)[:1], None, None),
        out_specs=(PartitionSpec(*tuple(spec)[:1], None, None), rows),
        check_vma=False,  # the kernels' loops start from device-invariant constants
    )(stack)


def _grafting_direction(g, diagonal, config: Config):
    """(u_g, new accumulator): the first-order step whose norm Shampoo borrows."""
    kind = config.graft_type
    if kind == GraftingType.SGD:
        return g, diagonal
    if kind == GraftingType.SQRT_N:
        return jnp.sign(g), diagonal
    if kind in (GraftingType.ADAGRAD_NORMALIZED, GraftingType.RMSPROP_NORMALIZED):
        g = g / (jnp.linalg.norm(g) + 1e-16)
    if kind in (GraftingType.ADAGRAD, GraftingType.ADAGRAD_NORMALIZED):
        diagonal = diagonal + jnp.square(g)
    else:
        diagonal = config.beta2 * diagonal + _statistics_weight(config) * jnp.square(g)
    direction = g / (jnp.sqrt(diagonal) + config.diagonal_epsilon)
    clip = config.clip_by_scaled_gradient_norm
    if clip is not None and kind in (
        GraftingType.RMSPROP,
        GraftingType.RMSPROP_NORMALIZED,
    ):
        scaled_norm = jnp.linalg.norm(direction) / math.sqrt(max(direction.size, 1))
        direction = direction / jnp.maximum(1.0, scaled_norm / clip)
    return direction, diagonal


def _statistics_weight(config: Config):
    """Weight of the new gram in the EMA: 1 − β2, or 1 when β2 = 1 (a sum)."""
    return jnp.where(jnp.asarray(config.beta2) == 1.0, 1.0, 1.0 - config.beta2)


def _new_statistics(grads, state, layout: Layout, config: Config, usable):
    """S ← β2·S + c·G_b ⋅_{¬k} G_b for every block and axis, in stack order;
    every S as it was where the step's gradients are not ``usable``."""
    pieces = [[] for _ in layout.keys]
    for g, plan, slots in zip(grads, layout.plans, layout.slots, strict=True):
        if plan is None:
            continue
        x = g.astype(_stack_dtype(state)).reshape(plan.merged_shape)
        grams = [
            block_grams(cut(x, group), plan.axes, config.gram_precision)
            for group in plan.groups
        ]
        for (group, axis), (stack, _, _) in zip(plan.entries, slots, strict=True):
            pieces[stack].append(grams[group][axis])
    out = []
    for stack, old, rows in zip(pieces, state.statistics, layout.rows, strict=True):
        previous = load(old)
        gram = replicate(jnp.concatenate(stack), config)
        gram = jnp.pad(gram, ((0, previous.shape[0] - rows), (0, 0), (0, 0)))
        ema = config.beta2 * previous + _statistics_weight(config) * gram
        real = (jnp.arange(previous.shape[0]) < rows)[:, None, None]
        # A statistic that would overflow (a sum with β2 = 1 of huge but finite
        # gradients) keeps its previous value, like a failed root.
        kept = usable & real & jnp.all(jnp.isfinite(ema), axis=(1, 2), keepdims=True)
        new = store(jnp.where(kept, ema, previous), old)
        out.append(constrain_stack(new, config.statistics_partition_spec))
    return tuple(out)


def _new_preconditioners(statistics, state, layout: Layout, config: Config, usable):
    """Inverse roots of every stack; a failed root keeps the previous one, and
    so does every root where the step's gradients are not ``usable``."""
    roots, errors = [], []
    for (_, p), rows, stats, old in zip(
        layout.keys, layout.rows, statistics, state.preconditioners, strict=True
    ):
        new, error = _stack_roots(load(stats), p, config)
        kept = usable & jnp.isfinite(error) & (error < config.inverse_failure_threshold)
        kept = kept & jnp.all(jnp.isfinite(new), axis=(1, 2))
        # Padding rows (a stack split over devices) keep their identity, so the
        # state is a function of the real rows alone (shampoo_state_from_seed).
        kept = kept & (jnp.arange(new.shape[0]) < rows)
        new = jnp.where(kept[:, None, None], new, load(old))
        roots.append(constrain_stack(store(new, old), config.statistics_partition_spec))
        errors.append(error)
    return tuple(roots), tuple(errors)


def _stack_dtype(state: ShampooState):
    if not state.statistics:
        return jnp.float32
    first = state.statistics[0]
    return jnp.float32 if is_quantized(first) else first.dtype


def _norm(x: jax.Array) -> jax.Array:
    """‖x‖₂ as max|x|·‖x/max|x|‖: the plain sum of squares overflows float32 once
    an entry passes ~1.8e19 (possible for P(G) with an old, large root P)."""
    if not x.size:
        return jnp.zeros((), x.dtype)
    largest = jnp.max(jnp.abs(x))
    scale = jnp.where(largest > 0, largest, 1)
    return scale * jnp.linalg.norm(x / scale)


# ------------------------------------------------------------------ the step


class _LearningRates(NamedTuple):
    """Where the step's learning rate lr enters (all of it: scale_by_shampoo has
    inner 1, outer None, decay None)."""

    inner: Any  # scales u_g (so u_s) before momentum: lr if coupled, else 1
    outer: Any  # the update is −outer·v (None: v itself, for scale_by_shampoo)
    decay: Any  # decoupled weight decay adds decay·λ·W to v


def _learning_rates(config: Config, step: jax.Array) -> _LearningRates:
    """lr = learning_rate(t) (or the constant) at step t = ``state.count``."""
    lr = config.learning_rate
    if lr is None:
        return _LearningRates(1.0, None, None)
    lr = lr(step) if callable(lr) else lr
    if config.decoupled_learning_rate:
        return _LearningRates(1.0, lr, lr)
    return _LearningRates(lr, 1.0, lr)


def _statistics_step(grads, state, layout: Layout, config: Config, usable):
    """The statistics after step t: updated when t % statistics_compute_steps = 0
    (and the gradients are ``usable``)."""
    if config.statistics_compute_steps == 1:
        return _new_statistics(grads, state, layout, config, usable)
    return lax.cond(
        state.count % config.statistics_compute_steps == 0,
        lambda: _new_statistics(grads, state, layout, config, usable),
        lambda: state.statistics,
    )


def _roots_step(statistics, state, layout: Layout, config: Config, refresh):
    """(roots, errors per stack) after step t: recomputed when ``refresh`` (t %
    preconditioning_compute_steps = 0 and the gradients are usable), else the
    stored roots and zero errors."""
    if config.preconditioning_compute_steps == 1:
        return _new_preconditioners(statistics, state, layout, config, refresh)
    return lax.cond(
        refresh,
        lambda: _new_preconditioners(statistics, state, layout, config, True),
        lambda: (
            state.preconditioners,
            tuple(jnp.zeros(load(s).shape[:1], jnp.float32) for s in statistics),
        ),
    )


def _root_errors(errors, refresh, state, layout: Layout, treedef):
    """Per parameter, the errors of its statistics' roots: this step's where
    the roots were recomputed, else the previous ones."""
    out = []
    old_errors = treedef.flatten_up_to(state.training_metrics.inverse_pth_root_errors)
    for slots, old in zip(layout.slots, old_errors, strict=True):
        if not slots:
            out.append(old)
            continue
        mine = jnp.concatenate(
            [errors[stack][first : first + rows] for stack, first, rows in slots]
        )
        out.append(jnp.where(refresh, mine, old))
    return out


def _grafted(gf, old_diagonal, weight, roots, plan, slots, rates, config: Config):
    """(u_s, u_g, new accumulator): the grafting step u_g = inner·(grafting
    direction), P(G) rescaled to its norm, u_s = P(G)·‖u_g‖/‖P(G)‖ (u_g for a
    parameter without statistics), both plus λ·W when the decay is coupled."""
    graft, diagonal = _grafting_direction(gf, old_diagonal, config)
    graft = rates.inner * graft
    if plan is None:
        direction = graft
    else:
        direction = preconditioned(gf, plan, slots, roots, config.precision).astype(
            gf.dtype
        )
    shampoo = direction * (jnp.linalg.norm(graft) / (_norm(direction) + 1e-16))
    if weight is not None and not config.decoupled_weight_decay:
        shampoo = shampoo + config.weight_decay * weight
        graft = graft + config.weight_decay * weight
    return shampoo, graft, diagonal


def _momentum_step(shampoo, graft, old_momentum, old_graft_momentum, running, config):
    """(v, stored m_s or m, stored m_g or None): m_s ← β1·m_s + w·u_s and
    m_g ← β1·m_g + w·u_g (one shared buffer m without a grafting momentum),
    v = w·u + β1·m (Nesterov) or m, with u, m Shampoo's from
    ``start_preconditioning_step`` on and the grafting's before."""
    beta1, shape = config.beta1, shampoo.shape
    w = (1.0 - beta1) if config.moving_average_for_momentum else 1.0
    momentum = beta1 * load_momentum(old_momentum, shape) + w * shampoo
    graft_source = old_graft_momentum if config.has_diagonal_momentum else old_momentum
    graft_momentum = beta1 * load_momentum(graft_source, shape) + w * graft
    mixed_momentum = jnp.where(running, momentum, graft_momentum)
    mixed = jnp.where(running, shampoo, graft)
    v = w * mixed + beta1 * mixed_momentum if config.nesterov else mixed_momentum
    if config.has_diagonal_momentum:
        return (
            v,
            store_momentum(momentum, old_momentum),
            store_momentum(graft_momentum, old_graft_momentum),
        )
    return v, store_momentum(mixed_momentum, old_momentum), None


def _leaf_step(g, old, weight, roots, plan, slots, rates, running, config: Config):
    """(update, stored momentum, grafting momentum, accumulator) of one
    parameter; ``old`` is its (momentum, grafting momentum, accumulator)."""
    old_momentum, old_graft_momentum, old_diagonal = old
    gf = g.astype(state_float_dtype(g.dtype))
    shampoo, graft, diagonal = _grafted(
        gf, old_diagonal, weight, roots, plan, slots, rates, config
    )
    v, momentum, graft_momentum = _momentum_step(
        shampoo, graft, old_momentum, old_graft_momentum, running, config
    )
    if weight is not None and config.decoupled_weight_decay:
        # As Google's newer code: λ·lr·W, then the outer lr as well.
        v = v + rates.decay * config.weight_decay * weight
    update = v if rates.outer is None else -rates.outer * v
    if old_diagonal is not None:
        diagonal = diagonal.astype(old_diagonal.dtype)
    return update.astype(g.dtype), momentum, graft_momentum, diagonal


def _decayed_weights(params, grads, treedef, config: Config) -> list:
    """Per parameter, W where the weight decay λ is not a concrete 0, else None."""
    if is_concrete_number(config.weight_decay) and config.weight_decay == 0:
        return [None] * len(grads)
    if params is None:
        raise ValueError(
            "distributed_shampoo with weight_decay != 0 needs the params: call "
            "update(grads, state, params)"
        )
    return treedef.flatten_up_to(params)


def shampoo_update(
    updates, state: ShampooState, params, config: Config, warning: SkipWarning
):
    """(updates, new state) of one step; see ``distributed_shampoo``. A step
    whose gradients are unusable returns zeros and the state unchanged, but for
    its count of skipped steps (the first reported by ``warning``)."""
    grads, treedef = jax.tree.flatten(updates)
    layout = plan_layout([g.shape for g in grads], config)
    weights = _decayed_weights(params, grads, treedef, config)
    check_state_matches(
        state,
        functools.partial(init_state, config=config, constrain=False),
        params,
        updates,
        "distributed_shampoo",
    )
    # A skipped step leaves everything as it was (see the docstring).
    usable = gradients_are_usable(grads)
    with jax.named_scope("precond/shampoo/statistics"):
        statistics = _statistics_step(grads, state, layout, config, usable)
    with jax.named_scope("precond/shampoo/inverse_roots"):
        refresh = usable & (state.count % config.preconditioning_compute_steps == 0)
        preconditioners, errors = _roots_step(
            statistics, state, layout, config, refresh
        )
        metrics = optax.MaskedNode()
        if config.generate_training_metrics:
            errors = _root_errors(errors, refresh, state, layout, treedef)
            metrics = TrainingMetrics(jax.tree.unflatten(treedef, errors))
        # Google's sharded mode preconditions with the stored roots and only
        # then computes the new ones (kept for the next step).
        used = state.preconditioners if config.uses_previous_roots else preconditioners
        roots = [replicate(load(p), config) for p in used]
    rates = _learning_rates(config, state.count)
    running = state.count >= config.start_preconditioning_step
    olds = zip(
        *(
            treedef.flatten_up_to(field)
            for field in (
                state.momentum,
                state.diagonal_momentum,
                state.diagonal_statistics,
            )
        ),
        strict=True,
    )
    with jax.named_scope("precond/shampoo/direction"):
        steps = [
            _leaf_step(g, old, w, roots, plan, slots, rates, running, config)
            for g, old, w, plan, slots in zip(
                grads, olds, weights, layout.plans, layout.slots, strict=True
            )
        ]
    # Per field, a tree like the params (empty trees: four empty columns).
    columns = [list(c) for c in zip(*steps, strict=True)] or [[]] * 4
    outputs, momenta, graft_momenta, diagonals = (
        jax.tree.unflatten(treedef, column) for column in columns
    )
    new_state = ShampooState(
        count=next_count(state.count),
        momentum=momenta,
        diagonal_momentum=graft_momenta,
        diagonal_statistics=diagonals,
        statistics=statistics,
        preconditioners=preconditioners,
        training_metrics=metrics,
        skipped=state.skipped,
    )
    outputs = jax.tree.map(lambda u: jnp.where(usable, u, jnp.zeros_like(u)), outputs)
    guarded = _as_before_unless(usable, new_state, state)
    return outputs, skip_counted(usable, guarded, warning)


def _as_before_unless(usable, new_state: ShampooState, state: ShampooState):
    """``new_state`` where the step's gradients are ``usable``, else ``state``.

    The statistics and roots already kept their old values in their own
    updates: a select over them here would copy every stack on every step. A
    quantized stack is still selected, as re-quantizing its kept values need
    not give the stored ones."""
    stacks = ("statistics", "preconditioners")
    guarded = fields_unless_skipped(usable, new_state, state, already_kept=stacks)
    return guarded._replace(
        **{
            field: tuple(
                state_unless_skipped(usable, new, old) if is_quantized(old) else new
                for new, old in zip(
                    getattr(new_state, field), getattr(state, field), strict=True
                )
            )
            for field in stacks
        }
    )
