"""Distributed Shampoo: update cost vs AdamW, inverse roots, loss after a budget.

Measures, in one process on the local JAX backend (written for CPU):

1. Peak: float32 GFLOP/s of a jitted ``a @ b`` (n = 512, 1024, 2048), before and
   after everything else (``kron_update.measure_matmul``); float64 at n = 512 and
   1024 (x64 on) for the float64 roots.
2. ``tx.update(grads, state, params)``, jitted with the state donated and fed
   back (``kron_update.measure_update``), of ``optax.adamw`` and of the
   ``precond bench`` Shampoo (``precond.bench.optimizers.make_shampoo``:
   ``distributed_shampoo`` with decoupled weight decay) on a transformer-shaped
   tree (``kron_update.transformer_shapes`` at d_model 256, MLP 1024), for block
   sizes 128, 512, 1024 × ``preconditioning_compute_steps`` 1 and 10 (median
   step; at 10: steps without roots, the root step and the mean over a 10-step
   window = amortised cost), with coupled-Newton and with eigh roots, as ratios
   to AdamW; optimizer-state bytes as ratios to AdamW's; the number of inverse
   roots that failed (kept the previous root).
3. Inverse 4th roots, ``matrix_inverse_pth_root`` (coupled Newton) vs
   ``matrix_inverse_pth_root_eigh``, at n = 128 … 2048 of an SPD matrix with
   condition number 1e4, in float32 and (x64 on, up to ``--float64-max``)
   float64, and of a rank-n/4 Gram matrix in float32 (up to ``--rank-max``):
   median time, Newton's iteration count, accuracy ‖X⁻⁴ − (A + ε'I)‖_F / ‖A‖_F in
   float64 NumPy, and GFLOP/s as a share of the matmul peak (:func:`root_gflop`).
4. Loss after a fixed budget on the ``digits-mlp`` and ``char-lm`` workloads of
   ``precond bench``, Shampoo vs AdamW vs Kron, each with a 4-rate sweep, with
   the machinery of ``psgd_variants.py`` (same steps, batches, seed, schedule).
   ``--variants`` adds Shampoo with other graftings, β2 or eigh roots.

OPENBLAS_NUM_THREADS is set to 1 unless set (see the comment at the import).

Usage::

    python benchmarks/shampoo.py                  # full run, ~12 min on 2 busy cores
    python benchmarks/shampoo.py --quick          # smoke run, ~2 min
    python benchmarks/shampoo.py --json out.json
    python benchmarks/shampoo.py --sections roots --sizes 128,256
    python benchmarks/shampoo.py --sections loss --workloads char-lm \\
        --variants shampoo,shampoo-rmsprop,shampoo-adagrad,shampoo-sgd
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# Before NumPy or JAX load OpenBLAS: jaxlib's CPU eigh runs in OpenBLAS's LAPACK,
# whose threads spin against XLA's own (and other processes') threads; on this
# 2-core machine a vmapped eigh of 12 128×128 matrices took 0.02 to 1.8 s from one
# call to the next with OpenBLAS's default thread count, 0.02 s steadily with one.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


import jax
import jax.numpy as jnp
import numpy as np
import optax

from _common import loadavg, machine_info, median_time, progress_log
from kron_update import (
    _is_shape,
    _table,
    measure_matmul,
    measure_update,
    random_tree,
    transformer_shapes,
)
from precond.bench.arguments import (
    learning_rate_grid,
    names,
    positive_int,
    positive_ints,
)
from precond.bench.optimizers import DEFAULT_WEIGHT_DECAY, make_shampoo
from precond.bench.report import write_json
from precond.jax import (
    GraftingType,
    matrix_inverse_pth_root,
    matrix_inverse_pth_root_eigh,
)
from psgd_variants import (
    DEFAULT_BATCH,
    DEFAULT_STEPS,
    LAST_STEPS,
    QUICK_STEPS,
    QUICK_WARMUP_STEPS,
    VARIANTS,
    WARMUP_STEPS,
    WORKLOADS,
    Variant,
    run_workload,
    workload_report,
)

LEARNING_RATE = 1e-3  # of the update timings (the rate does not change the cost)
BLOCK_SIZES = (128, 512, 1024)
# (preconditioning_compute_steps, eigh) of each timed Shampoo configuration
UPDATE_CASES = ((1, False), (10, False), (1, True), (10, True))
ROOT_SIZES = (128, 256, 512, 1024, 2048)
ROOT_P = 4
CONDITION = 1e4
RIDGE = 1e-6  # both root functions' default ridge_epsilon (relative to λ_max)
NEWTON_MAX_ITERS = 100  # matrix_inverse_pth_root's default num_iters


# --------------------------------------------------------------------------- variants


def _shampoo_variant(name: str, label: str, **kwargs: Any) -> Variant:
    kwargs = {"graft_type": GraftingType.RMSPROP_NORMALIZED} | kwargs
    roots = "eigh" if kwargs.get("eigh") else "Newton"
    return Variant(
        name,
        f"shampoo {label}",
        name,  # each variant is its own family: its own learning-rate grid
        "precond.bench.optimizers",
        "make_shampoo",
        kwargs=kwargs,
        fit_label=f"{roots} roots every step, block 128",
    )


# make_shampoo's defaults (RMSProp-normalized grafting, β2 0.999, Newton roots),
# then one change each: the grafting, β2, the root method.
SHAMPOO_VARIANTS = {
    v.name: v
    for v in (
        _shampoo_variant("shampoo", "(bench defaults)"),
        _shampoo_variant(
            "shampoo-rmsprop", "RMSProp grafting", graft_type=GraftingType.RMSPROP
        ),
        _shampoo_variant(
            "shampoo-adagrad", "AdaGrad grafting", graft_type=GraftingType.ADAGRAD
        ),
        _shampoo_variant("shampoo-sgd", "SGD grafting", graft_type=GraftingType.SGD),
        _shampoo_variant("shampoo-beta2-0.99", "β2 0.99", beta2=0.99),
        _shampoo_variant("shampoo-beta2-0.95", "β2 0.95", beta2=0.95),
        _shampoo_variant("shampoo-eigh", "eigh roots", eigh=True),
    )
}
KRON = VARIANTS["kron-eq"]  # EQ is kron's default update style
LOSS_VARIANTS = {
    "adamw": VARIANTS["adamw"],
    "kron": Variant(
        "kron", "kron (defaults)", "kron", KRON.module, KRON.function, kwargs={}
    ),
    **SHAMPOO_VARIANTS,
}
DEFAULT_VARIANTS = ("adamw", "kron", "shampoo")
LR_GRIDS = {  # --quick: the one at len // 2
    "adamw": (3e-3, 1e-2, 3e-2, 1e-1),
    "kron": (3e-3, 1e-2, 3e-2, 1e-1),
    "shampoo": (1e-4, 3e-4, 1e-3, 3e-3),
    "shampoo-rmsprop": (1e-4, 3e-4, 1e-3, 3e-3),
    "shampoo-adagrad": (1e-3, 3e-3, 1e-2, 3e-2),
    "shampoo-sgd": (1e-2, 3e-2, 1e-1, 3e-1),
    "shampoo-beta2-0.99": (3e-4, 1e-3, 3e-3, 1e-2),
    "shampoo-beta2-0.95": (3e-4, 1e-3, 3e-3, 1e-2),
    "shampoo-eigh": (1e-4, 3e-4, 1e-3, 3e-3),
}


# --------------------------------------------------------------------------- updates


def measure_shampoo(params, grads, block_size: int, every: int, eigh: bool, steps):
    """Times ``steps`` consecutive updates after one untimed (step counts 1 …
    steps); a step computes the roots when its count is a multiple of ``every``."""
    tx = make_shampoo(
        LEARNING_RATE,
        DEFAULT_WEIGHT_DECAY,
        block_size=block_size,
        preconditioning_compute_steps=every,
        eigh=eigh,
    )
    r = measure_update(tx, params, grads, steps, warmup=1)
    shampoo_state = r.pop("state")[0]
    roots = [t for i, t in enumerate(r["times"], 1) if i % every == 0]
    plain = [t for i, t in enumerate(r["times"], 1) if i % every != 0]
    metrics = jax.tree.leaves(shampoo_state.training_metrics)
    errors = np.concatenate([np.asarray(e).ravel() for e in metrics])
    sizes: dict[str, int] = {}  # statistic size ↦ count, over all stacks
    for stack in shampoo_state.statistics:
        n = int(stack.shape[-1])
        sizes[n] = sizes.get(n, 0) + int(stack.shape[0])
    return {
        "block_size": block_size,
        "compute_steps": every,
        "eigh": eigh,
        "steps": steps,
        "median_s": statistics.median(r["times"]),
        "mean_s": statistics.fmean(r["times"]),
        "root_s": statistics.median(roots) if roots else None,
        "plain_s": statistics.median(plain) if plain else None,
        "state_bytes": r["state_bytes"],
        "compile_s": r["compile_s"],
        "statistics": {str(n): sizes[n] for n in sorted(sizes, reverse=True)},
        "num_statistics": sum(sizes.values()),
        # Non-finite or >= inverse_failure_threshold (0.1): the old root was kept.
        "failed_roots": int(np.sum(~(np.isfinite(errors) & (errors < 0.1)))),
        "max_root_error": float(np.nanmax(errors)) if errors.size else None,
    }


# --------------------------------------------------------------------------- roots


MATRICES = {  # kind ↦ label of spd_matrix(n, kind, seed)
    "cond": f"κ {CONDITION:g}",
    "rank": "rank n/4",
}


def spd_matrix(n: int, kind: str, seed: int = 0) -> np.ndarray:
    """A float64 symmetric PSD n×n matrix with ‖A‖₂ ≈ 1.

    'cond': Q·diag(λ)·Qᵀ, λ log-spaced from 1 down to 1/CONDITION, Q random
    orthogonal (QR of a Gaussian matrix). 'rank': GᵀG/‖GᵀG‖₂ for a Gaussian
    (n/4)×n G, rank n/4, like the n×n statistic of a block whose other axis is
    n/4 long (a 256×1024 weight at block size 1024); only the ridge makes it
    invertible (κ ≈ 1e6).
    """
    rng = np.random.default_rng(seed)
    if kind == "rank":
        g = rng.standard_normal((max(n // 4, 1), n))
        gram = g.T @ g
        return gram / np.linalg.eigvalsh(gram)[-1]
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (q * np.logspace(0.0, -np.log10(CONDITION), n)) @ q.T


def root_accuracy(root: np.ndarray, a: np.ndarray, p: int) -> float:
    """‖X⁻ᵖ − (A + ε'I)‖_F / ‖A‖_F in float64, ε' = RIDGE·λ_max(A)."""
    x = np.asarray(root, np.float64)
    ridge = RIDGE * np.linalg.eigvalsh(a)[-1]
    residual = np.linalg.matrix_power(np.linalg.inv(x), p) - a
    residual[np.diag_indices_from(residual)] -= ridge
    return float(np.linalg.norm(residual) / np.linalg.norm(a))


def root_gflop(method: str, n: int, iterations: int | None) -> float:
    """Nominal FLOPs of one inverse 4th root, GFLOP.

    Newton: 4 matmuls of n×n per iteration (T² and T⁴ by squaring, T⁴·M, H·T):
    8n³ each; the power iteration (≤ 100 matrix-vector products, 2n² each) and
    the elementwise work are not counted. eigh: 9n³ for the symmetric
    eigendecomposition with eigenvectors (Golub & Van Loan's count for
    tridiagonalisation + QR; LAPACK's divide and conquer is of the same order)
    plus two n×n products (the root and the residual check), 4n³: 13n³.
    """
    if method == "newton":
        return 8.0 * n**3 * iterations / 1e9
    return 13.0 * n**3 / 1e9


def _root_fn(method: str, num_iters: int = NEWTON_MAX_ITERS) -> Callable:
    if method == "eigh":
        return functools.partial(matrix_inverse_pth_root_eigh, p=ROOT_P)
    return functools.partial(matrix_inverse_pth_root, p=ROOT_P, num_iters=num_iters)


def newton_iterations(x: jax.Array, root, error, guess: int) -> int:
    """Iterations the coupled Newton run took: the smallest ``num_iters`` whose
    root and error are bitwise those of the full run. Searched from ``guess`` (the
    count at the previous size) outwards, then by bisection, so that a count
    equal or next to the guess costs two runs."""

    def same(k: int) -> bool:
        r, e = jax.jit(_root_fn("newton", k))(x)
        return bool(jnp.array_equal(r, root) and jnp.array_equal(e, error))

    lo, hi = 0, NEWTON_MAX_ITERS  # invariant: not same(lo), same(hi)
    k, step = min(max(guess, 1), hi), 1
    if same(k):  # walk down from the guess
        hi = k
        while hi - step > lo and same(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(lo, hi - step)
    else:  # walk up
        lo = k
        while lo + step < hi and not same(lo + step):
            lo, step = lo + step, 2 * step
        hi = min(hi, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if same(mid) else (mid, hi)
    return hi


def measure_roots(
    sizes: Sequence[int], dtype: str, kind: str, log
) -> list[dict[str, Any]]:
    """Time, iterations and accuracy of both root methods at each size."""
    rows, guess = [], 15
    for n in sizes:
        a = spd_matrix(n, kind, seed=n)
        x = jnp.asarray(a, dtype)
        runs = max(1, min(10, (1024 // n) ** 2)) if n < 1024 else 2 if n == 1024 else 1
        for method in ("newton", "eigh"):
            compiled = jax.jit(_root_fn(method)).lower(x).compile()
            root, error = jax.block_until_ready(compiled(x))  # also the warm-up
            seconds = median_time(lambda c=compiled, x=x: c(x), runs, warmup=0)
            iterations = None
            if method == "newton":
                iterations = guess = newton_iterations(x, root, error, guess)
            gflop = root_gflop(method, n, iterations)
            rows.append(
                {
                    "dtype": dtype,
                    "matrix": kind,
                    "n": n,
                    "method": method,
                    "runs": runs,
                    "median_s": seconds,
                    "iterations": iterations,
                    "gflop": gflop,
                    "gflops": gflop / seconds,
                    "error": float(error),
                    "accuracy": root_accuracy(np.asarray(root), a, ROOT_P),
                }
            )
            log(
                f"root {dtype} {kind} n={n} {method}: {1e3 * seconds:.1f} ms, "
                f"iterations {iterations}, accuracy {rows[-1]['accuracy']:.2e}"
            )
    return rows


# --------------------------------------------------------------------------- report


def report(res: dict[str, Any]) -> str:
    info, cfg = res["machine"], res["config"]
    out = [
        "# Distributed Shampoo: update cost, inverse roots, loss after a budget\n",
        f"- CPU: {info['cpu_model']}, {info['usable_cpus']} usable cores; JAX "
        f"device {info['jax_device']}; jax {info['jax']}, jaxlib {info['jaxlib']}, "
        f"optax {info['optax']}; XLA_FLAGS `{info['xla_flags']}`; "
        f"OPENBLAS_NUM_THREADS {cfg['openblas_threads']}",
        f"- date (UTC) {info['date_utc']}; load average (1, 5, 15 min) at start "
        f"{info['loadavg_start']}, at end {info['loadavg_end']}; wall "
        f"{res['wall_s']:.0f} s"
        + (" — QUICK smoke run, not the benchmark" if cfg["quick"] else ""),
        "- Shampoo = `precond.bench.optimizers.make_shampoo` (the `precond bench` "
        "entry): `distributed_shampoo` with RMSProp-normalized grafting (unless "
        "named), β1 0.9, β2 0.999, Nesterov, coupled-Newton roots, "
        f"`start_preconditioning_step` 5, decoupled weight decay {cfg['wd']:g}",
    ]
    if res.get("matmul"):
        out += [
            "\n## 1. Matmul throughput (peak)\n",
            *_table(
                "pass | dtype | n | runs | median ms | GFLOP/s",
                [
                    (
                        r["pass"],
                        r.get("dtype", "float32"),
                        r["n"],
                        r["runs"],
                        f"{1e3 * r['median_s']:.2f}",
                        r["gflops"],
                    )
                    for r in res["matmul"]
                ],
            ),
            f"Peak = best float32 figure of both passes: **{res['peak']:.1f} "
            "GFLOP/s** ('before' precedes everything else, 'after' follows it)"
            + (
                f"; float64: {res['peak64']:.1f} GFLOP/s." if res.get("peak64") else "."
            ),
        ]
    if res.get("update"):
        out += _update_report(res)
    if res.get("roots"):
        out += _roots_report(res)
    if res.get("workloads"):
        grids = "; ".join(
            f"{f} {', '.join(f'{lr:g}' for lr in lrs)}"
            for f, lrs in cfg["lrs"].items()
            if any(LOSS_VARIANTS[v].family == f for v in cfg["variants"])
        )
        out += [
            "\n## 4. Loss after a fixed budget\n",
            f"`psgd_variants.py`'s machinery: seed {cfg['seed']} (init and "
            f"batches), weight decay {cfg['wd']:g}, {cfg['schedule']} schedule; "
            f"train loss = mean minibatch loss of the last {cfg['last']} steps; "
            "best lr = lowest of the sweep; step ms = median jitted train step "
            f"(first {cfg['warmup']} steps of each run left out), pooled over the "
            f"sweep. Learning rates: {grids}. kron: `precond.jax.kron` defaults "
            "(EQ, its update-probability schedule).",
        ]
        for w in res["workloads"]:
            out += workload_report(w, heading="###")
    return "\n".join(out) + "\n"


def _update_report(res: dict[str, Any]) -> list[str]:
    cfg, adamw = res["config"], res["adamw"]
    a_s = adamw["median_s"]

    def vs(seconds: float | None) -> str:
        return "–" if seconds is None else f"{1e3 * seconds:.1f} ({seconds / a_s:.1f}×)"

    rows = [
        ("optax.adamw", "–", "–", "–", adamw["state_bytes"] / 2**20, "1.00", vs(a_s))
        + ("–",) * 3
        + (f"{adamw['compile_s']:.1f}", "–")
    ]
    for r in res["update"]:
        stats = ", ".join(f"{k}: {v}" for k, v in r["statistics"].items())
        every = r["compute_steps"]
        rows.append(
            (
                "shampoo, " + ("eigh" if r["eigh"] else "Newton"),
                r["block_size"],
                every,
                stats,
                r["state_bytes"] / 2**20,
                f"{r['state_bytes'] / adamw['state_bytes']:.2f}",
                vs(r["median_s"]) if every == 1 else "–",
                vs(r["plain_s"]),
                vs(r["root_s"]) if every > 1 else "–",
                vs(r["mean_s"]) if every > 1 else "–",
                f"{r['compile_s']:.1f}",
                f"{r['failed_roots']}/{r['num_statistics']}",
            )
        )
    return [
        "\n## 2. Update time and optimizer state vs AdamW\n",
        f"Tree: `transformer_shapes({cfg['layers']}, d_model={cfg['d_model']}, "
        f"d_mlp={4 * cfg['d_model']})`: {cfg['num_params']:,} float32 parameters "
        f"in {cfg['num_tensors']} tensors; fixed random gradients (N(0, 1)). "
        "update = `jax.jit(tx.update, donate_argnums=1)`, state fed back. AdamW: "
        f"median of {adamw['runs']} updates (before {1e3 * adamw['before_s']:.2f} "
        f"ms, after {1e3 * adamw['after_s']:.2f} ms, pooled **{1e3 * a_s:.2f} "
        "ms**). Time cells: ms (× AdamW). Every = "
        "`preconditioning_compute_steps`; at 1 every step computes all roots "
        f"(median of {cfg['repeats']} steps); at 10, {cfg['window']} steps "
        "(counts 1 … 10·windows after one untimed step) with one root step per "
        "10: median without roots, the root step(s), amortised = mean. "
        "Statistics: n: how many n×n statistics. Failed roots: error ≥ 0.1 or "
        "NaN at the last root computation (the previous root is kept).\n",
        *_table(
            "optimizer | block | every | statistics | state MiB | state × AdamW | "
            "every = 1 | no roots (median) | root step | amortised | compile s | "
            "failed roots",
            rows,
        ),
    ]


def _roots_report(res: dict[str, Any]) -> list[str]:
    peak = {"float32": res["peak"], "float64": res.get("peak64") or res["peak"]}
    rows = []
    for r in res["roots"]:
        rows.append(
            (
                r["dtype"],
                MATRICES[r["matrix"]],
                r["n"],
                r["method"],
                r["runs"],
                f"{1e3 * r['median_s']:.1f}",
                r["iterations"] if r["iterations"] is not None else "–",
                f"{r['gflop']:.2f}",
                r["gflops"],
                100 * r["gflops"] / peak[r["dtype"]],
                f"{r['error']:.1e}",
                f"{r['accuracy']:.1e}",
            )
        )
    return [
        "\n## 3. Inverse 4th root: coupled Newton vs eigh\n",
        f"Matrices (`spd_matrix`, ‖A‖₂ = 1): κ {CONDITION:g} = Q·diag(λ)·Qᵀ, λ "
        f"log-spaced in [1/{CONDITION:g}, 1], Q random orthogonal; rank n/4 = "
        "GᵀG (scaled) of a Gaussian (n/4)×n G, the statistic of a block whose "
        "other axis is n/4 long (invertible only through the ridge). Ridge "
        "ε' = 1e-6·λ_max (both functions' default). Time: "
        "median of `runs` calls of the compiled function after one warm-up call. "
        "Newton's iterations: the smallest `num_iters` that reproduces the full "
        f"run bitwise (max {NEWTON_MAX_ITERS}). GFLOP: Newton 8n³ per iteration, "
        "eigh 13n³ (nominal, see `root_gflop`); % of the matmul peak of the same "
        "dtype. error = the function's own error (Newton max|M − I|, eigh "
        "relative residual); accuracy = ‖X⁻⁴ − (A + ε'I)‖_F / ‖A‖_F in float64 "
        "NumPy.\n",
        *_table(
            "dtype | matrix | n | method | runs | median ms | iterations | GFLOP | "
            "GFLOP/s | % of peak | error | accuracy",
            rows,
        ),
    ]


# --------------------------------------------------------------------------- main


SECTIONS = ("update", "roots", "loss")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sections",
        type=names(SECTIONS, "section"),
        default=list(SECTIONS),
        metavar="A,B",
        help=f"sections to run besides the matmul peak (default: {','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        help="timed Shampoo steps at every = 1 (default 3, 1 with --quick); "
        "matmul and AdamW use 10× as many",
    )
    parser.add_argument(
        "--windows", type=positive_int, default=1, help="10-step windows at every=10"
    )
    parser.add_argument("--layers", type=positive_int, help="layers (default 2)")
    parser.add_argument(
        "--d-model", type=positive_int, default=256, help="tree width (MLP 4×)"
    )
    parser.add_argument(
        "--block-sizes", type=positive_ints, help="block sizes (default 128,512,1024)"
    )
    parser.add_argument(
        "--sizes", type=positive_ints, help="root sizes (default 128…2048)"
    )
    parser.add_argument(
        "--float64-max",
        type=int,
        default=1024,
        help="largest float64 root size (0: no float64 roots; default 1024)",
    )
    parser.add_argument(
        "--rank-max",
        type=int,
        default=1024,
        help="largest size of the rank-n/4 float32 roots (0: none; default 1024)",
    )
    parser.add_argument(
        "--variants",
        type=names(list(LOSS_VARIANTS), "variant"),
        metavar="A,B",
        help=f"loss-section variants (default {','.join(DEFAULT_VARIANTS)}; "
        f"choose from {','.join(LOSS_VARIANTS)})",
    )
    parser.add_argument(
        "--workloads",
        type=names(WORKLOADS, "workload"),
        default=list(WORKLOADS),
        metavar="A,B",
        help=f"loss-section workloads (default {','.join(WORKLOADS)})",
    )
    parser.add_argument("--steps", type=positive_int, help="steps, every workload")
    parser.add_argument(
        "--lr",
        type=learning_rate_grid(list(LR_GRIDS)),
        action="append",
        default=[],
        metavar="FAMILY=LR,LR",
        help="one family's learning-rate sweep (defaults: "
        + "; ".join(f"{k} {','.join(map(str, v))}" for k, v in LR_GRIDS.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every run")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    q = args.quick
    args.repeats = args.repeats or (1 if q else 3)
    args.layers = args.layers or (1 if q else 2)
    args.block_sizes = args.block_sizes or ([128, 512] if q else list(BLOCK_SIZES))
    args.sizes = args.sizes or ([128, 256] if q else list(ROOT_SIZES))
    args.variants = args.variants or list(DEFAULT_VARIANTS)
    grids = {k: list(v) for k, v in LR_GRIDS.items()}
    if q:
        grids = {k: [v[len(v) // 2]] for k, v in grids.items()}
    grids.update(dict(args.lr))
    args.lrs = grids
    steps = args.steps or (QUICK_STEPS if q else None)
    args.steps_by = {w: steps or DEFAULT_STEPS[w] for w in WORKLOADS}
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    info = machine_info()

    log = progress_log(t0)

    d = args.d_model
    shapes_tree = transformer_shapes(args.layers, d_model=d, d_mlp=4 * d)
    shapes = jax.tree.leaves(shapes_tree, is_leaf=_is_shape)
    params = random_tree(shapes_tree, seed=0, scale=0.02)
    grads = random_tree(shapes_tree, seed=1)
    matmul_sizes = (512, 1024) if args.quick else (512, 1024, 2048)
    ref_runs = 10 * args.repeats
    adamw_tx = optax.adamw(LEARNING_RATE, weight_decay=DEFAULT_WEIGHT_DECAY)

    def references(label: str) -> tuple[list[dict], dict | None]:
        log(f"matmul peak ({label})")
        matmul = measure_matmul(matmul_sizes, ref_runs, label)
        if "update" not in args.sections:
            return matmul, None
        log(f"adamw ({label})")
        r = measure_update(adamw_tx, params, grads, ref_runs, warmup=3)
        r.pop("state")
        return matmul, r

    result: dict[str, Any] = {"machine": info}
    matmul, adamw_before = references("before")
    update = []
    if "update" in args.sections:
        for block in args.block_sizes:
            for every, eigh in UPDATE_CASES:
                steps = args.repeats if every == 1 else every * args.windows
                log(
                    f"shampoo block_size={block} preconditioning_compute_steps="
                    f"{every} eigh={eigh}"
                )
                update.append(measure_shampoo(params, grads, block, every, eigh, steps))
                r = update[-1]
                log(
                    f"  median {1e3 * r['median_s']:.1f} ms, mean "
                    f"{1e3 * r['mean_s']:.1f} ms, compile {r['compile_s']:.1f} s, "
                    f"failed roots {r['failed_roots']}/{r['num_statistics']}"
                )
    roots = []
    if "roots" in args.sections:
        roots += measure_roots(args.sizes, "float32", "cond", log)
        sizes_rank = [n for n in args.sizes if n <= args.rank_max]
        if sizes_rank:
            roots += measure_roots(sizes_rank, "float32", "rank", log)
        sizes64 = [n for n in args.sizes if n <= args.float64_max]
        if sizes64:
            with jax.enable_x64(True):
                log("matmul peak (float64)")
                m64 = measure_matmul((512, 1024), ref_runs, "x64 (roots)")
                matmul += [dict(r, dtype="float64") for r in m64]
                roots += measure_roots(sizes64, "float64", "cond", log)
    workloads = []
    cfg_loss = {
        "variants": args.variants,
        "steps": args.steps_by,
        "batch_size": DEFAULT_BATCH,
        "lrs": args.lrs,
        "seed": args.seed,
        "schedule": args.schedule,
        "last": LAST_STEPS,
        "warmup": QUICK_WARMUP_STEPS if args.quick else WARMUP_STEPS,
        "weight_decay": DEFAULT_WEIGHT_DECAY,
    }
    if "loss" in args.sections:
        variants = [LOSS_VARIANTS[v] for v in args.variants]
        factories = {v.name: v.factory() for v in variants}
        for w in args.workloads:
            workloads.append(run_workload(w, variants, factories, cfg_loss, log))
    matmul_after, adamw_after = references("after")
    matmul += matmul_after
    log("done")
    info["loadavg_end"] = loadavg()
    f32 = [r["gflops"] for r in matmul if r.get("dtype", "float32") == "float32"]
    f64 = [r["gflops"] for r in matmul if r.get("dtype") == "float64"]
    result |= {
        "config": {
            "quick": args.quick,
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
            "layers": args.layers,
            "d_model": d,
            "num_params": int(sum(np.prod(s) for s in shapes)),
            "num_tensors": len(shapes),
            "repeats": args.repeats,
            "window": 10 * args.windows,
            "wd": DEFAULT_WEIGHT_DECAY,
            **cfg_loss,
        },
        "matmul": matmul,
        "peak": max(f32),
        "peak64": max(f64) if f64 else None,
        "update": update,
        "roots": roots,
        "workloads": workloads,
    }
    if adamw_before is not None:
        times = adamw_before["times"] + adamw_after["times"]
        result["adamw"] = {
            "median_s": statistics.median(times),
            "before_s": statistics.median(adamw_before["times"]),
            "after_s": statistics.median(adamw_after["times"]),
            "runs": len(times),
            "state_bytes": adamw_before["state_bytes"],
            "compile_s": adamw_before["compile_s"],
        }
    result["wall_s"] = time.perf_counter() - t0
    print(report(result))
    if args.json:
        write_json(result, args.json)
        log(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
