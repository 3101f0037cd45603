"""Complex parameters in every JAX PSGD variant (Kron 'EQ'/'QUAD'/'PRO', XMat, LRA,
Affine; whitening and Newton mode).

Over ℂ the preconditioner is Hermitian, P = QᴴQ, fitted with conjugate transposes
(see ``precond.jax._core.factor_kernels``). Properties proven here:

1. One step on complex128 parameters equals the complex float64 NumPy references
   of ``tests/reference`` given the same noise (the optimizers' randomness is a
   pure function of their key or seed, so the references redraw it). A real leaf
   next to the complex ones still equals the real reference (Kron).
2. The gradient convention: ``jax.grad`` of a real loss gives the conjugate of
   the descent direction, so, as in optax's own complex tests, the optimizers are
   given conj(jax.grad); plain ``optax.sgd`` descends on it and ascends on the raw
   gradient here.
3. Every variant solves an ill-conditioned complex least-squares problem whose
   optimum is purely imaginary: it ends near that optimum, so the imaginary part
   is neither dropped nor turned into NaN.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import precond.jax as pj
from precond.jax._core import factor_kernels as km
from tests.jax.helpers import float64, kron_module
from tests.reference import affine_reference as affine_ref
from tests.reference import kron_reference as kron_ref
from tests.reference import lra_reference as lra_ref
from tests.reference import xmat_reference as xmat_ref

xmat_module = importlib.import_module("precond.jax.psgd.xmat")
lra_module = importlib.import_module("precond.jax.psgd.lra")
affine_module = importlib.import_module("precond.jax.psgd.affine")

LR = 0.1  # preconditioner_lr / precond_lr of every case
# Kron: one real leaf next to complex ones (its own stack); leaf index = sorted
# key order. XMat/LRA/Affine: complex leaves only (17 entries: odd, so XMat's
# middle entry is exercised; Affine views (4, 3) with two triangular factors and
# v sampled, and (1, 5) with a diagonal side and v integrated out).
SHAPES = {"a_real": (4, 3), "m": (4, 3), "v": (5,)}


def _complex(rng, shape):
    return rng.normal(size=shape) + 1j * rng.normal(size=shape)


def _problem(variant, newton):
    rng = np.random.default_rng(7)
    shapes = SHAPES if variant == "kron" else {k: SHAPES[k] for k in ("m", "v")}
    grads, vectors, hvps = {}, {}, {}
    for name, shape in shapes.items():
        draw = rng.normal if name == "a_real" else (lambda size: _complex(rng, size))
        grads[name] = draw(size=shape) * 3.0
        vectors[name] = draw(size=shape)
        hvps[name] = draw(size=shape) * 0.5
    return grads, (hvps, vectors) if newton else None


def _rms_clip(U):
    return U / max(1.0, np.sqrt(np.mean(np.abs(U) ** 2)) / 1.1)


def _kron_reference(grads, newton, style, seed):
    """Step 1 of scale_by_kron (b1 = 0.9, update probability 1, Q = I)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
    _, noise_key = kron_module.fit_randomness(key)  # balancing I is a no-op
    out = {}
    for leaf, (name, g) in enumerate(sorted(grads.items())):
        real = not np.iscomplexobj(g)
        mu_hat = (0.1 * g) / (1 - 0.9)
        shape = g.shape
        Qs = [np.ones(d) if len(shape) < 2 else np.eye(d) for d in shape]
        if newton is not None:
            target, V = newton[0][name], newton[1][name]
        else:
            dtype = jnp.float64 if real else jnp.complex128
            V = np.asarray(kron_module.unit_noise(noise_key, leaf, 0, shape, dtype))
            target = mu_hat
        if style == "EQ":
            if newton is None:
                target = kron_ref.add_damping_noise(target, V)
            Qs = kron_ref.update_factors(Qs, target, V, LR)
        else:
            if newton is None:
                eps = np.finfo(np.float64).eps
                target = target + (1e-9 + eps * np.abs(target)) * V
                others = [g.size // d for d in shape]
                targets = [
                    c * np.ones(d) if len(shape) < 2 else c * np.eye(d)
                    for c, d in zip(others, shape, strict=True)
                ]
            else:
                targets = []
                for axis in range(len(shape)):
                    V_i = np.moveaxis(V, axis, 0).reshape(shape[axis], -1)
                    T = V_i @ V_i.conj().T
                    targets.append(np.real(np.diag(T)) if len(shape) < 2 else T)
            Qs, _ = kron_ref.update_factors_gen2(
                Qs, [0.0] * len(Qs), target, targets, LR, style
            )
        out[name] = _rms_clip(kron_ref.precondition(Qs, mu_hat))
    return out


def _psgd_keys(state, newton=False):
    """(whitening vector key, fit key) of step 1 of scale_by_psgd (psgd-jax's
    order: decision, vector (XMat, LRA), then the fit's subkey; Newton mode
    draws neither decision nor vector). The fit key is the same for Affine,
    which draws no vector, only in Newton mode; see _affine_fit_key."""
    key = state.key
    if newton:
        return None, jax.random.split(key)[1]
    key, _ = jax.random.split(key)
    key, vector_key = jax.random.split(key)
    return vector_key, jax.random.split(key)[1]


def _affine_fit_key(state, newton):
    key = state.key
    if not newton:
        key, _ = jax.random.split(key)
    return jax.random.split(key)[1]


def _whitening_vector(vector_key, grads):
    """v like the gradients (optax.tree.random_like), flattened."""
    return np.asarray(
        ravel_pytree(optax.tree.random_like(vector_key, grads, jax.random.normal))[0]
    )


def _psgd_mu_hat(g):
    """m̂ of step 1 of scale_by_psgd (b1 = 0.9): optax's moment and bias
    correction, 1 − β₁ⁿ in the gradients' precision (float64 here)."""
    return ((1 - 0.9) * g) / (1 - 0.9)


def _xmat_reference(state, grads, newton):
    vector_key, _ = _psgd_keys(state, newton is not None)
    h, unravel = ravel_pytree(grads if newton is None else newton[0])
    h = np.asarray(h)
    if newton is None:
        v = _whitening_vector(vector_key, grads)
        v_energy = h.size  # psgd-jax's whitening scale: E[Σ|v|²] = n
    else:
        v = np.asarray(ravel_pytree(newton[1])[0])
        v_energy = np.sum(np.abs(v) ** 2)
    scale = (v_energy / np.sum(np.abs(h) ** 2)) ** 0.25
    a, b = xmat_ref.update(scale * np.ones(h.size, complex), np.zeros(h.size), v, h, LR)
    g = _psgd_mu_hat(np.asarray(ravel_pytree(grads)[0]))
    return jax.tree.map(np.asarray, unravel(xmat_ref.precondition(a, b, g)))


def _lra_reference(state, grads, newton):
    vector_key, fit_key = _psgd_keys(state, newton is not None)
    balance, update_u = lra_module.fit_randomness(fit_key)
    assert not bool(balance), "pick a seed that does not balance at step 1"
    U, V, d = (np.asarray(x) for x in state.preconditioner)
    h, unravel = ravel_pytree(grads if newton is None else newton[0])
    h = np.asarray(h)
    if newton is None:
        v = _whitening_vector(vector_key, grads)
        v_energy = h.size
    else:
        v = np.asarray(ravel_pytree(newton[1])[0])
        v_energy = np.sum(np.abs(v) ** 2)
    d = d * (v_energy / np.sum(np.abs(h) ** 2)) ** 0.25
    U, V, d = lra_ref.update(U, V, d, v, h, LR, update_u=bool(update_u))
    g = _psgd_mu_hat(np.asarray(ravel_pytree(grads)[0]))
    return jax.tree.map(np.asarray, unravel(lra_ref.precondition(U, V, d, g)))


def _affine_integrates_noise_out(factors):
    """psgd-jax's rule: both sides diagonal, or one diagonal and at least as
    long as the other."""
    left, right = (np.ndim(Q) == 1 for Q in factors)
    d1, d2 = (np.shape(Q)[0] for Q in factors)
    return (left and right) or (left and d1 >= d2) or (right and d2 >= d1)


def _affine_reference(state, grads, newton):
    fit_key = _affine_fit_key(state, newton is not None)
    keys = jax.random.split(fit_key, len(grads))
    out = {}
    for key, (name, g) in zip(keys, sorted(grads.items()), strict=True):
        view = affine_ref.matrix_view_shape(g.shape)
        factors = affine_ref.init_factors(view)
        H = (g if newton is None else newton[0][name]).reshape(view)
        if newton is not None:
            V = newton[1][name].reshape(view)
            scale = affine_ref.first_scale(H, V)
        else:
            # Whitening: scale from E[Σ|v|²] = numel; v integrated out or drawn.
            scale = affine_ref.first_scale(H, None)
            V = None
            if not _affine_integrates_noise_out(factors):
                V = np.asarray(
                    optax.tree.random_like(
                        jax.random.split(key)[1],
                        jnp.zeros(view, jnp.complex128),
                        jax.random.normal,
                    )
                )
        factors = affine_ref.update(*(scale * Q for Q in factors), H, V, LR)
        m_hat = _psgd_mu_hat(g).reshape(view)
        out[name] = affine_ref.precondition(*factors, m_hat).reshape(g.shape)
    return out


# (variant, Kron update style, Newton mode): the one table of cases.
CASES = [
    ("kron", "EQ", False),
    ("kron", "QUAD", False),
    ("kron", "PRO", False),
    ("kron", "EQ", True),
    ("kron", "PRO", True),
    ("xmat", None, False),
    ("xmat", None, True),
    ("lra", None, False),
    ("lra", None, True),
    ("affine", None, False),
    ("affine", None, True),
]


def _case_id(case):
    variant, style, newton = case
    return "-".join([variant] + ([style] if style else []) + ["newton"] * newton)


def _scale_by(variant, style, seed, cache="packed"):
    if variant == "kron":
        return pj.scale_by_kron(
            preconditioner_update_probability=1.0,
            preconditioner_update_style=style,
            preconditioner_cache=cache,
            precond_dtype=jnp.float64,
            preconditioner_lr=LR,
            seed=seed,
        )
    factory = {
        "xmat": pj.scale_by_xmat,
        "lra": pj.scale_by_lra,
        "affine": pj.scale_by_affine,
    }[variant]
    return factory(precond_lr=LR, seed=seed)


def _seed_without_lra_balancing():
    """A seed whose LRA fit at step 1 does not rebalance, in whitening or in
    Newton mode (probability ~0.98)."""
    for seed in range(100):
        state = pj.scale_by_lra(seed=seed).init({"x": jnp.zeros(2)})
        if not any(
            bool(lra_module.fit_randomness(_psgd_keys(state, newton)[1])[0])
            for newton in (False, True)
        ):
            return seed
    raise AssertionError("no seed found")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_one_step_matches_complex_float64_reference(case):
    variant, style, newton = case
    with float64():
        seed = _seed_without_lra_balancing() if variant == "lra" else 3
        grads, pair = _problem(variant, newton)
        optimizer = _scale_by(variant, style, seed)
        params = {k: jnp.zeros(g.shape, g.dtype) for k, g in grads.items()}
        state = optimizer.init(params)
        extra = {}
        if pair is not None:
            extra = dict(Hvp=pair[0], vector=pair[1], update_preconditioner=True)
        updates, new_state = jax.jit(optimizer.update)(grads, state, params, **extra)
        if variant == "kron":
            want = _kron_reference(grads, pair, style, seed)
        else:
            reference = {
                "xmat": _xmat_reference,
                "lra": _lra_reference,
                "affine": _affine_reference,
            }[variant]
            want = reference(state, grads, pair)
        for name, g in grads.items():
            assert updates[name].dtype == g.dtype
            np.testing.assert_allclose(
                updates[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name
            )
        # State dtypes are stable: a second step changes no dtype or shape.
        assert jax.tree.map(lambda x: (x.shape, x.dtype), new_state) == jax.tree.map(
            lambda x: (x.shape, x.dtype), state
        )
        leaves = jax.tree.leaves(
            new_state.preconditioners
            if variant == "kron"
            else (new_state.preconditioner)
        )
        assert any(jnp.iscomplexobj(x) for x in leaves)


@pytest.mark.parametrize("style", ["EQ", "QUAD", "PRO", "QEQ"])
def test_kron_caches_agree_and_factors_keep_their_structure(style):
    """Every Kron cache gives the same complex updates over three steps; the
    cached P_i = Q_iᴴQ_i is exactly Hermitian; 'EQ' factors stay upper triangular
    with a real positive diagonal, 'QUAD' factors Hermitian. ('PRO' and 'QEQ'
    store their 'packed' cache 'dense'.)"""
    with float64():
        grads, _ = _problem("kron", False)
        params = {k: jnp.zeros(g.shape, g.dtype) for k, g in grads.items()}
        outputs = []
        full = style in ("PRO", "QEQ")
        caches = ("dense", None) if full else ("packed", "dense", None)
        for cache in caches:
            optimizer = _scale_by("kron", style, 3, cache)
            state = optimizer.init(params)
            update = jax.jit(optimizer.update)
            steps = []
            for _ in range(3):
                updates, state = update(grads, state, params)
                steps.append(updates["m"])
            outputs.append(steps)
            if cache == "dense":
                stack = next(s for s in state.preconditioners if jnp.iscomplexobj(s[0]))
                for F in stack:
                    Q, P = np.asarray(F[0, 0]), np.asarray(F[0, 1])
                    np.testing.assert_allclose(P, Q.conj().T @ Q, rtol=1e-12)
                    np.testing.assert_array_equal(P, P.conj().T)
                    if style == "EQ":
                        np.testing.assert_array_equal(np.tril(Q, -1), 0)
                        assert np.all(np.diag(Q).imag == 0)
                        assert np.all(np.diag(Q).real > 0)
                    if style == "QUAD":
                        np.testing.assert_array_equal(Q, Q.conj().T)
        for other in outputs[1:]:
            np.testing.assert_allclose(other, outputs[0], rtol=1e-10, atol=1e-13)


def test_gradient_convention_is_optax_conjugated_gradient():
    """jax.grad of a real loss of z is conj(2∂L/∂z̄): optax.sgd descends on its
    conjugate (what the PSGD optimizers are given) and ascends on it as is."""
    z = jnp.array([1.0 + 2.0j, -0.5 + 0.25j])
    target = jnp.array([0.5j, 1.0 - 1.0j])

    def loss(z):
        return jnp.sum(jnp.abs(z - target) ** 2)

    raw = jax.grad(loss)(z)
    np.testing.assert_allclose(jnp.conj(raw), 2 * (z - target), rtol=1e-6)
    sgd = optax.sgd(0.1)
    for grad, decreases in ((jnp.conj(raw), True), (raw, False)):
        updates, _ = sgd.update(grad, sgd.init(z))
        assert bool(loss(optax.apply_updates(z, updates)) < loss(z)) == decreases


def _least_squares(rng, n=8, k=3, condition=30.0):
    """A = X·diag(s)·Yᴴ with random unitary X, Y and s from 1 to 1/condition, and
    B = A·Z* with a purely imaginary optimum Z*."""
    X, _ = np.linalg.qr(_complex(rng, (n, n)))
    Y, _ = np.linalg.qr(_complex(rng, (n, n)))
    A = (X * np.geomspace(1.0, 1.0 / condition, n)) @ Y.conj().T
    Z = 1j * rng.normal(size=(n, k))
    return (jnp.asarray(A, jnp.complex64), jnp.asarray(Z, jnp.complex64))


# The full optimizers, float32 (the same learning rates reach the same accuracy on
# the real 16×6 embedding of the problem).
CONVERGENCE = {
    "kron-EQ": lambda: pj.kron(1e-2, preconditioner_update_probability=1.0),
    "kron-QUAD": lambda: pj.kron(
        1e-2, preconditioner_update_probability=1.0, preconditioner_update_style="QUAD"
    ),
    "kron-PRO": lambda: pj.kron(
        1e-2, preconditioner_update_probability=1.0, preconditioner_update_style="PRO"
    ),
    "xmat": lambda: pj.xmat(0.02),
    "lra": lambda: pj.low_rank_approximation(0.02),
    "affine": lambda: pj.affine(0.02),
}


@pytest.mark.parametrize("name", sorted(CONVERGENCE))
def test_complex_least_squares_reaches_its_imaginary_optimum(name):
    """min ‖A·Z − B‖² (cond(A) = 30, so 900 for the Hessian AᴴA) from Z = 0 with
    conj(jax.grad): Z ends near the purely imaginary Z*, so the imaginary part of
    every update is kept (a dropped one would leave Z = 0)."""
    A, Z_star = _least_squares(np.random.default_rng(1))
    B = A @ Z_star
    optimizer = CONVERGENCE[name]()

    def loss(params):
        return jnp.sum(jnp.abs(A @ params["z"] - B) ** 2)

    @jax.jit
    def run(params):
        def step(carry, _):
            params, state = carry
            grads = jax.tree.map(jnp.conj, jax.grad(loss)(params))
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, state), _ = jax.lax.scan(
            step, (params, optimizer.init(params)), None, length=600
        )
        return params, state

    params = {"z": jnp.zeros(Z_star.shape, jnp.complex64)}
    final, state = run(params)
    error = float(jnp.linalg.norm(final["z"] - Z_star) / jnp.linalg.norm(Z_star))
    assert error < 0.05, error
    assert float(loss(final)) < 1e-3 * float(loss(params))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))


