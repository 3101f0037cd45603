"""What precond's normal draws save: ``jax.random.normal`` against
``precond.jax._normal_draws.standard_normal`` (the same Threefry bits, the hash
unrolled), alone and inside the optimizer updates that draw.

Measures, in one process, interleaved (rounds of every case, the order reversed
every other round), the median wall time of jitted calls:

1. a draw of n float32 normals, n = the bench char-lm's parameter count and a
   2048 × 2048 layer's 4.2M;
2. one update (``tx.update`` and ``optax.apply_updates``, jitted, the state fed
   back) that fits the preconditioner, on the bench's char-lm parameters:
   ``precond.jax.pro`` (its defaults, and with ``draws='compact'``) and
   ``precond.jax.kron`` (``preconditioner_update_probability=1``); and
   ``kron`` on one 2048 × 2048 layer;

each with the draws of ``jax.random.normal`` and with precond's: the benchmark
swaps ``_normal_draws.standard_normal``, which the fits of Kron and pro call
(:func:`draws_of`). Ratios are precond's time over ``jax.random.normal``'s.

Usage::

    python benchmarks/normal_draws.py            # ~3 min on 2 cores
    python benchmarks/normal_draws.py --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from _common import machine_info
from precond.bench.report import write_json
from precond.bench.workloads import get_workload
from precond.jax import _normal_draws, kron, pro

DRAWS = {
    "jax.random.normal": jax.random.normal,
    "precond": _normal_draws.standard_normal,
}


@contextlib.contextmanager
def draws_of(draw):
    """Kron's and pro's fits draw with ``draw`` in the jit traces made inside the
    block (they call ``_normal_draws.standard_normal``)."""
    ours = _normal_draws.standard_normal
    _normal_draws.standard_normal = draw
    try:
        yield
    finally:
        _normal_draws.standard_normal = ours


def draw_case(n: int, draw) -> Callable:
    compiled = (
        jax.jit(lambda k: draw(k, (n,), jnp.float32))
        .lower(jax.random.PRNGKey(0))
        .compile()
    )
    key = jax.random.PRNGKey(1)
    return lambda: compiled(key)


def update_case(tx, params, draw) -> Callable:
    """One fitting update of ``tx`` from a fixed gradient, its state fed back."""
    grads = jax.tree.map(lambda p: jnp.cos(p) * 1e-2, params)
    with draws_of(draw):
        state = tx.init(params)
        step = jax.jit(
            lambda s: (lambda u, s: (optax.apply_updates(params, u), s))(
                *tx.update(grads, s, params)
            )
        )
        compiled = step.lower(state).compile()
    box = [state]

    def run():
        _, box[0] = compiled(box[0])
        return box[0]

    return run


def cases() -> dict[str, dict[str, Callable]]:
    charlm = get_workload("char-lm").init_params(0)
    layer = {"w": jax.random.normal(jax.random.PRNGKey(2), (2048, 2048)) * 0.02}
    optimizers = {
        "pro, char-lm": (lambda: pro(0.02), charlm),
        "pro draws='compact', char-lm": (lambda: pro(0.02, draws="compact"), charlm),
        "kron p=1, char-lm": (
            lambda: kron(0.01, preconditioner_update_probability=1.0),
            charlm,
        ),
        "kron p=1, 2048x2048": (
            lambda: kron(0.01, preconditioner_update_probability=1.0),
            layer,
        ),
    }
    out = {}
    sizes = {
        "char-lm's": sum(x.size for x in jax.tree.leaves(charlm)),
        "2048²": 2048**2,
    }
    for label, n in sizes.items():
        out[f"draw, {n / 1e6:.2f}M normals ({label})"] = {
            d: draw_case(n, f) for d, f in DRAWS.items()
        }
    for label, (make, params) in optimizers.items():
        out[f"update, {label}"] = {
            d: update_case(make(), params, f) for d, f in DRAWS.items()
        }
    return out


def measure(table, rounds: int, calls: int) -> dict[str, dict[str, float]]:
    jobs = [(case, draw) for case in table for draw in DRAWS]
    times = {job: [] for job in jobs}
    for job in jobs:
        jax.block_until_ready(table[job[0]][job[1]]())
    for r in range(rounds):
        for case, draw in jobs if r % 2 == 0 else reversed(jobs):
            fn = table[case][draw]
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times[case, draw].append(time.perf_counter() - start)
    return {
        case: {draw: 1e3 * statistics.median(times[case, draw]) for draw in DRAWS}
        for case in table
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    info = machine_info()
    medians = measure(cases(), args.rounds, args.calls)
    print(f"# normal_draws: {info['cpu_model']}, jax {info['jax']}, {info['date_utc']}")
    print("| case | jax.random.normal ms | precond ms | ratio |\n|---|---|---|---|")
    for case, ms in medians.items():
        theirs, ours = ms["jax.random.normal"], ms["precond"]
        print(f"| {case} | {theirs:.2f} | {ours:.2f} | {ours / theirs:.2f} |")
    if args.json:
        write_json({"machine": info, "medians_ms": medians}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
