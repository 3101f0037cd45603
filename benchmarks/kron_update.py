"""Cost of one PSGD Kron optimizer update vs AdamW, and its share of matmul peak.

Measures, in one process on the local JAX backend (written for CPU):

1. Reference peak: float32 throughput of a jitted ``a @ b`` for square sizes; the
   best median GFLOP/s is the peak that later fractions refer to.
2. Update time of ``precond.jax.kron`` vs ``optax.adamw`` on a transformer-shaped
   parameter tree: ``tx.update(grads, state, params)`` compiled once with the state
   donated (``donate_argnums=1``) for every optimizer, the new state fed back each
   step, grads and params fixed. Kron runs at ``preconditioner_update_probability``
   1.0 (every step fits the factors; median step) and 0.03 (the counter fits the
   factors every 34th step; median of the steps without a fit, the time of the
   fitting steps, and the mean over windows of 34 consecutive steps, i.e. the
   amortised cost), each with ``cache_preconditioner`` True and False. All times
   are reported as ratios to AdamW's median measured in the same run.
3. Achieved FLOP/s: matmul FLOPs the algorithm needs, counted analytically
   (:func:`kron_matmul_flops`), divided by the measured time, as a fraction of the
   peak of 1. XLA's own estimate (``compiled.cost_analysis()``) is printed beside
   it; XLA counts both branches of every ``lax.cond`` (fit or not, finite or not),
   so for the whole update it is an estimate of the fitting step only.
4. Breakdown: each stage of the algorithm jitted alone on random inputs for every
   distinct matrix shape in the tree, summed over the tree, to show where a step's
   time goes.

Usage::

    python benchmarks/kron_update.py               # full run, ~5 min on 2 cores
    python benchmarks/kron_update.py --quick       # smoke run (1 layer, few repeats)
    python benchmarks/kron_update.py --json out.json

Timings on a shared CPU are noisy: compare ratios within one run, and look at the
load averages printed with the machine description.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import precond
from precond._common.factor_plan import plan_diagonal_axes
from precond.jax import _kron_math as km
from precond.jax import kron

# Probability used for the amortised measurement; 1/0.03 = 33.3, so the counter
# fits the factors on every 34th step.
LOW_PROBABILITY = 0.03
STEPS_PER_FIT = int(np.ceil(1.0 / LOW_PROBABILITY))
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # optax.adamw's default, given to both optimizers
MAX_SIZE_TRIANGULAR = 8192  # kron's default
MIN_NDIM_TRIANGULAR = 2  # kron's default


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, library versions, date and load averages."""
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    device = jax.devices()[0]
    return {
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "jax_backend": jax.default_backend(),
        "jax_device": f"{device.platform}:{device.device_kind}",
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None)
        or __import__("jaxlib").__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "precond": getattr(precond, "__version__", "unknown"),
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "loadavg_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------- timing


def _block(tree: Any) -> None:
    jax.block_until_ready(tree)


def time_calls(fn: Callable[[], Any], runs: int, warmup: int = 2) -> list[float]:
    """Wall seconds of ``runs`` calls of ``fn``, each blocked on, after warm-up."""
    for _ in range(warmup):
        _block(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - start)
    return times


