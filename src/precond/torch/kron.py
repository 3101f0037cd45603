"""PSGD Kron as a ``torch.optim.Optimizer``: drop-in for ``kron_torch.Kron``.

The same generation-1 algorithm as :func:`precond.jax.kron` (kernels in
``precond.torch._kron_math``): each parameter's preconditioner is
P = ⊗_i Q_iᵀQ_i, one triangular or diagonal factor per axis, fitted online so
that P·m̂ is whitened (Li 2018, arXiv:1809.10232; Li 2024, arXiv:2402.11858).
Parameters of equal shape and factor structure form a bucket whose factors and
momenta are kept in (B, ...) stacks (``_kron_state.BucketStacks``; each
parameter's ``state`` entries are views of them), so that one batched call fits
or applies all of their factors without copying them into a batch each step.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
import torch

from precond._common.factor_plan import MEMORY_SAVE_MODES
from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.kron_constants import BALANCE_PROBABILITY, MAX_UPDATE_RMS
from precond._common.kron_constants import (  # re-exported, as before
    PRECONDITIONER_CACHES as PRECONDITIONER_CACHES,
)
from precond._common.schedules import check_update_prob_schedule
from precond._common.validation import check_bool, check_choice, check_real
from precond.torch import _kron_math as km
from precond.torch._dtensor import (
    check_dtensor_parameter,
    full_gradients,
    full_value,
    is_dtensor,
    local_part,
    local_value,
)
from precond.torch._kron_state import (
    FACTORS,
    LIPSCHITZ,
    MOMENTUM,
    STEP,
    UPDATE_COUNTER,
    BucketStacks,
    bucket_stacks,
    buckets,
    cache_layout,
    cost,
    factor_of,
    factor_plan,
    generation_2,
    gram_of,
    initial_factors,
    state_dict_problem,
    state_dtypes,
    stored,
)
from precond.torch._optimizer import (
    CheckedOptimizer,
    as_dtype,
    as_shape,
    check_arguments,
    check_lr,
    closure_loss,
    eager_step,
    finite_entries,
    gradient_entries,
    group_defaults,
    scalar,
    seeded_generator,
    working_dtype,
)
from precond.torch._optimizer import (  # re-exported: precond.bench imports it here
    gradients_are_usable as gradients_are_usable,
)
from precond.torch._profiling import profiled_stage
from precond.torch.strategies import Replicated, Strategy

__all__ = ["Kron", "precond_update_prob_schedule"]

# MAX_UPDATE_RMS, BALANCE_PROBABILITY, the update styles and the cache layouts
# come from precond._common.kron_constants, shared with precond.jax.kron.
# Key of kron-torch 0.1.0's param groups holding the momenta (loaded, not kept).
KRON_TORCH_MOMENTA = "momentum_buffer"


def precond_update_prob_schedule(
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: float = 200,
) -> Callable[[int], float]:
    """p(n) = clip(max_prob·exp(−decay·(n − flat_start)), min_prob, max_prob) for
    the 1-based step n, in torch float32 arithmetic.

    The defaults are kron-torch 0.1.0's (p = 1 for 200 steps, then an anneal to
    0.03), and so are the values, bit for bit. With ``flat_start=500`` it is
    :func:`precond.jax.precond_update_prob_schedule` within 2 ulp (torch's and
    XLA's float32 exp round differently), so both frameworks update the
    preconditioner at the same steps (checked to 5000).

    Example:
        >>> schedule = precond_update_prob_schedule()
        >>> [round(float(schedule(n)), 4) for n in (1, 200, 500, 1000)]
        [1.0, 1.0, 0.7408, 0.4493]
    """
    check_update_prob_schedule(max_prob, min_prob, decay, flat_start)
    low = torch.tensor(min_prob, dtype=torch.float32)
    high = torch.tensor(max_prob, dtype=torch.float32)

    def schedule(n: int) -> float:
        exponent = -decay * (torch.tensor(n, dtype=torch.float32) - flat_start)
        prob = torch.minimum(torch.maximum(max_prob * torch.exp(exponent), low), high)
        return prob.item()

    return schedule


_DEFAULT_SCHEDULE = precond_update_prob_schedule()


# memory_save_mode values: precond's plan's, plus kron-torch 0.3.3's 'smart_one_diag'
# (torch only: distributed-kron, and so precond.jax.kron, has no such mode).
TORCH_MEMORY_SAVE_MODES = tuple(dict.fromkeys((*MEMORY_SAVE_MODES, "smart_one_diag")))


def balance_draw(seed: int, step: int) -> float:
    """Uniform [0, 1) draw of step ``step``; the factors are balanced when it is
    below 0.01. A function of (seed, step) only: every rank draws the same. Drawn
    on the CPU, so a GPU step does not wait for it."""
    generator = seeded_generator(torch.device("cpu"), seed, step, -1)
    return float(torch.rand((), generator=generator))


def unit_noise(shape, seed: int, step: int, index: int, dtype, device) -> torch.Tensor:
    """V ~ N(0, I) for parameter ``index`` (its position in the optimizer) at
    ``step``: the same on every rank and however parameters are bucketed."""
    generator = seeded_generator(device, seed, step, index)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)


def _factor_update(compile_kernels: bool) -> Callable:
    """The fit, ``torch.compile``'d if asked: one compile per stack shape, then
    fused code (compiling the preconditioning, batched matmuls, gains nothing)."""
    if compile_kernels:
        return torch.compile(km.update_factors, dynamic=False)
    return km.update_factors


class Kron(CheckedOptimizer):
    """PSGD Kron with kron-torch's arguments, defaults and behaviour.

    The positional arguments and their defaults are kron-torch 0.1.0's; the
    arguments kron-torch 0.3.3 added come next, keyword-only, with defaults that
    keep 0.1.0's behaviour (pass 0.3.3's values to get its rules); precond's own
    options follow. Each step, per parameter, with n its 1-based step count:

    1. m ← β₁m + (1−β₁)g, m̂ = m / (1 − β₁ⁿ).
    2. With probability p(n), fit the factors: with probability 0.01 balance
       their norms, draw V ~ N(0, I), and take one ``update_factors`` step on
       (m̂, V) (plus 2^-11.5·mean|m̂|·V with ``damping=True``).
    3. U = (⊗_i Q_iᴴQ_i)·m̂; then, by ``update_clipping``:
       'norm_and_value' (kron-torch 0.1.0): θ ← θ − lr·clamp(U + λθ, −1, 1),
       elementwise. (kron-torch 0.1.0 also calls ``clip_grad_norm_`` on the
       updates, meaning to bound their global norm by √(number of
       parameters), but that function scales tensors' ``.grad``, which the
       updates do not have: it never scales them, and neither does precond);
       'rms' (kron-torch 0.3.3, precond.jax.kron): U ← U / max(1, RMS(U)/1.1)
       per tensor and θ ← θ − lr·(U + λθ).

    Where precond departs from kron-torch 0.1.0 on purpose, an argument turns
    it back (docs/migrating/kron-torch.md lists them): draws come from a
    generator seeded by (``seed``, n), so every rank and every restored run
    draws the same, and the update decision is a counter (update when 1/p steps
    have passed) — ``seed=None`` draws from torch's global generator in
    kron-torch's order instead; the momentum buffer keeps m, where 0.1.0 stored
    m̂ back into it (``store_debiased_momentum=True``).

    Non-finite and huge gradients, as :func:`precond.jax.kron`: a step in which
    some gradient's squared norm Σ|g|² is not finite in its working precision
    (float32, or float64 for float64 parameters) is *skipped*: no state changes
    (momentum, factors, counters) and no parameter moves except by weight decay.
    That covers NaN and ±Inf entries and finite entries from about 1.8e19 (in
    float32), whose squares overflow and would poison the factors for good. A
    factor fit that still overflows (a large gradient met by large factors)
    keeps the parameter's old factors; the step itself proceeds. Skipped steps
    are counted in :attr:`skipped_steps` (kept in ``param_groups[0]``, so
    checkpoints keep it), and the first is logged at WARNING on the
    ``precond.torch.kron`` logger.

    Complex parameters are supported (Li's PSGD is defined for them): P =
    ⊗ Q_iᴴQ_i is Hermitian, the factors are complex with real positive
    diagonals, and V ~ CN(0, I), in every update style and cache layout.
    Integer parameters are refused. ``None`` gradients are skipped; sparse
    gradients are refused.

    DTensor parameters (FSDP2's ``fully_shard``, torch >= 2.6) work with either
    strategy: each whole gradient is gathered, the factors and momentum are
    fitted on the whole tensor (on every rank, or on the owner only with
    ``ShardedPreconditioning``) and each rank applies its shard's slice of the
    update, so the run is the unsharded one (:mod:`precond.torch._dtensor`).

    Args:
        params: parameters or param groups (every argument below except
            ``seed``, ``strategy`` and ``compile_kernels`` may be set per group).
        lr: learning rate (a float or a one-element tensor).
        b1: momentum β₁ in [0, 1). Each param group also holds it as
            ``momentum``, the name torch's schedulers set (OneCycleLR and
            CyclicLR with ``cycle_momentum=True``); a group may give either,
            and a change to either is what the next step uses.
        weight_decay: weight decay λ on every parameter (see ``update_clipping``
            for where it enters).
        preconditioner_update_probability: a probability in (0, 1], a function
            of the step n, or None for :func:`precond_update_prob_schedule`'s
            default (1 for 200 steps, then annealed to 0.03). A function stored
            in a param group makes ``torch.save`` of the state_dict fail unless
            it is picklable (e.g. defined at module level).
        max_size_triangular: axes longer than this get diagonal factors.
        max_skew_triangular: an axis longer than this times the tensor's second
            largest dim (1 for a vector) gets a diagonal factor: with the
            default 10, biases longer than 10 and tall embeddings are diagonal.
            ``float('inf')`` turns the rule off (precond.jax.kron's planning).
        mu_dtype: momentum dtype (default: the parameter's).
        precond_dtype: factor dtype (default: the parameter's, as kron-torch
            0.1.0). The math runs in at least float32 whatever it is.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors
            (default 1: none; kron-torch 0.3.3 uses 2).
        memory_save_mode: None, 'one_diag' (the largest axis diagonal),
            'smart_one_diag' (it, if strictly the largest) or 'all_diag'.
        momentum_into_precond_update: fit the factors to m̂ (True) or to g.
        precond_lr: step size of the factor updates.
        precond_init_scale: s, with initial factors Q_i = s^(1/k)·I on the k
            axes, so P = s²·I.
        merge_dims: kron-torch 0.3.3's merging: a tensor of 3+ dims is
            preconditioned as a matrix (default False: as 0.1.0, every axis).
        update_clipping: 'norm_and_value' (default, kron-torch 0.1.0) or 'rms'
            (kron-torch 0.3.3 and precond.jax.kron), as in step 3 above.
        store_debiased_momentum: store m̂ back into the momentum buffer, as
            kron-torch 0.1.0 does (default False: the buffer keeps m, so the
            bias correction does not compound from step to step).
        damping: add 2^-11.5·mean|m̂|·V to m̂ before an 'EQ' fit, as
            precond.jax.kron (default False, as kron-torch; the generation-2
            styles always damp, elementwise, as their rules define).
        merge_small_dims: precondition in the shape that merges adjacent axes
            (``precond._common.factor_plan.merge_dims``), as precond.jax.kron.
        target_merged_dim_size: largest dim that ``merge_small_dims`` creates.
        preconditioner_update_style: 'EQ' (the generation-1 rule above),
            'QUAD', 'PRO' or 'QEQ' (generation-2 rules without triangular solves,
            ``_kron_math.update_factors_gen2``; Lipschitz estimates in the
            state), as in :func:`precond.jax.kron`.
        preconditioner_cache: how a triangular factor is stored: None (Q alone,
            kron-torch's layout), 'dense' (Q and the cached P = QᵀQ: twice the
            factor memory; steps without a fit apply P in one matmul per axis
            instead of two) or 'packed' (Q and P in one (d + 1, d) array, about
            Q's memory, as precond.jax.kron's default; unpacking P is an
            elementwise pass over each factor every step, which on a CPU can
            cost more than the matmul it saves). 'PRO' and 'QEQ', whose Q is
            neither triangular nor symmetric, store 'packed' as 'dense'.
        seed: an int seeds the noise and the balancing draws per step (every
            rank draws the same without communicating; a restored run repeats
            them) and the update decision is a deterministic counter. None:
            kron-torch 0.1.0's draws from torch's global generator, in its
            order (a Bernoulli update decision per group and step, always on
            the first step; then per parameter V and, for 2+ dims, the
            balancing draw), so ``torch.manual_seed`` reproduces kron-torch's
            run. With several ranks, None needs the same global seed on each.
        strategy: how ranks share the work (:mod:`precond.torch.strategies`);
            default :class:`~precond.torch.strategies.Replicated`.
        compile_kernels: ``torch.compile`` the factor update (one compile per
            shape of stack, ~4 s each on a CPU; beyond torch._dynamo's recompile
            limit, 8 by default, further shapes run eagerly). See BENCHMARKS.md
            for when it pays off. Inductor has no complex code generation, so
            for complex parameters it only adds compile time.

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> optimizer = Kron(model.parameters(), lr=1e-3)
        >>> model(torch.randn(2, 8)).square().sum().backward()
        >>> optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 0.001,
        b1: float = 0.9,
        weight_decay: float = 0.0,
        preconditioner_update_probability: float | Callable | None = None,
        max_size_triangular: int = 8192,
        max_skew_triangular: float = 10,
        mu_dtype: torch.dtype | None = None,
        precond_dtype: torch.dtype | None = None,
        *,
        min_ndim_triangular: int = 1,
        memory_save_mode: str | None = None,
        momentum_into_precond_update: bool = True,
        precond_lr: float = 0.1,
        precond_init_scale: float = 1.0,
        merge_dims: bool = False,
        update_clipping: str = "norm_and_value",
        store_debiased_momentum: bool = False,
        damping: bool = False,
        merge_small_dims: bool = False,
        target_merged_dim_size: int = 2048,
        preconditioner_update_style: str = "EQ",
        preconditioner_cache: str | None = None,
        seed: int | None = 42,
        strategy: Strategy | None = None,
        compile_kernels: bool = False,
    ):
        check_arguments(locals(), OPTIMIZER_ARGUMENTS)
        defaults = group_defaults(locals(), GROUP_ARGUMENTS)
        self.seed = seed
        self.strategy = strategy or Replicated()
        self.compile_kernels = compile_kernels
        self._update_factors = _factor_update(compile_kernels)
        self._stacks: dict[tuple[int, ...], BucketStacks] = {}  # per bucket
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._update_factors = _factor_update(self.compile_kernels)
        self._stacks = {}

    def _check_param_group(self, group: dict[str, Any]) -> None:
        check_arguments(group, GROUP_ARGUMENTS)
        for p in group["params"]:
            _check_parameter(p)

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = closure_loss(closure)
        self._sync_momentum()
        entries = gradient_entries(self.param_groups, _check_gradient)
        if not entries:
            return loss
        # Whole gradients: a DTensor's is gathered (precond.torch._dtensor).
        full = full_gradients([p for _, p, _ in entries])
        if self._skipped_for_unusable_gradients(entries, full):
            return loss
        grads = {index: g for (_, _, index), g in zip(entries, full, strict=True)}
        draws = None if self.seed is not None else self._global_draws(entries)
        owners = self._owners(entries)
        updates: dict[int, torch.Tensor] = {}
        rank = self.strategy.rank
        mine = [e for e, owner in zip(entries, owners, strict=True) if owner == rank]
        for bucket in buckets(mine, self.state).values():
            self._step_bucket(bucket, updates, draws, grads)
        with profiled_stage("precond/kron/share_updates"):
            shared = self.strategy.share(
                [p for _, p, _ in entries],
                owners,
                [updates.get(i) for _, _, i in entries],
            )
        with profiled_stage("precond/kron/apply_updates"):
            self._apply(entries, shared)
        return loss

    def _owners(self, entries) -> list[int]:
        """The rank that computes each entry's update. The strategy shares out
        all the optimizer's parameters, group by group and the costliest first
        within each, not only this step's with gradients: a parameter whose
        gradient is missing on some steps (a branch a batch did not reach), or
        a group added later (``add_param_group``), moves no other parameter,
        or its state, to another rank."""
        params = [
            (g, group, p)
            for g, group in enumerate(self.param_groups)
            for p in group["params"]
        ]
        costs = [cost(p.shape, group) for _, group, p in params]
        order = sorted(range(len(params)), key=lambda i: (params[i][0], -costs[i], i))
        assigned = self.strategy.assign(
            [params[i][2] for i in order], [costs[i] for i in order]
        )
        owners = dict(zip(order, assigned, strict=True))
        return [owners[index] for _, _, index in entries]

    def _apply(self, entries, updates) -> None:
        """θ ← θ − lr·(clipped update with weight decay), per group's
        ``update_clipping`` (see the class docstring); one ``_foreach`` call per
        stage and group."""
        by_group: dict[int, list] = defaultdict(list)
        for (group, p, _), update in zip(entries, updates, strict=True):
            by_group[id(group)].append((group, p, update))
        for members in by_group.values():
            group = members[0][0]
            lr, decay = scalar(group["lr"]), group["weight_decay"]
            if group["update_clipping"] == "rms":
                local = [local_value(p) for _, p, _ in members]
                torch._foreach_mul_(  # pyright: ignore[reportPrivateImportUsage]
                    local, 1 - lr * decay
                )
                _foreach_add_to_params(members, [u for _, _, u in members], -lr)
            else:
                self._apply_norm_and_value_clipped(members, lr, decay)

    def _apply_norm_and_value_clipped(self, members, lr: float, decay: float) -> None:
        """kron-torch 0.1.0's rule as it runs: each entry of the updates U + λθ
        clamped to [-1, 1] (on the whole tensors: a DTensor θ is gathered for
        the decay term). Its global norm clip is a no-op (class docstring)."""
        steps = [update for _, _, update in members]
        if decay != 0:
            steps = torch._foreach_add(  # pyright: ignore[reportPrivateImportUsage]
                steps,
                [as_dtype(full_value(p), u.dtype) for (_, p, u) in members],
                alpha=decay,
            )
        # Complex entries: the real and imaginary parts each.
        real = [torch.view_as_real(u) if u.is_complex() else u for u in steps]
        torch._foreach_clamp_min_(real, -1.0)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_clamp_max_(real, 1.0)  # pyright: ignore[reportPrivateImportUsage]
        _foreach_add_to_params(members, steps, -lr)

    def _global_draws(self, entries) -> dict[int, tuple]:
        """``seed=None``: kron-torch 0.1.0's draws from torch's global generator,
        in its order. Per group: u ~ U[0, 1), update when u < p(n) or the
        factors are yet to be made;
        then, on an update, per parameter V ~ N(0, I) in the factor dtype and,
        for 2+ dims, a balancing draw. Returns {index: (update, V, balance)}."""
        present = {index: (group, p) for group, p, index in entries}
        draws: dict[int, tuple] = {}
        index = 0
        for group in self.param_groups:
            indices = range(index, index + len(group["params"]))
            index += len(group["params"])
            mine = [i for i in indices if i in present]
            if not mine:
                continue
            first = present[mine[0]][1]
            n = self.state[first].get(STEP, 0) + 1
            probability = _probability(group, n)
            # Always on the first step, as kron-torch creates its factors then
            # (also a resumed run's first step: 0.1.0 saves no factors).
            update = (
                bool(torch.rand([]) < probability) or FACTORS not in (self.state[first])
            )
            for i, p in zip(indices, group["params"], strict=True):
                noise = balance = None
                if update:
                    dtype, _ = state_dtypes(p, group)
                    noise = torch.randn(p.shape, dtype=dtype, device=p.device)
                    balance = p.ndim > 1 and bool(torch.rand([]) < BALANCE_PROBABILITY)
                draws[i] = (update, noise, balance)
        return draws

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state; factors, momenta and Lipschitz estimates keep their
        saved values and dtypes (torch would cast them to the parameter's dtype,
        e.g. float32 factors of a bfloat16 weight to bfloat16).

        A state that does not fit the parameters (another model's checkpoint:
        other groups, shapes or factor structure, complex for real, missing
        keys) is refused with a ``ValueError`` naming the first mismatching
        entry, and nothing is changed.

        A kron-torch 0.1.0 state dict (its momentum buffers and step count kept
        in the param groups, no factors) loads too: each parameter gets its
        momentum and step, and fresh factors at its next step, as a resumed
        kron-torch run re-creates them. Hyperparameters that a saved group
        lacks (one saved before an argument existed) take this optimizer's
        defaults.
        """
        self._check_state_dict(state_dict)
        self._load_keeping_dtypes(state_dict, (FACTORS, MOMENTUM, LIPSCHITZ))
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            if KRON_TORCH_MOMENTA in group:
                self._load_kron_torch_group(group)

    def _load_kron_torch_group(self, group: dict[str, Any]) -> None:
        """A kron-torch 0.1.0 group's momenta and step count into each parameter's
        state (its factors are made fresh at the next step)."""
        momenta = group.pop(KRON_TORCH_MOMENTA)
        step = group.pop(STEP, 0)
        for p, m in zip(group["params"], momenta, strict=True):
            _, mu_dtype = state_dtypes(p, group)
            self.state[p] = {
                STEP: step,
                UPDATE_COUNTER: 0,
                MOMENTUM: m.to(device=p.device, dtype=mu_dtype, copy=True),
            }

    def _check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises ValueError at the first entry of ``state_dict`` that does not
        fit this optimizer's parameters (checked against the saved groups'
        hyperparameters, which the load will install)."""
        problem = state_dict_problem(self.param_groups, state_dict)
        if problem:
            raise ValueError(
                f"Invalid state_dict: {problem} (is it another model's or "
                "optimizer's checkpoint?)"
            )

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if FACTORS in state:
            return state
        _, mu_dtype = state_dtypes(p, group)
        state.setdefault(STEP, 0)  # kept from a kron-torch 0.1.0 state dict
        state.setdefault(UPDATE_COUNTER, 0)
        if MOMENTUM not in state and is_dtensor(p):  # whole, as the gradient
            state[MOMENTUM] = torch.zeros(p.shape, dtype=mu_dtype, device=p.device)
        elif MOMENTUM not in state:
            state[MOMENTUM] = torch.zeros_like(
                p, dtype=mu_dtype, memory_format=torch.preserve_format
            )
        state[FACTORS] = initial_factors(p, group)
        if generation_2(group):
            state[LIPSCHITZ] = [
                torch.zeros((), dtype=torch.float32, device=p.device)
                for _ in state[FACTORS]
            ]
        return state

    def _step_bucket(
        self,
        bucket,
        updates: dict[int, torch.Tensor],
        draws: dict | None,
        grads: dict[int, torch.Tensor],
    ) -> None:
        """Momentum, fit and preconditioned update of equal-shaped parameters;
        ``draws`` holds ``seed=None``'s draws (:meth:`_global_draws`), ``grads``
        the whole gradients by parameter index."""
        group = bucket[0][0]
        states = [self._init_state(p, g) for g, p, _ in bucket]
        stacks = bucket_stacks(self._stacks, states)
        shape, _ = factor_plan(bucket[0][1].shape, group)
        dtype = working_dtype(stacks.factors[0].dtype)
        with profiled_stage("precond/kron/momentum"):
            mu_hat = _momentum_step(
                bucket, states, stacks.momentum, shape, dtype, grads
            )
        stored_factors = [as_dtype(F, dtype) for F in stacks.factors]
        if _update_due(bucket, states, draws):
            with profiled_stage("precond/kron/update_factors"):
                stored_factors = self._fit(
                    bucket, states, stacks, stored_factors, mu_hat, draws, grads
                )
        with profiled_stage("precond/kron/precondition"):
            U = _preconditioned(stored_factors, mu_hat, group)
        for (_, p, index), u in zip(bucket, U, strict=True):
            updates[index] = as_shape(u, p.shape)

    def _fit(self, bucket, states, stacks, stored_factors, mu_hat, draws, grads):
        """One factor fit of a bucket (with its balancing and noise draws); a
        stack entry whose fit overflows keeps its old factors. Returns the new
        state arrays, also written into the bucket's ``stacks``."""
        group = bucket[0][0]
        cache, style = cache_layout(group), group["preconditioner_update_style"]
        factors = [factor_of(F, cache, style) for F in stored_factors]
        if draws is None:
            factors, noise = self._seeded_randomness(bucket, states, factors, mu_hat)
        else:
            factors, noise = _global_randomness(bucket, factors, mu_hat, draws)
        target = mu_hat
        if not group["momentum_into_precond_update"]:
            bucket_grads = [grads[index] for _, _, index in bucket]
            target = _stacked(bucket_grads, mu_hat.dtype, mu_hat.shape[1:])
        lipschitz = []
        if not generation_2(group):
            if group["damping"]:
                target = km.add_damping_noise(target, noise)
            factors = self._update_factors(factors, target, noise, group["precond_lr"])
        else:
            factors, lipschitz = _fit_gen2(
                group, states, factors, target, noise, mu_hat
            )
        factor_dtype = stacks.factors[0].dtype
        new = [as_dtype(stored(Q, cache, factor_dtype), mu_hat.dtype) for Q in factors]
        return _keep_finite_fits(states, stacks, new, lipschitz)

    def _seeded_randomness(self, bucket, states, factors, mu_hat):
        """(factors, V) of a seeded fit: the factors balanced when the step's
        :func:`balance_draw` is below 0.01, V from :func:`unit_noise`."""
        seed = cast(int, self.seed)  # draws are None (this path) only with a seed
        step = states[0][STEP]
        if balance_draw(seed, step) < BALANCE_PROBABILITY:
            factors = km.balance_factors(factors)
        shape, dtype, device = mu_hat.shape[1:], mu_hat.dtype, mu_hat.device
        noise = torch.stack(
            [
                unit_noise(shape, seed, step, index, dtype, device)
                for _, _, index in bucket
            ]
        )
        return factors, noise


def _foreach_add_to_params(members, steps, alpha: float) -> None:
    """θ ← θ + alpha·step for each (group, θ, _) of ``members`` (on this rank's
    shard of a DTensor θ), in θ's dtype."""
    torch._foreach_add_(  # pyright: ignore[reportPrivateImportUsage]
        [local_value(p) for _, p, _ in members],
        [
            as_dtype(local_part(p, u), p.dtype)
            for (_, p, _), u in zip(members, steps, strict=True)
        ],
        alpha=alpha,
    )


def _stacked(tensors, dtype: torch.dtype, shape) -> torch.Tensor:
    """The tensors in ``dtype``, each reshaped to ``shape``, stacked: (B, *shape)."""
    return torch.stack([as_shape(as_dtype(t, dtype), shape) for t in tensors])


def _momentum_step(
    bucket,
    states,
    momenta: torch.Tensor,
    shape,
    dtype: torch.dtype,
    all_grads: dict[int, torch.Tensor],
) -> torch.Tensor:
    """Counts the step and updates the bucket's stack of momenta,
    m ← β₁m + (1−β₁)g; returns the stack of m̂ = m/(1−β₁ⁿ) (of g when β₁ = 0) in
    ``dtype`` and ``shape``. With ``store_debiased_momentum`` (kron-torch
    0.1.0), m ← m̂."""
    group = bucket[0][0]
    b1 = group["b1"]
    for state in states:
        state[STEP] += 1
    # Each state's momentum is its entry's view of ``momenta``: one fused
    # call updates the stack without first copying the gradients into one.
    grads = [
        as_shape(as_dtype(all_grads[index], momenta.dtype), momenta.shape[1:])
        for _, _, index in bucket
    ]
    torch._foreach_lerp_(  # pyright: ignore[reportPrivateImportUsage]
        [state[MOMENTUM] for state in states], grads, 1 - b1
    )
    # With β₁ = 0 the lerp set m = g exactly, and m̂ = m/1.
    correction = 1 - b1 ** states[0][STEP] if b1 > 0 else 1.0
    stacked_shape = (len(bucket), *shape)
    mu_hat = as_dtype(as_shape(momenta, stacked_shape), dtype) / correction
    if group["store_debiased_momentum"]:
        momenta.copy_(mu_hat.reshape(momenta.shape))
    return mu_hat


def _update_due(bucket, states, draws: dict | None) -> bool:
    """Counts the steps since the last fit; whether the factors are fitted this
    step: once 1/p(n) steps have passed (a seed), or by ``seed=None``'s draw. A
    due fit resets the count."""
    for state in states:
        state[UPDATE_COUNTER] += 1
    if draws is None:
        probability = _probability(bucket[0][0], states[0][STEP])
        update = states[0][UPDATE_COUNTER] >= 1.0 / np.float32(probability)
    else:
        update = draws[bucket[0][2]][0]
    if update:
        for state in states:
            state[UPDATE_COUNTER] = 0
    return bool(update)


def _global_randomness(bucket, factors, mu_hat, draws: dict):
    """(factors, V) of a ``seed=None`` fit from :meth:`Kron._global_draws`: the
    factors of the parameters whose balancing draw came up are balanced."""
    chosen = torch.tensor(
        [draws[index][2] for _, _, index in bucket], device=mu_hat.device
    )
    if chosen.any():
        balanced = km.balance_factors(factors)
        factors = [
            torch.where(km._expand(chosen, Q), B, Q)
            for Q, B in zip(factors, balanced, strict=True)
        ]
    shape = mu_hat.shape[1:]
    noise = torch.stack(
        [draws[index][1].to(mu_hat.dtype).reshape(shape) for _, _, index in bucket]
    )
    return factors, noise


def _fit_gen2(group, states, factors, target, noise, mu_hat):
    """One 'QUAD', 'PRO' or 'QEQ' fit (``update_factors_gen2``) to the target with
    relative damping noise, towards whitening targets; returns (factors,
    stacked Lipschitz estimates)."""
    lipschitz = [
        torch.stack([s[LIPSCHITZ][axis] for s in states])
        for axis in range(len(factors))
    ]
    valid = [
        torch.ones(d, dtype=torch.bool, device=mu_hat.device) for d in mu_hat.shape[1:]
    ]
    targets = km.whitening_targets(valid, [km.is_diagonal(Q) for Q in factors])
    return km.update_factors_gen2(
        factors,
        lipschitz,
        km.add_relative_damping_noise(target, noise),
        targets,
        group["precond_lr"],
        group["preconditioner_update_style"],
    )


def _keep_finite_fits(states, stacks, new, lipschitz) -> list[torch.Tensor]:
    """The fitted state arrays, but for a stack entry whose fit overflowed (a
    usable but large gradient met by large factors), which keeps its old ones:
    decided on the device, without a host sync. Selected in place into the
    bucket's ``stacks`` (the factors) and ``states`` (the Lipschitz estimates);
    returns the factors in ``new``'s (working) dtype."""
    fitted = finite_entries(new + lipschitz)
    for stack, F in zip(stacks.factors, new, strict=True):
        # F holds values of the stack's dtype (``stored``): its cast is exact.
        F_stored = as_dtype(F, stack.dtype)
        torch.where(km._expand(fitted, F_stored), F_stored, stack, out=stack)
    for i, state in enumerate(states):
        for axis, L in enumerate(lipschitz):
            estimate = state[LIPSCHITZ][axis]
            estimate.copy_(torch.where(fitted[i], L[i], estimate))
    return [
        as_dtype(stack, F.dtype) for stack, F in zip(stacks.factors, new, strict=True)
    ]


def _preconditioned(stored_factors, mu_hat, group) -> torch.Tensor:
    """U = (⊗_i Q_iᴴQ_i)·m̂ for the stack (with the cached P_i = Q_iᴴQ_i where
    the layout keeps them); with ``update_clipping='rms'``, U / max(1, RMS/1.1)
    per tensor."""
    cache = cache_layout(group)
    if cache is None:
        U = km.precondition(stored_factors, mu_hat)
    else:  # U = G ×_1 P_1 … ×_k P_k
        U = km.apply_along_axes([gram_of(F, cache) for F in stored_factors], mu_hat)
    if group["update_clipping"] == "rms":
        squares = U.abs().square() if U.is_complex() else U.square()
        rms = squares.reshape(U.shape[0], -1).mean(dim=1).sqrt()
        U = U / torch.clamp(rms / MAX_UPDATE_RMS, min=1.0).reshape(
            (-1,) + (1,) * (U.ndim - 1)
        )
    return U


def _probability(group: dict[str, Any], step: int) -> float:
    """The group's preconditioner update probability at the 1-based ``step``."""
    probability: float | Callable[[int], float] | None = group[
        "preconditioner_update_probability"
    ]
    if probability is None:
        probability = _DEFAULT_SCHEDULE
    if callable(probability):
        probability = probability(step)
    return probability


def _check_probability(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        check_real(name, value, low=0.0, high=1.0, low_inclusive=False)


def _check_dtype(name: str, value: Any) -> None:
    if value is not None and not (
        isinstance(value, torch.dtype) and value.is_floating_point
    ):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a floating torch.dtype"
        )


def _check_skew(name: str, value: Any) -> None:
    if value != float("inf"):
        check_real(name, value, low=0.0)


# The update clippings of ``Kron(update_clipping=...)``.
UPDATE_CLIPPINGS = ("norm_and_value", "rms")


def _check_seed(name: str, value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral)
    ):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None (torch's global generator) or "
            "a Python int"
        )


def _check_strategy(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, Strategy):
        raise TypeError(
            f"Invalid {name}={value!r}: must be None or a precond.torch.Strategy "
            "(Replicated() or ShardedPreconditioning())"
        )


# The optimizer-wide arguments (not per group) and their checks.
OPTIMIZER_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("seed", _check_seed),
    ("strategy", _check_strategy),
    ("compile_kernels", check_bool),
)

