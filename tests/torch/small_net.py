"""The model, batches and checkpoints of the multi-process torch tests (Kron's
and Pro's FSDP2 test, Shampoo's and SOAP's DDP and FSDP2 test): a small tanh
net whose sizes each test picks (:class:`Problem`), the rows of the global batch
each rank trains on, ``fully_shard`` on a CPU mesh, and model plus optimizer
through ``torch.distributed.checkpoint``.

The net: Linear(10 → hidden) → tanh → Linear(hidden → out), times a
one-element scale (``fully_shard`` refuses 0-dim parameters: with 4 ranks three
hold none of it), plus a parameter that the forward pass never uses (no
gradient, no state).
"""

from __future__ import annotations

import dataclasses

import torch

GLOBAL_BATCH = 16
IN_FEATURES = 10
DTYPES = {"float64": torch.float64, "float32": torch.float32}


class Net(torch.nn.Module):
    """Linear(10 → ``hidden``) → tanh → Linear(``hidden`` → ``out_features``),
    times a one-element scale, plus an unused parameter."""

    def __init__(self, hidden: int, out_features: int):
        super().__init__()
        self.hidden = torch.nn.Linear(IN_FEATURES, hidden)
        self.out = torch.nn.Linear(hidden, out_features)
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))
        self.unused = torch.nn.Parameter(torch.randn(7, 3))

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))) * self.scale


@dataclasses.dataclass(frozen=True)
class Problem:
    """A test's net (``hidden`` and ``out_features`` wide) and its global
    batches, with a NaN in rank 0's rows at step ``nan_step`` (every rank must
    skip that step, as one process does)."""

    hidden: int
    out_features: int
    nan_step: int

    def build(self, dtype_name: str) -> Net:
        """The net, the same on every rank (seed 0), in the dtype named."""
        torch.manual_seed(0)
        return Net(self.hidden, self.out_features).to(DTYPES[dtype_name])

    def batch(self, step: int, dtype_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch (x, y) of ``step``, drawn from its own seed."""
        generator = torch.Generator().manual_seed(100 + step)
        x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
        y = torch.randn(GLOBAL_BATCH, self.out_features, generator=generator)
        if step == self.nan_step:
            x[0, 0] = float("nan")
        return x.to(DTYPES[dtype_name]), y.to(DTYPES[dtype_name])

    def train(self, model, optimizer, dtype_name, rows, steps, record=None) -> None:
        """The ``steps`` on the ``rows`` of each global batch (mean squared
        error); ``record`` (a list), if given, gets each step's whole gradients
        by parameter name (DDP's "module." prefix dropped)."""
        for step in steps:
            x, y = self.batch(step, dtype_name)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            if record is not None:
                record.append(
                    {
                        n.removeprefix("module."): _whole(p.grad)
                        for n, p in model.named_parameters()
                        if p.grad is not None
                    }
                )
            optimizer.step()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, whole (a DTensor's gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def rows_of(rank: int, world_size: int) -> slice:
    """The rows of each global batch that ``rank`` trains on."""
    shard = GLOBAL_BATCH // world_size
    return slice(rank * shard, (rank + 1) * shard)


def local_values(model) -> dict[str, torch.Tensor]:
    """Each parameter's local shard (a copy)."""
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def fully_sharded(model: Net, world_size: int) -> Net:
    """``model`` with each layer and then the whole ``fully_shard``-ed on a
    ``world_size`` CPU mesh (every parameter a DTensor sharded on dim 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model.hidden, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save_checkpoint(model, optimizer, checkpoint) -> None:
    """Model and optimizer through torch.distributed.checkpoint: state dicts
    keyed by parameter names, each rank writing its shards and its state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dcp.save(
        {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        },
        checkpoint_id=checkpoint,
    )


def load_checkpoint(model, optimizer, checkpoint, sharded: bool) -> None:
    """The model and a fresh optimizer from :func:`save_checkpoint`'s
    checkpoint, on any number of ranks. The optimizer's state, which DCP makes
    with a step at lr 0 where no parameter has a gradient (as in a new
    process), is the template that ``dcp.load`` fills; that step gives the
    parameter without a gradient a state the checkpoint lacks (as any torch
    optimizer's), which a partial load keeps. Under ShardedPreconditioning
    (``sharded``) each rank holds (and loads) its own parameters' state only,
    which DCP's strict check refuses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model.zero_grad(set_to_none=True)
    loaded = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load(
        loaded,
        checkpoint_id=checkpoint,
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    set_model_state_dict(model, loaded["model"])
    options = StateDictOptions(strict=not sharded)
    set_optimizer_state_dict(model, optimizer, loaded["optimizer"], options=options)
