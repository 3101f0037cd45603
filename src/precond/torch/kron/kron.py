"""PSGD Kron as a ``torch.optim.Optimizer``: drop-in for ``kron_torch.Kron``.

The same generation-1 algorithm as :func:`precond.jax.kron` (kernels in
``precond.torch._core.factor_kernels``): each parameter's preconditioner is
P = ⊗_i Q_iᵀQ_i, one triangular or diagonal factor per axis, fitted online so
that P·m̂ is whitened (Li 2018, arXiv:1809.10232; Li 2024, arXiv:2402.11858).
Parameters of equal shape and factor structure form a bucket whose factors and
momenta are kept in (B, ...) stacks (``_kron_state.BucketStacks``; each
parameter's ``state`` entries are views of them), so that one batched call fits
or applies all of their factors without copying them into a batch each step
(``_kron_step``).

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
``precond.torch`` logger.

Complex parameters are supported (Li's PSGD is defined for them): P =
⊗ Q_iᴴQ_i is Hermitian, the factors are complex with real positive
diagonals, and V ~ CN(0, I), in every update style and cache layout.
Integer parameters are refused. ``None`` gradients are skipped; sparse
gradients are refused.

DTensor parameters (FSDP2's ``fully_shard``, torch >= 2.6) work with either
strategy: each whole gradient is gathered, the factors and momentum are
fitted on the whole tensor (on every rank, or on the owner only with
``ShardedPreconditioning``) and each rank applies its shard's slice of the
update, so the run is the unsharded one (:mod:`precond.torch._core.dtensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from precond.torch._core import factor_kernels as km
from precond.torch._core.dtensor import is_dtensor
from precond.torch._core.optimizer import (
    check_arguments,
    closure_loss,
    eager_step,
    group_defaults,
)
from precond.torch._core.profiling import profiled_stage
from precond.torch._core.tensors import as_dtype, as_shape, working_dtype
from precond.torch.kron import _kron_randomness as randomness
from precond.torch.kron._kron_arguments import (
    GROUP_ARGUMENTS,
    OPTIMIZER_ARGUMENTS,
    check_gradient,
    check_parameter,
)
from precond.torch.kron._kron_checkpoint import KronCheckpointing
from precond.torch.kron._kron_state import (
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
    initial_factors,
    state_dtypes,
    stored,
)
from precond.torch.kron._kron_step import (
    apply_updates,
    factor_update,
    fit_gen2,
    keep_finite_fits,
    momentum_step,
    preconditioned,
    stacked,
    update_due,
)
from precond.torch.kron.strategies import Replicated, Strategy, owners_of

__all__ = ["Kron"]


class Kron(KronCheckpointing):
    """PSGD Kron with kron-torch's arguments, defaults and behaviour.

    Each step, per parameter: the momentum m̂ (bias-corrected); with
    probability p(n) a fit of the Kronecker factors Q_i to m̂; the update
    U = (⊗_i Q_iᴴQ_i)·m̂, clipped by ``update_clipping``; θ ← θ − lr·(U + λθ).
    The positional arguments and their defaults are kron-torch 0.1.0's, the
    keyword-only ones that kron-torch 0.3.3 added keep 0.1.0's behaviour by
    default, and precond's own options follow. A step with a NaN, ±Inf or
    overflowing gradient is skipped (:attr:`skipped_steps`). The algorithm,
    the departures from kron-torch and the handling of non-finite gradients,
    complex and DTensor parameters: :mod:`precond.torch.kron.kron`.

    Args:
        params: parameters or param groups (every argument below except
            ``seed``, ``strategy`` and ``compile_kernels`` may be set per group).
        lr: learning rate (a float or a one-element tensor).
        b1: momentum β₁ in [0, 1). Each param group also holds it as
            ``momentum``, the name torch's schedulers set (OneCycleLR and
            CyclicLR with ``cycle_momentum=True``); a group may give either,
            and a change to either is what the next step uses.
        weight_decay: weight decay λ on every parameter (``update_clipping``
            says where it enters).
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
        update_clipping: 'norm_and_value' (default, kron-torch 0.1.0):
            θ ← θ − lr·clamp(U + λθ, −1, 1) elementwise; or 'rms' (kron-torch
            0.3.3, precond.jax.kron): U ← U / max(1, RMS(U)/1.1) per tensor and
            θ ← θ − lr·(U + λθ).
        store_debiased_momentum: store m̂ back into the momentum buffer, as
            kron-torch 0.1.0 does (default False: the buffer keeps m, so the
            bias correction does not compound from step to step).
        damping: add 2^-11.5·mean|m̂|·V to m̂ before an 'EQ' fit, as
            precond.jax.kron (default False, as kron-torch; the generation-2
            styles always damp, elementwise, as their rules define).
        merge_small_dims: precondition in the shape that merges adjacent axes
            (``precond._common.factor_plan.merge_dims``), as precond.jax.kron.
        target_merged_dim_size: largest dim that ``merge_small_dims`` creates.
        preconditioner_update_style: 'EQ' (the generation-1 rule),
            'QUAD', 'PRO' or 'QEQ' (generation-2 rules without triangular solves,
            ``factor_kernels.update_factors_gen2``; Lipschitz estimates in the
            state), as in :func:`precond.jax.kron`.
        preconditioner_cache: how a triangular factor is stored: None (Q alone,
            kron-torch's layout), 'dense' (Q and the cached P = QᵀQ: twice the
            memory, one matmul per axis instead of two on steps without a fit)
            or 'packed' (Q and P in one (d + 1, d) array, precond.jax.kron's
            default; unpacked every step, which on a CPU can cost more than it
            saves). 'PRO' and 'QEQ' store 'packed' as 'dense'.
        seed: an int seeds the noise and the balancing draws per step (every
            rank draws the same; a restored run repeats them) and the update
            decision is a deterministic counter. None: kron-torch 0.1.0's draws
            from torch's global generator, in its order, so
            ``torch.manual_seed`` reproduces kron-torch's run (with several
            ranks, the same global seed on each).
        strategy: how ranks share the work (:mod:`precond.torch.kron.strategies`);
            default :class:`~precond.torch.kron.strategies.Replicated`.
        compile_kernels: ``torch.compile`` the factor update (one compile per
            shape of stack, ~4 s each on a CPU; past torch._dynamo's recompile
            limit further shapes run eagerly; no gain for complex parameters).
            See BENCHMARKS.md for when it pays off.

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
        self._update_factors = factor_update(compile_kernels)
        self._stacks: dict[tuple[int, ...], BucketStacks] = {}  # per bucket
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._update_factors = factor_update(self.compile_kernels)
        self._stacks = {}

    def _check_param_group(self, group: dict[str, Any]) -> None:
        check_arguments(group, GROUP_ARGUMENTS)
        for p in group["params"]:
            check_parameter(p)

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = closure_loss(closure)
        self._sync_momentum()
        usable = self._usable_entries(check_gradient)
        if usable is None:
            return loss
        entries, full = usable
        grads = {index: g for (_, _, index), g in zip(entries, full, strict=True)}
        draws = (
            None
            if self.seed is not None
            else randomness.global_draws(self.param_groups, self.state, entries)
        )
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
            apply_updates(entries, shared)
        return loss

    def _owners(self, entries) -> list[int]:
        """The rank that computes each entry's update (:func:`owners_of`)."""
        return owners_of(
            self.strategy, self.param_groups, entries, lambda p, g: cost(p.shape, g)
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
        ``draws`` holds ``seed=None``'s draws (``randomness.global_draws``),
        ``grads`` the whole gradients by parameter index."""
        group = bucket[0][0]
        states = [self._init_state(p, g) for g, p, _ in bucket]
        stacks = bucket_stacks(self._stacks, states)
        shape, _ = factor_plan(bucket[0][1].shape, group)
        dtype = working_dtype(stacks.factors[0].dtype)
        with profiled_stage("precond/kron/momentum"):
            mu_hat = momentum_step(bucket, states, stacks.momentum, shape, dtype, grads)
        stored_factors = [as_dtype(F, dtype) for F in stacks.factors]
        if update_due(bucket, states, draws):
            with profiled_stage("precond/kron/update_factors"):
                stored_factors = self._fit(
                    bucket, states, stacks, stored_factors, mu_hat, draws, grads
                )
        with profiled_stage("precond/kron/precondition"):
            U = preconditioned(stored_factors, mu_hat, group)
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
            seed = cast(int, self.seed)  # draws are None only with a seed
            factors, noise = randomness.seeded_randomness(
                seed, bucket, states, factors, mu_hat
            )
        else:
            factors, noise = randomness.global_randomness(
                bucket, factors, mu_hat, draws
            )
        target = mu_hat
        if not group["momentum_into_precond_update"]:
            bucket_grads = [grads[index] for _, _, index in bucket]
            target = stacked(bucket_grads, mu_hat.dtype, mu_hat.shape[1:])
        lipschitz = []
        if not generation_2(group):
            if group["damping"]:
                target = km.add_damping_noise(target, noise)
            factors = self._update_factors(factors, target, noise, group["precond_lr"])
        else:
            factors, lipschitz = fit_gen2(group, states, factors, target, noise, mu_hat)
        factor_dtype = stacks.factors[0].dtype
        new = [as_dtype(stored(Q, cache, factor_dtype), mu_hat.dtype) for Q in factors]
        return keep_finite_fits(states, stacks, new, lipschitz)
