"""PSGD XMat against a float64 explicit-matrix reference, and its fitting property."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj
from tests.jax.helpers import float64
from tests.reference import xmat_reference as ref

# The module, not the ``xmat`` function that precond.jax re-exports under its name.
xmat_module = importlib.import_module("precond.jax.psgd.xmat")


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


@pytest.mark.parametrize("n", [6, 7])
@pytest.mark.parametrize("order", ["2nd", "1st"])
def test_one_update_and_preconditioning_match_reference(n, order):
    rng = np.random.default_rng(n)
    a = 1 + 0.1 * rng.normal(size=n)
    b = 0.1 * rng.normal(size=n)
    if n % 2:
        b[n // 2] = 0
    v, h, g = (rng.normal(size=n) for _ in range(3))
    got_a, got_b = xmat_module.xmat_update(
        jnp.asarray(a), jnp.asarray(b), jnp.asarray(v), jnp.asarray(h), 0.1, order
    )
    want_a, want_b = ref.update(a, b, v, h, 0.1, order)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_b, want_b, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(
        xmat_module.xmat_precondition(got_a, got_b, jnp.asarray(g)),
        ref.precondition(want_a, want_b, g),
        rtol=1e-12,
    )


def test_newton_fit_drives_p_h_to_v():
    """H = X-shaped SPD: repeated (v, H·v) fits give P ≈ H⁻¹."""
    n = 8
    rng = np.random.default_rng(0)
    H = np.diag(rng.uniform(1, 10, n)) + 0.3 * np.fliplr(np.diag(rng.uniform(1, 2, n)))
    H = (H + H.T) / 2
    assert np.all(np.linalg.eigvalsh(H) > 0)
    optimizer = pj.scale_by_xmat(b1=0.0)
    params = {"w": jnp.zeros(n)}
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for _ in range(2000):
        v = rng.normal(size=n)
        _, state = update(
            params,
            state,
            Hvp={"w": jnp.asarray(H @ v)},
            vector={"w": jnp.asarray(v)},
            update_preconditioner=True,
        )
    P = ref.x_matrix(*map(np.asarray, state.preconditioner))
    P = P.T @ P
    np.testing.assert_allclose(P @ H, np.eye(n), atol=0.05)


def test_whitening_fit_drives_p_to_inverse_sqrt_covariance():
    """Gradients g = S·z with an X-shaped SPD S (covariance C = S²): repeated
    whitening fits give P ≈ C^{-1/2} = S⁻¹, which XMat can represent exactly."""
    n = 8
    rng = np.random.default_rng(2)
    S = np.diag(rng.uniform(1, 4, n)) + 0.5 * np.fliplr(np.diag(rng.uniform(0.5, 1, n)))
    S = (S + S.T) / 2
    assert np.all(np.linalg.eigvalsh(S) > 0)
    optimizer = pj.scale_by_xmat(b1=0.0, precond_lr=0.02)
    params = {"w": jnp.zeros(n)}
    state = optimizer.init(params)
    S_jax = jnp.asarray(S)

    def fit(state, key):
        _, state = optimizer.update({"w": S_jax @ jax.random.normal(key, (n,))}, state)
        return state, None

    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    state, _ = jax.jit(lambda s: jax.lax.scan(fit, s, keys))(state)
    Q = ref.x_matrix(*map(np.asarray, state.preconditioner))
    error = np.linalg.norm(Q.T @ Q @ S - np.eye(n)) / np.sqrt(n)
    # Only the expectations match at P = S⁻¹: each fit moves Q by O(η) on one
    # sample, so a noise floor of order sqrt(η) remains (observed 0.10); P = I
    # errs by > 1.
    assert np.linalg.norm(S - np.eye(n)) / np.sqrt(n) > 1
    assert error < 0.2, error


def test_whitening_trains_a_quadratic():
    rng = np.random.default_rng(1)
    target = jnp.asarray(rng.normal(size=20))
    scales = jnp.asarray(np.geomspace(1, 100, 20))
    optimizer = pj.xmat(learning_rate=0.05)

    def loss(p):
        return jnp.sum(scales * (p["x"] - target) ** 2)

    params = {"x": jnp.zeros(20)}
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), state

    start = loss(params)
    for _ in range(300):
        params, state = step(params, state)
    assert loss(params) < 1e-2 * start


def test_partial_newton_arguments_are_an_error():
    optimizer = pj.xmat()
    params = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match="missing vector, update_preconditioner"):
        optimizer.update(params, optimizer.init(params), params, Hvp=params)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(step_normalizer_order="3rd"), "Invalid step_normalizer_order='3rd'"),
        (dict(b1=1.0), "Invalid b1=1.0"),
        (dict(precond_lr=0.0), "Invalid precond_lr=0.0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pj.xmat(**kwargs)


def _squared_distance(params, x):
    return jnp.sum((params - x) ** 2)


@pytest.mark.parametrize("newton", [False, True], ids=["whitening", "hvp"])
def test_psgd_jax_readme_convergence(newton):
    """psgd-jax's README: XMat with lr 1.0, b1 0 on Σ(θ − 0)² from θ = (1, 2, 3)
    reaches loss < 1e-4 in about 10 whitening steps, and ≈ 0 one step after the
    first with Hessian-vector products (P = H⁻¹ exactly for H = 2I)."""
    with jax.enable_x64(False):
        params, x = jnp.array([1.0, 2.0, 3.0]), jnp.zeros(3)
        optimizer = pj.xmat(learning_rate=1.0, b1=0.0)
        state = optimizer.init(params)
        key = jax.random.PRNGKey(0)
        losses = []
        for _ in range(20):
            if newton:
                key, subkey = jax.random.split(key)
                loss, grads, hvp, vector, flag = pj.hessian_helper(
                    subkey, _squared_distance, params, loss_fn_extra_args=(x,)
                )
                updates, state = optimizer.update(
                    grads, state, Hvp=hvp, vector=vector, update_preconditioner=flag
                )
            else:
                loss, grads = jax.value_and_grad(_squared_distance)(params, x)
                updates, state = optimizer.update(grads, state)
            params = params + updates
            losses.append(float(loss))
            if loss < 1e-4:
                break
    assert losses[0] == 14.0
    if newton:
        assert len(losses) == 2
        assert losses[1] < 1e-10
    else:
        assert len(losses) <= 12


def test_inject_hyperparams_gives_the_same_updates_in_float64():
    """Under this file's float64 mode, inject_hyperparams gives the plain
    updates to 1e-6. (One compile for many donated steps, update and state
    dtypes with bf16 and f32 mixed, inject_hyperparams in float32:
    test_optax_contract.py's table.)"""
    optimizer = pj.xmat(learning_rate=0.1)
    params = grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    injected = optax.inject_hyperparams(pj.xmat)(learning_rate=0.1)
    plain_state, injected_state = optimizer.init(params), injected.init(params)
    for _ in range(2):
        want, plain_state = optimizer.update(grads, plain_state, params)
        got, injected_state = injected.update(grads, injected_state, params)
        for k in params:
            # The injected learning rate is a float32 array, 0.1 a Python float.
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
