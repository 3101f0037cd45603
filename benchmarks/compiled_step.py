"""``torch.compile(optimizer.step)`` of precond's torch optimizers against the
eager step, on the bench's models.

A user who compiles the step (as PyTorch's tutorial on compiled optimizers
shows for ``torch.optim``) gets ``compiled``: precond's steps are left out of
dynamo's tracing (``precond.torch._optimizer.eager_step``), so that is the
eager step behind one graph break. ``traced`` is what the same call did before
that: dynamo traced the step's Python, broke it into graphs at its host syncs
and re-specialised it per bucket, past its recompile limit. Each optimizer
steps the bench's ``digits-mlp`` and ``char-lm`` parameters with fixed random
gradients (``peer_speed.torch_stepper``), the three variants in interleaved
rounds after a warm-up that compiles every kind of step; the table gives the
median round's ms per step, its ratio to eager, the graphs dynamo made and the
warm-up's seconds (its steps and compiles).

Usage::

    python benchmarks/compiled_step.py            # ~3 min on 2 cores
    python benchmarks/compiled_step.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import pathlib
import sys
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch
from benchmarks._common import loadavg
from benchmarks.peer_speed import (
    LEARNING_RATE,
    MODELS,
    measure_pair,
    settle_allocator,
    torch_stepper,
)

import precond.torch as pt

# Kron fitting every step and every 33rd, Pro every step.
CASES = {
    "kron p=1": lambda q: pt.Kron(
        q, lr=LEARNING_RATE, preconditioner_update_probability=1.0
    ),
    "kron p=0.03": lambda q: pt.Kron(
        q, lr=LEARNING_RATE, preconditioner_update_probability=0.03
    ),
    "pro p=1": lambda q: pt.Pro(
        q, lr=LEARNING_RATE, preconditioner_update_probability=1.0
    ),
}


class _Stepping:
    """An object with ``step()`` calling ``step`` (what ``torch_stepper`` calls)."""

    def __init__(self, step):
        self.step = step


def compiled(make):
    """``torch.compile(optimizer.step)``, as a user writes it."""
    return lambda params: _Stepping(torch.compile(make(params).step))


def traced(make):
    """The step compiled with dynamo tracing into it: its function unwrapped
    from torch's hooks, ``no_grad`` and ``eager_step``, run under ``no_grad``."""

    def build(params):
        optimizer = make(params)
        function = inspect.unwrap(type(optimizer).step)
        compiled_step = torch.compile(lambda: function(optimizer))

        def step():
            with torch.no_grad():
                compiled_step()

        return _Stepping(step)

    return build


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def time_case(model: str, name: str, window: int, rounds: int) -> list[dict]:
    make = CASES[name]
    warmup = 36 if "0.03" in name else 3  # a fit and steps without one
    torch._dynamo.reset()
    runs, graphs, warmup_s = {}, {}, {}
    for variant, wrap in (("eager", None), ("compiled", compiled), ("traced", traced)):
        before, start = _graphs(), time.perf_counter()
        runs[variant] = torch_stepper(
            make if wrap is None else wrap(make), model, "cpu", warmup=warmup
        )
        warmup_s[variant] = time.perf_counter() - start
        graphs[variant] = _graphs() - before
    ms = measure_pair(runs, window, rounds)["ms"]
    return [
        {
            "model": model,
            "case": name,
            "variant": variant,
            "ms": ms[variant],
            "x_eager": ms[variant] / ms["eager"],
            "graphs": graphs[variant],
            "warmup_steps": warmup,
            "warmup_s": warmup_s[variant],
        }
        for variant in runs
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="digits-mlp, 2 rounds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    settle_allocator()
    models = ["digits-mlp"] if args.quick else args.models.split(",")
    rounds = 2 if args.quick else args.rounds
    print(f"torch {torch.__version__}, load average at the start: {loadavg()}")
    rows = []
    # Dynamo warns at its recompile limit, which the traced steps reach, and
    # of the lru_caches it traces through in them.
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Dynamo detected")
    for model in models:
        for name in args.cases.split(","):
            window = 10 if "p=1" in name else 100
            rows += time_case(model, name, window, rounds)
            print(f"done: {model} {name}", file=sys.stderr)
    print(f"load average at the end: {loadavg()}\n")
    print(
        "| model | optimizer | variant | ms per step | × eager | dynamo graphs "
        "| warm-up steps | warm-up s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['case']} | {r['variant']} | {r['ms']:.2f} "
            f"| {r['x_eager']:.2f} | {r['graphs']} | {r['warmup_steps']} "
            f"| {r['warmup_s']:.1f} |"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
