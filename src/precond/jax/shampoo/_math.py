"""Shampoo's matrix kernels: top eigenvalue, inverse p-th roots, quantization.

Single-matrix functions (arrays in, arrays out); the optimizer vmaps them over
stacks of equal-sized statistics. Symbols: ``A`` the (damped) statistics matrix,
``H ≈ A^{-1/p}`` its inverse p-th root, ``M = H^p·A`` (→ I as H converges).

References:
    N. J. Higham, *Functions of Matrices*, SIAM 2008, §7.3 (coupled Newton
    iteration for the inverse p-th root, eq. 7.18).
    R. Anil et al., *Scalable Second Order Optimization for Deep Learning*, 2020.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precond.jax._core.pool_safe_linalg import eigh

# The relative ridge is ε·max(λ_max, LAMBDA_FLOOR): a zero matrix still gets εI·1e-6.
LAMBDA_FLOOR = 1e-6
# A coupled-Newton step may raise the error a little before it falls; a larger rise
# means divergence, and the previous iterate is returned.
DIVERGENCE_FACTOR = 1.2
_QUANTIZED_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.int16): 32767.0}
# Roots of matrices with an entry above this are computed on A/2^k (max entry in
# [1, 2)) and rescaled by 2^(-k/p): the Frobenius norm and the power iteration
# square or sum the entries, which overflows float32 from about 1e19. Below it the
# matrix is used as given (no change to the iteration's rounding).
LARGEST_UNSCALED = 2.0**32


def root_dtype() -> jnp.dtype:
    """float64 when JAX's x64 mode is on, else float32: roots need the precision."""
    return jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))


def _matmul(a, b, precision):
    return jnp.matmul(a, b, precision=precision)


def _matrix_power(x: jax.Array, p: int, precision) -> jax.Array:
    """x^p for a static integer p >= 1, by repeated squaring."""
    result, square = None, x
    while True:
        if p & 1:
            result = square if result is None else _matmul(result, square, precision)
        p >>= 1
        if not p:
            assert result is not None  # p >= 1 has a set bit
            return result
        square = _matmul(square, square, precision)


