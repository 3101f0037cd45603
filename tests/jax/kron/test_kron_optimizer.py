"""Conformance of precond.jax.kron as an optax optimizer (DESIGN.md §7.3).

Convergence on an ill-conditioned quadratic and on Rosenbrock (kron's defaults),
MultiSteps, dtypes, pytree edge cases and the non-finite gradient policy.
optax.inject_hyperparams, one compile for many donated steps and the rest of
optax's optimizer contract are in test_optax_contract.py's table of every
optimizer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj
from tests.jax.helpers import assert_skipped_once


def _spd(rng, d, condition):
    """A rotated SPD matrix with log-spaced eigenvalues from 1 to 1/condition."""
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    eigenvalues = np.logspace(0, -np.log10(condition), d)
    matrix = basis @ np.diag(eigenvalues) @ basis.T
    root = basis @ np.diag(np.sqrt(eigenvalues)) @ basis.T
    return jnp.asarray(matrix, jnp.float32), jnp.asarray(root, jnp.float32)


def _noisy_kronecker_quadratic(seed):
    """L(X) = ½ tr(Xᵀ A X B); gradients carry noise with covariance ∝ B ⊗ A."""
    rng = np.random.default_rng(seed)
    A, A_root = _spd(rng, 16, 1e3)
    B, B_root = _spd(rng, 8, 1e2)
    x0 = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)

    def loss(x):
        return 0.5 * jnp.sum(x * (A @ x @ B))

    def noisy_grad(x, key):
        return A @ x @ B + 0.1 * A_root @ jax.random.normal(key, x.shape) @ B_root

    return loss, noisy_grad, x0


def _run_noisy(optimizer, seed, steps):
    loss, noisy_grad, x0 = _noisy_kronecker_quadratic(seed)

    def body(carry, key):
        x, state = carry
        updates, state = optimizer.update(noisy_grad(x, key), state, x)
        x = optax.apply_updates(x, updates)
        return (x, state), loss(x)

    keys = jax.random.split(jax.random.PRNGKey(seed), steps)
    _, losses = jax.lax.scan(body, (x0, optimizer.init(x0)), keys)
    return losses


@pytest.mark.parametrize("seed", [0, 1])
def test_beats_adam_on_noisy_ill_conditioned_quadratic(seed):
    """Best-of-sweep loss after 300 steps: Kron's Kronecker-factored whitening
    captures the rotated curvature A ⊗ B that Adam's diagonal cannot."""
    steps, window = 300, 50
    learning_rates = [0.3, 0.1, 0.03, 0.01, 0.003]

    def best(make):
        # The rate is traced: one compile per optimizer serves the whole sweep.
        final_loss = jax.jit(
            lambda lr: jnp.mean(_run_noisy(make(lr), seed, steps)[-window:])
        )
        return min(float(final_loss(lr)) for lr in learning_rates)

    initial = float(
        _noisy_kronecker_quadratic(seed)[0](_noisy_kronecker_quadratic(seed)[2])
    )
    kron_loss = best(lambda lr: pj.kron(learning_rate=lr))
    adam_loss = best(optax.adam)
    assert kron_loss < initial / 50
    assert kron_loss < adam_loss, (kron_loss, adam_loss)


def test_converges_on_deterministic_ill_conditioned_quadratic():
    loss, _, x0 = _noisy_kronecker_quadratic(0)
    optimizer = pj.kron(learning_rate=optax.cosine_decay_schedule(0.03, 1000))

    def body(carry, _):
        x, state = carry
        updates, state = optimizer.update(jax.grad(loss)(x), state, x)
        return (optax.apply_updates(x, updates), state), None

    (x, _), _ = jax.lax.scan(body, (x0, optimizer.init(x0)), None, length=1000)
    assert float(loss(x)) < 1e-4 * float(loss(x0))


def test_converges_on_rosenbrock():
    def rosenbrock(params):
        x, y = params["xy"]
        return (1 - x) ** 2 + 100 * (y - x**2) ** 2

    params = {"xy": jnp.array([-1.5, 2.0])}
    optimizer = pj.kron(learning_rate=optax.cosine_decay_schedule(0.01, 2000))

    def body(carry, _):
        p, state = carry
        updates, state = optimizer.update(jax.grad(rosenbrock)(p), state, p)
        return (optax.apply_updates(p, updates), state), None

    (params, _), _ = jax.jit(
        lambda p: jax.lax.scan(body, (p, optimizer.init(p)), None, length=2000)
    )(params)
    np.testing.assert_allclose(params["xy"], [1.0, 1.0], atol=1e-3)


