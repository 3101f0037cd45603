"""PSGD Affine's kernels on one parameter viewed as a (d₁, d₂) matrix: the matrix
views, the factors Q_l and Q_r, their fit (Kron's ``update_factors`` on the two
sides), the norm bound and P·G.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precond.jax._core import factor_kernels as km
from precond.jax._core.pool_safe_linalg import triangular_solve


class AffineFactors(NamedTuple):
    """Q = Q_r ⊗ Q_l of one parameter viewed as a (d₁, d₂) matrix. In the state,
    one AffineFactors holds every parameter's: ``left`` and ``right`` are trees
    like the parameters of the arrays below."""

    left: jax.Array  # (d₁, d₁) upper triangular, or (d₁,) for a diagonal Q_l
    right: jax.Array  # (d₂, d₂) upper triangular, or (d₂,) for a diagonal Q_r


def matrix_view_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (d₁, d₂) matrix view of a tensor, keeping its axis order.

    d₁ is the product of the first j dims and d₂ that of the rest, with j
    minimising d₁² + d₂² (the smallest such j on ties). A scalar is (1, 1) and a
    vector of n entries is (1, n); a matrix stays as it is unless a side is 1.
    Unlike psgd-jax, axes are never permuted, so the view is a free reshape
    (``permute_axes=True`` takes psgd-jax's view, :func:`permuted_matrix_view`).

    Example:
        >>> matrix_view_shape((2, 3, 8))
        (6, 8)
    """
    shape = tuple(int(d) for d in shape)
    best = (1, math.prod(shape))  # j = 0
    for j in range(1, len(shape) + 1):
        view = (math.prod(shape[:j]), math.prod(shape[j:]))
        if view[0] ** 2 + view[1] ** 2 < best[0] ** 2 + best[1] ** 2:
            best = view
    return best


def permuted_matrix_view(
    shape: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, int]]:
    """psgd-jax's matrix view: (axis permutation, (d₁, d₂)).

    A matrix keeps its shape and a scalar or vector becomes (1, n). A tensor of
    3 or more axes takes, over every permutation of its axes (in lexicographic
    order) and every split point j in 1..k−1, the first (permutation, j) with
    the least d₁² + d₂² (d₁ the product of the first j permuted dims).

    Example:
        >>> permuted_matrix_view((2, 8, 3))
        ((0, 2, 1), (6, 8))
    """
    shape = tuple(int(d) for d in shape)
    identity = tuple(range(len(shape)))
    if len(shape) == 2:
        return identity, shape
    if len(shape) < 2:
        return identity, (1, math.prod(shape))
    best, best_cost = None, math.inf
    for permutation in itertools.permutations(identity):
        dims = [shape[a] for a in permutation]
        for j in range(1, len(dims)):
            view = (math.prod(dims[:j]), math.prod(dims[j:]))
            if view[0] ** 2 + view[1] ** 2 < best_cost:
                best, best_cost = (permutation, view), view[0] ** 2 + view[1] ** 2
    assert best is not None  # every cost is finite, so the first one was taken
    return best


def matrix_view_plan(
    shape: Sequence[int], permute_axes: bool = False
) -> tuple[tuple[int, ...] | None, tuple[int, int]]:
    """(permutation or None, view): :func:`permuted_matrix_view` when
    ``permute_axes`` (and a permutation helps), else :func:`matrix_view_shape`."""
    if permute_axes:
        permutation, view = permuted_matrix_view(shape)
        if permutation != tuple(range(len(shape))):
            return permutation, view
        return None, view
    return None, matrix_view_shape(shape)


def to_matrix(x: jax.Array, plan) -> jax.Array:
    """``x`` as its (d₁, d₂) matrix view (permuted first if the plan says so)."""
    permutation, view = plan
    if permutation is not None:
        x = jnp.transpose(x, permutation)
    return x.reshape(view)


def from_matrix(X: jax.Array, plan, shape: Sequence[int]) -> jax.Array:
    """The inverse of :func:`to_matrix` for a tensor of ``shape``."""
    permutation, _ = plan
    if permutation is None:
        return X.reshape(shape)
    X = X.reshape([shape[a] for a in permutation])
    return jnp.transpose(X, tuple(int(i) for i in np.argsort(permutation)))


