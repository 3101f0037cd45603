"""Step time against the packages precond replaces, on the bench's models.

For each pair (precond's optimizer, the original it replaces), built with the
same arguments (the originals' defaults, float32 everywhere, the same
preconditioner update probability or root interval):

- ``jax-kron``: ``precond.jax.kron`` vs distributed-kron 1.0.0's ``kron``, both
  with the same arguments (what a user who changes the import gets: precond's
  defaults keep each block's own size and merge dims by a balanced rule, where
  distributed-kron pads every axis to a multiple of ``block_size``);
- ``jax-kron-same-math``: the same, with precond given ``merge_rule``,
  ``block_padding`` and ``noise_draws`` ``'distributed_kron'``: distributed-kron's
  factor shapes, padding and draws, so that both compute the same updates (the
  parity tests' setting), and ``preconditioner_cache=None``: distributed-kron's
  storage (Q alone, applied as Qᵀ(Q·G)), so that the caching is equal too and the
  ratio is the implementation's alone;
- ``torch-kron``: ``precond.torch.Kron`` vs kron-torch 0.1.0's ``Kron``;
- ``torch-kron-heavyball`` (not in the default ``--pairs``; it needs the
  ``peers`` extra): ``precond.torch.Kron`` vs HeavyBall 3.2.1's ``PSGDKron``,
  which compiles its kernels with ``torch.compile`` by default, given
  kron-torch's values where HeavyBall's defaults differ
  (``max_size_triangular=8192``, ``precond_init_scale=1.0``) and warmed up past
  its first fit, so that its compilation is not timed;
- ``shampoo``: ``precond.jax.distributed_shampoo`` vs Google's (optax-shampoo
  0.0.6's ``distributed_shampoo``), block size 128, at
  ``preconditioning_compute_steps`` 1 and 33, and with roots at step 0 only
  ("roots never": the per-step part, statistics, preconditioning and grafting,
  alone);

on the parameters of the bench's ``digits-mlp`` and ``char-lm`` (the JAX
workloads' ``init_params``; the same shapes as ``torch_models``' modules), with
fixed random gradients.

For ``torch-kron`` a second table gives each side's time per step in matrix
products and triangular solves (their operators' self time under
``torch.profiler``, one window after the timed rounds), and that time for
precond over the original's whole step: the ratio precond would reach if the
rest of its step took no time; and the operators each side dispatches per step
(top-level ``aten::`` calls in the same window), the count that fixes the
per-operator overhead of small models.

A third table gives, for ``torch-kron``, a floor under any implementation of
kron-torch's algorithm (``benchmarks/_torch_kron_floor.py``): a program with
only the momentum, the fit's and the preconditioning's products and the
clamped update, on stacked state, eager and through ``torch.compile``, timed in
the pair's rounds, over kron-torch's step.

For ``shampoo`` a second table gives the floor of Google's algorithm on these
blocks (``benchmarks/_shampoo_floor.py``): the time of its matrix products
alone (per step: the statistics and the preconditioning; per root computation:
the coupled Newton iterations the statistics take), timed as jitted programs,
and that floor over the original's step, which no implementation of the same
algorithm reaches on this machine with XLA's matrix products.

Protocol: each optimizer's update (JAX: ``jax.jit`` with the state donated;
torch: ``optimizer.step()``, the gradients set before each step) runs a fixed
number of steps per round (20 at Kron's update probability 1, where every step
fits the factors; 200 at 0.03, so that a round holds the fits each optimizer
draws; 5 for Shampoo's roots every step, 66 for every 33 steps), the two
optimizers of a pair (and the torch-kron pair's floors) alternating round by
round (``--rounds``), and the time per step is the median over rounds of each
round's mean. The ratio precond/original is
the number issue [6 of 6] sets targets for (≤ 0.5 for Kron, ≤ 0.2 for Shampoo).
Before any pair, the process allocates and frees one 16 MiB block
(:func:`settle_allocator`), so that glibc's malloc keeps the steps' temporaries
on its heap whatever ran before; the torch pairs' minor page faults per step
are printed last, to show that no step paid them.

The originals are the test oracles (the ``parity`` extra; distributed-kron is
imported as ``tests/oracles.py`` does); HeavyBall comes with the ``peers`` extra.

Usage::

    python benchmarks/peer_speed.py                    # the four pairs, ~12 min
    python benchmarks/peer_speed.py --pairs torch-kron-heavyball
    python benchmarks/peer_speed.py --pairs jax-kron --models char-lm
    python benchmarks/peer_speed.py --quick            # smoke run
    python benchmarks/peer_speed.py --json out.json
    python benchmarks/peer_speed.py --pairs torch-kron --unsettled-allocator
    python benchmarks/peer_speed.py --torch-device cuda   # torch pairs on the GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import jax_stepper, machine_info

LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4
DEFAULT_PAIRS = ("jax-kron", "jax-kron-same-math", "torch-kron", "shampoo")
PAIRS = (*DEFAULT_PAIRS, "torch-kron-heavyball")
MODELS = ("digits-mlp", "char-lm")
SHAMPOO_BLOCK = 128
# A root interval no run reaches: roots at step 0 only, so that the steps timed
# are Shampoo's per-step part (statistics, preconditioning, grafting) alone.
NEVER = 10**9
# The Shampoo floor counts Newton iterations on the statistics after as many
# steps as the roots-every-step run takes (2 warm-up steps, 7 rounds of 5).
FLOOR_STATISTICS_STEPS = 2 + 7 * 5


# ----------------------------------------------------------------- steppers


def _jax_params(model: str):
    from precond.bench.workloads import get_workload

    params = get_workload(model).init_params(0)
    keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    grads = [
        jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return params, treedef.unflatten(grads)


def _dict_keyed(tree):
    """The leaves as a flat dict (distributed-kron 1.0.0's ``kron`` reads a key
    from every path entry, and the char-lm's layers are lists)."""
    return {f"{i:05d}": x for i, x in enumerate(jax.tree.leaves(tree))}


def torch_stepper(
    make, model: str, device: str, warmup: int = 2
) -> Callable[[int], None]:
    """``run(n)``: n ``step()`` calls of ``make(parameters)`` on the bench's torch
    ``model`` on ``device`` with fixed random gradients, after ``warmup`` steps;
    on a GPU, ``run`` returns once the device has finished them."""
    import torch

    from precond.bench.torch_models import build_model
    from precond.bench.workloads import get_workload

    module = build_model(get_workload(model).torch_model, 0).to(device)
    parameters = [p for p in module.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1)
    grads = [
        torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device)
        for p in parameters
    ]
    optimizer = make(parameters)

    def run(n: int) -> None:
        for _ in range(n):
            # Set before every step, as backward would: HeavyBall consumes them
            # (sets .grad to None in its step).
            for p, g in zip(parameters, grads, strict=True):
                p.grad = g
            optimizer.step()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    run(warmup)
    return run