def xla_flops(compiled: Any) -> float | None:
    """FLOPs XLA estimates for a compiled executable (dict or list-of-dicts API)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # backend without cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


# --------------------------------------------------------------------------- peak


def measure_matmul_peak(sizes: Sequence[int], runs: int) -> list[dict[str, Any]]:
    """Median time and GFLOP/s (2n³ FLOPs) of a jitted float32 n×n @ n×n."""
    rows = []
    matmul = jax.jit(lambda a, b: a @ b)
    for n in sizes:
        key_a, key_b = jax.random.split(jax.random.PRNGKey(n))
        a = jax.random.normal(key_a, (n, n), jnp.float32)
        b = jax.random.normal(key_b, (n, n), jnp.float32)
        compiled = matmul.lower(a, b).compile()
        # Aim for at least ~1 s of timed work for the small sizes.
        n_runs = max(runs, int(runs * (2048 / n) ** 2 // 4))
        times = time_calls(lambda c=compiled, a=a, b=b: c(a, b), n_runs)
        median = statistics.median(times)
        rows.append(
            {
                "n": n,
                "runs": n_runs,
                "median_ms": median * 1e3,
                "gflops": 2 * n**3 / median / 1e9,
                "xla_gflop": _scaled(xla_flops(compiled)),
            }
        )
    return rows


def _scaled(flops: float | None, scale: float = 1e9) -> float | None:
    return None if flops is None else flops / scale


# --------------------------------------------------------------------------- model


def transformer_tree(
    num_layers: int = 4, d_model: int = 512, d_mlp: int = 2048, vocab: int = 256
) -> dict[str, Any]:
    """Shapes of a pre-norm transformer: embedding, per-layer attention/MLP/norms."""
    tree: dict[str, Any] = {"embedding": (vocab, d_model)}
    for layer in range(num_layers):
        tree[f"layer_{layer}"] = {
            "attn_q": (d_model, d_model),
            "attn_k": (d_model, d_model),
            "attn_v": (d_model, d_model),
            "attn_o": (d_model, d_model),
            "mlp_in": (d_model, d_mlp),
            "mlp_out": (d_mlp, d_model),
            "norm_1_scale": (d_model,),
            "norm_1_bias": (d_model,),
            "norm_2_scale": (d_model,),
            "norm_2_bias": (d_model,),
        }
    tree["final_norm_scale"] = (d_model,)
    tree["final_norm_bias"] = (d_model,)
    return tree


def random_like_shapes(shapes: Any, seed: int, scale: float = 1.0) -> Any:
    """A float32 array N(0, scale²) for every shape tuple in ``shapes``."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    arrays = [
        scale * jax.random.normal(k, s, jnp.float32)
        for k, s in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


# --------------------------------------------------------------------------- FLOPs

FLOP_TERMS = (
    "A",  # A = G ×_i Q_i for every axis
    "B",  # B = V ×_i Q_i^{-T}: one triangular solve per axis
    "grams",  # T1 = A_(i)A_(i)ᵀ and T2 = B_(i)B_(i)ᵀ for every axis
    "q_update",  # triu(T1 − T2) · Q_i per axis
    "gram_cache",  # P_i = Q_iᵀQ_i after a fit (cache_preconditioner=True only)
    "precondition",  # U = G ×_i P_i (cached) or G ×_i Q_i ×_i Q_iᵀ (not cached)
)


def kron_matmul_flops(
    shape: Sequence[int],
    *,
    cache_preconditioner: bool,
    max_size_triangular: int = MAX_SIZE_TRIANGULAR,
    min_ndim_triangular: int = MIN_NDIM_TRIANGULAR,
    memory_save_mode: str | None = None,
) -> dict[str, float]:
    """Matmul FLOPs of PSGD Kron for one parameter, by stage.

    Let N = ∏ d_j be the number of entries and D = Σ d_i over the axes with a
    triangular (d_i × d_i) factor. Multiplying a d×d matrix into axis i of the
    tensor costs 2·d_i·N FLOPs (a multiply and an add per term); a triangular
    solve costs half that, d_i·N. Per tensor:

    ========================  =========================  ===================
    stage                     general                    2-D m×n, both tri.
    ========================  =========================  ===================
    A = G ×_i Q_i             2·D·N                      2m²n + 2mn²
    B = V ×_i Q_i^{-T}        D·N                        m²n + mn²
    T1, T2 per axis           4·D·N                      4m²n + 4mn²
    triu(T1 − T2)·Q_i         Σ 2·d_i³                   2m³ + 2n³
    P_i = Q_iᵀQ_i (cached)    Σ 2·d_i³                   2m³ + 2n³
    precondition, cached      2·D·N  (G ×_i P_i)         2m²n + 2mn²
    precondition, not cached  4·D·N  (Q_iᵀ(Q_i·G))       4m²n + 4mn²
    ========================  =========================  ===================

    The first five stages run only on a step that fits the factors; precondition
    runs every step. Diagonal factors and everything elementwise (momentum, noise,
    the O(d²) norm lower bound, the RMS clip, packing/unpacking, AdamW-like
    O(N) work) are not counted: O(N) per tensor, negligible next to the
    O(d·N) terms for d in the hundreds. The triangular matrices are counted as
    dense in the Q update and QᵀQ, as XLA executes them.

    Returns:
        FLOPs per stage (keys :data:`FLOP_TERMS`), plus ``"fit_step"`` (all
        stages) and ``"plain_step"`` (precondition only).
    """
    shape = tuple(shape) or (1,)
    diagonal = plan_diagonal_axes(
        shape,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=memory_save_mode,
    )
    numel = float(np.prod(shape))
    tri = [float(d) for d, diag in zip(shape, diagonal, strict=True) if not diag]
    d_sum = sum(tri)
    d_cubes = sum(d**3 for d in tri)
    terms = {
        "A": 2 * d_sum * numel,
        "B": d_sum * numel,
        "grams": 4 * d_sum * numel,
        "q_update": 2 * d_cubes,
        "gram_cache": 2 * d_cubes if cache_preconditioner else 0.0,
        "precondition": (2 if cache_preconditioner else 4) * d_sum * numel,
    }
    terms["fit_step"] = sum(terms[t] for t in FLOP_TERMS)
    terms["plain_step"] = terms["precondition"]
    return terms


