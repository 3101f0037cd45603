"""Cost of ``precond.torch.kfac.KFAC`` per data-parallel step vs plain SGD, its
communication, and the loss it reaches in a fixed budget, on the digits CNN of
``examples/torch_kfac_digits.py``.

1. Step time: for 1, 2 and 4 gloo processes (``torch.multiprocessing`` spawn, one
   CPU thread each, ``file://`` rendezvous), a DDP step (zero_grad, forward,
   backward with DDP's all-reduce, ``preconditioner.step()``, ``optimizer.step()``)
   of SGD (momentum) alone and of SGD + K-FAC with each KAISA strategy (one
   process: one K-FAC run, the strategies are the same there), the example's
   settings (factors every step, decompositions every ``--inv-update-steps``) and
   the example's global batch split over the processes. All variants of a world
   size run in one spawn, interleaved in rounds (rotating order) so that a change
   of machine load hits all alike. A step's time is the slowest rank's; reported:
   the median over the timed steps (a step without decompositions), the mean (the
   decompositions amortised), both as ratios to SGD in the same world size.
2. Communication: K-FAC's bytes per step by kind (``communicator.bytes_sent``:
   factor all-reduce, second-order broadcasts, preconditioned-gradient broadcasts),
   summed over the ranks, over the timed steps. DDP's gradient all-reduce (the same
   for SGD) is not counted.
3. Loss after a fixed budget of steps (one process): SGD (momentum), AdamW (a small
   lr sweep) and SGD + K-FAC: mean training loss of the last epoch's steps and test
   accuracy.

Usage::

    python benchmarks/torch_kfac.py                 # full run, ~1.5 min on 2 cores
    python benchmarks/torch_kfac.py --quick         # smoke run
    python benchmarks/torch_kfac.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from precond.bench.report import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.torch.spawned import init_gloo, leave_group_and_exit

from precond.torch.kfac import KFAC

EXAMPLE_PATH = Path(__file__).resolve().parents[1] / "examples" / "torch_kfac_digits.py"
STRATEGIES = ("comm-opt", "hybrid-opt", "mem-opt")
KINDS = ("factors", "second_order", "gradients")


def example():
    """The example module (model, data, defaults), loaded from its path."""
    if "torch_kfac_digits" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torch_kfac_digits", EXAMPLE_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["torch_kfac_digits"] = module
        spec.loader.exec_module(module)
    return sys.modules["torch_kfac_digits"]


def example_defaults() -> argparse.Namespace:
    return example().parse_args([])


def make_kfac(net: nn.Module, defaults: argparse.Namespace, strategy: str) -> KFAC:
    """The example's K-FAC (its default settings) with ``strategy``."""
    return example().make_kfac(
        net, argparse.Namespace(**{**vars(defaults), "strategy": strategy})
    )


def sgd(params, defaults: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params,
        lr=defaults.lr,
        momentum=defaults.momentum,
        weight_decay=defaults.weight_decay,
    )


# ------------------------------------------------------------------ 1-2. step time


