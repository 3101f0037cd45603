"""Kernels of PSGD Kron for torch: the mirror of ``precond.jax._kron_math``.

Same function names, argument order and math, with one difference: every tensor
carries a leading *stack* axis, so a single call fits or applies the factors of
many equal-shaped parameters (batched matmuls and solves instead of a Python loop).
Symbols (Li 2015, arXiv:1512.04202; Li 2018, arXiv:1809.10232):

* ``G``: (B, d_1, …, d_k) gradients (or momenta) of B equal-shaped tensors.
* ``Qs``: per axis, (B, d, d) upper-triangular factors or (B, d) diagonal ones;
  the preconditioner of stack entry b is P_b = ⊗_i Q_{b,i}ᴴQ_{b,i}.
* ``V``: standard normal noise shaped like ``G``.

Complex tensors are supported throughout (Li's PSGD is defined for them): P is
Hermitian, P = ⊗ Q_iᴴQ_i, grams are X_(i)X_(i)ᴴ, B uses Q_i^{-H}, and triangular
factors keep a real positive diagonal. For real tensors ``conj`` is a no-op, so
the real results are unchanged (ᴴ reads as ᵀ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from precond._common.kron_constants import (  # the styles both frameworks accept
    UPDATE_STYLES as UPDATE_STYLES,
)

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
    """X_(i) X_(i)ᴴ per stack entry: (B, d, d), or its (real) diagonal (B, d)."""
    rows, _ = _rows(X, axis)
    if diagonal:
        if rows.is_complex():
            return torch.view_as_real(rows).square().sum(dim=(1, 3))
        return (rows * rows).sum(dim=1)
    return torch.bmm(rows.transpose(1, 2), rows.conj())


def solve_transposed_along_axis(
    Q: torch.Tensor, X: torch.Tensor, axis: int
) -> torch.Tensor:
    """X ×_axis Q^{-H} for upper-triangular Q (a vector Q divides by conj(q))."""
    if Q.ndim == 2:
        return X / _along(Q.conj(), X, axis)
    rows, moved = _rows(X, axis)
    # Row-vector form of Q^{-H} x = conj(Q)^{-T} x: solve y conj(Q) = xᵀ for y.
    solved = torch.linalg.solve_triangular(Q.conj(), rows, upper=True, left=False)
    return _unrows(solved, moved, axis)


def norm_lower_bound(S: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound on the spectral norm ‖S_b‖₂ of each (B, d, d) entry.

    With s = max|S|, Ŝ = S/s and x the column of Ŝ with the largest norm,
    returns s·‖Ŝ Ŝᴴ x‖/‖Ŝᴴ x‖ (y = xᴴŜ normalised, s·‖yŜᴴ‖); within a factor
    √d of ‖S‖₂. Returns 0 for S = 0.
    """
    scale = S.abs().amax(dim=(1, 2))
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    S_hat = S / safe_scale[:, None, None].to(S.dtype)
    squares = (
        torch.view_as_real(S_hat).square().sum(dim=-1)
        if S_hat.is_complex()
        else S_hat * S_hat
    )
    column = squares.sum(dim=1).argmax(dim=1)
    x = torch.take_along_dim(S_hat, column[:, None, None], dim=2)[..., 0]
    y = torch.bmm(x.conj()[:, None, :], S_hat)[:, 0]
    y_norm = torch.linalg.vector_norm(y, dim=1, keepdim=True)
    y = y / torch.where(y_norm > 0, y_norm, torch.ones_like(y_norm)).to(y.dtype)
    bound = safe_scale * torch.linalg.vector_norm(
        torch.bmm(y[:, None, :], S_hat.mH)[:, 0], dim=1
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

    A = G ×_1 Q_1 … ×_k Q_k and B = V ×_1 Q_1^{-H} … ×_k Q_k^{-H}; per axis, with
    T1 = A_(i)A_(i)ᴴ and T2 = B_(i)B_(i)ᴴ (diagonals only for diagonal factors):

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
    """P_i = Q_iᴴQ_i per entry for matrix factors, |q_i|² for diagonal ones."""
    return Q * Q.conj() if Q.ndim == 2 else torch.bmm(Q.mH, Q)


def precondition(Qs: Sequence[torch.Tensor], G: torch.Tensor) -> torch.Tensor:
    """U = P·G = G ×_1 Q_1ᴴQ_1 … ×_k Q_kᴴQ_k, applying Q_i then Q_iᴴ per axis."""
    for axis, Q in enumerate(Qs):
        G = mode_product(G, Q, axis)
        G = mode_product(G, Q.conj() if Q.ndim == 2 else Q.mH, axis)
    return G


def pack_factor(Q: torch.Tensor) -> torch.Tensor:
    """Packs each upper-triangular Q and P = QᴴQ into one (B, d + 1, d) array: Q
    in the upper triangle, P's strict lower triangle below it, diag(P) last."""
    P = factor_gram(Q)
    body = torch.triu(Q) + torch.tril(P, -1)
    return torch.cat([body, P.diagonal(dim1=1, dim2=2)[:, None, :]], dim=1)


def unpack_factor(packed: torch.Tensor) -> torch.Tensor:
    """The triangular Q stored in a packed factor."""
    return torch.triu(packed[:, :-1])


def unpack_gram(packed: torch.Tensor) -> torch.Tensor:
    """The symmetric (Hermitian) P = QᴴQ stored in a packed factor."""
    strict_lower = torch.tril(packed[:, :-1], -1)
    return strict_lower + strict_lower.mH + torch.diag_embed(packed[:, -1])


# Smoothing β_L of the Lipschitz estimates L_i of the generation-2 rules.
LIPSCHITZ_DECAY = 0.95
# The Procrustes rotation step is at most this (its series is second order).
MAX_PROCRUSTES_STEP = 0.125


def whitening_targets(
    shape: Sequence[int], diagonal: Sequence[bool], like: torch.Tensor
) -> list[torch.Tensor]:
    """E[V_(i)V_(i)ᴴ] = c_i·I for V ~ N(0, I) (or CN(0, I)) of ``shape``
    (without the stack axis), c_i = ∏_{j≠i} d_j; a (d,) vector for a diagonal
    factor, (d, d) else (broadcast over the stack), in the real dtype of
    ``like`` and on its device."""
    dtype = like.real.dtype if like.is_complex() else like.dtype
    targets = []
    for i, (d, diag) in enumerate(zip(shape, diagonal, strict=True)):
        c = math.prod(shape[:i]) * math.prod(shape[i + 1 :])
        t = torch.full((d,), float(c), dtype=dtype, device=like.device)
        targets.append(t if diag else torch.diag(t))
    return targets


def normal_draw(
    generator: torch.Generator | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """N(0, I) of ``shape`` from ``generator`` (the default ``draw`` of the
    sampled norm bounds; tests inject their own)."""
    return torch.randn(tuple(shape), generator=generator, dtype=dtype, device=device)


def sampled_norm_lower_bound(
    S: torch.Tensor,
    key: torch.Generator | None = None,
    draw: Callable | None = None,
    vectors: int = 32,
    iterations: int = 2,
) -> torch.Tensor:
    """A lower bound on ‖S_b‖₂ of each real (B, d, d) entry from sampled power
    iterations, as :func:`precond.jax._kron_math.sampled_norm_lower_bound`.

    s = max|S_b|, Ŝ = S_b/s, x = the row of Ŝ with the largest norm; k start
    vectors x + sign(⟨x, w⟩)·w, w ~ N(0, I), each mapped twice by
    v ↦ (vŜ/‖vŜ‖)Ŝ; returns s·max_k‖v_k‖. ``draw(key, (B, k, d), dtype,
    device)`` draws the w (default :func:`normal_draw`, from the generator
    ``key``).
    """
    B, d = S.shape[0], S.shape[-1]
    scale = S.abs().amax(dim=(1, 2)) + TINY
    S_hat = S / scale[:, None, None]
    row = (S_hat * S_hat).sum(dim=2).argmax(dim=1)
    x = torch.take_along_dim(S_hat, row[:, None, None], dim=1)  # (B, 1, d)
    W = (draw or normal_draw)(key, (B, vectors, d), S.dtype, S.device)
    V = x + torch.sign((x * W).sum(dim=2, keepdim=True)) * W
    for _ in range(iterations):
        V = torch.bmm(V, S_hat)
        V = V / (torch.linalg.vector_norm(V, dim=2, keepdim=True) + TINY)
        V = torch.bmm(V, S_hat)
    return scale * torch.linalg.vector_norm(V, dim=2).amax(dim=1)


def procrustes_step(
    Q: torch.Tensor,
    key: torch.Generator | None = None,
    draw: Callable | None = None,
) -> torch.Tensor:
    """Rotates each (B, d, d) Q toward the symmetric PSD polar factor of QᴴQ:
    R = Qᴴ − Q normalised by lb(R), Q ← Q + aRQ + (a²/2)R²Q with
    a = min(−tr(RQ)/tr(R²Q), 1/8) when tr(R²Q) < 0, else 1/8 (P = QᴴQ kept to
    second order in a). Complex Q: R is skew-Hermitian (exp(aR) unitary) and
    the traces are their real parts. With a generator ``key`` (real Q), lb is
    :func:`sampled_norm_lower_bound` (``draw``: its normal draws)."""
    R = Q.mH - Q
    if key is None:
        bound = norm_lower_bound(R)
    else:
        bound = sampled_norm_lower_bound(R, key, draw)
    R = R / (bound + TINY)[:, None, None]
    RQ = torch.bmm(R, Q)
    RRQ = torch.bmm(R, RQ)
    tr_RQ = RQ.diagonal(dim1=1, dim2=2).sum(dim=1).real
    tr_RRQ = RRQ.diagonal(dim1=1, dim2=2).sum(dim=1).real
    safe = torch.where(tr_RRQ < 0, tr_RRQ, -torch.ones_like(tr_RRQ))
    a = torch.where(
        tr_RRQ < 0,
        torch.clamp(-tr_RQ / safe, max=MAX_PROCRUSTES_STEP),
        torch.full_like(tr_RRQ, MAX_PROCRUSTES_STEP),
    )[:, None, None]
    return Q + a * RQ + (0.5 * a * a) * RRQ


def update_factors_gen2(
    Qs: Sequence[torch.Tensor],
    lipschitz: Sequence[torch.Tensor],
    G: torch.Tensor,
    targets: Sequence[torch.Tensor],
    preconditioner_lr: float,
    style: str,
    keys: Sequence[torch.Generator | None] | None = None,
    draw: Callable | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One generation-2 PSGD step ('QUAD' or 'PRO') on each stack entry, as
    :func:`precond.jax._kron_math.update_factors_gen2`: with Pg = P·G,
    T1 = Pg_(i)Pg_(i)ᴴ and the target T2, L_i ← max(β_L·L_i + (1 − β_L)·ℓ, ℓ),
    ℓ = lb(T1) + lb(T2), μ = η/L_i;

        PRO:  Q ← procrustes_step(Q − μ(T1 − T2)Q);  q ← q⊙(1 − μ(T1 − T2))
        QUAD: Q' = Q − (μ/2)(T1 − T2)Q, Q'' = Q' − (μ/2)Q'(T1 − T2),
              Q ← (Q'' + Q''ᴴ)/2;  q ← q⊙(1 − (μ/2)(T1 − T2))²

    ``lipschitz`` holds one (B,) tensor per axis. ``keys`` (one
    ``torch.Generator`` or None per factor, used by matrix factors of real
    tensors): lb(T1) is :func:`sampled_norm_lower_bound` instead, and 'PRO''s
    rotation bounds ‖R‖₂ the same way, drawing next from the same generator
    (``draw``: their normal draws). Returns new factors and L_i.
    """
    Pg = precondition(Qs, G)
    keys = [None] * len(Qs) if keys is None else keys
    new_Qs, new_L = [], []
    for axis, (Q, L, T2, key) in enumerate(
        zip(Qs, lipschitz, targets, keys, strict=True)
    ):
        diagonal = is_diagonal(Q)
        T1 = unfold_gram(Pg, axis, diagonal)
        T2 = T2.to(T1.dtype).expand_as(T1)
        if diagonal:
            ell = T1.amax(dim=1) + T2.amax(dim=1)
        elif key is None:
            ell = norm_lower_bound(T1) + norm_lower_bound(T2)
        else:
            ell = sampled_norm_lower_bound(T1, key, draw) + norm_lower_bound(T2)
        # β_L·L in the stored dtype (float32), as precond.jax computes it.
        decayed = (LIPSCHITZ_DECAY * L).to(ell.dtype)
        L = torch.maximum(decayed + (1 - LIPSCHITZ_DECAY) * ell, ell)
        mu = preconditioner_lr / (L + TINY)
        E = T1 - T2
        if diagonal:
            scale = mu if style == "PRO" else 0.5 * mu
            gain = 1 - scale[:, None] * E
            Q = Q * (gain if style == "PRO" else gain * gain)
        elif style == "PRO":
            Q = procrustes_step(Q - mu[:, None, None] * torch.bmm(E, Q), key, draw)
        else:
            half = (0.5 * mu)[:, None, None]
            Q = Q - half * torch.bmm(E, Q)
            Q = Q - half * torch.bmm(Q, E)
            Q = 0.5 * (Q + Q.mH)
        new_Qs.append(Q)
        new_L.append(L.to(lipschitz[axis].dtype))
    return new_Qs, new_L


def add_relative_damping_noise(
    G: torch.Tensor, V: torch.Tensor, floor: float = 1e-9
) -> torch.Tensor:
    """G̃ = G + (δ + ε·|G|)⊙V with δ = ``floor`` and ε the machine epsilon of G's
    dtype: the generation-2 rules' elementwise damping."""
    return G + (floor + torch.finfo(G.dtype).eps * G.abs()) * V