def tree_matmul_flops(shapes: list[tuple[int, ...]], cache: bool) -> dict[str, float]:
    """:func:`kron_matmul_flops` summed over a list of parameter shapes."""
    total: dict[str, float] = collections.defaultdict(float)
    for shape in shapes:
        for name, value in kron_matmul_flops(shape, cache_preconditioner=cache).items():
            total[name] += value
    return dict(total)


# --------------------------------------------------------------------------- updates


def compile_update(tx: optax.GradientTransformation, params: Any, grads: Any):
    """``tx.update`` jitted with the state donated, compiled once; also its state."""
    state = tx.init(params)
    start = time.perf_counter()
    compiled = (
        jax.jit(tx.update, donate_argnums=1).lower(grads, state, params).compile()
    )
    return compiled, state, time.perf_counter() - start


def run_steps(compiled, grads, state, params, steps: int):
    """Runs ``steps`` consecutive updates, timing each (blocked); returns times, state.

    Also returns, per step, whether the step fitted the factors (kron's
    ``update_counter`` is reset to 0 on a fit; None for other optimizers).
    """
    times, fitted = [], []
    for _ in range(steps):
        start = time.perf_counter()
        updates, state = compiled(grads, state, params)
        _block((updates, state))
        times.append(time.perf_counter() - start)
        fitted.append(_fitted(state))
    return times, fitted, state


def _fitted(state: Any) -> bool | None:
    for sub in state if isinstance(state, tuple) else (state,):
        counter = getattr(sub, "update_counter", None)
        if counter is not None:
            return int(counter) == 0
    return None


def measure_adamw(params, grads, runs: int) -> dict[str, Any]:
    tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    compiled, state, compile_s = compile_update(tx, params, grads)
    _, _, state = run_steps(compiled, grads, state, params, 3)  # warm-up
    times, _, _ = run_steps(compiled, grads, state, params, runs)
    return {
        "optimizer": "adamw",
        "median_s": statistics.median(times),
        "times": times,
        "runs": runs,
        "compile_s": compile_s,
        "xla_gflop": _scaled(xla_flops(compiled)),
    }


def measure_kron(
    params, grads, *, probability: float, cache: bool, steps: int
) -> dict[str, Any]:
    """Times ``steps`` consecutive kron updates after one warm-up step."""
    tx = kron(
        LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        preconditioner_update_probability=probability,
        cache_preconditioner=cache,
    )
    compiled, state, compile_s = compile_update(tx, params, grads)
    # Warm-up: one step (a fitting step at p = 1, a plain one at p = 0.03).
    _, _, state = run_steps(compiled, grads, state, params, 1)
    times, fitted, _ = run_steps(compiled, grads, state, params, steps)
    fit_times = [t for t, f in zip(times, fitted, strict=True) if f]
    plain_times = [t for t, f in zip(times, fitted, strict=True) if not f]
    return {
        "optimizer": "kron",
        "probability": probability,
        "cache_preconditioner": cache,
        "steps": steps,
        "fit_steps": len(fit_times),
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "fit_median_s": statistics.median(fit_times) if fit_times else None,
        "plain_median_s": statistics.median(plain_times) if plain_times else None,
        "compile_s": compile_s,
        "xla_gflop": _scaled(xla_flops(compiled)),
    }


