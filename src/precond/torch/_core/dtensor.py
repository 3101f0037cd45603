"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) in Kron
and Pro.

Their preconditioner P = ⊗_i Q_iᴴQ_i couples every entry of a parameter (or of
a block of it) with every other along each axis, so the fit and U = P·m̂ need
the whole tensor, not a shard of it. For a DTensor parameter θ (placements over
a device mesh) Kron and Pro therefore

1. gather the full gradient g = ``θ.grad.full_tensor()`` on every rank (one
   all-gather per parameter and step, in the optimizer's parameter order);
2. run their unchanged per-parameter math on g: the momentum and the factors
   are full, plain tensors, kept on every rank (Pro, and Kron's
   ``Replicated``) or on the owner only (Kron's ``ShardedPreconditioning``),
   exactly as for an unsharded parameter;
3. apply to the local shard only the matching slice of the full update U:
   ``distribute_tensor(U, mesh, placements, src_data_rank=None)`` cuts it
   locally (``torch.chunk`` semantics, as FSDP2 shards), without communication.

So the trajectory is the single-process one on the global batch (only the
gradient reduction order differs), the noise draws stay functions of (seed,
step, parameter index), and ``state_dict()`` holds plain tensors of the full
shapes. The price: each rank holds full gradients transiently, and the
optimizer state is not sharded by FSDP but by the strategy (whole parameters
per rank), which whole-axis factors need anyway.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``:
    where it was never imported, no tensor is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def looks_like_dtensor(t: torch.Tensor) -> bool:
    """A DTensor, or a tensor subclass of an older torch that acts like one."""
    return is_dtensor(t) or type(t).__name__ == "DTensor"


def dtensors_supported() -> bool:
    """torch >= 2.6: ``distribute_tensor(..., src_data_rank=None)`` cuts the local
    shard without communication."""
    try:
        from torch.distributed.tensor import distribute_tensor
    except ImportError:
        return False
    return "src_data_rank" in inspect.signature(distribute_tensor).parameters


def check_dtensor_parameter(p: torch.Tensor, optimizer: str) -> None:
    """Refuses a DTensor parameter where this torch cannot cut its shards
    locally (before 2.6), naming ``optimizer`` and the ways out."""
    if looks_like_dtensor(p) and not dtensors_supported():
        raise NotImplementedError(
            f"{optimizer} takes DTensor (FSDP2 fully_shard) parameters from torch "
            f"2.6 on; this is torch {torch.__version__}: upgrade, or wrap the model "
            "in DDP instead"
        )


def full_gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's whole gradient: gathered for a DTensor (an all-gather,
    so every rank must pass the same DTensors in the same order), ``p.grad``
    otherwise."""
    grads = []
    for p in params:
        grad = p.grad
        assert grad is not None  # only parameters with a gradient are passed
        grads.append(grad.full_tensor() if is_dtensor(grad) else grad)
    return grads


def full_value(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (gathered for a DTensor)."""
    return p.full_tensor() if is_dtensor(p) else p


def local_value(p: torch.Tensor) -> torch.Tensor:
    """The part of ``p`` this rank stores (its shard for a DTensor): in-place
    updates of it update ``p``."""
    return p.to_local() if is_dtensor(p) else p


def local_part(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` (shaped like ``p``) that matches this rank's shard of
    ``p``: ``full`` itself for a plain parameter. No communication."""
    if not is_dtensor(p):
        return full
    from torch.distributed.tensor import distribute_tensor

    sharded = distribute_tensor(
        full.detach(), p.device_mesh, p.placements, src_data_rank=None
    )
    return sharded.to_local()