def is_diagonal_side(
    size: int, other: int, max_size_triangular: int, max_skew_triangular: int
) -> bool:
    """A side of ``size`` (the other side ``other``) gets a diagonal factor when
    size < 2, size > max_size_triangular or size > max_skew_triangular·other."""
    return size < 2 or size > max_size_triangular or size > max_skew_triangular * other


def init_factors(
    view: tuple[int, int],
    scale: float,
    dtype: Any,
    max_size_triangular: int,
    max_skew_triangular: int,
) -> AffineFactors:
    """Q_l = √s·I and Q_r = √s·I (vectors of √s for diagonal sides): Q = s·I."""
    d1, d2 = view
    root = math.sqrt(scale)

    def factor(size, other):
        if is_diagonal_side(size, other, max_size_triangular, max_skew_triangular):
            return jnp.full((size,), root, dtype)
        return root * jnp.eye(size, dtype=dtype)

    return AffineFactors(left=factor(d1, d2), right=factor(d2, d1))


def _inverse(Q: jax.Array) -> jax.Array:
    """Q⁻¹ of an upper-triangular Q (1/q for a diagonal factor)."""
    if km.is_diagonal(Q):
        return 1 / Q
    identity = jnp.eye(Q.shape[0], dtype=Q.dtype)
    return triangular_solve(Q, identity, left_side=True, lower=False)


def expected_noise_grams(Qs: Sequence[jax.Array]) -> list[jax.Array]:
    """E[B_(i)B_(i)ᵀ] for B = V ×_1 Q_1^{-T} … ×_k Q_k^{-T}, V ~ N(0, I).

    B_(i) = Q_i^{-T}·V_(i)·M with M = ⊗_{j≠i} Q_j^{-1} (in the unfolding's order),
    and E[V_(i) S V_(i)ᵀ] = tr(S)·I for iid standard normal V, so

        E[B_(i)B_(i)ᵀ] = (∏_{j≠i} tr(Q_j^{-1}Q_j^{-T}))·Q_i^{-T}Q_i^{-1},

    with tr(Q^{-1}Q^{-T}) = ‖Q^{-1}‖_F². For the matrix view: E[BBᵀ] =
    tr(Q_r⁻¹Q_r⁻ᵀ)·Q_l⁻ᵀQ_l⁻¹ and E[BᵀB] = tr(Q_l⁻¹Q_l⁻ᵀ)·Q_r⁻ᵀQ_r⁻¹. Only the
    diagonal (a vector) for a diagonal factor.

    Complex factors: B = V ×_i Q_i^{-H} with circular V (E[v v̄] = 1, E[v v] =
    0), E[B_(i)B_(i)ᴴ] = (∏_{j≠i} ‖Q_j^{-1}‖_F²)·Q_i^{-H}Q_i^{-1}.
    """
    inverses = [_inverse(Q) for Q in Qs]
    traces = [jnp.sum(km.squared_magnitude(inverse)) for inverse in inverses]
    grams = []
    for i, inverse in enumerate(inverses):
        others = math.prod(traces[:i] + traces[i + 1 :])
        if inverse.ndim == 1:
            gram = km.squared_magnitude(inverse)
        else:
            gram = km.hermitian_part(km.conj_transpose(inverse) @ inverse)
        grams.append(others * gram)
    return grams


