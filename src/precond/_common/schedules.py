"""Hyperparameter schedules shared by both frameworks (arguments checked here once)."""

from __future__ import annotations

from precond._common.validation import check_real


def check_update_prob_schedule(
    max_prob: float, min_prob: float, decay: float, flat_start: float
) -> None:
    """Checks the arguments of PSGD's preconditioner-update-probability schedule
    p(n) = clip(max_prob·exp(−decay·(n − flat_start)), min_prob, max_prob)."""
    check_real("max_prob", max_prob, low=0.0, high=1.0)
    check_real("min_prob", min_prob, low=0.0, high=1.0)
    check_real("decay", decay, low=0.0)
    check_real("flat_start", flat_start, low=0.0)
    if min_prob > max_prob:
        raise ValueError(
            f"Invalid min_prob={min_prob!r}: must be <= max_prob={max_prob!r}"
        )