# --------------------------------------------------------------------------- breakdown


def _triangular(key: jax.Array, d: int) -> jax.Array:
    """A well-conditioned upper-triangular factor, like a fitted Q."""
    return jnp.eye(d, dtype=jnp.float32) + 0.02 * jnp.triu(
        jax.random.normal(key, (d, d), jnp.float32)
    ) / np.sqrt(d)


def _stage_functions() -> dict[str, tuple[Callable, str]]:
    """Stage name -> (fn(Q1, Q2, packed1, packed2, G, V, T1, T2), FLOP term)."""

    def solve_both(Q1, Q2, V):
        B = km.solve_transposed_along_axis(Q1, V, 0)
        return km.solve_transposed_along_axis(Q2, B, 1)

    def grams(A, B):
        return [km.unfold_gram(X, axis, False) for axis in (0, 1) for X in (A, B)]

    return {
        "A = Q1·G·Q2ᵀ": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: km.apply_along_axes([Q1, Q2], G),
            "A",
        ),
        "B: 2 triangular solves": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: solve_both(Q1, Q2, V),
            "B",
        ),
        "T1, T2 Grams, both axes": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: grams(G, V),
            "grams",
        ),
        "triu(T1−T2)·Q, both axes": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: (
                jnp.triu(T1) @ Q1,
                jnp.triu(T2) @ Q2,
            ),
            "q_update",
        ),
        "fit total (update_factors)": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: km.update_factors([Q1, Q2], G, V, 0.1),
            "fit_no_cache",
        ),
        "QᵀQ + pack, both axes": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: (
                km.pack_factor(Q1),
                km.pack_factor(Q2),
            ),
            "gram_cache",
        ),
        "unpack Q + P (no matmul)": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: (
                km.unpack_factor(p1),
                km.unpack_gram(p1),
                km.unpack_factor(p2),
                km.unpack_gram(p2),
            ),
            "none",
        ),
        "precondition cached: unpack P, P1·G·P2": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: km.precondition_with_grams(
                [km.unpack_gram(p1), km.unpack_gram(p2)], G
            ),
            "precondition_cached",
        ),
        "precondition not cached: Qᵀ(Q·G) per axis": (
            lambda Q1, Q2, p1, p2, G, V, T1, T2: km.precondition([Q1, Q2], G),
            "precondition_not_cached",
        ),
    }


def _stage_flops(shape: tuple[int, int], term: str) -> float:
    if term == "none":
        return 0.0
    if term == "fit_no_cache":
        f = kron_matmul_flops(shape, cache_preconditioner=False)
        return f["A"] + f["B"] + f["grams"] + f["q_update"]
    if term.startswith("precondition_"):
        cache = term == "precondition_cached"
        return kron_matmul_flops(shape, cache_preconditioner=cache)["precondition"]
    return kron_matmul_flops(shape, cache_preconditioner=True)[term]


