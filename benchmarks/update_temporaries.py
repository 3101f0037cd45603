"""The temporaries of JAX Kron's compiled update, and the page faults they cost.

XLA reports how much scratch memory a compiled program needs beside its
arguments and outputs (``compiled.memory_analysis().temp_size_in_bytes``). On a
CPU, XLA maps that memory fresh at every call, so each page a step touches is a
minor page fault (the OS maps in and zeroes it) at every step; on a GPU it
counts in the peak memory. For each case this script prints, per optimizer:

- the temporaries and the arguments (parameters, gradients, state) in MiB;
- the step time and the minor page faults per step (``ru_minflt``), medians
  over rounds in which the case's optimizers alternate, for steps that fit the
  factors (update probability 1) and steps that do not (update probability
  1e-6: the first step fits, the timed ones do not).

Cases: the bench's ``char-lm`` and ``digits-mlp`` parameters with
distributed-kron's math (``peer_speed.DISTRIBUTED_KRON_MATH``), beside
distributed-kron 1.0.0 and beside precond's batched ``lax.map`` over the units;
``kron_update.py``'s 4-layer transformer tree with precond's defaults, for each
``preconditioner_cache`` (its fitting steps take seconds: memory and steps
without a fit only). Last, what faulting in fresh memory costs on this machine.

Run from the repository root, with the ``parity`` extra (distributed-kron)::

    python benchmarks/update_temporaries.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchmarks._common import jax_stepper, machine_info
from benchmarks.kron_update import random_tree, transformer_shapes
from benchmarks.peer_speed import (
    DISTRIBUTED_KRON_MATH,
    _dict_keyed,
    _jax_params,
    measure_pair,
)

MiB = 2**20
NO_FIT = 1e-6  # an update probability whose counter never fits after step 1
# Steps per round: (fitting, without a fit).
WINDOWS = {1.0: 5, NO_FIT: 10}


def _arguments(probability: float) -> dict[str, Any]:
    return dict(
        learning_rate=1e-3,
        weight_decay=1e-4,
        preconditioner_update_probability=probability,
    )


def _precond(**extra) -> Callable[[float], Any]:
    from precond.jax import kron

    return lambda probability: kron(**_arguments(probability), **extra)


def _distributed_kron() -> Callable[[float], Any]:
    from tests import oracles

    original = oracles.distributed_kron()
    return lambda probability: original.kron(**_arguments(probability))


def cases() -> list[dict[str, Any]]:
    """Each case: parameters, gradients, probabilities timed, and its
    optimizers as name -> (make(probability), keyed by index like peer_speed)."""
    same_math = {
        "precond": (_precond(**DISTRIBUTED_KRON_MATH), False),
        "precond, lax_map": (
            _precond(**DISTRIBUTED_KRON_MATH, lax_map_scanned_layers=True),
            False,
        ),
        "distributed-kron": (_distributed_kron(), True),
    }
    shapes = transformer_shapes(4)
    return [
        *(
            {
                "case": f"{model}, distributed-kron's math",
                "trees": _jax_params(model),
                "probabilities": (1.0, NO_FIT),
                "optimizers": same_math,
            }
            for model in ("char-lm", "digits-mlp")
        ),
        {
            "case": "kron_update.py's tree (4 layers)",
            "trees": (random_tree(shapes, 0), random_tree(shapes, 1)),
            "probabilities": (NO_FIT,),
            "optimizers": {
                f"precond, cache {cache}": (
                    _precond(preconditioner_cache=cache),
                    False,
                )
                for cache in ("packed", "dense", None)
            },
        },
    ]


def memory(tx, params, grads) -> dict[str, float]:
    """MiB of temporaries and of arguments of the jitted, donated update at
    update probability 1 (the same program reserves them at any probability)."""
    compiled = (
        jax.jit(tx.update, donate_argnums=1)
        .lower(grads, tx.init(params), params)
        .compile()
    )
    analysis = compiled.memory_analysis()
    assert analysis is not None, "this backend reports no memory analysis"
    return {
        "temporaries_mib": analysis.temp_size_in_bytes / MiB,
        "arguments_mib": analysis.argument_size_in_bytes / MiB,
    }


def fault_cost(mib: int = 178, tries: int = 5) -> list[float]:
    """ms to write one byte per page of ``mib`` MiB of freshly mapped memory."""
    costs = []
    for _ in range(tries):
        block = mmap.mmap(-1, mib * MiB)
        pages = np.frombuffer(block, dtype=np.uint8)
        start = time.perf_counter()
        pages[:: mmap.PAGESIZE] = 1
        costs.append(1e3 * (time.perf_counter() - start))
        del pages
        block.close()
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"machine": machine_info(), "rows": []}
    print(
        "| case | optimizer | temporaries MiB | arguments MiB | setting | ms/step "
        "| page faults/step | MiB faulted/step |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for case in cases():
        params, grads = case["trees"]
        keyed = (_dict_keyed(params), _dict_keyed(grads))
        sizes = {}
        for name, (make, by_index) in case["optimizers"].items():
            p, g = keyed if by_index else (params, grads)
            sizes[name] = memory(make(1.0), p, g)
        for probability in case["probabilities"]:
            runs = {}
            for name, (make, by_index) in case["optimizers"].items():
                p, g = keyed if by_index else (params, grads)
                runs[name] = jax_stepper(make(probability), p, g)
            timed = measure_pair(runs, WINDOWS[probability], args.rounds)
            setting = "fitting" if probability == 1.0 else "without a fit"
            for name in runs:
                row = {
                    "ms": timed["ms"][name],
                    "faults": timed["page_faults_per_step"][name],
                }
                mem, faulted = sizes[name], row["faults"] * mmap.PAGESIZE / MiB
                result["rows"].append(
                    {"case": case["case"], "optimizer": name, "setting": setting}
                    | mem
                    | row
                )
                print(
                    f"| {case['case']} | {name} | {mem['temporaries_mib']:.1f} "
                    f"| {mem['arguments_mib']:.1f} | {setting} | {row['ms']:.1f} "
                    f"| {row['faults']:.0f} | {faulted:.0f} |",
                    flush=True,
                )
    costs = fault_cost()
    result["fault_cost_ms_178_mib"] = costs
    print(
        "\nwriting one byte per page of 178 MiB of fresh memory: "
        + ", ".join(f"{c:.1f}" for c in costs)
        + " ms"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
