"""The preconditioner update probability of Kron and ProAdamW: the public
schedule (kron-torch 0.1.0's, bit for bit) and a param group's probability at a
step (a number, a function of the step, or None for the default schedule)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from precond._common.schedules import check_update_prob_schedule
from precond.torch._core.step_policy import probability_at

__all__ = ["precond_update_prob_schedule"]


def precond_update_prob_schedule(
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: float = 200,
) -> Callable[[int], float]:
    """p(n) = clip(max_prob·exp(−decay·(n − flat_start)), min_prob, max_prob) for
    the 1-based step n, in torch float32 arithmetic.

    The defaults are kron-torch 0.1.0's (p = 1 for 200 steps, then an anneal to
    0.03), and so are the values, bit for bit. With ``flat_start=500`` it is
    :func:`precond.jax.precond_update_prob_schedule` within 2 ulp (torch's and
    XLA's float32 exp round differently), so both frameworks update the
    preconditioner at the same steps (checked to 5000).

    Args:
        max_prob: the probability of the first ``flat_start`` steps, in [0, 1].
        min_prob: the floor the probability anneals to, in [0, ``max_prob``].
        decay: the rate of the exponential anneal (>= 0).
        flat_start: the steps before the anneal starts (>= 0).

    Returns:
        The schedule: a function of the 1-based step n returning p(n).

    Examples:
        >>> schedule = precond_update_prob_schedule()
        >>> [round(float(schedule(n)), 4) for n in (1, 200, 500, 1000)]
        [1.0, 1.0, 0.7408, 0.4493]
    """
    check_update_prob_schedule(max_prob, min_prob, decay, flat_start)
    low = torch.tensor(min_prob, dtype=torch.float32)
    high = torch.tensor(max_prob, dtype=torch.float32)

    def schedule(n: int) -> float:
        exponent = -decay * (torch.tensor(n, dtype=torch.float32) - flat_start)
        prob = torch.minimum(torch.maximum(max_prob * torch.exp(exponent), low), high)
        return prob.item()

    return schedule


_DEFAULT_SCHEDULE = precond_update_prob_schedule()


def scheduled_probability(group: dict[str, Any], step: int) -> float:
    """The group's preconditioner update probability at the 1-based ``step``."""
    probability: float | Callable[[int], float] | None = group[
        "preconditioner_update_probability"
    ]
    if probability is None:
        probability = _DEFAULT_SCHEDULE
    return probability_at(probability, step)
