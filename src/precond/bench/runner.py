"""Train one workload with one optimizer and measure loss, accuracy, time and memory.

:func:`training_loop` is shared by the frameworks: it draws the minibatches, sets
the learning-rate multiplier of every step from the budget used so far, times every
step and evaluates on the validation rows. :func:`run_jax` (here) and
:func:`precond.bench.torch_runner.run_torch` give it a framework's train step and
evaluation and return a :class:`RunResult`. Nothing here prints: progress goes to
optional callbacks.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from precond._common.validation import check_choice, check_int, check_real
from precond.bench.data import BatchStream, batch_indices
from precond.bench.optimizers import DEFAULT_WEIGHT_DECAY, OptimizerSpec
from precond.bench.workloads import Workload

# Steps excluded from the median step time (allocator and cache warm-up).
WARMUP_STEPS = 10
# Learning-rate schedules: the peak rate held ("constant"), or a linear warm-up over
# the first 5% of the budget followed by a cosine decay to zero at its end.
SCHEDULES = ("cosine", "constant")
WARMUP_FRACTION = 0.05


@dataclass(frozen=True)
class RunConfig:
    """What to run: the budget, minibatch size and seed of one training run.

    Exactly one of ``steps`` (a step budget) and ``time_budget_s`` (seconds of
    training, compile and evaluations excluded) is set. ``seed`` sets the
    parameter init, the minibatch order and the optimizer's own randomness; the
    train/test split is the workload's fixed ``split_seed``. ``schedule`` is one
    of :data:`SCHEDULES`, applied to every optimizer's rate; a cosine schedule
    warms up over ``lr_warmup_fraction`` of the budget and decays to
    ``lr_final_fraction`` of the peak. The validation rows
    are scored before the first step, every ``eval_every`` steps and after the
    last. ``devices`` > 1 shards each JAX batch over that many devices.
    """

    steps: int | None = 400
    batch_size: int = 128
    seed: int = 0
    schedule: str = "cosine"
    eval_every: int = 20
    warmup_steps: int = WARMUP_STEPS  # steps left out of the median step time
    time_budget_s: float | None = None
    devices: int = 1
    lr_warmup_fraction: float = WARMUP_FRACTION
    lr_final_fraction: float = 0.0

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.time_budget_s is None):
            raise ValueError(
                f"Invalid budget steps={self.steps!r}, time_budget_s="
                f"{self.time_budget_s!r}: give exactly one"
            )
        if self.steps is not None:
            check_int("steps", self.steps, low=1)
        if self.time_budget_s is not None and not (
            math.isfinite(self.time_budget_s) and self.time_budget_s > 0
        ):
            raise ValueError(
                f"Invalid time_budget_s={self.time_budget_s!r}: must be finite and > 0"
            )
        for name in ("batch_size", "eval_every", "devices"):
            check_int(name, getattr(self, name), low=1)
        check_int("warmup_steps", self.warmup_steps, low=0)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_real(
            "lr_warmup_fraction",
            self.lr_warmup_fraction,
            low=0.0,
            high=1.0,
            high_inclusive=False,
        )
        check_real("lr_final_fraction", self.lr_final_fraction, low=0.0, high=1.0)

    def multiplier(self, progress: float) -> float:
        """The learning rate as a fraction of the peak at ``progress`` of the
        budget (:func:`lr_multiplier` with this run's schedule)."""
        return lr_multiplier(
            progress, self.schedule, self.lr_warmup_fraction, self.lr_final_fraction
        )

    def schedule_text(self) -> str:
        """The schedule in words: "cosine" for the bench's (5% warm-up, decay to
        0), else with its warm-up and final fraction."""
        if self.schedule != "cosine" or (
            self.lr_warmup_fraction == WARMUP_FRACTION and self.lr_final_fraction == 0
        ):
            return self.schedule
        return (
            f"cosine (warm-up {self.lr_warmup_fraction:.3g} of the budget, to "
            f"{self.lr_final_fraction:.3g} of the peak)"
        )

    def budget(self) -> str:
        """The budget in words: "400 steps" or "60 s"."""
        if self.steps is not None:
            return f"{self.steps} steps"
        return f"{self.time_budget_s:g} s"


@dataclass
class RunResult:
    """Measurements of one run. Times in seconds unless named ``_ms``.

    ``history`` holds one entry per evaluation, ``{"step", "time_s",
    "train_loss", "val_loss", "val_accuracy"}``: ``time_s`` is the training time
    up to that step (compile and evaluations excluded), ``train_loss`` the mean
    minibatch loss since the previous evaluation (NaN at step 0), ``val_*`` the
    workload's metrics on its whole validation (test) split. The first entry is
    at step 0, the last after the final step; ``final_*`` are the last entry's
    values. ``minibatch_loss[i]`` is the loss of the batch of step i + 1 and
    ``step_ms[i]`` its wall time (warm-up steps included). ``diverged``: a
    minibatch loss was not finite, and the run stopped there. ``skipped_steps``:
    steps whose gradient precond's step guard refuses (a NaN or ±Inf entry, or
    a squared norm that overflows): precond's optimizers skip them, the
    baselines apply them. A real workload should have none.
    """

    framework: str
    workload: str
    optimizer: str
    learning_rate: float  # the peak rate of the schedule
    schedule: str
    weight_decay: float
    seed: int
    batch_size: int
    budget: str
    devices: int
    steps: int  # steps taken
    final_train_loss: float
    final_val_loss: float
    final_val_accuracy: float
    diverged: bool
    skipped_steps: int
    median_step_ms: float
    compile_s: float | None  # None where there is no separate compilation
    train_s: float
    param_bytes: int
    state_bytes: int
    history: list[dict[str, float]] = field(default_factory=list)
    minibatch_loss: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lr_multiplier(
    progress: float,
    schedule: str,
    warmup: float = WARMUP_FRACTION,
    final: float = 0.0,
) -> float:
    """The learning rate as a fraction of the peak, at ``progress`` ∈ [0, 1] of the
    budget: 1 ("constant"), or ("cosine") ``progress / warmup`` during the warm-up
    and then f + (1 − f)·(1 + cos(π·(progress − warmup) / (1 − warmup))) / 2,
    from 1 down to the ``final`` fraction f."""
    if schedule == "constant":
        return 1.0
    progress = min(max(progress, 0.0), 1.0)
    if progress < warmup:
        return progress / warmup
    decayed = (progress - warmup) / (1.0 - warmup)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * decayed))


