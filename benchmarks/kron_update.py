"""Cost of one PSGD Kron optimizer update vs AdamW, and its share of matmul peak.

Measures, in one process on the local JAX backend (written for CPU):

1. Peak: float32 GFLOP/s of a jitted ``a @ b`` (n = 512, 1024, 2048), before and
   after everything else, so that a change of machine load shows.
2. ``tx.update(grads, state, params)``, jitted with the state donated and fed
   back, of ``optax.adamw`` and of ``precond.jax.kron`` with each
   ``preconditioner_cache`` layout ('packed', 'dense', None) on a transformer-shaped
   tree, at ``preconditioner_update_probability`` 1.0 (every step fits the
   factors) and 0.03 (one fit every 34 steps: the steps without a fit, the fitting
   step, and the mean over the 34-step window = amortised cost), as ratios to
   AdamW's time; and the optimizer-state bytes, as ratios to AdamW's.
3. Achieved FLOP/s: analytic matmul FLOPs (:func:`kron_matmul_flops`) over the
   measured time, as a fraction of the peak, with XLA's ``cost_analysis()`` total.
4. Breakdown: each stage jitted alone over all matrix tensors of the tree, and
   the measured steps split into those stages.

Usage::

    python benchmarks/kron_update.py               # full run, ~4 min on 2 cores
    python benchmarks/kron_update.py --quick       # smoke run (1 layer, few repeats)
    python benchmarks/kron_update.py --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _common import loadavg, machine_info, median_time, progress_log
from precond._common.factor_plan import plan_diagonal_axes
from precond.bench.report import write_json
from precond.jax import _kron_math as km
from precond.jax import kron
from precond.jax.kron import fit_randomness, unit_noise

LOW_PROBABILITY = 0.03
STEPS_PER_FIT = int(np.ceil(1.0 / LOW_PROBABILITY))  # 34: kron fits when >= 1/p
LAYOUTS = ("packed", "dense", None)  # kron's preconditioner_cache options
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # optax.adamw's default, given to both optimizers


def xla_gflop(compiled: Any) -> float | None:
    """XLA's FLOP estimate of a compiled executable, in GFLOP (None if absent)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # backend without cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return float(cost["flops"]) / 1e9 if cost and "flops" in cost else None