def measure_breakdown(shapes: list[tuple[int, ...]], runs: int) -> dict[str, Any]:
    """Median time of each stage per distinct 2-D shape, and summed over the tree."""
    counts = collections.Counter(s for s in shapes if len(s) == 2)
    stages = _stage_functions()
    per_shape: dict[str, dict[str, dict[str, float | None]]] = {}
    for shape, _ in sorted(counts.items()):
        m, n = shape
        keys = jax.random.split(jax.random.PRNGKey(m * 7919 + n), 6)
        Q1, Q2 = _triangular(keys[0], m), _triangular(keys[1], n)
        args = (
            Q1,
            Q2,
            km.pack_factor(Q1),
            km.pack_factor(Q2),
            jax.random.normal(keys[2], shape, jnp.float32),
            jax.random.normal(keys[3], shape, jnp.float32),
            jax.random.normal(keys[4], (m, m), jnp.float32),
            jax.random.normal(keys[5], (n, n), jnp.float32),
        )
        rows = {}
        for name, (fn, term) in stages.items():
            compiled = jax.jit(fn).lower(*args).compile()
            times = time_calls(lambda c=compiled, a=args: c(*a), runs, warmup=1)
            rows[name] = {
                "median_s": statistics.median(times),
                "gflop": _stage_flops(shape, term) / 1e9,
                "xla_gflop": _scaled(xla_flops(compiled)),
            }
        per_shape[f"{m}x{n}"] = rows
    totals = {}
    for name in stages:
        totals[name] = {
            "seconds": sum(
                per_shape[f"{s[0]}x{s[1]}"][name]["median_s"] * c
                for s, c in counts.items()
            ),
            "gflop": sum(
                per_shape[f"{s[0]}x{s[1]}"][name]["gflop"] * c
                for s, c in counts.items()
            ),
        }
    return {
        "counts": {f"{s[0]}x{s[1]}": c for s, c in sorted(counts.items())},
        "per_shape": per_shape,
        "tree_totals": totals,
        "tree_precondition_only": {
            str(cache): measure_tree_precondition(shapes, runs, cache)
            for cache in (True, False)
        },
    }


def measure_tree_precondition(
    shapes: list[tuple[int, ...]], runs: int, cache: bool
) -> dict[str, float]:
    """Median time of applying the preconditioner to every tensor, in one jit.

    The matmul part of a step without a fit (no momentum, RMS clip, ``lax.cond``
    or state handling): the difference to kron's measured step without a fit is
    the cost of everything else in the step.
    """
    keys = jax.random.split(jax.random.PRNGKey(17), len(shapes))
    all_factors, grads = [], []
    for key, shape in zip(keys, shapes, strict=True):
        key_g, *key_q = jax.random.split(key, len(shape) + 1)
        diagonal = plan_diagonal_axes(
            shape,
            max_size_triangular=MAX_SIZE_TRIANGULAR,
            min_ndim_triangular=MIN_NDIM_TRIANGULAR,
            memory_save_mode=None,
        )
        factors = []
        for k, d, diag in zip(key_q, shape, diagonal, strict=True):
            if diag:
                factors.append(jnp.ones((d,), jnp.float32))
            else:
                Q = _triangular(k, d)
                factors.append(km.pack_factor(Q) if cache else Q)
        all_factors.append(tuple(factors))
        grads.append(jax.random.normal(key_g, shape, jnp.float32))

    def precondition_tree(all_factors, grads):
        out = []
        for factors, G in zip(all_factors, grads, strict=True):
            if cache:
                grams = [F * F if F.ndim == 1 else km.unpack_gram(F) for F in factors]
                out.append(km.precondition_with_grams(grams, G))
            else:
                out.append(km.precondition(factors, G))
        return out

    compiled = jax.jit(precondition_tree).lower(all_factors, grads).compile()
    times = time_calls(lambda: compiled(all_factors, grads), runs, warmup=1)
    gflop = tree_matmul_flops(shapes, cache)["plain_step"] / 1e9
    return {"median_s": statistics.median(times), "gflop": gflop}


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _fmt_xla(gflop: float | None, spec: str = ".2f") -> str:
    """XLA's estimate; it reports a negative count for ops it cannot cost."""
    if gflop is not None and gflop < 0:
        return "not counted"
    return _fmt(gflop, spec)


