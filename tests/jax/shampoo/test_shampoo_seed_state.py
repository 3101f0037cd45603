"""Loading states written in the seed's layout into precond's Shampoo.

optax-shampoo 0.0.6 (the oracle, with the shims of ``test_parity_shampoo``)
trains a few steps and its state -- ``ShampooState(count, stats)`` of
``ParameterStats`` with ``QuantizedValue`` members, or ``ShardedShampooStats``
with ``shard_optimizer_states`` -- goes through ``shampoo_state_from_seed``.
Then both optimizers continue from the same parameters with the same gradients
for 10 steps: the displacements agree to 1e-5 (relative, float32). And
precond's own state, seen in the seed's layout by ``seed_parameter_stats`` and
converted back, is the state it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import precond.jax as ps
from precond.jax.shampoo import _math as sm
from tests.jax.shampoo.test_parity_shampoo import (
    BASE,
    NEWER,
    _relative_difference,
    patched_optax_shampoo,
    random_params_and_grads,
)

# Blocked and unblocked statistics of four sizes, a rank-3 parameter (its int8
# momentum is stored with a moved axis), a vector and a scalar (no statistics).
SHAPES = {"a": (6, 5), "b": (3, 4, 2), "c": (4,), "d": ()}


@pytest.fixture(scope="module")
def google():
    """optax-shampoo 0.0.6, with the shims of ``test_parity_shampoo``."""
    yield from patched_optax_shampoo()


WARMUP = 4  # steps 0.0.6 takes before its state is converted
CONTINUED = 10


def _data(shapes=SHAPES, steps=WARMUP + CONTINUED, seed=5):
    return random_params_and_grads(shapes, steps, seed)


def _run(update, state, params, grads):
    """(displacements from ``params`` after each step, final state, params)."""
    start, out = params, []
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(jax.tree.map(jnp.subtract, params, start))
    return out, state, params


def _pmapped(opt):
    """``opt.update`` in pmap over one device with axis 'batch' (state and
    arrays carried with a leading device axis of 1)."""
    step = jax.pmap(opt.update, axis_name="batch", devices=jax.devices()[:1])

    def update(grads, state, params):
        add = lambda x: x[None]  # noqa: E731
        updates, state = step(
            jax.tree.map(add, grads), state, jax.tree.map(add, params)
        )
        return jax.tree.map(lambda x: x[0], updates), state

    return update


# (case id, arguments of both, precond-only arguments, how the update runs)
CASES = [
    ("default_mode_adagrad", {"graft_type": 2}, {}, "jit"),
    ("memory_mode_int8_momenta_sqrt_n_two_momenta_no_metrics",
     {"graft_type": 5, "best_effort_memory_usage_reduction": True,
      "generate_training_metrics": False},
     {"separate_grafting_momentum": True}, "jit"),
    ("pmap_memory_mode_int16_statistics",
     {"best_effort_memory_usage_reduction": True, "batch_axis_name": "batch"},
     {}, "pmap"),
    ("sharded_states_previous_roots",
     {"shard_optimizer_states": True, "num_devices_for_pjit": 8,
      "statistics_partition_spec": P("data", None, None),
      "preconditioner_partition_spec": P("data", None, None)},
     {}, "mesh"),
]  # fmt: skip


def _continue_both(google, arguments, ours_only, mode):
    kwargs = {**BASE, **NEWER, **arguments}
    params, grads = _data()
    theirs = google.distributed_shampoo(**kwargs)
    ours = ps.distributed_shampoo(**kwargs, **ours_only)
    if mode == "pmap":
        # State arrays carry the device axis; the converter reads one copy.
        init = jax.pmap(theirs.init, devices=jax.devices()[:1])
        state = init(jax.tree.map(lambda x: x[None], params))
        _, state, start = _run(_pmapped(theirs), state, params, grads[:WARMUP])
        seed_state = jax.tree.map(lambda x: x[0], state)
        converted = ps.shampoo_state_from_seed(seed_state, start, **kwargs)
        want, _, _ = _run(_pmapped(theirs), state, start, grads[WARMUP:])
        add = lambda x: x[None]  # noqa: E731
        got, _, _ = _run(
            _pmapped(ours), jax.tree.map(add, converted), start, grads[WARMUP:]
        )
        return got, want, seed_state, converted
    if mode == "mesh":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        with jax.set_mesh(mesh):
            state = jax.jit(theirs.init(None).init_fn)(params)
            _, state, start = _run(
                jax.jit(theirs.update), state, params, grads[:WARMUP]
            )
            converted = ps.shampoo_state_from_seed(state, start, **kwargs)
            want, _, _ = _run(jax.jit(theirs.update), state, start, grads[WARMUP:])
            got, _, _ = _run(jax.jit(ours.update), converted, start, grads[WARMUP:])
        return got, want, state, converted
    state = theirs.init(params)
    _, state, start = _run(jax.jit(theirs.update), state, params, grads[:WARMUP])
    converted = ps.shampoo_state_from_seed(state, start, **kwargs, **ours_only)
    want, _, _ = _run(jax.jit(theirs.update), state, start, grads[WARMUP:])
    got, _, _ = _run(jax.jit(ours.update), converted, start, grads[WARMUP:])
    return got, want, state, converted


@pytest.mark.parametrize(
    ("arguments", "ours_only", "mode"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_states_of_0_0_6_continue_the_same_in_precond(
    google, arguments, ours_only, mode
):
    """4 steps of 0.0.6, its state converted, then 10 more steps of each agree.
    Measured 2026-12-04 (largest relative difference of the displacements):
    default 2.2e-7, memory + SQRT_N 2.3e-7, pmap int16 2.3e-7, sharded 1.6e-7."""
    got, want, _, converted = _continue_both(google, arguments, ours_only, mode)
    worst = _relative_difference(got, want)
    print("largest relative difference:", worst)
    assert worst <= 1e-5
    assert int(converted.count) == WARMUP
    if mode == "pmap":  # the int16 members went through the converter
        assert isinstance(converted.statistics[0], sm.QuantizedArray)
    if arguments.get("best_effort_memory_usage_reduction"):
        assert isinstance(converted.momentum["b"], sm.QuantizedArray)


def test_a_fresh_state_would_not_continue_the_same(google):
    """The comparison can fail: precond started afresh (count 0, empty
    statistics) from the same parameters moves them differently from 0.0.6's
    continued run."""
    kwargs = {**BASE, **NEWER, "graft_type": 2}
    params, grads = _data()
    theirs = google.distributed_shampoo(**kwargs)
    ours = ps.distributed_shampoo(**kwargs)
    _, state, start = _run(jax.jit(theirs.update), theirs.init(params), params,
                           grads[:WARMUP])  # fmt: skip
    want, _, _ = _run(jax.jit(theirs.update), state, start, grads[WARMUP:])
    fresh, _, _ = _run(jax.jit(ours.update), ours.init(start), start, grads[WARMUP:])
    assert _relative_difference(fresh, want) > 1e-2


# One run covers every kind of member: int8 momenta (rank 3 with a moved axis),
# int16 statistics and roots, AdaGrad's diagonal statistics, root errors in
# blocked order, and stacks padded with identity rows for 8 devices.
ROUND_TRIP = {
    "best_effort_memory_usage_reduction": True,
    "quantize_statistics": True,
    "graft_type": 2,
    "preconditioner_partition_spec": P("data", None, None),
}


def _equal_states(a, b, name):
    assert jax.tree.structure(a) == jax.tree.structure(b), name
    for path, x in jax.tree_util.tree_leaves_with_path(a):
        y = dict(jax.tree_util.tree_leaves_with_path(b))[path]
        where = f"{name}: {jax.tree_util.keystr(path)}"
        assert x.shape == y.shape, where
        assert x.dtype == y.dtype, where
        if ".scales" in jax.tree_util.keystr(path):
            # A dequantized value q·s requantizes to the same integers q with a
            # scale max|q·s|/qmax that can round 1 ulp away from s.
            np.testing.assert_allclose(x, y, rtol=2.4e-7, err_msg=where)
        else:
            np.testing.assert_array_equal(x, y, err_msg=where)


def test_seed_view_and_back_is_the_identity():
    """precond → seed_parameter_stats → shampoo_state_from_seed gives back the
    state (after 4 steps, so that nothing is at its initial value)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params, grads = _data(steps=WARMUP)
    kwargs = {**BASE, **NEWER, **ROUND_TRIP}
    opt = ps.distributed_shampoo(**kwargs)
    with jax.set_mesh(mesh):
        _, state, last = _run(jax.jit(opt.update), opt.init(params), params, grads)
    view = ps.seed_parameter_stats(state, last, **kwargs)
    # Some rows are padding (identity), not statistics of the view.
    rows = sum(stack.values.shape[0] for stack in state.statistics)
    is_stats = lambda x: isinstance(x, ps.ParameterStats)  # noqa: E731
    real = sum(len(v.statistics) for v in jax.tree.leaves(view, is_leaf=is_stats))
    assert rows > real
    back = ps.shampoo_state_from_seed(
        ps.SeedShampooState(state.count, view), last, **kwargs
    )
    assert isinstance(back.statistics[0], sm.QuantizedArray)
    assert isinstance(back.momentum["b"], sm.QuantizedArray)
    _equal_states(jax.device_get(back), jax.device_get(state), "round trip")


def test_checkpoints_that_do_not_fit_the_arguments_are_refused(google):
    kwargs = {**BASE, **NEWER}
    params, _ = _data(steps=0)
    state = google.distributed_shampoo(**kwargs).init(params)
    with pytest.raises(ValueError, match=r"Invalid seed_state: \[.b.\] .*statistics"):
        # 0.0.6's default merge limit (4096) merges other dims than 8 does.
        ps.shampoo_state_from_seed(state, params, **BASE)
    with pytest.raises(ValueError, match=r"\['a'\].*has no diagonal_statistics"):
        ps.shampoo_state_from_seed(state, params, **kwargs, graft_type=2)
