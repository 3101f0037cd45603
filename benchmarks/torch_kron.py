"""Cost of one ``precond.torch.Kron`` step vs ``torch.optim.AdamW``, and its share
of the matmul peak.

Measures, in one process with PyTorch (written for CPU; ``--device cuda`` also runs):

1. Peak: float32 GFLOP/s of ``torch.mm`` (n = 512, 1024), before and after
   everything else, at the thread count of the run.
2. ``optimizer.step()`` on a transformer-shaped model (``nn.Embedding``, per block
   two ``nn.LayerNorm`` and the qkv, attention-out, MLP-in and MLP-out
   ``nn.Linear`` layers with biases, a final ``nn.LayerNorm``) whose gradients are
   set once (standard normal) and never change; only ``step()`` is timed. AdamW
   (``torch.optim.AdamW`` defaults: the for-loop implementation on CPU; the
   ``foreach=True`` one beside it) against Kron at
   ``preconditioner_update_probability`` 1.0 (every step fits the factors) and
   0.03 (one fit every 34 steps: the steps without a fit, the fitting step and
   the mean over the 34-step window = amortised cost), eager and with
   ``compile_kernels=True``, as ratios to AdamW's median step. All optimizers
   are stepped in interleaved rounds (rotating order), so a change of machine
   load hits all of them alike. Warm-up steps are not timed; the compile time
   (first compiled step minus a steady one, on a fresh Inductor cache) is
   reported separately.
3. Optimizer-state bytes (every tensor in ``optimizer.state``), as ratios to
   AdamW's.
4. Achieved FLOP/s: analytic matmul FLOPs (``kron_update.kron_matmul_flops`` with
   ``preconditioner_cache=None``, which is how the torch kernels precondition:
   Qᵢᵀ(Qᵢ·G)) over the measured time, as a fraction of the peak.
5. Where the time goes: ``torch.profiler`` of one eager fitting step and one
   eager step without a fit, top operators by self time.

Usage::

    python benchmarks/torch_kron.py                  # full run, ~2.5 min on 2 cores
    python benchmarks/torch_kron.py --quick          # smoke run (1 block, few repeats)
    python benchmarks/torch_kron.py --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

# A fresh Inductor cache, so that the compile time is a first compile's: set
# before torch is imported (kept when the caller chose one).
_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.TemporaryDirectory(prefix="torch_kron_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE.name


import torch
from torch import nn

from _common import loadavg, machine_info, progress_log
from kron_update import _table, kron_matmul_flops
from precond.bench.report import write_json
from precond.torch import Kron

LOW_PROBABILITY = 0.03
STEPS_PER_FIT = 34  # Kron fits when its counter reaches 1/p = 33.3…, i.e. every 34
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 1e-4  # given to every optimizer
ADAMW = "adamw"  # the reference: torch.optim.AdamW with its defaults
ADAMW_FOREACH = "adamw-foreach"
ADAMW_STEPS_PER_ROUND = 2


# --------------------------------------------------------------------------- model


def transformer(layers: int, d_model: int, d_mlp: int, vocab: int) -> nn.Module:
    """Parameters of a pre-norm transformer (no forward: only the shapes matter)."""
    blocks = []
    for _ in range(layers):
        blocks += [
            nn.LayerNorm(d_model),
            nn.Linear(d_model, 3 * d_model),  # q, k, v
            nn.Linear(d_model, d_model),  # attention out
            nn.LayerNorm(d_model),
            nn.Linear(d_model, d_mlp),
            nn.Linear(d_mlp, d_model),
        ]
    return nn.ModuleList([nn.Embedding(vocab, d_model), *blocks, nn.LayerNorm(d_model)])


def set_gradients(params: Sequence[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.device)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    def tensors(x: Any):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)

    return sum(
        t.numel() * t.element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        for t in tensors(value)
    )


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def measure_matmul(
    sizes: Sequence[int], runs: int, label: str, device: torch.device
) -> list[dict]:
    """GFLOP/s (2n³ FLOPs over the median time) of a float32 n×n ``torch.mm``."""
    rows = []
    for n in sizes:
        generator = torch.Generator().manual_seed(n)
        a, b = (torch.randn(n, n, generator=generator).to(device) for _ in range(2))
        out = torch.empty(n, n, device=device)
        n_runs = max(runs, int(runs * (1024 / n) ** 2 // 2))  # more for small n

        def mm(a=a, b=b, out=out) -> None:
            torch.mm(a, b, out=out)

        for _ in range(2):
            mm()
        times = [timed(mm, device) for _ in range(n_runs)]
        seconds = statistics.median(times)
        rows.append({"pass": label, "n": n, "runs": n_runs, "median_s": seconds})
        rows[-1]["gflops"] = 2 * n**3 / seconds / 1e9
    return rows


class Timed:
    """One optimizer under test: its step times and, for Kron, which fitted."""

    def __init__(self, name: str, optimizer: torch.optim.Optimizer, probe: Any):
        self.name, self.optimizer, self.probe = name, optimizer, probe
        self.times: list[float] = []
        self.fitted: list[bool] = []

    def step(self, device: torch.device) -> tuple[float, bool]:
        seconds = timed(self.optimizer.step, device)
        # Kron resets a parameter's update counter to 0 on a step that fits.
        state = self.optimizer.state.get(self.probe, {})
        return seconds, state.get("update_counter") == 0

    def record(self, device: torch.device) -> None:
        seconds, fitted = self.step(device)
        self.times.append(seconds)
        self.fitted.append(fitted)


def kron(params, probability: float, compiled: bool) -> Kron:
    return Kron(
        params,
        lr=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        preconditioner_update_probability=probability,
        compile_kernels=compiled,
        # precond's rules when BENCHMARKS.md's figures were recorded (before
        # kron-torch 0.1.0's defaults): RMS clipping, damping noise, no skew rule,
        # float32 factors, triangular factors from 2-D.
        update_clipping="rms",
        damping=True,
        max_skew_triangular=float("inf"),
        min_ndim_triangular=2,
        precond_dtype=torch.float32,
    )


def run_steps(args: argparse.Namespace, params, device, log) -> dict[str, Any]:
    """Warms up every optimizer, then times them in interleaved rounds."""
    probe = max(params, key=lambda p: p.numel())  # a 2-D weight: has a counter
    optimizers = {
        ADAMW: torch.optim.AdamW(params, LEARNING_RATE, weight_decay=WEIGHT_DECAY),
        ADAMW_FOREACH: torch.optim.AdamW(
            params, LEARNING_RATE, weight_decay=WEIGHT_DECAY, foreach=True
        ),
    }
    for probability in (1.0, LOW_PROBABILITY):
        for compiled in (False, True):
            name = f"kron p={probability:g} {'compiled' if compiled else 'eager'}"
            optimizers[name] = kron(params, probability, compiled)
    runs = {name: Timed(name, opt, probe) for name, opt in optimizers.items()}
    warmup: dict[str, list[float]] = {}
    compile_stats: dict[str, Any] = {}
    for name, r in runs.items():
        # p = 0.03: through the first fit (compiles the fit when compiled). Compiled
        # at p = 1 first: its first step compiles both kernels for every stack.
        steps = STEPS_PER_FIT if "p=0.03" in name else 3 if "kron" in name else 5
        log(f"warm-up {name} ({steps} steps)")
        warmup[name] = [r.step(device)[0] for _ in range(steps)]
        if name == "kron p=1 compiled":
            compile_stats = dynamo_counters()
    rounds = args.windows * STEPS_PER_FIT
    p1_rounds = {round(i * rounds / args.repeats) for i in range(args.repeats)}
    log(f"timing: {rounds} interleaved rounds")
    for i in range(rounds):
        names = [n for n in runs if "p=1 " not in n or i in p1_rounds]
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:  # rotating order
            for _ in range(ADAMW_STEPS_PER_ROUND if "adamw" in name else 1):
                runs[name].record(device)
    return {
        "runs": runs,
        "warmup": warmup,
        "compile": compile_stats,
        "state_bytes": {n: state_bytes(r.optimizer) for n, r in runs.items()},
    }


def dynamo_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        # calls that Dynamo gave up on (e.g. the recompile limit): they run eagerly
        "frames_left_eager": int(frames.get("total", 0) - frames.get("ok", 0)),
        "recompile_limit": _recompile_limit(),
    }


def _recompile_limit() -> int | None:
    config = torch._dynamo.config
    return getattr(config, "recompile_limit", getattr(config, "cache_size_limit", None))


def summary(r: Timed) -> dict[str, Any]:
    fit = [t for t, f in zip(r.times, r.fitted, strict=True) if f]
    plain = [t for t, f in zip(r.times, r.fitted, strict=True) if not f]
    return {
        "steps": len(r.times),
        "fits": len(fit),
        "median_s": statistics.median(r.times),
        "mean_s": statistics.fmean(r.times),
        "fit_s": statistics.median(fit) if fit else None,
        "plain_s": statistics.median(plain) if plain else None,
    }


# --------------------------------------------------------------------------- profile


def profile_steps(params, device, top: int) -> dict[str, Any]:
    """Self time per operator of one eager fitting step and one step without."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for label, probability, warm in (("fitting", 1.0, 2), ("no fit", 0.03, 2)):
        optimizer = kron(params, probability, compiled=False)
        for _ in range(warm):
            optimizer.step()
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            seconds = timed(optimizer.step, device)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        out[label] = {
            "step_s": seconds,
            "self_cpu_total_s": total / 1e6,
            "ops": [
                {
                    "op": e.key,
                    "calls": e.count,
                    "self_s": e.self_cpu_time_total / 1e6,
                    "share": e.self_cpu_time_total / total,
                }
                for e in rows[:top]
            ],
        }
    return out


