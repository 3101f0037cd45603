"""Kernels of PSGD Kron for torch: the mirror of ``precond.jax._kron_math``.

Same function names, argument order and math, with one difference: every tensor
carries a leading *stack* axis, so a single call fits or applies the factors of
many equal-shaped parameters (batched matmuls and solves instead of a Python loop).
Symbols (Li 2015, arXiv:1512.04202; Li 2018, arXiv:1809.10232):

* ``G``: (B, d_1, …, d_k) gradients (or momenta) of B equal-shaped tensors.
* ``Qs``: per axis, (B, d, d) upper-triangular factors or (B, d) diagonal ones;
  the preconditioner of stack entry b is P_b = ⊗_i Q_{b,i}ᵀQ_{b,i}.
* ``V``: standard normal noise shaped like ``G``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# sqrt(float32 machine epsilon) = 2^-11.5: scale of the damping noise added to G.
DAMPING_SCALE = torch.finfo(torch.float32).eps ** 0.5
# Added to step-size denominators so an all-zero gradient never divides by zero.
TINY = torch.finfo(torch.float32).tiny


def is_diagonal(factor: torch.Tensor) -> bool:
    """A factor is diagonal when it is stored as a (B, d) stack of vectors."""
    return factor.ndim == 2


def _rows(X: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Size]:
    """X with tensor axis ``axis`` (0-based, after the stack axis) last, as
    (B, N, d) rows, and the moved shape to undo it."""
    moved = X.movedim(axis + 1, -1)
    return moved.reshape(X.shape[0], -1, moved.shape[-1]), moved.shape


def _unrows(rows: torch.Tensor, moved_shape, axis: int) -> torch.Tensor:
    shape = (*moved_shape[:-1], rows.shape[-1])
    return rows.reshape(shape).movedim(-1, axis + 1)


def _along(vector: torch.Tensor, X: torch.Tensor, axis: int) -> torch.Tensor:
    """A (B, d) stack of vectors shaped to broadcast along tensor axis ``axis``."""
    shape = [X.shape[0]] + [1] * (X.ndim - 1)
    shape[axis + 1] = vector.shape[1]
    return vector.reshape(shape)


def mode_product(X: torch.Tensor, M: torch.Tensor, axis: int) -> torch.Tensor:
    """X ×_axis M: ``M @ X`` along ``axis`` (M a (B, d', d) stack), or ``M ⊙ X``."""
    if M.ndim == 2:
        return X * _along(M, X, axis)
    rows, moved = _rows(X, axis)
    return _unrows(torch.bmm(rows, M.transpose(1, 2)), moved, axis)


def apply_along_axes(factors: Sequence[torch.Tensor], X: torch.Tensor) -> torch.Tensor:
    """X ×_1 F_1 ×_2 F_2 … ×_k F_k for matrix or vector factors F_i."""
    for axis, F in enumerate(factors):
        X = mode_product(X, F, axis)
    return X


def unfold_gram(X: torch.Tensor, axis: int, diagonal: bool) -> torch.Tensor:
    """X_(i) X_(i)ᵀ per stack entry: (B, d, d), or its diagonal (B, d)."""
    rows, _ = _rows(X, axis)
    if diagonal:
        return (rows * rows).sum(dim=1)
    return torch.bmm(rows.transpose(1, 2), rows)


def solve_transposed_along_axis(
    Q: torch.Tensor, X: torch.Tensor, axis: int
) -> torch.Tensor:
    """X ×_axis Q^{-T} for upper-triangular Q (a vector Q divides)."""
    if Q.ndim == 2:
        return X / _along(Q, X, axis)
    rows, moved = _rows(X, axis)
    # Row-vector form of Q^{-T} x: solve y Q = xᵀ for y.
    solved = torch.linalg.solve_triangular(Q, rows, upper=True, left=False)
    return _unrows(solved, moved, axis)


def norm_lower_bound(S: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound on the spectral norm ‖S_b‖₂ of each (B, d, d) entry.

    With s = max|S|, Ŝ = S/s and x the column of Ŝ with the largest norm,
    returns s·‖Ŝ Ŝᵀ x‖/‖Ŝᵀ x‖; within a factor √d of ‖S‖₂. Returns 0 for S = 0.
    """
    scale = S.abs().amax(dim=(1, 2))
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    S_hat = S / safe_scale[:, None, None]
    column = (S_hat * S_hat).sum(dim=1).argmax(dim=1)
    x = torch.take_along_dim(S_hat, column[:, None, None], dim=2)[..., 0]
    y = torch.bmm(x[:, None, :], S_hat)[:, 0]
    y_norm = torch.linalg.vector_norm(y, dim=1, keepdim=True)
    y = y / torch.where(y_norm > 0, y_norm, torch.ones_like(y_norm))
    bound = safe_scale * torch.linalg.vector_norm(
        torch.bmm(y[:, None, :], S_hat.transpose(1, 2))[:, 0], dim=1
    )
    return torch.where(scale > 0, bound, torch.zeros_like(bound))


def add_damping_noise(G: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """G̃ = G + sqrt(ε_f32)·mean|G|·V, the mean per stack entry."""
    mean = G.abs().reshape(G.shape[0], -1).mean(dim=1)
    return G + DAMPING_SCALE * _expand(mean, G) * V


def _expand(per_entry: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    return per_entry.reshape((X.shape[0],) + (1,) * (X.ndim - 1))


def update_factors(
    Qs: Sequence[torch.Tensor],
    G: torch.Tensor,
    V: torch.Tensor,
    preconditioner_lr: float,
) -> list[torch.Tensor]:
    """One PSGD step on the Kronecker factors, fitting P = ⊗ Q_iᵀQ_i to (G, V).

    A = G ×_1 Q_1 … ×_k Q_k and B = V ×_1 Q_1^{-T} … ×_k Q_k^{-T}; per axis, with
    T1 = A_(i)A_(i)ᵀ and T2 = B_(i)B_(i)ᵀ (diagonals only for diagonal factors):

        triangular: Q_i ← Q_i − η / (lb(T1 + T2) + tiny) · triu(T1 − T2) · Q_i
        diagonal:   q_i ← q_i − η / (max|T1 + T2| + tiny) · (T1 − T2) ⊙ q_i

    lb is :func:`norm_lower_bound`, one step size per stack entry. ``G`` should
    already carry the damping noise (:func:`add_damping_noise`).
    """
    A = apply_along_axes(Qs, G)
    B = V
    for axis, Q in enumerate(Qs):
        B = solve_transposed_along_axis(Q, B, axis)
    new_Qs = []
    for axis, Q in enumerate(Qs):
        diagonal = is_diagonal(Q)
        T1 = unfold_gram(A, axis, diagonal)
        T2 = unfold_gram(B, axis, diagonal)
        if diagonal:
            step = preconditioner_lr / ((T1 + T2).abs().amax(dim=1) + TINY)
            new_Qs.append(Q - step[:, None] * (T1 - T2) * Q)
        else:
            gradient = torch.triu(T1 - T2)
            step = preconditioner_lr / (norm_lower_bound(T1 + T2) + TINY)
            new_Qs.append(Q - step[:, None, None] * torch.bmm(gradient, Q))
    return new_Qs


def balance_factors(Qs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Rescales each entry's factors to equal max-abs norms, ⊗ Q_iᵀQ_i unchanged.

    n_i = max|Q_i|, γ = (∏ n_i)^{1/k}: Q_i ← Q_i·γ/n_i.
    """
    norms = torch.stack([Q.abs().reshape(Q.shape[0], -1).amax(dim=1) for Q in Qs])
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    gamma = safe.log().mean(dim=0).exp()
    return [Q * _expand(gamma / safe[i], Q) for i, Q in enumerate(Qs)]


def factor_gram(Q: torch.Tensor) -> torch.Tensor:
    """P_i = Q_iᵀQ_i per entry for matrix factors, q_i² for diagonal ones."""
    return Q * Q if Q.ndim == 2 else torch.bmm(Q.transpose(1, 2), Q)


def precondition(Qs: Sequence[torch.Tensor], G: torch.Tensor) -> torch.Tensor:
    """U = P·G = G ×_1 Q_1ᵀQ_1 … ×_k Q_kᵀQ_k, applying Q_i then Q_iᵀ per axis."""
    for axis, Q in enumerate(Qs):
        G = mode_product(G, Q, axis)
        G = mode_product(G, Q if Q.ndim == 2 else Q.transpose(1, 2), axis)
    return G
