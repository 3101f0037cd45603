"""SOAP as a ``torch.optim.Optimizer``: Adam run in the eigenbasis of Shampoo's
Kronecker factors (Vyas et al. 2024, arXiv:2409.11321).

The definition is ``tests/reference/soap_reference.py``'s (a float64 NumPy
reference written from the paper's Algorithm 3), which :func:`precond.jax`'s
SOAP implements too. Per parameter (each block of it, with ``block_size``), in
its working shape (the authors' greedy merge of adjacent dims with
``merge_dims``), with one statistic S_k and basis Q_k per axis of length at most
``max_precond_dim`` (none for a 1-D tensor unless ``precondition_1d``; an axis
without one keeps the identity: one-sided SOAP, or Adam with none at all):

* every call decays the parameter first: θ ← θ − lr·λ·θ (torch's AdamW);
* the first call accumulates S_k ← β_s·S_k + (1−β_s)·G ⋅_{¬k} G and takes
  each Q_k as the eigenvectors of S_k by descending eigenvalue; the parameter
  takes no preconditioned step, and the Adam count t stays 0;
* each later call (t = 1, 2, ...): G' = G ×_k Q_k; M ← β₁M + (1−β₁)G',
  V ← β₂V + (1−β₂)G'² (both moments live in the eigenbasis);
  U = (M / (√V + ε)) ×_k Q_kᵀ, divided by its RMS (+1e-30) with
  ``normalize_grads``; θ ← θ − lr·√(1−β₂ᵗ)/(1−β₁ᵗ)·U (lr alone without
  ``correct_bias``); then the statistics take G, and when t is a multiple of
  ``precondition_frequency`` each Q_k is refreshed: one QR power step
  (estimates diag(QᵀSQ) sorted descending, Q's columns and V's entries along k
  permuted by that order, Q ← qr(S·Q).Q) or, with ``refresh='eigh'``, the
  eigenvectors of S_k; M is rotated exactly into the new bases.

Blocks of equal shape are kept as one (count, ...) stack per parameter region,
and each refresh batches the eigh or QR of every statistic of one size of a
parameter into one call. Not over parameters: LAPACK (MKL) rounds a matrix by
its place in memory, so a batch shared with other parameters would make a
parameter's bases depend on which others a rank steps. A step whose
gradients are unusable (NaN, ±Inf, or so large their squared norm overflows) is
skipped as in Kron: no state changes and the parameters move by weight decay
alone.

Each call's step of a parameter is −lr·√(1−β₂ᵗ)/(1−β₁ᵗ)·U rounded to the
parameter's dtype (zero on the first call), added after the decay: so a rank
that did not compute it applies it bit for bit. Under ``torch.distributed`` the
``strategy`` shares the work out: every rank steps every parameter
(:class:`~precond.torch.Replicated`), or each rank keeps the moments,
statistics and bases of, and computes the projections, refreshes (eigh, QR)
and steps of, the parameters assigned to it, balanced by cost
(:class:`~precond.torch.ShardedPreconditioning`), and one all-gather gives
every rank every step; every rank applies the decay itself. A DTensor
parameter (FSDP2's ``fully_shard``) is stepped whole: its gradient is gathered
on every rank, its state is whole, and each rank applies its shard's slice of
the step (:mod:`precond.torch._core.dtensor`), so the run is the unsharded one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from precond.torch._core import optimizer as shared
from precond.torch._core.blocks import cut, paste
from precond.torch._core.dtensor import local_part, local_value
from precond.torch._core.profiling import profiled_stage
from precond.torch._core.step_policy import STEP
from precond.torch._core.tensors import scalar, working_dtype
from precond.torch.kron.strategies import (
    Replicated,
    Strategy,
    check_strategy,
    owners_of,
)
from precond.torch.soap import _soap_kernels as kernels
from precond.torch.soap._soap_arguments import (
    GROUP_ARGUMENTS,
    check_gradient,
    check_parameter,
)
from precond.torch.soap._soap_layout import Layout, layout

__all__ = ["SOAP"]

# Keys of self.state[p] besides STEP (the 1-based count of calls, the Adam count
# t being STEP − 1): flat lists, per region of the layout, of the first and
# second moments (count, *block), and per (region, axis with a statistic) of the
# statistics S and bases Q (count, d, d).
EXP_AVG, EXP_AVG_SQ = "exp_avg", "exp_avg_sq"
STATISTICS, BASES = "statistics", "bases"
_STATE_LISTS = (EXP_AVG, EXP_AVG_SQ, STATISTICS, BASES)


class SOAP(shared.CheckedOptimizer):
    """SOAP: Adam in the eigenbasis of Shampoo's factors, with the paper's
    argument names, order and defaults.

    The step, the first call (statistics and bases only) and the refresh:
    :mod:`precond.torch.soap.soap`. A step with a NaN, ±Inf or overflowing
    gradient is skipped (:attr:`skipped_steps`). torch's schedulers cycle
    ``betas[0]`` (OneCycleLR, CyclicLR), as for ``torch.optim.Adam``.

    Args:
        params: parameters or param groups (every argument may be set per group).
        lr: learning rate (a float or a one-element tensor).
        betas: (β₁, β₂) of the two moments, each in [0, 1).
        shampoo_beta: β_s of the statistics; below 0 (the default, -1): β₂.
        eps: ε added to √V.
        weight_decay: decoupled weight decay λ, on the parameter before the
            step (θ ← θ − lr·λ·θ), every call including the first.
        precondition_frequency: the bases are refreshed every this many Adam
            steps.
        max_precond_dim: an axis longer than this gets no statistic (its basis is
            the identity); it also bounds the dims ``merge_dims`` makes.
        merge_dims: precondition in the shape that merges adjacent dims while
            their product stays at most ``max_precond_dim`` (tensors of 2+ dims).
        precondition_1d: give 1-D parameters a statistic too (else: Adam).
        normalize_grads: divide each update U by its RMS (+1e-30).
        correct_bias: Adam's bias correction √(1−β₂ᵗ)/(1−β₁ᵗ) of the step.
        refresh: 'qr' (the paper's one QR power step, with the sort of the
            estimated eigenvalues and the permutation of V) or 'eigh' (the
            eigenvectors of S, V left as it is).
        block_size: None (whole tensors) or the length blocks of the working
            shape are cut into along every axis (remainders are blocks of their
            own); each block is a SOAP of its own.
        strategy: how ``torch.distributed`` ranks share the work (not per
            group): None or :class:`~precond.torch.Replicated` (every rank
            steps every parameter), or
            :class:`~precond.torch.ShardedPreconditioning` (each rank keeps the
            state of, and computes the projections, basis refreshes and step
            of, the parameters assigned to it; one all-gather shares the steps;
            each rank's ``state_dict`` holds its own parameters' state). Under
            FSDP2 both apply to whole (gathered) parameters.

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> optimizer = SOAP(model.parameters(), lr=3e-3)
        >>> model(torch.randn(2, 8)).square().sum().backward()
        >>> optimizer.step()
    """

    # The state entries load_state_dict copies as saved (dtype kept).
    _KEPT_STATE: tuple[str, ...] = _STATE_LISTS

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        correct_bias: bool = True,
        *,
        refresh: str = "qr",
        block_size: int | None = None,
        strategy: Strategy | None = None,
    ):
        defaults = shared.group_defaults(locals(), GROUP_ARGUMENTS)
        shared.check_arguments(defaults, GROUP_ARGUMENTS)
        check_strategy("strategy", strategy)
        self.strategy: Strategy = strategy or Replicated()
        super().__init__(params, defaults)

    def _check_param_group(self, group: dict[str, Any]) -> None:
        shared.check_arguments(group, GROUP_ARGUMENTS)
        for p in group["params"]:
            check_parameter(p)

    def _sync_momentum(self) -> None:
        """No ``b1``/``momentum`` pair to sync: torch's schedulers set ``betas``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's checks; a bad group is refused whole."""
        torch.optim.Optimizer.add_param_group(self, param_group)
        try:
            self._check_param_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state; moments, statistics and bases keep their saved dtypes.
        Groups that do not match raise torch's ValueError, changing nothing."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(
                "loaded state dict has a different number of parameter groups"
            )
        for group, ours in zip(saved, self.param_groups, strict=True):
            if len(group["params"]) != len(ours["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't "
                    "match the size of optimizer's group"
                )
        self._load_keeping_dtypes(state_dict, self._KEPT_STATE)

    @shared.eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = shared.closure_loss(closure)
        usable = self._usable_entries(check_gradient)
        if usable is None:
            return loss
        entries, full = usable
        owners = owners_of(self.strategy, self.param_groups, entries, _cost)
        rank = self.strategy.rank
        steps: dict[int, torch.Tensor] = {}
        for (group, p, index), g, owner in zip(entries, full, owners, strict=True):
            _decay(group, p)  # on every rank, owner or not
            if owner != rank:
                continue
            refreshes: list[tuple] = []
            steps[index], finish = self._step_parameter(group, p, g, refreshes)
            with profiled_stage("precond/soap/update_factors"):
                _refresh(refreshes)
                if finish is not None:
                    finish()
        with profiled_stage("precond/soap/apply_updates"):
            shared_steps = self.strategy.share(
                [p for _, p, _ in entries],
                owners,
                [steps.get(index) for _, _, index in entries],
            )
            for (_, p, _), step in zip(entries, shared_steps, strict=True):
                local_value(p).add_(local_part(p, step.to(p.dtype)))
        return loss

    def _init_state(self, p: torch.Tensor, lay: Layout) -> dict[str, Any]:
        state = self.state[p]
        if EXP_AVG in state:
            return state
        dtype = working_dtype(p.dtype)
        zeros = [
            torch.zeros(r.count, *r.block_shape, dtype=dtype, device=p.device)
            for r in lay.regions
        ]
        square = []
        for r, axes in zip(lay.regions, lay.axes, strict=True):
            for k in axes:
                d = r.block_shape[k]
                square.append(torch.zeros(r.count, d, d, dtype=dtype, device=p.device))
        state[STEP] = 0
        state[EXP_AVG] = zeros
        state[EXP_AVG_SQ] = [z.clone() for z in zeros]
        state[STATISTICS] = square
        state[BASES] = [s.clone() for s in square]
        return state

    def _step_parameter(
        self, group, p, g, refreshes
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Counts the call, takes p's Adam step in the eigenbasis (after the
        first call) and accumulates its statistics (``g``: the whole gradient).
        Appends the refreshes it needs to ``refreshes``; returns p's step (whole,
        in p's dtype) and what must run once the refreshes are done."""
        lay = layout(p.shape, group)
        state = self._init_state(p, lay)
        dtype = state[EXP_AVG][0].dtype
        state[STEP] += 1
        t = state[STEP] - 1
        G = g.to(dtype).reshape(lay.shape)
        blocks = [cut(G, r) for r in lay.regions]
        per_region = _split(state[STATISTICS], lay), _split(state[BASES], lay)
        if t > 0:
            step = self._adam_step(group, p, state, lay, blocks, per_region[1], t)
        else:  # the first call moves p by its weight decay alone
            step = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        beta_s = group["shampoo_beta"]
        if beta_s < 0:
            beta_s = group["betas"][1]
        with profiled_stage("precond/soap/update_factors"):
            for G_r, S_r, axes in zip(blocks, per_region[0], lay.axes, strict=True):
                kernels.accumulate(S_r, G_r, axes, beta_s)
        if t == 0:
            for S, Q in zip(state[STATISTICS], state[BASES], strict=True):
                refreshes.append(("eigh", S, Q, None))
            return step, None
        if t % group["precondition_frequency"] != 0 or not state[BASES]:
            return step, None
        return step, self._plan_refresh(group, state, lay, per_region, refreshes)

    def _adam_step(self, group, p, state, lay, blocks, bases, t) -> torch.Tensor:
        """The moments in the eigenbasis; returns the step −size·U (whole, in
        p's dtype)."""
        b1, b2 = group["betas"]
        eps = group["eps"]
        update = torch.empty(lay.shape, dtype=state[EXP_AVG][0].dtype, device=p.device)
        for i, (region, axes) in enumerate(zip(lay.regions, lay.axes, strict=True)):
            M, V = state[EXP_AVG][i], state[EXP_AVG_SQ][i]
            with profiled_stage("precond/soap/momentum"):
                projected = kernels.project(blocks[i], axes, bases[i])
                M.mul_(b1).add_(projected, alpha=1 - b1)
                V.mul_(b2).addcmul_(projected, projected, value=1 - b2)
            with profiled_stage("precond/soap/precondition"):
                U = kernels.project_back(M / (V.sqrt() + eps), axes, bases[i])
                if group["normalize_grads"]:
                    rms = U.square().reshape(U.shape[0], -1).mean(dim=1).sqrt()
                    U = U / (1e-30 + rms).reshape(-1, *[1] * (U.dim() - 1))
            paste(update, U, region)
        size = _rounded(scalar(group["lr"]), update.dtype)
        if group["correct_bias"]:
            size = size * math.sqrt(1 - b2**t) / (1 - b1**t)
        return (update.reshape(p.shape) * -size).to(p.dtype)

    @staticmethod
    def _plan_refresh(group, state, lay, per_region, refreshes) -> Callable[[], None]:
        """Projects M back with the old bases, queues the refresh of every basis
        (permuting V along its axis after a QR step) and returns the rotation
        of M into the new bases."""
        statistics, bases = per_region
        kind = group["refresh"]
        for i, axes in enumerate(lay.axes):
            M = state[EXP_AVG][i]
            M.copy_(kernels.project_back(M, axes, bases[i]))
            for j, k in enumerate(axes):
                V = state[EXP_AVG_SQ][i] if kind == "qr" else None
                refreshes.append((kind, statistics[i][j], bases[i][j], (V, k)))

        def rotate() -> None:
            for i, axes in enumerate(lay.axes):
                M = state[EXP_AVG][i]
                M.copy_(kernels.project(M, axes, bases[i]))

        return rotate


