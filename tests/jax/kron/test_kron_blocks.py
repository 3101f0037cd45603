"""Block partitioning: layout round trips, inert padding, and the no-op identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj
from precond.jax.kron import _layout as layout
from tests.jax.helpers import (
    float64,
    kron_module,
    run_updates,
    seed_that_balances_at_step,
)
from tests.reference import kron_reference as ref


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


def _plan(shape, block_size, scanned=False):
    return layout.plan_tensor(
        shape,
        scanned=scanned,
        path="p",
        max_size_triangular=8192,
        min_ndim_triangular=2,
        memory_save_mode=None,
        merge_small_dims=False,
        target_merged_dim_size=2048,
        block_size=block_size,
    )


@pytest.mark.parametrize(
    ("shape", "block_size", "scanned"),
    [((5, 7), 4, False), ((3, 9, 2), 4, False), ((2, 5, 6), 3, True), ((7,), 3, False)],
)
def test_units_round_trip_and_extents(shape, block_size, scanned):
    plan = _plan(shape, block_size, scanned)
    lead = plan.lead(shape)
    x = jnp.arange(np.prod(shape), dtype=jnp.float64).reshape(shape) + 1
    units = layout.to_units(x, plan)
    np.testing.assert_array_equal(layout.from_units(units, plan, lead), x)
    extents = layout.unit_extents(plan, lead)
    assert units.shape == (len(extents), *plan.block_shape)
    for unit, extent in zip(units, extents):
        real = unit[tuple(slice(0, e) for e in extent)]
        assert bool(jnp.all(real > 0))  # every real entry comes from x
        assert float(jnp.sum(unit)) == float(jnp.sum(real))  # padding is zero


def _grads(shapes, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.normal(size=s)) for k, s in shapes.items()}
        for _ in range(steps)
    ]


def test_block_size_above_every_dim_equals_no_blocking():
    shapes = {"w": (6, 5), "t": (3, 4, 2), "b": (5,)}
    grads = _grads(shapes, steps=4)
    params = {k: jnp.zeros(s) for k, s in shapes.items()}
    kwargs = dict(
        precond_dtype=jnp.float64,
        preconditioner_update_probability=0.5,
        merge_small_dims=False,
    )
    blocked, _ = run_updates(
        pj.scale_by_kron(partition_grads_into_blocks=True, block_size=6, **kwargs),
        params,
        grads,
    )
    plain, _ = run_updates(
        pj.scale_by_kron(partition_grads_into_blocks=False, **kwargs), params, grads
    )
    for a, b in zip(blocked, plain):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_padding_is_inert():
    """A (5, 7) parameter in 4×4 blocks equals, block by block, the unpadded
    reference fit on each real sub-block (edge blocks 4×3, 1×4, 1×3) with the same
    noise, the damping scale mean|G| of the whole (real) parameter, and balancing
    on real entries only."""
    shape, block = (5, 7), 4
    seed = seed_that_balances_at_step(2)
    grads = [g["w"] for g in _grads({"w": shape}, steps=4, seed=1)]
    optimizer = pj.scale_by_kron(
        b1=0.0,
        preconditioner_update_probability=1.0,
        precond_dtype=jnp.float64,
        partition_grads_into_blocks=True,
        block_size=block,
        seed=seed,
        merge_small_dims=False,
    )
    got, _ = run_updates(optimizer, {"w": jnp.zeros(shape)}, [{"w": g} for g in grads])

    chunks = [(slice(0, 4), slice(4, 5)), (slice(0, 4), slice(4, 7))]
    Qs = {
        (r, c): [
            np.eye(len(range(*rows.indices(5)))),
            np.eye(len(range(*cols.indices(7)))),
        ]
        for r, rows in enumerate(chunks[0])
        for c, cols in enumerate(chunks[1])
    }
    for n, (G, updates) in enumerate(zip(grads, got), start=1):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), n)
        balance, noise_key = kron_module.fit_randomness(key)
        G = np.asarray(G)
        U = np.zeros(shape)
        for (r, c), factors in Qs.items():
            rows, cols = chunks[0][r], chunks[1][c]
            G_block = G[rows, cols]
            # Units are numbered in row-major block order; the noise of an edge
            # block is the top-left corner of a full block's draw.
            V_block = np.asarray(
                kron_module.unit_noise(noise_key, 0, 2 * r + c, (block, block), G.dtype)
            )[: G_block.shape[0], : G_block.shape[1]]
            if bool(balance):
                factors = ref.balance_factors(factors)
            damped = G_block + ref.DAMPING_SCALE * np.mean(np.abs(G)) * V_block
            factors = ref.update_factors(factors, damped, V_block, 0.1)
            Qs[(r, c)] = factors
            U[rows, cols] = ref.precondition(factors, G_block)
        U = U / max(1.0, np.sqrt(np.mean(U**2)) / 1.1)
        np.testing.assert_allclose(updates["w"], U, rtol=1e-10, atol=1e-14)


def test_blocks_of_all_parameters_share_one_stack():
    params = {"a": jnp.zeros((8, 8)), "b": jnp.zeros((4, 12)), "c": jnp.zeros((4, 4))}
    state = pj.scale_by_kron(partition_grads_into_blocks=True, block_size=4).init(
        params
    )
    # 4 + 3 + 1 blocks of 4×4: one stack of 8 units with two triangular factors.
    assert [f.shape for f in jax.tree.leaves(state.preconditioners)] == [
        (8, 5, 4),
        (8, 5, 4),
    ]


def test_bad_block_size():
    with pytest.raises(ValueError, match="Invalid block_size=0: must be >= 1"):
        pj.kron(partition_grads_into_blocks=True, block_size=0)