def _run_steps(optimizer, params, num_steps, seed=0):
    """Updates of ``num_steps`` steps on random gradients (same for every optimizer)."""
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    all_updates = []
    for step in range(num_steps):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(seed + step), len(leaves))
        grads = treedef.unflatten(
            [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)]
        )
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        all_updates.append(updates)
    return all_updates, state


PARAMS = {"w": jnp.ones((6, 5)), "b": jnp.zeros(5), "conv": jnp.ones((3, 2, 2, 2))}


def test_multisteps_accumulates_then_steps():
    params = {"w": jnp.ones((4, 3))}
    micro = [jnp.full((4, 3), 0.1), jnp.full((4, 3), 0.3).at[0, 0].set(-1.0)]
    accumulated = optax.MultiSteps(pj.kron(), every_k_schedule=2)
    state = accumulated.init(params)
    first, state = accumulated.update({"w": micro[0]}, state, params)
    np.testing.assert_array_equal(first["w"], 0.0)
    second, _ = accumulated.update({"w": micro[1]}, state, params)

    direct = pj.kron()
    expected, _ = direct.update({"w": (micro[0] + micro[1]) / 2}, direct.init(params))
    np.testing.assert_allclose(second["w"], expected["w"], rtol=1e-6)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("mu_dtype", "precond_dtype"), [(None, None), (jnp.bfloat16, jnp.bfloat16)]
)
def test_dtypes_of_updates_and_state_are_stable(param_dtype, mu_dtype, precond_dtype):
    params = jax.tree.map(lambda p: p.astype(param_dtype), PARAMS)
    optimizer = pj.scale_by_kron(
        mu_dtype=mu_dtype,
        precond_dtype=precond_dtype,
        preconditioner_update_probability=1.0,
    )
    state = optimizer.init(params)
    initial = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    update = jax.jit(optimizer.update)
    for _ in range(3):
        updates, state = update(params, state)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == initial
    jax.tree.map(
        lambda u, p: (u.dtype == p.dtype) or pytest.fail(u.dtype), updates, params
    )
    assert state.mu["w"].dtype == (mu_dtype or param_dtype)
    expected_precond = precond_dtype or jnp.float32
    assert all(
        f.dtype == expected_precond for f in jax.tree.leaves(state.preconditioners)
    )


@pytest.mark.parametrize(
    "shape", [(), (7,), (6, 5), (4, 3, 2), (3, 2, 2, 2), (2, 2, 3, 1, 2)]
)
def test_every_rank_gets_whitened_updates(shape):
    """On N(0, σ²) gradients the fitted P ≈ σ⁻¹·I, so updates have RMS ≈ 1."""
    params = {"p": jnp.zeros(shape)}
    optimizer = pj.scale_by_kron(b1=0.0, preconditioner_update_probability=1.0)

    def step(state, step):
        grads = {"p": 5.0 * jax.random.normal(jax.random.PRNGKey(step), shape)}
        updates, state = optimizer.update(grads, state)
        assert updates["p"].shape == shape  # checked once, at trace time
        return state, jnp.mean(updates["p"] ** 2)

    run = jax.jit(lambda state: jax.lax.scan(step, state, jnp.arange(400)))
    _, squares = run(optimizer.init(params))
    # The mean over the last 100 steps: one draw of a scalar is too noisy.
    assert 0.5 < np.sqrt(np.mean(squares[300:])) <= 1.1 + 1e-6


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"partition_grads_into_blocks": True, "block_size": 2}],
)
def test_parameters_with_no_entries_get_zero_updates(kwargs):
    params = {"empty": jnp.zeros((0, 5)), "w": jnp.ones((3, 4))}
    optimizer = pj.scale_by_kron(preconditioner_update_probability=1.0, **kwargs)
    updates, state = jax.jit(optimizer.update)(
        jax.tree.map(jnp.ones_like, params), optimizer.init(params)
    )
    assert updates["empty"].shape == (0, 5)
    assert float(jnp.sqrt(jnp.mean(updates["w"] ** 2))) > 0.1
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))


def test_none_leaves_and_empty_trees():
    params = {"a": jnp.ones((3, 2)), "none": None, "empty": {}}
    optimizer = pj.kron()
    state = optimizer.init(params)
    updates, state = jax.jit(optimizer.update)(params, state)
    assert updates["none"] is None
    assert updates["empty"] == {}
    empty_updates, _ = optimizer.update({}, optimizer.init({}))
    assert empty_updates == {}


def test_update_counter_follows_probability():
    """p = 0.25: the factors change on exactly every 4th step."""
    params = {"w": jnp.ones((3, 3))}
    optimizer = pj.scale_by_kron(preconditioner_update_probability=0.25)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    changed = []
    for step in range(12):
        grads = {"w": jax.random.normal(jax.random.PRNGKey(step), (3, 3))}
        _, new_state = update(grads, state)
        before = jax.tree.leaves(state.preconditioners)
        after = jax.tree.leaves(new_state.preconditioners)
        changed.append(any(bool(jnp.any(a != b)) for a, b in zip(before, after)))
        state = new_state
    assert changed == [i % 4 == 3 for i in range(12)]


