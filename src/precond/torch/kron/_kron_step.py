"""The pieces of Kron's step on a bucket (equal-shaped parameters whose factors
and momenta are kept in (B, ...) stacks): the momentum, the fit's schedule and
its generation-2 variant, the overflow guard of a fit, the preconditioned and
clipped update; then the updates' clipping and addition to the parameters."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from precond._common.kron_constants import MAX_UPDATE_RMS
from precond.torch._core import factor_kernels as km
from precond.torch._core.dtensor import full_value, local_part, local_value
from precond.torch._core.step_policy import count_step, finite_entries, fit_due
from precond.torch._core.tensors import as_dtype, as_shape, scalar
from precond.torch.kron._kron_state import (
    LIPSCHITZ,
    MOMENTUM,
    STEP,
    cache_layout,
    gram_of,
)
from precond.torch.kron.schedule import scheduled_probability


def factor_update(compile_kernels: bool) -> Callable:
    """The fit, ``torch.compile``'d if asked: one compile per stack shape, then
    fused code (compiling the preconditioning, batched matmuls, gains nothing)."""
    if compile_kernels:
        return torch.compile(km.update_factors, dynamic=False)
    return km.update_factors


def stacked(tensors, dtype: torch.dtype, shape) -> torch.Tensor:
    """The tensors in ``dtype``, each reshaped to ``shape``, stacked: (B, *shape)."""
    return torch.stack([as_shape(as_dtype(t, dtype), shape) for t in tensors])


def momentum_step(
    bucket,
    states,
    momenta: torch.Tensor,
    shape,
    dtype: torch.dtype,
    all_grads: dict[int, torch.Tensor],
) -> torch.Tensor:
    """Counts the step and updates the bucket's stack of momenta,
    m ← β₁m + (1−β₁)g; returns the stack of m̂ = m/(1−β₁ⁿ) (of g when β₁ = 0) in
    ``dtype`` and ``shape``. With ``store_debiased_momentum`` (kron-torch
    0.1.0), m ← m̂."""
    group = bucket[0][0]
    b1 = group["b1"]
    count_step(states)
    # Each state's momentum is its entry's view of ``momenta``: one fused
    # call updates the stack without first copying the gradients into one.
    grads = [
        as_shape(as_dtype(all_grads[index], momenta.dtype), momenta.shape[1:])
        for _, _, index in bucket
    ]
    torch._foreach_lerp_(  # pyright: ignore[reportPrivateImportUsage]
        [state[MOMENTUM] for state in states], grads, 1 - b1
    )
    # With β₁ = 0 the lerp set m = g exactly, and m̂ = m/1.
    correction = 1 - b1 ** states[0][STEP] if b1 > 0 else 1.0
    stacked_shape = (len(bucket), *shape)
    mu_hat = as_dtype(as_shape(momenta, stacked_shape), dtype) / correction
    if group["store_debiased_momentum"]:
        momenta.copy_(mu_hat.reshape(momenta.shape))
    return mu_hat


def update_due(bucket, states, draws: dict | None) -> bool:
    """Whether the factors are fitted this step (the step policy's
    :func:`fit_due`): once 1/p(n) steps have passed (a seed), or by
    ``seed=None``'s draw."""
    if draws is not None:
        return fit_due(states, drawn=draws[bucket[0][2]][0])
    return fit_due(states, scheduled_probability(bucket[0][0], states[0][STEP]))


def fit_gen2(group, states, factors, target, noise, mu_hat):
    """One 'QUAD', 'PRO' or 'QEQ' fit (``update_factors_gen2``) to the target with
    relative damping noise, towards whitening targets; returns (factors,
    stacked Lipschitz estimates)."""
    lipschitz = [
        torch.stack([s[LIPSCHITZ][axis] for s in states])
        for axis in range(len(factors))
    ]
    valid = [
        torch.ones(d, dtype=torch.bool, device=mu_hat.device) for d in mu_hat.shape[1:]
    ]
    targets = km.whitening_targets(valid, [km.is_diagonal(Q) for Q in factors])
    return km.update_factors_gen2(
        factors,
        lipschitz,
        km.add_relative_damping_noise(target, noise),
        targets,
        group["precond_lr"],
        group["preconditioner_update_style"],
    )


