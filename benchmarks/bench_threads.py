"""Does one framework slow the other down, and what do thread settings change?

``precond bench`` gives XLA:CPU and torch the same number of intra-op threads
(``--threads``, default: the cores available) and keeps LAPACK and torch's
inter-op pool at one thread (:mod:`precond.bench.machine`). This script measures,
in new processes, the median step time of every optimizer of the default suite:

- ``alone``: one framework in the process; the other cannot be imported (as on a
  machine where it is not installed);
- ``together``: ``--frameworks jax,torch``: both configured at start, so the JAX
  runs happen with torch imported and the torch runs after JAX's;
- ``threads=1`` (with ``--compare-threads``): ``alone`` with one thread, to show
  how much the final losses move with the thread count.

Modes run in rounds, the order reversed every other round, so that a change of
machine load hits all alike. Reported per (framework, workload, optimizer): the
median over rounds of each mode's median step time, the ratio together/alone,
and the final validation losses (which must not depend on the other framework).

Usage::

    python benchmarks/bench_threads.py --steps 60 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precond.bench.optimizers import OPTIMIZERS
from precond.bench.report import write_json

# Runs ``precond bench`` with argv[2:] in a process where the top-level module
# argv[1] (if not "-") can be neither found nor imported.
RUN_HIDING = """
import importlib.abc, sys

hidden = sys.argv[1]

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

if hidden != "-":
    sys.meta_path.insert(0, Hide())
from precond.bench.cli import main
sys.exit(main(sys.argv[2:]))
"""

OTHER = {"jax": "torch", "torch": "jax"}


def run_bench(hidden: str, argv: Sequence[str]) -> dict[str, Any]:
    """``precond bench ARGV`` in a new process hiding ``hidden``; its results.json."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out"
        command = [sys.executable, "-c", RUN_HIDING, hidden, "bench", *argv]
        command += ["--output", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
        return json.loads((out / "results.json").read_text())


def optimizers_of(names: str | None, frameworks: Sequence[str]) -> list[str]:
    """``--optimizers NAMES`` for a run of ``frameworks`` (names that exist in none
    of them left out), or nothing for the suite's default."""
    if not names:
        return []
    kept = [
        name
        for name in names.split(",")
        if set(OPTIMIZERS[name].frameworks()) & set(frameworks)
    ]
    return ["--optimizers", ",".join(kept)]


def modes(args: argparse.Namespace) -> dict[str, list[tuple[str, list[str]]]]:
    """Each mode: the (hidden module, argv) of its processes."""
    common = ["--steps", str(args.steps), "--no-progress", "--no-plots"]
    if args.workloads:
        common += ["--workloads", args.workloads]

    def alone(framework: str, *extra: str) -> tuple[str, list[str]]:
        names = optimizers_of(args.optimizers, [framework])
        return OTHER[framework], ["--frameworks", framework, *extra, *common, *names]

    both = optimizers_of(args.optimizers, ["jax", "torch"])
    found = {
        "alone": [alone("jax"), alone("torch")],
        "together": [("-", ["--frameworks", "jax,torch", *common, *both])],
    }
    if args.compare_threads:
        found["threads=1"] = [alone(f, "--threads", "1") for f in ("jax", "torch")]
    return found


def measure(args: argparse.Namespace, log) -> dict[str, Any]:
    """Step times and final losses per mode and round."""
    plan = modes(args)
    step_ms: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    losses: dict[tuple[str, str, str], dict[str, float]] = {}
    environment = None
    for round_ in range(args.rounds):
        order = list(plan) if round_ % 2 == 0 else list(reversed(plan))
        for mode in order:
            for hidden, argv in plan[mode]:
                start = time.perf_counter()
                document = run_bench(hidden, argv)
                log(
                    f"round {round_ + 1} {mode} {argv[1]}: "
                    f"{time.perf_counter() - start:.0f} s"
                )
                environment = environment or document["environment"]
                for run in document["runs"]:
                    key = (run["framework"], run["workload"], run["optimizer"])
                    step_ms.setdefault(key, {}).setdefault(mode, []).append(
                        run["median_step_ms"]
                    )
                    losses.setdefault(key, {})[mode] = run["final_val_loss"]
    rows = []
    for key, by_mode in step_ms.items():
        medians = {mode: statistics.median(v) for mode, v in by_mode.items()}
        rows.append(
            {
                "framework": key[0],
                "workload": key[1],
                "optimizer": key[2],
                "step_ms": medians,
                "together_vs_alone": medians["together"] / medians["alone"],
                "final_val_loss": losses[key],
            }
        )
    return {"environment": environment, "rows": rows}


def report(result: dict[str, Any]) -> str:
    modes_run = list(result["rows"][0]["step_ms"])
    header = ["framework", "workload", "optimizer"]
    header += [f"step ms {m}" for m in modes_run] + ["together / alone"]
    header += [f"val loss {m}" for m in modes_run]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result["rows"]:
        cells = [row["framework"], row["workload"], row["optimizer"]]
        cells += [f"{row['step_ms'][m]:.2f}" for m in modes_run]
        cells.append(f"{row['together_vs_alone']:.2f}")
        cells += [f"{row['final_val_loss'][m]:.6g}" for m in modes_run]
        lines.append("| " + " | ".join(cells) + " |")
    worst = max(result["rows"], key=lambda r: r["together_vs_alone"])
    lines.append(
        f"\nLargest together/alone ratio: {worst['together_vs_alone']:.2f} "
        f"({worst['framework']} {worst['workload']} {worst['optimizer']})."
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all modes")
    parser.add_argument("--workloads", help="comma-separated (default: all)")
    parser.add_argument("--optimizers", help="comma-separated (default: the suite's)")
    parser.add_argument(
        "--compare-threads",
        action="store_true",
        help="also run each framework alone with --threads 1",
    )
    parser.add_argument("--json", help="write the results to this JSON file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = measure(args, log)
    words = sys.argv[1:] if argv is None else list(argv)
    result |= {
        "command": "python benchmarks/bench_threads.py " + " ".join(words),
        "date": started,
        "load_average": os.getloadavg(),
    }
    print(report(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
