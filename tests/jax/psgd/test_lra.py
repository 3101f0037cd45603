"""PSGD LRA against a float64 explicit-matrix reference, and its fitting property."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precond.jax.psgd.hessian import hessian_helper
from precond.jax.psgd.lra import (
    LRA_STATIC_ARGS,
    fit_randomness,
    lra,
    lra_precondition,
    lra_preconditioner,
    lra_update,
    scale_by_lra,
)
from tests.jax.helpers import float64
from tests.reference import lra_reference as ref

KEY = jax.random.PRNGKey(0)


@pytest.fixture(autouse=True)
def _float64():
    with float64():
        yield


def _random_factors(rng, n, r):
    """U, V large enough that the low-rank part of Q matters, d around 1."""
    return (
        0.3 * rng.normal(size=(n, r)),
        0.5 * rng.normal(size=(n, r)),
        (1 + 0.2 * rng.normal(size=n)),
    )


def _assert_same_factors(got, want, balanced):
    """Equal U, V, d; after balancing, U and V are only defined up to UO, VO (O
    orthogonal r×r), so compare UVᵀ, UUᵀ and VVᵀ (every later step depends on U
    and V through these alone) and d."""
    U, V, d = map(np.asarray, got)
    want_u, want_v, want_d = want
    np.testing.assert_allclose(d, want_d, rtol=1e-12, atol=1e-14)
    if not balanced:
        np.testing.assert_allclose(U, want_u, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(V, want_v, rtol=1e-12, atol=1e-14)
    for left, right, want_left, want_right in (
        (U, V, want_u, want_v),
        (U, U, want_u, want_u),
        (V, V, want_v, want_v),
    ):
        np.testing.assert_allclose(
            left @ right.T, want_left @ want_right.T, rtol=1e-11, atol=1e-13
        )


@pytest.mark.parametrize("balance", [False, True], ids=["", "balance"])
@pytest.mark.parametrize("update_u", [True, False], ids=["U-step", "V-step"])
@pytest.mark.parametrize("order", ["2nd", "1st"])
def test_one_update_and_preconditioning_match_reference(order, update_u, balance):
    """One fit (d step, then the U or V Lie-group step, optionally after
    rebalancing) and P·g equal the n×n-matrix float64 reference."""
    n, r = 7, 3
    rng = np.random.default_rng([n, update_u, balance])
    U, V, d = _random_factors(rng, n, r)
    v, h, g = (rng.normal(size=n) for _ in range(3))
    got = lra_update(
        *map(jnp.asarray, (U, V, d, v, h)),
        0.1,
        order,
        update_u=update_u,
        balance=balance,
    )
    want = ref.update(
        U, V, d, v, h, 0.1, order, update_u=update_u, balance_first=balance
    )
    _assert_same_factors(got, want, balance)
    np.testing.assert_allclose(
        lra_precondition(*got, jnp.asarray(g)),
        ref.precondition(*want, g),
        rtol=1e-12,
        atol=1e-14,
    )


def test_balancing_leaves_a_zero_factor_alone():
    """With U = 0 (Q = diag(d)) balancing would zero V too and freeze the fit;
    it is skipped, and the U step then moves U off 0."""
    rng = np.random.default_rng(3)
    U, V, d = _random_factors(rng, 7, 3)
    v, h = rng.normal(size=7), rng.normal(size=7)
    args = (jnp.zeros((7, 3)), jnp.asarray(V), jnp.asarray(d), jnp.asarray(v))
    new = lra_update(*args, jnp.asarray(h), 0.1, update_u=True, balance=True)
    want = ref.update(0 * U, V, d, v, h, 0.1, update_u=True)
    for got_x, want_x in zip(new, want, strict=True):
        np.testing.assert_allclose(got_x, want_x, rtol=1e-12, atol=1e-14)
    assert np.abs(new.U).max() > 0


def test_init_shapes_and_rank_clamp():
    """U, V ~ N(0, 1)/sqrt(n(r + 10)) with r = min(rank, n); d = scale."""
    pre = lra_preconditioner(rank=10)
    (U, V, d), _ = pre.init({"a": jnp.zeros((40, 5)), "b": jnp.zeros(3)}, 2.0, KEY)
    assert U.shape == V.shape == (203, 10)
    assert d.shape == (203,)
    np.testing.assert_array_equal(d, 2.0)
    for x in (U, V):  # 2030 draws each: the sample std is within ~2% (5% allowed)
        np.testing.assert_allclose(np.std(x), 1 / np.sqrt(203 * 20), rtol=0.05)
    small, _ = pre.init({"w": jnp.zeros(3)}, 1.0, KEY)
    assert small.U.shape == small.V.shape == (3, 3)


def test_fit_draws_its_decisions_from_the_key_and_scales_first():
    """The jitted fit on a pytree equals the reference with the (balance, U-or-V)
    that :func:`fit_randomness` draws from its key (seeds chosen so that every
    lax.cond branch runs), and with ``first`` d is first scaled by
    (Σv²/Σh²)^{1/4}. Balancing has probability 0.01, the U step 1/2."""
    rng = np.random.default_rng(0)
    h = {
        "a": jnp.asarray(rng.normal(size=(4, 3))),
        "b": jnp.asarray(rng.normal(size=3)),
    }
    h_flat = np.concatenate([np.ravel(h["a"]), h["b"]])
    U, V, d = _random_factors(rng, 15, 4)
    fit = jax.jit(lra_preconditioner(rank=4).fit, static_argnums=6)
    balances, updates_u = jax.vmap(
        lambda seed: fit_randomness(jax.random.PRNGKey(seed))
    )(jnp.arange(2000))  # P(balance and V step) = 1/200 per seed
    # Binomial standard errors over 2000 seeds: 0.0022 and 0.011 (~4 allowed).
    assert abs(float(jnp.mean(balances)) - 0.01) < 0.009
    assert abs(float(jnp.mean(updates_u)) - 0.5) < 0.045
    for (balance, update_u), first in zip(
        [(False, True), (False, False), (True, True), (True, False)],
        [True, False, False, True],
        strict=True,
    ):
        seed = int(np.flatnonzero((balances == balance) & (updates_u == update_u))[0])
        key = jax.random.PRNGKey(seed)
        v = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), (15,)))
        v_tree = {"a": jnp.asarray(v[:12].reshape(4, 3)), "b": jnp.asarray(v[12:])}
        got = fit(tuple(map(jnp.asarray, (U, V, d))), h, v_tree, 0.1, first, key, True)
        scale = (np.sum(v * v) / np.sum(h_flat * h_flat)) ** 0.25 if first else 1
        want = ref.update(
            U, V, d * scale, v, h_flat, 0.1, update_u=update_u, balance_first=balance
        )
        _assert_same_factors(got, want, balance)


def _imbalance(U, V):
    """(‖U‖²_F + ‖V‖²_F)/(2‖UVᵀ‖_*): ≥ 1 for every factorization of UVᵀ, 1
    exactly when UᵀU = VᵀV (the least-norm, balanced one)."""
    nuclear = jnp.sum(jnp.linalg.svd(U @ V.T, compute_uv=False))
    return (jnp.sum(U * U) + jnp.sum(V * V)) / (2 * nuclear)


def _drift(U, V, rng, condition):
    """U·R, V·R⁻ᵀ with R of the given condition number: the same UVᵀ (so the same
    Q), and ‖UR‖_F = ‖VR⁻ᵀ‖_F, so scaling by one number cannot undo it."""
    r = U.shape[1]
    left, _ = np.linalg.qr(rng.normal(size=(r, r)))
    right, _ = np.linalg.qr(rng.normal(size=(r, r)))
    R = left @ np.diag(np.geomspace(1, condition, r)) @ right
    U, V = U @ R, V @ np.linalg.inv(R).T
    rho = np.sqrt(np.linalg.norm(U) / np.linalg.norm(V))
    return U / rho, V * rho


def test_balancing_undoes_the_drift_of_the_u_v_gauge():
    """The long-run blow-up (NaN or a frozen fit after 2e4 to 1.5e5 steps at a
    constant learning rate): U, V ↦ UR, VR⁻ᵀ leaves Q unchanged, the U and V steps
    let that r×r gauge random-walk, and psgd-jax's rebalancing (U/ρ, V·ρ) fixes
    only ‖U‖ = ‖V‖. ‖U‖ and ‖V‖ then grow (imbalance 300–1800 after 5e4 steps
    in a float32 run of this problem, measured) while UVᵀ stays put, until
    I + VᵀU is too ill-conditioned for float32 solves. Here, from such a drifted
    state: (1) one rebalancing (float64, η = 0 so nothing else moves) restores
    UᵀU = VᵀV with UVᵀ unchanged; (2) a float32 training run keeps the imbalance
    near 1 (a rebalancing every ~100 steps; measured ≤ 1.1 at every 1000th
    step of 3e5)."""
    rng = np.random.default_rng(0)
    n, r = 12, 4
    U, V, d = _random_factors(rng, n, r)
    U, V = _drift(U, V, rng, 1e3)
    assert _imbalance(U, V) > 100
    v, h = rng.normal(size=n), rng.normal(size=n)
    new_u, new_v, new_d = lra_update(
        *map(jnp.asarray, (U, V, d, v, h)), 0.0, update_u=True, balance=True
    )
    np.testing.assert_allclose(new_u @ new_v.T, U @ V.T, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(new_u.T @ new_u, new_v.T @ new_v, atol=1e-12)
    np.testing.assert_allclose(_imbalance(new_u, new_v), 1, rtol=1e-12)
    np.testing.assert_array_equal(new_d, d)

    # (2) float32, r = n = 10 (where the drift was fastest): noisy gradients of
    # ½xᵀHx, H rotated with eigenvalues 1…1e-3; 2000 steps to fit Q, the gauge
    # drifted as after ~1e5 steps, 2000 more steps.
    with jax.enable_x64(False):
        n = 10
        basis, _ = np.linalg.qr(rng.normal(size=(n, n)))
        H = basis @ np.diag(np.geomspace(1, 1e-3, n)) @ basis.T
        root = jnp.asarray(np.linalg.cholesky(H), jnp.float32)
        H = jnp.asarray(H, jnp.float32)
        optimizer = lra(learning_rate=0.05)

        @jax.jit
        def train(x, state, key):
            def step(carry, key):
                x, state = carry
                g = H @ x + 0.1 * root @ jax.random.normal(key, (n,))
                updates, state = optimizer.update(g, state, x)
                U, V, _ = state[0].preconditioner
                return (x + updates, state), _imbalance(U, V)

            return jax.lax.scan(step, (x, state), jax.random.split(key, 2000))

        x = jnp.asarray(rng.normal(size=n), jnp.float32)
        (x, state), _ = train(x, optimizer.init(x), jax.random.PRNGKey(1))
        U, V, d = map(np.asarray, state[0].preconditioner)
        U, V = _drift(U.astype(np.float64), V.astype(np.float64), rng, 1e3)
        assert _imbalance(U, V) > 100
        factors = type(state[0].preconditioner)(
            jnp.asarray(U, jnp.float32), jnp.asarray(V, jnp.float32), d
        )
        state = (state[0]._replace(preconditioner=factors), *state[1:])
        (x, state), imbalance = train(x, state, jax.random.PRNGKey(2))
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state))
    assert np.max(imbalance[1000:]) < 1.5, np.max(imbalance[1000:])


def test_newton_fit_drives_p_h_to_identity():
    """H = diagonal + rank 2 SPD, so H⁻¹ = diagonal − rank 2 is exactly an LRA
    P = d(I + VUᵀ)(I + UVᵀ)d with r = 4. Exact pairs (v, H·v) make every fit's
    gradient vanish at P = H⁻¹ (no noise floor), so P·H → I as the fit goes on;
    3000 fits at η = 0.1 reach max|PH − I| ≈ 0.014 (0.05 allowed); the best
    diagonal P is at 0.75 (H's off-diagonal entries reach 13, its diagonal 2.3)."""
    n = 16
    rng = np.random.default_rng(0)
    W = 2 * rng.normal(size=(n, 2))
    H = np.diag(rng.uniform(1, 10, n)) + W @ W.T
    optimizer = scale_by_lra(b1=0.0, uvd_rank_of_approximation=4)
    params = {"w": jnp.zeros(n)}
    H_jax = jnp.asarray(H)

    @jax.jit
    def fit_many(key):
        def fit_once(state, key):
            v = jax.random.normal(key, (n,))
            _, state = optimizer.update(
                params,
                state,
                Hvp={"w": H_jax @ v},
                vector={"w": v},
                update_preconditioner=True,
            )
            return state, None

        keys = jax.random.split(key, 3000)
        return jax.lax.scan(fit_once, optimizer.init(params), keys)[0]

    state = fit_many(jax.random.PRNGKey(1))
    P = ref.p_matrix(*map(np.asarray, state.preconditioner))
    np.testing.assert_array_less(np.abs(P @ H - np.eye(n)), 0.05)


def test_whitening_fit_approaches_inverse_sqrt_covariance():
    """Gradients g = S·z, z ~ N(0, I): the fit minimises E[gᵀPg + vᵀP⁻¹v], at
    P = (E[ggᵀ])^{-1/2} = S⁻¹. S = diagonal + rank 2, so S⁻¹ is an LRA with r = 4.
    One sample per fit leaves a noise floor; with η = 0.1/(1 + t/200), 2000
    fits reach ‖PS − I‖_F/√n ≈ 0.14–0.19 over seeds (0.35 allowed), against
    ≈ 0.72 for the best diagonal P."""
    n = 12
    rng = np.random.default_rng(0)
    W = rng.normal(size=(n, 2))
    S = np.diag(rng.uniform(0.5, 2, n)) + W @ W.T
    optimizer = scale_by_lra(
        b1=0.0, uvd_rank_of_approximation=4, precond_lr=lambda t: 0.1 / (1 + t / 200)
    )
    params = {"w": jnp.zeros(n)}
    S_jax = jnp.asarray(S)

    @jax.jit
    def fit_many(key):
        def fit_once(state, key):
            _, state = optimizer.update(
                {"w": S_jax @ jax.random.normal(key, (n,))}, state
            )
            return state, None

        keys = jax.random.split(key, 2000)
        return jax.lax.scan(fit_once, optimizer.init(params), keys)[0]

    state = fit_many(jax.random.PRNGKey(1))
    P = ref.p_matrix(*map(np.asarray, state.preconditioner))

    def relative_error(P):
        return np.linalg.norm(P @ S - np.eye(n)) / np.sqrt(n)

    best_diagonal = np.diag(np.diag(S) / np.sum(S * S, axis=1))  # row-wise fit
    assert relative_error(best_diagonal) > 0.7
    assert relative_error(P) < 0.35


def test_whitening_trains_an_ill_conditioned_quadratic():
    """½(x − t)ᵀA(x − t), A = diag(1…100) + rank 1 (condition ≈ 300): the loss
    falls below 1e-3 of its start in 300 steps (measured 7e-6)."""
    rng = np.random.default_rng(1)
    n = 20
    target = jnp.asarray(rng.normal(size=n))
    w = rng.normal(size=n)
    A = jnp.asarray(np.diag(np.geomspace(1, 100, n)) + 10 * np.outer(w, w))
    optimizer = lra(learning_rate=0.05)

    def loss(p):
        return 0.5 * (p["x"] - target) @ A @ (p["x"] - target)

    @jax.jit
    def train(params):
        def step(carry, _):
            params, state = carry
            updates, state = optimizer.update(jax.grad(loss)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        carry = (params, optimizer.init(params))
        return jax.lax.scan(step, carry, None, length=300)[0][0]

    params = {"x": jnp.zeros(n)}
    assert loss(train(params)) < 1e-3 * loss(params)


def _squared_distance(params, x):
    return jnp.sum((params - x) ** 2)


@pytest.mark.parametrize("newton", [False, True], ids=["whitening", "hvp"])
def test_psgd_jax_readme_convergence(newton):
    """psgd-jax's README problem: lr 1.0, b1 0 on Σ(θ − 0)² from θ = (1, 2, 3).
    Whitening reaches loss < 1e-4 within 12 steps (measured 9). With Hessian-vector
    products it is not exact after one step as XMat is: the random U, V
    (≈ 0.16 per entry for n = 3) make Q ≠ s·I, so P ≠ H⁻¹ after the scaled first
    fit; it reaches < 1e-4 within 6 steps (measured 4)."""
    with jax.enable_x64(False):
        params, x = jnp.array([1.0, 2.0, 3.0]), jnp.zeros(3)
        optimizer = lra(learning_rate=1.0, b1=0.0)
        state = optimizer.init(params)
        update = jax.jit(optimizer.update)
        helper = jax.jit(
            lambda key, params: hessian_helper(
                key, _squared_distance, params, loss_fn_extra_args=(x,)
            )
        )
        key = jax.random.PRNGKey(0)
        losses = []
        for _ in range(20):
            if newton:
                key, subkey = jax.random.split(key)
                loss, grads, hvp, vector, flag = helper(subkey, params)
                updates, state = update(
                    grads, state, Hvp=hvp, vector=vector, update_preconditioner=flag
                )
            else:
                loss, grads = jax.value_and_grad(_squared_distance)(params, x)
                updates, state = update(grads, state)
            params = params + updates
            losses.append(float(loss))
            if loss < 1e-4:
                break
    assert losses[0] == 14.0
    assert len(losses) <= (6 if newton else 12)


def test_partial_newton_arguments_are_an_error():
    optimizer = lra()
    params = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match="missing vector, update_preconditioner"):
        optimizer.update(params, optimizer.init(params), params, Hvp=params)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(uvd_rank_of_approximation=0), ValueError, "=0: must be >= 1"),
        (dict(uvd_rank_of_approximation=-2), ValueError, "=-2: must be >= 1"),
        (dict(uvd_rank_of_approximation=2.0), TypeError, "=2.0: must be a Python int"),
        (
            dict(uvd_rank_of_approximation=True),
            TypeError,
            "=True: must be a Python int",
        ),
        (dict(step_normalizer_order="3rd"), ValueError, "order='3rd': must be one of"),
        (dict(precision="fast"), ValueError, "Invalid precision='fast'"),
        (dict(b1=1.0), ValueError, "Invalid b1=1.0"),
        (dict(precond_lr=0.0), ValueError, "Invalid precond_lr=0.0"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    name = next(iter(kwargs))
    with pytest.raises(error, match=re.escape(message)) as info:
        lra(**kwargs)
    assert f"Invalid {name}=" in str(info.value)


@pytest.mark.parametrize(
    ("precision", "hlo"), [(None, "DEFAULT"), ("highest", "HIGHEST")]
)
def test_precision_reaches_every_matmul(precision, hlo):
    optimizer = scale_by_lra(precision=precision)
    params = {"w": jnp.ones(5)}
    text = jax.jit(optimizer.update).lower(params, optimizer.init(params)).as_text()
    assert set(re.findall(r"precision = \[(\w+), (\w+)\]", text)) == {(hlo, hlo)}


def test_inject_hyperparams_gives_the_same_updates_in_float64():
    """Under this file's float64 mode, inject_hyperparams gives the plain
    updates to 1e-6. (One compile for many donated steps, update and state
    dtypes with bf16 and f32 mixed, the non-finite-gradient skip,
    inject_hyperparams in float32: test_optax_contract.py's table.)"""
    optimizer = lra(learning_rate=0.1)
    params = grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    injected = optax.inject_hyperparams(lra, static_args=LRA_STATIC_ARGS)(
        learning_rate=0.1
    )
    plain_state, injected_state = optimizer.init(params), injected.init(params)
    plain_update, injected_update = jax.jit(optimizer.update), jax.jit(injected.update)
    for _ in range(2):
        want, plain_state = plain_update(grads, plain_state, params)
        got, injected_state = injected_update(grads, injected_state, params)
        for k in params:
            # The injected learning rate is a float32 array, 0.1 a Python float.
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
