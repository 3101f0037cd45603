"""One step of SOAP: Adam in the eigenbases, statistics, and the basis refresh.

:func:`soap_update` is the transform of ``scale_by_soap``: for every block,
project the gradient into the eigenbasis, update both moments there, take
Adam's direction and project it back; then update the statistics and, on the
first step and every ``precondition_frequency`` Adam steps, refresh the bases
(one power step with QR, or eigh) and rotate the first moment into them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from precond.jax._core.blocks import block_grams, cut, join
from precond.jax._core.guards import check_state_matches
from precond.jax._core.mesh_placement import ShardingPlan
from precond.jax._core.momentum import bias_correction, moving_average
from precond.jax._core.pool_safe_linalg import eigh, qr
from precond.jax._core.precision import matmul_precision
from precond.jax._core.step_policy import (
    fields_unless_skipped,
    next_count,
    skip_counted,
    step_is_usable,
    zeros_unless_usable,
)
from precond.jax.soap._config import Config
from precond.jax.soap._layout import Layout, along, group_rows, permuted
from precond.jax.soap._state import (
    SoapState,
    init_state,
    layout_of,
    placement,
    state_specs,
)

# The branches of the basis refresh (lax.switch's index).
KEEP, EIGH, QR = 0, 1, 2


class _Step(NamedTuple):
    """What one traced step knows: its config, plan and placement."""

    config: Config
    layout: Layout
    sharding: ShardingPlan


# ------------------------------------------------------------------ per block


def _blocks(x: jax.Array, plan, group) -> jax.Array:
    return cut(x.reshape(plan.work_shape), group.region)


def _bases_of(step: _Step, bases, p: int, group: int, dtype) -> dict[int, jax.Array]:
    """Per preconditioned axis of the parameter's ``group``: its blocks' bases."""
    plan, slots = step.layout.plans[p], step.layout.slots[p]
    return {
        k: bases[stack][first : first + rows].astype(dtype)
        for k, (stack, first, rows) in group_rows(plan, slots, group).items()
    }


def _adam_blocks(config: Config, g, mu, nu, qs, count):
    """(direction, μ, ν) of a group's blocks: the moments of the projected
    gradient G' = G ×_k Q_kᵀ, Adam's direction M/(√V + ε) projected back
    (normalised per block, with ``normalize_grads``), with the bias correction."""
    projected = along(g, qs)
    # β in the moments' dtype first: a float and the same value injected as an
    # array (optax.inject_hyperparams) then give the same 1 − β, and the same steps.
    b1, b2 = jnp.asarray(config.b1, mu.dtype), jnp.asarray(config.b2, nu.dtype)
    mu = moving_average(mu, projected, b1)
    nu = moving_average(nu, projected * projected, b2)
    direction = along(mu / (jnp.sqrt(nu) + config.eps), qs, transpose=True)
    if config.normalize_grads:
        axes = tuple(range(1, direction.ndim))
        rms = jnp.sqrt(jnp.mean(direction * direction, axis=axes, keepdims=True))
        direction = direction / (1e-30 + rms)
    if config.correct_bias:
        t = jnp.maximum(count, 1)
        scale = jnp.sqrt(bias_correction(config.b2, t, mu.dtype)) / bias_correction(
            config.b1, t, mu.dtype
        )
        direction = direction * scale
    return direction, mu, nu


def _leaf_step(step: _Step, p: int, g, mu, nu, bases, count):
    """(update, μ, ν, grams per statistic entry) of parameter ``p``."""
    plan = step.layout.plans[p]
    dtype = mu.dtype
    if not g.size:
        return jnp.zeros_like(mu), mu, nu, []
    x = g.astype(dtype)
    pieces, grams = [], []
    for index, group in enumerate(plan.groups):
        qs = _bases_of(step, bases, p, index, dtype)
        blocks = _blocks(x, plan, group)
        out = _adam_blocks(
            step.config,
            blocks,
            _blocks(mu, plan, group),
            _blocks(nu, plan, group),
            qs,
            count,
        )
        pieces.append((group.region, out))
        by_axis = block_grams(blocks, group.axes, None)
        grams.extend(by_axis[k] for k in group.axes)
    joined = [
        join([(region, out[i]) for region, out in pieces]).reshape(g.shape)
        for i in range(3)
    ]
    return (*joined, grams)


# ------------------------------------------------------------------ statistics


def _new_statistics(step: _Step, grams_per_leaf, statistics, beta, usable):
    """S ← β_s·S + (1−β_s)·G ⋅_{¬k} G for every block and axis, in stack order
    (padding rows stay 0); every S as it was where the step is not ``usable``."""
    pieces: list[list] = [[] for _ in step.layout.sizes]
    for grams, slots in zip(grams_per_leaf, step.layout.slots, strict=True):
        for gram, (stack, _, _) in zip(grams, slots, strict=True):
            pieces[stack].append(gram)
    out = []
    for stack, old in zip(pieces, statistics, strict=True):
        gram = jnp.concatenate(stack).astype(old.dtype)
        gram = jnp.pad(gram, ((0, old.shape[0] - gram.shape[0]), (0, 0), (0, 0)))
        b = jnp.asarray(beta, old.dtype)  # as the moments' β (_adam_blocks)
        new = jnp.where(usable, b * old + (1 - b) * gram, old).astype(old.dtype)
        out.append(step.sharding.constrain(new, step.sharding.stack_spec))
    return tuple(out)


# ------------------------------------------------------------------ refresh


def _eigh_rows(s: jax.Array, q: jax.Array):
    """(eigenvectors of S by descending eigenvalue, the identity order)."""
    vectors = eigh(s.astype(_linalg_dtype(s)))[1][:, ::-1]
    return vectors.astype(q.dtype), jnp.arange(s.shape[-1])


def _power_rows(s: jax.Array, q: jax.Array):
    """One power step: the columns of Q sorted by descending diag(QᵀSQ), then
    Q ← qr(S·Q_sorted).Q; and that order (which the second moment follows)."""
    dtype = _linalg_dtype(s)
    s, q = s.astype(dtype), q.astype(dtype)
    sq = s @ q
    order = jnp.argsort(-jnp.sum(q * sq, axis=0), stable=True)
    return qr(sq[:, order]).astype(q.dtype), order


def _linalg_dtype(x: jax.Array):
    return jnp.promote_types(x.dtype, jnp.float32)


def _over_rows(fn, sharding: ShardingPlan, *stacks):
    """``fn`` on every row of the stacks: each device on the rows it holds (a
    shard_map) when they are split over a mesh, else one vmap."""
    mapped = jax.vmap(fn)
    if sharding.shards == 1:
        return mapped(*stacks)
    spec = sharding.stack_spec
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(
        mapped,
        mesh=sharding.mesh if mesh.empty else mesh,
        in_specs=(spec,) * len(stacks),
        out_specs=(spec, spec),
        check_vma=False,
    )(*stacks)


def _refreshed_bases(step: _Step, kind: int, statistics, bases):
    """(new bases, orders or None) of every stack; padding rows keep I."""
    rows_fn = _eigh_rows if kind == EIGH else _power_rows
    new_bases, orders = [], []
    for stack, (s, q) in enumerate(zip(statistics, bases, strict=True)):
        new, order = _over_rows(rows_fn, step.sharding, s, q)
        real = (jnp.arange(q.shape[0]) < step.layout.rows[stack])[:, None, None]
        new = jnp.where(real, new, q)
        new_bases.append(step.sharding.constrain(new, step.sharding.stack_spec))
        orders.append(order)
    return tuple(new_bases), (tuple(orders) if kind == QR else None)


def _rotated_moments(step: _Step, mus, nus, old_bases, new_bases, orders):
    """Each block's first moment projected back with the old bases and into the
    new ones; its second moment permuted by the refresh's order (QR)."""
    out_mu, out_nu = [], []
    for p, (plan, mu, nu) in enumerate(zip(step.layout.plans, mus, nus, strict=True)):
        if not mu.size or not plan.entries:
            out_mu.append(mu)
            out_nu.append(nu)
            continue
        pieces_mu, pieces_nu = [], []
        for index, group in enumerate(plan.groups):
            old = _bases_of(step, old_bases, p, index, mu.dtype)
            new = _bases_of(step, new_bases, p, index, mu.dtype)
            m = along(along(_blocks(mu, plan, group), old, transpose=True), new)
            v = _blocks(nu, plan, group)
            if orders is not None:
                v = permuted(v, _bases_of(step, orders, p, index, jnp.int32))
            pieces_mu.append((group.region, m))
            pieces_nu.append((group.region, v))
        out_mu.append(join(pieces_mu).reshape(mu.shape))
        out_nu.append(join(pieces_nu).reshape(nu.shape))
    return out_mu, out_nu


