"""Float64 NumPy reference of PSGD Affine with explicit matrices (algorithms.md §1b).

A parameter is viewed as a (d₁, d₂) matrix; Q_l and Q_r are dense matrices
(diagonal factors expanded with ``np.diag``); the preconditioner is the explicit
Kronecker matrix P = (Q_rᵀQ_r) ⊗ (Q_lᵀQ_l) acting on vec(G) (column-major), and
the fit uses explicit inverses. Written from the math, not from the kernels.

Complex factors: P = ⊗ Q_iᴴQ_i in Kron's mode-product convention, i.e.
P·G = Q_lᴴQ_l·G·(Q_rᴴQ_r)ᵀ, so P = (Q_rᴴQ_r) ⊗ (Q_lᴴQ_l) on the column-major
vec(G) (vec(XYZ) = (Zᵀ ⊗ X)·vec(Y)); A = Q_l·H·Q_rᵀ, B = Q_l⁻ᴴ·V·conj(Q_r)⁻¹,
and the grams are AAᴴ (left) and AᵀĀ (right, the mode-2 unfolding's).
``.conj()`` does nothing on reals.
"""

import itertools

import numpy as np

# Added to step-size denominators, as in the kernels (float32's smallest normal).
TINY = float(np.finfo(np.float32).tiny)


def matrix_view_shape(shape):
    """(∏ shape[:j], ∏ shape[j:]) with the smallest d₁² + d₂² (first j on ties)."""
    candidates = [
        (int(np.prod(shape[:j], dtype=int)), int(np.prod(shape[j:], dtype=int)))
        for j in range(len(shape) + 1)
    ]
    return min(candidates, key=lambda v: v[0] ** 2 + v[1] ** 2)


def is_diagonal_side(size, other, max_size=4096, max_skew=128):
    return size < 2 or size > max_size or size > max_skew * other


def _as64(X):
    """X in float64, or complex128 if complex."""
    X = np.asarray(X)
    return X.astype(np.result_type(X.dtype, np.float64))


def dense(Q):
    """The factor as a matrix: Q itself, or diag(q) for a diagonal factor."""
    Q = _as64(Q)
    return np.diag(Q) if Q.ndim == 1 else Q


def preconditioner_matrix(Ql, Qr):
    """P = (Q_rᵀQ_r) ⊗ (Q_lᵀQ_l): vec(P·G) = P·vec(G), vec column-major
    (complex: (Q_rᴴQ_r) ⊗ (Q_lᴴQ_l))."""
    L, R = dense(Ql), dense(Qr)
    return np.kron(R.conj().T @ R, L.conj().T @ L)


def precondition(Ql, Qr, G):
    """P·G through the explicit Kronecker matrix."""
    G = _as64(G)
    return (preconditioner_matrix(Ql, Qr) @ G.flatten(order="F")).reshape(
        G.shape, order="F"
    )


def _restrict(E, like):
    """triu(E) for a triangular factor; the diagonal (a vector) for a diagonal one."""
    return np.diag(E).copy() if np.ndim(like) == 1 else np.triu(E)


def noise_grams_by_basis(Ql, Qr):
    """E[BBᵀ] and E[BᵀB] for B = Q_l⁻ᵀ V Q_r⁻¹, V ~ N(0, I), computed without the
    trace formula: E[V_ab V_cd] = δ_ac δ_bd, so E[f(V)] = Σ_ab f(E_ab) for a
    quadratic f, E_ab the unit matrices."""
    L_inv, R_inv = np.linalg.inv(dense(Ql)), np.linalg.inv(dense(Qr))
    d1, d2 = L_inv.shape[0], R_inv.shape[0]
    dtype = np.result_type(L_inv, R_inv)
    left, right = np.zeros((d1, d1), dtype), np.zeros((d2, d2), dtype)
    # Complex V: circular (E[V_ab V̄_cd] = δ_ac δ_bd, E[V_ab V_cd] = 0), and
    # BBᴴ only pairs V with V̄, so the same sum over unit matrices holds.
    for a, b in itertools.product(range(d1), range(d2)):
        E = np.zeros((d1, d2))
        E[a, b] = 1
        B = L_inv.conj().T @ E @ R_inv.conj()
        left += B @ B.conj().T
        right += B.T @ B.conj()
    return left, right


