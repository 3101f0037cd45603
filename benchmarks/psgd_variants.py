"""Loss after a fixed step budget and time per step of the PSGD variants vs AdamW.

On the ``digits-mlp`` and ``char-lm`` workloads of ``precond bench``
(:mod:`precond.bench.workloads`), trains with each optimizer variant for a fixed
number of steps, for each learning rate of a small sweep around the family's usual
rate (:data:`LR_GRIDS`), all runs from the same initial parameters on the same
minibatches:

- ``optax.adamw`` (the reference of every time ratio);
- ``precond.jax.kron`` with ``preconditioner_update_style`` 'EQ', 'QUAD' and 'PRO',
  in whitening mode (its default update-probability schedule: every step for the
  first 500 steps) and in Newton (HVP) mode;
- ``precond.jax.xmat``, ``precond.jax.lra.low_rank_approximation`` and
  ``precond.jax.affine.affine``, in whitening and Newton mode (their default
  ``preconditioner_update_probability`` 1.0).

Newton mode: each step calls ``precond.jax.hessian_helper`` (loss, gradients and,
on a preconditioner-update step, a Hessian-vector product H·v for v ~ N(0, I)) and
passes ``Hvp``, ``vector`` and ``update_preconditioner`` to ``update``, fitting
the preconditioner on every step (psgd-jax's default, and the same share of fits
as kron's whitening schedule over these budgets). A first run with kron fitting
on 1 step in 10 in HVP mode left its preconditioner far from fitted after 200-300
steps (20-30 fits from P = I: char-lm train loss 4.5 against 2.2 whitening).

For each variant the table gives the learning rate with the lowest final train
loss (mean minibatch loss of the last ``--last`` steps), that run's loss on the
held-out split, and the median wall time of one jitted train step (gradient or
HVP, optimizer update and parameter update; compile excluded, the first
``WARMUP_STEPS`` steps of each run excluded), pooled over the variant's sweep
runs, as a ratio to AdamW's in the same process (AdamW is timed in its sweep and
once more after the other variants; both passes are printed and pooled). Speed is
measured, never asserted; on a shared machine compare ratios, not milliseconds,
and rerun if AdamW's two passes or the load averages in the header differ a lot.

Usage::

    python benchmarks/psgd_variants.py                  # ~15 min on 2 idle cores
    python benchmarks/psgd_variants.py --quick          # smoke run: 30 steps, one lr
    python benchmarks/psgd_variants.py --variants adamw,kron-eq,xmat-hvp
    python benchmarks/psgd_variants.py --lr kron=3e-3,1e-2 --workloads char-lm
    python benchmarks/psgd_variants.py --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _common import loadavg, machine_info, progress_log
from precond.bench.arguments import learning_rate_grid, names, positive_int
from precond.bench.optimizers import DEFAULT_WEIGHT_DECAY
from precond.bench.report import write_json
from precond.bench.runner import RunConfig, training_loop
from precond.bench.workloads import get_workload
from precond.jax import hessian_helper

WORKLOADS = ("digits-mlp", "char-lm")
DEFAULT_STEPS = {"digits-mlp": 300, "char-lm": 200}
DEFAULT_BATCH = {"digits-mlp": 128, "char-lm": 16}
QUICK_STEPS = 30
# Learning-rate sweep of each family (--quick: the one at len // 2). Earlier runs
# with lower grids (AdamW and Kron from 1e-3, the PSGD family from 3e-3) never had
# their best at the lowest rate and often at the highest, so the grids start one
# step (×3) above the families' usual defaults (Kron 1e-3, psgd-jax 1e-2).
LR_GRIDS = {
    "adamw": (3e-3, 1e-2, 3e-2, 1e-1),
    "kron": (3e-3, 1e-2, 3e-2, 1e-1),
    "xmat": (1e-2, 3e-2, 1e-1, 3e-1),
    "lra": (1e-2, 3e-2, 1e-1, 3e-1),
    "affine": (1e-2, 3e-2, 1e-1, 3e-1),
}
WARMUP_STEPS = 10  # steps of each run left out of the step times
QUICK_WARMUP_STEPS = 5
LAST_STEPS = 20  # final train loss = mean minibatch loss of the last steps
SMOOTH = 10  # steps of the running mean of the plotted loss curves
HVP_PROBABILITY = 1.0  # Newton mode fits on every step (psgd-jax's default)


# --------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One optimizer configuration: ``module.function(learning_rate=...,
    weight_decay=..., **kwargs)``, fitted by whitening or by Newton (HVP)."""

    name: str  # command-line name
    label: str  # table label
    family: str
    module: str
    function: str
    hvp_probability: float | None = None  # Newton mode: hessian_helper's p
    kwargs: dict[str, Any] = field(default_factory=dict)
    fit_label: str | None = None  # the table's "fit" cell, if not the family's

    @property
    def hvp(self) -> bool:
        return self.hvp_probability is not None

    @property
    def fit(self) -> str:
        """How the preconditioner is fitted, and how often."""
        if self.fit_label is not None:
            return self.fit_label
        if self.family == "adamw":
            return "–"
        if self.hvp:
            return f"HVP, p = {self.hvp_probability:g}"
        if self.family == "kron":
            return "whitening, p = kron schedule"
        return "whitening, p = 1"

    def factory(self) -> Callable[..., Any]:
        """The optimizer constructor; ImportError/AttributeError if unavailable."""
        return getattr(importlib.import_module(self.module), self.function)