# --------------------------------------------------------------------- pairs


def _kron_arguments(probability: float) -> dict[str, Any]:
    return dict(
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        preconditioner_update_probability=probability,
    )


# precond's keyword-only arguments that make its factor shapes, padding and draws
# distributed-kron's: the same updates (tests/jax/test_parity_distributed_kron.py),
# and its storage: Q alone, no cached QᵀQ (equal caching on both sides).
DISTRIBUTED_KRON_MATH = dict(
    merge_rule="distributed_kron",
    block_padding="distributed_kron",
    noise_draws="distributed_kron",
    preconditioner_cache=None,
)


def jax_kron_pair(
    model: str, probability: float, same_math: bool = False
) -> dict[str, Callable]:
    """With ``same_math``, precond runs with :data:`DISTRIBUTED_KRON_MATH`."""
    from tests import oracles

    from precond.jax import kron

    original = oracles.distributed_kron()
    params, grads = _jax_params(model)
    keyed_params, keyed_grads = _dict_keyed(params), _dict_keyed(grads)
    arguments = _kron_arguments(probability)
    ours = arguments | (DISTRIBUTED_KRON_MATH if same_math else {})
    return {
        "precond": lambda: jax_stepper(kron(**ours), params, grads),
        "original": lambda: jax_stepper(
            original.kron(**arguments), keyed_params, keyed_grads
        ),
    }


