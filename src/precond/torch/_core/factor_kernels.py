"""Kernels of PSGD Kron for torch: the mirror of ``precond.jax._core.factor_kernels``.

Same kernels, with the same names, argument names and order, math and
conventions (tests/common/test_kron_kernels.py runs every kernel of both against
the same float64 references). Two differences, both the frameworks':

* Stacks. Every per-unit argument carries a leading *stack* axis
  (``STACK_AXES = 1``), so one call fits or applies the factors of many
  equal-shaped units with batched matmuls and solves, where precond.jax's kernels
  see one unit and their callers ``jax.vmap`` (``STACK_AXES = 0``): each kernel
  here is the JAX kernel vmapped over axis 0 of its per-unit arguments.
  Arguments shared by all units (axes, diagonal flags, step sizes, the style,
  whitening targets, ``draw``) carry no stack axis. A diagonal factor is a
  vector per unit (:func:`is_diagonal`).
* Randomness. ``rng`` is a ``torch.Generator`` (None: torch's global one) here
  and a PRNG key in JAX; ``draw(rng, shape, dtype, device)`` here (torch places
  a draw on a device), ``draw(rng, shape, dtype)`` there (default
  :func:`normal_draw`). A generator draws the two sampled bounds of a 'PRO'
  factor in turn, where a key is split between them.

Only here: private reshaping helpers; the complex-number helpers of the JAX
module are tensor methods in torch (``is_complex()``, ``conj()``, ``mH``).

Symbols (Li 2015, arXiv:1512.04202; Li 2018, arXiv:1809.10232):

* ``G``: (B, d_1, …, d_k) gradients (or momenta) of B equal-shaped tensors.
* ``Qs``: per axis, (B, d, d) upper-triangular factors or (B, d) diagonal ones;
  the preconditioner of stack entry b is P_b = ⊗_i Q_{b,i}ᴴQ_{b,i}.
* ``V``: standard normal noise shaped like ``G``.

Complex tensors are supported throughout (Li's PSGD is defined for them): P is
Hermitian, P = ⊗ Q_iᴴQ_i, grams are X_(i)X_(i)ᴴ, B uses Q_i^{-H}, and triangular
factors keep a real positive diagonal. For real tensors ``conj`` is a no-op, so
the real results are unchanged (ᴴ reads as ᵀ).

A *packed* triangular factor is a (B, d + 1, d) array holding Q in its upper
triangle, the strict lower triangle of P_i = Q_iᴴQ_i below it and diag(P_i) in
its last row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from precond._common.kron_constants import (  # the styles both frameworks accept
    UPDATE_STYLES as UPDATE_STYLES,
)
from precond.torch._core.tensors import as_dtype

# Leading stack axes of a kernel's per-unit arguments (module doc; 0 in
# precond.jax._core.factor_kernels, whose callers vmap).
STACK_AXES = 1
# sqrt(float32 machine epsilon) = 2^-11.5: scale of the damping noise added to G.
DAMPING_SCALE = torch.finfo(torch.float32).eps ** 0.5
# Added to step-size denominators so an all-zero gradient never divides by zero.
TINY = torch.finfo(torch.float32).tiny


def is_diagonal(factor: torch.Tensor) -> bool:
    """A factor is diagonal when it is stored as a vector per unit: a (B, d)
    stack of vectors."""
    return factor.ndim == STACK_AXES + 1


def _rows(X: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Size]:
    """X with tensor axis ``axis`` (0-based, after the stack axis) last, as
    (B, N, d) rows, and the moved shape to undo it."""
    # The no-op moves and reshapes are skipped: each would still be dispatched.
    last = axis == X.ndim - 2
    moved = X if last else X.movedim(axis + 1, -1)
    if moved.ndim == 3:
        return moved, moved.shape
    return moved.reshape(X.shape[0], -1, moved.shape[-1]), moved.shape


def _unrows(rows: torch.Tensor, moved_shape, axis: int) -> torch.Tensor:
    shape = (*moved_shape[:-1], rows.shape[-1])
    unrolled = rows if rows.shape == shape else rows.reshape(shape)
    return unrolled if axis == unrolled.ndim - 2 else unrolled.movedim(-1, axis + 1)


def _conj(M: torch.Tensor) -> torch.Tensor:
    """conj(M), without dispatching a no-op for a real M."""
    return M.conj() if M.is_complex() else M


def _along(vector: torch.Tensor, X: torch.Tensor, axis: int) -> torch.Tensor:
    """A (B, d) stack of vectors shaped to broadcast along tensor axis ``axis``."""
    shape = [X.shape[0]] + [1] * (X.ndim - 1)
    shape[axis + 1] = vector.shape[1]
    return vector.reshape(shape)


def _rows_times(X: torch.Tensor, right: torch.Tensor, axis: int) -> torch.Tensor:
    """X with its rows along ``axis`` multiplied by the (B, d, d') stack ``right``."""
    rows, moved = _rows(X, axis)
    return _unrows(torch.bmm(rows, right), moved, axis)


def mode_product(X: torch.Tensor, M: torch.Tensor, axis: int) -> torch.Tensor:
    """X ×_axis M: ``M @ X`` along ``axis`` (M a (B, d', d) stack), or ``M ⊙ X``."""
    if is_diagonal(M):
        return X * _along(M, X, axis)
    return _rows_times(X, M.transpose(1, 2), axis)


def _adjoint_product(X: torch.Tensor, M: torch.Tensor, axis: int) -> torch.Tensor:
    """X ×_axis Mᴴ: rows·conj(M), the same operand as (Mᴴ)ᵀ without the two
    dispatches of forming it (for conj(M) ⊙ X, none for a real M)."""
    if is_diagonal(M):
        return X * _along(_conj(M), X, axis)
    return _rows_times(X, _conj(M), axis)


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
    if is_diagonal(Q):
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

    No division is guarded: for S ≠ 0, ‖y‖ ≥ xᴴx = ‖x‖² ≥ 1 up to rounding (x
    is at least as long as the column holding an entry of modulus 1), and an
    entry with s = 0 (or NaN) comes out NaN, which the last ``where`` makes 0.
    """
    scale = S.abs().amax(dim=(1, 2))
    S_hat = S / as_dtype(_expand(scale, S), S.dtype)
    squares = (
        torch.view_as_real(S_hat).square().sum(dim=-1)
        if S_hat.is_complex()
        else S_hat * S_hat
    )
    column = squares.sum(dim=1).argmax(dim=1)
    x = torch.take_along_dim(S_hat, _expand(column, S), dim=2)[..., 0]
    y = torch.bmm(_conj(x).unsqueeze(1), S_hat)  # (B, 1, d)
    y = y / as_dtype(torch.linalg.vector_norm(y, dim=2, keepdim=True), y.dtype)
    bound = scale * torch.linalg.vector_norm(torch.bmm(y, S_hat.mH), dim=(1, 2))
    return torch.where(scale > 0, bound, 0.0)


def add_damping_noise(
    G: torch.Tensor,
    V: torch.Tensor,
    valid_count: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """G̃ = G + sqrt(ε_f32)·mean|G|·V (|G| the modulus for a complex G), the mean
    per stack entry. For zero-padded blocks, pass the number of real entries
    (an int, or one per stack entry) as ``valid_count`` so the mean ignores
    the padding."""
    magnitudes = G.abs().reshape(G.shape[0], -1)
    if valid_count is None:
        mean = magnitudes.mean(dim=1)
    else:
        mean = magnitudes.sum(dim=1) / valid_count
    return G + DAMPING_SCALE * _expand(mean, G) * V


def _expand(per_entry: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A (B,) vector shaped to scale each entry of the stack X (one dispatch,
    where ``per_entry[:, None, None]`` makes two)."""
    return per_entry.reshape((X.shape[0],) + (1,) * (X.ndim - 1))


def update_factors(
    Qs: Sequence[torch.Tensor],
    G: torch.Tensor,
    V: torch.Tensor | None,
    preconditioner_lr: torch.Tensor | float,
    *,
    step_normalizer_order: str = "2nd",
    noise_grams: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One PSGD step on the Kronecker factors, fitting P = ⊗ Q_iᴴQ_i to (G, V).

    A = G ×_1 Q_1 … ×_k Q_k and B = V ×_1 Q_1^{-H} … ×_k Q_k^{-H}; per axis, with
    T1 = A_(i)A_(i)ᴴ and T2 = B_(i)B_(i)ᴴ (diagonals only for diagonal factors):

        triangular: Q_i ← Q_i − η / (lb(T1 + T2) + tiny) · triu(T1 − T2) · Q_i
        diagonal:   q_i ← q_i − η / (max|T1 + T2| + tiny) · (T1 − T2) ⊙ q_i

    lb is :func:`norm_lower_bound`, one step size per stack entry. ``G`` should
    already carry the damping noise (:func:`add_damping_noise`).

    Args:
        step_normalizer_order: '2nd' (above) or '1st': the step is normalised by
            the gradient instead, η / (lb(triu(T1 − T2)) + tiny) (diagonal:
            η / (max|T1 − T2| + tiny)).
        noise_grams: per axis, a given stack of T2 (matrices, or diagonal
            vectors for a diagonal factor) used instead of the one from V;
            ``V`` is then not used and may be None.
    """
    A = apply_along_axes(Qs, G)
    B = V
    if noise_grams is None:
        assert B is not None  # V is used unless noise_grams are given
        for axis, Q in enumerate(Qs):
            B = solve_transposed_along_axis(Q, B, axis)
    first_order = step_normalizer_order == "1st"
    new_Qs = []
    for axis, Q in enumerate(Qs):
        diagonal = is_diagonal(Q)
        T1 = unfold_gram(A, axis, diagonal)
        if noise_grams is None:
            assert B is not None
            T2 = unfold_gram(B, axis, diagonal)
        else:
            T2 = noise_grams[axis]
        if diagonal:
            normalizer = (T1 - T2).abs() if first_order else (T1 + T2).abs()
            step = preconditioner_lr / (normalizer.amax(dim=1) + TINY)
            new_Qs.append(Q - step[:, None] * (T1 - T2) * Q)
        else:
            # In place where a temporary is not read again: the same values,
            # with three (d, d) temporaries fewer per factor.
            gradient = (T1 - T2).triu_()
            normalizer = gradient if first_order else T1.add_(T2)
            step = preconditioner_lr / (norm_lower_bound(normalizer) + TINY)
            new_Qs.append(Q - torch.bmm(gradient, Q).mul_(_expand(step, Q)))
    return new_Qs


def balance_factors(
    Qs: Sequence[torch.Tensor], valid: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Rescales each entry's factors to equal max-abs norms, ⊗ Q_iᴴQ_i unchanged.

    n_i = max|Q_i|, γ = (∏ n_i)^{1/k}: Q_i ← Q_i·γ/n_i. ``valid`` (one boolean
    (B, d) stack, or one (d,) vector for every entry, per axis) restricts the
    norms to the real rows and columns of zero-padded blocks.
    """
    norms = []
    for i, Q in enumerate(Qs):
        magnitude = Q.abs()
        if valid is not None:
            v = valid[i]
            mask = v if is_diagonal(Q) else v[..., :, None] & v[..., None, :]
            magnitude = torch.where(mask, magnitude, 0.0)
        norms.append(magnitude.reshape(Q.shape[0], -1).amax(dim=1))
    norms = torch.stack(norms)
    safe = torch.where(norms > 0, norms, 1.0)
    gamma = safe.log().mean(dim=0).exp()
    return [Q * _expand(gamma / safe[i], Q) for i, Q in enumerate(Qs)]


def factor_gram(Q: torch.Tensor) -> torch.Tensor:
    """P_i = Q_iᴴQ_i per entry for matrix factors, |q_i|² for diagonal ones."""
    return Q * Q.conj() if is_diagonal(Q) else torch.bmm(Q.mH, Q)


def precondition(Qs: Sequence[torch.Tensor], G: torch.Tensor) -> torch.Tensor:
    """U = P·G = G ×_1 Q_1ᴴQ_1 … ×_k Q_kᴴQ_k, applying Q_i then Q_iᴴ per axis."""
    for axis, Q in enumerate(Qs):
        G = mode_product(G, Q, axis)
        G = _adjoint_product(G, Q, axis)
    return G


def precondition_with_grams(
    Ps: Sequence[torch.Tensor], G: torch.Tensor
) -> torch.Tensor:
    """U = G ×_1 P_1 … ×_k P_k with precomputed (symmetric or Hermitian)
    P_i = Q_iᴴQ_i."""
    return apply_along_axes(Ps, G)


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
    valid: Sequence[torch.Tensor], diagonal: Sequence[bool]
) -> list[torch.Tensor]:
    """E[V_(i)V_(i)ᴴ] for V ~ N(0, I) (or CN(0, I)) on the real entries of a
    zero-padded block: c_i·diag(valid_i), c_i = ∏_{j≠i} (number of real entries
    of axis j), in float32 on ``valid``'s device; a vector for a diagonal
    factor, a matrix otherwise. ``valid``: one boolean vector per axis (all True
    for a block without padding), shared by the units of a stack, as the
    targets are."""
    counts = [v.to(torch.float32).sum() for v in valid]
    targets = []
    for i, (v, diag) in enumerate(zip(valid, diagonal, strict=True)):
        c = 1.0  # ∏_{j≠i} counts[j], multiplied in order
        for j, count in enumerate(counts):
            if j != i:
                c = c * count
        t = c * v.to(torch.float32)
        targets.append(t if diag else torch.diag(t))
    return targets


def normal_draw(
    rng: torch.Generator | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """N(0, I) of ``shape`` from the generator ``rng`` (the default ``draw`` of
    the sampled norm bounds; tests inject their own)."""
    return torch.randn(tuple(shape), generator=rng, dtype=dtype, device=device)


def sampled_norm_lower_bound(
    S: torch.Tensor,
    rng: torch.Generator | None,
    draw: Callable | None = None,
    vectors: int = 32,
    iterations: int = 2,
) -> torch.Tensor:
    """A lower bound on ‖S_b‖₂ of each real (B, d, d) entry from sampled power
    iterations, as :func:`precond.jax._core.factor_kernels.sampled_norm_lower_bound`.

    s = max|S_b|, Ŝ = S_b/s, x = the row of Ŝ with the largest norm; k start
    vectors x + sign(⟨x, w⟩)·w, w ~ N(0, I), each mapped twice by
    v ↦ (vŜ/‖vŜ‖)Ŝ; returns s·max_k‖v_k‖. ``draw(rng, (B, k, d), dtype,
    device)`` draws the w (default :func:`normal_draw`, from the generator
    ``rng``).
    """
    B, d = S.shape[0], S.shape[-1]
    scale = S.abs().amax(dim=(1, 2)) + TINY
    S_hat = S / _expand(scale, S)
    row = (S_hat * S_hat).sum(dim=2).argmax(dim=1)
    x = torch.take_along_dim(S_hat, _expand(row, S), dim=1)  # (B, 1, d)
    W = (draw or normal_draw)(rng, (B, vectors, d), S.dtype, S.device)
    V = x + torch.sign((x * W).sum(dim=2, keepdim=True)) * W
    for _ in range(iterations):
        V = torch.bmm(V, S_hat)
        V = V / (torch.linalg.vector_norm(V, dim=2, keepdim=True) + TINY)
        V = torch.bmm(V, S_hat)
    return scale * torch.linalg.vector_norm(V, dim=2).amax(dim=1)


def procrustes_step(
    Q: torch.Tensor,
    rng: torch.Generator | None = None,
    draw: Callable | None = None,
) -> torch.Tensor:
    """Rotates each (B, d, d) Q toward the symmetric PSD polar factor of QᴴQ:
    R = Qᴴ − Q normalised by lb(R), Q ← Q + aRQ + (a²/2)R²Q with
    a = min(−tr(RQ)/tr(R²Q), 1/8) when tr(R²Q) < 0, else 1/8 (P = QᴴQ kept to
    second order in a). Complex Q: R is skew-Hermitian (exp(aR) unitary) and
    the traces are their real parts. With a generator ``rng`` (real Q), lb is
    :func:`sampled_norm_lower_bound` (``draw``: its normal draws)."""
    R = Q.mH - Q
    if rng is None:
        bound = norm_lower_bound(R)
    else:
        bound = sampled_norm_lower_bound(R, rng, draw)
    R = R / _expand(bound + TINY, R)
    RQ = torch.bmm(R, Q)
    RRQ = torch.bmm(R, RQ)
    tr_RQ = RQ.diagonal(dim1=1, dim2=2).sum(dim=1).real
    tr_RRQ = RRQ.diagonal(dim1=1, dim2=2).sum(dim=1).real
    safe = torch.where(tr_RRQ < 0, tr_RRQ, -1.0)
    a = _expand(
        torch.where(
            tr_RRQ < 0,
            torch.clamp(-tr_RQ / safe, max=MAX_PROCRUSTES_STEP),
            MAX_PROCRUSTES_STEP,
        ),
        Q,
    )
    return Q + a * RQ + (0.5 * a * a) * RRQ


def update_factors_gen2(
    Qs: Sequence[torch.Tensor],
    lipschitz: Sequence[torch.Tensor],
    G: torch.Tensor,
    targets: Sequence[torch.Tensor],
    preconditioner_lr: float,
    style: str,
    rngs: Sequence[torch.Generator | None] | None = None,
    draw: Callable | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One generation-2 PSGD step ('QUAD', 'PRO' or 'QEQ') on each stack entry, as
    :func:`precond.jax._core.factor_kernels.update_factors_gen2`: with Pg = P·G,
    T1 = Pg_(i)Pg_(i)ᴴ and the target T2, L_i ← max(β_L·L_i + (1 − β_L)·ℓ, ℓ),
    ℓ = lb(T1) + lb(T2), μ = η/L_i;

        PRO:  Q ← procrustes_step(Q − μ(T1 − T2)Q);  q ← q⊙(1 − μ(T1 − T2))
        QEQ:  Q ← Q − μQ(T1 − T2);  q ← q⊙(1 − μ(T1 − T2))
        QUAD: Q' = Q − (μ/2)(T1 − T2)Q, Q'' = Q' − (μ/2)Q'(T1 − T2),
              Q ← (Q'' + Q''ᴴ)/2;  q ← q⊙(1 − (μ/2)(T1 − T2))²

    ``lipschitz`` holds one (B,) tensor per axis. ``rngs`` (one
    ``torch.Generator`` or None per factor, used by matrix factors of real
    tensors): lb(T1) is :func:`sampled_norm_lower_bound` instead, and 'PRO''s
    rotation bounds ‖R‖₂ the same way, drawing next from the same generator
    (``draw``: their normal draws). Returns new factors and L_i.
    """
    Pg = precondition(Qs, G)
    rngs = [None] * len(Qs) if rngs is None else rngs
    new_Qs, new_L = [], []
    for axis, (Q, L, T2, rng) in enumerate(
        zip(Qs, lipschitz, targets, rngs, strict=True)
    ):
        diagonal = is_diagonal(Q)
        T1 = unfold_gram(Pg, axis, diagonal)
        T2 = T2.to(T1.dtype).expand_as(T1)
        if diagonal:
            ell = T1.amax(dim=1) + T2.amax(dim=1)
        elif rng is None:
            ell = norm_lower_bound(T1) + norm_lower_bound(T2)
        else:
            ell = sampled_norm_lower_bound(T1, rng, draw) + norm_lower_bound(T2)
        # β_L·L in the stored dtype (float32), as precond.jax computes it.
        decayed = (LIPSCHITZ_DECAY * L).to(ell.dtype)
        L = torch.maximum(decayed + (1 - LIPSCHITZ_DECAY) * ell, ell)
        mu = preconditioner_lr / (L + TINY)
        E = T1 - T2
        if diagonal:
            scale = 0.5 * mu if style == "QUAD" else mu
            gain = 1 - scale[:, None] * E
            Q = Q * (gain * gain if style == "QUAD" else gain)
        elif style == "PRO":
            Q = procrustes_step(Q - _expand(mu, Q) * torch.bmm(E, Q), rng, draw)
        elif style == "QEQ":
            Q = Q - _expand(mu, Q) * torch.bmm(Q, E)
        else:
            half = _expand(0.5 * mu, Q)
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
