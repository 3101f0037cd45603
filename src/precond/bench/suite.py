"""A benchmark suite: every (framework, workload, optimizer, learning rate, seed)
run, one after the other, with a progress bar each.

:func:`plan` lists the runs; :func:`run_suite` runs them and, on
``KeyboardInterrupt``, returns the runs already finished with ``interrupted`` set,
so the report can still be written.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from precond.bench.optimizers import OptimizerSpec
from precond.bench.runner import WARMUP_FRACTION, RunConfig, RunResult
from precond.bench.workloads import Workload


@dataclass(frozen=True)
class Job:
    """One run: a framework, a workload, an optimizer, its peak rate, a config."""

    framework: str
    workload: Workload
    spec: OptimizerSpec
    learning_rate: float
    config: RunConfig

    @property
    def label(self) -> str:
        return (
            f"{self.framework} {self.workload.name} {self.spec.name} "
            f"lr {self.learning_rate:g} seed {self.config.seed}"
        )


def plan(
    frameworks: Sequence[str],
    workloads: Sequence[Workload],
    optimizers: Sequence[OptimizerSpec],
    *,
    seeds: Sequence[int],
    lr_multipliers: Sequence[float] = (1.0,),
    lr_overrides: dict[str, float] | None = None,
    steps: int | None = None,
    time_budget_s: float | None = None,
    batch_size: int | None = None,
    schedule: str = "cosine",
    devices: int = 1,
    lr_warmup_fraction: float = WARMUP_FRACTION,
    lr_final_fraction: float = 0.0,
) -> list[Job]:
    """Every run of the suite, framework by framework, workload by workload.

    An optimizer without a version in a framework is left out of that framework.
    Each optimizer's rates are its rate on the workload (``lr_overrides`` or its
    default) times each of ``lr_multipliers``; an ``lr_overrides`` key
    ``"NAME.KEYWORD"`` sets the rate of one of its ``part_learning_rates`` on
    every workload instead (not multiplied). Without ``steps`` or
    ``time_budget_s``, each workload's own step budget is used; ``batch_size``
    overrides the workloads' own. ``devices`` applies to JAX runs only; the
    cosine schedule's warm-up and final fractions are
    :class:`~precond.bench.runner.RunConfig`'s.
    """
    jobs = []
    for framework in frameworks:
        for workload in workloads:
            base = RunConfig(
                steps=None if time_budget_s is not None else (steps or workload.steps),
                time_budget_s=time_budget_s,
                batch_size=batch_size or workload.batch_size,
                schedule=schedule,
                eval_every=workload.eval_every,
                devices=devices if framework == "jax" else 1,
                lr_warmup_fraction=lr_warmup_fraction,
                lr_final_fraction=lr_final_fraction,
            )
            for registered in optimizers:
                if framework not in registered.frameworks():
                    continue
                spec = _with_part_rates(registered, lr_overrides or {})
                peak = (lr_overrides or {}).get(spec.name)
                if peak is None:
                    peak = spec.learning_rate(workload.name, framework)
                for multiplier in lr_multipliers:
                    for seed in seeds:
                        jobs.append(
                            Job(
                                framework,
                                workload,
                                spec,
                                peak * multiplier,
                                replace(base, seed=seed),
                            )
                        )
    return jobs


def _with_part_rates(spec: OptimizerSpec, overrides: dict[str, float]) -> OptimizerSpec:
    """``spec`` with the part rates that ``overrides`` gives as ``NAME.KEYWORD``
    set on every framework and workload."""
    parts = dict(spec.part_learning_rates)
    for key, value in overrides.items():
        name, _, keyword = key.partition(".")
        if name == spec.name and keyword:
            parts[keyword] = {
                framework: dict.fromkeys(rates, value)
                for framework, rates in parts[keyword].items()
            }
    if parts == spec.part_learning_rates:
        return spec
    return replace(spec, part_learning_rates=parts)


@dataclass
class SuiteOutcome:
    results: list[RunResult] = field(default_factory=list)
    interrupted: bool = False


def run_job(job: Job, weight_decay: float, progress: bool) -> RunResult:
    """Runs one job with a tqdm progress bar on stderr (steps, or seconds of a
    time budget)."""
    from tqdm import tqdm

    if job.framework == "jax":
        from precond.bench.runner import run_jax as run
    else:
        from precond.bench.torch_runner import run_torch as run

    config = job.config
    budget_s = config.time_budget_s
    total = config.steps if budget_s is None else round(budget_s, 1)
    with tqdm(
        total=total,
        desc=f"{job.label} (compiling)" if job.framework == "jax" else job.label,
        unit="step" if budget_s is None else "s",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not progress,
        leave=True,
    ) as bar:

        def on_compiled(seconds: float) -> None:
            bar.set_description(job.label, refresh=False)
            bar.reset(total=total)  # restart the clock: the rate counts steps only

        def on_step(step: int, loss: float, elapsed: float) -> None:
            if step % 10 == 0 or step == config.steps:
                bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            if budget_s is not None:
                bar.update(round(min(elapsed, budget_s), 1) - bar.n)
            else:
                bar.update(1)

        return run(
            job.workload,
            job.spec,
            config,
            learning_rate=job.learning_rate,
            weight_decay=weight_decay,
            on_compiled=on_compiled,
            on_step=on_step,
        )


def run_suite(
    jobs: Sequence[Job], weight_decay: float, progress: bool = True
) -> SuiteOutcome:
    """Runs ``jobs`` in order; Ctrl-C stops the suite, keeping the finished runs."""
    outcome = SuiteOutcome()
    try:
        for job in jobs:
            outcome.results.append(run_job(job, weight_decay, progress))
    except KeyboardInterrupt:
        outcome.interrupted = True
    return outcome
