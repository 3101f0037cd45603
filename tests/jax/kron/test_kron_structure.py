"""Structure identities of Kron's scanned layers and merged dims (DESIGN.md §7.2)."""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj
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


def _random_grads(shapes, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {name: jnp.asarray(rng.normal(size=shape)) for name, shape in shapes.items()}
        for _ in range(steps)
    ]


def _factor_shapes(state):
    return [f.shape for f in jax.tree.leaves(state.preconditioners)]


KWARGS = dict(precond_dtype=jnp.float64, preconditioner_update_probability=0.5)


@pytest.mark.parametrize("lax_map", [False, True])
def test_scanned_parameter_equals_independent_layers(lax_map):
    """Layer l of a scanned (L, m, n) parameter = a lone (m, n) parameter fitted by
    the float64 reference with that layer's noise (unit l of parameter 0): every
    layer has its own factors, momentum bias correction and RMS clip."""
    layers, m, n, b1 = 3, 5, 4, 0.9
    seed = seed_that_balances_at_step(2)
    grads = _random_grads({"stack": (layers, m, n)}, steps=4)
    scanned = pj.scale_by_kron(
        b1=b1,
        scanned_layers={"stack": True},
        lax_map_scanned_layers=lax_map,
        lax_map_batch_size=2,
        seed=seed,
        independent_scanned_layers=True,
        **KWARGS,
    )
    got, state = run_updates(scanned, {"stack": jnp.zeros((layers, m, n))}, grads)
    assert _factor_shapes(state) == [(layers, m + 1, m), (layers, n + 1, n)]

    for l in range(layers):
        Qs, mu, counter = [np.eye(m), np.eye(n)], np.zeros((m, n)), 0
        for step, (g, updates) in enumerate(zip(grads, got), start=1):
            mu = b1 * mu + (1 - b1) * np.asarray(g["stack"][l])
            mu_hat = mu / (1 - b1**step)
            counter += 1
            if counter >= 1 / KWARGS["preconditioner_update_probability"]:
                counter = 0
                key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
                balance, noise_key = kron_module.fit_randomness(key)
                V = np.asarray(
                    kron_module.unit_noise(noise_key, 0, l, (m, n), jnp.float64)
                )
                if bool(balance):
                    Qs = ref.balance_factors(Qs)
                Qs = ref.update_factors(Qs, ref.add_damping_noise(mu_hat, V), V, 0.1)
            U = ref.precondition(Qs, mu_hat)
            U = U / max(1.0, np.sqrt(np.mean(U**2)) / 1.1)
            np.testing.assert_allclose(updates["stack"][l], U, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("style", ["EQ", "PRO"])
def test_fit_in_batches_equals_one_vmap(monkeypatch, style):
    """A stack fitted batch by batch (``_fit_batch_size``, on a CPU) updates and
    fits as in one vmap over its units, to float64 rounding (XLA may pick other
    kernels for another batch size): batches of 3 of the stack of 6 units, and
    of 1 of the 7 units (no larger divisor)."""
    shapes = {"even": (6, 5, 4), "odd": (7, 3, 4)}
    grads = _random_grads(shapes, steps=4)
    kwargs = dict(
        scanned_layers={k: True for k in shapes},
        preconditioner_update_style=style,
        **KWARGS,
    )

    params = {k: jnp.zeros(s) for k, s in shapes.items()}

    def run():
        return run_updates(pj.scale_by_kron(**kwargs), params, grads)

    whole, whole_state = run()
    step_module = importlib.import_module("precond.jax.kron._step")
    fit_batch_size = step_module._fit_batch_size
    batch_sizes = []

    def recorded(*args):
        batch_sizes.append(fit_batch_size(*args))
        return batch_sizes[-1]

    # Room for 4 units of 5×4 in float64: 4·(4·20 + 8·(25 + 16))·8 bytes.
    monkeypatch.setattr(step_module, "FIT_BATCH_BYTES", 4 * 3264)
    monkeypatch.setattr(step_module, "_fit_batch_size", recorded)
    batched, batched_state = run()
    # The 7 units of 3×4 (1984 bytes each): room for 6, and 7 is prime.
    assert sorted(set(batch_sizes)) == [1, 3]
    for got, want in zip(batched, whole, strict=True):
        for k in shapes:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-13, atol=1e-15)
    for got, want in zip(
        jax.tree.leaves(batched_state), jax.tree.leaves(whole_state), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def test_scanned_layers_accepts_a_callable():
    params = {"stack": jnp.zeros((2, 3, 3)), "bias": jnp.zeros(3)}
    optimizer = pj.scale_by_kron(
        scanned_layers=lambda p: jax.tree.map(lambda x: x.ndim == 3, p)
    )
    state = optimizer.init(params)
    # Stacks in leaf order: the bias's one unit, then the two layers of "stack".
    assert _factor_shapes(state) == [(1, 3), (2, 4, 3), (2, 4, 3)]


def test_merged_dims_equal_kron_on_the_merged_shape():
    """merge_small_dims on shape s = plain Kron on the reshaped parameter."""
    shapes = {"conv": (4, 2, 3, 3), "vector": (5,), "matrix": (3, 4)}
    # (4, 2, 3, 3) under target 20: (8, 9) beats (4, 18) as the more balanced split.
    merged = {"conv": (8, 9), "vector": (5,), "matrix": (3, 4)}
    grads = _random_grads(shapes, steps=4)
    with_merging, state = run_updates(
        pj.scale_by_kron(merge_small_dims=True, target_merged_dim_size=20, **KWARGS),
        {k: jnp.zeros(s) for k, s in shapes.items()},
        grads,
    )
    reshaped, _ = run_updates(
        pj.scale_by_kron(**KWARGS),
        {k: jnp.zeros(s) for k, s in merged.items()},
        [{k: g[k].reshape(merged[k]) for k in shapes} for g in grads],
    )
    for got, want in zip(with_merging, reshaped):
        for k in shapes:
            np.testing.assert_allclose(
                got[k], want[k].reshape(shapes[k]), rtol=1e-12, atol=1e-15
            )
    # Stacks in leaf order: conv (8, 9), matrix (3, 4), vector (5,).
    assert _factor_shapes(state) == [
        (1, 9, 8),
        (1, 10, 9),
        (1, 4, 3),
        (1, 5, 4),
        (1, 5),
    ]


def test_merging_keeps_factor_memory_small_for_conv_kernels():
    """A (64, 32, 3, 3) kernel: factors 64 and 288, ~4.7 numbers per parameter."""
    params = {"kernel": jnp.zeros((64, 32, 3, 3), jnp.float32)}
    state = pj.scale_by_kron(
        merge_small_dims=True, partition_grads_into_blocks=False
    ).init(params)
    factor_numbers = sum(f.size for f in jax.tree.leaves(state.preconditioners))
    assert _factor_shapes(state) == [(1, 65, 64), (1, 289, 288)]
    assert factor_numbers < 5 * math.prod(params["kernel"].shape)


def test_merged_axis_is_diagonal_only_if_all_its_sources_are():
    # one_diag: (1, 8) gets two diagonal factors (size 1, and the largest axis);
    # (3, 4, 5): axis 2 diagonal; the merged (3, 4) -> 12 stays triangular.
    params = {"row": jnp.zeros((1, 8)), "t": jnp.zeros((3, 4, 5))}
    state = pj.scale_by_kron(
        merge_small_dims=True, target_merged_dim_size=12, memory_save_mode="one_diag"
    ).init(params)
    assert _factor_shapes(state) == [(1, 1), (1, 8), (1, 13, 12), (1, 5)]


def test_digits_mlp_state_with_merging_and_blocks_is_within_twice_the_plain_state():
    """The digits MLP 64→256→256→10 with merging and blocking at their default
    sizes keeps its factors within 2× of plain Kron (an existing implementation's
    defaults give 18.5 MB of factors for ~19k parameters)."""
    params = {
        "w1": jnp.zeros((64, 256)),
        "b1": jnp.zeros(256),
        "w2": jnp.zeros((256, 256)),
        "b2": jnp.zeros(256),
        "w3": jnp.zeros((256, 10)),
        "b3": jnp.zeros(10),
    }

    def factor_bytes(**kwargs):
        state = pj.scale_by_kron(**kwargs).init(params)
        return sum(x.nbytes for x in jax.tree.leaves(state.preconditioners))

    plain = factor_bytes(merge_small_dims=False, partition_grads_into_blocks=False)
    assert factor_bytes(partition_grads_into_blocks=False) <= 2 * plain
    assert factor_bytes(merge_small_dims=False) <= 2 * plain
    assert factor_bytes() <= 2 * plain  # the defaults: merged and blocked
    # Packed float32 factors: 65·64 + 4·257·256 + 11·10 + diagonals = 1.07 MB.
    assert plain < 1.1e6


@pytest.mark.parametrize(
    ("scanned_layers", "message"),
    [
        ({"a": True}, "Invalid scanned_layers: must have the structure of the params"),
        ({"a": True, "s": True}, "Invalid scanned_layers: parameter ['s'] is 0-d"),
    ],
)
def test_bad_scanned_layers(scanned_layers, message):
    params = {"a": jnp.zeros((2, 3)), "s": jnp.zeros(())}
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        pj.scale_by_kron(scanned_layers=scanned_layers).init(params)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lax_map_batch_size": 0}, "Invalid lax_map_batch_size=0: must be >= 1"),
        ({"target_merged_dim_size": -4}, "Invalid target_merged_dim_size=-4"),
    ],
)
def test_bad_structure_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pj.kron(**kwargs)


def test_default_merging_and_blocking_do_not_inflate_a_small_mlp():
    """32→64→64→10: the default (merged, blocked) factors take no more memory
    than plain Kron's; distributed-kron's merge rule makes the 64×64 and 32×64
    kernels single 4096- and 2048-long triangular axes (about 100× the bytes)."""
    shapes = {"w1": (32, 64), "b1": (64,), "w2": (64, 64), "b2": (64,)}
    shapes |= {"w3": (64, 10), "b3": (10,)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}

    def factor_bytes(**kwargs):
        state = jax.eval_shape(pj.scale_by_kron(**kwargs).init, params)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state[2]))

    plain = factor_bytes(merge_small_dims=False, partition_grads_into_blocks=False)
    assert factor_bytes() <= plain
    assert factor_bytes(merge_rule="distributed_kron") > 50 * plain
