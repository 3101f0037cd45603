"""soap's state placed on a mesh of 8 (simulated) devices: the moments follow
their parameter (``params_partition_specs``), the stacks of statistics and bases
are split along their rows (padded to a multiple of 8), so each device holds
about 1/8 of the state and refreshes 1/8 of the bases (a shard_map over the
rows). The oracle is the same optimizer on one device, without placement."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import precond.jax as pj
from tests.jax.helpers import float64

# Every dim a spec splits is a multiple of 8. Blocks of 8 give 72 rows of 8×8
# statistics and 2 of 3×3 (padded to 8 rows); every block's grams are full rank
# from the first step (see test_soap_reference), so the bases are well defined.
SHAPES = {"w": (64, 24), "b": (24,), "t": (16, 8, 3), "e": (40, 16)}
SPECS = {"w": P("x"), "b": P(), "t": P("x", None, None), "e": P(None, "x")}
KWARGS = dict(block_size=8, precondition_frequency=2, weight_decay=1e-3)
STEPS = 8


def _params(mesh=None):
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s)) for k, s in SHAPES.items()}
    if mesh is None:
        return params
    return {
        k: jax.device_put(p, NamedSharding(mesh, SPECS[k])) for k, p in params.items()
    }


def _run(optimizer, params):
    state = jax.jit(optimizer.init)(params)
    update = jax.jit(optimizer.update)
    outputs = []
    for step in range(STEPS):
        rng = np.random.default_rng(100 + step)
        grads = {
            k: jax.device_put(rng.normal(size=p.shape), p.sharding)
            for k, p in params.items()
        }
        updates, state = update(grads, state, params)
        outputs.append(updates)
        params = optax.apply_updates(params, updates)
    return outputs, state[0]


@functools.cache
def _unsharded():
    with float64():
        return _run(pj.soap(3e-2, **KWARGS), _params())


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_steps_equal_the_unsharded_ones_on_an_eighth_of_the_state(axis_type):
    """On an auto mesh (placed by constraints) and an explicit one (sharding in
    types: the step runs under auto_axes)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))
    want, whole = _unsharded()
    with float64():
        sharded = pj.soap(3e-2, **KWARGS, params_partition_specs=SPECS, mesh=mesh)
        with jax.set_mesh(mesh):
            got, state = _run(sharded, _params(mesh))
    for step, (u, w) in enumerate(zip(got, want, strict=True)):
        for k in SHAPES:
            np.testing.assert_allclose(
                u[k], w[k], rtol=1e-9, atol=1e-12, err_msg=f"step {step} {k}"
            )
            assert u[k].sharding.is_equivalent_to(
                NamedSharding(mesh, SPECS[k]), u[k].ndim
            )
    for k in SHAPES:
        for moment in (state.mu[k], state.nu[k]):
            assert moment.sharding.is_equivalent_to(
                NamedSharding(mesh, SPECS[k]), moment.ndim
            )
    stacks = (*state.statistics, *state.bases)
    assert [s.shape[0] for s in state.statistics] == [8, 72]  # n = 3, 8
    for stack in stacks:
        assert stack.sharding.spec[0] == "x"
        assert stack.addressable_shards[0].data.nbytes * 8 == stack.nbytes
    # Per device: about 1/8 of the unsharded statistics (74 real rows in 80).
    per_device = sum(s.addressable_shards[0].data.nbytes for s in state.statistics)
    unsharded = sum(s.nbytes for s in whole.statistics)
    assert per_device <= unsharded / 8 * 1.05