def power_iteration(
    matrix: jax.Array,
    num_iters: int = 100,
    error_tolerance: float = 1e-6,
    precision=lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """The top eigenpair (v, λ) of a symmetric PSD matrix by power iteration.

    v ← A·v / ‖A·v‖, λ = vᵀA·v, until λ moves by at most ``error_tolerance`` or
    ``num_iters`` iterations. The start vector is fixed (deterministic on every
    device), uniform in [-1, 1] per entry.

    Args:
        matrix: (n, n) symmetric PSD matrix.
        num_iters: the most iterations.
        error_tolerance: stop once the error (the eigenvalue's move, for power
            iteration) is at most this.
        precision: ``lax.Precision`` of the matrix products.

    Returns:
        The unit eigenvector and the eigenvalue estimate, in ``matrix.dtype``.

    Example:
        >>> v, top = power_iteration(jnp.diag(jnp.array([4.0, 9.0])))
        >>> round(float(top), 4), round(abs(float(v[1])), 4)
        (9.0, 1.0)
    """
    n = matrix.shape[-1]
    start = np.random.default_rng(1729).uniform(-1.0, 1.0, n)
    v0 = jnp.asarray(start, matrix.dtype)

    def keep_going(carry):
        i, _, _, moving = carry
        return (i < num_iters) & moving

    def step(carry):
        i, v, eigenvalue, _ = carry
        v = _unit(v)
        av = _matmul(matrix, v, precision)
        new_eigenvalue = jnp.dot(v, av, precision=precision)
        moving = jnp.abs(new_eigenvalue - eigenvalue) > error_tolerance
        return i + 1, av, new_eigenvalue, moving

    carry = (0, v0, jnp.zeros((), matrix.dtype), jnp.asarray(True))
    _, v, eigenvalue, _ = lax.while_loop(keep_going, step, carry)
    return _unit(v), eigenvalue


def _unit(v):
    """v/‖v‖, or v itself when it is 0 (A·v = 0 for a zero matrix)."""
    norm = jnp.linalg.norm(v)
    return v / jnp.where(norm > 0, norm, 1)


def _scaled_down(work: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(A/2^k, k): k = ⌊log₂ max|A|⌋ when max|A| > LARGEST_UNSCALED, else 0.

    Dividing by a power of two is exact, and for a PSD matrix
    λ_max(A/2^k) >= max|A/2^k| >= 1, so the relative ridge ε·max(λ_max, 1e-6) is
    the same ε·λ_max before and after. A non-finite A is left as it is (its root
    fails and is reported as failed).
    """
    largest = jnp.max(jnp.abs(work))
    huge = jnp.isfinite(largest) & (largest > LARGEST_UNSCALED)
    exponent = jnp.where(huge, jnp.floor(jnp.log2(jnp.where(huge, largest, 1))), 0)
    exponent = exponent.astype(jnp.int32)
    return jnp.ldexp(work, -exponent), exponent


def _scaled_up(root: jax.Array, exponent: jax.Array, p: int) -> jax.Array:
    """(2^k·A)^{-1/p} = 2^{-k/p}·A^{-1/p}: undoes :func:`_scaled_down` on a root."""
    return root * jnp.exp2(-exponent.astype(root.dtype) / p)


def _relative_ridge(ridge_epsilon, top_eigenvalue, relative: bool = True):
    """ε·max(λ_max, 1e-6), or ε·1 when the ridge is absolute (``relative=False``)."""
    if not relative:
        top_eigenvalue = jnp.ones_like(top_eigenvalue)
    return ridge_epsilon * jnp.maximum(top_eigenvalue, LAMBDA_FLOOR)


def _inverse_root_gap(ridge, low, high, p: int):
    """(ridge + low)^{-1/p} − (ridge + high)^{-1/p} >= 0 for low <= high, without
    the cancellation of subtracting two close powers: with a = ridge + low and
    d = high − low, it is a^{-1/p}·(1 − (1 + d/a)^{-1/p})
    = −a^{-1/p}·expm1(−log1p(d/a)/p), accurate for small and large d/a alike."""
    a = ridge + low
    return -(a ** (-1.0 / p)) * jnp.expm1(-jnp.log1p((high - low) / a) / p)


def _top_eigenpairs(matrix: jax.Array, k: int, iterations: int):
    """(λ, V): the k largest eigenpairs of a symmetric PSD matrix by LOBPCG,
    started from the first k unit vectors (deterministic on every device)."""
    from jax.experimental.sparse import linalg as sparse_linalg

    n = matrix.shape[-1]
    start = jnp.eye(n, k, dtype=matrix.dtype)
    eigenvalues, vectors, _ = sparse_linalg.lobpcg_standard(
        matrix, start, iterations or k
    )
    return eigenvalues, vectors


def matrix_inverse_pth_root(
    matrix: jax.Array,
    p: int,
    num_iters: int = 100,
    ridge_epsilon: float = 1e-6,
    error_tolerance: float = 1e-6,
    precision=lax.Precision.HIGHEST,
    relative_matrix_epsilon: bool = True,
    lobpcg_topk_precondition: int = 0,
    lobpcg_max_iter: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """(A + ε'I)^{-1/p} of a symmetric PSD matrix by the coupled Newton iteration.

    With ε' = ε·max(λ_max, 1e-6) (λ_max by :func:`power_iteration`) and
    A' = A + ε'I, start from z = (1+p)/(2‖A'‖_F), M = z·A', H = z^{1/p}·I and repeat

        T = (1 + 1/p)·I − M/p,   M ← T^p·M,   H ← H·T

    while e = max|M − I| > ``error_tolerance`` (at most ``num_iters`` times); M → I
    and H → A'^{-1/p}. If a step raises e by more than 1.2× the iteration has
    diverged and the previous H is returned. Runs in float64 when x64 is enabled.
    A matrix with entries above 2^32 is divided by a power of two 2^k first and
    the root multiplied by 2^{-k/p} (exact up to rounding), so statistics up to
    the dtype's largest value get finite roots.

    With ``relative_matrix_epsilon=False`` the ridge is ε itself. With
    ``lobpcg_topk_precondition`` = k > 0, the k largest eigenpairs (λ_i, v_i) of
    A (LOBPCG, ``lobpcg_max_iter`` iterations, default k) are deflated first,
    A_d = A − Σ (λ_i − λ_k)·v_i·v_iᵀ (λ_k the smallest of them; the ridge then
    uses λ_max = max λ_i), the iteration runs on A_d, and the root is inflated
    back: H = H_d − Σ ((ε'+λ_k)^{-1/p} − (ε'+λ_i)^{-1/p})·v_i·v_iᵀ. The error is
    then measured on the result, max|H^p·(A + ε'I) − I|.

    Args:
        matrix: (n, n) symmetric PSD matrix.
        p: the root, a static Python int >= 1.
        num_iters: the most iterations.
        ridge_epsilon: ε of the ridge ε'.
        error_tolerance: stop once the error (the eigenvalue's move, for power
            iteration) is at most this.
        precision: ``lax.Precision`` of the matrix products.
        relative_matrix_epsilon: the ridge is ε·max(λ_max, 1e-6) (True) or ε (False).
        lobpcg_topk_precondition: k > 0 deflates the k largest eigenpairs first (0:
            none).
        lobpcg_max_iter: LOBPCG iterations (0: k).

    Returns:
        (H, e): the root in ``matrix.dtype`` and the final error max|M − I|
        (float32; NaN or large when the root failed and must not be used).
        e is measured on the tracked M, as Google's implementation does: in
        float32 at condition numbers ≳ 1e5 and p = 8, M can drift from the true
        H^p·A' (e = 4e-7 reported for a true residual of 1.6). Enable x64 (the
        iteration then runs in float64) or use the eigh root for such statistics.

    Example: diag(4, 9)^{-1/2} = diag(1/2, 1/3).

        >>> A = jnp.diag(jnp.array([4.0, 9.0]))
        >>> root, error = matrix_inverse_pth_root(A, 2, ridge_epsilon=0.0)
        >>> [round(float(x), 4) for x in jnp.diag(root)], bool(error < 1e-6)
        ([0.5, 0.3333], True)
    """
    n = matrix.shape[-1]
    work, exponent = _scaled_down(matrix.astype(root_dtype()))
    deflated = None
    # LOBPCG needs more than 5k rows; smaller statistics are rooted as they are.
    if 0 < 5 * lobpcg_topk_precondition < n:
        deflated = _deflation(work, lobpcg_topk_precondition, lobpcg_max_iter)
        work, top = deflated.matrix, jnp.max(deflated.eigenvalues)
    elif relative_matrix_epsilon:
        _, top = power_iteration(work, error_tolerance=1e-6, precision=precision)
    else:
        top = jnp.ones((), work.dtype)
    ridge = _relative_ridge(ridge_epsilon, top, relative_matrix_epsilon)
    if n == 1:
        root = _scaled_up((work + ridge) ** (-1.0 / p), exponent, p)
        return root.astype(matrix.dtype), jnp.zeros((), jnp.float32)
    root, error = _coupled_newton(
        work + ridge * jnp.eye(n, dtype=work.dtype),
        p,
        num_iters,
        error_tolerance,
        precision,
    )
    if deflated is not None:
        root, error = _inflated(root, deflated, ridge, p)
    root = _scaled_up(root, exponent, p)
    return root.astype(matrix.dtype), error


class _Deflation(NamedTuple):
    """A matrix with its top eigenpairs deflated to the smallest of them."""

    matrix: jax.Array  # A_d = A − Σ (λ_i − λ_k)·v_i·v_iᵀ
    undeflated: jax.Array  # A
    eigenvalues: jax.Array  # (k,) λ_i
    vectors: jax.Array  # (n, k) v_i
    smallest: jax.Array  # λ_k


def _deflation(work: jax.Array, k: int, iterations: int) -> _Deflation:
    """A with its k largest eigenpairs (LOBPCG) lowered to the k-th."""
    eigenvalues, vectors = _top_eigenpairs(work, k, iterations)
    smallest = jnp.min(eigenvalues)
    deflation = jnp.sqrt(eigenvalues - smallest) * vectors
    deflated = work - _matmul(deflation, deflation.T, lax.Precision.HIGHEST)
    return _Deflation(deflated, work, eigenvalues, vectors, smallest)


def _coupled_newton(damped, p: int, num_iters: int, error_tolerance, precision):
    """(H, e): the coupled Newton iteration for A'^{-1/p} (``damped`` = A'),
    stopped at e = max|M − I| <= ``error_tolerance``, ``num_iters`` steps, or a
    rise of e by more than DIVERGENCE_FACTOR (then the previous H)."""
    identity = jnp.eye(damped.shape[-1], dtype=damped.dtype)
    z = (1 + p) / (2 * jnp.linalg.norm(damped))
    m0 = z * damped
    h0 = z ** (1.0 / p) * identity
    e0 = jnp.max(jnp.abs(m0 - identity))

    def keep_going(carry):
        i, _, _, error, improving = carry
        return (i < num_iters) & (error > error_tolerance) & improving

    def step(carry):
        i, m, h, error, _ = carry
        t = (1 + 1.0 / p) * identity - m / p
        new_m = _matmul(_matrix_power(t, p, precision), m, precision)
        new_error = jnp.max(jnp.abs(new_m - identity))
        improving = new_error < DIVERGENCE_FACTOR * error
        # A diverging step ends the loop without updating H, so no copy of the
        # previous H is carried through every iteration.
        new_h = jnp.where(improving, _matmul(h, t, precision), h)
        return i + 1, new_m, new_h, new_error, improving

    carry = (0, m0, h0, e0, jnp.asarray(True))
    _, m, root, _, _ = lax.while_loop(keep_going, step, carry)
    return root, jnp.max(jnp.abs(m - identity)).astype(jnp.float32)


def _inflated(root, deflated: _Deflation, ridge, p: int):
    """(H, e): the root of the deflated matrix with its top eigenpairs restored,
    H = H_d − Σ ((ε'+λ_k)^{-1/p} − (ε'+λ_i)^{-1/p})·v_i·v_iᵀ, and its error
    max|H^p·(A + ε'I) − I| on the undeflated A."""
    gap = _inverse_root_gap(ridge, deflated.smallest, deflated.eigenvalues, p)
    inflation = jnp.sqrt(gap) * deflated.vectors
    root = root - _matmul(inflation, inflation.T, lax.Precision.HIGHEST)
    identity = jnp.eye(root.shape[-1], dtype=root.dtype)
    residual = _matmul(
        _matrix_power(root, p, lax.Precision.HIGHEST),
        deflated.undeflated + ridge * identity,
        lax.Precision.HIGHEST,
    )
    return root, jnp.max(jnp.abs(residual - identity)).astype(jnp.float32)


def matrix_inverse_pth_root_eigh(
    matrix: jax.Array,
    p: int,
    ridge_epsilon: float = 1e-6,
    precision=lax.Precision.HIGHEST,
    relative_matrix_epsilon: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """(A + ε'I)^{-1/p} by an eigendecomposition, ε' = ε·max(λ_max, 1e-6) (ε'
    = ε with ``relative_matrix_epsilon=False``).

    A = U·diag(λ)·Uᵀ gives H = U·diag((max(λ, 0) + ε')^{-1/p})·Uᵀ (rounding can
    make the smallest λ slightly negative; they are clipped at 0). Slower than
    the Newton iteration on accelerators, but exact up to rounding at any
    condition number. Runs in float64 when x64 is enabled; entries above 2^32
    are scaled down by a power of two first, as in :func:`matrix_inverse_pth_root`.

    Args:
        matrix: (n, n) symmetric PSD matrix.
        p: the root, a static Python int >= 1.
        ridge_epsilon: ε of the ridge ε'.
        precision: ``lax.Precision`` of the matrix products.
        relative_matrix_epsilon: the ridge is ε·max(λ_max, 1e-6) (True) or ε (False).

    Returns:
        (H, e): the root in ``matrix.dtype`` and the decomposition's relative
        residual e = max|U·diag(λ)·Uᵀ − A| / max(λ_max, 1e-30) (float32; NaN when
        A is not finite). Unlike max|H^p·A − I|, e does not grow with the
        condition number, so a correct root of an ill-conditioned A passes.

    Example: diag(4, 9)^{-1/2} = diag(1/2, 1/3).

        >>> A = jnp.diag(jnp.array([4.0, 9.0]))
        >>> root, error = matrix_inverse_pth_root_eigh(A, 2, ridge_epsilon=0.0)
        >>> [round(float(x), 4) for x in jnp.diag(root)], bool(error < 1e-6)
        ([0.5, 0.3333], True)
    """
    work, exponent = _scaled_down(matrix.astype(root_dtype()))
    eigenvalues, vectors = eigh(work)
    ridge = _relative_ridge(ridge_epsilon, eigenvalues[-1], relative_matrix_epsilon)
    scales = (jnp.maximum(eigenvalues, 0) + ridge) ** (-1.0 / p)
    root = _scaled_up(_matmul(vectors * scales, vectors.T, precision), exponent, p)
    rebuilt = _matmul(vectors * eigenvalues, vectors.T, precision)
    error = jnp.max(jnp.abs(rebuilt - work)) / jnp.maximum(eigenvalues[-1], 1e-30)
    return root.astype(matrix.dtype), error.astype(jnp.float32)


class QuantizedArray(NamedTuple):
    """A float array stored as int8/int16 with one float32 scale per column.

    ``dequantize`` gives values·scales (+ diag(diagonal)). Symmetric matrices keep
    their diagonal apart in float32 (it dominates and would waste the range).

    Attributes:
        values: (..., m, n) int8 or int16.
        scales: (..., n) float32: max|column| / 127 or / 32767.
        diagonal: (..., n) float32, or None.
    """

    values: jax.Array  # (..., m, n) int8 or int16
    scales: jax.Array  # (..., n) float32: max |column| / 127 or / 32767
    diagonal: jax.Array | None  # (..., n) float32, or None


def quantize(x: jax.Array, dtype, *, extract_diagonal: bool = False) -> QuantizedArray:
    """Symmetric per-column quantization of ``x`` (rank >= 2) to int8 or int16.

    scale_j = max_i |x_ij| / q_max (q_max = 127 or 32767; a zero column gets scale
    1) and q_ij = round(x_ij / scale_j), so |q·scale − x| <= scale/2 entrywise.
    With ``extract_diagonal`` (square matrices) the diagonal is kept exactly in
    float32 and only the off-diagonal part is quantized.
    """
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    diagonal = None
    if extract_diagonal:
        diagonal = jnp.diagonal(x, axis1=-2, axis2=-1)
        x = x - diagonal[..., None] * jnp.eye(x.shape[-1], dtype=x.dtype)
    scales = jnp.max(jnp.abs(x), axis=-2) / _QUANTIZED_MAX[dtype]
    scales = jnp.where(scales == 0, 1.0, scales)
    values = jnp.round(x / scales[..., None, :]).astype(dtype)
    return QuantizedArray(values, scales, diagonal)


def dequantize(q: QuantizedArray) -> jax.Array:
    """The float32 array that ``q`` stores."""
    x = q.values.astype(jnp.float32) * q.scales[..., None, :]
    if q.diagonal is not None:
        x = x + q.diagonal[..., None] * jnp.eye(x.shape[-1], dtype=x.dtype)
    return x
