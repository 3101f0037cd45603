"""PSGD Kron kernels against the float64 NumPy references in tests/reference.

Every test runs in float64 (module-scoped ``jax.enable_x64`` context, so the flag
never leaks into other test modules) and compares the kernels with explicit dense
formulas: P = ⊗ Q_iᵀQ_i as a matrix acting on vec(G), explicit inverses instead of
triangular solves, explicit unfoldings. The fitting tests check the property the
update exists for: fitted to Newton pairs (V, H·V) the preconditioner converges to
H⁻¹ (algorithms.md, "Oracle test recipe").
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precond.jax._core import factor_kernels as km
from tests.reference import kron_reference as ref


@pytest.fixture(scope="module", autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


SHAPES = [(7,), (5, 4), (3, 4, 5), (2, 3, 4, 3)]
# Every diagonal/triangular mix of every shape: 2 + 4 + 8 + 16 = 30 cases.
CASES = [
    pytest.param(shape, mask, id=f"{shape}-" + "".join("dt"[not m] for m in mask))
    for shape in SHAPES
    for mask in itertools.product([True, False], repeat=len(shape))
]
# Kernels and references differ only by float64 rounding (different summation
# orders and triangular solves versus explicit inverses of well-conditioned Q).
RTOL = 1e-12


def random_triangular(rng: np.random.Generator, d: int) -> np.ndarray:
    """Upper-triangular Q with a positive diagonal in [0.5, 2] (condition ≲ 10)."""
    Q = np.triu(rng.standard_normal((d, d))) * 0.3
    Q[np.diag_indices(d)] = rng.uniform(0.5, 2.0, d)
    return Q


def random_factors(rng, shape, diagonal_mask) -> list[np.ndarray]:
    return [
        rng.uniform(0.5, 2.0, d) if diagonal else random_triangular(rng, d)
        for d, diagonal in zip(shape, diagonal_mask, strict=True)
    ]


def to_jax(arrays):
    return [jnp.asarray(a) for a in arrays]


def assert_close(actual, desired, rtol=RTOL):
    """Elementwise, relative to the largest entry (exact zeros need an atol)."""
    actual = np.asarray(actual)
    desired = np.asarray(desired)
    assert actual.shape == desired.shape
    scale = np.max(np.abs(desired)) if desired.size else 0.0
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=rtol * scale)


# --- (a) applying the preconditioner ----------------------------------------
# precondition, factor_gram, precondition_with_grams, apply_along_axes,
# mode_product and solve_transposed_along_axis against the references:
# tests/common/test_kron_kernels.py (both frameworks, one table).


# --- (b) one factor update ----------------------------------------------------


@pytest.mark.parametrize(("shape", "diagonal_mask"), CASES)
def test_update_factors_takes_a_meaningful_step(shape, diagonal_mask):
    """The step equals the reference (and keeps triangular factors exactly
    triangular) in tests/common/test_kron_kernels.py; here, it moves the
    factors by much more than that table's tolerance."""
    rng = np.random.default_rng(2)
    Qs = random_factors(rng, shape, diagonal_mask)
    G = rng.standard_normal(shape) * 3.0
    V = rng.standard_normal(shape)
    got = km.update_factors(to_jax(Qs), jnp.asarray(G), jnp.asarray(V), 0.1)
    assert len(got) == len(Qs)
    for new_Q, old_Q in zip(got, Qs, strict=True):
        assert new_Q.shape == old_Q.shape
        assert new_Q.dtype == jnp.float64
        assert np.max(np.abs(np.asarray(new_Q) - old_Q)) > 1e-3 * np.max(np.abs(old_Q))


