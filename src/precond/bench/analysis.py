"""From runs to comparisons: learning-rate selection, steps and time to reach the
baseline's final loss, and the loss of each optimizer at the baseline's budget.

Pure Python on :class:`precond.bench.runner.RunResult` objects (no JAX, no torch).

Steps to reach AdamW's loss (the definition used everywhere in the report): the
target is the mean, over seeds, of AdamW's final validation loss (at its selected
learning rate, same framework and workload). Each run's validation losses, scored
on the whole validation split every ``eval_every`` steps, are joined by straight
lines, and the step (and, on the (training time, loss) curve, the time) to reach
the target is the first point from which that curve stays ≤ the target to the
end of the run (:func:`reached_and_stayed`): a transient dip below the target
that rises above it again does not count. The losses are not smoothed: they are
full-split evaluations, not noisy minibatch losses. Interpolation only refines
the step between two evaluations. A run whose curve does not end at or below the
target has "not reached". Over seeds, the mean is reported when every seed
reached the target, else "not reached".

The winner of a (framework, workload) is the optimizer with the lowest mean final
validation loss (:func:`winners`); the fastest to the baseline's final loss are the
one with the least training time and the one with the fewest steps to reach it
(:func:`fastest`), the baseline itself among them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from precond.bench.runner import RunResult


def reached_and_stayed(
    xs: Sequence[float], losses: Sequence[float], target: float
) -> float | None:
    """The first x from which the piecewise-linear curve through (xs[i],
    losses[i]) stays ≤ ``target`` up to xs[-1], or None if it ends above it.

    ``xs`` must be increasing. A non-finite loss counts as above the target, and
    no line is drawn to or from it: the curve stays below only from the next
    finite point on.
    """
    if len(xs) != len(losses):
        raise ValueError(f"{len(xs)} x values but {len(losses)} losses")
    if not math.isfinite(target):
        return None
    below = [math.isfinite(v) and v <= target for v in losses]
    if not below or not below[-1]:
        return None
    start = len(below) - 1
    while start > 0 and below[start - 1]:
        start -= 1
    if start == 0 or not math.isfinite(losses[start - 1]):
        return float(xs[start])
    x0, x1, l0, l1 = xs[start - 1], xs[start], losses[start - 1], losses[start]
    return float(x0 + (x1 - x0) * (l0 - target) / (l0 - l1))


def value_at(xs: Sequence[float], losses: Sequence[float], x: float) -> float | None:
    """The piecewise-linear curve through (xs[i], losses[i]) at ``x``; None if
    ``x`` is outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, l0, l1 = xs[i - 1], xs[i], losses[i - 1], losses[i]
            return float(l1 if x1 == x0 else l0 + (l1 - l0) * (x - x0) / (x1 - x0))
    return float(losses[0])


def loss_curve(
    run: RunResult, axis: str, loss: str = "val_loss"
) -> tuple[list[float], list[float]]:
    """(xs, losses) of ``run``'s evaluations: ``axis`` 'step' or 'time_s',
    ``loss`` 'val_loss' or 'train_loss' (the mean minibatch loss since the
    previous evaluation)."""
    return (
        [float(h[axis]) for h in run.history],
        [float(h[loss]) for h in run.history],
    )


def _score(loss: float) -> float:
    return loss if math.isfinite(loss) else math.inf


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    if not all(math.isfinite(v) for v in values):
        return math.nan  # a diverged seed: no spread to speak of
    return statistics.stdev(values)


Key = tuple[str, str, str]  # (framework, workload, optimizer)


def group_runs(results: Sequence[RunResult]) -> dict[Key, dict[float, list[RunResult]]]:
    """Runs by (framework, workload, optimizer), then by learning rate, in the
    order first seen."""
    groups: dict[Key, dict[float, list[RunResult]]] = {}
    for r in results:
        key = (r.framework, r.workload, r.optimizer)
        groups.setdefault(key, {}).setdefault(r.learning_rate, []).append(r)
    return groups


def select_learning_rates(
    results: Sequence[RunResult],
) -> dict[Key, float]:
    """The learning rate of each (framework, workload, optimizer) with the lowest
    mean final validation loss over its seeds (a non-finite loss counts as +∞;
    ties go to the rate run first)."""
    chosen = {}
    for key, by_lr in group_runs(results).items():
        chosen[key] = min(
            by_lr,
            key=lambda lr: _mean([_score(r.final_val_loss) for r in by_lr[lr]]),
        )
    return chosen