def test_schedule_values():
    schedule = pj.precond_update_prob_schedule()
    np.testing.assert_allclose(schedule(1), 1.0)
    np.testing.assert_allclose(schedule(500), 1.0)
    np.testing.assert_allclose(schedule(1500), np.exp(-1.0), rtol=1e-6)
    np.testing.assert_allclose(schedule(100_000), 0.03)
    custom = pj.precond_update_prob_schedule(min_prob=0.05, flat_start=1000)
    np.testing.assert_allclose(custom(1000), 1.0)
    np.testing.assert_allclose(custom(10_000), 0.05)


def test_preconditioner_cache_layouts_agree():
    with jax.enable_x64(True):
        params = {
            "w": jnp.ones((6, 5), jnp.float64),
            "t": jnp.ones((3, 4, 2), jnp.float64),
        }
        kwargs = dict(
            preconditioner_update_probability=0.5,
            precond_dtype=jnp.float64,
            merge_small_dims=False,
            partition_grads_into_blocks=False,
        )
        runs = {
            cache: _run_steps(pj.kron(preconditioner_cache=cache, **kwargs), params, 6)
            for cache in ("packed", "dense", None)
        }
    for cache in ("dense", None):
        for a, b in zip(runs["packed"][0], runs[cache][0]):
            jax.tree.map(
                lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-10), a, b
            )
    shapes = {
        cache: [x.shape for x in jax.tree.leaves(state[0].preconditioners)]
        for cache, (_, state) in runs.items()
    }
    assert shapes == {
        "packed": [(1, 4, 3), (1, 5, 4), (1, 3, 2), (1, 7, 6), (1, 6, 5)],
        "dense": [(1, 2, 3, 3), (1, 2, 4, 4), (1, 2, 2, 2), (1, 2, 6, 6), (1, 2, 5, 5)],
        None: [(1, 3, 3), (1, 4, 4), (1, 2, 2), (1, 6, 6), (1, 5, 5)],
    }


@pytest.mark.parametrize("b1", [0.9, 0.0])
def test_non_finite_gradient_skips_the_step(b1):
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    optimizer = pj.scale_by_kron(b1=b1, preconditioner_update_probability=1.0)
    update = jax.jit(optimizer.update)
    _, state = update(jax.tree.map(jnp.ones_like, params), optimizer.init(params))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        bad_grads = {"w": jnp.ones((4, 3)).at[1, 2].set(bad), "b": jnp.ones(3)}
        updates, new_state = update(bad_grads, state)
        for leaf in jax.tree.leaves(updates):
            np.testing.assert_array_equal(leaf, 0.0, err_msg=str(bad))
        assert_skipped_once(new_state, state)
        _, after = update(jax.tree.map(jnp.ones_like, params), new_state)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(after))
        assert int(after.count) == 2, bad


@pytest.mark.parametrize(
    "name",
    ["kron", "kron-decay-schedule", "scale_by_kron-b1-0", "scale_by_kron-QUAD"],
)
def test_optax_map_params_over_the_state(name):
    """optax.tree.map_params finds the momentum (the one params-shaped tree) in
    Kron's state: identity keeps the state, and a spec per parameter with the
    rest mapped to None gives the momentum those specs."""
    from jax.sharding import PartitionSpec as P

    optimizer = {
        "kron": lambda: pj.kron(),
        "kron-decay-schedule": lambda: pj.kron(
            learning_rate=optax.linear_schedule(1e-3, 0.0, 10), weight_decay=0.1
        ),
        "scale_by_kron-b1-0": lambda: pj.scale_by_kron(b1=0.0),
        "scale_by_kron-QUAD": lambda: pj.scale_by_kron(
            preconditioner_update_style="QUAD"
        ),
    }[name]()
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    state = optimizer.init(params)
    _, state = optimizer.update(params, state, params)

    same = optax.tree.map_params(optimizer, lambda p: p, state)
    assert jax.tree.structure(same) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, same, state)

    specs = {"w": P("x", None), "b": P()}
    mapped = optax.tree.map_params(
        optimizer,
        lambda _, spec: spec,
        state,
        specs,
        transform_non_params=lambda _: None,
        is_leaf=lambda x: isinstance(x, P),
    )
    kron_state = mapped if isinstance(mapped, pj.KronState) else mapped[0]
    assert kron_state.mu == (None if name == "scale_by_kron-b1-0" else specs)
    assert kron_state.preconditioners is None
    assert kron_state.count is None
