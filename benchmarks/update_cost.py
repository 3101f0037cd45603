"""What one step of pro costs beside Muon and AdamW as the char-lm transformer
grows: the optimizer update alone, and the gradient it follows.

Issue [4 of 6] asks for pro to reach AdamW's loss in less wall time than Muon.
On the bench's char-lm (d 64, 2 layers) a step of pro without a factor fit
costs about what Muon's does, and the fits are the difference. Muon's
Newton-Schulz iterations cost about m·n·min(m, n) per weight per step, pro's
preconditioning between fits 2·m·n·(m + n) over blocks of at most 256, and a
fit three d³ products per dense side: which is cheaper depends on the widths.
This script measures it on the char-lm at each ``--shapes`` entry
(``WIDTHxLAYERS``; default the bench's 64x2 and 256x4, the larger transformer
the issue suggests), with the bench's own optimizers at their char-lm rates:

- ``adamw`` and ``muon`` (``precond.bench``'s, Muon on the hidden matrices,
  AdamW on the rest);
- ``pro fit``: ``precond.jax.pro`` fitting its factors (every step) with its
  default rule 'PRO' (three d³ products per dense factor), and ``pro fit QUAD``
  and ``pro fit QEQ`` with the other rules (two and one);
- ``pro no fit``: pro between fits (update probability 1e-9 after its first,
  always fitting, step).

Each update is ``jax.jit``-compiled, fed fixed random gradients and its own
state; the optimizers run in interleaved rounds of ``--steps`` updates and the
table gives the median round's time per update, its ratio to AdamW's, and the
time of one gradient (``jax.value_and_grad`` of the bench's loss on a batch of
``--batch-size`` sequences of the bench's context), which every step adds.

Usage::

    python benchmarks/update_cost.py
    python benchmarks/update_cost.py --shapes 64x2,128x4,256x4 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import precond.jax as pj
from _common import jax_stepper
from precond.bench import arguments
from precond.bench.data import CHAR_LM_CONTEXT, CHAR_LM_VOCAB
from precond.bench.jax_models import init_char_lm
from precond.bench.optimizers import OPTIMIZERS
from precond.bench.workloads import get_workload

# pro between fits: its first step fits (the factors start as identities), then
# a probability no run of this script reaches.
NEVER = 1e-9


def optimizers() -> dict:
    """The bench's AdamW and Muon and pro (fitting by each rule, not fitting)
    at their char-lm rates, weight decay 1e-4 (Muon's hidden-matrix rule reads
    the params' keys, so it holds at every width)."""
    workload = get_workload("char-lm")

    def bench(name):
        spec = OPTIMIZERS[name]
        rate = spec.learning_rate("char-lm", "jax")
        return spec.build("jax", workload, rate, 1e-4)

    rate = OPTIMIZERS["pro"].learning_rate("char-lm", "jax")
    return {
        "adamw": bench("adamw"),
        "muon": bench("muon"),
        "pro fit": pj.pro(rate, weight_decay=1e-4),
        **{
            f"pro fit {style}": pj.pro(
                rate, weight_decay=1e-4, preconditioner_update_style=style
            )
            for style in ("QUAD", "QEQ")
        },
        "pro no fit": pj.pro(
            rate, weight_decay=1e-4, preconditioner_update_probability=NEVER
        ),
    }


def gradient_seconds(params, batch_size: int, repeats: int) -> float:
    """Median seconds of one compiled value_and_grad of the bench's loss."""
    loss = get_workload("char-lm").loss
    tokens = jax.random.randint(
        jax.random.key(2), (batch_size, CHAR_LM_CONTEXT + 1), 0, CHAR_LM_VOCAB
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    grad = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(grad(params, x, y))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grad(params, x, y))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(width: int, layers: int, steps: int, rounds: int, batch_size: int):
    params = init_char_lm(0, d_model=width, layers=layers)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grads = treedef.unflatten(
        [
            jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ]
    )
    runs = {name: jax_stepper(o, params, grads) for name, o in optimizers().items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            runs[name](steps)
            times[name].append((time.perf_counter() - start) / steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    size = sum(x.size for x in leaves)
    return size, medians, gradient_seconds(params, batch_size, rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--shapes", type=arguments.transformer_shapes, default="64x2,256x4"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print(
        "| model | parameters | optimizer | update ms | ×adamw | "
        f"gradient ms (batch {args.batch_size}) |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for width, layers in args.shapes:
        size, medians, grad_s = measure(
            width, layers, args.steps, args.rounds, args.batch_size
        )
        for name, seconds in medians.items():
            print(
                f"| d {width}, {layers} layers | {size:,} | {name} "
                f"| {seconds * 1e3:.2f} | {seconds / medians['adamw']:.2f} "
                f"| {grad_s * 1e3:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
