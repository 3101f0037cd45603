"""PSGD Kron as a ``torch.optim.Optimizer``: drop-in for ``kron_torch.Kron``.

The same generation-1 algorithm as :func:`precond.jax.kron` (kernels in
``precond.torch._kron_math``): each parameter's preconditioner is
P = ⊗_i Q_iᵀQ_i, one triangular or diagonal factor per axis, fitted online so
that P·m̂ is whitened (Li 2018, arXiv:1809.10232; Li 2024, arXiv:2402.11858).
Parameters of equal shape and factor structure are stacked so that one batched
call fits or applies all of their factors.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from precond._common.factor_plan import (
    MEMORY_SAVE_MODES,
    merge_dims,
    plan_diagonal_axes,
)
from precond._common.schedules import check_update_prob_schedule
from precond._common.validation import (
    check_bool,
    check_choice,
    check_int,
    check_real,
)
from precond.torch import _kron_math as km
from precond.torch.strategies import Replicated, Strategy

__all__ = ["Kron", "precond_update_prob_schedule"]

# Updates are scaled down so their per-tensor RMS is at most this.
MAX_UPDATE_RMS = 1.1
# Probability that a preconditioner update first rebalances the factor norms.
BALANCE_PROBABILITY = 0.01
# Keys of self.state[p].
STEP, UPDATE_COUNTER, MOMENTUM, FACTORS = "step", "update_counter", "momentum", "Q"
LIPSCHITZ = "lipschitz"  # generation-2 styles: per axis, a float32 scalar
# Layouts of a triangular factor's state: Q with P = QᵀQ packed into one (d + 1, d)
# array, Q and P stacked (2, d, d), or Q alone (d, d); as precond.jax.kron.
PRECONDITIONER_CACHES = ("packed", "dense", None)


def precond_update_prob_schedule(
    max_prob: float = 1.0,
    min_prob: float = 0.03,
    decay: float = 0.001,
    flat_start: float = 500,
) -> Callable[[int], float]:
    """p(n) = clip(max_prob·exp(−decay·(n − flat_start)), min_prob, max_prob) for
    the 1-based step n, in float32 like :func:`precond.jax.precond_update_prob_schedule`
    (within 2 ulp of it: NumPy's and XLA's exp round differently), so both
    frameworks update the preconditioner at the same steps (checked to 20000)."""
    check_update_prob_schedule(max_prob, min_prob, decay, flat_start)

    def schedule(n: int) -> float:
        exponent = np.float32(-decay) * (np.float32(n) - np.float32(flat_start))
        prob = np.float32(max_prob) * np.exp(exponent, dtype=np.float32)
        return float(np.clip(prob, np.float32(min_prob), np.float32(max_prob)))

    return schedule


_DEFAULT_SCHEDULE = precond_update_prob_schedule()


def _plan(
    shape: tuple[int, ...], group: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(merged shape, diagonal per axis) of a parameter, as precond.jax.kron plans
    it (scalars become (1,)), plus kron-torch's ``max_skew_triangular`` rule."""
    shape = tuple(shape) or (1,)
    diagonal = plan_diagonal_axes(
        shape,
        max_size_triangular=group["max_size_triangular"],
        min_ndim_triangular=group["min_ndim_triangular"],
        memory_save_mode=group["memory_save_mode"],
    )
    numel = math.prod(shape)
    skew = group["max_skew_triangular"]
    diagonal = tuple(
        diag or (len(shape) > 1 and d > skew * (numel // d))
        for d, diag in zip(shape, diagonal, strict=True)
    )
    if group["merge_small_dims"]:
        groups = merge_dims(shape, group["target_merged_dim_size"])
        merged = tuple(math.prod(shape[a] for a in g) for g in groups)
        diagonal = tuple(
            all(diagonal[a] for a in g) or size > group["max_size_triangular"]
            for g, size in zip(groups, merged, strict=True)
        )
        shape = merged
    return shape, diagonal


def _generator(device: torch.device, *seeds: int) -> torch.Generator:
    """A generator seeded from integers: the same draws on every rank."""
    generator = torch.Generator(device=device)
    generator.manual_seed(hash(seeds) % (2**63))
    return generator


def balance_draw(seed: int, step: int) -> float:
    """Uniform [0, 1) draw of step ``step``; the factors are balanced when it is
    below 0.01. A function of (seed, step) only: every rank draws the same. Drawn
    on the CPU, so a GPU step does not wait for it."""
    generator = _generator(torch.device("cpu"), seed, step, -1)
    return float(torch.rand((), generator=generator))


def _working_view(g: torch.Tensor) -> torch.Tensor:
    """``g`` flattened in its working precision (float32, or float64 for float64
    and complex128), complex entries as (real, imaginary) pairs."""
    if g.is_complex():
        wide = g.dtype == torch.complex128
        return torch.view_as_real(g if wide else g.to(torch.complex64)).reshape(-1)
    return (g if g.dtype == torch.float64 else g.to(torch.float32)).reshape(-1)


def gradients_are_usable(grads: list[torch.Tensor]) -> bool:
    """True when every gradient's squared norm Σ|g|² is finite in its working
    precision (float32, or float64 for float64/complex128 gradients): False for
    NaN and ±Inf entries, and for finite entries so large (≳ 1.8e19 in float32)
    that their squares overflow, as :func:`precond.jax.kron`'s guard. One dot
    product per gradient, one host sync per step."""
    return bool(
        torch.stack(
            [torch.isfinite(torch.dot(x, x)) for x in map(_working_view, grads)]
        ).all()
    )


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    """The complex dtype of at least ``dtype``'s precision (complex64 at least)."""
    if dtype in (torch.float64, torch.complex128):
        return torch.complex128
    return torch.complex64


def unit_noise(shape, seed: int, step: int, index: int, dtype, device) -> torch.Tensor:
    """V ~ N(0, I) for parameter ``index`` (its position in the optimizer) at
    ``step``: the same on every rank and however parameters are bucketed."""
    generator = _generator(device, seed, step, index)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)


def _factor_update(compile_kernels: bool) -> Callable:
    """The fit, ``torch.compile``'d if asked: one compile per stack shape, then
    fused code (compiling the preconditioning, batched matmuls, gains nothing)."""
    if compile_kernels:
        return torch.compile(km.update_factors, dynamic=False)
    return km.update_factors


class Kron(torch.optim.Optimizer):
    """PSGD Kron with kron-torch's arguments and defaults.

    Each step, with n the parameter's 1-based step count:

    1. m ← β₁m + (1−β₁)g, m̂ = m / (1 − β₁ⁿ).
    2. With probability p(n) (a deterministic counter: update when 1/p steps
       have passed since the last update), fit the factors: with probability
       0.01 balance their norms, draw V ~ N(0, I), and take one
       ``update_factors`` step on (m̂ + 2^-11.5·mean|m̂|·V, V).
    3. U = (⊗_i Q_iᵀQ_i)·m̂, U ← U / max(1, RMS(U)/1.1), θ ← θ − lr·(U + λθ).

    Non-finite and huge gradients, as :func:`precond.jax.kron`: a step in which
    some gradient's squared norm Σ|g|² is not finite in its working precision
    (float32, or float64 for float64 parameters) is *skipped*: no state changes
    (momentum, factors, counters) and no parameter moves except by weight decay.
    That covers NaN and ±Inf entries and finite entries from about 1.8e19 (in
    float32), whose squares overflow and would poison the factors for good. A
    factor fit that still overflows (a large gradient met by large factors)
    keeps the parameter's old factors; the step itself proceeds.

    Complex parameters are supported (Li's PSGD is defined for them): P =
    ⊗ Q_iᴴQ_i is Hermitian, the factors are complex (complex64, or complex128
    for float64/complex128 factors) with real positive diagonals, and
    V ~ CN(0, I), in every update style and cache layout. Integer parameters
    are refused. ``None`` gradients are skipped; sparse gradients
    are refused.

    Args:
        params: parameters or param groups (every argument below except
            ``seed`` and ``strategy`` may be set per group).
        lr: learning rate.
        b1: momentum β₁ in [0, 1).
        weight_decay: decoupled weight decay λ (all parameters).
        preconditioner_update_probability: a probability, a function of the
            step n, or None for :func:`precond_update_prob_schedule`'s default
            (a function stored in a param group makes ``torch.save`` of the
            state_dict fail unless it is picklable, e.g. defined at module level).
        max_size_triangular: axes longer than this get diagonal factors.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors.
        memory_save_mode: None, 'one_diag' or 'all_diag'.
        momentum_into_precond_update: fit the factors to m̂ (True) or to g.
        precond_lr: step size of the factor updates.
        precond_init_scale: s, with initial factors Q_i = s^(1/k)·I on the k
            axes, so P = s²·I (kron-torch's convention).
        mu_dtype: momentum dtype (default: the parameter's).
        precond_dtype: factor dtype (default float32); the math runs in at
            least float32.
        max_skew_triangular: an axis of a tensor with 2+ dims is diagonal when it
            is longer than this times the product of the other dims (default
            inf: off, as in precond.jax.kron).
        merge_small_dims: precondition in the shape that merges adjacent axes
            (``precond._common.factor_plan.merge_dims``), as precond.jax.kron.
        target_merged_dim_size: largest dim that merging may create.
        preconditioner_update_style: 'EQ' (the generation-1 rule above),
            'QUAD' or 'PRO' (generation-2 rules without triangular solves,
            ``_kron_math.update_factors_gen2``; Lipschitz estimates in the
            state), as in :func:`precond.jax.kron`.
        preconditioner_cache: how a triangular factor is stored: None (Q alone,
            kron-torch's layout), 'dense' (Q and the cached P = QᵀQ: twice the
            factor memory; steps without a fit apply P in one matmul per axis
            instead of two) or 'packed' (Q and P in one (d + 1, d) array, about
            Q's memory, as precond.jax.kron's default; unpacking P is an
            elementwise pass over each factor every step, which on a CPU can
            cost more than the matmul it saves). 'PRO', whose Q is not
            triangular, stores 'packed' as 'dense'.
        seed: seed of the noise and of the balancing draws (per step: every
            rank draws the same without communicating).
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
        lr: float = 0.001,
        b1: float = 0.9,
        weight_decay: float = 0.0,
        preconditioner_update_probability: float | Callable | None = None,
        max_size_triangular: int = 8192,
        min_ndim_triangular: int = 2,
        memory_save_mode: str | None = None,
        momentum_into_precond_update: bool = True,
        precond_lr: float = 0.1,
        precond_init_scale: float = 1.0,
        mu_dtype: torch.dtype | None = None,
        precond_dtype: torch.dtype | None = None,
        *,
        max_skew_triangular: float = float("inf"),
        merge_small_dims: bool = False,
        target_merged_dim_size: int = 2048,
        preconditioner_update_style: str = "EQ",
        preconditioner_cache: str | None = None,
        seed: int = 42,
        strategy: Strategy | None = None,
        compile_kernels: bool = False,
    ):
        defaults = dict(
            lr=lr,
            b1=b1,
            weight_decay=weight_decay,
            preconditioner_update_probability=preconditioner_update_probability,
            max_size_triangular=max_size_triangular,
            min_ndim_triangular=min_ndim_triangular,
            memory_save_mode=memory_save_mode,
            momentum_into_precond_update=momentum_into_precond_update,
            precond_lr=precond_lr,
            precond_init_scale=precond_init_scale,
            mu_dtype=mu_dtype,
            precond_dtype=precond_dtype,
            max_skew_triangular=max_skew_triangular,
            merge_small_dims=merge_small_dims,
            target_merged_dim_size=target_merged_dim_size,
            preconditioner_update_style=preconditioner_update_style,
            preconditioner_cache=preconditioner_cache,
        )
        check_int("seed", seed)
        check_bool("compile_kernels", compile_kernels)
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(
                f"Invalid strategy={strategy!r}: must be None or a "
                "precond.torch.Strategy (Replicated() or ShardedPreconditioning())"
            )
        self.seed = seed
        self.strategy = strategy or Replicated()
        self.compile_kernels = compile_kernels
        self._update_factors = _factor_update(compile_kernels)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, groups) plus the seed, the strategy and
        ``compile_kernels``, so that ``copy.deepcopy`` and ``pickle`` give an
        optimizer that steps exactly like this one."""
        return {
            **super().__getstate__(),
            "seed": self.seed,
            "strategy": self.strategy,
            "compile_kernels": self.compile_kernels,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._update_factors = _factor_update(self.compile_kernels)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
            for p in self.param_groups[-1]["params"]:
                _check_parameter(p)
        except Exception:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = []  # (group, parameter, global index), gradient present
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel() > 0:
                    _check_gradient(p)
                    entries.append((group, p, index))
                index += 1
        if not entries:
            return loss
        if not gradients_are_usable([p.grad for _, p, _ in entries]):
            # Skipped: no state changes; decoupled weight decay still applies.
            for group, p, _ in entries:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            return loss
        owners = self.strategy.assign(
            [p for _, p, _ in entries],
            [_cost(p.shape, group) for group, p, _ in entries],
        )
        updates: dict[int, torch.Tensor] = {}
        rank = self.strategy.rank
        mine = [e for e, owner in zip(entries, owners, strict=True) if owner == rank]
        for bucket in _buckets(mine, self.state).values():
            self._step_bucket(bucket, updates)
        updates = self.strategy.share(
            [p for _, p, _ in entries], owners, [updates.get(i) for _, _, i in entries]
        )
        for (group, p, _), update in zip(entries, updates, strict=True):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-group["lr"])
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state; factors, momenta and Lipschitz estimates keep their
        saved values and dtypes (torch would cast them to the parameter's dtype,
        e.g. float32 factors of a bfloat16 weight to bfloat16).

        A state that does not fit the parameters (another model's checkpoint:
        other groups, shapes or factor structure, complex for real, missing
        keys) is refused with a ``ValueError`` naming the first mismatching
        entry, and nothing is changed.
        """
        self._check_state_dict(state_dict)
        kept = (FACTORS, MOMENTUM, LIPSCHITZ)
        saved = {
            index: {key: entry[key] for key in kept if key in entry}
            for index, entry in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entries in saved.items():
            state = self.state[params[index]]
            device = params[index].device
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device=device, copy=True)
                else:
                    state[key] = [t.to(device=device, copy=True) for t in value]

    def _check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises ValueError at the first entry of ``state_dict`` that does not
        fit this optimizer's parameters (checked against the saved groups'
        hyperparameters, which the load will install)."""

        def fail(message: str):
            raise ValueError(
                f"Invalid state_dict: {message} (is it another model's or "
                "optimizer's checkpoint?)"
            )

        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(
            state_dict
        ):
            fail("must be a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            fail(f"{len(saved_groups)} param groups, expected {len(self.param_groups)}")
        known = set()
        position = 0
        for g, (group, saved) in enumerate(
            zip(self.param_groups, saved_groups, strict=True)
        ):
            if len(saved["params"]) != len(group["params"]):
                fail(
                    f"group {g} has {len(saved['params'])} parameters, expected "
                    f"{len(group['params'])}"
                )
            hyper = {**group, **{k: v for k, v in saved.items() if k != "params"}}
            for p, index in zip(group["params"], saved["params"], strict=True):
                known.add(index)
                entry = state_dict["state"].get(index)
                if entry is not None:
                    where = f"parameter {position} (group {g})"
                    problem = _state_entry_problem(p, hyper, entry)
                    if problem:
                        fail(f"{where} {problem}")
                position += 1
        unknown = [index for index in state_dict["state"] if index not in known]
        if unknown:
            fail(f"state for parameter {unknown[0]!r}, which no group lists")

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if state:
            return state
        shape, diagonal = _plan(p.shape, group)
        dtype, mu_dtype = _state_dtypes(p, group)
        scale = group["precond_init_scale"] ** (1 / len(shape))
        state[STEP] = 0
        state[UPDATE_COUNTER] = 0
        state[MOMENTUM] = torch.zeros_like(
            p, dtype=mu_dtype, memory_format=torch.preserve_format
        )
        cache, work = _cache(group), torch.promote_types(dtype, torch.float32)
        state[FACTORS] = [
            torch.full((d,), scale, dtype=dtype, device=p.device)
            if diag
            else _stored(
                scale * torch.eye(d, dtype=work, device=p.device)[None], cache, dtype
            )[0]
            for d, diag in zip(shape, diagonal, strict=True)
        ]
        if group["preconditioner_update_style"] != "EQ":
            state[LIPSCHITZ] = [
                torch.zeros((), dtype=torch.float32, device=p.device) for _ in shape
            ]
        return state

    def _step_bucket(self, bucket, updates: dict[int, torch.Tensor]) -> None:
        """Momentum, fit and preconditioned update of equal-shaped parameters."""
        group = bucket[0][0]
        states = [self._init_state(p, g) for g, p, _ in bucket]
        shape, _ = _plan(bucket[0][1].shape, group)
        b1 = group["b1"]
        for state in states:
            state[STEP] += 1
        step = states[0][STEP]
        grads = [p.grad for _, p, _ in bucket]
        momenta = [s[MOMENTUM] for s in states]
        torch._foreach_lerp_(
            momenta,
            [g.to(m.dtype) for g, m in zip(grads, momenta, strict=True)],
            1 - b1,
        )
        factor_dtype = states[0][FACTORS][0].dtype
        dtype = torch.promote_types(factor_dtype, torch.float32)
        correction = 1 - b1**step

        def stacked(tensors):
            return torch.stack([t.to(dtype).reshape(shape) for t in tensors])

        mu_hat = stacked(momenta) / correction if b1 > 0 else stacked(grads)
        cache, style = _cache(group), group["preconditioner_update_style"]
        stored = [
            torch.stack([s[FACTORS][axis] for s in states]).to(dtype)
            for axis in range(len(shape))
        ]
        probability = group["preconditioner_update_probability"]
        if probability is None:
            probability = _DEFAULT_SCHEDULE
        if callable(probability):
            probability = probability(step)
        for state in states:
            state[UPDATE_COUNTER] += 1
        if states[0][UPDATE_COUNTER] >= 1.0 / np.float32(probability):
            for state in states:
                state[UPDATE_COUNTER] = 0
            device = mu_hat.device
            factors = [_factor_of(F, cache, style) for F in stored]
            if balance_draw(self.seed, step) < BALANCE_PROBABILITY:
                factors = km.balance_factors(factors)
            noise = torch.stack(
                [
                    unit_noise(shape, self.seed, step, index, dtype, device)
                    for _, _, index in bucket
                ]
            )
            target = mu_hat if group["momentum_into_precond_update"] else stacked(grads)
            old_stored = stored
            if style == "EQ":
                factors = self._update_factors(
                    factors,
                    km.add_damping_noise(target, noise),
                    noise,
                    group["precond_lr"],
                )
            else:
                lipschitz = [
                    torch.stack([s[LIPSCHITZ][axis] for s in states])
                    for axis in range(len(shape))
                ]
                targets = km.whitening_targets(
                    shape, [km.is_diagonal(Q) for Q in factors], mu_hat
                )
                factors, lipschitz = km.update_factors_gen2(
                    factors,
                    lipschitz,
                    km.add_relative_damping_noise(target, noise),
                    targets,
                    group["precond_lr"],
                    style,
                )
            stored = [_stored(Q, cache, factor_dtype).to(dtype) for Q in factors]
            # A fit that overflowed (a usable but large gradient met by large
            # factors) keeps that parameter's old factors: decided per stack entry
            # on the device, without a host sync.
            new = stored + (lipschitz if style != "EQ" else [])
            fitted = torch.stack(
                [torch.isfinite(F).reshape(F.shape[0], -1).all(dim=1) for F in new]
            ).all(dim=0)
            stored = [
                torch.where(km._expand(fitted, F), F, old)
                for F, old in zip(stored, old_stored, strict=True)
            ]
            if style != "EQ":
                for i, state in enumerate(states):
                    for axis, L in enumerate(lipschitz):
                        kept = state[LIPSCHITZ][axis]
                        kept.copy_(torch.where(fitted[i], L[i], kept))
            for i, state in enumerate(states):
                for axis, F in enumerate(stored):
                    state[FACTORS][axis].copy_(F[i])
        if cache is None:
            U = km.precondition(stored, mu_hat)
        else:  # U = G ×_1 P_1 … ×_k P_k with the cached P_i = Q_iᵀQ_i
            U = km.apply_along_axes([_gram_of(F, cache) for F in stored], mu_hat)
        squares = U.abs().square() if U.is_complex() else U.square()
        rms = squares.reshape(U.shape[0], -1).mean(dim=1).sqrt()
        U = U / torch.clamp(rms / MAX_UPDATE_RMS, min=1.0).reshape(
            (-1,) + (1,) * (U.ndim - 1)
        )
        for (_, p, index), u in zip(bucket, U, strict=True):
            updates[index] = u.reshape(p.shape)


def _state_entry_problem(
    p: torch.Tensor, group: dict[str, Any], entry: Any
) -> str | None:
    """What makes a saved ``self.state[p]`` unfit for ``p`` under ``group``'s
    hyperparameters, or None."""
    if not isinstance(entry, dict):
        return f"state is a {type(entry).__name__}, expected a dict"
    keys = {STEP, UPDATE_COUNTER, MOMENTUM, FACTORS}
    if group["preconditioner_update_style"] != "EQ":
        keys.add(LIPSCHITZ)
    missing = sorted(keys - set(entry))
    if missing:
        return f"state lacks {missing[0]!r}"
    for key in (STEP, UPDATE_COUNTER):
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key!r} is {value!r}, expected an int >= 0"

    def tensor_problem(name, value, shape, complex_):
        if not isinstance(value, torch.Tensor):
            return f"{name} is a {type(value).__name__}, expected a tensor"
        if tuple(value.shape) != tuple(shape):
            return f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}"
        kind = "complex" if complex_ else "floating"
        if value.is_complex() != complex_ or not (
            value.is_floating_point() or value.is_complex()
        ):
            return f"{name} has dtype {value.dtype}, expected a {kind} dtype"
        return None

    problem = tensor_problem(repr(MOMENTUM), entry[MOMENTUM], p.shape, p.is_complex())
    if problem:
        return problem
    shape, diagonal = _plan(p.shape, group)
    factors = entry[FACTORS]
    if not isinstance(factors, list | tuple) or len(factors) != len(shape):
        got = len(factors) if isinstance(factors, list | tuple) else factors
        return f"{FACTORS!r} has {got!r} factors, expected {len(shape)}"
    cache = _cache(group)
    for axis, (F, d, diag) in enumerate(zip(factors, shape, diagonal, strict=True)):
        if diag:
            expected = (d,)
        else:
            expected = {None: (d, d), "dense": (2, d, d), "packed": (d + 1, d)}[cache]
        problem = tensor_problem(f"{FACTORS!r}[{axis}]", F, expected, p.is_complex())
        if problem:
            return problem
    if LIPSCHITZ in keys:
        estimates = entry[LIPSCHITZ]
        if not isinstance(estimates, list | tuple) or len(estimates) != len(shape):
            return f"{LIPSCHITZ!r} has the wrong length, expected {len(shape)}"
        for axis, L in enumerate(estimates):
            problem = tensor_problem(f"{LIPSCHITZ!r}[{axis}]", L, (), False)
            if problem:
                return problem
    return None


