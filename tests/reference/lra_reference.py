"""Float64 NumPy reference of PSGD LRA with explicit matrices (algorithms.md §1b).

Q = (I + UVᵀ)·diag(d), P = QᵀQ, E = aaᵀ − bbᵀ, VVᵀ and UUᵀ are built as n×n
matrices and inverses come from ``np.linalg.solve``; each step is the Lie-group
step of Q it stands for (Q ← Q·(I − μ·diag(∇d)), Q ← (I − μ·EVVᵀ)·Q,
Q ← (I − μ·UUᵀE)·Q), and the new factor is read back from the new Q. Written
from the math, not from the O(nr) vector formulas the implementation uses.

Complex U, V, d: Q = (I + UVᴴ)·diag(d), P = QᴴQ, b = Q⁻ᴴv, E = aaᴴ − bbᴴ and
every ᵀ is ᴴ (``.conj()`` does nothing on real inputs).
"""

import numpy as np


def q_matrix(U, V, d):
    """Q = (I + UVᵀ)·diag(d) ((I + UVᴴ)·diag(d) if complex)."""
    return (np.eye(len(d)) + U @ V.conj().T) @ np.diag(d)


def p_matrix(U, V, d):
    """P = QᵀQ (QᴴQ)."""
    Q = q_matrix(U, V, d)
    return Q.conj().T @ Q


def precondition(U, V, d, g):
    return p_matrix(U, V, d) @ g


def _spd_sqrt(A):
    w, X = np.linalg.eigh(A)
    return (X * np.sqrt(w)) @ X.T


def balance(U, V):
    """The gauge R ∈ GL(r) minimising ‖UR‖²_F + ‖VR⁻ᵀ‖²_F: UVᵀ (so Q) unchanged.

    With A = UᵀU, B = VᵀV and S = RRᵀ the cost is tr(AS) + tr(BS⁻¹), stationary
    where SAS = B: S = A⁻¹ # B = A^{-1/2}(A^{1/2}BA^{1/2})^{1/2}A^{-1/2} (the
    geometric mean). With R = S^{1/2}: (UR)ᵀUR = RAR = R⁻¹BR⁻¹ = (VR⁻ᵀ)ᵀVR⁻ᵀ.
    Needs U, V of full column rank (the factors are then unique up to UO, VO with
    O orthogonal, which leaves UVᵀ, UUᵀ and VVᵀ, so every later step, unchanged).
    """
    A, B = U.T @ U, V.T @ V
    root_a = _spd_sqrt(A)
    inv_root_a = np.linalg.inv(root_a)
    R = _spd_sqrt(inv_root_a @ _spd_sqrt(root_a @ B @ root_a) @ inv_root_a)
    return U @ R, V @ np.linalg.inv(R).T


def update(U, V, d, v, h, lr, order="2nd", *, update_u, balance_first=False):
    """One fit of Q to (v, h): d step, then the U step or the V step."""
    if balance_first:
        U, V = balance(U, V)
    n = len(d)
    eye = np.eye(n)
    Q = q_matrix(U, V, d)
    P = Q.conj().T @ Q
    a = Q @ h
    b = np.linalg.solve(Q.conj().T, v)
    Ph = P @ h
    iPv = np.linalg.solve(P, v)

    # d step: the relative gradient of E[hᵀPh + vᵀP⁻¹v] over Q → Q(I + Δ), Δ
    # diagonal, is diag(Ph·hᵀ − P⁻¹v·vᵀ) (complex: diag(Ph·hᴴ − v·vᴴP⁻¹), with
    # vvᴴP⁻¹ = (P⁻¹vvᴴ)ᴴ); Q ← Q(I − μ·diag(∇d)).
    outer_v = np.linalg.solve(P, np.outer(v, v.conj())).conj().T
    grad_d = np.diag(np.outer(Ph, h.conj()) - outer_v).copy()
    if order == "2nd":
        mu = lr * np.min(
            1
            / np.sqrt(np.abs(Ph) ** 2 + np.abs(v) ** 2)
            / np.sqrt(np.abs(h) ** 2 + np.abs(iPv) ** 2)
        )
    else:
        mu = lr / np.max(np.abs(grad_d))
    Q = Q @ (eye - mu * np.diag(grad_d))
    # Read d back: Q = (I + UVᵀ)·diag(d_new).
    d_new = np.diag(np.linalg.solve(eye + U @ V.conj().T, Q)).copy()

    E = np.outer(a, a.conj()) - np.outer(b, b.conj())
    VV, UU = V @ V.conj().T, U @ U.conj().T
    if update_u:
        G = E @ VV  # the gradient restricted to moves of U
        second = np.linalg.norm(a) * np.linalg.norm(VV @ a) + np.linalg.norm(
            b
        ) * np.linalg.norm(VV @ b)
    else:
        G = UU @ E  # the gradient restricted to moves of V
        second = np.linalg.norm(a) * np.linalg.norm(UU @ a) + np.linalg.norm(
            b
        ) * np.linalg.norm(UU @ b)
    mu = lr / second if order == "2nd" else lr / np.linalg.norm(G, "fro")
    Q = (eye - mu * G) @ Q
    # Read the moved factor back from Q·diag(d)⁻¹ − I = U'Vᵀ (or UV'ᵀ).
    low_rank = Q @ np.diag(1 / d_new) - eye
    if update_u:  # U'Vᴴ = L ⇔ V̄U'ᵀ = Lᵀ
        U = np.linalg.lstsq(V.conj(), low_rank.T, rcond=None)[0].T
    else:  # UV'ᴴ = L
        V = np.linalg.lstsq(U, low_rank, rcond=None)[0].conj().T
    # The step keeps Q in the family (I + UVᵀ)·diag(d): read-back is exact.
    assert np.allclose(
        U @ V.conj().T, low_rank, rtol=0, atol=1e-12 * np.abs(low_rank).max()
    )
    return U, V, d_new