def _refresh(step: _Step, index, statistics, bases, mus, nus):
    """lax.switch over KEEP / EIGH / QR: (bases, μ, ν) after the refresh."""

    def branch(kind):
        def run(operands):
            statistics, bases, mus, nus = operands
            if kind == KEEP:
                return bases, mus, nus
            new, orders = _refreshed_bases(step, kind, statistics, bases)
            return (new, *_rotated_moments(step, mus, nus, bases, new, orders))

        return run

    kinds = (KEEP, EIGH) if step.config.refresh == "eigh" else (KEEP, EIGH, QR)
    operands = (statistics, bases, mus, nus)
    return lax.switch(
        jnp.minimum(index, len(kinds) - 1), [branch(k) for k in kinds], operands
    )


def _refresh_index(config: Config, count, usable):
    """EIGH on the first step, QR (or EIGH) every ``precondition_frequency``
    Adam steps, else KEEP; KEEP on a skipped step."""
    due = (count > 0) & (count % config.precondition_frequency == 0)
    periodic = EIGH if config.refresh == "eigh" else QR
    index = jnp.where(count == 0, EIGH, jnp.where(due, periodic, KEEP))
    return jnp.where(usable, index, KEEP)


# ------------------------------------------------------------------ the step


def soap_update(updates, state: SoapState, params, config: Config, warning):
    """(updates, new state) of one step; see ``scale_by_soap``. A step whose
    gradients are unusable returns zeros and the state unchanged, but for its
    count of skipped steps (the first reported by ``warning``)."""
    grads, treedef = jax.tree.flatten(updates)
    check_state_matches(
        state,
        functools.partial(init_state, config=config, constrain=False),
        params,
        updates,
        "soap",
    )
    del params  # the moments are the whole state a step needs
    sharding = placement(updates, config)
    step = _Step(config, layout_of(grads, config, sharding), sharding)
    specs = state_specs(sharding, treedef, len(step.layout.sizes))
    return sharding.run(
        lambda g, s: _step(step, treedef, g, s, warning),
        (specs.mu, specs),
        grads,
        state,
    )


