"""precond.torch.Kron under torch.distributed equals one process on the global batch.

Each test spawns 2 or 4 processes (``torch.multiprocessing``, gloo, ``file://``
rendezvous in a temporary directory, a timeout on every collective and on the
whole run). Every rank wraps the same model in DDP, trains on its shard of each
global batch (DDP averages the gradients) and writes its final parameters and the
names of the parameters it keeps optimizer state for to the temporary directory;
the parent compares them with a single-process run on the whole global batch.

* ``Replicated`` (the default): every rank fits and applies every factor.
* ``ShardedPreconditioning()``: each rank fits and applies only its own
  parameters' factors, keeps only their state, and one all-gather shares the
  updates. Checked with an uneven 63-wide layer, a parameter that never gets a
  gradient (it must stay untouched and stateless) and more ranks than parameters.

float64 (factors in float64 too) agrees to 1e-12: the only difference is DDP's
all-reduce order. float32 agrees to FLOAT32_TOLERANCE (see there).
"""

from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from precond.torch import Kron, ShardedPreconditioning

STEPS = 5
GLOBAL_BATCH = 16
IN_FEATURES, HIDDEN, OUT_FEATURES = 10, 63, 5
# Seconds allowed to one collective, and to a whole spawned run (4 processes on a
# shared 2-core machine take ~10 s, mostly importing torch).
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 120
# float64: the ranks' gradients are DDP's all-reduced average and the reference's
# are the full-batch mean, equal up to summation order (~1e-16 relative); five
# Kron steps keep that far below 1e-12 (measured: 6e-17).
FLOAT64_TOLERANCE = 1e-12
# float32: the same ~1e-7 relative difference in the gradients, passed through the
# factor fits (each normalises by a lower bound of a norm of A·Aᵀ + B·Bᵀ) and
# the RMS clip. Measured max |difference| over the cases here: 3e-8 with
# parameters of size <= 2.3 that moved by up to 0.08; 1e-6 leaves a margin of 30.
FLOAT32_TOLERANCE = 1e-6


class Net(torch.nn.Module):
    """Linear(10 → 63) → tanh → Linear(63 → 5), times a scalar, plus a parameter
    that the forward pass never uses (its gradient stays None on every rank)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.unused = torch.nn.Parameter(torch.randn(7, 3))

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))) * self.scale


class Tiny(torch.nn.Module):
    """Two parameters: with 4 ranks, two of them own nothing."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x):
        return self.layer(x)


MODELS = {"net": Net, "tiny": Tiny}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def build(model_name, dtype_name):
    torch.manual_seed(0)
    return MODELS[model_name]().to(DTYPES[dtype_name])


def optimizer_for(params, dtype_name, strategy):
    precond_dtype = torch.float64 if dtype_name == "float64" else None
    return Kron(
        params,
        lr=0.05,
        weight_decay=0.01,
        preconditioner_update_probability=1.0,
        precond_dtype=precond_dtype,
        strategy=strategy,
    )


def batch(step, dtype_name):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
    y = torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=generator)
    return x.to(DTYPES[dtype_name]), y.to(DTYPES[dtype_name])


def train(model, optimizer, dtype_name, rows):
    for step in range(STEPS):
        x, y = batch(step, dtype_name)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()


# name → (model, dtype, sharded preconditioning).
CASES = {
    "ddp-float64": ("net", "float64", False),
    "sharded-float64": ("net", "float64", True),
    "ddp-float32": ("net", "float32", False),
    "sharded-float32": ("net", "float32", True),
    "sharded-2params-float64": ("tiny", "float64", True),
    "sharded-2params-float32": ("tiny", "float32", True),
}
# One spawn per world size (each spawn costs ~10 s of imports), the cases run one
# after the other on the same process group. A case that may abort its processes
# (a collective with mismatched sizes kills gloo with SIGABRT) comes last, so that
# an abort loses no other case.
RUNS = {
    "2ranks": (2, ["ddp-float64", "sharded-float64"]),
    "4ranks": (
        4,
        [
            "ddp-float64",
            "sharded-float64",
            "ddp-float32",
            "sharded-float32",
            "sharded-2params-float32",
            "sharded-2params-float64",
        ],
    ),
}