# The torch-kron pair's floor programs (benchmarks/_torch_kron_floor.py), timed
# in the pair's rounds: name -> compiled.
FLOORS = {"floor": False, "compiled floor": True}


def _torch_kron_arguments(probability: float) -> dict[str, Any]:
    """The torch Kron pairs' shared arguments (kron-torch's names)."""
    return dict(
        lr=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        preconditioner_update_probability=probability,
    )


def torch_kron_pair(model: str, probability: float, device: str) -> dict[str, Callable]:
    import torch
    from benchmarks._torch_kron_floor import KronFloor, warmup_steps
    from tests import oracles

    import precond.torch as pt

    original = oracles.kron_torch()
    arguments = _torch_kron_arguments(probability)
    torch.manual_seed(0)
    return {
        "precond": lambda: torch_stepper(
            lambda p: pt.Kron(p, **arguments), model, device
        ),
        "original": lambda: torch_stepper(
            lambda p: original.Kron(p, **arguments), model, device
        ),
        # benchmarks/_torch_kron_floor.py: what no implementation undercuts.
        **{
            name: lambda compiled=compiled: torch_stepper(
                lambda p: KronFloor(p, **arguments, compiled=compiled),
                model,
                device,
                warmup_steps(probability),
            )
            for name, compiled in FLOORS.items()
        },
    }


def heavyball_pair(model: str, probability: float, device: str) -> dict[str, Callable]:
    """precond's Kron against HeavyBall's compiled PSGDKron (reported in the
    "original" column)."""
    import precond.torch as pt

    try:
        import heavyball
    except ModuleNotFoundError as error:
        raise SystemExit(
            "--pairs torch-kron-heavyball needs HeavyBall: pip install -e '.[peers]'"
        ) from error
    arguments = _torch_kron_arguments(probability)
    # kron-torch's values (precond's defaults) where HeavyBall's differ.
    theirs = arguments | dict(max_size_triangular=8192, precond_init_scale=1.0)
    # HeavyBall fits when its running sum of p passes an integer: past ceil(1/p)
    # steps its fit is compiled too.
    warmup = math.ceil(1 / probability) + 2
    return {
        "precond": lambda: torch_stepper(
            lambda p: pt.Kron(p, **arguments), model, device
        ),
        "original": lambda: torch_stepper(
            lambda p: heavyball.PSGDKron(p, **theirs), model, device, warmup
        ),
    }


def _shampoo_arguments(interval: int) -> dict[str, Any]:
    """The Shampoo pair's arguments, roots every ``interval`` steps."""
    return dict(
        learning_rate=LEARNING_RATE,
        block_size=SHAMPOO_BLOCK,
        preconditioning_compute_steps=interval,
        start_preconditioning_step=1,
        # 0.0.6's default differs from the seed's (precond's): set both.
        merge_small_dims_block_size=SHAMPOO_BLOCK,
    )


def shampoo_pair(model: str, interval: int) -> dict[str, Callable]:
    from tests.jax.test_parity_shampoo import patched_optax_shampoo

    import precond.jax as pj

    # The oracle with the parity tests' shims for today's JAX, left applied.
    original = next(patched_optax_shampoo())
    params, grads = _jax_params(model)
    arguments = _shampoo_arguments(interval)
    return {
        "precond": lambda: jax_stepper(
            pj.distributed_shampoo(**arguments), params, grads
        ),
        "original": lambda: jax_stepper(
            original.distributed_shampoo(**arguments), params, grads
        ),
    }


