"""The pieces of one Shampoo step in torch, as ``precond.jax.shampoo._update``
defines them: the statistics' EMA, the inverse roots of every due statistic
(batched over stacks of equal ones), the grafting direction, the grafted
Shampoo direction and the two momenta with Nesterov."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from precond.torch.shampoo._arguments import GraftingType
from precond.torch.shampoo._math import (
    inverse_pth_roots_eigh,
    inverse_pth_roots_newton,
)

# State keys of each parameter (besides the step count).
MOMENTUM, GRAFT_MOMENTUM = "momentum", "diagonal_momentum"
DIAGONAL, STATISTICS, ROOTS = "diagonal_statistics", "statistics", "preconditioners"
# Guard added to the norms of the grafted direction and of normalized gradients.
NORM_GUARD = 1e-16


def has_diagonal_statistics(group: dict[str, Any]) -> bool:
    return int(group["graft_type"]) not in (GraftingType.SGD, GraftingType.SQRT_N)


def has_graft_momentum(group: dict[str, Any]) -> bool:
    """A grafting momentum of its own: all but SQRT_N (which shares the
    momentum) unless ``separate_grafting_momentum``."""
    return (
        int(group["graft_type"]) != GraftingType.SQRT_N
        or group["separate_grafting_momentum"]
    )


def statistics_weight(beta2: float) -> float:
    """Weight of the new gram in the EMA: 1 − β2, or 1 when β2 = 1 (a sum)."""
    return 1.0 if beta2 == 1.0 else 1.0 - beta2


def update_statistics(statistics: list, grams: list, beta2: float) -> None:
    """S ← β2·S + c·gram in place, per statistic; a block whose new S is not
    finite (an overflowing sum) keeps its previous one."""
    c = statistics_weight(beta2)
    for old, gram in zip(statistics, grams, strict=True):
        new = beta2 * old + c * gram
        finite = torch.isfinite(new).all(dim=(-2, -1))
        old.copy_(torch.where(finite[:, None, None], new, old))


def refresh_roots(due: list[tuple[dict, dict, int]]) -> None:
    """New inverse roots of the ``due`` (group, parameter state, exponent)
    entries, every (size, exponent, kernel) stack computed in one batched call;
    a root whose error is NaN or >= ``inverse_failure_threshold``, or that is
    not finite, is not used (the previous one stays)."""
    stacks: dict[tuple, list] = defaultdict(list)
    for group, state, p in due:
        for i, stats in enumerate(state[STATISTICS]):
            key = (
                stats.shape[-1],
                p,
                stats.dtype,
                stats.device,
                group["eigh"],
                group["relative_matrix_epsilon"],
                group["matrix_epsilon"],
            )
            stacks[key].append((group, state, i))
    for (_, p, _, _, eigh, relative, epsilon), members in stacks.items():
        batch = torch.cat([state[STATISTICS][i] for _, state, i in members])
        kernel = inverse_pth_roots_eigh if eigh else inverse_pth_roots_newton
        roots, errors = kernel(batch, p, epsilon, relative)
        finite = torch.isfinite(roots).all(dim=(-2, -1))
        start = 0
        for group, state, i in members:
            old = state[ROOTS][i]
            end = start + old.shape[0]
            error = errors[start:end]
            kept = finite[start:end] & torch.isfinite(error)
            kept &= error < group["inverse_failure_threshold"]
            old.copy_(torch.where(kept[:, None, None], roots[start:end], old))
            start = end


def grafting_direction(
    g: torch.Tensor, diagonal: torch.Tensor | None, group: dict[str, Any]
) -> torch.Tensor:
    """u_g, the first-order step whose norm Shampoo borrows; the AdaGrad or
    RMSProp accumulator ``diagonal`` is updated in place."""
    kind = int(group["graft_type"])
    if kind == GraftingType.SGD:
        return g
    if kind == GraftingType.SQRT_N:
        return torch.sign(g)
    assert diagonal is not None
    if kind in (GraftingType.ADAGRAD_NORMALIZED, GraftingType.RMSPROP_NORMALIZED):
        g = g / (torch.linalg.vector_norm(g) + NORM_GUARD)
    if kind in (GraftingType.ADAGRAD, GraftingType.ADAGRAD_NORMALIZED):
        diagonal.add_(g.square())
    else:
        beta2 = group["beta2"]
        diagonal.copy_(beta2 * diagonal + statistics_weight(beta2) * g.square())
    direction = g / (diagonal.sqrt() + group["diagonal_epsilon"])
    clip = group["clip_by_scaled_gradient_norm"]
    if clip is not None and kind in (
        GraftingType.RMSPROP,
        GraftingType.RMSPROP_NORMALIZED,
    ):
        scaled = torch.linalg.vector_norm(direction) / math.sqrt(max(g.numel(), 1))
        direction = direction / torch.clamp(scaled / clip, min=1.0)
    return direction


def safe_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖₂ as max|x|·‖x/max|x|‖ (no overflow of the sum of squares)."""
    if not x.numel():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    largest = x.abs().amax()
    scale = torch.where(largest > 0, largest, torch.ones_like(largest))
    return scale * torch.linalg.vector_norm(x / scale)


def grafted(
    direction: torch.Tensor, graft: torch.Tensor, weight, group: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_s, u_g): u_s = P(G)·‖u_g‖/(‖P(G)‖ + 1e-16), both plus λ·W when the
    weight decay is coupled (``weight`` is W, or None without decay)."""
    scale = torch.linalg.vector_norm(graft) / (safe_norm(direction) + NORM_GUARD)
    shampoo = direction * scale
    if weight is not None and not group["decoupled_weight_decay"]:
        decay = group["weight_decay"]
        shampoo = shampoo + decay * weight
        graft = graft + decay * weight
    return shampoo, graft


def momentum_step(
    shampoo: torch.Tensor,
    graft: torch.Tensor,
    state: dict[str, Any],
    running: bool,
    group: dict[str, Any],
) -> torch.Tensor:
    """v, with the momenta updated in place: m_s ← β1·m_s + w·u_s and
    m_g ← β1·m_g + w·u_g (SQRT_N without a grafting momentum: m_g from m_s, and
    the one buffer keeps the momentum in use); u, m are Shampoo's once
    ``running`` (t >= start_preconditioning_step), the grafting's before;
    v = w·u + β1·m (Nesterov) or m, w = 1 − β1 with
    ``moving_average_for_momentum``, else 1."""
    beta1 = group["beta1"]
    w = (1.0 - beta1) if group["moving_average_for_momentum"] else 1.0
    old = state[MOMENTUM]
    momentum = beta1 * old + w * shampoo
    separate = GRAFT_MOMENTUM in state
    graft_momentum = beta1 * (state[GRAFT_MOMENTUM] if separate else old) + w * graft
    mixed_momentum = momentum if running else graft_momentum
    mixed = shampoo if running else graft
    v = w * mixed + beta1 * mixed_momentum if group["nesterov"] else mixed_momentum
    if separate:
        old.copy_(momentum)
        state[GRAFT_MOMENTUM].copy_(graft_momentum)
    else:
        old.copy_(mixed_momentum)
    return v
