"""Single-tensor kernels of PSGD Kron: arrays in, arrays out.

No pytrees, no optimizer state, no random number generation: callers pass the
noise. Symbols follow the PSGD papers (Li 2015, arXiv:1512.04202; Li 2018,
arXiv:1809.10232):

* ``G``: gradient (or momentum) tensor of order k with dims d_1..d_k.
* ``Qs``: one factor per axis; a (d, d) upper-triangular matrix or a (d,) vector
  (a diagonal factor). The preconditioner is P = ⊗_i Q_iᵀQ_i.
* ``V``: standard normal noise with the shape of ``G``.
* ``X ×_i M``: mode-i product, multiplying the matrix M into axis i of X.

A *packed* triangular factor is a (d + 1, d) array holding Q in its upper triangle
(diagonal included), the strict lower triangle of P_i = Q_iᵀQ_i below it, and
diag(P_i) in its last row. It stores Q and the cached QᵀQ in about the memory of Q
alone, so steps that do not update the preconditioner skip recomputing QᵀQ.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# sqrt(float32 machine epsilon) = 2^-11.5: scale of the damping noise added to G.
DAMPING_SCALE = float(jnp.finfo(jnp.float32).eps) ** 0.5
# Added to step-size denominators so an all-zero gradient never divides by zero.
TINY = float(jnp.finfo(jnp.float32).tiny)


def is_diagonal(factor: jax.Array) -> bool:
    """A factor is diagonal when it is stored as a vector."""
    return factor.ndim == 1


def mode_product(X: jax.Array, M: jax.Array, axis: int) -> jax.Array:
    """X ×_axis M: ``M @ X`` along ``axis`` (M a (d', d) matrix), or ``M ⊙ X``."""
    if M.ndim == 1:
        shape = [1] * X.ndim
        shape[axis] = M.shape[0]
        return X * M.reshape(shape)
    return jnp.moveaxis(jnp.tensordot(M, X, axes=(1, axis)), 0, axis)


def apply_along_axes(factors: Sequence[jax.Array], X: jax.Array) -> jax.Array:
    """X ×_1 F_1 ×_2 F_2 … ×_k F_k for matrix or vector factors F_i."""
    for axis, F in enumerate(factors):
        X = mode_product(X, F, axis)
    return X


def unfold_gram(X: jax.Array, axis: int, diagonal: bool) -> jax.Array:
    """X_(i) X_(i)ᵀ: contracts every axis but ``axis`` (only the diagonal if asked)."""
    others = tuple(a for a in range(X.ndim) if a != axis)
    if diagonal:
        return jnp.sum(X * X, axis=others)
    return jnp.tensordot(X, X, axes=(others, others))


def solve_transposed_along_axis(Q: jax.Array, X: jax.Array, axis: int) -> jax.Array:
    """X ×_axis Q^{-T} for an upper-triangular Q (a vector Q divides)."""
    if Q.ndim == 1:
        shape = [1] * X.ndim
        shape[axis] = Q.shape[0]
        return X / Q.reshape(shape)
    moved = jnp.moveaxis(X, axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    # Row-vector form of Q^{-T} x: solve y Q = xᵀ for y.
    solved = jax.lax.linalg.triangular_solve(Q, rows, left_side=False, lower=False)
    return jnp.moveaxis(solved.reshape(moved.shape), -1, axis)


def norm_lower_bound(S: jax.Array) -> jax.Array:
    """A cheap lower bound on the spectral norm ‖S‖₂ of a square matrix S.

    With s = max|S|, Ŝ = S/s and x the column of Ŝ with the largest norm,
    returns s·‖Ŝ Ŝᵀ x‖/‖Ŝᵀ x‖ (two steps of power iteration on ŜŜᵀ from x). It
    satisfies ‖S‖_F/√d ≤ max column norm ≤ bound ≤ ‖S‖₂, so it is within a factor
    √d of the spectral norm, and much closer in practice. Returns 0 for S = 0.
    """
    scale = jnp.max(jnp.abs(S))
    safe_scale = jnp.where(scale > 0, scale, 1)
    S_hat = S / safe_scale
    column = jnp.argmax(jnp.sum(S_hat * S_hat, axis=0))
    x = jax.lax.dynamic_index_in_dim(S_hat, column, axis=1, keepdims=False)
    y = x @ S_hat
    y_norm = jnp.linalg.norm(y)
    y = y / jnp.where(y_norm > 0, y_norm, 1)
    bound = safe_scale * jnp.linalg.norm(y @ S_hat.T)
    return jnp.where(scale > 0, bound, 0).astype(S.dtype)


def add_damping_noise(
    G: jax.Array, V: jax.Array, valid_count: jax.Array | int | None = None
) -> jax.Array:
    """G̃ = G + sqrt(ε_f32)·mean|G|·V.

    The noise keeps the fit well posed when G is tiny or rank deficient. For a
    zero-padded block, pass the number of real entries as ``valid_count`` so the
    mean ignores the padding.
    """
    count = G.size if valid_count is None else valid_count
    return G + DAMPING_SCALE * (jnp.sum(jnp.abs(G)) / count).astype(G.dtype) * V


def update_factors(
    Qs: Sequence[jax.Array],
    G: jax.Array,
    V: jax.Array,
    preconditioner_lr: jax.Array | float,
) -> list[jax.Array]:
    """One PSGD step on the Kronecker factors, fitting P = ⊗ Q_iᵀQ_i to the pair (G, V).

    A = G ×_1 Q_1 … ×_k Q_k and B = V ×_1 Q_1^{-T} … ×_k Q_k^{-T}. For each axis i,
    with T1 = A_(i)A_(i)ᵀ and T2 = B_(i)B_(i)ᵀ (only their diagonals for a
    diagonal factor), every factor is moved from the same A and B:

        triangular: Q_i ← Q_i − η / (lb(T1 + T2) + tiny) · triu(T1 − T2) · Q_i
        diagonal:   q_i ← q_i − η / (max|T1 + T2| + tiny) · (T1 − T2) ⊙ q_i

    where lb is :func:`norm_lower_bound`. The fixed point E[T1] = E[T2] makes
    P ≈ E[GGᵀ]^{-1/2} (whitening, V independent noise) or P ≈ H^{-1} (Newton,
    G = H·V) in the Kronecker-factored sense. ``G`` should already carry any
    damping noise (:func:`add_damping_noise`). Factors must be unpacked.
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
            step = preconditioner_lr / (jnp.max(jnp.abs(T1 + T2)) + TINY)
            new_Qs.append(Q - step * (T1 - T2) * Q)
        else:
            step = preconditioner_lr / (norm_lower_bound(T1 + T2) + TINY)
            new_Qs.append(Q - step * (jnp.triu(T1 - T2) @ Q))
    return new_Qs


def balance_factors(
    Qs: Sequence[jax.Array], valid: Sequence[jax.Array] | None = None
) -> list[jax.Array]:
    """Rescales factors to equal max-abs norms without changing ⊗ Q_iᵀQ_i.

    With n_i = max|Q_i| and γ = (∏ n_i)^{1/k}: Q_i ← Q_i·γ/n_i. Prevents one factor
    from growing while another shrinks until they under- or overflow. ``valid``
    (one boolean vector per axis) restricts the norms to the real rows and columns
    of a zero-padded block.
    """
    norms = []
    for i, Q in enumerate(Qs):
        magnitude = jnp.abs(Q)
        if valid is not None:
            mask = valid[i] if Q.ndim == 1 else valid[i][:, None] & valid[i][None, :]
            magnitude = jnp.where(mask, magnitude, 0)
        norms.append(jnp.max(magnitude))
    norms = jnp.stack(norms)
    safe = jnp.where(norms > 0, norms, 1)
    gamma = jnp.exp(jnp.mean(jnp.log(safe)))
    return [Q * (gamma / safe[i]).astype(Q.dtype) for i, Q in enumerate(Qs)]


def factor_gram(Q: jax.Array) -> jax.Array:
    """P_i = Q_iᵀQ_i for a matrix factor, q_i² for a diagonal one."""
    return Q * Q if Q.ndim == 1 else Q.T @ Q


def precondition(Qs: Sequence[jax.Array], G: jax.Array) -> jax.Array:
    """U = P·G = G ×_1 Q_1ᵀQ_1 … ×_k Q_kᵀQ_k, applying Q_i then Q_iᵀ per axis."""
    for axis, Q in enumerate(Qs):
        G = mode_product(G, Q, axis)
        G = mode_product(G, Q if Q.ndim == 1 else Q.T, axis)
    return G


def precondition_with_grams(Ps: Sequence[jax.Array], G: jax.Array) -> jax.Array:
    """U = G ×_1 P_1 … ×_k P_k with precomputed (symmetric) P_i = Q_iᵀQ_i."""
    return apply_along_axes(Ps, G)


def pack_factor(Q: jax.Array) -> jax.Array:
    """Packs upper-triangular Q and P = QᵀQ into one (d + 1, d) array (module doc)."""
    P = Q.T @ Q
    body = jnp.triu(Q) + jnp.tril(P, -1)
    return jnp.concatenate([body, jnp.diagonal(P)[None, :]], axis=0)


def unpack_factor(packed: jax.Array) -> jax.Array:
    """The triangular Q stored in a packed factor."""
    return jnp.triu(packed[:-1])


def unpack_gram(packed: jax.Array) -> jax.Array:
    """The symmetric P = QᵀQ stored in a packed factor."""
    strict_lower = jnp.tril(packed[:-1], -1)
    return strict_lower + strict_lower.T + jnp.diag(packed[-1])