def _cache(group: dict[str, Any]) -> str | None:
    """The factor layout of a group: 'packed' cannot hold PRO's full Q."""
    cache = group["preconditioner_cache"]
    if cache == "packed" and group["preconditioner_update_style"] == "PRO":
        return "dense"
    return cache


def _stored(Q: torch.Tensor, cache: str | None, dtype: torch.dtype) -> torch.Tensor:
    """The state array of a (B, ...) stack of factors in the cache layout."""
    if Q.ndim == 2 or cache is None:  # diagonal factors are stored as they are
        return Q.to(dtype)
    if cache == "packed":
        return km.pack_factor(Q).to(dtype)
    return torch.stack([Q, km.factor_gram(Q)], dim=1).to(dtype)


def _factor_of(F: torch.Tensor, cache: str | None, style: str) -> torch.Tensor:
    """Q (or the diagonal q) from a stack of state arrays."""
    if F.ndim == 2 or cache is None:
        return F
    if cache == "dense":
        return F[:, 0]
    Q = km.unpack_factor(F)
    if style == "QUAD":  # Hermitian: only its upper triangle is stored
        Q = Q + torch.triu(Q, 1).mH
    return Q


def _gram_of(F: torch.Tensor, cache: str) -> torch.Tensor:
    """P = QᵀQ (q² for a diagonal factor) from a stack of cached state arrays."""
    if F.ndim == 2:
        return F * F
    return F[:, 1] if cache == "dense" else km.unpack_gram(F)


