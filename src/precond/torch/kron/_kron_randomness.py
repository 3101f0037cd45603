"""Kron's random draws: with a seed, the balancing draw and the noise V are
functions of (seed, step, parameter index), the same on every rank and in every
resumed run; with ``seed=None``, kron-torch 0.1.0's draws from torch's global
generator, in its order."""

from __future__ import annotations

import torch

from precond._common.kron_constants import BALANCE_PROBABILITY
from precond.torch._core import factor_kernels as km
from precond.torch._core.step_policy import seeded_generator
from precond.torch.kron._kron_state import FACTORS, STEP, state_dtypes
from precond.torch.kron.schedule import scheduled_probability


def balance_draw(seed: int, step: int) -> float:
    """Uniform [0, 1) draw of step ``step``; the factors are balanced when it is
    below 0.01. A function of (seed, step) only: every rank draws the same. Drawn
    on the CPU, so a GPU step does not wait for it."""
    generator = seeded_generator(torch.device("cpu"), seed, step, -1)
    return float(torch.rand((), generator=generator))


def unit_noise(shape, seed: int, step: int, index: int, dtype, device) -> torch.Tensor:
    """V ~ N(0, I) for parameter ``index`` (its position in the optimizer) at
    ``step``: the same on every rank and however parameters are bucketed."""
    generator = seeded_generator(device, seed, step, index)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)


def seeded_randomness(seed: int, bucket, states, factors, mu_hat):
    """(factors, V) of a seeded fit: the factors balanced when the step's
    :func:`balance_draw` is below 0.01, V from :func:`unit_noise` (both looked
    up at call time, so a test may replace them)."""
    step = states[0][STEP]
    if balance_draw(seed, step) < BALANCE_PROBABILITY:
        factors = km.balance_factors(factors)
    shape, dtype, device = mu_hat.shape[1:], mu_hat.dtype, mu_hat.device
    noise = torch.stack(
        [unit_noise(shape, seed, step, index, dtype, device) for _, _, index in bucket]
    )
    return factors, noise


def global_draws(param_groups: list[dict], state, entries) -> dict[int, tuple]:
    """``seed=None``: kron-torch 0.1.0's draws from torch's global generator,
    in its order. Per group: u ~ U[0, 1), update when u < p(n) or the
    factors are yet to be made;
    then, on an update, per parameter V ~ N(0, I) in the factor dtype and,
    for 2+ dims, a balancing draw. Returns {index: (update, V, balance)}."""
    present = {index: (group, p) for group, p, index in entries}
    draws: dict[int, tuple] = {}
    index = 0
    for group in param_groups:
        indices = range(index, index + len(group["params"]))
        index += len(group["params"])
        mine = [i for i in indices if i in present]
        if not mine:
            continue
        first = present[mine[0]][1]
        n = state[first].get(STEP, 0) + 1
        probability = scheduled_probability(group, n)
        # Always on the first step, as kron-torch creates its factors then
        # (also a resumed run's first step: 0.1.0 saves no factors).
        update = bool(torch.rand([]) < probability) or FACTORS not in (state[first])
        for i, p in zip(indices, group["params"], strict=True):
            noise = balance = None
            if update:
                dtype, _ = state_dtypes(p, group)
                noise = torch.randn(p.shape, dtype=dtype, device=p.device)
                balance = p.ndim > 1 and bool(torch.rand([]) < BALANCE_PROBABILITY)
            draws[i] = (update, noise, balance)
    return draws


def global_randomness(bucket, factors, mu_hat, draws: dict):
    """(factors, V) of a ``seed=None`` fit from :func:`global_draws`: the
    factors of the parameters whose balancing draw came up are balanced."""
    chosen = torch.tensor(
        [draws[index][2] for _, _, index in bucket], device=mu_hat.device
    )
    if chosen.any():
        balanced = km.balance_factors(factors)
        factors = [
            torch.where(km._expand(chosen, Q), B, Q)
            for Q, B in zip(factors, balanced, strict=True)
        ]
    shape = mu_hat.shape[1:]
    noise = torch.stack(
        [draws[index][1].to(mu_hat.dtype).reshape(shape) for _, _, index in bucket]
    )
    return factors, noise