# Every per-group argument and its check: (name, check(name, value)), in the
# signature's order (which is the order of ``defaults``). The arguments that
# precond.jax.kron takes under the same name and rule are checked by
# precond._common.kron_arguments; the rest are kron-torch's own and checked here:
# lr and weight_decay (the alias's in JAX), a probability in (0, 1] or None for
# the default schedule (JAX: a schedule or [0, 1]), kron-torch's precond_lr and
# precond_init_scale (distributed-kron's preconditioner_lr / _init_scale),
# torch dtypes, memory_save_mode with kron-torch 0.3.3's 'smart_one_diag', and
# the kron-torch rules JAX lacks (max_skew_triangular, merge_dims,
# update_clipping, store_debiased_momentum, damping).
_SHARED = KRON_SHARED_ARGUMENT_CHECKS
GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", check_lr),
    ("b1", _SHARED["b1"]),
    ("weight_decay", lambda n, v: check_real(n, v, low=0.0)),
    ("preconditioner_update_probability", _check_probability),
    ("max_size_triangular", _SHARED["max_size_triangular"]),
    ("max_skew_triangular", _check_skew),
    ("mu_dtype", _check_dtype),
    ("precond_dtype", _check_dtype),
    ("min_ndim_triangular", _SHARED["min_ndim_triangular"]),
    ("memory_save_mode", lambda n, v: check_choice(n, v, TORCH_MEMORY_SAVE_MODES)),
    ("momentum_into_precond_update", _SHARED["momentum_into_precond_update"]),
    ("precond_lr", lambda n, v: check_real(n, v, low=0.0)),
    ("precond_init_scale", lambda n, v: check_real(n, v, low=0.0, low_inclusive=False)),
    ("merge_dims", check_bool),
    ("update_clipping", lambda n, v: check_choice(n, v, UPDATE_CLIPPINGS)),
    ("store_debiased_momentum", check_bool),
    ("damping", check_bool),
    ("merge_small_dims", _SHARED["merge_small_dims"]),
    ("target_merged_dim_size", _SHARED["target_merged_dim_size"]),
    ("preconditioner_update_style", _SHARED["preconditioner_update_style"]),
    ("preconditioner_cache", _SHARED["preconditioner_cache"]),
)


def _check_parameter(p: torch.Tensor) -> None:
    check_dtensor_parameter(p, "precond.torch.Kron")
    if not (p.is_floating_point() or p.is_complex()):
        raise TypeError(
            f"Invalid parameter of dtype {p.dtype}: Kron supports floating and "
            "complex parameters"
        )


def _check_gradient(p: torch.Tensor) -> None:
    grad = p.grad
    if grad is None:  # gradient_entries checks only parameters with a gradient
        return
    if grad.is_sparse:
        raise RuntimeError(
            "Kron does not support sparse gradients (e.g. nn.Embedding(sparse=True))"
        )
    if grad.is_complex() != p.is_complex():
        raise RuntimeError(
            f"Kron got a gradient of dtype {grad.dtype} for a parameter of dtype "
            f"{p.dtype}"
        )
