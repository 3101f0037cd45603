"""Shampoo's matrix kernels in torch: inverse p-th roots of (B, n, n) stacks.

The torch mirror of ``precond.jax.shampoo._math`` (the same definitions, batched
over a stack of equal statistics instead of vmapped): the top eigenvalue by
power iteration, the inverse p-th root by the coupled Newton iteration or by an
eigendecomposition, each with the relative ridge ε·max(λ_max, 1e-6) and the
power-of-two rescaling of huge statistics. Every entry of a stack iterates as it
would alone: an entry whose loop has stopped keeps its values while the others
go on. Symbols: ``A`` a statistic, ``H ≈ (A + ε'I)^{-1/p}``, ``M = H^p·(A + ε'I)``.

References:
    N. J. Higham, *Functions of Matrices*, SIAM 2008, §7.3 (coupled Newton).
    R. Anil et al., *Scalable Second Order Optimization for Deep Learning*, 2020.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# The relative ridge is ε·max(λ_max, LAMBDA_FLOOR).
LAMBDA_FLOOR = 1e-6
# A Newton step that raises the error by more than this factor has diverged.
DIVERGENCE_FACTOR = 1.2
# Statistics with an entry above this are rooted as A/2^k (see _scaled_down).
LARGEST_UNSCALED = 2.0**32
NEWTON_ITERATIONS, NEWTON_TOLERANCE = 100, 1e-6
POWER_ITERATIONS, POWER_TOLERANCE = 100, 1e-6


@functools.cache
def _power_start(n: int) -> np.ndarray:
    """The fixed start vector of the power iteration (JAX's: uniform in [-1, 1]
    from ``default_rng(1729)``), so both frameworks iterate alike."""
    return np.random.default_rng(1729).uniform(-1.0, 1.0, n)


def _matrix_power(x: torch.Tensor, p: int) -> torch.Tensor:
    """x^p for an integer p >= 1 by repeated squaring (JAX's order of products)."""
    result, square = None, x
    while True:
        if p & 1:
            result = square if result is None else result @ square
        p >>= 1
        if not p:
            assert result is not None
            return result
        square = square @ square


def _unit(v: torch.Tensor) -> torch.Tensor:
    """Each row v/‖v‖, or v where ‖v‖ = 0."""
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    return v / torch.where(norm > 0, norm, torch.ones_like(norm))


def top_eigenvalues(stack: torch.Tensor) -> torch.Tensor:
    """(B,) λ_max of each symmetric PSD matrix of ``stack`` by power iteration:
    v ← A·v/‖A·v‖, λ = vᵀA·v, until λ moves by at most 1e-6 or 100 iterations."""
    batch, n = stack.shape[0], stack.shape[-1]
    v = torch.as_tensor(_power_start(n), dtype=stack.dtype, device=stack.device)
    v = v.expand(batch, n).clone()
    eigenvalue = torch.zeros(batch, dtype=stack.dtype, device=stack.device)
    active = torch.ones(batch, dtype=torch.bool, device=stack.device)
    for _ in range(POWER_ITERATIONS):
        u = _unit(v)
        av = (stack @ u.unsqueeze(-1)).squeeze(-1)
        new_eigenvalue = (u * av).sum(-1)
        moving = (new_eigenvalue - eigenvalue).abs() > POWER_TOLERANCE
        v = torch.where(active[:, None], av, v)
        eigenvalue = torch.where(active, new_eigenvalue, eigenvalue)
        active = active & moving
        if not bool(active.any()):
            break
    return eigenvalue


def _scaled_down(work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A/2^k, k) per entry: k = ⌊log₂ max|A|⌋ where max|A| > 2^32, else 0
    (exact, and the relative ridge is unchanged by it)."""
    largest = work.abs().amax(dim=(-2, -1))
    huge = torch.isfinite(largest) & (largest > LARGEST_UNSCALED)
    safe = torch.where(huge, largest, torch.ones_like(largest))
    exponent = torch.where(huge, torch.floor(torch.log2(safe)), torch.zeros_like(safe))
    exponent = exponent.to(torch.int32)
    return torch.ldexp(work, -exponent[:, None, None].to(work.dtype)), exponent


def _scaled_up(root: torch.Tensor, exponent: torch.Tensor, p: int) -> torch.Tensor:
    """2^{-k/p}·root: undoes :func:`_scaled_down` on a root."""
    return root * torch.exp2(-exponent.to(root.dtype) / p)[:, None, None]


def _ridge(ridge_epsilon: float, top: torch.Tensor, relative: bool) -> torch.Tensor:
    """ε·max(λ_max, 1e-6), or ε (``relative=False``)."""
    if not relative:
        top = torch.ones_like(top)
    return ridge_epsilon * torch.clamp(top, min=LAMBDA_FLOOR)


def inverse_pth_roots_newton(
    stack: torch.Tensor, p: int, ridge_epsilon: float, relative: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, n, n) roots, (B,) errors): (A + ε'I)^{-1/p} of each matrix by the
    coupled Newton iteration, as ``precond.jax.shampoo._math.
    matrix_inverse_pth_root``: z = (1+p)/(2‖A'‖_F), M = z·A', H = z^{1/p}·I, then
    T = (1 + 1/p)·I − M/p, M ← T^p·M, H ← H·T while e = max|M − I| > 1e-6 (at most
    100 times), stopping without updating H when e rises by more than 1.2×."""
    n = stack.shape[-1]
    work, exponent = _scaled_down(stack)
    top = top_eigenvalues(work) if relative else torch.ones_like(work[:, 0, 0])
    ridge = _ridge(ridge_epsilon, top, relative)
    if n == 1:
        root = (work + ridge[:, None, None]) ** (-1.0 / p)
        return _scaled_up(root, exponent, p), torch.zeros_like(ridge)
    identity = torch.eye(n, dtype=work.dtype, device=work.device)
    damped = work + ridge[:, None, None] * identity
    z = (1 + p) / (2 * torch.linalg.matrix_norm(damped))
    m = z[:, None, None] * damped
    h = (z ** (1.0 / p))[:, None, None] * identity
    error = (m - identity).abs().amax(dim=(-2, -1))
    active = error > NEWTON_TOLERANCE
    for _ in range(NEWTON_ITERATIONS):
        if not bool(active.any()):
            break
        t = (1 + 1.0 / p) * identity - m / p
        new_m = _matrix_power(t, p) @ m
        new_error = (new_m - identity).abs().amax(dim=(-2, -1))
        improving = new_error < DIVERGENCE_FACTOR * error
        h = torch.where((active & improving)[:, None, None], h @ t, h)
        m = torch.where(active[:, None, None], new_m, m)
        error = torch.where(active, new_error, error)
        active = active & improving & (new_error > NEWTON_TOLERANCE)
    error = (m - identity).abs().amax(dim=(-2, -1))
    return _scaled_up(h, exponent, p), error


def inverse_pth_roots_eigh(
    stack: torch.Tensor, p: int, ridge_epsilon: float, relative: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, n, n) roots, (B,) errors): U·diag((max(λ, 0) + ε')^{-1/p})·Uᵀ from
    A = U·diag(λ)·Uᵀ, ε' = ε·max(λ_max, 1e-6); the error is the decomposition's
    relative residual max|U·diag(λ)·Uᵀ − A| / max(λ_max, 1e-30) (NaN for a
    non-finite A), as ``matrix_inverse_pth_root_eigh``."""
    work, exponent = _scaled_down(stack)
    finite = torch.isfinite(work).all(dim=(-2, -1))
    # torch's eigh raises on NaN; such entries are reported as failed.
    safe = torch.where(finite[:, None, None], work, torch.zeros_like(work))
    eigenvalues, vectors = torch.linalg.eigh(safe)
    top = eigenvalues[:, -1]
    ridge = _ridge(ridge_epsilon, top, relative)
    scales = (torch.clamp(eigenvalues, min=0) + ridge[:, None]) ** (-1.0 / p)
    root = (vectors * scales[:, None, :]) @ vectors.transpose(-2, -1)
    rebuilt = (vectors * eigenvalues[:, None, :]) @ vectors.transpose(-2, -1)
    error = (rebuilt - work).abs().amax(dim=(-2, -1)) / torch.clamp(top, min=1e-30)
    error = torch.where(finite, error, torch.full_like(error, float("nan")))
    return _scaled_up(root, exponent, p), error