def _buckets(entries, optimizer_state) -> dict[tuple, list]:
    """Entries grouped by everything a batched call must share."""
    buckets: dict[tuple, list] = defaultdict(list)
    for group, p, index in entries:
        state = optimizer_state.get(p) or {}
        key = (
            id(group),
            _plan(p.shape, group),
            p.device,
            p.dtype,
            state.get(STEP, 0),
            state.get(UPDATE_COUNTER, 0),
        )
        buckets[key].append((group, p, index))
    return buckets


def _cost(shape, group) -> float:
    """Relative cost of one parameter's fit and update: Σ d_i³ + numel·Σ d_i."""
    merged, diagonal = _plan(shape, group)
    numel = math.prod(merged)
    return sum(
        (d if diag else d**3) + numel * (1 if diag else d)
        for d, diag in zip(merged, diagonal, strict=True)
    )


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


# Every per-group argument and its check: (name, check(name, value)).
GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", lambda n, v: check_real(n, v, low=0.0)),
    ("b1", lambda n, v: check_real(n, v, low=0.0, high=1.0, high_inclusive=False)),
    ("weight_decay", lambda n, v: check_real(n, v, low=0.0)),
    ("preconditioner_update_probability", _check_probability),
    ("max_size_triangular", lambda n, v: check_int(n, v, low=0)),
    ("min_ndim_triangular", lambda n, v: check_int(n, v, low=0)),
    ("memory_save_mode", lambda n, v: check_choice(n, v, MEMORY_SAVE_MODES)),
    ("momentum_into_precond_update", check_bool),
    ("precond_lr", lambda n, v: check_real(n, v, low=0.0)),
    ("precond_init_scale", lambda n, v: check_real(n, v, low=0.0, low_inclusive=False)),
    ("mu_dtype", _check_dtype),
    ("precond_dtype", _check_dtype),
    ("max_skew_triangular", _check_skew),
    ("merge_small_dims", check_bool),
    ("target_merged_dim_size", lambda n, v: check_int(n, v, low=1)),
    (
        "preconditioner_update_style",
        lambda n, v: check_choice(n, v, km.UPDATE_STYLES),
    ),
    ("preconditioner_cache", lambda n, v: check_choice(n, v, PRECONDITIONER_CACHES)),
)