@pytest.mark.parametrize("diagonal_mask", [(False, True, False), (True, False, True)])
def test_kernels_under_jit_equal_reference(diagonal_mask):
    """Tracing changes nothing (a few cases only: each one compiles)."""
    shape = (3, 4, 5)
    rng = np.random.default_rng(3)
    Qs = random_factors(rng, shape, diagonal_mask)
    G = rng.standard_normal(shape)
    V = rng.standard_normal(shape)
    args = (to_jax(Qs), jnp.asarray(G))
    assert_close(jax.jit(km.precondition)(*args), ref.precondition(Qs, G))
    new_Qs = jax.jit(km.update_factors)(*args, jnp.asarray(V), jnp.float64(0.1))
    for got, want in zip(new_Qs, ref.update_factors(Qs, G, V, 0.1), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize(("shape", "diagonal_mask"), CASES[:14])
def test_update_factors_fixed_point_of_newton_pair(shape, diagonal_mask):
    """With G = H·V and ⊗ Q_iᵀQ_i = H⁻¹ exactly, T1 = T2 on every axis: no move."""
    rng = np.random.default_rng(3)
    Qs = random_factors(rng, shape, diagonal_mask)
    # H_i = (Q_iᵀQ_i)⁻¹, so P = ⊗ Q_iᵀQ_i is H⁻¹ by construction.
    Hs = [np.linalg.inv(ref.factor_gram(Q)) for Q in Qs]
    V = rng.standard_normal(shape)
    G = ref.apply_kron(Hs, V)
    got = km.update_factors(to_jax(Qs), jnp.asarray(G), jnp.asarray(V), 0.5)
    for new_Q, Q in zip(got, Qs, strict=True):
        assert_close(new_Q, Q, rtol=1e-12)


# --- (c) norm lower bound -----------------------------------------------------


def random_matrix(kind: str, d: int, log_scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = 10.0**log_scale
    if kind == "psd":
        X = rng.standard_normal((d, d + 3))
        return scale * (X @ X.T)
    if kind == "nonsymmetric":
        return scale * rng.standard_normal((d, d))
    if kind == "rank1":
        return scale * np.outer(rng.standard_normal(d), rng.standard_normal(d))
    if kind == "rank1_psd":
        u = rng.standard_normal(d)
        return scale * np.outer(u, u)
    assert kind == "zero"
    return np.zeros((d, d))


@settings(max_examples=80, deadline=None, database=None)
@given(
    kind=st.sampled_from(["psd", "nonsymmetric", "rank1", "rank1_psd", "zero"]),
    d=st.integers(1, 16),
    log_scale=st.floats(-30, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_norm_lower_bound_brackets_spectral_norm(kind, d, log_scale, seed):
    S = random_matrix(kind, d, log_scale, seed)
    lb = float(km.norm_lower_bound(jnp.asarray(S)))
    if kind == "zero":
        assert lb == 0.0
        return
    spectral = np.linalg.norm(S, 2)
    max_column = np.max(np.linalg.norm(S, axis=0))
    assert lb <= spectral * (1 + 1e-12)
    # Chain proved in the kernel docstring: ‖S‖₂/√d ≤ ‖S‖_F/√d ≤ max column ≤ lb.
    assert lb >= max_column * (1 - 1e-12)
    assert lb >= spectral / np.sqrt(d) * (1 - 1e-12)
    np.testing.assert_allclose(lb, ref.norm_lower_bound(S), rtol=1e-12)
    if kind.startswith("rank1"):
        # ŜŜᵀ has rank one: power iteration from any non-null vector is exact.
        np.testing.assert_allclose(lb, spectral, rtol=1e-12)


def test_norm_lower_bound_is_close_on_random_psd_matrices():
    """On 50×50 Wishart matrices XXᵀ the bound beats its √50 ≈ 7 worst case by far.

    Measured over 1000 such matrices: median ‖S‖₂/lb ≈ 1.11, 99th percentile ≈ 1.33,
    worst ≈ 1.49. The assertions below leave margin for the 200 fixed-seed draws.
    """
    rng = np.random.default_rng(4)
    ratios = []
    for _ in range(200):
        X = rng.standard_normal((50, 50))
        S = X @ X.T
        lb = float(km.norm_lower_bound(jnp.asarray(S)))
        ratios.append(np.linalg.norm(S, 2) / lb)
    ratios = np.array(ratios)
    assert np.all(ratios >= 1 - 1e-12)
    assert np.median(ratios) < 1.2
    assert np.mean(ratios <= 1.5) >= 0.95


def test_norm_lower_bound_keeps_dtype_and_is_zero_for_zero():
    S32 = jnp.asarray(np.random.default_rng(5).standard_normal((6, 6)), jnp.float32)
    assert km.norm_lower_bound(S32).dtype == jnp.float32
    for dtype in (jnp.float32, jnp.float64):
        zero = km.norm_lower_bound(jnp.zeros((4, 4), dtype))
        assert zero.dtype == dtype
        assert float(zero) == 0.0
    assert float(jax.jit(km.norm_lower_bound)(jnp.zeros((3, 3)))) == 0.0


# --- (d) packed factors -------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 5, 8])
def test_pack_unpack_round_trip(d):
    Q = random_triangular(np.random.default_rng(6 + d), d)
    packed = km.pack_factor(jnp.asarray(Q))
    assert packed.shape == (d + 1, d)
    np.testing.assert_array_equal(km.unpack_factor(packed), Q)
    gram = np.asarray(km.unpack_gram(packed))
    np.testing.assert_array_equal(gram, gram.T)
    assert_close(gram, Q.T @ Q, rtol=1e-14)
    # The cached gram preconditions like the factor it was packed from.
    G = np.random.default_rng(7).standard_normal((d, 3))
    assert_close(
        km.precondition_with_grams([jnp.asarray(gram), jnp.eye(3)], jnp.asarray(G)),
        ref.precondition([Q, np.eye(3)], G),
    )


# --- (e) balancing ------------------------------------------------------------


@pytest.mark.parametrize(("shape", "diagonal_mask"), CASES)
def test_balance_factors_keeps_preconditioner_and_equalises_norms(shape, diagonal_mask):
    rng = np.random.default_rng(8)
    # Factors of very different magnitudes (1e-3 … 1e3) but a fixed product.
    Qs = [
        Q * 10.0 ** rng.uniform(-3, 3)
        for Q in random_factors(rng, shape, diagonal_mask)
    ]
    balanced = km.balance_factors(to_jax(Qs))
    assert_close(ref.preconditioner_matrix(balanced), ref.preconditioner_matrix(Qs))
    norms = np.array([np.max(np.abs(np.asarray(Q))) for Q in balanced])
    np.testing.assert_allclose(norms, norms[0], rtol=1e-12)
    np.testing.assert_allclose(
        np.prod(norms), np.prod([np.max(np.abs(Q)) for Q in Qs]), rtol=1e-12
    )
    # Against ref.balance_factors: tests/common/test_kron_kernels.py.


# --- (f) fitting: the preconditioner converges to the oracle ------------------


def random_spd(rng: np.random.Generator, d: int, condition: float = 10.0):
    """SPD matrix with eigenvalues log-spaced in [1, condition] in a random basis."""
    O, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (O * np.logspace(0, np.log10(condition), d)) @ O.T


def spd_sqrt(H: np.ndarray) -> np.ndarray:
    w, O = np.linalg.eigh(H)
    return (O * np.sqrt(w)) @ O.T


def fit_factors(diagonal_mask, mixers, steps, *, whitening, seed=0):
    """Runs ``steps`` updates from Q_i = I with η annealed linearly from 0.5 to 0.

    Newton: G = V ×_1 M_1 … ×_k M_k with the same V passed to the update.
    Whitening: G is built from an independent draw V', so only E[GGᵀ] = ⊗ M_i² is
    seen. No damping noise: the fit is checked against the exact oracle.
    """
    shape = tuple(M.shape[0] for M in mixers)
    Ms = [
        jnp.asarray(np.diag(M) if diagonal else M)
        for M, diagonal in zip(mixers, diagonal_mask, strict=True)
    ]
    Qs = [
        jnp.ones(d) if diagonal else jnp.eye(d)
        for d, diagonal in zip(shape, diagonal_mask, strict=True)
    ]
    key = jax.random.key(seed)

    def step(Qs, n):
        v_key, g_key = jax.random.split(jax.random.fold_in(key, n))
        V = jax.random.normal(v_key, shape, jnp.float64)
        noise = jax.random.normal(g_key, shape, jnp.float64) if whitening else V
        G = km.apply_along_axes(Ms, noise)
        lr = 0.5 * (1.0 - n / steps)
        return km.update_factors(Qs, G, V, lr), None

    run = jax.jit(lambda Qs: jax.lax.scan(step, Qs, jnp.arange(steps))[0])
    return [np.asarray(Q) for Q in run(Qs)]


def relative_identity_error(P: np.ndarray, target_inverse: np.ndarray) -> float:
    """‖P·T − I‖_F / ‖I‖_F, with T the matrix P should invert."""
    n = P.shape[0]
    return float(np.linalg.norm(P @ target_inverse - np.eye(n)) / np.sqrt(n))


def _fit_problem(name):
    rng = np.random.default_rng(9)
    if name == "6x5":
        return (False, False), [random_spd(rng, 6), random_spd(rng, 5)]
    if name == "6x5x4":
        return (False,) * 3, [random_spd(rng, d) for d in (6, 5, 4)]
    assert name == "6x5-diag"
    return (False, True), [random_spd(rng, 6), np.diag(rng.uniform(1.0, 10.0, 5))]


FIT_PROBLEMS = ["6x5", "6x5x4", "6x5-diag"]


@pytest.mark.parametrize("name", FIT_PROBLEMS)
def test_fit_to_newton_pairs_converges_to_inverse_hessian(name):
    diagonal_mask, Hs = _fit_problem(name)
    H = ref.kron_all(Hs)
    assert relative_identity_error(np.eye(len(H)), H) > 1.0  # Q = I starts far off
    Qs = fit_factors(diagonal_mask, Hs, steps=2000, whitening=False)
    # At P = H⁻¹ the pair (V, HV) gives T1 = T2 for every V: the stochastic fit has
    # zero variance at its solution and converges to rounding (observed ~1e-15).
    assert relative_identity_error(ref.preconditioner_matrix(Qs), H) < 1e-10


@pytest.mark.parametrize("name", FIT_PROBLEMS)
def test_fit_to_gradient_covariance_whitens(name):
    diagonal_mask, Cs = _fit_problem(name)  # covariance C = ⊗ C_i of vec(G)
    C_sqrt = ref.kron_all([spd_sqrt(C) for C in Cs])
    assert relative_identity_error(np.eye(len(C_sqrt)), C_sqrt) > 0.5
    Qs = fit_factors(
        diagonal_mask, [spd_sqrt(C) for C in Cs], steps=3000, whitening=True
    )
    # Only E[T1] = E[T2] at P = C^{-1/2}: each sample of (G, V) still moves Q by
    # O(η), so the result is an average over the last ~1/η samples and keeps
    # sampling noise. Observed 0.05-0.09 over 8 seeds for these problems; 0.2
    # separates that from an unfitted P = I (error > 0.5).
    assert relative_identity_error(ref.preconditioner_matrix(Qs), C_sqrt) < 0.2


# --- (g) damping noise --------------------------------------------------------


def test_add_damping_noise_formula():
    np.testing.assert_equal(km.DAMPING_SCALE, 2.0**-11.5)
    np.testing.assert_equal(km.TINY, float(np.finfo(np.float32).tiny))
    rng = np.random.default_rng(10)
    G = rng.standard_normal((5, 4, 3)) * 7.0
    V = rng.standard_normal((5, 4, 3))
    got = np.asarray(km.add_damping_noise(jnp.asarray(G), jnp.asarray(V)))
    expected = G + 2.0**-11.5 * np.mean(np.abs(G)) * V
    # Only mean|G| can differ, by summation order: the noise term is 1e-3 of G,
    # so a few ulps of the mean vanish in the sum.
    np.testing.assert_allclose(got, expected, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(
        km.add_damping_noise(jnp.zeros((3, 2)), jnp.asarray(V[:3, :2, 0])), 0.0
    )
