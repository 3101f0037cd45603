"""Skipped steps are counted and reported (precond.jax._core.step_policy).

Every JAX optimizer skips a step whose gradient is unusable (NaN, ±Inf, or so
large that its squared norm overflows): zero update, state unchanged but for
its count of skipped steps, ``skipped``, which ``precond.jax.skipped_steps``
reads from any optax state. Asked for (the ``precond.jax`` logger's own level
set to WARNING or lower when the step is traced), the first skipped step of
each optimizer is logged once at WARNING by a host callback compiled into the
step; by default there is no callback (it costs every step, and a program with
one is not written to JAX's persistent compilation cache). Run over every
optimizer and variant of the robustness table (``tests/jax/helpers.py``'s
``EVERY_OPTIMIZER``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from precond.jax._core import step_policy as policy
from tests.jax.helpers import EVERY_OPTIMIZER, assert_skipped_once

NAMES = list(EVERY_OPTIMIZER)
LOGGER = "precond.jax"
PARAMS = {"w": jnp.ones((8, 6)), "b": jnp.zeros(6)}


def _gradients(step: int = 1, bad: float | None = None):
    """Finite gradients of step ``step``, with ``bad`` in w[0, 0] if given."""
    grads = jax.tree.map(lambda p: 0.1 * step * (p - 0.5) + 0.01, PARAMS)
    if bad is not None:
        grads["w"] = grads["w"].at[0, 0].set(bad)
    return grads


def _skip_warnings(caplog) -> list[logging.LogRecord]:
    jax.effects_barrier()  # the callbacks of the steps dispatched so far
    return [
        r
        for r in caplog.records
        if r.name == LOGGER and "skipped a step" in r.getMessage()
    ]


@pytest.mark.parametrize("name", NAMES)
def test_nan_and_inf_steps_are_counted_and_logged_once(name, caplog):
    """Under jit: a finite step counts nothing; a NaN and then an Inf gradient
    each add exactly 1 and leave every other state leaf unchanged; the WARNING
    is logged once over the two, naming the optimizer and the counter."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    optimizer = EVERY_OPTIMIZER[name](0.01)
    update = jax.jit(optimizer.update)
    state = optimizer.init(PARAMS)
    assert pj.skipped_steps(state).dtype == jnp.int32
    assert int(pj.skipped_steps(state)) == 0
    _, state = update(_gradients(), state, PARAMS)
    assert int(pj.skipped_steps(state)) == 0
    assert not _skip_warnings(caplog)
    for bad in (jnp.nan, jnp.inf):
        _, new_state = update(_gradients(bad=bad), state, PARAMS)
        assert_skipped_once(new_state, state)
        state = new_state
    assert int(pj.skipped_steps(state)) == 2
    (record,) = _skip_warnings(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("precond.jax.")
    assert "steps taken so far: 1" in message
    assert "NaN, ±Inf or so large that its squared norm overflows" in message
    assert "precond.jax.skipped_steps(opt_state)" in message


@pytest.mark.parametrize("name", NAMES)
def test_init_on_abstract_params_has_an_int32_counter(name):
    state = jax.eval_shape(EVERY_OPTIMIZER[name](0.01).init, PARAMS)
    shapes = jax.eval_shape(pj.skipped_steps, state)
    assert (shapes.shape, shapes.dtype) == ((), jnp.int32)


@pytest.mark.parametrize("name", NAMES)
def test_the_callback_is_compiled_in_only_when_asked_for(name, caplog):
    """The step traced with the ``precond.jax`` logger's level unset (WARNING
    inherited from the root logger: the default) or at ERROR has no host
    callback (it costs every step, and a program with one is not cached) and
    logs nothing; the count goes on. Traced with the logger's level set to
    WARNING, it has one."""
    grads = _gradients(bad=jnp.nan)

    def lowered_text():
        optimizer = EVERY_OPTIMIZER[name](0.01)  # a fresh update: a new trace
        state = optimizer.init(PARAMS)
        return jax.jit(optimizer.update).lower(grads, state, PARAMS).as_text()

    assert logging.getLogger(LOGGER).level == logging.NOTSET
    assert logging.getLogger(LOGGER).isEnabledFor(logging.WARNING)
    assert "callback" not in lowered_text()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert "callback" in lowered_text()
    caplog.set_level(logging.ERROR, logger=LOGGER)
    assert "callback" not in lowered_text()
    optimizer = EVERY_OPTIMIZER[name](0.01)
    state = optimizer.init(PARAMS)
    _, state = jax.jit(optimizer.update)(grads, state, PARAMS)
    assert int(pj.skipped_steps(state)) == 1
    assert not _skip_warnings(caplog)


def test_the_counter_saturates_at_the_int32_maximum():
    class State(NamedTuple):
        count: jax.Array
        skipped: jax.Array

    top = jnp.iinfo(jnp.int32).max
    warning = policy.SkipWarning("test")
    state = State(jnp.int32(3), jnp.int32(top))
    assert int(policy.skip_counted(jnp.asarray(False), state, warning).skipped) == top
    state = State(jnp.int32(3), jnp.int32(5))
    assert int(policy.skip_counted(jnp.asarray(True), state, warning).skipped) == 5
    assert int(policy.skip_counted(jnp.asarray(False), state, warning).skipped) == 6


def test_each_optimizer_warns_once_and_vmap_warns_only_on_a_skip(caplog):
    """Two optimizers warn once each; under vmap (both branches of the step's
    cond run) a batch without a skipped step logs nothing."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    first, second = (pj.xmat(0.01) for _ in range(2))
    for optimizer in (first, second, first):
        update = jax.jit(optimizer.update)
        update(_gradients(bad=jnp.nan), optimizer.init(PARAMS), PARAMS)
    assert len(_skip_warnings(caplog)) == 2
    optimizer = pj.kron(0.01)
    states = jax.vmap(lambda _: optimizer.init(PARAMS))(jnp.arange(2))
    batched = jax.tree.map(lambda g: jnp.stack([g, g]), _gradients())
    _, states = jax.jit(jax.vmap(optimizer.update))(batched, states)
    assert len(_skip_warnings(caplog)) == 2
    np.testing.assert_array_equal(states[0].skipped, [0, 0])
    batched["w"] = batched["w"].at[1, 0, 0].set(jnp.nan)
    _, states = jax.jit(jax.vmap(optimizer.update))(batched, states)
    np.testing.assert_array_equal(states[0].skipped, [0, 1])
    assert len(_skip_warnings(caplog)) == 3


def test_counts_are_found_inside_wrapping_states():
    """optax.inject_hyperparams and multi_transform states: each optimizer's
    count is found, and the counts add up."""
    injected = optax.inject_hyperparams(pj.kron, static_args=pj.KRON_STATIC_ARGS)(
        learning_rate=0.01
    )
    state = injected.init(PARAMS)
    _, state = injected.update(_gradients(bad=jnp.inf), state, PARAMS)
    assert int(pj.skipped_steps(state)) == 1
    split = optax.multi_transform(
        {"kron": pj.kron(0.01), "xmat": pj.xmat(0.01)}, {"w": "kron", "b": "xmat"}
    )
    state = split.init(PARAMS)
    _, state = split.update(_gradients(bad=jnp.nan), state, PARAMS)  # in w alone
    assert int(pj.skipped_steps(state)) == 1
    grads = _gradients()
    grads["b"] = grads["b"].at[0].set(jnp.nan)
    _, state = split.update(grads, state, PARAMS)
    assert int(pj.skipped_steps(state)) == 2
    assert int(pj.skipped_steps(optax.adam(0.1).init(PARAMS))) == 0


def test_partition_specs_replicate_the_counter():
    kron_specs = pj.get_opt_state_partition_specs(PARAMS, learning_rate=0.1)
    pro_specs = pj.pro_opt_state_partition_specs(PARAMS)
    shampoo_specs = pj.distributed_shampoo_partition_specs(
        PARAMS, {"w": P(), "b": P()}, 0.1, 4
    )
    assert kron_specs[0].skipped == pro_specs[0].skipped == P()
    assert shampoo_specs.skipped == P()


SHARDED = {
    "kron": lambda specs: pj.kron(
        0.01,
        params_partition_specs=specs,
        preconditioner_partition_spec=P("fsdp", None),
        block_size=4,
    ),
    "pro": lambda specs: pj.pro(
        0.01,
        block_size=4,
        pipeline_axis_name="fsdp",
        pipeline_axis_size=8,
        params_partition_specs=specs,
    ),
}


@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_kron_and_pro_count_and_warn_once(name, caplog):
    """States split over 8 simulated devices (init under jit): the counter is
    replicated, a NaN step adds 1, and the WARNING is logged once although the
    callback may run on every device."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = {"w": P("fsdp", None), "b": P()}
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
    with jax.set_mesh(mesh):
        params = jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
        )
        optimizer = SHARDED[name](specs)
        state = jax.jit(optimizer.init)(params)
        assert state[0].skipped.sharding.is_fully_replicated
        update = jax.jit(optimizer.update)
        grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
        for _ in range(2):
            grads["w"] = grads["w"].at[0, 0].set(jnp.nan)
            _, state = update(grads, state, params)
    assert int(pj.skipped_steps(state)) == 2
    assert len(_skip_warnings(caplog)) == 1