def norm_lower_bound(S):
    """psgd-jax's lower bound on ‖S‖₂: s = max|S|, Ŝ = S/s; if the largest
    column norm of Ŝ beats the largest row norm, x = that column and lb =
    s·‖(xᴴŜ)Ŝᴴ‖/‖xᴴŜ‖, else x = that row and lb = s·‖Ŝᴴ(Ŝx̄)‖/‖Ŝx̄‖; 0 for S = 0."""
    S = np.asarray(S)
    s = np.max(np.abs(S))
    if s == 0:
        return 0.0
    S_hat = S / s
    magnitude = np.abs(S_hat) ** 2
    columns, rows = magnitude.sum(axis=0), magnitude.sum(axis=1)
    if columns.max() > rows.max():
        y = S_hat[:, np.argmax(columns)].conj() @ S_hat
        return float(s * np.linalg.norm(y @ S_hat.conj().T) / np.linalg.norm(y))
    y = S_hat @ S_hat[np.argmax(rows)].conj()
    return float(s * np.linalg.norm(S_hat.conj().T @ y) / np.linalg.norm(y))


def update(Ql, Qr, H, V, lr, order="2nd"):
    """One Affine fit step on (V, H); V=None integrates V ~ N(0, I) out.

    A = Q_l H Q_rᵀ, B = Q_l⁻ᵀ V Q_r⁻¹; ∇_l = triu(AAᵀ − BBᵀ), ∇_r = triu(AᵀA −
    BᵀB) (diagonals only for diagonal factors); μ = η/lb(AAᵀ + BBᵀ) ('2nd', max
    for diagonal) or η/lb(∇) ('1st', max|∇| for diagonal); Q ← Q − μ∇Q.
    """
    L, R = dense(Ql), dense(Qr)
    H = _as64(H)
    A = L @ H @ R.T
    if V is None:
        BBt, BtB = noise_grams_by_basis(Ql, Qr)
    else:
        B = np.linalg.inv(L).conj().T @ _as64(V) @ np.linalg.inv(R).conj()
        BBt, BtB = B @ B.conj().T, B.T @ B.conj()
    new = []
    for Q, T1, T2 in ((Ql, A @ A.conj().T, BBt), (Qr, A.T @ A.conj(), BtB)):
        grad = _restrict(T1 - T2, Q)
        total = _restrict(T1 + T2, Q)
        if np.ndim(Q) == 1:
            norm = np.max(np.abs(grad if order == "1st" else total)) + TINY
            new.append(np.asarray(Q) - lr / norm * grad * np.asarray(Q))
        else:
            norm = norm_lower_bound(grad if order == "1st" else T1 + T2) + TINY
            new.append(np.asarray(Q) - lr / norm * grad @ np.asarray(Q))
    return new


def first_scale(H, V):
    """Both factors' factor at the first fit with automatic scaling:
    (Σv²/Σh²)^{1/8}, with Σv² = numel when V is integrated out (None)."""
    H = _as64(H)
    v_energy = H.size if V is None else np.sum(np.abs(_as64(V)) ** 2)
    return (v_energy / np.sum(np.abs(H) ** 2)) ** 0.125


def init_factors(view, scale=1.0, max_size=4096, max_skew=128):
    """√s·I or √s·1 per side, diagonal by :func:`is_diagonal_side`."""
    d1, d2 = view
    root = np.sqrt(scale)

    def factor(size, other):
        if is_diagonal_side(size, other, max_size, max_skew):
            return np.full(size, root)
        return root * np.eye(size)

    return [factor(d1, d2), factor(d2, d1)]