def cases(
    pairs, models, torch_device: str = "cpu"
) -> list[tuple[str, str, str, Any, int, Callable]]:
    """(pair, model, setting, its value, steps per round, make the pair's
    steppers) for every case asked; the torch pairs on ``torch_device``."""
    # (label, argument, steps per round): a round of a rare event (a fit at
    # p = 0.03, a root every 33 steps) holds several of them.
    settings = {
        "jax-kron": [("p=1", 1.0, 20), ("p=0.03", 0.03, 200)],
        "jax-kron-same-math": [("p=1", 1.0, 20), ("p=0.03", 0.03, 200)],
        "torch-kron": [("p=1", 1.0, 20), ("p=0.03", 0.03, 200)],
        "torch-kron-heavyball": [("p=1", 1.0, 20), ("p=0.03", 0.03, 200)],
        "shampoo": [
            ("roots every 1", 1, 5),
            ("roots every 33", 33, 66),
            # Roots at step 0 only (in the warm-up): the per-step part alone.
            ("roots never", NEVER, 66),
        ],
    }
    makers = {
        "jax-kron": jax_kron_pair,
        "jax-kron-same-math": lambda m, v: jax_kron_pair(m, v, same_math=True),
        "torch-kron": functools.partial(torch_kron_pair, device=torch_device),
        "torch-kron-heavyball": functools.partial(heavyball_pair, device=torch_device),
        "shampoo": shampoo_pair,
    }
    return [
        (
            pair,
            model,
            label,
            value,
            window,
            lambda p=pair, m=model, v=value: makers[p](m, v),
        )
        for pair in pairs
        for model in models
        for label, value, window in settings[pair]
    ]


# ------------------------------------------------------------------- protocol


def _minor_page_faults() -> int:
    """The process's minor page faults so far: each is a fresh page of memory
    the OS maps in (and zeroes) when it is first touched."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# A block as large as a small training step's activations: once freed, glibc's
# malloc keeps up to twice its size of freed memory on its heap (see
# settle_allocator).
SETTLING_BLOCK_BYTES = 16 * 2**20


def settle_allocator() -> None:
    """Allocates and frees one 16 MiB block, as a training loop's backward pass
    frees its activations, so that every optimizer is measured in the same
    allocator state, whatever ran before in this process.

    glibc's malloc returns freed memory at the top of its heap to the OS once it
    exceeds twice the largest block freed so far, and gets it back at the next
    step page by page (each a minor page fault, the page zeroed by the OS). In a
    fresh process that threshold is small: a step whose temporaries exceed it
    then faults on every step, which precond's stacked temporaries did on the
    char-lm when it ran alone, and did not after the digits-mlp's pairs
    (BENCHMARKS.md, "torch Kron: page faults"). Other allocators ignore this."""
    import torch

    torch.ones(SETTLING_BLOCK_BYTES // 4)  # freed at once


def measure_pair(runs: dict[str, Callable], window: int, rounds: int) -> dict:
    """Median over ``rounds`` of each round's mean seconds per step, the
    optimizers alternating round by round (the first one alternating too); and
    the median of each round's minor page faults per step. ``ratio`` is
    precond's over the original's, when ``runs`` names both."""
    per_round: dict[str, list[float]] = {name: [] for name in runs}
    faults: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            faults_before = _minor_page_faults()
            start = time.perf_counter()
            runs[name](window)
            per_round[name].append((time.perf_counter() - start) / window)
            faults[name].append((_minor_page_faults() - faults_before) / window)
    medians = {name: statistics.median(t) for name, t in per_round.items()}
    return {
        "ms": {name: 1e3 * s for name, s in medians.items()},
        "ratio": medians["precond"] / medians["original"]
        if {"precond", "original"} <= medians.keys()
        else None,
        "spread": {name: [1e3 * min(t), 1e3 * max(t)] for name, t in per_round.items()},
        "page_faults_per_step": {
            name: statistics.median(f) for name, f in faults.items()
        },
    }


# The torch operators that do a step's matrix products and triangular solves.
MATMUL_OPERATORS = frozenset(
    {
        "aten::mm",
        "aten::bmm",
        "aten::addmm",
        "aten::baddbmm",
        "aten::linalg_solve_triangular",
    }
)


def torch_step_profile(
    runs: dict[str, Callable], window: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Per optimizer, over one window under ``torch.profiler``: the milliseconds
    per step that its matmuls and triangular solves take (their operators' self
    CPU time), a floor under its step time whatever the rest costs; and the
    operators it dispatches per step from Python (``aten::`` calls not made by
    another ``aten::`` call), each a fixed cost however small its tensors."""
    from torch.profiler import profile

    floors, dispatches = {}, {}
    for name, run in runs.items():
        with profile() as prof:
            run(window)
        self_us = sum(
            event.self_cpu_time_total
            for event in prof.key_averages()
            if event.key in MATMUL_OPERATORS
        )
        floors[name] = self_us / 1e3 / window
        dispatches[name] = (
            sum(
                event.name.startswith("aten::")
                and not (
                    event.cpu_parent and event.cpu_parent.name.startswith("aten::")
                )
                for event in prof.events()
            )
            / window
        )
    return floors, dispatches