@dataclass
class LoopRecord:
    """What :func:`training_loop` measured."""

    history: list[dict[str, float]]
    minibatch_loss: list[float]
    step_seconds: list[float]
    train_s: float
    diverged: bool
    skipped_steps: int


def _progress(config: RunConfig, k: int, elapsed: float, last: float) -> float | None:
    """The budget's fraction at the middle of step k + 1 (see
    :func:`training_loop`), or None once the budget is used up."""
    if config.steps is not None:
        return (k + 0.5) / config.steps if k < config.steps else None
    budget = config.time_budget_s
    if budget is None or elapsed >= budget:
        return None
    return (elapsed + 0.5 * last) / budget


def training_loop(
    step: Callable[[Any, float], tuple[float, bool]],
    evaluate: Callable[[], tuple[float, float]],
    config: RunConfig,
    n_train: int,
    on_step: Callable[[int, float, float], None] | None = None,
) -> LoopRecord:
    """Runs ``config``'s budget of steps.

    Args:
        step: (row indices of the batch, learning-rate multiplier) ↦ (minibatch
            loss, whether the step guard refused the gradient), after the update
            has completed.
        evaluate: () ↦ (validation loss, validation accuracy) of the current model.
        config: the budget, batch size, seed, schedule and evaluation interval.
        n_train: training rows (the minibatches are drawn from them).
        on_step: called after every step with (step, minibatch loss, training
            seconds so far).

    The multiplier of step k is the schedule at the middle of that step's share of
    the budget: (k − ½)/N of a budget of N steps, or, with a time budget T,
    (t + ½·d)/T where t is the training time before the step and d the previous
    step's duration (0 before the first). A time-budget run stops after the step
    that uses up the budget. A non-finite minibatch loss stops the run.
    """
    if config.steps is not None:
        batches = batch_indices(n_train, config.batch_size, config.steps, config.seed)
        next_batch = iter(batches).__next__
    else:
        next_batch = BatchStream(n_train, config.batch_size, config.seed).next

    def record(k: int, elapsed: float, train_loss: float) -> dict[str, float]:
        val_loss, val_accuracy = evaluate()
        return {
            "step": k,
            "time_s": elapsed,
            "train_loss": train_loss,
            "val_loss": float(val_loss),
            "val_accuracy": float(val_accuracy),
        }

    history = [record(0, 0.0, math.nan)]
    losses: list[float] = []
    seconds: list[float] = []
    elapsed, k, diverged, skipped = 0.0, 0, False, 0
    since_eval: list[float] = []
    while True:
        progress = _progress(config, k, elapsed, seconds[-1] if seconds else 0.0)
        if progress is None:
            break
        idx = next_batch()
        start = time.perf_counter()
        loss, refused = step(idx, config.multiplier(progress))
        seconds.append(time.perf_counter() - start)
        loss, skipped = float(loss), skipped + bool(refused)
        elapsed += seconds[-1]
        k += 1
        losses.append(loss)
        since_eval.append(loss)
        diverged = not math.isfinite(loss)
        if on_step is not None:
            on_step(k, loss, elapsed)
        if diverged:
            break
        if k % config.eval_every == 0:
            history.append(record(k, elapsed, statistics.fmean(since_eval)))
            since_eval = []
    if history[-1]["step"] != k:
        train_loss = statistics.fmean(since_eval) if since_eval else math.nan
        history.append(record(k, elapsed, train_loss))
    return LoopRecord(history, losses, seconds, elapsed, diverged, skipped)