def timing_worker(rank, world_size, init_file, out_dir, variants, warmup, steps):
    """One rank: every variant (SGD or a K-FAC strategy) on its own DDP model,
    stepped in interleaved rounds; writes rank{r}.json (or rank{r}.err)."""
    out = Path(out_dir)
    try:
        init_gloo(rank, world_size, init_file)
        ex, defaults = example(), example_defaults()
        x_train, y_train, _, _ = ex.load_split()
        runs = {}
        for name in variants:
            torch.manual_seed(0)
            model = ex.DigitsCNN()
            ddp = nn.parallel.DistributedDataParallel(model)
            kfac = None if name == "sgd" else make_kfac(ddp, defaults, name)
            runs[name] = {
                "net": ddp,
                "optimizer": sgd(ddp.parameters(), defaults),
                "kfac": kfac,
                "batches": ex.global_batches(len(y_train), defaults.batch_size, 0),
                "times": [],
                "bytes_start": None,
            }

        def step(run) -> float:
            rows = next(run["batches"])[rank::world_size]
            dist.barrier()
            start = time.perf_counter()
            run["optimizer"].zero_grad()
            loss = F.cross_entropy(run["net"](x_train[rows]), y_train[rows])
            loss.backward()
            if run["kfac"] is not None:
                run["kfac"].step()
            run["optimizer"].step()
            seconds = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
            return seconds.item()

        names = list(runs)
        for round_ in range(warmup + steps):
            if round_ == warmup:
                for run in runs.values():
                    if run["kfac"] is not None:
                        run["bytes_start"] = dict(run["kfac"].communicator.bytes_sent)
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                seconds = step(runs[name])
                if round_ >= warmup:
                    runs[name]["times"].append(seconds)
        result = {}
        for name, run in runs.items():
            sent = {}
            if run["kfac"] is not None:
                end = run["kfac"].communicator.bytes_sent
                sent = {k: end.get(k, 0) - run["bytes_start"].get(k, 0) for k in KINDS}
            grid = run["kfac"].grid if run["kfac"] is not None else None
            result[name] = {
                "times": run["times"],
                "bytes": sent,
                "grid": None if grid is None else [grid.grad_workers, grid.columns],
            }
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        leave_group_and_exit()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def time_world(world_size: int, warmup: int, steps: int, log) -> list[dict]:
    variants = ["sgd", *(STRATEGIES if world_size > 1 else STRATEGIES[:1])]
    with tempfile.TemporaryDirectory(prefix="torch_kfac_bench_") as tmp:
        out = Path(tmp)
        context = mp.start_processes(
            timing_worker,
            args=(world_size, str(out / "init"), tmp, variants, warmup, steps),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join(timeout=1.0):
                pass
        except Exception as e:
            errors = "\n".join(p.read_text() for p in out.glob("rank*.err"))
            raise RuntimeError(f"{world_size} processes failed: {e}\n{errors}") from e
        ranks = [
            json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)
        ]
    rows = []
    sgd_median = statistics.median(ranks[0]["sgd"]["times"])
    sgd_mean = statistics.mean(ranks[0]["sgd"]["times"])
    for name in variants:
        times = ranks[0][name]["times"]  # the same on every rank (all-reduced)
        median, mean = statistics.median(times), statistics.mean(times)
        row = {
            "world_size": world_size,
            "variant": "sgd" if name == "sgd" else f"kfac {name}",
            "grid": ranks[0][name]["grid"],
            "median_s": median,
            "mean_s": mean,
            "median_vs_sgd": median / sgd_median,
            "mean_vs_sgd": mean / sgd_mean,
            "bytes_per_step": {
                kind: sum(r[name]["bytes"].get(kind, 0) for r in ranks) / steps
                for kind in KINDS
            }
            if name != "sgd"
            else {},
        }
        rows.append(row)
        log(
            f"W={world_size} {row['variant']}: median {1e3 * median:.2f} ms "
            f"({row['median_vs_sgd']:.2f}× SGD), mean {1e3 * mean:.2f} ms"
        )
    return rows


# ------------------------------------------------------------------ 3. loss budget


def train_budget(
    optimizer_name: str, lr: float, steps: int, defaults: argparse.Namespace
) -> dict[str, Any]:
    ex = example()
    x_train, y_train, x_test, y_test = ex.load_split()
    torch.manual_seed(0)
    model = ex.DigitsCNN()
    kfac = None
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    else:
        optimizer = sgd(
            model.parameters(), argparse.Namespace(**{**vars(defaults), "lr": lr})
        )
        if optimizer_name == "sgd+kfac":
            kfac = make_kfac(
                model, argparse.Namespace(**{**vars(defaults), "lr": lr}), "comm-opt"
            )
    batches = ex.global_batches(len(y_train), defaults.batch_size, 0)
    steps_per_epoch = len(y_train) // defaults.batch_size
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        rows = next(batches)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[rows]), y_train[rows])
        loss.backward()
        if kfac is not None:
            kfac.step()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        test_loss = F.cross_entropy(model(x_test), y_test).item()
    last = losses[-steps_per_epoch:]
    return {
        "optimizer": optimizer_name,
        "lr": lr,
        "train_loss": sum(last) / len(last) if all(map(_finite, last)) else None,
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "seconds": seconds,
    }


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


