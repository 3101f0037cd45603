"""SOAP's kernels on stacks of equal blocks: X is (B, *block), a statistic S
and a basis Q of block axis k are (B, d, d). Paper notation; no state."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from precond.torch._core.blocks import along_each, gram


def project(X: torch.Tensor, axes: Sequence[int], bases: Sequence[torch.Tensor]):
    """X in the eigenbasis: G' = G ×_k Q_k for every axis with a basis."""
    return along_each(X, axes, bases)


def project_back(X: torch.Tensor, axes: Sequence[int], bases: Sequence[torch.Tensor]):
    """X back from the eigenbasis: U = N ×_k Q_kᵀ for every axis with a basis."""
    return along_each(X, axes, [Q.transpose(-1, -2) for Q in bases])


def accumulate(
    statistics: Sequence[torch.Tensor], G: torch.Tensor, axes: Sequence[int], beta
) -> None:
    """S_k ← β·S_k + (1−β)·G ⋅_{¬k} G, in place."""
    for S, k in zip(statistics, axes, strict=True):
        S.mul_(beta).add_(gram(G, k), alpha=1 - beta)


def descending_eigenvectors(S: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of each symmetric S, by descending eigenvalue. Where
    eigh fails to converge in S's precision (float32), it is taken in float64
    and cast back, as the authors' code falls back."""
    try:
        vectors = torch.linalg.eigh(S).eigenvectors
    except RuntimeError:  # torch.linalg.LinAlgError is one
        vectors = torch.linalg.eigh(S.double()).eigenvectors.to(S.dtype)
    if not bool(vectors.isfinite().all()):
        vectors = torch.linalg.eigh(S.double()).eigenvectors.to(S.dtype)
    return vectors.flip(-1)


def power_step(S: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One QR power step of each basis toward the eigenvectors of S: the
    eigenvalue estimates diag(QᵀSQ) sorted descending (a stable sort), Q's
    columns permuted by that order, Q ← qr(S·Q).Q. Returns (new Q, order),
    order (B, d) being the permutation the second moment must follow."""
    SQ = torch.bmm(S, Q)
    estimates = (Q * SQ).sum(dim=-2)
    order = torch.argsort(-estimates, dim=-1, stable=True)
    SQ = SQ.gather(-1, order.unsqueeze(-2).expand_as(SQ))
    return torch.linalg.qr(SQ).Q, order


def permute_axis(V: torch.Tensor, order: torch.Tensor, axis: int) -> torch.Tensor:
    """V's entries along block axis ``axis`` taken in ``order`` (B, d)."""
    shape = [order.shape[0]] + [1] * (V.dim() - 1)
    shape[axis + 1] = order.shape[1]
    return torch.take_along_dim(V, order.reshape(shape), dim=axis + 1)