@functools.cache
def _shampoo_floor(model: str) -> dict:
    from benchmarks._shampoo_floor import shampoo_floor_ms

    params, grads = _jax_params(model)
    return shampoo_floor_ms(
        params, grads, _shampoo_arguments(1), FLOOR_STATISTICS_STEPS
    )


def shampoo_floor_of_step(model: str, interval: int) -> dict:
    """The Shampoo pair's floor (benchmarks/_shampoo_floor.py) for a step with
    roots every ``interval`` steps: S + N/interval ms (S alone for NEVER)."""
    floor = _shampoo_floor(model)
    roots = 0.0 if interval == NEVER else floor["roots"] / interval
    return floor | {"step": floor["per_step"] + roots}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs",
        default=",".join(DEFAULT_PAIRS),
        help=f"comma-separated, from {', '.join(PAIRS)}",
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 short rounds")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--torch-device",
        default="cpu",
        help="the torch pairs' device (cpu, cuda); the JAX pairs run on JAX's default",
    )
    parser.add_argument(
        "--unsettled-allocator",
        action="store_true",
        help="skip settle_allocator(), to see the page faults it prevents",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rounds = 2 if args.quick else args.rounds
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown:
        raise SystemExit(f"unknown --pairs {unknown}: choose from {PAIRS}")
    if not args.unsettled_allocator:
        settle_allocator()
    on_gpu = torch.device(args.torch_device).type == "cuda"
    info = machine_info() | {
        "torch": torch.__version__,
        "torch_device": torch.cuda.get_device_name(args.torch_device)
        if on_gpu
        else args.torch_device,
        "rounds": rounds,
        "allocator_settled": not args.unsettled_allocator,
    }
    print(json.dumps(info, indent=1))
    print("| pair | model | setting | precond ms | original ms | precond / original |")
    print("|---|---|---|---:|---:|---:|")
    rows = []
    models = args.models.split(",")
    for pair, model, label, value, window, make in cases(
        pairs, models, args.torch_device
    ):
        window = min(window, 3) if args.quick else window
        runs = {name: start() for name, start in make().items()}
        result = measure_pair(runs, window, rounds)
        # On a GPU the profiler's CPU times are launches, not products.
        if pair.startswith("torch-kron") and not on_gpu:
            result["matmul_ms"], result["ops_per_step"] = torch_step_profile(
                {name: runs[name] for name in ("precond", "original")}, window
            )
        if pair == "shampoo":
            result["floor_ms"] = shampoo_floor_of_step(model, value)
        ms = result["ms"]
        print(
            f"| {pair} | {model} | {label} | {ms['precond']:.2f} | "
            f"{ms['original']:.2f} | {result['ratio']:.2f} |",
            flush=True,
        )
        rows.append(
            {"pair": pair, "model": model, "setting": label, "window": window} | result
        )
    floors = [row for row in rows if "matmul_ms" in row]
    if floors:
        print_matmul_floors(floors)
    kron_floors = [row for row in rows if "floor" in row["ms"]]
    if kron_floors:
        print_kron_floors(kron_floors)
    torch_rows = [row for row in rows if row["pair"].startswith("torch-kron")]
    if torch_rows and not on_gpu:
        print_page_faults(torch_rows)
    shampoo_floors = [row for row in rows if "floor_ms" in row]
    if shampoo_floors:
        print_shampoo_floors(shampoo_floors)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}))
    return 0