def median_step_ms(seconds: list[float], warmup_steps: int) -> float:
    """Median step time (ms) after ``warmup_steps`` (all steps if there are no
    more; NaN if none)."""
    timed = seconds[warmup_steps:] or seconds
    return 1e3 * statistics.median(timed) if timed else math.nan


def result_from_loop(loop: LoopRecord, config: RunConfig, **fields: Any) -> RunResult:
    """A :class:`RunResult` from a loop record and the run's own fields."""
    final = loop.history[-1]
    return RunResult(
        schedule=config.schedule_text(),
        seed=config.seed,
        batch_size=config.batch_size,
        budget=config.budget(),
        steps=len(loop.minibatch_loss),
        final_train_loss=final["train_loss"],
        final_val_loss=final["val_loss"],
        final_val_accuracy=final["val_accuracy"],
        diverged=loop.diverged,
        skipped_steps=loop.skipped_steps,
        median_step_ms=median_step_ms(loop.step_seconds, config.warmup_steps),
        train_s=loop.train_s,
        history=loop.history,
        minibatch_loss=loop.minibatch_loss,
        step_ms=[1e3 * s for s in loop.step_seconds],
        **fields,
    )


# --------------------------------------------------------------------------- JAX


def tree_nbytes(tree: Any) -> int:
    """Sum of ``nbytes`` over the array leaves of a pytree (other leaves count 0)."""
    import jax

    return int(sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(tree)))