# --------------------------------------------------------------------------- report


def report(res: dict[str, Any]) -> str:
    info, cfg, peak = res["machine"], res["config"], res["peak"]
    steps, nbytes = res["steps"], res["state_bytes"]
    a_s, lo_p = steps[ADAMW]["median_s"], LOW_PROBABILITY

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else 1e3 * seconds

    def vs_adamw(seconds: float | None) -> str:
        return (
            "n/a" if seconds is None else f"{1e3 * seconds:.1f} ({seconds / a_s:.1f}×)"
        )

    def rate(gflop: float, seconds: float | None) -> list[float | None]:
        r = None if seconds is None or not gflop else gflop / seconds
        return [r, None if r is None else 100 * r / peak]  # GFLOP/s, % of peak

    out = [
        "# PSGD Kron (PyTorch) step cost vs AdamW\n",
        f"- CPU: {info['cpu_model']}, {info['usable_cpus']} usable cores; torch "
        f"{info['torch']} on {cfg['device']}, intra-op threads {cfg['threads']}",
        f"- date (UTC) {info['date_utc']}; load average (1, 5, 15 min) at start "
        f"{info['loadavg_start']}, at end {info['loadavg_end']}; wall "
        f"{res['wall_s']:.0f} s",
        f"- model: blocks {cfg['layers']}, d_model {cfg['d_model']}, MLP "
        f"{cfg['d_mlp']}, embedding {cfg['vocab']}×{cfg['d_model']}: "
        f"{cfg['num_params']:,} parameters in {cfg['num_tensors']} tensors, "
        f"float32; stacks (shape × count): {cfg['stacks']}",
        f"- lr {LEARNING_RATE}, weight decay {WEIGHT_DECAY} for all; gradients "
        "fixed (standard normal), only `step()` timed; "
        + f"{cfg['rounds']} interleaved rounds"
        + (" — QUICK smoke run, not the benchmark" if cfg["quick"] else ""),
        "\n## 1. float32 matmul throughput (peak)\n",
        *_table(
            "pass | n | runs | median ms | GFLOP/s",
            [
                (
                    r["pass"],
                    r["n"],
                    r["runs"],
                    f"{1e3 * r['median_s']:.3f}",
                    r["gflops"],
                )
                for r in res["matmul"]
            ],
        ),
        f"Peak = best of both passes: **{peak:.1f} GFLOP/s** (`torch.mm`, "
        f"threads {cfg['threads']}; 'before' precedes the optimizer runs, 'after' "
        "follows them).",
        "\n## 2. Step time and optimizer state vs AdamW\n",
        f"Time cells: ms (× AdamW's median step, **{1e3 * a_s:.2f} ms**, "
        f"{steps[ADAMW]['steps']} steps, {ADAMW_STEPS_PER_ROUND} per round). "
        f"p = 1: median of {cfg['repeats']} steps spread over the rounds, each "
        f"fits. p = {lo_p}: {cfg['rounds']} consecutive steps (one per round), one "
        f"fit per {STEPS_PER_FIT}; amortised = their mean.\n",
    ]
    rows = []
    for name in (ADAMW, ADAMW_FOREACH):
        label = "torch.optim.AdamW" + (" (foreach=True)" if "foreach" in name else "")
        s, b = steps[name], nbytes[name]
        rows.append(
            (label, "–", b / 2**20, f"{b / nbytes[ADAMW]:.2f}", vs_adamw(s["median_s"]))
        )
    for mode in ("eager", "compiled"):
        hi, lo = steps[f"kron p=1 {mode}"], steps[f"kron p={lo_p:g} {mode}"]
        b = nbytes[f"kron p=1 {mode}"]
        times = [hi["median_s"], lo["plain_s"], lo["fit_s"], lo["mean_s"]]
        rows.append(
            ("Kron", mode, b / 2**20, f"{b / nbytes[ADAMW]:.2f}", *map(vs_adamw, times))
        )
    out += _table(
        "optimizer | kernels | state MiB | state × AdamW | p = 1 | "
        f"p = {lo_p}, no fit (median) | p = {lo_p}, fitting step | "
        f"p = {lo_p}, amortised",
        [r + ("–",) * (8 - len(r)) for r in rows],
    )
    comp, warm = res["compile"], res["warmup"]
    first = warm["kron p=1 compiled"][0]
    out += [
        "## 3. Compilation (`compile_kernels=True`)\n",
        f"- compile time ≈ first compiled step − steady compiled step = "
        f"{first:.1f} s − {steps['kron p=1 compiled']['median_s']:.2f} s = "
        f"**{first - steps['kron p=1 compiled']['median_s']:.1f} s** (fresh Inductor "
        f"cache `{cfg['inductor_cache']}`); Dynamo compiled "
        f"{comp.get('unique_graphs')} graphs ({comp.get('graph_breaks')} graph "
        f"breaks, {comp.get('frames_left_eager')} calls left eager) for "
        f"{cfg['num_stacks']} stack shapes (one graph of the factor fit per shape); "
        f"Dynamo's recompile limit is {comp.get('recompile_limit')} graphs: a model "
        "with more stack shapes fits the others eagerly.",
        f"- the p = {lo_p} compiled optimizer reused those graphs (Dynamo caches per "
        "function, not per optimizer): its first step took "
        f"{1e3 * warm[f'kron p={lo_p:g} compiled'][0]:.0f} ms and its first fitting "
        f"step {1e3 * warm[f'kron p={lo_p:g} compiled'][-1]:.0f} ms (warm-up, not "
        f"timed; eager: {1e3 * warm[f'kron p={lo_p:g} eager'][0]:.0f} and "
        f"{1e3 * warm[f'kron p={lo_p:g} eager'][-1]:.0f} ms).",
        "- break-even at p = 1: compile time / (eager − compiled step) = "
        + _break_even(first, steps["kron p=1 eager"], steps["kron p=1 compiled"])
        + f"; amortised at p = {lo_p}: "
        + _break_even(
            first,
            steps[f"kron p={lo_p:g} eager"],
            steps[f"kron p={lo_p:g} compiled"],
            key="mean_s",
        )
        + ".",
        "",
        "## 4. Achieved FLOP/s vs matmul peak\n",
        "Analytic = matmul FLOPs of the step (`kron_update.kron_matmul_flops`, "
        "layout None: the torch kernels precondition as Qᵢᵀ(Qᵢ·G)). Per 2-D weight "
        "with N entries and D = d₀ + d₁: fitting step 2DN (A = G ×ᵢ Qᵢ) + DN "
        "(triangular solves) + 4DN (Grams) + Σ 2dᵢ³ (triu(T1 − T2)·Qᵢ) + 4DN "
        "(preconditioning); step without a fit 4DN. 1-D tensors (diagonal factors), "
        "elementwise work and norm bounds are not counted.\n",
    ]
    g = res["gflop"]
    amortised = (g["fit_step"] + (STEPS_PER_FIT - 1) * g["precondition"]) / (
        STEPS_PER_FIT
    )
    rows = []
    for mode in ("eager", "compiled"):
        hi, lo = steps[f"kron p=1 {mode}"], steps[f"kron p={lo_p:g} {mode}"]
        for p, step, gflop, seconds in (
            (1, "fitting (median)", g["fit_step"], hi["median_s"]),
            (lo_p, "no fit (median)", g["precondition"], lo["plain_s"]),
            (lo_p, "amortised (mean)", amortised, lo["mean_s"]),
        ):
            rows.append(
                (mode, f"{p:g}", step, gflop, ms(seconds), *rate(gflop, seconds))
            )
    out += _table(
        "kernels | p | step | analytic GFLOP | ms | GFLOP/s | % of peak", rows
    )
    prof = res.get("profile")
    if not prof:
        return "\n".join(out)
    out += [
        "## 5. Where the time goes (eager, `torch.profiler`)\n",
        "One profiled step of each kind (after two unprofiled ones); self CPU time "
        "per operator, top operators. `aten::cat` is `torch.stack`: each step stacks "
        "every bucket's gradients into one batch (its factors and momenta are kept "
        "in stacks; before `56c3e87` they were stacked, copied, every step too).\n",
    ]
    for label, p in prof.items():
        out += [
            f"{label} step: {1e3 * p['step_s']:.1f} ms under the profiler "
            f"(operators' self time {1e3 * p['self_cpu_total_s']:.1f} ms)\n",
            *_table(
                "operator | calls | self ms | share %",
                [
                    (o["op"], o["calls"], 1e3 * o["self_s"], 100 * o["share"])
                    for o in p["ops"]
                ],
            ),
        ]
    return "\n".join(out)