def _step(step: _Step, treedef, grads: list, state: SoapState, warning):
    """The body of :func:`soap_update`, on the gradients' leaves."""
    config, sharding = step.config, step.sharding
    usable = step_is_usable(grads)
    count, first = state.count, state.count == 0
    old_mus = treedef.flatten_up_to(state.mu)
    old_nus = treedef.flatten_up_to(state.nu)
    with matmul_precision(config.precision):
        bases = [sharding.constrain(q, PartitionSpec()) for q in state.bases]
        results = [
            _leaf_step(step, p, g, mu, nu, bases, count)
            for p, (g, mu, nu) in enumerate(zip(grads, old_mus, old_nus, strict=True))
        ]
        outputs, mus, nus, grams = list(zip(*results, strict=True)) or [()] * 4
        # The first step only takes the bases: no direction, the moments stay 0.
        mus = [
            jnp.where(first, old, new) for old, new in zip(old_mus, mus, strict=True)
        ]
        nus = [
            jnp.where(first, old, new) for old, new in zip(old_nus, nus, strict=True)
        ]
        beta = config.statistics_beta
        statistics = _new_statistics(step, grams, state.statistics, beta, usable)
        index = _refresh_index(config, count, usable)
        new_bases, mus, nus = _refresh(step, index, statistics, state.bases, mus, nus)
    outputs = [jnp.where(first, 0, u) for u in outputs]
    outputs = zeros_unless_usable(usable, sharding.constrain_params(outputs), grads)
    new_state = SoapState(
        count=next_count(count, usable),
        mu=jax.tree.unflatten(treedef, sharding.constrain_params(mus)),
        nu=jax.tree.unflatten(treedef, sharding.constrain_params(nus)),
        statistics=statistics,
        bases=tuple(new_bases),
        skipped=state.skipped,
    )
    guarded = fields_unless_skipped(
        usable, new_state, state, already_kept=("statistics", "bases")
    )
    return jax.tree.unflatten(treedef, outputs), skip_counted(usable, guarded, warning)