def norm_lower_bound(S: jax.Array) -> jax.Array:
    """A cheap lower bound on ‖S‖₂ (as psgd-jax's): with s = max|S| and Ŝ = S/s,
    take the column x of Ŝ of largest norm if it beats every row (else the
    row), and return s·‖Ŝᴴ(Ŝx)‖/‖Ŝx‖ (two power-iteration steps on ŜŜᴴ or ŜᴴŜ);
    0 for S = 0. For a Hermitian S rows and columns tie and the row is used.
    """
    scale = jnp.max(jnp.abs(S))
    safe_scale = jnp.where(scale > 0, scale, 1)
    S_hat = S / safe_scale
    magnitude = km.squared_magnitude(S_hat)
    column_norms, row_norms = jnp.sum(magnitude, axis=0), jnp.sum(magnitude, axis=1)

    def from_column():
        x = jax.lax.dynamic_index_in_dim(
            S_hat, jnp.argmax(column_norms), axis=1, keepdims=False
        )
        y = km.conj(x) @ S_hat
        return jnp.linalg.norm((y / jnp.linalg.norm(y)) @ km.conj_transpose(S_hat))

    def from_row():
        x = jax.lax.dynamic_index_in_dim(
            S_hat, jnp.argmax(row_norms), axis=0, keepdims=False
        )
        y = S_hat @ km.conj(x)
        return jnp.linalg.norm(km.conj_transpose(S_hat) @ (y / jnp.linalg.norm(y)))

    bound = jax.lax.cond(
        jnp.max(column_norms) > jnp.max(row_norms), from_column, from_row
    )
    return jnp.where(scale > 0, safe_scale * bound, 0).astype(km.real_dtype(S.dtype))


def affine_update(
    factors: AffineFactors,
    H: jax.Array,
    V: jax.Array | None,
    precond_lr: jax.Array | float,
    step_normalizer_order: str = "2nd",
) -> AffineFactors:
    """One PSGD step of (Q_l, Q_r) on the pair (V, H) of (d₁, d₂) matrices.

    A = Q_l·H·Q_rᵀ and B = Q_l⁻ᵀ·V·Q_r⁻¹; the relative gradients are
    triu(AAᵀ − BBᵀ) for Q_l and triu(AᵀA − BᵀB) for Q_r (only the diagonals for
    a diagonal factor), and Q ← Q − μ·∇·Q with μ = η/(lb(AAᵀ + BBᵀ) + tiny)
    ('2nd'; max instead of lb for a diagonal factor) or η/(lb(∇) + tiny) ('1st'),
    lb being :func:`norm_lower_bound`. ``V=None`` integrates v ~ N(0, I) out:
    BBᵀ and BᵀB are replaced by their expectations
    (:func:`expected_noise_grams`).
    """
    Qs = [factors.left, factors.right]
    A = km.apply_along_axes(Qs, H)
    if V is None:
        noise_grams = expected_noise_grams(Qs)
    else:
        B = V
        for axis, Q in enumerate(Qs):
            B = km.solve_transposed_along_axis(Q, B, axis)
    first_order = step_normalizer_order == "1st"
    new = []
    for axis, Q in enumerate(Qs):
        diagonal = km.is_diagonal(Q)
        T1 = km.unfold_gram(A, axis, diagonal)
        T2 = noise_grams[axis] if V is None else km.unfold_gram(B, axis, diagonal)
        if diagonal:
            normalizer = jnp.abs(T1 - T2) if first_order else jnp.abs(T1 + T2)
            step = precond_lr / (jnp.max(normalizer) + km.TINY)
            new.append(Q - step * (T1 - T2) * Q)
        else:
            gradient = jnp.triu(T1 - T2)
            normalizer = gradient if first_order else T1 + T2
            step = precond_lr / (norm_lower_bound(normalizer) + km.TINY)
            new.append(Q - step * (gradient @ Q))
    return AffineFactors(*new)


def affine_precondition(factors: AffineFactors, G: jax.Array) -> jax.Array:
    """P·G = Q_lᵀQ_l·G·Q_rᵀQ_r for a (d₁, d₂) matrix G."""
    return km.precondition([factors.left, factors.right], G)


def integrates_noise_out(factors: AffineFactors) -> bool:
    """Whitening integrates v out (psgd-jax's rule) when both factors are
    diagonal, or one is diagonal and its side is at least as long as the other
    (then the triangular inverse is the small one); otherwise it samples
    v ~ N(0, I)."""
    left, right = factors
    if km.is_diagonal(left) and km.is_diagonal(right):
        return True
    if km.is_diagonal(left):
        return left.shape[0] >= right.shape[0]
    if km.is_diagonal(right):
        return right.shape[0] >= left.shape[0]
    return False