def measure_matmul(sizes: Sequence[int], runs: int, label: str) -> list[dict]:
    """GFLOP/s (2n³ FLOPs over the median time) of a jitted float32 n×n @ n×n."""
    rows = []
    for n in sizes:
        ka, kb = jax.random.split(jax.random.PRNGKey(n))
        ab = (jax.random.normal(ka, (n, n)), jax.random.normal(kb, (n, n)))
        compiled = jax.jit(jnp.matmul).lower(*ab).compile()
        n_runs = max(runs, int(runs * (2048 / n) ** 2 // 4))  # more for small n
        seconds = median_time(lambda c=compiled, ab=ab: c(*ab), n_runs, warmup=2)
        rows.append({"pass": label, "n": n, "runs": n_runs, "median_s": seconds})
        rows[-1]["gflops"] = 2 * n**3 / seconds / 1e9
    return rows


# --------------------------------------------------------------------------- model


def transformer_shapes(layers: int, d_model=512, d_mlp=2048, vocab=256) -> dict:
    """Parameter shapes of a pre-norm transformer."""
    tree: dict[str, Any] = {"embedding": (vocab, d_model)}
    for i in range(layers):
        layer = {f"attn_{x}": (d_model, d_model) for x in "qkvo"}
        layer |= {"mlp_in": (d_model, d_mlp), "mlp_out": (d_mlp, d_model)}
        layer |= {
            f"norm_{j}_{x}": (d_model,) for j in (1, 2) for x in ("scale", "bias")
        }
        tree[f"layer_{i}"] = layer
    return tree | {"final_norm_scale": (d_model,), "final_norm_bias": (d_model,)}


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def random_tree(shapes: Any, seed: int, scale: float = 1.0) -> Any:
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    arrays = [
        scale * jax.random.normal(k, s) for k, s in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


# --------------------------------------------------------------------------- FLOPs


def kron_matmul_flops(shape: Sequence[int], layout: str | None) -> dict[str, float]:
    """Matmul FLOPs of one kron update of a parameter of ``shape``, by stage.

    N = ∏ d_j entries, D = Σ d_i over axes with a triangular factor (kron's default
    factor plan). A d×d matrix multiplied into one axis costs 2·d·N; a triangular
    solve d·N. Fitting step: A = G ×_i Q_i (2DN), B = V ×_i Q_i^{-T} (DN), Grams
    T1, T2 of every axis (4DN), triu(T1 − T2)·Q_i (Σ 2d_i³), and for the cached
    layouts P_i = Q_iᵀQ_i (Σ 2d_i³). Every step: precondition, 2DN with cached P_i
    ('packed', 'dense') or 4DN as Q_iᵀ(Q_i·G) (None). Elementwise O(N) work
    (momentum, noise, clipping, unpacking) and O(d²) norm bounds are not counted;
    triangular matrices are counted dense in matmuls, as XLA runs them.
    """
    shape = tuple(shape) or (1,)
    diagonal = plan_diagonal_axes(
        shape, max_size_triangular=8192, min_ndim_triangular=2, memory_save_mode=None
    )
    numel = float(np.prod(shape))
    tri = [float(d) for d, diag in zip(shape, diagonal, strict=True) if not diag]
    dn, cubes = sum(tri) * numel, sum(2 * d**3 for d in tri)
    f = {"A": 2 * dn, "B": dn, "grams": 4 * dn, "q_update": cubes}
    f["fit"] = f["A"] + f["B"] + f["grams"] + f["q_update"]
    f["gram_cache"] = 0.0 if layout is None else cubes
    f["precondition"] = (4 if layout is None else 2) * dn
    f["fit_step"] = f["fit"] + f["gram_cache"] + f["precondition"]
    return f


def tree_gflop(shapes: Sequence[tuple], layout: str | None) -> dict[str, float]:
    per_shape = [kron_matmul_flops(s, layout) for s in shapes]
    return {k: sum(f[k] for f in per_shape) / 1e9 for k in per_shape[0]}


# --------------------------------------------------------------------------- updates


def measure_update(tx, params, grads, steps: int, warmup: int) -> dict[str, Any]:
    """Times consecutive donated updates; records which ones fitted (kron)."""
    state = tx.init(params)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    start = time.perf_counter()
    compiled = jax.jit(tx.update, donate_argnums=1).lower(grads, state, params)
    compiled = compiled.compile()
    compile_s = time.perf_counter() - start
    times, fitted = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(grads, state, params))[1]
        if i >= warmup:
            times.append(time.perf_counter() - start)
            # kron resets its update_counter to 0 on a step that fits the factors.
            counters = [s.update_counter for s in state if hasattr(s, "update_counter")]
            fitted.append(bool(counters) and int(counters[0]) == 0)
    return {
        "times": times,
        "fitted": fitted,
        "state_bytes": state_bytes,
        "xla_gflop": xla_gflop(compiled),
        "compile_s": compile_s,
        "state": state,  # the last one
    }


def measure_kron(params, grads, layout, probability, steps) -> dict[str, Any]:
    tx = kron(
        LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        preconditioner_update_probability=probability,
        preconditioner_cache=layout,
        # The layout BENCHMARKS.md's figures were measured with (before kron took
        # distributed-kron 1.0.0's merging and blocking defaults).
        merge_small_dims=False,
        partition_grads_into_blocks=False,
    )
    r = measure_update(tx, params, grads, steps, warmup=1)
    fit = [t for t, f in zip(r["times"], r["fitted"], strict=True) if f]
    plain = [t for t, f in zip(r["times"], r["fitted"], strict=True) if not f]
    return {
        "layout": layout,
        "probability": probability,
        "steps": steps,
        "median_s": statistics.median(r["times"]),
        "mean_s": statistics.fmean(r["times"]),
        "fit_s": statistics.median(fit) if fit else None,
        "plain_s": statistics.median(plain) if plain else None,
        "state_bytes": r["state_bytes"],
        "xla_gflop": r["xla_gflop"],
    }


# --------------------------------------------------------------------------- breakdown


def _store(Q: jax.Array, layout: str) -> jax.Array:
    """A fitted Q in a cached layout, as kron stores it after a fit."""
    return km.pack_factor(Q) if layout == "packed" else jnp.stack([Q, Q.T @ Q])


def _precondition(x: dict, layout: str | None) -> jax.Array:
    """kron's preconditioning of one tensor in a layout (packed unpacks P_i)."""
    if layout is None:
        return km.precondition(x["Q"], x["G"])
    unpack = km.unpack_gram if layout == "packed" else (lambda F: F[1])
    return km.precondition_with_grams([unpack(F) for F in x[layout]], x["G"])


def _solves(x: dict) -> jax.Array:
    B = km.solve_transposed_along_axis(x["Q"][0], x["V"], 0)
    return km.solve_transposed_along_axis(x["Q"][1], B, 1)


def _grams(x: dict) -> list[jax.Array]:
    return [km.unfold_gram(X, a, False) for a in (0, 1) for X in (x["G"], x["V"])]


def _q_update(x: dict) -> list[jax.Array]:
    return [jnp.triu(M) @ Q for M, Q in zip(x["M"], x["Q"], strict=True)]


def _fit(x: dict) -> list[jax.Array]:
    return km.update_factors(x["Q"], x["G"], x["V"], 0.1)


def _cache(x: dict, layout: str) -> list[jax.Array]:
    return [_store(Q, layout) for Q in x["Q"]]


def _noise(xs: list[dict]) -> Any:
    _, noise_key = fit_randomness(jax.random.PRNGKey(0))
    return [
        jax.vmap(
            lambda unit, x=x: unit_noise(
                noise_key, 0, unit, x["G"].shape[1:], x["G"].dtype
            )
        )(jnp.arange(x["G"].shape[0]))
        for x in xs
    ]


def _each(fn: Callable[..., Any], **kwargs: Any) -> Callable[[list[dict]], list]:
    """``fn`` vmapped over the units of every stack, as kron applies its kernels."""
    return lambda xs: [jax.vmap(partial(fn, **kwargs))(x) for x in xs]


def _stages() -> list[tuple[str, str, tuple, Callable]]:
    """(row, FLOP term = part of a step, layouts it belongs to, fn of all inputs)."""
    how = {"packed": "unpack Pᵢ, G ×ᵢ Pᵢ", "dense": "G ×ᵢ Pᵢ", None: "Qᵢᵀ(Qᵢ·G)"}
    how = {c: f"precondition, {c}: {how[c]}" for c in LAYOUTS}
    return [
        ("noise: one normal draw per unit", "noise", LAYOUTS, _noise),
        ("B = V ×ᵢ Qᵢ⁻ᵀ (triangular solves)", "B", LAYOUTS, _each(_solves)),
        ("Grams T1, T2, both axes", "grams", LAYOUTS, _each(_grams)),
        ("triu(T1 − T2)·Qᵢ, both axes", "q_update", LAYOUTS, _each(_q_update)),
        ("fit total (update_factors)", "fit", LAYOUTS, _each(_fit)),
        *[
            (f"QᵀQ, {c}", "gram_cache", (c,), _each(_cache, layout=c))
            for c in ("packed", "dense")
        ],
        *[
            (how[c], "precondition", (c,), _each(_precondition, layout=c))
            for c in LAYOUTS
        ],
    ]


def measure_breakdown(shapes: Sequence[tuple], runs: int) -> list[dict[str, Any]]:
    """Median time of each stage over all 2-D tensors of the tree, in one jit each.

    Like kron, tensors of equal shape are stacked and each stage is vmapped over
    them. The 1-D tensors (diagonal factors, < 0.1% of the entries) are left out.
    """
    matrices = [s for s in shapes if len(s) == 2]
    xs = []
    for i, shape in enumerate(sorted(set(matrices))):
        units, k = matrices.count(shape), jax.random.split(jax.random.PRNGKey(i), 6)
        Qs = [  # well-conditioned upper-triangular factors, like fitted ones
            jnp.eye(d)
            + 0.02 * jnp.triu(jax.random.normal(k[j], (units, d, d))) / d**0.5
            for j, d in enumerate(shape)
        ]
        x = {"Q": Qs, "G": jax.random.normal(k[4], (units, *shape))}
        x |= {"V": jax.random.normal(k[5], (units, *shape))}
        x |= {"M": [jax.random.normal(k[2 + j], Q.shape) for j, Q in enumerate(Qs)]}
        store = {c: jax.vmap(partial(_store, layout=c)) for c in ("packed", "dense")}
        xs.append(x | {c: [f(Q) for Q in Qs] for c, f in store.items()})
    rows = []
    for name, term, layouts, fn in _stages():
        compiled = jax.jit(fn).lower(xs).compile()
        rows.append(
            {
                "stage": name,
                "parts": [(term, c) for c in layouts],
                "median_s": median_time(lambda c=compiled: c(xs), runs),
                "gflop": tree_gflop(matrices, layouts[0]).get(term, 0.0),
                "xla_gflop": xla_gflop(compiled),
            }
        )
    return rows


# --------------------------------------------------------------------------- report


def _cell(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.1f}"
    return "n/a" if x is None else str(x)


def _table(header: str, rows: list[Sequence[Any]]) -> list[str]:
    """A Markdown table (first column left-aligned, floats to .1f), blank line."""
    lines = [f"| {header} |", "|---|" + "---:|" * header.count(" | ")]
    return lines + ["| " + " | ".join(map(_cell, r)) + " |" for r in rows] + [""]


def report(res: dict[str, Any]) -> str:
    info, cfg, peak, adamw = res["machine"], res["config"], res["peak"], res["adamw"]
    kr = {(r["layout"], r["probability"]): r for r in res["kron"]}
    lo_p, a_s = LOW_PROBABILITY, adamw["median_s"]

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else 1e3 * seconds

    def rate(gflop: float, seconds: float | None) -> list[float | None]:
        r = None if seconds is None or not gflop else gflop / seconds
        return [r, None if r is None else 100 * r / peak]  # GFLOP/s, % of peak

    def vs_adamw(seconds: float | None) -> str:
        return (
            "n/a" if seconds is None else f"{1e3 * seconds:.1f} ({seconds / a_s:.1f}×)"
        )

    def xla(gflop: float | None) -> float | str | None:  # < 0: ops XLA can't cost
        return "not counted" if gflop is not None and gflop < 0 else gflop

    out = [
        "# PSGD Kron update cost vs AdamW\n",
        f"- CPU: {info['cpu_model']}, {info['usable_cpus']} usable cores; JAX "
        f"device {info['jax_device']}; jax {info['jax']}, jaxlib {info['jaxlib']}, "
        f"optax {info['optax']}; XLA_FLAGS `{info['xla_flags']}`",
        f"- date (UTC) {info['date_utc']}; load average (1, 5, 15 min) at start "
        f"{info['loadavg_start']}, at end {info['loadavg_end']}; wall "
        f"{res['wall_s']:.0f} s",
        f"- tree: layers {cfg['layers']}, d_model 512, MLP 2048, embedding 256×512: "
        f"{cfg['num_params']:,} parameters in {cfg['num_tensors']} tensors, float32",
        "- update = `jax.jit(tx.update, donate_argnums=1)`, state fed back; weight "
        f"decay {WEIGHT_DECAY} for both; repeats {cfg['repeats']}"
        + (" — QUICK smoke run, not the benchmark" if cfg["quick"] else ""),
        "\n## 1. float32 matmul throughput (peak)\n",
        *_table(
            "pass | n | runs | median ms | GFLOP/s",
            [
                (
                    r["pass"],
                    r["n"],
                    r["runs"],
                    f"{1e3 * r['median_s']:.2f}",
                    r["gflops"],
                )
                for r in res["matmul"]
            ],
        ),
        f"Peak = best of both passes: **{peak:.1f} GFLOP/s** ('before' precedes "
        "the kron runs, 'after' follows them).",
        "\n## 2. Update time and optimizer state vs AdamW\n",
        f"AdamW: median of {adamw['runs']} updates (before "
        f"{1e3 * adamw['before_s']:.2f} ms, after {1e3 * adamw['after_s']:.2f} ms, "
        f"pooled **{1e3 * a_s:.2f} ms**). Time cells: ms (× AdamW). p = 1: median "
        f"of {cfg['repeats']} steps, each fits. p = {lo_p}: {cfg['window_steps']} "
        f"consecutive steps with one fit per {STEPS_PER_FIT}; amortised = mean.\n",
    ]
    rows = [("optax.adamw", "–", adamw["state_bytes"] / 2**20, "1.00", vs_adamw(a_s))]
    for c in LAYOUTS:
        hi, lo, nbytes = kr[(c, 1.0)], kr[(c, lo_p)], kr[(c, 1.0)]["state_bytes"]
        ratio = f"{nbytes / adamw['state_bytes']:.2f}"
        times = [hi["median_s"], lo["plain_s"], lo["fit_s"], lo["mean_s"]]
        rows.append(("kron", repr(c), nbytes / 2**20, ratio, *map(vs_adamw, times)))
    out += _table(
        "optimizer | preconditioner_cache | state MiB | state × AdamW | p = 1 | "
        f"p = {lo_p}, no fit (median) | p = {lo_p}, fitting step | "
        f"p = {lo_p}, amortised",
        [r + ("–",) * (8 - len(r)) for r in rows],
    )
    out += [
        "## 3. Achieved FLOP/s vs matmul peak\n",
        "Analytic = matmul FLOPs the layout needs (`kron_matmul_flops`; elementwise "
        "work not counted). None needs twice the preconditioning FLOPs of the "
        "cached layouts, so compare layouts by time, not by % of peak. XLA = "
        "`cost_analysis()` of the whole compiled update: it counts both branches "
        "of each `lax.cond` (a fitting step, on every row) and no FLOPs for "
        f"`triangular_solve`. AdamW: XLA {adamw['xla_gflop']:.3f} GFLOP.\n",
    ]
    rows = []
    for c in LAYOUTS:
        g, hi, lo = res["gflop"][str(c)], kr[(c, 1.0)], kr[(c, lo_p)]
        amortised = (g["fit_step"] + (STEPS_PER_FIT - 1) * g["precondition"]) / (
            STEPS_PER_FIT
        )
        for r, step, gflop, seconds in (
            (hi, "fitting (median)", g["fit_step"], hi["median_s"]),
            (lo, "no fit (median)", g["precondition"], lo["plain_s"]),
            (lo, "amortised (mean)", amortised, lo["mean_s"]),
        ):
            head = (repr(c), f"{r['probability']:g}", step, gflop, xla(r["xla_gflop"]))
            rows.append((*head, ms(seconds), *rate(gflop, seconds)))
    out += _table(
        "preconditioner_cache | p | step | analytic GFLOP | XLA GFLOP | ms | "
        "GFLOP/s | % of peak",
        rows,
    )
    stages = res.get("breakdown")
    if not stages:
        return "\n".join(out)
    out += [
        "## 4. Where the time goes\n",
        "Each stage jitted alone over all 2-D tensors of the tree (equal shapes "
        "stacked and vmapped, as kron does; the 1-D tensors, < 0.1% of the "
        "entries, left out), on random well-conditioned inputs. The fit's "
        "A = G ×ᵢ Qᵢ is the same matmuls as 'precondition, dense'; 'fit total' "
        "is A, B, the Grams, the norm lower bounds and the Q updates.\n",
        *_table(
            "stage | ms | analytic GFLOP | XLA GFLOP | GFLOP/s | % of peak",
            [
                (
                    s["stage"],
                    ms(s["median_s"]),
                    s["gflop"],
                    xla(s["xla_gflop"]),
                    *rate(s["gflop"], s["median_s"]),
                )
                for s in stages
            ],
        ),
        "Measured steps split into those stages (ms); rest = measured − stages: "
        "momentum, damping, balancing, unpacking Q, RMS clip, `lax.cond`s, state "
        "copies, the 1-D tensors (negative: XLA fused or overlapped the stages "
        "better inside the step than alone).\n",
    ]
    rows = []
    for c in LAYOUTS:
        split = [
            sum((ms(s["median_s"]) for s in stages if (part, c) in s["parts"]), 0.0)
            for part in ("noise", "fit", "gram_cache", "precondition")
        ]
        fit_ms, plain = ms(kr[(c, 1.0)]["median_s"]), ms(kr[(c, lo_p)]["plain_s"])
        plain_rest = None if plain is None else plain - split[3]
        rows.append((repr(c), fit_ms, *split, fit_ms - sum(split), plain, split[3]))
        rows[-1] += (plain_rest,)
    out += _table(
        "preconditioner_cache | fitting step (p = 1) | noise | fit total | QᵀQ | "
        f"precondition | rest | no-fit step (p = {lo_p}) | precondition | rest",
        rows,
    )
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed kron steps at p=1 and runs per breakdown stage (default 5, "
        "2 with --quick); matmul and AdamW use 10× as many",
    )
    parser.add_argument(
        "--windows", type=int, default=1, help=f"{STEPS_PER_FIT}-step windows at p=0.03"
    )
    parser.add_argument("--layers", type=int, help="transformer layers (default 4)")
    parser.add_argument("--quick", action="store_true", help="1 layer, 2 repeats")
    parser.add_argument("--no-breakdown", action="store_true", help="skip section 4")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.layers = args.layers or (1 if args.quick else 4)
    if min(args.repeats, args.windows, args.layers) < 1:
        parser.error("--repeats, --windows and --layers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    info = machine_info()

    log = progress_log(t0)

    shapes_tree = transformer_shapes(args.layers)
    shapes = jax.tree.leaves(shapes_tree, is_leaf=_is_shape)
    params = random_tree(shapes_tree, seed=0, scale=0.02)
    grads = random_tree(shapes_tree, seed=1)
    sizes = (512, 1024) if args.quick else (512, 1024, 2048)
    ref_runs = 10 * args.repeats
    adamw_tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    def references(label: str) -> tuple[list[dict], dict]:
        log(f"matmul peak, adamw ({label})")
        matmul = measure_matmul(sizes, ref_runs, label)
        return matmul, measure_update(adamw_tx, params, grads, ref_runs, warmup=3)

    matmul_before, adamw_before = references("before")
    kron_rows = []
    window = args.windows * STEPS_PER_FIT
    for probability, steps in ((1.0, args.repeats), (LOW_PROBABILITY, window)):
        for layout in LAYOUTS:
            log(f"kron p={probability} preconditioner_cache={layout!r}")
            kron_rows.append(measure_kron(params, grads, layout, probability, steps))
    breakdown = None
    if not args.no_breakdown:
        log("breakdown")
        breakdown = measure_breakdown(shapes, args.repeats)
    matmul_after, adamw_after = references("after")
    log("done")

    info["loadavg_end"] = loadavg()
    matmul = matmul_before + matmul_after
    result = {
        "machine": info,
        "config": {
            "layers": args.layers,
            "num_params": int(sum(np.prod(s) for s in shapes)),
            "num_tensors": len(shapes),
            "repeats": args.repeats,
            "window_steps": window,
            "quick": args.quick,
        },
        "matmul": matmul,
        "peak": max(r["gflops"] for r in matmul),
        "adamw": {
            "median_s": statistics.median(adamw_before["times"] + adamw_after["times"]),
            "before_s": statistics.median(adamw_before["times"]),
            "after_s": statistics.median(adamw_after["times"]),
            "runs": 2 * ref_runs,
            "state_bytes": adamw_before["state_bytes"],
            "xla_gflop": adamw_before["xla_gflop"],
        },
        "kron": kron_rows,
        "gflop": {str(layout): tree_gflop(shapes, layout) for layout in LAYOUTS},
        "breakdown": breakdown,
        "wall_s": time.perf_counter() - t0,
    }
    print(report(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