@dataclass
class Summary:
    """One row of the report: an optimizer at its selected rate, over seeds.

    Ratios are to the baseline of the same framework and workload (None where it
    was not run): ``steps_ratio`` = steps to reach its final loss / its steps,
    ``time_ratio`` = seconds to reach it / its training seconds.
    """

    framework: str
    workload: str
    optimizer: str
    learning_rate: float
    seeds: list[int]
    steps: float  # mean steps taken
    val_loss: float  # mean final validation loss
    val_loss_std: float
    val_accuracy: float
    train_loss: float
    median_step_ms: float
    compile_s: float | None
    train_s: float
    state_bytes: int
    param_bytes: int
    diverged: int  # seeds that diverged
    skipped_steps: int  # steps the step guard refused, over the seeds
    target: float | None = None  # the baseline's mean final validation loss
    steps_to_target: float | None = None
    time_to_target: float | None = None
    steps_ratio: float | None = None
    time_ratio: float | None = None
    val_loss_at_baseline_steps: float | None = None
    val_loss_at_baseline_time: float | None = None
    step_ratio: float | None = None  # median step time / the baseline's
    state_ratio: float | None = None  # state bytes / the baseline's
    swept: dict[float, float] = field(default_factory=dict)  # lr ↦ mean val loss


def _all_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    if not values or len(known) < len(values):
        return None
    return statistics.fmean(known)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or not base or not math.isfinite(base):
        return None
    return value / base


def summarize(results: Sequence[RunResult], baseline: str = "adamw") -> list[Summary]:
    """One :class:`Summary` per (framework, workload, optimizer), in the order
    first run, each at its selected learning rate, compared with ``baseline``."""
    groups = group_runs(results)
    chosen = select_learning_rates(results)
    rows: dict[Key, Summary] = {}
    for key, by_lr in groups.items():
        runs = by_lr[chosen[key]]
        compile_times = [r.compile_s for r in runs if r.compile_s is not None]
        rows[key] = Summary(
            framework=key[0],
            workload=key[1],
            optimizer=key[2],
            learning_rate=chosen[key],
            seeds=[r.seed for r in runs],
            steps=_mean([r.steps for r in runs]),
            val_loss=_mean([r.final_val_loss for r in runs]),
            val_loss_std=_std([r.final_val_loss for r in runs]),
            val_accuracy=_mean([r.final_val_accuracy for r in runs]),
            train_loss=_mean([r.final_train_loss for r in runs]),
            median_step_ms=_mean([r.median_step_ms for r in runs]),
            compile_s=_mean(compile_times) if compile_times else None,
            train_s=_mean([r.train_s for r in runs]),
            state_bytes=runs[0].state_bytes,
            param_bytes=runs[0].param_bytes,
            diverged=sum(r.diverged for r in runs),
            skipped_steps=sum(r.skipped_steps for r in runs),
            swept={
                lr: _mean([r.final_val_loss for r in group])
                for lr, group in sorted(by_lr.items())
            },
        )
    for key, row in rows.items():
        base_key = (key[0], key[1], baseline)
        if base_key not in rows:
            continue
        base = rows[base_key]
        base_runs = groups[base_key][chosen[base_key]]
        runs = groups[key][chosen[key]]
        row.target = base.val_loss if math.isfinite(base.val_loss) else None
        if row.target is not None:
            row.steps_to_target = _all_or_none(
                [reached_and_stayed(*loss_curve(r, "step"), row.target) for r in runs]
            )
            row.time_to_target = _all_or_none(
                [reached_and_stayed(*loss_curve(r, "time_s"), row.target) for r in runs]
            )
        row.steps_ratio = _ratio(row.steps_to_target, base.steps)
        row.time_ratio = _ratio(row.time_to_target, base.train_s)
        row.val_loss_at_baseline_steps = _all_or_none(
            [value_at(*loss_curve(r, "step"), base.steps) for r in runs]
        )
        base_time = _mean([r.train_s for r in base_runs])
        row.val_loss_at_baseline_time = _all_or_none(
            [value_at(*loss_curve(r, "time_s"), base_time) for r in runs]
        )
        row.step_ratio = _ratio(row.median_step_ms, base.median_step_ms)
        row.state_ratio = _ratio(row.state_bytes, base.state_bytes)
    return list(rows.values())