def _variants() -> dict[str, Variant]:
    out = [Variant("adamw", "optax.adamw", "adamw", "optax", "adamw")]
    for style in ("EQ", "QUAD", "PRO"):
        for p in (None, HVP_PROBABILITY):
            suffix = "" if p is None else "-hvp"
            out.append(
                Variant(
                    f"kron-{style.lower()}{suffix}",
                    f"kron {style}" + (" HVP" if p else ""),
                    "kron",
                    "precond.jax.kron",
                    "kron",
                    p,
                    {"preconditioner_update_style": style},
                )
            )
    for family, module, function in (
        ("xmat", "precond.jax.xmat", "xmat"),
        ("lra", "precond.jax.lra", "low_rank_approximation"),
        ("affine", "precond.jax.affine", "affine"),
    ):
        for p in (None, HVP_PROBABILITY):
            suffix = "" if p is None else "-hvp"
            label = family + (" HVP" if p else "")
            out.append(Variant(family + suffix, label, family, module, function, p))
    return {v.name: v for v in out}


VARIANTS = _variants()


def resolve_factories(variants: Sequence[Variant]) -> dict[str, Callable[..., Any]]:
    """Each variant's constructor; exits with status 2, naming every variant whose
    module or function cannot be imported (never skips one silently)."""
    factories, missing = {}, []
    for v in variants:
        try:
            factories[v.name] = v.factory()
        except (ImportError, AttributeError) as error:
            missing.append(
                f"{v.name} needs {v.module}.{v.function}: "
                f"{type(error).__name__}: {error}"
            )
    if missing:
        print(
            "psgd_variants.py: error: cannot import the optimizer of "
            + "; ".join(missing)
            + " (choose other variants with --variants)",
            file=sys.stderr,
        )
        sys.exit(2)
    return factories


# --------------------------------------------------------------------------- training


def compile_step(workload, variant: Variant, factory, data, cfg: dict[str, Any]):
    """The compiled train step (params, state, x, y, idx, step, lr, key) ↦ (params,
    state, loss), and ``init`` params ↦ optimizer state.

    The learning rate of the step is an argument, so a sweep compiles once: the
    optimizer is built inside the trace with that rate (its state does not depend
    on the rate). The batch is gathered from the device-resident split.
    """

    def optimizer(lr):
        kwargs = {"weight_decay": DEFAULT_WEIGHT_DECAY, **variant.kwargs}
        return factory(learning_rate=lr, **kwargs)

    def train_step(params, state, x_train, y_train, idx, step, lr, key):
        tx = optimizer(lr)
        x, y = x_train[idx], y_train[idx]
        if variant.hvp:
            loss, grads, hvp, vector, fit = hessian_helper(
                key,
                workload.loss,
                params,
                loss_fn_extra_args=(x, y),
                preconditioner_update_probability=variant.hvp_probability,
                train_step=step,
            )
            newton = {"Hvp": hvp, "vector": vector, "update_preconditioner": fit}
            updates, state = tx.update(grads, state, params, **newton)
        else:
            loss, grads = jax.value_and_grad(workload.loss)(params, x, y)
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params = workload.init_params(cfg["seed"])
    state = optimizer(1.0).init(params)
    args = (*data, jnp.zeros(cfg["batch_size"], jnp.int32))
    args += (jnp.int32(0), jnp.float32(1.0), jax.random.PRNGKey(0))
    compiled = jax.jit(train_step).lower(params, state, *args).compile()
    return compiled, lambda p: optimizer(1.0).init(p)