@pytest.mark.parametrize("variant", ["kron", "lra"])
def test_newton_fit_inverts_a_hermitian_hessian(variant):
    """Newton fitting on pairs (v, h = H·v) with v circular complex normal and H
    Hermitian positive definite drives P = QᴴQ to H⁻¹ (η annealed to 0,
    float64): Kron's kernel (constant η is all scale_by_kron takes) on a
    Kronecker-structured H; LRA's whole transformation, whose rank covers n so P
    is exact, and which rebalances U, V on ~1% of the steps (UVᴴ must stay)."""
    steps = 1500
    with float64():
        rng = np.random.default_rng(4)

        def hermitian(n):
            X = _complex(rng, (n, n))
            return X @ X.conj().T / n + 0.5 * np.eye(n)

        if variant == "kron":
            shape, H1, H2 = (3, 4), hermitian(3), hermitian(4)
            H = np.kron(H1, H2)  # acts on the C-order vec of a (3, 4) tensor
            H_j = jnp.asarray(H)

            @jax.jit
            def fit_kernel(Qs):
                def step(Qs, inputs):
                    key, lr = inputs
                    v = jax.random.normal(key, shape, jnp.complex128)
                    h = (H_j @ v.ravel()).reshape(shape)
                    return km.update_factors(Qs, h, v, lr), None

                keys = jax.random.split(jax.random.PRNGKey(0), steps)
                lrs = jnp.linspace(0.5, 0.0, steps)
                return jax.lax.scan(step, Qs, (keys, lrs))[0]

            Qs = fit_kernel([jnp.eye(d, dtype=jnp.complex128) for d in shape])
            P = kron_ref.preconditioner_matrix([np.asarray(Q) for Q in Qs])
            np.testing.assert_allclose(P @ H, np.eye(H.shape[0]), atol=1e-3)
            return
        shape, H = (6,), hermitian(6)
        optimizer = pj.scale_by_lra(
            b1=0.0, precond_lr=optax.linear_schedule(0.3, 0.0, steps)
        )
        H_j = jnp.asarray(H)
        params = {"x": jnp.zeros(shape, jnp.complex128)}

        @jax.jit
        def fit(state):
            def step(state, key):
                v = jax.random.normal(key, shape, jnp.complex128)
                h = (H_j @ v.ravel()).reshape(shape)
                _, state = optimizer.update(
                    {"x": h},
                    state,
                    params,
                    Hvp={"x": h},
                    vector={"x": v},
                    update_preconditioner=True,
                )
                return state, None

            keys = jax.random.split(jax.random.PRNGKey(0), steps)
            return jax.lax.scan(step, state, keys)[0]

        state = fit(optimizer.init(params))
        P = lra_ref.p_matrix(*map(np.asarray, state.preconditioner))
        np.testing.assert_allclose(P @ H, np.eye(H.shape[0]), atol=1e-6)