def _cost(p: torch.Tensor, group: dict[str, Any]) -> float:
    """The work of a parameter's step, by which ShardedPreconditioning balances
    the ranks: per basis of length d in a block of n entries, d³ (its eigh or QR)
    and 2·d·n (projecting G and U), times the blocks; plus the size."""
    lay = layout(p.shape, group)
    total = p.numel()
    for region, axes in zip(lay.regions, lay.axes, strict=True):
        n = math.prod(region.block_shape)
        for k in axes:
            d = region.block_shape[k]
            total += region.count * (d**3 + 2 * d * n)
    return float(total)


def _decay(group: dict[str, Any], p: torch.Tensor) -> None:
    """θ ← θ − lr·λ·θ (this rank's shard of a DTensor θ)."""
    decay = group["weight_decay"]
    if decay != 0:
        lr = _rounded(scalar(group["lr"]), working_dtype(p.dtype))
        local_value(p).mul_(1 - lr * decay)


def _rounded(lr: float, dtype: torch.dtype) -> float:
    """``lr`` rounded to float32 for float32 state: a float lr and the same
    value as a float32 tensor (``lr=torch.tensor(...)``) then step alike."""
    return float(np.float32(lr)) if dtype == torch.float32 else lr


def _split(flat: list[torch.Tensor], lay: Layout) -> list[list[torch.Tensor]]:
    """A flat list over (region, axis with a statistic), per region."""
    out, start = [], 0
    for axes in lay.axes:
        out.append(flat[start : start + len(axes)])
        start += len(axes)
    return out


def _refresh(refreshes: list[tuple]) -> None:
    """Every queued refresh, one batched eigh or QR call per (kind, size,
    dtype, device): ``(kind, S, Q, target)``, Q written in place; after a QR
    step the second moment ``target = (V, axis)`` is permuted to follow."""
    batches: dict[tuple, list[tuple]] = defaultdict(list)
    for item in refreshes:
        kind, S, _, _ = item
        batches[(kind, S.shape[-1], S.dtype, S.device)].append(item)
    for (kind, _, _, _), items in batches.items():
        counts = [S.shape[0] for _, S, _, _ in items]
        S = torch.cat([s for _, s, _, _ in items])
        if kind == "eigh":
            new, orders = kernels.descending_eigenvectors(S), None
        else:
            new, orders = kernels.power_step(S, torch.cat([q for _, _, q, _ in items]))
        start = 0
        for (_, _, Q, target), n in zip(items, counts, strict=True):
            Q.copy_(new[start : start + n])
            if orders is not None and target is not None:
                V, axis = target
                V.copy_(kernels.permute_axis(V, orders[start : start + n], axis))
            start += n
