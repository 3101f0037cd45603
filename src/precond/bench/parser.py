"""The command line of ``precond bench``: its options, their types and help, and
the one-line usage errors (exit status 2) that ``precond.bench.cli`` reports."""

from __future__ import annotations

import argparse

from precond import __version__
from precond.bench.arguments import (
    finite_positive,
    multipliers,
    names,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from precond.bench.machine import available_cores
from precond.bench.optimizers import (
    BASELINE,
    DEFAULT_WEIGHT_DECAY,
    FRAMEWORKS,
    OPTIMIZERS,
)
from precond.bench.runner import SCHEDULES
from precond.bench.workloads import WORKLOADS

DEFAULT_LR_SWEEP = (0.3, 1.0, 3.0)
DEFAULT_OUTPUT = "bench-results"


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


def _error(message: str) -> UsageError:
    return UsageError(f"precond bench: error: {message}")


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump, no traceback)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


# ----------------------------------------------------------------- argument types


def _lr_override(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` (an optimizer's rate) or ``NAME.KEYWORD=VALUE`` (the rate
    of one of its parts, e.g. ``muon.adam_learning_rate=1e-3``)."""
    name, sep, value_text = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not of the form NAME=VALUE (e.g. kron=1e-3)"
        )
    optimizer, _, keyword = name.partition(".")
    if optimizer not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}"
        )
    parts = OPTIMIZERS[optimizer].part_learning_rates
    if keyword and keyword not in parts:
        raise argparse.ArgumentTypeError(
            f"optimizer {optimizer!r} has no part rate {keyword!r}"
            + (f"; choose from {', '.join(parts)}" if parts else "")
        )
    return name, finite_positive(value_text, f"learning rate for {name!r}:")


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``precond`` parser with its ``bench`` subcommand."""
    parser = _Parser(
        prog="precond",
        description="Scalable second-order optimizers for JAX and PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"precond {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        help="train workloads with each optimizer and compare them with AdamW",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train each workload with each optimizer, in each installed framework,\n"
            "then print a table and write a report folder (report.md, results.json\n"
            "and a PNG of validation loss vs steps and vs time per workload).\n"
            "A progress bar per run goes to stderr. The table gives, per optimizer\n"
            "at its selected learning rate: final validation loss and accuracy,\n"
            f"steps and seconds to reach {BASELINE}'s final validation loss (the\n"
            "first point from which the linearly joined evaluations stay at or\n"
            f"below it; ratio to {BASELINE}'s steps/seconds), median step time,\n"
            "optimizer-state bytes and JAX compile time, and names the optimizer\n"
            "with the lowest final validation loss of each workload, and the ones\n"
            f"that reach {BASELINE}'s final validation loss in the least time and\n"
            "in the fewest steps. See --list for workloads and optimizers."
        ),
    )
    bench.add_argument(
        "--frameworks",
        type=names(FRAMEWORKS, "framework"),
        metavar="A,B",
        help=(
            "comma-separated frameworks, of jax (optax optimizers, models in plain "
            "JAX) and torch (torch.optim optimizers, torch.nn models); default: "
            "every installed one (a missing one is skipped with a note)"
        ),
    )
    bench.add_argument(
        "--workloads",
        type=names(WORKLOADS, "workload"),
        default=[name for name, w in WORKLOADS.items() if w.default],
        metavar="A,B",
        help="comma-separated workloads (default: "
        + ",".join(name for name, w in WORKLOADS.items() if w.default)
        + ")",
    )
    bench.add_argument(
        "--optimizers",
        type=names(OPTIMIZERS, "optimizer"),
        metavar="A,B",
        help=(
            "comma-separated optimizers; each runs in the selected frameworks it "
            "exists in (default: "
            + ",".join(n for n, s in OPTIMIZERS.items() if s.default)
            + ", and kfac when torch is installed)"
        ),
    )
    budget = bench.add_mutually_exclusive_group()
    budget.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="training steps per run (default: each workload's own, see --list)",
    )
    budget.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="SECONDS",
        help=(
            "train each run for this many seconds instead of a step budget "
            "(compile and evaluation time excluded; the schedule follows the time)"
        ),
    )
    bench.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="N",
        help="minibatch size (default: each workload's own, see --list)",
    )
    bench.add_argument(
        "--seeds",
        type=positive_int,
        default=1,
        metavar="N",
        help=(
            "run each configuration with N seeds (--seed, --seed + 1, ...) and "
            "report means (default: %(default)s)"
        ),
    )
    bench.add_argument(
        "--seed",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help=(
            "first seed of the parameter init, minibatch order and optimizer "
            "randomness; the train/test split is fixed (default: %(default)s)"
        ),
    )
    bench.add_argument(
        "--lr",
        type=_lr_override,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=(
            "peak learning rate of one optimizer on every workload, e.g. "
            "--lr kron=3e-4, or of a part of it that a second rule trains, e.g. "
            "--lr muon.adam_learning_rate=1e-3 (--lr-sweep does not scale "
            "those); repeat for several (defaults: see --list)"
        ),
    )
    bench.add_argument(
        "--lr-sweep",
        type=multipliers,
        nargs="?",
        const=list(DEFAULT_LR_SWEEP),
        metavar="M1,M2",
        help=(
            "also run each optimizer at these multiples of its learning rate "
            "(default multiples: "
            + ",".join(f"{m:g}" for m in DEFAULT_LR_SWEEP)
            + ") and report the one with the lowest mean final validation loss"
        ),
    )
    bench.add_argument(
        "--weight-decay",
        type=nonnegative_float,
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
            "over the first 5%% of the budget to the optimizer's rate, then decays "
            "it to 0 at the end; 'constant' keeps the rate (default: %(default)s)"
        ),
    )
    bench.add_argument(
        "--devices",
        type=positive_int,
        default=1,
        metavar="N",
        help=(
            "shard each JAX batch over N devices (data parallel; on a CPU, N "
            "devices are simulated); PyTorch runs use one process (default: 1)"
        ),
    )
    bench.add_argument(
        "--threads",
        type=positive_int,
        default=available_cores(),
        metavar="N",
        help=(
            "intra-op threads of XLA:CPU and of torch (each framework gets N; "
            "LAPACK under JAX runs single-threaded, torch has one inter-op "
            "thread); recorded in the report (default: the cores this process "
            "may use, here %(default)s)"
        ),
    )
    bench.add_argument(
        "--output",
        metavar="DIR",
        help=(
            f"folder for report.md, results.json and the plots (default: "
            f"{DEFAULT_OUTPUT}/<UTC date-time>)"
        ),
    )
    bench.add_argument(
        "--json",
        metavar="PATH",
        help="also write the JSON report (config, environment, every run) to PATH",
    )
    bench.add_argument(
        "--no-plots", action="store_true", help="do not draw the PNG plots"
    )
    bench.add_argument(
        "--no-progress", action="store_true", help="do not show progress bars"
    )
    bench.add_argument(
        "--readme",
        metavar="PATH",
        help="also write this run's results table into the Markdown file PATH, "
        "between its lines <!-- bench-results:begin --> and "
        "<!-- bench-results:end --> (how README.md's table is made)",
    )
    bench.add_argument(
        "--list",
        action="store_true",
        help="list the workloads and optimizers (with their learning rates), exit",
    )
    return parser


# ----------------------------------------------------------------------- commands
