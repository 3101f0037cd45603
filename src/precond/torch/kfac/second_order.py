"""K-FAC's second-order math: factor decompositions, preconditioning, KL clipping.

Two compute methods, which damp differently (as KAISA's do):

* eigen: A = Q_A diag(d_A) Q_Aᵀ, G = Q_G diag(d_G) Q_Gᵀ (eigenvalues clamped at 0), and
  P = Q_G ((Q_Gᵀ ∇ Q_A) ⊘ (d_G d_Aᵀ + λ)) Q_Aᵀ, which is exactly (G ⊗ A + λI)⁻¹ vec ∇;
* inverse: P = (G + λI)⁻¹ ∇ (A + λI)⁻¹, i.e. (G + λI)⁻¹ ⊗ (A + λI)⁻¹ (λ per factor).

With ``prediv`` (KAISA's ``compute_eigenvalue_outer_product``) the inverse worker
stores D = 1 ⊘ (d_G d_Aᵀ + λ) with the damping of the inverse step, so gradient
workers need one product instead of an outer product, an add and a division.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "damped_inverse",
    "eigen_decomposition",
    "kl_clip_scale",
    "precondition_eigen",
    "precondition_inverse",
]


def eigen_decomposition(
    factor: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues clamped at 0, eigenvectors) of a symmetric factor, in ``dtype``."""
    values, vectors = torch.linalg.eigh(factor.to(dtype))
    return values.clamp(min=0), vectors


def damped_inverse(
    factor: torch.Tensor, damping: float, dtype: torch.dtype
) -> torch.Tensor:
    """(F + λI)⁻¹ in ``dtype``, symmetrised."""
    f = factor.to(dtype)
    eye = torch.eye(f.shape[0], dtype=dtype, device=f.device)
    inverse = torch.linalg.inv(f + damping * eye)
    return (inverse + inverse.T) / 2


def precondition_eigen(
    grad: torch.Tensor,
    q_a: torch.Tensor,
    q_g: torch.Tensor,
    *,
    d_a: torch.Tensor | None = None,
    d_g: torch.Tensor | None = None,
    damping: float | None = None,
    prediv: torch.Tensor | None = None,
) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ vec ∇ in the eigenbases: from ``prediv`` = 1 ⊘ (d_G d_Aᵀ + λ),
    or from ``d_a``, ``d_g`` and ``damping``."""
    rotated = q_g.T @ grad.to(q_a.dtype) @ q_a
    if prediv is None:
        rotated = rotated / (torch.outer(d_g, d_a) + damping)
    else:
        rotated = rotated * prediv
    return q_g @ rotated @ q_a.T


def precondition_inverse(
    grad: torch.Tensor, a_inverse: torch.Tensor, g_inverse: torch.Tensor
) -> torch.Tensor:
    """(G + λI)⁻¹ ∇ (A + λI)⁻¹."""
    return g_inverse @ grad.to(a_inverse.dtype) @ a_inverse


def kl_clip_scale(
    preconditioned: list[torch.Tensor],
    grads: list[torch.Tensor],
    lr: float,
    kl_clip: float,
) -> float:
    """ν = min(1, √(κ / |Σ_ℓ lr² ⟨P_ℓ, ∇_ℓ⟩|)); 1 when the sum is 0 or not finite
    (a non-finite gradient then stays in its own layer instead of spreading)."""
    if not preconditioned:
        return 1.0
    total = sum(
        (p * g.to(p.dtype)).sum() for p, g in zip(preconditioned, grads, strict=True)
    )
    total = abs(float(total)) * lr**2
    if total == 0.0 or not math.isfinite(total):
        return 1.0
    return min(1.0, math.sqrt(kl_clip / total))
