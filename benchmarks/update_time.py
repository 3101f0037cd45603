"""The update alone of every JAX optimizer beside AdamW, on the bench's models.

Each optimizer's ``update`` is jitted with its state donated and fed back, on
the parameters of the bench's ``digits-mlp`` and ``char-lm`` (as
``peer_speed.py``: fixed random gradients), at each preconditioner update
probability of ``--probabilities`` (Shampoo: roots every round(1/p) steps).
AdamW and the optimizers run in interleaved rounds of ``--steps`` updates; the
table gives the median round's time per update and its ratio to AdamW's in
the same run. Run it once per checkout (``PYTHONPATH=<checkout>/src``) to
compare two, alternating the checkouts.

Usage::

    python benchmarks/update_time.py                    # ~4 min on 2 cores
    python benchmarks/update_time.py --optimizers lra,pro --probabilities 0.1
    python benchmarks/update_time.py --quick            # smoke run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


import optax
from benchmarks._common import jax_stepper, loadavg, machine_info
from benchmarks.peer_speed import (
    LEARNING_RATE,
    MODELS,
    _jax_params,
    _shampoo_arguments,
)

import precond.jax as pj


def _probability_optimizer(make):
    return lambda p: make(LEARNING_RATE, preconditioner_update_probability=p)


OPTIMIZERS = {
    "kron": _probability_optimizer(pj.kron),
    "pro": _probability_optimizer(pj.pro),
    "xmat": _probability_optimizer(pj.xmat),
    "lra": _probability_optimizer(pj.lra),
    "affine": _probability_optimizer(pj.affine),
    # peer_speed.py's Shampoo (block 128, preconditioning from step 1).
    "shampoo": lambda p: pj.distributed_shampoo(
        **_shampoo_arguments(max(round(1 / p), 1))
    ),
}


def time_model(model: str, names, probabilities, steps: int, rounds: int) -> list:
    """Rows (model, optimizer, p, ms, × AdamW) of one model's interleaved rounds."""
    params, grads = _jax_params(model)
    runs = {("adamw", None): jax_stepper(optax.adamw(LEARNING_RATE), params, grads)}
    for name in names:
        for p in probabilities:
            runs[name, p] = jax_stepper(OPTIMIZERS[name](p), params, grads)
    times: dict = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            start = time.perf_counter()
            run(steps)
            times[key].append((time.perf_counter() - start) / steps * 1e3)
    adamw = statistics.median(times["adamw", None])
    return [
        (model, name, p, statistics.median(t), statistics.median(t) / adamw)
        for (name, p), t in times.items()
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--probabilities", default="1,0.1")
    parser.add_argument("--steps", type=int, default=30, help="updates per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    names = args.optimizers.split(",")
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        raise SystemExit(f"--optimizers: unknown {unknown}; known: {list(OPTIMIZERS)}")
    probabilities = [float(p) for p in args.probabilities.split(",")]
    steps, rounds = (5, 2) if args.quick else (args.steps, args.rounds)
    info = machine_info()
    print(json.dumps(info, indent=1))
    rows = []
    for model in args.models.split(","):
        rows += time_model(model, names, probabilities, steps, rounds)
    print(f"\nload average at the end: {loadavg()}\n")
    print("| model | optimizer | p | ms per update | × AdamW |")
    print("|---|---|---:|---:|---:|")
    for model, name, p, ms, ratio in rows:
        shown = "–" if p is None else p
        print(f"| {model} | {name} | {shown} | {ms:.3f} | {ratio:.2f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
