"""``KFACParamScheduler``: step-wise decay of K-FAC's damping and update intervals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from precond._common.validation import check_int, check_real
from precond.torch.kfac.preconditioner import KFAC

__all__ = ["KFACParamScheduler"]


class KFACParamScheduler:
    """Multiplies K-FAC's damping by ``damping_alpha`` at each milestone of
    ``damping_schedule``, and its ``factor_update_steps`` and ``inv_update_steps``
    by ``update_freq_alpha`` (rounded down, at least 1) at each milestone of
    ``update_freq_schedule``.

    Milestones count calls of :meth:`step` (e.g. epochs), starting at
    ``start_step``: after ``step()`` brings the count to s, damping is
    base · damping_alpha^(number of milestones ≤ s), with base the value at
    construction. Call ``step()`` after ``preconditioner.step()``.

    Args:
        kfac: the :class:`~precond.torch.kfac.KFAC` preconditioner to schedule.
        damping_alpha: factor (> 0) applied to the damping at each of
            ``damping_schedule``'s milestones.
        damping_schedule: the milestones (counts of ``step()`` calls) of the
            damping; None or empty: the damping is left alone.
        update_freq_alpha: factor (> 0) applied to ``factor_update_steps`` and
            ``inv_update_steps`` at each of ``update_freq_schedule``'s milestones.
        update_freq_schedule: the milestones of the update intervals; None or
            empty: they are left alone.
        start_step: the count of ``step()`` calls to start from (e.g. the epoch
            a resumed run starts at).

    Example, the damping halved after the first epoch:
        >>> import torch
        >>> from precond.torch.kfac import KFAC
        >>> preconditioner = KFAC(torch.nn.Linear(4, 2), damping=0.003)
        >>> scheduler = KFACParamScheduler(
        ...     preconditioner, damping_alpha=0.5, damping_schedule=[1]
        ... )
        >>> scheduler.step()
        >>> preconditioner.damping
        0.0015
    """

    def __init__(
        self,
        kfac: KFAC,
        damping_alpha: float = 1,
        damping_schedule: Sequence[int] | None = None,
        update_freq_alpha: float = 1,
        update_freq_schedule: Sequence[int] | None = None,
        start_step: int = 0,
    ):
        if not isinstance(kfac, KFAC):
            raise TypeError(f"Invalid kfac={kfac!r}: must be a precond KFAC")
        check_real("damping_alpha", damping_alpha, low=0.0, low_inclusive=False)
        check_real("update_freq_alpha", update_freq_alpha, low=0.0, low_inclusive=False)
        check_int("start_step", start_step, low=0)
        self.kfac = kfac
        self.damping_alpha = damping_alpha
        self.damping_schedule = sorted(damping_schedule or [])
        self.update_freq_alpha = update_freq_alpha
        self.update_freq_schedule = sorted(update_freq_schedule or [])
        scheduled = []
        if self.damping_schedule:
            scheduled.append("damping")
        if self.update_freq_schedule:
            scheduled += ["factor_update_steps", "inv_update_steps"]
        for name in scheduled:
            if callable(kfac.param_groups[0][name]):
                raise ValueError(
                    f"Invalid kfac: its {name} is a callable; a KFACParamScheduler "
                    "cannot also schedule it"
                )
        self._base = {name: kfac.param_groups[0][name] for name in scheduled}
        self.current_step = start_step
        self._apply()

    def _apply(self) -> None:
        def passed(schedule):
            return sum(1 for milestone in schedule if milestone <= self.current_step)

        if "damping" in self._base:
            factor = self.damping_alpha ** passed(self.damping_schedule)
            self.kfac.param_groups[0]["damping"] = self._base["damping"] * factor
        if "factor_update_steps" in self._base:
            factor = self.update_freq_alpha ** passed(self.update_freq_schedule)
            for name in ("factor_update_steps", "inv_update_steps"):
                self.kfac.param_groups[0][name] = max(1, int(self._base[name] * factor))

    def step(self, step: int | None = None) -> None:
        """Advances the count by one (or sets it to ``step``) and applies it."""
        self.current_step = self.current_step + 1 if step is None else step
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"current_step": self.current_step, "base": dict(self._base)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.current_step = state_dict["current_step"]
        self._base = dict(state_dict["base"])
        self._apply()