def init_gloo(rank: int, world_size: int, init_file) -> None:
    """Joins the gloo group of a spawned test run (one thread per process, a
    timeout on every collective)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def worker(rank, world_size, init_file, out_dir, case_names):
    """One rank: for each case, DDP over its shard of every global batch; writes
    rank{r}-{case}.pt, or rank{r}.err with the case and the traceback."""
    out = Path(out_dir)
    case_name = "init_process_group"
    try:
        init_gloo(rank, world_size, init_file)
        for case_name in case_names:
            model_name, dtype_name, sharded = CASES[case_name]
            model = build(model_name, dtype_name)
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, find_unused_parameters=model_name == "net"
            )
            strategy = ShardedPreconditioning() if sharded else None
            optimizer = optimizer_for(ddp.parameters(), dtype_name, strategy)
            shard = GLOBAL_BATCH // world_size
            rows = slice(rank * shard, (rank + 1) * shard)
            train(ddp, optimizer, dtype_name, rows)
            names = {id(p): n for n, p in model.named_parameters()}
            torch.save(
                {
                    "params": {n: p.detach() for n, p in model.named_parameters()},
                    "stateful": sorted(names[id(p)] for p in optimizer.state),
                },
                out / f"rank{rank}-{case_name}.pt",
            )
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(
            f"in case {case_name}:\n{traceback.format_exc()}"
        )
        raise


def spawn(fn, args, nprocs, out_dir):
    """Runs ``fn(rank, *args)`` on ``nprocs`` processes; returns None, or a message
    naming the ranks that failed or hung, with their tracebacks."""
    context = mp.start_processes(
        fn, args=args, nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    error = None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
                error = f"ranks {alive} still running after {RUN_TIMEOUT_S} s"
                break
    except ProcessException as e:
        error = f"rank {e.error_index} failed first: {e}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    if error is None:
        return None
    tracebacks = "\n".join(
        f"--- rank {rank} ---\n{(out_dir / f'rank{rank}.err').read_text()}"
        for rank in range(nprocs)
        if (out_dir / f"rank{rank}.err").exists()
    )
    return f"{error}\n{tracebacks}"


def single_process(model_name, dtype_name):
    model = build(model_name, dtype_name)
    optimizer = optimizer_for(model.parameters(), dtype_name, None)
    train(model, optimizer, dtype_name, slice(None))
    return {n: p.detach() for n, p in model.named_parameters()}


def check_against_single_process(results, model_name, dtype_name, sharded):
    """Raises AssertionError naming the rank and parameter that disagree."""
    tolerance = FLOAT64_TOLERANCE if dtype_name == "float64" else FLOAT32_TOLERANCE
    reference = single_process(model_name, dtype_name)
    initial = dict(build(model_name, dtype_name).named_parameters())
    for rank, result in enumerate(results):
        params = result["params"]
        assert params.keys() == reference.keys()
        for name, value in params.items():
            error = (value - reference[name]).abs().max().item()
            assert error <= tolerance, (
                f"rank {rank}, {name}: max |distributed - single| = {error:.3g} "
                f"> {tolerance:g}"
            )
            # Every rank applied the same update (all-gathered or replicated).
            assert torch.equal(value, results[0]["params"][name]), (
                f"rank {rank}, {name}: differs from rank 0"
            )
    # Trained parameters moved; the unused one did not (no gradient: no decay).
    for name, value in reference.items():
        moved = not torch.equal(value, initial[name].detach())
        assert moved == (name != "unused"), name

    stateful = [set(result["stateful"]) for result in results]
    with_grad = {n for n in reference if n != "unused"}
    if sharded:
        # A partition of the parameters with gradients: each rank keeps the state
        # of its own parameters only, and every rank owns some when it can.
        assert set().union(*stateful) == with_grad, stateful
        assert sum(len(s) for s in stateful) == len(with_grad), stateful
        if len(with_grad) >= len(results):
            assert all(stateful), stateful
    else:
        assert all(s == with_grad for s in stateful), stateful


@pytest.mark.parametrize("run_name", list(RUNS))
def test_distributed_equals_single_process(tmp_path, run_name):
    world_size, case_names = RUNS[run_name]
    error = spawn(
        worker,
        (world_size, str(tmp_path / "init"), str(tmp_path), case_names),
        world_size,
        tmp_path,
    )
    failures = []
    for case_name in case_names:
        model_name, dtype_name, sharded = CASES[case_name]
        files = [tmp_path / f"rank{r}-{case_name}.pt" for r in range(world_size)]
        if not all(f.exists() for f in files):
            failures.append(f"{case_name}: not finished on every rank")
            continue
        results = [torch.load(f, weights_only=True) for f in files]
        try:
            check_against_single_process(results, model_name, dtype_name, sharded)
        except AssertionError as e:
            failures.append(f"{case_name}: {e}")
    if error is not None or failures:
        pytest.fail("\n".join(failures + ([error] if error else [])))
