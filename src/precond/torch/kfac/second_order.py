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
        assert d_g is not None
        assert d_a is not None
        assert damping is not None
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
    exponents: list[int] | None = None,
) -> float:
    """ν = min(1, √(κ / |Σ_ℓ lr² ⟨P_ℓ, ∇_ℓ⟩|)) with P_ℓ = 2^e_ℓ·``preconditioned[ℓ]``
    and ∇_ℓ = 2^e_ℓ·``grads[ℓ]`` (e_ℓ = ``exponents[ℓ]``, default 0); 1 when the sum
    is 0 or not finite (a non-finite gradient then stays in its own layer instead
    of spreading).

    Scale-safe: each ⟨·,·⟩ is summed in float64 and the powers of two are kept
    apart from it, so ν is right (and clips) even where Σ lr²⟨P, ∇⟩ overflows
    float32, or float64.
    """
    if not preconditioned or lr == 0.0:
        return 1.0
    if exponents is None:
        exponents = [0] * len(preconditioned)
    # Each tensor x is summed as 2^-e x (2^(e-1) ≤ max|x| < 2^e, exact), so the
    # float64 products cannot overflow; u_ℓ carries the power 2^f_ℓ apart.
    pairs = [
        (p.to(torch.float64), g.to(device=p.device, dtype=torch.float64))
        for p, g in zip(preconditioned, grads, strict=True)
    ]
    maxima = torch.stack(
        [
            t.abs().amax() if t.numel() else t.new_zeros(())
            for pair in pairs
            for t in pair
        ]
    ).tolist()
    if not all(math.isfinite(m) for m in maxima):
        return 1.0
    shifts = [math.frexp(m)[1] for m in maxima]
    inner = torch.stack(
        [
            (
                torch.ldexp(p, p.new_tensor(-sp)) * torch.ldexp(g, g.new_tensor(-sg))
            ).sum()
            for (p, g), sp, sg in zip(pairs, shifts[0::2], shifts[1::2], strict=True)
        ]
    ).tolist()
    powers = [
        2 * e + sp + sg
        for e, sp, sg in zip(exponents, shifts[0::2], shifts[1::2], strict=True)
    ]
    # Σ_ℓ u_ℓ 2^f_ℓ = 2^F Σ_ℓ u_ℓ 2^(f_ℓ − F): no overflow for any powers.
    top = max(powers)
    terms = zip(inner, powers, strict=True)
    total = abs(sum(math.ldexp(u, f - top) for u, f in terms))
    if total == 0.0 or not math.isfinite(total):
        return 1.0
    # ν = √(κ / total) / lr · 2^(−F/2), in logs: every factor may be out of range.
    log_nu = 0.5 * (math.log(kl_clip) - math.log(total)) - math.log(lr)
    log_nu -= 0.5 * top * math.log(2.0)
    return 1.0 if log_nu >= 0.0 else math.exp(log_nu)
