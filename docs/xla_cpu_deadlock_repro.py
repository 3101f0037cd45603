"""A standalone JAX program (no precond) that hangs XLA:CPU (jaxlib 0.10), in a
form for the JAX tracker: the hang that precond's programs avoid by making no
batched LAPACK call (``precond.jax._core.pool_safe_linalg``).

The program is one jitted function with seven independent chains of batched
triangular solves and matmuls (the shape of PSGD Kron's factor update of a small
transformer), called repeatedly.

Seen with jax/jaxlib 0.10.2 on a 2-core machine (2026-11-25), clean ``XLA_FLAGS``:
it hung in 3 of 3 runs, within the first two calls, every thread idle in a futex
wait. gdb showed two threads inside ``lapack_strsm_ffi`` →
``jax::TriMatrixEquationSolver`` → ``jax::ParallelBatchMap`` waiting on a
``BlockingCounter`` for batch tasks, while every worker of the intra-op Eigen pool
sat in ``WaitForWork``: the batched solves wait for pool work that never runs.
With ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` (independent
chains not run concurrently) the same program runs every call (300 of 300).
jaxlib's source has since stopped splitting LAPACK batches over the pool in
open-source builds; the released jaxlib 0.10.x still splits them.

Usage (each command sets XLA_FLAGS itself; a call that never returns is the hang):
    XLA_FLAGS= timeout 120 python docs/xla_cpu_deadlock_repro.py
    XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false \\
        timeout 600 python docs/xla_cpu_deadlock_repro.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

# (stack, n): factors of a 4-layer transformer with d_model 128, vocab 96.
CHAINS = [(4, 128), (4, 384), (4, 128), (8, 128), (8, 512), (1, 96), (1, 128)]


def factor_update(q, g, v):
    """One chain: Q ← Q − 0.1·triu(A Aᵀ − B Bᵀ)Q, A = Q g, B = Q⁻ᵀ v (batched)."""
    a = q @ g
    b = solve_triangular(q, v, lower=False, trans=1)
    step = jnp.triu(a @ a.mT - b @ b.mT)
    scale = 0.1 / (jnp.max(jnp.abs(step), axis=(-2, -1), keepdims=True) + 1e-30)
    return q - scale * step @ q


@jax.jit
def update_all(qs, gs, vs):
    return [factor_update(q, g, v) for q, g, v in zip(qs, gs, vs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    key = jax.random.key(0)
    qs, gs, vs = [], [], []
    for k, n in CHAINS:
        key, a, b = jax.random.split(key, 3)
        qs.append(jnp.broadcast_to(jnp.eye(n), (k, n, n)))
        gs.append(jax.random.normal(a, (k, n, n)))
        vs.append(jax.random.normal(b, (k, n, n)))
    start = time.perf_counter()
    for call in range(args.calls):
        t = time.perf_counter()
        qs = update_all(qs, gs, vs)
        jax.block_until_ready(qs)
        if call % 100 == 0 or time.perf_counter() - t > 10:
            print(f"call {call}: {time.perf_counter() - t:.3f} s", flush=True)
    print(f"done: {args.calls} calls in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
