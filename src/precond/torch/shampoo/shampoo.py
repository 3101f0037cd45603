"""Distributed Shampoo with grafting as a ``torch.optim.Optimizer``: the torch
twin of :func:`precond.jax.distributed_shampoo`, with its argument names,
defaults and arithmetic (``tests/torch/shampoo`` checks the two agree to
~1e-10 in float64).

For a parameter W with gradient G (after merging small dims, cut into blocks
G_b), at its step t (0-based), per block b and preconditioned axis k:

    S_{b,k} ← β2·S_{b,k} + (1−β2)·G_b ⋅_{¬k} G_b        if t % statistics_compute_steps = 0
    P_{b,k} ← (S_{b,k} + ε·max(λ_max, 1e-6)·I)^{-1/p}    if t % preconditioning_compute_steps = 0
    u_s = P(G)·‖u_g‖/‖P(G)‖,  P(G)_b = G_b ×_0 P_{b,0} ×_1 P_{b,1} …
    m_s ← β1·m_s + w·(u_s + λW),  m_g ← β1·m_g + w·(u_g + λW)
    m, u = (m_s, u_s) if t >= start_preconditioning_step else (m_g, u_g)
    v = w·u + β1·m if nesterov else m,   W ← W − lr·v

with u_g the grafting method's step (:class:`GraftingType`), p = 2·(number of
preconditioned axes) unless ``exponent_override``, w = 1 − β1 with
``moving_average_for_momentum`` else 1. S starts at ε·I and P at I; a root whose
error is NaN or >= ``inverse_failure_threshold`` is not used (the previous P
stays). The roots of all due statistics of one size and exponent are computed
in one batched call (``shampoo._math``).

Under ``torch.distributed`` the ``strategy`` shares the work out: every
rank steps every parameter (:class:`~precond.torch.Replicated`), or each its
own (:class:`~precond.torch.ShardedPreconditioning`, one all-gather of the
updates). A DTensor parameter (FSDP2's ``fully_shard``) is stepped whole: its
gradient (and, with weight decay, its value) is gathered on every rank, the
statistics, roots and momenta are whole tensors, and each rank applies its
shard's slice of the update (:mod:`precond.torch._core.dtensor`), so the run
is the unsharded one.

A step in which some gradient's squared norm is not finite in its working
precision (NaN, ±Inf, or entries from ~1.8e19 in float32) is skipped: no state
changes and no parameter moves (weight decay included, as JAX's returns zero
updates); :attr:`skipped_steps` counts it and the first is logged at WARNING on
the ``precond.torch`` logger.
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from precond.torch._core.dtensor import (
    full_value,
    is_dtensor,
    local_part,
    local_value,
)
from precond.torch._core.optimizer import (
    CheckedOptimizer,
    check_arguments,
    closure_loss,
    eager_step,
    group_defaults,
    saved_parameters,
)
from precond.torch._core.profiling import profiled_stage
from precond.torch._core.tensors import scalar, working_dtype
from precond.torch.kron.strategies import Replicated, Strategy, owners_of
from precond.torch.shampoo import _step
from precond.torch.shampoo._arguments import (
    ENUM_ARGUMENTS,
    GROUP_ARGUMENTS,
    GraftingType,
    PreconditionerType,
    check_beta1,
    check_gradient,
    check_parameter,
    check_strategy,
)
from precond.torch.shampoo._layout import plan_of, preconditioned, statistics_grams
from precond.torch.shampoo._step import (
    DIAGONAL,
    GRAFT_MOMENTUM,
    MOMENTUM,
    ROOTS,
    STATISTICS,
)

__all__ = ["Shampoo"]

STEP = "step"
# State entries saved in their own dtype (torch's load would cast them to the
# parameter's, e.g. bfloat16).
_KEPT = (MOMENTUM, GRAFT_MOMENTUM, DIAGONAL, STATISTICS, ROOTS)


def _cost(p: torch.Tensor, group: dict[str, Any]) -> float:
    """The work of a parameter's step: n³ per statistic (its root), plus its
    size."""
    plan = plan_of(p.shape, group)
    if plan is None:
        return float(p.numel())
    cubes = [
        plan.regions[r].count * plan.regions[r].block_shape[k] ** 3
        for r, k in plan.entries
    ]
    return float(sum(cubes) + p.numel())


def _check_saved_state(p: torch.Tensor, group: dict, state: dict) -> None:
    """Raises ValueError when a saved parameter state does not fit ``p`` under
    its saved group's layout arguments."""
    plan = plan_of(p.shape, group)
    expected = (
        []
        if plan is None
        else [
            (plan.regions[r].count, plan.regions[r].block_shape[k])
            for r, k in plan.entries
        ]
    )
    found = [(s.shape[0], s.shape[-1]) for s in state.get(STATISTICS, [])]
    momentum = state.get(MOMENTUM)
    if found != expected or momentum is None or momentum.shape != p.shape:
        raise ValueError(
            f"Invalid state_dict: the state saved for a parameter of shape "
            f"{tuple(p.shape)} does not fit it (another model's checkpoint, or "
            "another block_size?)"
        )