def _break_even(compile_s: float, eager: dict, compiled: dict, key="median_s") -> str:
    saved = eager[key] - compiled[key]
    if saved <= 0:
        return "never (compiled not faster)"
    return f"{compile_s / saved:.0f} steps"


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed Kron steps at p=1 (default 5, 2 with --quick)",
    )
    parser.add_argument(
        "--windows", type=int, default=1, help=f"{STEPS_PER_FIT}-step windows at p=0.03"
    )
    parser.add_argument("--layers", type=int, help="transformer blocks (default 4)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-mlp", type=int, help="MLP width (default 4·d_model)")
    parser.add_argument("--vocab", type=int, default=512, help="embedding rows")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--no-profile", action="store_true", help="skip section 5")
    parser.add_argument("--quick", action="store_true", help="1 block, 2 repeats")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.layers = args.layers or (1 if args.quick else 4)
    args.d_mlp = args.d_mlp or 4 * args.d_model
    if min(args.repeats, args.windows, args.layers, args.d_model) < 1:
        parser.error("--repeats, --windows, --layers and --d-model must be >= 1")
    if args.repeats > args.windows * STEPS_PER_FIT:
        parser.error(f"--repeats must be <= {STEPS_PER_FIT} * --windows")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = machine_info() | {"torch": torch.__version__}

    log = progress_log(t0)

    torch.manual_seed(0)
    model = transformer(args.layers, args.d_model, args.d_mlp, args.vocab).to(device)
    params = list(model.parameters())
    set_gradients(params, seed=1)
    shapes = [tuple(p.shape) for p in params]
    stacks = Counter(shapes)
    sizes = (512, 1024)
    matmul_runs = 10 * args.repeats

    log("matmul peak (before)")
    matmul = measure_matmul(sizes, matmul_runs, "before", device)
    measured = run_steps(args, params, device, log)
    prof = None
    if not args.no_profile:
        log("profile")
        prof = profile_steps(params, device, top=10)
    log("matmul peak (after)")
    matmul += measure_matmul(sizes, matmul_runs, "after", device)
    log("done")

    info["loadavg_end"] = loadavg()
    per_shape = [kron_matmul_flops(s, None) for s in shapes]
    result = {
        "machine": info,
        "config": {
            "device": str(device),
            "threads": torch.get_num_threads(),
            "layers": args.layers,
            "d_model": args.d_model,
            "d_mlp": args.d_mlp,
            "vocab": args.vocab,
            "num_params": sum(p.numel() for p in params),
            "num_tensors": len(params),
            "num_stacks": len(stacks),
            "stacks": ", ".join(
                f"{'×'.join(map(str, s))} × {n}" for s, n in stacks.items()
            ),
            "repeats": args.repeats,
            "rounds": args.windows * STEPS_PER_FIT,
            "quick": args.quick,
            "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
        },
        "matmul": matmul,
        "peak": max(r["gflops"] for r in matmul),
        "steps": {n: summary(r) for n, r in measured["runs"].items()},
        "warmup": measured["warmup"],
        "compile": measured["compile"],
        "state_bytes": measured["state_bytes"],
        "gflop": {k: sum(f[k] for f in per_shape) / 1e9 for k in per_shape[0]},
        "profile": prof,
        "wall_s": time.perf_counter() - t0,
    }
    print(report(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