def test_hessian_helper_returns_descent_gradient_and_hermitian_hvp():
    """For L(z) = ‖Az − b‖², hessian_helper's grads are 2Aᴴ(Az − b) (the
    conjugate of jax.grad) and its hvp is H·v with the Hermitian H = 2AᴴA; a
    real leaf's gradient is untouched."""
    with float64():
        rng = np.random.default_rng(2)
        A = jnp.asarray(_complex(rng, (4, 3)))
        b = jnp.asarray(_complex(rng, (4,)))
        params = {
            "r": jnp.asarray(rng.normal(size=2)),
            "z": jnp.asarray(_complex(rng, (3,))),
        }

        def loss(p):
            return jnp.sum(jnp.abs(A @ p["z"] - b) ** 2) + jnp.sum(p["r"] ** 3)

        _, grads, hvp, vector, update = pj.hessian_helper(
            jax.random.PRNGKey(0), loss, params
        )
        assert bool(update)
        A_, z = np.asarray(A), np.asarray(params["z"])
        np.testing.assert_allclose(
            grads["z"], 2 * A_.conj().T @ (A_ @ z - np.asarray(b)), rtol=1e-12
        )
        np.testing.assert_allclose(
            hvp["z"], 2 * A_.conj().T @ A_ @ np.asarray(vector["z"]), rtol=1e-12
        )
        np.testing.assert_allclose(grads["r"], 3 * np.asarray(params["r"]) ** 2)
        assert jnp.iscomplexobj(vector["z"])
        assert not jnp.iscomplexobj(vector["r"])


@pytest.mark.parametrize("precond_dtype", [None, jnp.bfloat16])
def test_kron_complex_factor_dtype(precond_dtype):
    """Complex64 parameters get complex64 factors for float32 and bfloat16 (no
    complex bfloat16 exists) precond_dtype, real parameters keep precond_dtype,
    momentum is complex, and an update keeps every dtype."""
    optimizer = pj.scale_by_kron(precond_dtype=precond_dtype)
    params = {"r": jnp.zeros((3, 2)), "z": jnp.zeros((3, 2), jnp.complex64)}
    state = optimizer.init(params)
    real = jnp.dtype(precond_dtype or jnp.float32)
    dtypes = {tuple(str(F.dtype) for F in stack) for stack in state.preconditioners}
    assert dtypes == {(str(real),) * 2, ("complex64",) * 2}
    assert state.mu["z"].dtype == jnp.complex64
    grads = {"r": jnp.ones((3, 2)), "z": jnp.full((3, 2), 1 + 2j, jnp.complex64)}
    updates, new_state = optimizer.update(grads, state)
    assert updates["z"].dtype == jnp.complex64
    assert bool(jnp.all(updates["z"].imag != 0))
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(
        lambda x: x.dtype, state
    )