def train(compiled, init, workload, data, score, lr: float, cfg) -> dict[str, Any]:
    """One run from the seed's initial parameters, driven by ``precond bench``'s
    :func:`precond.bench.runner.training_loop` (its minibatches, learning-rate
    schedule and step timing; it stops at the first non-finite loss). A run that
    stopped, or whose final train loss exceeds its first step's loss, is marked
    diverged. ``score`` maps the params to the held-out split's metrics, taken
    after the last step."""
    carry = {"params": workload.init_params(cfg["seed"]), "step": 0}
    carry["state"] = init(carry["params"])
    base_key = jax.random.PRNGKey(cfg["seed"])

    def step(idx, scale: float) -> tuple[float, bool]:
        i = carry["step"]
        carry["params"], carry["state"], loss = jax.block_until_ready(
            compiled(
                carry["params"],
                carry["state"],
                *data,
                jnp.asarray(idx),
                jnp.int32(i),
                jnp.float32(lr * scale),
                jax.random.fold_in(base_key, i),
            )
        )
        carry["step"] = i + 1
        return float(loss), False

    def evaluate() -> tuple[float, float]:
        metrics = score(carry["params"])
        return float(metrics["loss"]), float(metrics["accuracy"])

    config = RunConfig(
        steps=cfg["steps"],
        batch_size=cfg["batch_size"],
        seed=cfg["seed"],
        schedule=cfg["schedule"],
        eval_every=cfg["steps"],
    )
    loop = training_loop(step, evaluate, config, len(data[0]))
    losses, seconds = loop.minibatch_loss, loop.step_seconds
    final = math.nan if loop.diverged else statistics.fmean(losses[-cfg["last"] :])
    timed = seconds[cfg["warmup"] :] or seconds
    return {
        "lr": lr,
        "final_train_loss": final,
        "diverged": loop.diverged or not final <= losses[0],
        "stopped_at_step": len(losses) if loop.diverged else None,
        "median_step_s": statistics.median(timed),
        "losses": losses,
        "step_s": seconds,
        "test": {
            "loss": loop.history[-1]["val_loss"],
            "accuracy": loop.history[-1]["val_accuracy"],
        },
        "state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(carry["state"]))),
    }


def _sort_key(run: dict[str, Any]) -> float:
    loss = run["final_train_loss"]
    return loss if math.isfinite(loss) else math.inf