def print_matmul_floors(rows: list[dict]) -> None:
    """The torch pairs' matmul-and-solve time per step, and the ratio precond
    would reach if nothing but its matmuls and solves took time."""
    print()
    print(
        "| pair | model | setting | precond matmul ms | original matmul ms "
        "| precond matmul / original step | precond ops/step | original ops/step |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        floor, ops = row["matmul_ms"], row["ops_per_step"]
        print(
            f"| {row['pair']} | {row['model']} | {row['setting']} | "
            f"{floor['precond']:.2f} | {floor['original']:.2f} | "
            f"{floor['precond'] / row['ms']['original']:.2f} | "
            f"{ops['precond']:.0f} | {ops['original']:.0f} |",
            flush=True,
        )


def print_kron_floors(rows: list[dict]) -> None:
    """The torch-kron pair's floor programs (benchmarks/_torch_kron_floor.py),
    eager and compiled, over kron-torch's step: the ratio no implementation of
    kron-torch's algorithm reaches on this machine; precond's beside them."""
    print()
    print(
        "| pair | model | setting | floor ms | compiled floor ms | original ms "
        "| floor / original | compiled floor / original | precond / original |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ms = row["ms"]
        eager, compiled = (ms[name] for name in FLOORS)
        print(
            f"| {row['pair']} | {row['model']} | {row['setting']} | {eager:.2f} | "
            f"{compiled:.2f} | {ms['original']:.2f} | {eager / ms['original']:.2f} | "
            f"{compiled / ms['original']:.2f} | {row['ratio']:.2f} |",
            flush=True,
        )


def print_page_faults(rows: list[dict]) -> None:
    """The torch pairs' minor page faults per step (median of the rounds):
    pages the allocator got anew from the OS, zeroed on first touch; whether a
    step pays them depends on the allocator's state (:func:`settle_allocator`)."""
    print()
    names = list(dict.fromkeys(n for row in rows for n in row["page_faults_per_step"]))
    print(
        "| pair | model | setting | "
        + " | ".join(f"{n} faults/step" for n in names)
        + " |"
    )
    print("|---|---|---|" + "---:|" * len(names))
    for row in rows:
        faults = row["page_faults_per_step"]
        cells = " | ".join(f"{faults[n]:.0f}" if n in faults else "" for n in names)
        print(
            f"| {row['pair']} | {row['model']} | {row['setting']} | {cells} |",
            flush=True,
        )


def print_shampoo_floors(rows: list[dict]) -> None:
    """The Shampoo pair's floor (benchmarks/_shampoo_floor.py): the matrix
    products of Google's algorithm on precond's blocks, and that floor over the
    original's step, the ratio no implementation of the algorithm whose products
    run at XLA's speed reaches on this machine; then the Newton iterations per
    stack of statistics (n×n, root p, rows: fewest–most of a row)."""
    print()
    print(
        "| pair | model | setting | products per step: GFLOP, ms | products per "
        "root computation: GFLOP, ms | floor ms | original ms "
        "| floor / original step |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        floor = row["floor_ms"]
        print(
            f"| {row['pair']} | {row['model']} | {row['setting']} | "
            f"{floor['per_step_gflop']:.3f}, {floor['per_step']:.2f} | "
            f"{floor['roots_gflop']:.2f}, {floor['roots']:.1f} | "
            f"{floor['step']:.2f} | {row['ms']['original']:.2f} | "
            f"{floor['step'] / row['ms']['original']:.2f} |",
            flush=True,
        )
    print()
    for model in dict.fromkeys(row["model"] for row in rows):
        stacks = _shampoo_floor(model)["stacks"]
        iterations = ", ".join(
            f"{n}×{n} p={p} ×{k}: {low}" + (f"–{high}" if high != low else "")
            for n, p, k, low, high in stacks
        )
        print(f"Newton iterations, {model}: {iterations}")


if __name__ == "__main__":
    raise SystemExit(main())
