"""Compile and step time of ``precond.jax.pro``'s update (or ``--optimizer
affine``'s) on transformer-shaped parameters: the bench's char-lm (2 layers)
and the same layers repeated to ``--layers`` (default 12), not scanned, so
that every layer's weights, biases and norms are separate parameters as in
most model code.

For each model it prints the seconds to trace and lower ``jax.jit(update)``,
to compile it, pro's number of factor stacks, and the median time of the
compiled update (fitting the factors with probability ``--probability``, at a
fixed step, so either always or never; default 0.1: at step 1 it fits).

Usage (compare two checkouts by their ``src`` folders, on a quiet machine)::

    python benchmarks/pro_compile.py
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/pro_compile.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import precond
import precond.jax as pj
from precond.bench.workloads import get_workload


def models(layers: int) -> dict:
    """{name: params}: the char-lm's, and its layers repeated to ``layers``."""
    params = get_workload("char-lm").init_params(0)
    deep = dict(params, layers=[params["layers"][i % 2] for i in range(layers)])
    return {"char-lm": params, f"char-lm, {layers} layers": deep}


# --optimizer: the function and its learning rate.
OPTIMIZERS = {"pro": (pj.pro, 0.02), "affine": (pj.affine, 0.01)}


def measure(name: str, params, probability: float, repeats: int) -> dict:
    make, learning_rate = OPTIMIZERS[name]
    optimizer = make(learning_rate, preconditioner_update_probability=probability)
    state = optimizer.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    start = time.perf_counter()
    lowered = jax.jit(optimizer.update).lower(grads, state, params)
    traced = time.perf_counter()
    update = lowered.compile()
    compiled = time.perf_counter()
    jax.block_until_ready(update(grads, state, params))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(20):
            out = update(grads, state, params)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - begin) / 20 * 1e3)
    return {
        "trace s": traced - start,
        "compile s": compiled - traced,
        "stacks": len(state[0].factors) if name == "pro" else "-",
        "update ms": float(np.median(times)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="pro")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--probability", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{args.optimizer}: precond from {precond.__file__}, jax {jax.__version__}")
    print("| model | parameters | stacks | trace s | compile s | update ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, params in models(args.layers).items():
        row = measure(args.optimizer, params, args.probability, args.repeats)
        size = sum(x.size for x in jax.tree.leaves(params))
        print(
            f"| {name} | {size:,} | {row['stacks']} | {row['trace s']:.2f} "
            f"| {row['compile s']:.2f} | {row['update ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
