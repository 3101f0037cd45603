"""The matrix products Shampoo cannot do without, timed on this machine.

A floor under the step time of any implementation of Google's Shampoo
algorithm on the same blocks (precond's layout, :mod:`precond.jax._shampoo_layout`,
which blocks as Google's does), whatever the rest of its step costs:

- per step, S: the statistics' grams G_b·G_bᵀ along every preconditioned axis
  of every block, and the preconditioning products G_b ×_k P_k (with the
  cutting of the gradients into blocks that they read);
- per root computation, N: the coupled Newton iteration's products (T^p by
  squaring, T^p·M and H·T) on every (K, n, n) stack of statistics, as many
  times as precond's kernel iterates on each statistic after a given number
  of steps on the given gradients, counted row by row (a vmapped while loop,
  precond's and Google's, runs until a stack's last row stops). The iteration
  is Google's, with its start and stopping rule, so an implementation of it
  runs as many, give or take rounding. Statistics of other steps may take
  other counts (the script counts at one number of steps).

Not counted: the power iterations (matrix-vector products), elementwise work,
grafting and momentum. A step with roots every ``interval`` steps costs at least
S + N/interval. Each part is timed as jitted programs (the Newton steps of a
stack in one loop), the median of repeated runs; FLOPs are XLA's cost analysis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from benchmarks._common import median_time
from jax import lax

from precond.jax import distributed_shampoo
from precond.jax._blocks import cut
from precond.jax._shampoo_layout import _precondition_blocks, block_grams, plan_layout
from precond.jax._shampoo_math import _matmul, _matrix_power
from precond.jax._shampoo_state import load
from precond.jax._shampoo_transform import _vmapped_root
from precond.jax.shampoo import _bound_config

# The Newton iteration's cap (``matrix_inverse_pth_root``'s default, Google's).
MAX_NEWTON_ITERATIONS = 100


def _per_step_products(grads, layout, config):
    """The grams and preconditioning products of every block (the grams stand
    in for the roots: only their shapes matter here)."""
    out = []
    for g, plan in zip(grads, layout.plans, strict=True):
        if plan is None:
            continue
        x = g.reshape(plan.merged_shape)
        for group in plan.groups:
            blocks = cut(x, group)
            grams = block_grams(blocks, plan.axes, config.gram_precision)
            roots = [grams[k] for k in plan.axes]
            out.append(_precondition_blocks(blocks, plan.axes, roots, config.precision))
            out.extend(grams.values())
    return out


def _newton_products(t, m, h, p: int, precision):
    """One coupled Newton step's products on (K, n, n) stacks: (T^p·M, H·T)."""
    return (
        _matmul(_matrix_power(t, p, precision), m, precision),
        _matmul(h, t, precision),
    )


def _newton_loop(t, m, h, p: int, precision, iterations: int):
    """``iterations`` Newton steps' products in one program. Each step's T is
    the previous H·T, so that no product is loop-invariant; with orthogonal
    T, M, H every product stays orthogonal: no overflow, no denormals."""

    def step(_, carry):
        t, m, h = carry
        m, h = _newton_products(t, m, h, p, precision)
        return h, m, h

    return lax.fori_loop(0, iterations, step, (t, m, h))


def newton_iterations(stack, p: int, config) -> list[int]:
    """Per row of the (K, n, n) ``stack``, how many Newton steps precond's root
    runs: the fewest allowed steps that give the uncapped root, bit for bit."""
    roots = jax.jit(lambda s, cap: _vmapped_root(p, config, num_iters=cap)(s)[0])
    uncapped = roots(stack, MAX_NEWTON_ITERATIONS)
    counts: list[int | None] = [None] * stack.shape[0]
    for cap in range(MAX_NEWTON_ITERATIONS + 1):
        same = jnp.all(roots(stack, cap) == uncapped, axis=(1, 2)).tolist()
        counts = [
            cap if count is None and equal else count
            for count, equal in zip(counts, same, strict=True)
        ]
        if None not in counts:
            break
    return [MAX_NEWTON_ITERATIONS if c is None else c for c in counts]


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _random_orthogonal(key, shape) -> jax.Array:
    return jnp.linalg.qr(jax.random.normal(key, shape))[0]


def shampoo_floor_ms(
    params, grads, arguments: dict, statistics_steps: int, runs: int = 30
) -> dict:
    """The floor of ``distributed_shampoo(**arguments)`` (its ``eigh`` False,
    no LOBPCG deflation) on ``params``, with the statistics of
    ``statistics_steps`` steps on ``grads``: {'per_step': S ms, 'roots': N ms,
    'per_step_gflop', 'roots_gflop', 'stacks': [(n, p, rows, fewest and most
    Newton iterations of a row)]}."""
    config = _bound_config((), arguments)
    leaves = jax.tree.leaves(grads)
    layout = plan_layout([g.shape for g in leaves], config)
    optimizer = distributed_shampoo(**arguments)
    update = jax.jit(optimizer.update, donate_argnums=1)
    state = optimizer.init(params)
    for _ in range(statistics_steps):
        _, state = update(grads, state, params)
    per_step = _compiled(lambda gs: _per_step_products(gs, layout, config), leaves)
    roots_ms, roots_flops, stacks = 0.0, 0.0, []
    for (n, p), rows, stack in zip(
        layout.keys, layout.rows, state.statistics, strict=True
    ):
        if n == 1:  # a scalar's root is a power, no iteration
            continue
        iterations = newton_iterations(load(stack), p, config)
        most = max(iterations)
        keys = jax.random.split(jax.random.key(n * p), 3)
        stacks_in = [_random_orthogonal(k, stack.shape) for k in keys]
        one_step = _compiled(
            functools.partial(_newton_products, p=p, precision=config.precision),
            *stacks_in,
        )
        loop = _compiled(
            functools.partial(
                _newton_loop, p=p, precision=config.precision, iterations=most
            ),
            *stacks_in,
        )
        # Rows that stop early would spare their products in a row-by-row
        # implementation: the stack's time scaled by mean / most iterations.
        share = sum(iterations) / (most * len(iterations)) if most else 0.0
        loop_ms = 1e3 * median_time(lambda f=loop, a=stacks_in: f(*a), runs)
        roots_ms += share * loop_ms
        roots_flops += share * most * one_step.cost_analysis()["flops"]
        stacks.append((n, p, rows, min(iterations), most))
    per_step_ms = 1e3 * median_time(lambda: per_step(leaves), runs)
    per_step_flops = per_step.cost_analysis()["flops"]
    return {
        "per_step": per_step_ms,
        "roots": roots_ms,
        "per_step_gflop": per_step_flops / 1e9,
        "roots_gflop": roots_flops / 1e9,
        "stacks": stacks,
    }
