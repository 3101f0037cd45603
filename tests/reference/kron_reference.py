"""Float64 NumPy references for the PSGD Kron kernels, written from the math.

Everything here is deliberately explicit and slow: the preconditioner is the dense
matrix P = Q_1ᵀQ_1 ⊗ … ⊗ Q_kᵀQ_k acting on vec(G), inverses are explicit
``np.linalg.inv`` matrices, and mode-i unfoldings are built with ``np.moveaxis``
and ``reshape``. Nothing here imports JAX, so a kernel bug cannot hide in a shared
helper.

Conventions:

* vec(X) is the C-order ravel ``X.ravel()``. With that ordering
  vec(X ×_1 M_1 … ×_k M_k) = (M_1 ⊗ … ⊗ M_k)·vec(X), with ``np.kron`` taking the
  factors in axis order.
* A factor is a (d, d) upper-triangular matrix Q or a length-d vector q standing
  for the diagonal matrix diag(q).
* Everything works over ℂ as well (Li's PSGD is defined there): a complex input
  stays complex (complex128) and every ᵀ below is then ᴴ, |x| the modulus and
  a trace that must be real its real part; a real input stays float64.

Reference: X.-L. Li, "Preconditioned stochastic gradient descent" (2015,
arXiv:1512.04202) and "Preconditioner on matrix Lie group for SGD" (2018,
arXiv:1809.10232); the step is ``shared/reference/algorithms.md`` Part 1 §1, 5c-5e.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import numpy as np

# sqrt(float32 machine epsilon) = 2^-11.5, the damping-noise scale.
DAMPING_SCALE = 2.0**-11.5
# Smallest normal float32: the guard added to step-size denominators.
TINY = float(np.finfo(np.float32).tiny)


def _as_array(X: np.ndarray) -> np.ndarray:
    """X as float64, or complex128 when X is complex."""
    X = np.asarray(X)
    return X.astype(np.result_type(X.dtype, np.float64), copy=False)


def factor_matrix(Q: np.ndarray) -> np.ndarray:
    """The factor as a dense matrix: Q itself, or diag(q) for a diagonal factor."""
    Q = _as_array(Q)
    return np.diag(Q) if Q.ndim == 1 else Q


def factor_gram(Q: np.ndarray) -> np.ndarray:
    """Q_iᵀQ_i as a dense matrix (diag(q²) for a diagonal factor); Q_iᴴQ_i
    (diag(|q|²)) for a complex factor."""
    M = factor_matrix(Q)
    return M.conj().T @ M


def kron_all(matrices: Sequence[np.ndarray]) -> np.ndarray:
    """M_1 ⊗ M_2 ⊗ … ⊗ M_k (``np.kron`` in axis order)."""
    return reduce(np.kron, [_as_array(M) for M in matrices])


def preconditioner_matrix(Qs: Sequence[np.ndarray]) -> np.ndarray:
    """The dense preconditioner P = ⊗_i Q_iᵀQ_i, of size (∏d_i, ∏d_i); for
    complex factors the Hermitian P = ⊗_i Q_iᴴQ_i."""
    return kron_all([factor_gram(Q) for Q in Qs])


def apply_kron(matrices: Sequence[np.ndarray], X: np.ndarray) -> np.ndarray:
    """X ×_1 M_1 … ×_k M_k computed as (⊗ M_i)·vec(X), reshaped back."""
    X = _as_array(X)
    return (kron_all(matrices) @ X.ravel()).reshape(X.shape)


def precondition(Qs: Sequence[np.ndarray], G: np.ndarray) -> np.ndarray:
    """U with vec(U) = P·vec(G), P = ⊗_i Q_iᵀQ_i (Q_iᴴQ_i for complex factors)."""
    G = _as_array(G)
    return (preconditioner_matrix(Qs) @ G.ravel()).reshape(G.shape)


def unfold(X: np.ndarray, axis: int) -> np.ndarray:
    """The mode-``axis`` unfolding X_(i): a (d_i, ∏_{j≠i} d_j) matrix."""
    X = _as_array(X)
    return np.moveaxis(X, axis, 0).reshape(X.shape[axis], -1)


def norm_lower_bound(S: np.ndarray) -> float:
    """lb(S) of algorithms.md: s = max|S|, Ŝ = S/s, x = the column of Ŝ with the
    largest norm, y = xᵀŜ, lb = s·‖(y/‖y‖)Ŝᵀ‖₂; 0 for S = 0. A complex S is
    kept complex (every ᵀ is then ᴴ)."""
    S = _as_array(S)
    s = np.max(np.abs(S))
    if s == 0:
        return 0.0
    S_hat = S / s
    j = int(np.argmax(np.sum(np.abs(S_hat) ** 2, axis=0)))
    x = S_hat[:, j]
    y = x.conj() @ S_hat
    y = y / np.linalg.norm(y)
    return float(s * np.linalg.norm(y @ S_hat.conj().T))


def add_damping_noise(
    G: np.ndarray, V: np.ndarray, valid_count: int | None = None
) -> np.ndarray:
    """G̃ = G + 2^-11.5·mean|G|·V (|G| the modulus for a complex G); with
    ``valid_count``, the mean is sum|G| / valid_count (a zero-padded block)."""
    G = _as_array(G)
    if valid_count is None:
        mean = np.mean(np.abs(G))
    else:
        mean = np.sum(np.abs(G)) / valid_count
    return G + DAMPING_SCALE * mean * _as_array(V)


def update_factors(
    Qs: Sequence[np.ndarray],
    G: np.ndarray,
    V: np.ndarray | None,
    lr: float,
    step_normalizer_order: str = "2nd",
    noise_grams: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """One generation-1 PSGD Kron factor step (algorithms.md Part 1 §1, 5c-5e).

    c. A = G ×_1 Q_1 … ×_k Q_k, i.e. vec(A) = (⊗ Q_i)·vec(G).
    d. B = V ×_1 Q_1^{-T} … ×_k Q_k^{-T}, i.e. vec(B) = (⊗ Q_i^{-T})·vec(V),
       with explicit inverses.
    e. For each axis i, from the same A and B: T1 = A_(i)A_(i)ᵀ, T2 = B_(i)B_(i)ᵀ;
       triangular: Q_i ← Q_i − η/(lb(T1 + T2) + tiny)·triu(T1 − T2)·Q_i;
       diagonal:   q_i ← q_i − η/(max|T1 + T2| + tiny)·(T1 − T2)⊙q_i with only
       the (real) diagonals of T1, T2.

    Complex input uses ᴴ for ᵀ (B = V ×_i Q_i^{-H}, T1 = A_(i)A_(i)ᴴ, …).
    ``step_normalizer_order='1st'`` normalises by the gradient instead:
    η/(lb(triu(T1 − T2)) + tiny), diagonal η/(max|T1 − T2| + tiny).
    ``noise_grams``: per axis a given T2 (the diagonal as a vector for a diagonal
    factor) instead of B's; V is then unused.
    """
    mats = [factor_matrix(Q) for Q in Qs]
    A = apply_kron(mats, G)
    if noise_grams is None:
        B = apply_kron([np.linalg.inv(M).conj().T for M in mats], V)
    first_order = step_normalizer_order == "1st"
    new_Qs = []
    for axis, Q in enumerate(Qs):
        Q = _as_array(Q)
        A_i = unfold(A, axis)
        T1 = A_i @ A_i.conj().T
        if noise_grams is None:
            B_i = unfold(B, axis)
            T2 = B_i @ B_i.conj().T
        else:
            T2 = _as_array(noise_grams[axis])
            T2 = np.diag(T2) if Q.ndim == 1 else T2
        if Q.ndim == 1:
            t1, t2 = np.diag(T1).real, np.diag(T2).real
            normalizer = t1 - t2 if first_order else t1 + t2
            step = lr / (np.max(np.abs(normalizer)) + TINY)
            new_Qs.append(Q - step * (t1 - t2) * Q)
        else:
            normalizer = np.triu(T1 - T2) if first_order else T1 + T2
            step = lr / (norm_lower_bound(normalizer) + TINY)
            new_Qs.append(Q - step * np.triu(T1 - T2) @ Q)
    return new_Qs


def balance_factors(
    Qs: Sequence[np.ndarray], valid: Sequence[np.ndarray] | None = None
) -> list[np.ndarray]:
    """n_i = max|Q_i|, γ = (∏ n_i)^{1/k}, Q_i ← Q_i·γ/n_i (|·| the modulus for
    complex factors); with ``valid`` (a boolean vector per axis), n_i is the
    max over the real rows and columns only."""
    Qs = [_as_array(Q) for Q in Qs]
    if valid is None:
        valid = [np.ones(Q.shape[0], bool) for Q in Qs]
    norms = np.array(
        [
            np.max(np.abs(Q[v] if Q.ndim == 1 else Q[np.ix_(v, v)]))
            for Q, v in zip(Qs, valid, strict=True)
        ]
    )
    gamma = np.prod(norms) ** (1.0 / len(Qs))
    return [Q * (gamma / n) for Q, n in zip(Qs, norms, strict=True)]


def procrustes_step(Q: np.ndarray, W: np.ndarray | None = None) -> np.ndarray:
    """Generation-2 'PRO' rotation (algorithms.md Part 1 §2, step 5): R = Qᵀ − Q,
    R ← R/lb(R); a = min(−tr(RQ)/tr(R²Q), 1/8) if tr(R²Q) < 0 else 1/8;
    Q ← Q + a·RQ + (a²/2)·R²Q. Complex input uses R = Qᴴ − Q (skew-Hermitian,
    exp(aR) unitary) and the real parts of the traces. With start vectors W,
    lb(R) is :func:`sampled_norm_lower_bound` (R, W) instead."""
    Q = _as_array(Q)
    R = Q.conj().T - Q
    bound = norm_lower_bound(R) if W is None else sampled_norm_lower_bound(R, W)
    R = R / (bound + TINY)
    t1, t2 = np.trace(R @ Q).real, np.trace(R @ R @ Q).real
    a = min(-t1 / t2, 0.125) if t2 < 0 else 0.125
    return Q + a * R @ Q + 0.5 * a * a * R @ R @ Q


def update_factors_gen2(
    Qs: Sequence[np.ndarray],
    Ls: Sequence[float],
    G: np.ndarray,
    targets: Sequence[np.ndarray],
    lr: float,
    style: str,
    lipschitz_decay: float = 0.95,
    draws: Sequence[np.ndarray] | None = None,
) -> tuple[list[np.ndarray], list[float]]:
    """One generation-2 step (algorithms.md Part 1 §2, steps 2-5), dense matrices.

    Pg with vec(Pg) = P·vec(G); per axis T1 = Pg_(i)Pg_(i)ᵀ, E = T1 − T2 with the
    target T2 (a matrix, or the diagonal as a vector for a diagonal factor);
    ℓ = lb(T1) + lb(T2) (diagonal: max T1 + max T2), L ← max(β·L + (1−β)ℓ, ℓ),
    μ = η/L. PRO: Q ← Procrustes(Q − μEQ), q ← q(1 − μE). QEQ: Q ← Q − μQE,
    q ← q(1 − μE). QUAD: Q' = Q − (μ/2)EQ, Q'' = Q' − (μ/2)Q'E,
    Q ← (Q'' + Q''ᵀ)/2, q ← q(1 − (μ/2)E)².
    Complex input uses ᴴ for ᵀ (P = ⊗ Q_iᴴQ_i, T1 = Pg_(i)Pg_(i)ᴴ, unitary
    Procrustes rotation, Hermitian QUAD factors; real diagonals for diagonal
    factors). ``draws``: start vectors W of :func:`sampled_norm_lower_bound`,
    taken in order by each triangular factor's lb(T1), then (PRO) by its
    rotation's lb(R), instead of :func:`norm_lower_bound` there.
    """
    draws = None if draws is None else iter(draws)
    Pg = precondition(Qs, G)
    new_Qs, new_Ls = [], []
    for axis, (Q, L, T2) in enumerate(zip(Qs, Ls, targets, strict=True)):
        Q = _as_array(Q)
        T2 = _as_array(T2)
        Pg_i = unfold(Pg, axis)
        T1 = Pg_i @ Pg_i.conj().T
        if Q.ndim == 1:
            T1, T2 = np.diag(T1).real, T2.real
            ell = np.max(T1) + np.max(T2)
        elif draws is None:
            ell = norm_lower_bound(T1) + norm_lower_bound(T2)
        else:
            ell = sampled_norm_lower_bound(T1, next(draws)) + norm_lower_bound(T2)
        L = max(lipschitz_decay * L + (1 - lipschitz_decay) * ell, ell)
        mu = lr / (L + TINY)
        E = T1 - T2
        if Q.ndim == 1:
            Q = Q * (1 - 0.5 * mu * E) ** 2 if style == "QUAD" else Q * (1 - mu * E)
        elif style == "PRO":
            W = None if draws is None else next(draws)
            Q = procrustes_step(Q - mu * E @ Q, W)
        elif style == "QEQ":
            Q = Q - mu * Q @ E
        else:
            Q = Q - 0.5 * mu * E @ Q
            Q = Q - 0.5 * mu * Q @ E
            Q = 0.5 * (Q + Q.conj().T)
        new_Qs.append(Q)
        new_Ls.append(L)
    return new_Qs, new_Ls


def mode_product(X: np.ndarray, M: np.ndarray, axis: int) -> np.ndarray:
    """X ×_axis M: (I ⊗ … ⊗ M ⊗ … ⊗ I)·vec(X), M a matrix or a diagonal vector."""
    X = _as_array(X)
    mats = [np.eye(d) for d in X.shape]
    mats[axis] = factor_matrix(M)
    return apply_kron(mats, X)


def solve_transposed_along_axis(Q: np.ndarray, X: np.ndarray, axis: int):
    """X ×_axis Q^{-T} (Q^{-H} for a complex Q) with an explicit inverse."""
    return mode_product(X, np.linalg.inv(factor_matrix(Q)).conj().T, axis)


def unfold_gram(X: np.ndarray, axis: int, diagonal: bool) -> np.ndarray:
    """X_(i)X_(i)ᴴ from the explicit unfolding; only its (real) diagonal if
    ``diagonal``."""
    X_i = unfold(X, axis)
    T = X_i @ X_i.conj().T
    return np.diag(T).real if diagonal else T


def sampled_norm_lower_bound(
    S: np.ndarray, W: np.ndarray, iterations: int = 2
) -> float:
    """Sampled lb of a real S: s = max|S| (+ tiny), Ŝ = S/s, x = the row of Ŝ
    with the largest norm, start vectors v_k = x + sign(⟨x, w_k⟩)·w_k (rows of
    W), each mapped ``iterations`` times by v ↦ (vŜ/(‖vŜ‖ + tiny))Ŝ; returns
    s·max_k‖v_k‖."""
    S = _as_array(S)
    s = np.max(np.abs(S)) + TINY
    S_hat = S / s
    x = S_hat[int(np.argmax(np.sum(S_hat**2, axis=1)))]
    V = np.stack([x + np.sign(x @ w) * w for w in _as_array(W)])
    for _ in range(iterations):
        V = V @ S_hat
        V = V / (np.linalg.norm(V, axis=1, keepdims=True) + TINY)
        V = V @ S_hat
    return float(s * np.max(np.linalg.norm(V, axis=1)))


def pack_factor(Q: np.ndarray) -> np.ndarray:
    """The (d + 1, d) packed factor: Q's upper triangle, P = QᴴQ's strict lower
    triangle below it, diag(P) as the last row."""
    Q = _as_array(Q)
    P = factor_gram(Q)
    return np.vstack([np.triu(Q) + np.tril(P, -1), np.diag(P)[None, :]])


def whitening_targets(
    valid: Sequence[np.ndarray], diagonal: Sequence[bool]
) -> list[np.ndarray]:
    """E[V_(i)V_(i)ᵀ] for V ~ N(0, I) on the entries where every axis is valid:
    the row sums of the unfolded 0/1 mask (the diagonal vector for a diagonal
    factor, else diag of it)."""
    mask = reduce(np.multiply.outer, [np.asarray(v, np.float64) for v in valid])
    sums = [unfold(mask, i).sum(axis=1) for i in range(len(valid))]
    return [t if d else np.diag(t) for t, d in zip(sums, diagonal, strict=True)]


def add_relative_damping_noise(
    G: np.ndarray, V: np.ndarray, floor: float, eps: float
) -> np.ndarray:
    """G̃ = G + (δ + ε·|G|)⊙V with δ = ``floor`` and ε = ``eps`` (the machine
    epsilon of the kernel's dtype)."""
    G = _as_array(G)
    return G + (floor + eps * np.abs(G)) * _as_array(V)
