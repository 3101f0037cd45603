"""Float64 NumPy reference of PSGD XMat with explicit matrices (algorithms.md §1b).

Q = diag(a) + antidiag(b) is built as an n×n matrix; the update is the PSGD
gradient of E[hᵀPh + vᵀP⁻¹v] restricted to the X pattern, written from the math
(not from the vector formulas the implementation uses).

Complex a, b: P = QᴴQ, B = Q⁻ᴴv and E = AAᴴ − BBᴴ (the same code, with
conjugate transposes that do nothing on real inputs).
"""

import numpy as np


def x_matrix(a, b):
    """Q = diag(a) + antidiag(b), with the middle entry of an odd n counted once."""
    n = len(a)
    Q = np.diag(a).astype(np.result_type(a, b, float))
    J = np.fliplr(np.eye(n))
    Q += J * b[:, None] * (1 - np.eye(n))  # antidiag(b) off the diagonal
    return Q


def precondition(a, b, g):
    Q = x_matrix(a, b)
    return Q.conj().T @ Q @ g


def update(a, b, v, h, lr, order="2nd"):
    """One step: with A = Qh and B = Q⁻ᵀv (Q⁻ᴴv), the relative gradient is
    E = AAᵀ − BBᵀ (AAᴴ − BBᴴ) restricted to the X pattern; Q ← Q − μ·E_X·Q."""
    n = len(a)
    Q = x_matrix(a, b)
    A = Q @ h
    B = np.linalg.solve(Q.conj().T, v)
    E = np.outer(A, A.conj()) - np.outer(B, B.conj())
    J = np.fliplr(np.eye(n))
    pattern = (np.eye(n) + J) > 0
    E_x = np.where(pattern, E, 0.0)
    mu = (
        lr / np.max(np.abs(A) ** 2 + np.abs(B) ** 2)
        if order == "2nd"
        else lr / np.max(np.abs(E_x))
    )
    Q_new = Q - mu * E_x @ Q
    a_new = np.diag(Q_new).copy()
    b_new = np.fliplr(Q_new).diagonal().copy()
    if n % 2:
        b_new[n // 2] = 0.0
    return a_new, b_new