def keep_finite_fits(states, stacks, new, lipschitz) -> list[torch.Tensor]:
    """The fitted state arrays, but for a stack entry whose fit overflowed (a
    usable but large gradient met by large factors), which keeps its old ones:
    decided on the device, without a host sync. Selected in place into the
    bucket's ``stacks`` (the factors) and ``states`` (the Lipschitz estimates);
    returns the factors in ``new``'s (working) dtype."""
    fitted = finite_entries(new + lipschitz)
    for stack, F in zip(stacks.factors, new, strict=True):
        # F holds values of the stack's dtype (``stored``): its cast is exact.
        F_stored = as_dtype(F, stack.dtype)
        torch.where(km._expand(fitted, F_stored), F_stored, stack, out=stack)
    for i, state in enumerate(states):
        for axis, L in enumerate(lipschitz):
            estimate = state[LIPSCHITZ][axis]
            estimate.copy_(torch.where(fitted[i], L[i], estimate))
    return [
        as_dtype(stack, F.dtype) for stack, F in zip(stacks.factors, new, strict=True)
    ]


def preconditioned(stored_factors, mu_hat, group) -> torch.Tensor:
    """U = (⊗_i Q_iᴴQ_i)·m̂ for the stack (with the cached P_i = Q_iᴴQ_i where
    the layout keeps them); with ``update_clipping='rms'``, U / max(1, RMS/1.1)
    per tensor."""
    cache = cache_layout(group)
    if cache is None:
        U = km.precondition(stored_factors, mu_hat)
    else:  # U = G ×_1 P_1 … ×_k P_k
        U = km.apply_along_axes([gram_of(F, cache) for F in stored_factors], mu_hat)
    if group["update_clipping"] == "rms":
        squares = U.abs().square() if U.is_complex() else U.square()
        rms = squares.reshape(U.shape[0], -1).mean(dim=1).sqrt()
        U = U / torch.clamp(rms / MAX_UPDATE_RMS, min=1.0).reshape(
            (-1,) + (1,) * (U.ndim - 1)
        )
    return U


def foreach_add_to_params(members, steps, alpha: float) -> None:
    """θ ← θ + alpha·step for each (group, θ, _) of ``members`` (on this rank's
    shard of a DTensor θ), in θ's dtype."""
    torch._foreach_add_(  # pyright: ignore[reportPrivateImportUsage]
        [local_value(p) for _, p, _ in members],
        [
            as_dtype(local_part(p, u), p.dtype)
            for (_, p, _), u in zip(members, steps, strict=True)
        ],
        alpha=alpha,
    )


def apply_updates(entries, updates) -> None:
    """θ ← θ − lr·(clipped update with weight decay), per group's
    ``update_clipping`` (see ``Kron``'s docstring); one ``_foreach`` call per
    stage and group."""
    by_group: dict[int, list] = defaultdict(list)
    for (group, p, _), update in zip(entries, updates, strict=True):
        by_group[id(group)].append((group, p, update))
    for members in by_group.values():
        group = members[0][0]
        lr, decay = scalar(group["lr"]), group["weight_decay"]
        if group["update_clipping"] == "rms":
            local = [local_value(p) for _, p, _ in members]
            torch._foreach_mul_(  # pyright: ignore[reportPrivateImportUsage]
                local, 1 - lr * decay
            )
            foreach_add_to_params(members, [u for _, _, u in members], -lr)
        else:
            _apply_norm_and_value_clipped(members, lr, decay)


def _apply_norm_and_value_clipped(members, lr: float, decay: float) -> None:
    """kron-torch 0.1.0's rule as it runs: each entry of the updates U + λθ
    clamped to [-1, 1] (on the whole tensors: a DTensor θ is gathered for
    the decay term). Its global norm clip is a no-op (``Kron``'s docstring)."""
    steps = [update for _, _, update in members]
    if decay != 0:
        steps = torch._foreach_add(  # pyright: ignore[reportPrivateImportUsage]
            steps,
            [as_dtype(full_value(p), u.dtype) for (_, p, u) in members],
            alpha=decay,
        )
    # Complex entries: the real and imaginary parts each.
    real = [torch.view_as_real(u) if u.is_complex() else u for u in steps]
    torch._foreach_clamp_min_(real, -1.0)  # pyright: ignore[reportPrivateImportUsage]
    torch._foreach_clamp_max_(real, 1.0)  # pyright: ignore[reportPrivateImportUsage]
    foreach_add_to_params(members, steps, -lr)
