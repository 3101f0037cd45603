"""Train one workload with one optimizer and measure loss, accuracy, time and memory.

:func:`run` compiles the train step ahead of time (so compile time is measured on its
own), runs a fixed step budget with every step blocked on its results, and returns a
:class:`RunResult`. It never prints: progress goes to an optional callback.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from precond._common.validation import check_choice, check_int
from precond.bench.optimizers import DEFAULT_WEIGHT_DECAY, OptimizerSpec
from precond.bench.workloads import Workload, batch_indices

# Steps excluded from the median step time (allocator and cache warm-up).
WARMUP_STEPS = 10
# Full train/test evaluation every this many steps (and always after the last step).
EVAL_EVERY = 50
# Learning-rate schedules: the peak rate held ("constant"), or a linear warm-up over
# the first 5% of steps followed by a cosine decay to zero at the last step ("cosine").
SCHEDULES = ("cosine", "constant")
WARMUP_FRACTION = 0.05


@dataclass(frozen=True)
class RunConfig:
    """What to run: the step budget, minibatch size and seed of one training run.

    ``seed`` sets the parameter init, the minibatch order and the optimizer's own
    randomness; the train/test split is the workload's fixed ``split_seed``.
    ``schedule`` is one of :data:`SCHEDULES`, applied to every optimizer's rate.
    """

    steps: int = 500
    batch_size: int = 128
    seed: int = 0
    schedule: str = "cosine"
    eval_every: int = EVAL_EVERY
    warmup_steps: int = WARMUP_STEPS

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every"):
            check_int(name, getattr(self, name), low=1)
        check_int("warmup_steps", self.warmup_steps, low=0)
        check_choice("schedule", self.schedule, SCHEDULES)


@dataclass
class RunResult:
    """Measurements of one run. Times in seconds unless named ``_ms``.

    ``history`` holds one entry per evaluation, ``{"step", "train_loss",
    "test_loss", "test_accuracy"}`` on the full train and test sets; the last entry
    is after the final step, and ``final_train_loss`` / ``test_accuracy`` are its
    values. ``minibatch_loss[i]`` is the loss of the batch of step i + 1 and
    ``step_ms[i]`` its wall time (warm-up steps included).
    """

    workload: str
    optimizer: str
    learning_rate: float  # the peak rate of the schedule
    schedule: str
    weight_decay: float
    steps: int
    batch_size: int
    seed: int
    final_train_loss: float
    test_loss: float
    test_accuracy: float
    median_step_ms: float
    compile_s: float
    train_s: float
    param_bytes: int
    state_bytes: int
    history: list[dict[str, float]] = field(default_factory=list)
    minibatch_loss: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tree_nbytes(tree: Any) -> int:
    """Sum of ``nbytes`` over the array leaves of a pytree (other leaves count 0)."""
    import jax

    return int(sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(tree)))


def learning_rate_schedule(peak: float, steps: int, schedule: str):
    """The rate of every step: ``peak`` itself, or an optax warm-up + cosine schedule.

    "cosine": linear from 0 to ``peak`` over ``WARMUP_FRACTION·steps`` steps (none
    when that rounds to 0), then cosine decay to 0 at ``steps``.
    """
    if schedule == "constant":
        return peak
    import optax

    warmup = int(WARMUP_FRACTION * steps)
    if warmup == 0:
        return optax.cosine_decay_schedule(peak, decay_steps=steps, alpha=0.0)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=steps,
        end_value=0.0,
    )


def make_train_step(workload: Workload, optimizer) -> Callable:
    """(params, opt_state, x_train, y_train, idx) ↦ (params, opt_state, loss).

    Gathers the minibatch ``idx`` from the device-resident training set, takes the
    loss gradient and applies one optimizer update.
    """
    import jax
    import optax

    def train_step(params, opt_state, x_train, y_train, idx):
        with jax.named_scope("precond/bench/train_step"):
            x, y = x_train[idx], y_train[idx]
            loss, grads = jax.value_and_grad(workload.loss)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step


def make_evaluate(workload: Workload) -> Callable:
    """(params, x_train, y_train, x_test, y_test) ↦ {"train_loss", "test_loss", ...}."""

    def evaluate(params, x_train, y_train, x_test, y_test):
        train = workload.metrics(params, x_train, y_train)
        test = workload.metrics(params, x_test, y_test)
        return {
            "train_loss": train["loss"],
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
        }

    return evaluate


def run(
    workload: Workload,
    spec: OptimizerSpec,
    config: RunConfig,
    *,
    learning_rate: float | None = None,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    on_compiled: Callable[[float], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> RunResult:
    """Trains ``workload`` with ``spec`` for ``config.steps`` steps and measures it.

    Args:
        workload: what to train.
        spec: the optimizer; ``learning_rate`` defaults to ``spec.default_lr``.
        config: steps, batch size, seed and learning-rate schedule.
        learning_rate: overrides the optimizer's default (peak) learning rate.
        weight_decay: decoupled weight decay λ given to the optimizer.
        on_compiled: called once with the compile time (s) before the first step.
        on_step: called after every step with (step, minibatch loss), step 1-based.

    Returns:
        The run's :class:`RunResult`. The median step time is over the steps after
        ``config.warmup_steps`` (all steps if there are no more), each timed from
        dispatch until its parameters, state and loss are ready.
    """
    import jax

    lr = spec.default_lr if learning_rate is None else learning_rate
    split = workload.load_split(workload.split_seed)
    batches = batch_indices(
        len(split.x_train), config.batch_size, config.steps, config.seed
    )
    x_train, y_train, x_test, y_test = jax.device_put(
        (split.x_train, split.y_train, split.x_test, split.y_test)
    )

    optimizer = spec.make(
        learning_rate_schedule(lr, config.steps, config.schedule), weight_decay
    )
    params = workload.init_params(config.seed)
    opt_state = optimizer.init(params)

    start = time.perf_counter()
    train_step = (
        jax.jit(make_train_step(workload, optimizer))
        .lower(params, opt_state, x_train, y_train, batches[0])
        .compile()
    )
    compile_s = time.perf_counter() - start
    evaluate = (
        jax.jit(make_evaluate(workload))
        .lower(params, x_train, y_train, x_test, y_test)
        .compile()
    )
    if on_compiled is not None:
        on_compiled(compile_s)

    def record(step: int) -> dict[str, float]:
        metrics = evaluate(params, x_train, y_train, x_test, y_test)
        return {"step": step, **{k: float(v) for k, v in metrics.items()}}

    step_seconds: list[float] = []
    minibatch_loss: list[float] = []
    history: list[dict[str, float]] = []
    train_start = time.perf_counter()
    for step in range(1, config.steps + 1):
        idx = batches[step - 1]
        start = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(
            train_step(params, opt_state, x_train, y_train, idx)
        )
        step_seconds.append(time.perf_counter() - start)
        minibatch_loss.append(float(loss))
        if step % config.eval_every == 0 or step == config.steps:
            history.append(record(step))
        if on_step is not None:
            on_step(step, minibatch_loss[-1])
    train_s = time.perf_counter() - train_start

    timed = step_seconds[config.warmup_steps :] or step_seconds
    final = history[-1]
    return RunResult(
        workload=workload.name,
        optimizer=spec.name,
        learning_rate=float(lr),
        schedule=config.schedule,
        weight_decay=float(weight_decay),
        steps=config.steps,
        batch_size=config.batch_size,
        seed=config.seed,
        final_train_loss=final["train_loss"],
        test_loss=final["test_loss"],
        test_accuracy=final["test_accuracy"],
        median_step_ms=1e3 * statistics.median(timed),
        compile_s=compile_s,
        train_s=train_s,
        param_bytes=tree_nbytes(params),
        state_bytes=tree_nbytes(opt_state),
        history=history,
        minibatch_loss=minibatch_loss,
        step_ms=[1e3 * seconds for seconds in step_seconds],
    )


def environment() -> dict[str, Any]:
    """Versions and device of this process, recorded beside the results."""
    import os
    import platform

    import jax
    import optax

    from precond import __version__

    device = jax.devices()[0]
    return {
        "precond": __version__,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
    }
