"""How ranks of a ``torch.distributed`` job share Kron's preconditioner work.

A strategy decides which rank computes each parameter's update (``assign``) and
brings every rank the updates it did not compute (``share``). Under DDP the
gradients are already averaged, so :class:`Replicated` (every rank does all the
work, no communication) is correct as it is; :class:`ShardedPreconditioning`
spreads the fits and preconditioned updates over the ranks and exchanges the
results with one all-gather per step.

Under FSDP2 (``fully_shard``: DTensor parameters) both apply to whole
parameters: Kron gathers each whole gradient, the assigned rank fits and
preconditions it, and every rank applies its own shard's slice of the update.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Replicated", "ShardedPreconditioning", "Strategy"]

# (group, parameter, index among all the optimizer's parameters), as
# ``precond.torch._core.optimizer.gradient_entries`` lists them.
Entry = tuple[dict, torch.Tensor, int]


class Strategy:
    """Interface: ``rank``, ``assign(params, costs)``, ``share(...)``."""

    rank: int = 0

    def assign(
        self, params: Sequence[torch.Tensor], costs: Sequence[float]
    ) -> list[int]:
        """The rank that computes each parameter's update, given all the
        optimizer's parameters (whether or not they have gradients this step)
        in its order of assignment: group by group, the costliest first."""
        raise NotImplementedError

    def share(
        self,
        params: Sequence[torch.Tensor],
        owners: Sequence[int],
        updates: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Every parameter's update on every rank (``None`` where not computed)."""
        raise NotImplementedError


class Replicated(Strategy):
    """Every rank computes every update (one process, or DDP-averaged gradients).

    Example (Kron's default strategy):
        >>> from precond.torch import Kron
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = Kron(model.parameters(), strategy=Replicated())
    """

    def assign(self, params, costs):
        return [self.rank] * len(params)

    def share(self, params, owners, updates):
        return list(updates)


class ShardedPreconditioning(Strategy):
    """Each rank keeps the momentum and factors of, fits and preconditions only
    the parameters assigned to it, then one all-gather gives every rank all
    updates. Each parameter goes, in the order given (Kron's: group by group,
    the costliest first within each), to the least-loaded rank so far. So the
    shares are fixed from step to step: a parameter whose gradient is missing
    on some steps, or a group added later, moves no other one to another rank.

    Each rank's ``state_dict()`` holds the state of its own parameters only (as
    with ZeRO): save and load it per rank. With ``torch.distributed.checkpoint``
    (``get_optimizer_state_dict``), load it with
    ``set_optimizer_state_dict(..., options=StateDictOptions(strict=False))``,
    which lets each rank hold only its own. Every rank must see the same
    parameters with gradients in the same order, as under DDP.

    Args:
        process_group: the ranks to spread over (default: the whole world).

    Example, in each of the processes of a torchrun job (``model`` in DDP):

        >>> strategy = ShardedPreconditioning()  # doctest: +SKIP
        >>> optimizer = Kron(model.parameters(), strategy=strategy)  # doctest: +SKIP
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ShardedPreconditioning needs torch.distributed to be initialized "
                "(dist.init_process_group) before the optimizer is built"
            )
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._cache: dict[tuple, list[int]] = {}

    def assign(self, params, costs):
        key = tuple((id(p), tuple(p.shape)) for p in params)
        if key not in self._cache:
            loads = [(0.0, rank) for rank in range(self.world_size)]
            owners = []
            for c in costs:  # each to the least-loaded rank (the lowest on ties)
                load, rank = heapq.heappop(loads)
                owners.append(rank)
                heapq.heappush(loads, (load + c, rank))
            self._cache[key] = owners
        return self._cache[key]

    def share(self, params, owners, updates):
        dtype = torch.float32
        for p in params:  # the same on every rank, whatever it owns
            dtype = torch.promote_types(dtype, _real_dtype(p))
        # Every rank knows every rank's sizes: no size exchange is needed.
        sizes = [0] * self.world_size
        for p, owner in zip(params, owners, strict=True):
            sizes[owner] += _real_numel(p)
        device = params[0].device
        local = torch.zeros(max(sizes), dtype=dtype, device=device)
        offset = 0
        for u, owner in zip(updates, owners, strict=True):
            if owner == self.rank:
                assert u is not None  # this rank computed the updates it owns
                flat = _as_real(u).reshape(-1)
                local[offset : offset + flat.numel()] = flat
                offset += flat.numel()
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.process_group)
        offsets = [0] * self.world_size
        shared = []
        for p, owner in zip(params, owners, strict=True):
            start, n = offsets[owner], _real_numel(p)
            chunk = gathered[owner][start : start + n]
            if p.is_complex():  # (real, imaginary) pairs back to complex
                chunk = torch.view_as_complex(chunk.reshape(*p.shape, 2))
            shared.append(chunk.reshape(p.shape))
            offsets[owner] += n
        return shared


def check_strategy(name: str, value: Any) -> None:
    """None or a :class:`Strategy` (an optimizer's ``strategy`` argument)."""
    if value is not None and not isinstance(value, Strategy):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a precond.torch.Strategy "
            "(Replicated() or ShardedPreconditioning())"
        )


def owners_of(
    strategy: Strategy,
    param_groups: Sequence[dict],
    entries: Sequence[Entry],
    cost: Callable[[torch.Tensor, dict], float],
) -> list[int]:
    """The rank that computes each of ``entries``' updates (Shampoo's and
    SOAP's rule, Kron's too). The strategy shares out all the optimizer's
    parameters, group by group and the costliest (``cost(p, group)``) first
    within each, not only this step's with gradients: a parameter whose
    gradient is missing on some steps, or a group added later, moves no other
    parameter, or its state, to another rank."""
    params = [
        (g, group, p) for g, group in enumerate(param_groups) for p in group["params"]
    ]
    costs = [cost(p, group) for _, group, p in params]
    order = sorted(range(len(params)), key=lambda i: (params[i][0], -costs[i], i))
    assigned = strategy.assign([params[i][2] for i in order], [costs[i] for i in order])
    owners = dict(zip(order, assigned, strict=True))
    return [owners[index] for _, _, index in entries]


def _real_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a tensor's real and imaginary parts (itself if real)."""
    return p.real.dtype if p.is_complex() else p.dtype


def _real_numel(p: torch.Tensor) -> int:
    """Real numbers in a tensor: two per complex entry."""
    return p.numel() * (2 if p.is_complex() else 1)


def _as_real(u: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(u) if u.is_complex() else u