def markdown_report(result: dict[str, Any]) -> str:
    info, cfg = result["machine"], result["config"]
    peak = result["matmul_peak_gflops"]
    adamw_s = result["adamw"]["median_s"]
    out = []
    out.append("# PSGD Kron update cost vs AdamW\n")
    out.append(
        f"- CPU: {info['cpu_model']} — {info['logical_cpus']} logical CPUs "
        f"({info['usable_cpus']} usable), JAX device {info['jax_device']}"
    )
    out.append(
        f"- jax {info['jax']}, jaxlib {info['jaxlib']}, optax {info['optax']}, "
        f"numpy {info['numpy']}, precond {info['precond']}, "
        f"Python {info['python']}"
    )
    out.append(f"- date (UTC): {info['date_utc']}")
    out.append(
        f"- load average (1, 5, 15 min) at start {info['loadavg_start']}, "
        f"at end {info['loadavg_end']}"
    )
    out.append(
        f"- model: {cfg['layers']} layers, d_model {cfg['d_model']}, MLP "
        f"{cfg['d_mlp']}, embedding {cfg['vocab']}×{cfg['d_model']}: "
        f"{cfg['num_params']:,} parameters in {cfg['num_tensors']} tensors"
    )
    out.append(
        f"- update = `jax.jit(tx.update, donate_argnums=1)` (state donated, fed "
        f"back), float32, weight decay {WEIGHT_DECAY} for both; "
        f"repeats {cfg['repeats']}, window {cfg['window_steps']} steps"
        + (" — QUICK smoke run, not the benchmark" if cfg["quick"] else "")
    )
    out.append(f"- total wall time {result['wall_s']:.0f} s\n")

    out.append("## 1. float32 matmul throughput (reference peak)\n")
    out.append("| pass | n | runs | median ms | GFLOP/s |")
    out.append("|---|---:|---:|---:|---:|")
    for r in result["matmul"]:
        out.append(
            f"| {r['pass']} | {r['n']} | {r['runs']} | {r['median_ms']:.2f} "
            f"| {r['gflops']:.1f} |"
        )
    out.append(
        f"\nPeak (best median, both passes): **{peak:.1f} GFLOP/s**. 'before' is "
        "measured before the kron runs, 'after' after them.\n"
    )

    out.append("## 2. Update time vs AdamW (same run)\n")
    out.append("| optimizer | cache_preconditioner | p | statistic | ms | × AdamW |")
    out.append("|---|---|---:|---|---:|---:|")
    adamw = result["adamw"]
    out.append(
        f"| optax.adamw | – | – | median of {adamw['runs']} (before "
        f"{adamw['median_before_s'] * 1e3:.2f}, after "
        f"{adamw['median_after_s'] * 1e3:.2f}) | {adamw_s * 1e3:.2f} | 1.00 |"
    )
    for r in result["kron"]:
        head = f"| kron | {r['cache_preconditioner']} | {r['probability']:g} "
        if r["probability"] == 1.0:
            stats = [(f"median of {r['steps']} (every step fits)", r["median_s"])]
        else:
            stats = [
                (
                    f"median of {r['steps'] - r['fit_steps']} steps without a fit",
                    r["plain_median_s"],
                ),
                (f"fitting step ({r['fit_steps']} in window)", r["fit_median_s"]),
                (f"amortised: mean over {r['steps']} steps", r["mean_s"]),
            ]
        for label, seconds in stats:
            ratio = None if seconds is None else seconds / adamw_s
            ms = None if seconds is None else seconds * 1e3
            out.append(f"{head}| {label} | {_fmt(ms)} | {_fmt(ratio, '.1f')} |")
    out.append("")

    out.append("## 3. Achieved FLOP/s vs matmul peak\n")
    out.append(
        "Analytic = matmul FLOPs the algorithm needs (`kron_matmul_flops`; "
        "elementwise work not counted). XLA = `cost_analysis()['flops']` of the "
        "whole compiled update; it counts both branches of each `lax.cond`, so it "
        "estimates a fitting step, also for p = 0.03, and it counts no FLOPs for "
        "`triangular_solve` (see section 4).\n"
    )
    out.append(
        "| cache | p | step | analytic GFLOP | XLA GFLOP | ms | GFLOP/s | % of peak |"
    )
    out.append("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in result["kron"]:
        flops = result["analytic_gflop"][str(r["cache_preconditioner"])]
        fit, plain = flops["fit_step"], flops["plain_step"]
        if r["probability"] == 1.0:
            rows = [("fitting (median)", fit, r["median_s"])]
        else:
            k = STEPS_PER_FIT
            rows = [
                ("without fit (median)", plain, r["plain_median_s"]),
                ("amortised (mean)", (fit + (k - 1) * plain) / k, r["mean_s"]),
            ]
        for label, gflop, seconds in rows:
            rate = None if seconds is None else gflop / seconds
            share = None if rate is None else 100 * rate / peak
            out.append(
                f"| {r['cache_preconditioner']} | {r['probability']:g} | {label} "
                f"| {gflop:.1f} | {_fmt_xla(r['xla_gflop'], '.1f')} "
                f"| {_fmt(None if seconds is None else seconds * 1e3, '.1f')} "
                f"| {_fmt(rate, '.1f')} | {_fmt(share, '.1f')} |"
            )
    out.append(
        f"\nAdamW: XLA estimate {_fmt(result['adamw']['xla_gflop'], '.3f')} GFLOP "
        f"per update (elementwise only). Compile seconds: AdamW "
        f"{result['adamw']['compile_s']:.1f}, kron "
        + ", ".join(
            f"(cache={r['cache_preconditioner']}, p={r['probability']:g}) "
            f"{r['compile_s']:.1f}"
            for r in result["kron"]
        )
        + "\n"
    )
    out.append("Analytic GFLOP per step by stage, summed over the tree:\n")
    out.append("| stage | cache=True | cache=False |")
    out.append("|---|---:|---:|")
    for term in (*FLOP_TERMS, "fit_step", "plain_step"):
        out.append(
            f"| {term} | {result['analytic_gflop']['True'][term]:.1f} "
            f"| {result['analytic_gflop']['False'][term]:.1f} |"
        )
    out.append("")

    breakdown = result.get("breakdown")
    if breakdown:
        shapes = list(breakdown["counts"])
        out.append("## 4. Where the time goes: stages jitted alone\n")
        out.append(
            "Median ms of each stage on random inputs per matrix shape (count in "
            "the tree in parentheses); 'tree' sums count × time, with its GFLOP/s "
            "and % of peak. Stages overlap: 'fit total' = A + B + Grams + Q update "
            "+ norm bounds + elementwise.\n"
        )
        header = " | ".join(f"{s} (×{breakdown['counts'][s]})" for s in shapes)
        out.append(f"| stage | {header} | tree ms | tree GFLOP/s | % of peak |")
        out.append("|---|" + "---:|" * (len(shapes) + 3))
        for name, total in breakdown["tree_totals"].items():
            cells = " | ".join(
                f"{breakdown['per_shape'][s][name]['median_s'] * 1e3:.2f}"
                for s in shapes
            )
            rate = total["gflop"] / total["seconds"] if total["gflop"] else None
            share = None if rate is None else 100 * rate / peak
            out.append(
                f"| {name} | {cells} | {total['seconds'] * 1e3:.1f} "
                f"| {_fmt(rate, '.1f')} | {_fmt(share, '.1f')} |"
            )
        out.append("")
        out.append(
            "Preconditioning every tensor of the tree in one jit (the matmul part "
            "of a step without a fit) vs kron's measured step without a fit "
            "(section 2); the rest of that step is momentum, RMS clip, "
            "`lax.cond` and state handling:\n"
        )
        out.append(
            "| cache | precondition-only ms | GFLOP/s | % of peak "
            "| step without fit ms | precondition share |"
        )
        out.append("|---|---:|---:|---:|---:|---:|")
        plain = {
            r["cache_preconditioner"]: r["plain_median_s"]
            for r in result["kron"]
            if r["plain_median_s"] is not None
        }
        for cache, row in breakdown["tree_precondition_only"].items():
            rate = row["gflop"] / row["median_s"]
            step = plain.get(cache == "True")
            share = None if step is None else 100 * row["median_s"] / step
            out.append(
                f"| {cache} | {row['median_s'] * 1e3:.1f} | {rate:.1f} "
                f"| {100 * rate / peak:.1f} "
                f"| {_fmt(None if step is None else step * 1e3, '.1f')} "
                f"| {_fmt(share, '.0f')}% |"
            )
        out.append("")
        out.append("Analytic vs XLA GFLOP per stage for the largest shape:\n")
        largest = max(shapes, key=lambda s: np.prod([int(x) for x in s.split("x")]))
        out.append(f"| stage ({largest}) | analytic GFLOP | XLA GFLOP |")
        out.append("|---|---:|---:|")
        for name, row in breakdown["per_shape"][largest].items():
            out.append(
                f"| {name} | {row['gflop']:.2f} | {_fmt_xla(row['xla_gflop'])} |"
            )
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed kron steps at p=1 and timed runs per breakdown stage "
        "(default 5; 2 with --quick); matmul and AdamW use 10× as many",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=1,
        help=f"number of {STEPS_PER_FIT}-step windows timed at p={LOW_PROBABILITY}",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="transformer layers (default 4)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 layer, 2 repeats, matmul sizes 512 and 1024",
    )
    parser.add_argument(
        "--no-breakdown", action="store_true", help="skip the per-stage breakdown"
    )
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.layers is None:
        args.layers = 1 if args.quick else 4
    if args.repeats < 1 or args.windows < 1 or args.layers < 1:
        parser.error("--repeats, --windows and --layers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    info = machine_info()
    d_model, d_mlp, vocab = 512, 2048, 256
    shapes_tree = transformer_tree(args.layers, d_model, d_mlp, vocab)
    shapes = jax.tree.leaves(shapes_tree, is_leaf=lambda x: isinstance(x, tuple))
    params = random_like_shapes(shapes_tree, seed=0, scale=0.02)
    grads = random_like_shapes(shapes_tree, seed=1)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - wall_start:6.1f} s] {msg}", file=sys.stderr)

    # Matmul peak and AdamW are measured before and after the kron runs, so that
    # a change of machine load during the run shows up (and is averaged) in the
    # references: the peak is the best median of both passes, the AdamW time the
    # median of both passes' runs pooled.
    sizes = (512, 1024) if args.quick else (512, 1024, 2048)
    log("matmul peak (before)")
    matmul_before = measure_matmul_peak(sizes, 10 * args.repeats)
    log("adamw (before)")
    adamw_before = measure_adamw(params, grads, 10 * args.repeats)

    kron_rows = []
    window = args.windows * STEPS_PER_FIT
    for probability, steps in ((1.0, args.repeats), (LOW_PROBABILITY, window)):
        for cache in (True, False):
            log(f"kron p={probability} cache_preconditioner={cache}")
            kron_rows.append(
                measure_kron(
                    params, grads, probability=probability, cache=cache, steps=steps
                )
            )

    breakdown = None
    if not args.no_breakdown:
        log("breakdown")
        breakdown = measure_breakdown(shapes, args.repeats)

    log("matmul peak (after)")
    matmul_after = measure_matmul_peak(sizes, 10 * args.repeats)
    log("adamw (after)")
    adamw_after = measure_adamw(params, grads, 10 * args.repeats)
    matmul = [{**before, "pass": "before"} for before in matmul_before] + [
        {**after, "pass": "after"} for after in matmul_after
    ]
    peak = max(r["gflops"] for r in matmul)
    adamw = {
        **adamw_before,
        "median_s": statistics.median(adamw_before["times"] + adamw_after["times"]),
        "median_before_s": adamw_before["median_s"],
        "median_after_s": adamw_after["median_s"],
        "runs": adamw_before["runs"] + adamw_after["runs"],
    }
    log("done")

    info["loadavg_end"] = _loadavg()
    result = {
        "machine": info,
        "config": {
            "layers": args.layers,
            "d_model": d_model,
            "d_mlp": d_mlp,
            "vocab": vocab,
            "num_params": int(sum(np.prod(s) for s in shapes)),
            "num_tensors": len(shapes),
            "repeats": args.repeats,
            "window_steps": window,
            "low_probability": LOW_PROBABILITY,
            "quick": args.quick,
            "state_donated": True,
        },
        "matmul": matmul,
        "matmul_peak_gflops": peak,
        "adamw": adamw,
        "kron": kron_rows,
        "analytic_gflop": {
            str(cache): {
                k: v / 1e9 for k, v in tree_matmul_flops(shapes, cache).items()
            }
            for cache in (True, False)
        },
        "breakdown": breakdown,
        "wall_s": time.perf_counter() - wall_start,
    }
    print(markdown_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