def _check_group(group: dict[str, Any]) -> None:
    for name, check in GROUP_ARGUMENTS:
        check(name, group[name])


def _check_parameter(p: torch.Tensor) -> None:
    if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
        raise NotImplementedError(
            "precond.torch.Kron does not support FSDP2 (fully_shard) DTensor "
            "parameters yet: wrap the model in DDP instead (optionally with "
            "strategy=precond.torch.ShardedPreconditioning() to spread the "
            "preconditioner work over the ranks)"
        )
    if not (p.is_floating_point() or p.is_complex()):
        raise TypeError(
            f"Invalid parameter of dtype {p.dtype}: Kron supports floating and "
            "complex parameters"
        )


def _state_dtypes(
    p: torch.Tensor, group: dict[str, Any]
) -> tuple[torch.dtype, torch.dtype]:
    """(factor dtype, momentum dtype) of a parameter: complex counterparts of the
    group's dtypes for a complex parameter."""
    factor = group["precond_dtype"] or torch.float32
    momentum = group["mu_dtype"] or p.dtype
    if p.is_complex():
        factor = _complex_of(torch.promote_types(factor, torch.float32))
        momentum = momentum if momentum.is_complex else _complex_of(momentum)
    return factor, momentum


def _check_gradient(p: torch.Tensor) -> None:
    if p.grad.is_sparse:
        raise RuntimeError(
            "Kron does not support sparse gradients (e.g. nn.Embedding(sparse=True))"
        )
    if p.grad.is_complex() != p.is_complex():
        raise RuntimeError(
            f"Kron got a gradient of dtype {p.grad.dtype} for a parameter of dtype "
            f"{p.dtype}"
        )