@dataclass(frozen=True)
class Winner:
    """The optimizer with the lowest mean final validation loss on a (framework,
    workload), and the runner-up. ``within_spread``: with several seeds, the two
    means are closer than the larger of their standard deviations, so the order
    is not settled by these seeds."""

    framework: str
    workload: str
    best: Summary
    runner_up: Summary | None
    within_spread: bool


def ranked(rows: Sequence[Summary]) -> dict[tuple[str, str], list[Summary]]:
    """The rows of each (framework, workload), lowest mean final validation loss
    first (a non-finite loss last)."""
    pairs = dict.fromkeys((r.framework, r.workload) for r in rows)
    return {
        pair: sorted(
            (r for r in rows if (r.framework, r.workload) == pair),
            key=lambda r: _score(r.val_loss),
        )
        for pair in pairs
    }


def winners(rows: Sequence[Summary]) -> list[Winner]:
    """One :class:`Winner` per (framework, workload) of ``rows``, in order; a
    non-finite (diverged) loss never wins over a finite one."""
    found = []
    for (framework, workload), ranked_rows in ranked(rows).items():
        best = ranked_rows[0]
        runner_up = ranked_rows[1] if len(ranked_rows) > 1 else None
        within = (
            runner_up is not None
            and len(best.seeds) > 1
            and abs(runner_up.val_loss - best.val_loss)
            < max(best.val_loss_std, runner_up.val_loss_std)
        )
        found.append(Winner(framework, workload, best, runner_up, within))
    return found


@dataclass(frozen=True)
class Fastest:
    """The optimizers of a (framework, workload) that reach the baseline's final
    validation loss ``target`` in the least training time (``by_time``) and in
    the fewest steps (``by_steps``); None where no optimizer reached it."""

    framework: str
    workload: str
    target: float
    by_time: Summary | None
    by_steps: Summary | None


def fastest(rows: Sequence[Summary]) -> list[Fastest]:
    """One :class:`Fastest` per (framework, workload) of ``rows`` that has a
    target (the baseline was run and its loss is finite), in order. Ties in
    time go to the fewer steps and ties in steps to the less time, then to the
    row first run."""
    found = []
    pairs = dict.fromkeys((r.framework, r.workload) for r in rows)
    for framework, workload in pairs:
        group = [r for r in rows if (r.framework, r.workload) == (framework, workload)]
        targets = [r.target for r in group if r.target is not None]
        if not targets:
            continue
        reached = [
            r
            for r in group
            if r.steps_to_target is not None and r.time_to_target is not None
        ]
        by_time = min(
            reached, key=lambda r: (r.time_to_target, r.steps_to_target), default=None
        )
        by_steps = min(
            reached, key=lambda r: (r.steps_to_target, r.time_to_target), default=None
        )
        found.append(Fastest(framework, workload, targets[0], by_time, by_steps))
    return found


@dataclass(frozen=True)
class Verdict:
    """precond against the other libraries on a (framework, workload), by the
    bench's decisive metric: the training time to reach the baseline's final
    validation loss. ``ours``: the fastest of precond's optimizers that reached
    it, ``theirs``: the fastest of the others (the baseline among them); None
    where none of that side reached it or none was run. ``ratio``: ours' time /
    theirs' (below 1: precond is faster), None unless both reached it."""

    framework: str
    workload: str
    target: float
    ours: Summary | None
    theirs: Summary | None
    ratio: float | None


def verdicts(rows: Sequence[Summary], references: Sequence[str]) -> list[Verdict]:
    """One :class:`Verdict` per (framework, workload) with a target, where
    ``references`` names the optimizers that are not precond's (AdamW, Muon,
    SGD): the rows of every other optimizer are precond's."""
    found = []
    for framework, workload in dict.fromkeys((r.framework, r.workload) for r in rows):
        group = [r for r in rows if (r.framework, r.workload) == (framework, workload)]
        targets = [r.target for r in group if r.target is not None]
        if not targets:
            continue

        def quickest(side: list[Summary]) -> Summary | None:
            reached = [r for r in side if r.time_to_target is not None]
            return min(reached, key=lambda r: r.time_to_target or 0.0, default=None)

        ours = quickest([r for r in group if r.optimizer not in references])
        theirs = quickest([r for r in group if r.optimizer in references])
        ratio = None
        if ours is not None and theirs is not None:
            ratio = _ratio(ours.time_to_target, theirs.time_to_target)
        found.append(Verdict(framework, workload, targets[0], ours, theirs, ratio))
    return found