def run_workload(name: str, variants, factories, cfg: dict, log) -> dict[str, Any]:
    """Every variant's sweep on one workload, and its best learning rate."""
    workload = get_workload(name)
    split = workload.load_split(workload.split_seed)
    wcfg = dict(cfg, steps=cfg["steps"][name], batch_size=cfg["batch_size"][name])
    data = jax.device_put((split.x_train, split.y_train))
    test = jax.device_put((split.x_test, split.y_test))
    metrics = jax.jit(workload.metrics)

    def score(params):
        return metrics(params, *test)

    results, adamw_step = [], None
    for v in variants:
        start = time.perf_counter()
        compiled, init = compile_step(workload, v, factories[v.name], data, wcfg)
        compile_s = time.perf_counter() - start
        if v.name == "adamw":
            adamw_step = (compiled, init)
        log(f"{name} {v.name}: compiled in {compile_s:.1f} s")
        runs = []
        for lr in cfg["lrs"][v.family]:
            r = train(compiled, init, workload, data, score, lr, wcfg)
            log(
                f"{name} {v.name} lr={lr:g}: train loss {r['final_train_loss']:.4g}, "
                f"test loss {r['test']['loss']:.4g}, "
                f"{1e3 * r['median_step_s']:.2f} ms/step"
                + (" (diverged)" if r["diverged"] else "")
            )
            runs.append(r)
        best = min(range(len(runs)), key=lambda i: _sort_key(runs[i]))
        # Step times of the runs that ran to the end (of all, if none did).
        kept = [r for r in runs if r["stopped_at_step"] is None] or runs
        timed = [t for r in kept for t in r["step_s"][cfg["warmup"] :]]
        timed = timed or [t for r in kept for t in r["step_s"]]
        results.append(
            {
                "variant": v.name,
                "label": v.label,
                "family": v.family,
                "fit": v.fit,
                "hvp_probability": v.hvp_probability,
                "kwargs": v.kwargs,
                "compile_s": compile_s,
                "median_step_s": statistics.median(timed),
                "mean_step_s": statistics.fmean(timed),
                "best": best,
                "runs": runs,
            }
        )
    adamw = next((r for r in results if r["variant"] == "adamw"), None)
    if adamw is not None:
        # AdamW again after the others, so a change of machine load shows; the
        # reference time is the median over both passes.
        lr = adamw["runs"][adamw["best"]]["lr"]
        again = train(*adamw_step, workload, data, score, lr, wcfg)
        again = again["step_s"][cfg["warmup"] :] or again["step_s"]
        first = [t for r in adamw["runs"] for t in r["step_s"][cfg["warmup"] :]]
        adamw["first_pass_median_step_s"] = statistics.median(first or again)
        adamw["second_pass_median_step_s"] = statistics.median(again)
        adamw["median_step_s"] = statistics.median(first + again)
        adamw["mean_step_s"] = statistics.fmean(first + again)
        log(
            f"{name} adamw again (lr={lr:g}): "
            f"{1e3 * adamw['second_pass_median_step_s']:.2f} ms/step"
        )
    return {
        "workload": name,
        "description": workload.description,
        "steps": wcfg["steps"],
        "batch_size": wcfg["batch_size"],
        "n_train": len(split.x_train),
        "n_test": len(split.x_test),
        "results": results,
    }


# --------------------------------------------------------------------------- report


def _loss(run: dict[str, Any]) -> str:
    loss = run["final_train_loss"]
    if not math.isfinite(loss):
        return f"diverged (step {run['stopped_at_step']})"
    return f"{loss:.4g}" + (" (diverged)" if run["diverged"] else "")


def report(res: dict[str, Any]) -> str:
    info, cfg = res["machine"], res["config"]
    grids = "; ".join(
        f"{family} {', '.join(f'{lr:g}' for lr in lrs)}"
        for family, lrs in cfg["lrs"].items()
        if any(VARIANTS[v].family == family for v in cfg["variants"])
    )
    out = [
        "# PSGD variants vs AdamW: loss after a fixed budget, time per step\n",
        f"- CPU: {info['cpu_model']}, {info['usable_cpus']} usable cores; JAX "
        f"device {info['jax_device']}; jax {info['jax']}, jaxlib {info['jaxlib']}, "
        f"optax {info['optax']}; XLA_FLAGS `{info['xla_flags']}`",
        f"- date (UTC) {info['date_utc']}; load average (1, 5, 15 min) at start "
        f"{info['loadavg_start']}, at end {info['loadavg_end']}; wall "
        f"{res['wall_s']:.0f} s",
        f"- every run: seed {cfg['seed']} (init, batches, HVP draws), weight decay "
        f"{cfg['weight_decay']:g}, {cfg['schedule']} learning-rate schedule (as "
        f"`precond bench`); learning rates: {grids}"
        + (" — QUICK smoke run, not the benchmark" if cfg["quick"] else ""),
        f"- train loss = mean minibatch loss of the last {cfg['last']} steps; best "
        "lr = the lowest of the sweep; test loss and accuracy: the workload's "
        "metrics on its held-out split after the last step of that run",
        "- step ms = median wall time of one jitted train step (compile and the "
        f"first {cfg['warmup']} steps of each run excluded), pooled over the "
        "variant's sweep runs; mean ms counts the steps that fit the "
        "preconditioner when p < 1 at their share; × AdamW = ratio of medians in "
        "this run; state = optimizer-state bytes",
        "- kron: `preconditioner_update_style` EQ/QUAD/PRO, whitening with kron's "
        "default update-probability schedule (every step for the first 500); xmat, "
        "lra (`low_rank_approximation`), affine: default arguments (p = 1); HVP "
        "mode: `hessian_helper(..., preconditioner_update_probability="
        f"{HVP_PROBABILITY:g})` for every family",
    ]
    for w in res["workloads"]:
        out += workload_report(w)
    return "\n".join(out) + "\n"