def make_train_step(workload: Workload, optimizer, batch_sharding=None) -> Callable:
    """(params, opt_state, x_train, y_train, idx, lr_scale) ↦ (params, opt_state,
    loss, refused): ``refused`` is True when the step guard of precond's
    optimizers (:func:`precond.jax._core.guards.gradients_are_usable`) refuses the
    gradient.

    Gathers the minibatch ``idx`` from the device-resident training set (split
    over the devices by ``batch_sharding`` if given), takes the loss gradient,
    applies one optimizer update multiplied by ``lr_scale`` (every optimizer's
    update is proportional to its learning rate, decay included).
    """
    import jax
    import optax

    from precond.jax._core.guards import gradients_are_usable

    def train_step(params, opt_state, x_train, y_train, idx, lr_scale):
        with jax.named_scope("precond/bench/train_step"):
            x, y = x_train[idx], y_train[idx]
            if batch_sharding is not None:
                x = jax.lax.with_sharding_constraint(x, batch_sharding)
                y = jax.lax.with_sharding_constraint(y, batch_sharding)
            loss, grads = jax.value_and_grad(workload.loss)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss, ~gradients_are_usable(grads)

    return train_step


@functools.cache
def _jitted_metrics(workload: Workload) -> Callable:
    """``jax.jit(workload.metrics)``, one per workload, so that its compilations
    are shared by every run of the suite."""
    import jax

    return jax.jit(workload.metrics)


def run_jax(
    workload: Workload,
    spec: OptimizerSpec,
    config: RunConfig,
    *,
    learning_rate: float,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    on_compiled: Callable[[float], None] | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> RunResult:
    """Trains ``workload`` with ``spec``'s JAX optimizer within ``config``'s budget.

    The train step is compiled ahead of time (so its compile time is measured on
    its own) and every step is timed from dispatch until its parameters, state and
    loss are ready. With ``config.devices`` > 1 the parameters, optimizer state
    and training set are replicated over a ("data",) mesh of that many devices and
    each batch is split over it.
    """
    import contextlib

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    split = workload.load_split(workload.split_seed)
    batch_sharding = replicated = None
    context = contextlib.nullcontext()
    if config.devices > 1:
        mesh = jax.make_mesh(
            (config.devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
        )
        batch_sharding = NamedSharding(mesh, P("data"))
        replicated = NamedSharding(mesh, P())
        context = jax.set_mesh(mesh)

    def put(tree, sharding=None):
        """``tree`` on ``sharding`` (default: replicated over the mesh, if any)."""
        return jax.device_put(tree, sharding or replicated)

    with context:
        x_train, y_train, x_test, y_test = put(
            (split.x_train, split.y_train, split.x_test, split.y_test)
        )
        optimizer = spec.build("jax", workload, learning_rate, weight_decay)
        params = put(workload.init_params(config.seed))
        opt_state = optimizer.init(params)

        first = put(jnp.zeros((config.batch_size,), jnp.int32), batch_sharding)
        one = jnp.float32(1.0)
        start = time.perf_counter()
        train_step = (
            jax.jit(make_train_step(workload, optimizer, batch_sharding))
            .lower(params, opt_state, x_train, y_train, first, one)
            .compile()
        )
        compile_s = time.perf_counter() - start
        metrics = _jitted_metrics(workload)
        if on_compiled is not None:
            on_compiled(compile_s)

        state = {"params": params, "opt_state": opt_state}

        def step(idx, scale: float) -> tuple[float, bool]:
            out = train_step(
                state["params"],
                state["opt_state"],
                x_train,
                y_train,
                put(idx, batch_sharding),
                jnp.float32(scale),
            )
            state["params"], state["opt_state"], loss, refused = jax.block_until_ready(
                out
            )
            return float(loss), bool(refused)

        def evaluate() -> tuple[float, float]:
            result = metrics(state["params"], x_test, y_test)
            return float(result["loss"]), float(result["accuracy"])

        loop = training_loop(step, evaluate, config, len(split.x_train), on_step)

    return result_from_loop(
        loop,
        config,
        framework="jax",
        workload=workload.name,
        optimizer=spec.name,
        learning_rate=float(learning_rate),
        weight_decay=float(weight_decay),
        devices=config.devices,
        compile_s=compile_s,
        param_bytes=tree_nbytes(state["params"]),
        state_bytes=tree_nbytes(state["opt_state"]),
    )
