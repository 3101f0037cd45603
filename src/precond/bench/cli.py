"""The ``precond`` command: ``precond bench`` trains workloads with each optimizer.

Argument errors print one line on stderr and exit with status 2. JAX, optax,
scikit-learn and tqdm are imported only when a benchmark actually runs, so
``precond --help`` and ``precond bench --list`` are fast.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence

from precond import __version__
from precond._common.xla_workarounds import avoid_xla_cpu_deadlock
from precond.bench.optimizers import (
    BASELINE,
    DEFAULT_WEIGHT_DECAY,
    OPTIMIZERS,
)
from precond.bench.runner import SCHEDULES
from precond.bench.workloads import WORKLOADS

# What a bare `precond bench` trains: the quickest real workload.
DEFAULT_WORKLOAD = "digits-mlp"

USAGE_ERROR = 2
INTERRUPTED = 130

# (module, extra that installs it) needed to run a benchmark.
REQUIRED_MODULES = (
    ("jax", "jax"),
    ("optax", "jax"),
    ("sklearn", "bench"),
    ("tqdm", "bench"),
)


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump, no traceback)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


# ----------------------------------------------------------------- argument types


def _number(convert: type, low: float):
    """An argparse type: ``convert(text)``, finite and >= ``low``."""
    kind = "an integer" if convert is int else "a number"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"{text} must be {kind} >= {low}")
        return value

    return parse


_positive_int = _number(int, 1)
_nonnegative_int = _number(int, 0)
_nonnegative_float = _number(float, 0)


def _names(registry: dict, kind: str):
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"no {kind} names given")
        for name in names:
            if name not in registry:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {name!r}; choose from {', '.join(registry)}"
                )
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise argparse.ArgumentTypeError(
                f"{kind} {', '.join(map(repr, duplicates))} given more than once"
            )
        return names

    return parse


def _lr_override(text: str) -> tuple[str, float]:
    name, sep, value_text = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not of the form NAME=VALUE (e.g. kron=1e-3)"
        )
    if name not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}"
        )
    try:
        value = float(value_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"learning rate {value_text!r} for {name!r} is not a number"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"learning rate {value_text} for {name!r} must be a finite number > 0"
        )
    return name, value


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``precond`` parser with its ``bench`` subcommand."""
    parser = _Parser(
        prog="precond",
        description="Scalable second-order optimizers for JAX and PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"precond {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    optimizer_names = ", ".join(
        f"{s.name} (lr {s.default_lr:g})" for s in OPTIMIZERS.values()
    )
    bench = commands.add_parser(
        "bench",
        help="train workloads with each optimizer and compare them",
        description=(
            "Train each workload with each optimizer for a fixed number of steps "
            "(showing a progress bar per run on stderr), then print a table of "
            "the final loss on the full train set, test accuracy, median step "
            "time after warm-up, compile time of the train step, and "
            f"optimizer-state bytes, with ratios to {BASELINE}. "
            f"Optimizers: {optimizer_names}. Workloads: {', '.join(WORKLOADS)}."
        ),
    )
    bench.add_argument(
        "--steps",
        type=_positive_int,
        default=500,
        metavar="N",
        help="training steps per run (default: %(default)s)",
    )
    bench.add_argument(
        "--batch-size",
        type=_positive_int,
        default=128,
        metavar="N",
        help="minibatch size (default: %(default)s)",
    )
    bench.add_argument(
        "--seed",
        type=_nonnegative_int,
        default=0,
        metavar="N",
        help=(
            "seed of the parameter init, minibatch order and optimizer randomness; "
            "the train/test split is fixed (default: %(default)s)"
        ),
    )
    bench.add_argument(
        "--optimizers",
        type=_names(OPTIMIZERS, "optimizer"),
        default=list(OPTIMIZERS),
        metavar="A,B",
        help=f"comma-separated optimizers to run (default: {','.join(OPTIMIZERS)})",
    )
    bench.add_argument(
        "--workloads",
        type=_names(WORKLOADS, "workload"),
        default=[DEFAULT_WORKLOAD],
        metavar="A,B",
        help=(
            f"comma-separated workloads to run, of {','.join(WORKLOADS)} "
            f"(default: {DEFAULT_WORKLOAD}, the quickest)"
        ),
    )
    bench.add_argument(
        "--lr",
        type=_lr_override,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=(
            "learning rate of one optimizer, e.g. --lr kron=3e-4; repeat for "
            "several (defaults: see --list)"
        ),
    )
    bench.add_argument(
        "--weight-decay",
        type=_nonnegative_float,
        default=DEFAULT_WEIGHT_DECAY,
        metavar="X",
        help=(
            "decoupled weight decay given to every optimizer, applied as "
            "θ ← θ - lr·(u + X·θ) (default: %(default)g)"
        ),
    )
    bench.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="cosine",
        help=(
            "learning-rate schedule of every optimizer: 'cosine' warms up linearly "
            "over the first 5%% of steps to the optimizer's rate, then decays it to "
            "0 at the last step; 'constant' keeps the rate (default: %(default)s)"
        ),
    )
    bench.add_argument(
        "--json",
        metavar="PATH",
        help="also write the config, environment and every run's results as JSON",
    )
    bench.add_argument(
        "--no-progress",
        action="store_true",
        help="do not show progress bars",
    )
    bench.add_argument(
        "--list",
        action="store_true",
        help="list the workloads and optimizers (with default learning rates), exit",
    )
    return parser


# ----------------------------------------------------------------------- commands


def _format_list() -> str:
    width = max(len(name) for name in (*WORKLOADS, *OPTIMIZERS))
    lines = ["workloads:"]
    lines += [f"  {w.name:<{width}}  {w.description}" for w in WORKLOADS.values()]
    lines.append("optimizers:")
    lines += [
        f"  {s.name:<{width}}  lr {s.default_lr:<8g} {s.description}"
        for s in OPTIMIZERS.values()
    ]
    return "\n".join(lines)


def _check_requirements() -> None:
    for module, extra in REQUIRED_MODULES:
        if importlib.util.find_spec(module) is None:
            raise UsageError(
                f"precond bench: error: {module} is not installed; install it with: "
                f"pip install 'precond[{extra}]'"
            )


def _check_args(args: argparse.Namespace) -> dict[str, float]:
    """Cross-argument checks; returns the learning-rate overrides by name."""
    overrides: dict[str, float] = {}
    for name, value in args.lr:
        if name in overrides:
            raise UsageError(f"precond bench: error: --lr {name}= given more than once")
        if name not in args.optimizers:
            raise UsageError(
                f"precond bench: error: --lr {name}= given but {name!r} is not in "
                f"--optimizers ({','.join(args.optimizers)})"
            )
        overrides[name] = value
    if args.json is not None:
        path = os.path.abspath(args.json)
        if os.path.isdir(path):
            raise UsageError(f"precond bench: error: --json {args.json!r} is a folder")
        if not os.path.isdir(os.path.dirname(path)):
            raise UsageError(
                f"precond bench: error: --json {args.json!r}: folder "
                f"{os.path.dirname(path)!r} does not exist"
            )
    return overrides


def _check_batch_size(workloads, batch_size: int) -> None:
    for workload in workloads:
        n_train = len(workload.load_split(workload.split_seed).x_train)
        if batch_size > n_train:
            raise UsageError(
                f"precond bench: error: --batch-size {batch_size} exceeds the "
                f"{n_train} training rows of workload {workload.name!r}"
            )


def _run_bench(args: argparse.Namespace) -> int:
    if args.list:
        print(_format_list())
        return 0
    overrides = _check_args(args)
    _check_requirements()
    avoid_xla_cpu_deadlock()  # before jax is first imported

    from tqdm import tqdm

    from precond.bench.optimizers import get_optimizer
    from precond.bench.report import format_table, json_document
    from precond.bench.runner import RunConfig, environment, run
    from precond.bench.workloads import get_workload

    workloads = [get_workload(name) for name in args.workloads]
    _check_batch_size(workloads, args.batch_size)
    config = RunConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        schedule=args.schedule,
    )
    env = environment()

    results = []
    for workload in workloads:
        for name in args.optimizers:
            spec = get_optimizer(name)
            with tqdm(
                total=config.steps,
                desc=f"{workload.name} {name} (compiling)",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                disable=args.no_progress,
            ) as bar:
                label = f"{workload.name} {name}"

                def on_compiled(seconds: float, bar=bar, label=label) -> None:
                    bar.set_description(label, refresh=False)
                    bar.reset()  # restart the clock: the rate counts steps only

                def on_step(step: int, loss: float, bar=bar) -> None:
                    if step % 10 == 0 or step == config.steps:
                        bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
                    bar.update(1)

                results.append(
                    run(
                        workload,
                        spec,
                        config,
                        learning_rate=overrides.get(name),
                        weight_decay=args.weight_decay,
                        on_compiled=on_compiled,
                        on_step=on_step,
                    )
                )

    print(
        f"precond bench: {config.steps} steps, batch {config.batch_size}, "
        f"seed {config.seed}, {config.schedule} schedule, "
        f"weight decay {args.weight_decay:g}; "
        f"jax {env['jax']} on {env['backend']} ({env['device']})"
    )
    print(format_table(results, baseline=BASELINE))
    if args.json is not None:
        document = json_document(
            results,
            config={
                "steps": config.steps,
                "batch_size": config.batch_size,
                "seed": config.seed,
                "weight_decay": args.weight_decay,
                "schedule": config.schedule,
                "warmup_steps": config.warmup_steps,
                "eval_every": config.eval_every,
                "optimizers": list(args.optimizers),
                "workloads": list(args.workloads),
                "learning_rates": {r.optimizer: r.learning_rate for r in results},
            },
            environment=env,
            baseline=BASELINE,
        )
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(document, file, indent=2, allow_nan=False)
            file.write("\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``precond`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            prog = parser.prog if args.command is None else f"precond {args.command}"
            raise UsageError(
                f"{prog}: error: unrecognized arguments: {' '.join(unknown)} "
                f"(see '{prog} --help')"
            )
        if args.command is None:
            parser.print_help(sys.stderr)
            return USAGE_ERROR
        return _run_bench(args)
    except UsageError as error:
        print(error, file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exit_:  # --help and --version exit through argparse
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print("precond: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