class Shampoo(CheckedOptimizer):
    """Distributed Shampoo (Anil et al. 2020) with grafting, with the argument
    names and defaults of :func:`precond.jax.distributed_shampoo`.

    The step, its skipped steps and the batching of the roots:
    :mod:`precond.torch.shampoo.shampoo`. ``params, lr`` come first, as in torch;
    the next arguments are positional in ``distributed_shampoo``'s order, the
    rest keyword-only. JAX's mesh, pjit and quantization arguments
    (``batch_axis_name``, the partition specs, ``num_devices_for_pjit``,
    ``shard_optimizer_states``, ``best_effort_memory_usage_reduction``,
    ``quantize_statistics``, ``precision``, ``tensordot_precision``, ...) and
    LOBPCG deflation are not taken. Every argument may be set per param group;
    the layout arguments (``block_size``, merging, skipping, the exponent) are
    read when a parameter's state is made. ``beta1`` is also each group's
    ``momentum``, the key torch's schedulers set.

    Args:
        params: parameters or param groups.
        lr: learning rate (a float or a one-element tensor).
        block_size: axes longer than this are cut into blocks of this size
            (the last one shorter); 0 keeps axes whole. Small adjacent dims are
            merged up to this size first (``best_effort_shape_interpretation``).
            JAX has no default; 128 here.
        beta1: momentum, in [0, 1].
        beta2: EMA factor of the statistics (and of RMSProp grafting); 1 sums them.
        diagonal_epsilon: ε of AdaGrad/RMSProp grafting: G/(√D + ε).
        matrix_epsilon: relative ridge: roots of S + ε·max(λ_max(S), 1e-6)·I.
        weight_decay: λ, added to both directions before momentum (coupled;
            see ``decoupled_weight_decay``).
        start_preconditioning_step: steps before this one use the grafting
            method alone (the statistics are still accumulated).
        preconditioning_compute_steps: recompute the roots every this many steps.
        statistics_compute_steps: update the statistics every this many steps.
        best_effort_shape_interpretation: merge small adjacent dims, e.g.
            (1, 2, 512, 1, 2048, 1, 3, 4) → (1024, 2048, 12) for block 1024.
        graft_type: a :class:`GraftingType` (or its int value; stored as an int).
        nesterov: Nesterov momentum.
        exponent_override: p of the inverse roots if > 0, else 2·rank.
        inverse_failure_threshold: roots with a larger error are rejected.
        moving_average_for_momentum: w = 1 − β1 instead of 1.
        skip_preconditioning_dim_size_gt: parameters with a dim larger than this
            (before merging and blocking), and scalars, use the grafting step.
        clip_by_scaled_gradient_norm: with RMSProp grafting, divide u_g by
            max(1, RMS(u_g)/clip).
        relative_matrix_epsilon: the ridge is ε·max(λ_max, 1e-6); False: ε.
        merge_small_dims_block_size: merge small dims up to this size; None
            merges up to ``block_size``.
        precondtioner_type: a :class:`PreconditionerType` (Google's spelling):
            ALL axes, INPUT (all but the last) or OUTPUT (the last only).
        skip_preconditioning_rank_lt: parameters of lower rank take the grafting
            step alone.
        decoupled_learning_rate: lr scales the final update (True) or the
            directions before momentum (False).
        decoupled_weight_decay: add lr·λ·W after momentum (then scaled by lr
            again when the learning rate is decoupled, as Google's code)
            instead of λ·W before it.
        eigh: compute roots by an eigendecomposition instead of coupled Newton.
        separate_grafting_momentum: with SQRT_N grafting, keep a grafting
            momentum of its own.
        precondition_with_previous_roots: precondition step t with the roots
            of the step before (the new ones are kept for the next step);
            None or False: with this step's.
        strategy: how ``torch.distributed`` ranks share the work (not per
            group): None or :class:`~precond.torch.Replicated` (every rank
            steps every parameter), or
            :class:`~precond.torch.ShardedPreconditioning` (each rank keeps the
            state of, and computes the statistics, roots and update of, the
            parameters assigned to it; one all-gather shares the updates; each
            rank's ``state_dict`` holds its own parameters' state). Under
            FSDP2 both apply to whole (gathered) parameters.

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> optimizer = Shampoo(model.parameters(), lr=1e-2, block_size=128)
        >>> model(torch.randn(2, 8)).square().sum().backward()
        >>> optimizer.step()
    """

    _momentum_name = "beta1"
    _check_momentum = staticmethod(check_beta1)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 0.001,
        block_size: int = 128,
        beta1: float = 0.9,
        beta2: float = 0.999,
        diagonal_epsilon: float = 1e-10,
        matrix_epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        start_preconditioning_step: int = 5,
        preconditioning_compute_steps: int = 1,
        statistics_compute_steps: int = 1,
        best_effort_shape_interpretation: bool = True,
        graft_type: GraftingType | int = GraftingType.SGD,
        nesterov: bool = True,
        exponent_override: int = 0,
        *,
        inverse_failure_threshold: float = 0.1,
        moving_average_for_momentum: bool = False,
        skip_preconditioning_dim_size_gt: int = 4096,
        clip_by_scaled_gradient_norm: float | None = None,
        relative_matrix_epsilon: bool = True,
        merge_small_dims_block_size: int | None = None,
        precondtioner_type: PreconditionerType | int = PreconditionerType.ALL,
        skip_preconditioning_rank_lt: int = 1,
        decoupled_learning_rate: bool = True,
        decoupled_weight_decay: bool = False,
        eigh: bool = False,
        separate_grafting_momentum: bool = False,
        precondition_with_previous_roots: bool | None = None,
        strategy: Strategy | None = None,
    ):
        check_arguments(locals(), GROUP_ARGUMENTS)
        check_strategy("strategy", strategy)
        defaults = group_defaults(locals(), GROUP_ARGUMENTS)
        for name in ENUM_ARGUMENTS:
            defaults[name] = int(defaults[name])
        self.strategy: Strategy = strategy or Replicated()
        super().__init__(params, defaults)

    def _check_param_group(self, group: dict[str, Any]) -> None:
        check_arguments(group, GROUP_ARGUMENTS)
        for name in ENUM_ARGUMENTS:
            group[name] = int(group[name])
        for p in group["params"]:
            check_parameter(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state; its buffers keep their saved dtypes (torch would cast
        them to the parameter's, e.g. bfloat16). A state that does not fit
        (other groups, or buffers of other shapes: another model's checkpoint,
        another ``block_size``) raises ValueError and changes nothing."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"])
            for g, mine in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "Invalid state_dict: its param groups do not match this "
                "optimizer's (another model's checkpoint?)"
            )
        params = saved_parameters(self.param_groups, state_dict)
        for saved in groups:
            for key in saved["params"]:
                if key in state_dict["state"]:
                    _check_saved_state(params[key], saved, state_dict["state"][key])
        self._load_keeping_dtypes(state_dict, _KEPT)

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = closure_loss(closure)
        self._sync_momentum()
        # No weight decay on a skipped step either: JAX's returns zero updates.
        usable = self._usable_entries(check_gradient, decay=False)
        if usable is None:
            return loss
        entries, full = usable
        # Whole parameters for the weight decay, gathered as the gradients are.
        grads = {i: g for (_, _, i), g in zip(entries, full, strict=True)}
        values = {
            i: full_value(p) for group, p, i in entries if group["weight_decay"] != 0
        }
        owners = owners_of(self.strategy, self.param_groups, entries, _cost)
        rank = self.strategy.rank
        mine = [e for e, owner in zip(entries, owners, strict=True) if owner == rank]
        updates = dict(self._updates(mine, grads, values))
        with profiled_stage("precond/shampoo/share_updates"):
            shared = self.strategy.share(
                [p for _, p, _ in entries],
                owners,
                [updates.get(i) for _, _, i in entries],
            )
        with profiled_stage("precond/shampoo/apply_updates"):
            for (_, p, _), update in zip(entries, shared, strict=True):
                local_value(p).add_(local_part(p, update.to(p.dtype)))
        return loss

    def _updates(self, entries, grads, values) -> list[tuple[int, torch.Tensor]]:
        """(index, −lr·v) of each of ``entries`` (this rank's), their states
        advanced by one step; ``grads`` and ``values`` (with weight decay) hold
        the whole gradients and parameters by index."""
        states = [self._init_state(p, group) for group, p, _ in entries]
        plans = [plan_of(p.shape, group) for group, p, _ in entries]
        work = list(zip(entries, states, plans, strict=True))
        with profiled_stage("precond/shampoo/statistics"):
            for (group, _, i), state, plan in work:
                if (
                    plan is not None
                    and state[STEP] % group["statistics_compute_steps"] == 0
                ):
                    dtype = state[STATISTICS][0].dtype
                    grams = statistics_grams(grads[i], plan, dtype)
                    _step.update_statistics(state[STATISTICS], grams, group["beta2"])
        with profiled_stage("precond/shampoo/inverse_roots"):
            roots = self._refresh_roots(work)
        with profiled_stage("precond/shampoo/precondition"):
            directions = [
                self._directions(group, grads[i], values.get(i), state, plan, used)
                for ((group, _, i), state, plan), used in zip(work, roots, strict=True)
            ]
        with profiled_stage("precond/shampoo/momentum"):
            updates = [
                (index, self._update(group, values.get(index), state, shampoo, graft))
                for ((group, p, index), state, _), (shampoo, graft) in zip(
                    work, directions, strict=True
                )
            ]
        for state in states:
            state[STEP] += 1
        return updates

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Momenta and accumulator at 0, statistics at ε·I and roots at I, in
        the parameter's working dtype (float32, or float64 for float64)."""
        state = self.state[p]
        if MOMENTUM in state:
            return state
        dtype = working_dtype(p.dtype)
        state[STEP] = 0
        if is_dtensor(p):  # whole, as the gathered gradient
            state[MOMENTUM] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        else:
            state[MOMENTUM] = torch.zeros_like(p, dtype=dtype)
        if _step.has_graft_momentum(group):
            state[GRAFT_MOMENTUM] = torch.zeros_like(state[MOMENTUM])
        if _step.has_diagonal_statistics(group):
            state[DIAGONAL] = torch.zeros_like(state[MOMENTUM])
        plan = plan_of(p.shape, group)
        state[STATISTICS], state[ROOTS] = [], []
        blocks = [] if plan is None else [(plan.regions[r], k) for r, k in plan.entries]
        for region, k in blocks:
            n = region.block_shape[k]
            eye = torch.eye(n, dtype=dtype, device=p.device)
            eye = eye.expand(region.count, n, n)
            state[STATISTICS].append(group["matrix_epsilon"] * eye.clone())
            state[ROOTS].append(eye.clone())
        return state

    def _refresh_roots(self, work) -> list[list[torch.Tensor] | None]:
        """Recomputes the due roots (batched); returns, per entry, the roots
        its step preconditions with (the previous ones with
        ``precondition_with_previous_roots``), or None without a plan."""
        due, used = [], []
        for (group, _, _), state, plan in work:
            if plan is None:
                used.append(None)
                continue
            previous = bool(group["precondition_with_previous_roots"])
            refresh = state[STEP] % group["preconditioning_compute_steps"] == 0
            used.append(
                [r.clone() for r in state[ROOTS]]
                if previous and refresh
                else state[ROOTS]
            )
            if refresh:
                due.append((group, state, plan.exponent))
        _step.refresh_roots(due)
        return used

    def _directions(self, group, grad, value, state, plan, roots):
        """(u_s, u_g) of one parameter (whole gradient ``grad``, whole value
        ``value`` or None without weight decay): u_g scaled by lr when the
        learning rate is coupled, u_s the preconditioned gradient grafted to its
        norm (u_g without a plan), both with the coupled weight decay."""
        g = grad.to(working_dtype(grad.dtype))
        graft = _step.grafting_direction(g, state.get(DIAGONAL), group)
        if not group["decoupled_learning_rate"]:
            graft = scalar(group["lr"]) * graft
        if plan is None:
            direction = graft
        else:
            direction = preconditioned(g, plan, roots).to(g.dtype)
        weight = None if value is None else value.to(g.dtype)
        return _step.grafted(direction, graft, weight, group)

    def _update(self, group, value, state, shampoo, graft) -> torch.Tensor:
        """−lr·v (−v with a coupled learning rate), with the decoupled decay
        (``value``: the whole parameter, or None without weight decay)."""
        running = state[STEP] >= group["start_preconditioning_step"]
        v = _step.momentum_step(shampoo, graft, state, running, group)
        lr = scalar(group["lr"])
        decay = group["weight_decay"]
        if decay != 0 and group["decoupled_weight_decay"]:
            assert value is not None  # gathered where the decay is not 0
            v = v + lr * decay * value.to(v.dtype)
        return -(lr if group["decoupled_learning_rate"] else 1.0) * v
