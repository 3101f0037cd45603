"""An MLP trained with ``precond.torch.Kron`` on FSDP2 (``fully_shard``) parameters.

Every layer and the root are ``fully_shard``-ed on a 1-D device mesh, so each
parameter is a DTensor sharded on dim 0 (the 100-wide layers do not divide 3 or
more ranks evenly; FSDP2 chunks them as ``torch.chunk``). Kron gathers each whole
gradient, fits its factors on the whole tensor and applies the matching slice of
the update to the local shard (``precond.torch._core.dtensor``); with ``--strategy
sharded`` (``ShardedPreconditioning``) each rank fits only its share of the
parameters and keeps only their state, and one all-gather shares the updates.
Run it on CPUs (gloo) or GPUs (nccl, rank r on ``cuda:LOCAL_RANK``)::

    torchrun --standalone --nproc_per_node=2 examples/torch_kron_fsdp2.py
    torchrun --standalone --nproc_per_node=4 examples/torch_kron_fsdp2.py \\
        --strategy sharded --compare
    python examples/torch_kron_fsdp2.py   # one process, no sharding

The task is a fixed random "teacher" MLP's 10-way labels of x ~ N(0, I) in 32
dims; every step draws a global batch from a generator seeded by (seed, step),
the same on every rank, and rank r trains on its contiguous rows of it, so the
run does not depend on the number of processes (up to rounding). Rank 0 prints
the global batch's loss. ``--compare`` also trains the unsharded model on the
whole batches in rank 0 and prints the largest relative difference of the final
parameters (float64 by default: ~1e-15).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from precond.torch import Kron, ShardedPreconditioning

IN_FEATURES, HIDDEN, CLASSES = 32, 100, 10
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def make_model(dtype: torch.dtype, device: torch.device) -> nn.Module:
    """32 → 100 → 100 → 10, tanh between; the same weights for the same seed."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    ).to(device=device, dtype=dtype)


def global_batch(step: int, args: argparse.Namespace, device: torch.device):
    """(x, labels) of a step: the argmax of a fixed random linear-tanh teacher."""
    teacher = torch.Generator().manual_seed(args.seed)
    w1 = torch.randn(IN_FEATURES, HIDDEN, generator=teacher) / IN_FEATURES**0.5
    w2 = torch.randn(HIDDEN, CLASSES, generator=teacher)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch_size, IN_FEATURES, generator=generator)
    labels = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x.to(device=device, dtype=DTYPES[args.dtype]), labels.to(device)


def make_optimizer(params, args: argparse.Namespace, distributed: bool) -> Kron:
    sharded = distributed and args.strategy == "sharded"
    return Kron(
        params,
        lr=args.lr,
        weight_decay=args.weight_decay,
        strategy=ShardedPreconditioning() if sharded else None,
    )


def train(model, optimizer, args, device, rows: slice, report: bool) -> None:
    """args.steps steps on ``rows`` of every global batch; prints the mean loss
    over the whole batch (all-reduced) every args.log_every steps if ``report``."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    for step in range(args.steps):
        x, labels = global_batch(step, args, device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rows]), labels[rows])
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            total = loss.detach().clone()
            if world_size > 1 and rows != slice(None):
                dist.all_reduce(total)
                total /= world_size
            if report:
                print(f"step {step:4d} | loss {total.item():.4f}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["replicated", "sharded"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also train the unsharded model in rank 0 and print the difference",
    )
    parser.set_defaults(strategy="replicated")
    return parser.parse_args(argv)


def setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device); joins the process group under torchrun."""
    if "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def shard(model: nn.Module, world_size: int, device: torch.device) -> None:
    """``fully_shard`` every Linear, then the root, on a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world_size, device = setup()
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size must be a multiple of {world_size} ranks")
    model = make_model(DTYPES[args.dtype], device)
    if world_size > 1:
        shard(model, world_size, device)
    if rank == 0:
        print(
            f"{world_size} process(es) on {device}, Kron ({args.strategy}), "
            f"{args.dtype}, global batch {args.batch_size}, {args.steps} steps",
            flush=True,
        )
    per_rank = args.batch_size // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    optimizer = make_optimizer(model.parameters(), args, world_size > 1)
    train(model, optimizer, args, device, rows, report=rank == 0)
    params = [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        for p in model.parameters()
    ]
    if args.compare and rank == 0:
        single = make_model(DTYPES[args.dtype], device)
        optimizer = make_optimizer(single.parameters(), args, distributed=False)
        train(single, optimizer, args, device, slice(None), report=False)
        difference = max(
            ((p - q).abs().max() / q.abs().max()).item()
            for p, q in zip(params, single.parameters(), strict=True)
        )
        print(f"max relative difference from one process: {difference:.3g}")
    if world_size > 1:
        dist.barrier()  # the other ranks wait for rank 0's comparison
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # End without interpreter finalization. gloo's worker threads outlive
    # destroy_process_group (a gloo group has no shutdown), and the last barrier
    # keeps the collectives before it alive until a worker frees it; a worker that
    # frees their tensors after finalization began needs the GIL and aborts the
    # process (SIGABRT, "terminate called without an active exception",
    # pytorch/pytorch#179291). Everything is printed and the group is left.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
