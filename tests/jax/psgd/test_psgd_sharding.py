"""XMat, LRA and Affine with their state on a mesh of 8 (simulated) devices.

With ``preconditioner_partition_spec=P('x')`` every factor is split along its
first axis (zero-padded to a multiple of 8) and the momentum follows
``params_partition_specs``. The oracle is the same optimizer without any
placement argument: five steps (fits every step, momentum, a NaN step that must
be skipped) give the same updates up to the order of the sums over n, and
each device holds 1/8 of every factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import precond.jax as pj

SHAPES = {"w": (16, 7), "b": (7,), "t": (3, 5, 2)}  # n = 16·7 + 7 + 30 = 149
SPECS = {"w": PartitionSpec("x"), "b": PartitionSpec(), "t": PartitionSpec()}
OPTIMIZERS = {
    "xmat": pj.scale_by_xmat,
    "lra": pj.scale_by_lra,
    "affine": pj.scale_by_affine,
}
STEPS = 5
NAN_STEP = 3


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def _gradients():
    rng = np.random.default_rng(0)
    steps = []
    for t in range(STEPS):
        g = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
        if t == NAN_STEP:
            g["b"] = g["b"].at[0].set(jnp.nan)
        steps.append(g)
    return steps


def _run(optimizer, params, gradients):
    state = jax.jit(optimizer.init)(params)
    update = jax.jit(optimizer.update)
    updates = []
    for g in gradients:
        u, state = update(g, state, params)
        updates.append(u)
    return updates, state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_state_gives_the_unsharded_updates(name, mesh):
    make = OPTIMIZERS[name]
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    want, want_state = _run(make(precond_init_scale=1.0), params, _gradients())
    sharded = make(
        precond_init_scale=1.0,
        params_partition_specs=SPECS,
        preconditioner_partition_spec=PartitionSpec("x"),
        mesh=mesh,
    )
    placed = {
        k: jax.device_put(p, NamedSharding(mesh, SPECS[k])) for k, p in params.items()
    }
    got, state = _run(sharded, placed, _gradients())
    for step, (u, w) in enumerate(zip(got, want, strict=True)):
        for k in SHAPES:
            np.testing.assert_allclose(
                u[k], w[k], rtol=2e-5, atol=1e-6, err_msg=f"{name} step {step} {k}"
            )
    assert all(bool((u == 0).all()) for u in got[NAN_STEP].values())
    assert int(state.count) == int(want_state.count) == STEPS - 1
    for factor, unsharded in zip(
        jax.tree.leaves(state.preconditioner),
        jax.tree.leaves(want_state.preconditioner),
        strict=True,
    ):
        if factor.ndim == 0:
            continue
        rows = -(-unsharded.shape[0] // 8) * 8
        assert factor.shape == (rows, *unsharded.shape[1:])
        assert factor.sharding.spec[0] == "x"
        shard = factor.addressable_shards[0].data
        assert shard.shape == (rows // 8, *unsharded.shape[1:])
        np.testing.assert_array_equal(factor[unsharded.shape[0] :], 0)
    assert state.mu["w"].sharding.spec == PartitionSpec("x")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_spec_without_a_mesh_is_refused_with_a_clear_error(name):
    optimizer = OPTIMIZERS[name](preconditioner_partition_spec=PartitionSpec("x"))
    with pytest.raises(ValueError, match="need a mesh"):
        optimizer.init({"w": jnp.zeros((4, 3))})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_spec_of_the_wrong_type_is_refused_at_construction(name):
    with pytest.raises(ValueError, match="preconditioner_partition_spec"):
        OPTIMIZERS[name](preconditioner_partition_spec="x")