def workload_report(w: dict[str, Any], heading: str = "##") -> list[str]:
    """The Markdown section of one workload of :func:`run_workload`, under a
    ``heading``-level title: the best run of each variant, then the final train
    loss of every run of the sweeps."""
    base = next((r for r in w["results"] if r["variant"] == "adamw"), None)
    out = [
        f"\n{heading} {w['workload']}: {w['steps']} steps, batch {w['batch_size']}\n",
        f"{w['description']}; {w['n_train']} train / {w['n_test']} test rows."
        + (
            ""
            if base is None
            else " AdamW's step, timed in its sweep and again after the other "
            f"variants: {1e3 * base['first_pass_median_step_s']:.2f} ms, then "
            f"{1e3 * base['second_pass_median_step_s']:.2f} ms (median of both "
            f"passes, {1e3 * base['median_step_s']:.2f} ms, is the × AdamW "
            "reference)."
        )
        + "\n",
        "| variant | fit | best lr | train loss | test loss | test acc | "
        "step ms | × AdamW | mean ms | state × AdamW | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in w["results"]:
        b = r["runs"][r["best"]]
        ratio = state = "n/a"
        if base is not None:
            ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}"
            state = f"{b['state_bytes'] / base['runs'][0]['state_bytes']:.2f}"
        out.append(
            f"| {r['label']} | {r['fit']} | {b['lr']:g} | {_loss(b)} | "
            f"{b['test']['loss']:.4g} | {100 * b['test']['accuracy']:.1f}% | "
            f"{1e3 * r['median_step_s']:.2f} | {ratio} | "
            f"{1e3 * r['mean_step_s']:.2f} | {state} | {r['compile_s']:.1f} |"
        )
    width = max(len(r["runs"]) for r in w["results"])
    if width > 1:
        out += [
            "\nTrain loss of every run of the sweep (learning rate: loss, lowest "
            "rate first; best in bold; diverged = a final loss above the first "
            "step's, or a non-finite loss, which stops the run):\n",
            "| variant | " + " | ".join(f"lr {i + 1}" for i in range(width)) + " |",
            "|---|" + "---:|" * width,
        ]
        for r in w["results"]:
            cells = [f"{run['lr']:g}: {_loss(run)}" for run in r["runs"]]
            cells[r["best"]] = f"**{cells[r['best']]}**"
            cells += [""] * (width - len(cells))
            out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return out


COLOURS = {  # variant without "-hvp" ↦ colour; HVP variants are dashed
    "adamw": "black",
    "kron-eq": "tab:blue",
    "kron-quad": "tab:cyan",
    "kron-pro": "tab:green",
    "xmat": "tab:orange",
    "lra": "tab:purple",
    "affine": "tab:red",
}