# ------------------------------------------------------------------ report


def report(res: dict[str, Any]) -> str:
    from kron_update import _table

    lines = ["### 1. Step time vs SGD (slowest rank; one thread per process)", ""]
    rows = [
        [
            r["world_size"],
            r["variant"],
            "–" if r["grid"] is None else f"{r['grid'][0]}×{r['grid'][1]}",
            f"{1e3 * r['median_s']:.2f}",
            f"{r['median_vs_sgd']:.2f}",
            f"{1e3 * r['mean_s']:.2f}",
            f"{r['mean_vs_sgd']:.2f}",
        ]
        for r in res["timing"]
    ]
    lines += _table(
        "processes | variant | grid (workers × columns) | median ms | × SGD | "
        "mean ms | mean × SGD",
        rows,
    )
    lines += ["### 2. K-FAC communication per step (KiB, summed over ranks)", ""]
    rows = [
        [r["world_size"], r["variant"]]
        + [f"{r['bytes_per_step'][k] / 1024:.1f}" for k in KINDS]
        for r in res["timing"]
        if r["variant"] != "sgd"
    ]
    lines += _table("processes | variant | factors | second_order | gradients", rows)
    cfg = res["config"]
    lines += [
        f"### 3. Loss after {cfg['budget_steps']} steps (one process, batch "
        f"{cfg['batch_size']})",
        "",
    ]
    rows = [
        [
            r["optimizer"],
            f"{r['lr']:g}",
            "diverged" if r["train_loss"] is None else f"{r['train_loss']:.4f}",
            f"{r['test_loss']:.4f}",
            f"{100 * r['test_accuracy']:.1f}%",
            f"{r['seconds']:.1f}",
        ]
        for r in res["budget"]
    ]
    lines += _table(
        "optimizer | lr | train loss (last epoch) | test loss | test acc | seconds",
        rows,
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="processes"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds")
    parser.add_argument("--steps", type=int, default=40, help="timed rounds")
    parser.add_argument(
        "--budget-steps", type=int, default=220, help="steps of section 3"
    )
    parser.add_argument("--quick", action="store_true", help="few steps")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps, args.budget_steps = 2, 5, 22
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:

    from _common import loadavg, machine_info

    args = parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr)

    defaults = example_defaults()
    result: dict[str, Any] = {
        "machine": {**machine_info(), "torch": torch.__version__},
        "config": {
            "batch_size": defaults.batch_size,
            "kfac": {
                k: getattr(defaults, k)
                for k in (
                    "lr",
                    "damping",
                    "kl_clip",
                    "factor_update_steps",
                    "inv_update_steps",
                )
            },
            "momentum": defaults.momentum,
            "weight_decay": defaults.weight_decay,
            "warmup": args.warmup,
            "steps": args.steps,
            "budget_steps": args.budget_steps,
        },
        "timing": [],
        "budget": [],
    }
    for world_size in args.world_sizes:
        result["timing"] += time_world(world_size, args.warmup, args.steps, log)
    for name, lr in [
        ("sgd", defaults.lr),
        ("sgd+kfac", defaults.lr),
        ("adamw", 1e-3),
        ("adamw", 3e-3),
        ("adamw", 1e-2),
    ]:
        result["budget"].append(train_budget(name, lr, args.budget_steps, defaults))
        log(f"budget {name} lr {lr:g}: {result['budget'][-1]}")
    result["machine"]["loadavg_end"] = loadavg()
    print(report(result))
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