def plot(res: dict[str, Any], path: str) -> None:
    """Loss curves of each variant's best learning rate, one panel per workload
    (log y, running mean over ``SMOOTH`` steps, clipped above at 1.5× the largest
    first-step loss so that a diverged curve does not flatten the others)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = res["workloads"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8))
    for ax, w in zip(np.atleast_1d(axes), panels, strict=True):
        top = 0.0
        for r in w["results"]:
            best = r["runs"][r["best"]]
            losses = np.asarray(best["losses"], dtype=float)
            top = max(top, losses[0]) if np.isfinite(losses[0]) else top
            k = min(SMOOTH, len(losses))
            smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
            ax.plot(
                np.arange(k, len(losses) + 1),
                smooth,
                color=COLOURS.get(r["variant"].removesuffix("-hvp"), "gray"),
                linestyle="--" if r["hvp_probability"] is not None else "-",
                linewidth=1.2,
                label=f"{r['label']} (lr {best['lr']:g})",
            )
        ax.set_yscale("log")
        if top > 0:
            ax.set_ylim(top=1.5 * top)
        ax.set_xlabel("step")
        ax.set_ylabel(f"minibatch loss, running mean of {SMOOTH} steps")
        ax.set_title(f"{w['workload']} ({w['steps']} steps, batch {w['batch_size']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("PSGD variants vs AdamW, best learning rate of each (dashed: HVP)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        type=names(list(VARIANTS), "variant"),
        default=list(VARIANTS),
        metavar="A,B",
        help=f"comma-separated variants (default: all: {','.join(VARIANTS)})",
    )
    parser.add_argument(
        "--workloads",
        type=names(WORKLOADS, "workload"),
        default=list(WORKLOADS),
        metavar="A,B",
        help=f"comma-separated workloads (default: {','.join(WORKLOADS)})",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help="steps per run, for every workload (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items())
        + f"; {QUICK_STEPS} with --quick)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help="minibatch size, for every workload (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH.items())
        + ")",
    )
    parser.add_argument(
        "--lr",
        type=learning_rate_grid(list(LR_GRIDS)),
        action="append",
        default=[],
        metavar="FAMILY=LR,LR",
        help="learning rates of one family's sweep, e.g. --lr kron=1e-3,3e-3; "
        "repeat for several (defaults: "
        + "; ".join(f"{k} {','.join(map(str, v))}" for k, v in LR_GRIDS.items())
        + "; the middle one with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every run")
    parser.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="learning-rate schedule, as `precond bench` (default: cosine)",
    )
    parser.add_argument(
        "--last",
        type=positive_int,
        default=LAST_STEPS,
        help=f"steps averaged for the final train loss (default {LAST_STEPS})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_STEPS} steps, the middle learning rate of each grid",
    )
    parser.add_argument("--json", metavar="PATH", help="also write raw results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also save loss curves (PNG)")
    args = parser.parse_args(argv)
    grids = {k: list(v) for k, v in LR_GRIDS.items()}
    if args.quick:
        grids = {k: [v[len(v) // 2]] for k, v in grids.items()}
    grids.update(dict(args.lr))  # explicit grids win, also with --quick
    args.lrs = grids
    steps = args.steps or (QUICK_STEPS if args.quick else None)
    args.steps_by = {w: steps or DEFAULT_STEPS[w] for w in WORKLOADS}
    args.batch_by = {w: args.batch_size or DEFAULT_BATCH[w] for w in WORKLOADS}
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    variants = [VARIANTS[name] for name in args.variants]
    factories = resolve_factories(variants)
    t0 = time.perf_counter()
    info = machine_info()

    log = progress_log(t0)

    cfg = {
        "variants": args.variants,
        "workloads": args.workloads,
        "steps": args.steps_by,
        "batch_size": args.batch_by,
        "lrs": args.lrs,
        "seed": args.seed,
        "schedule": args.schedule,
        "last": args.last,
        "warmup": QUICK_WARMUP_STEPS if args.quick else WARMUP_STEPS,
        "weight_decay": DEFAULT_WEIGHT_DECAY,
        "hvp_probability": HVP_PROBABILITY,
        "quick": args.quick,
    }
    workloads = [run_workload(w, variants, factories, cfg, log) for w in args.workloads]
    info["loadavg_end"] = loadavg()
    result = {
        "machine": info,
        "config": cfg,
        "workloads": workloads,
        "wall_s": time.perf_counter() - t0,
    }
    print(report(result))
    if args.json:
        write_json(result, args.json)
        log(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        log(f"wrote {args.plot}")
    return result


if __name__ == "__main__":
    main()
