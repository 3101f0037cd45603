"""Kron's per-parameter state (``self.state[p]``): which factor each axis of a
parameter gets (the plan), the state's dtypes and storage layouts, a fresh
state, and the buckets of equal work with their stacks."""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from typing import Any

import torch

from precond._common.factor_plan import plan_diagonal_axes
from precond._common.kron_constants import GENERATION_1_STYLE, stored_cache
from precond._common.kron_plan import merge_planned_axes
from precond.torch._core import factor_kernels as km
from precond.torch._core.step_policy import STEP, UPDATE_COUNTER
from precond.torch._core.tensors import as_dtype, working_dtype

# Keys of self.state[p]: the step policy's (precond.torch._core.step_policy), and
# Kron's own.
MOMENTUM, FACTORS = "momentum", "Q"
LIPSCHITZ = "lipschitz"  # generation-2 styles: per axis, a float32 scalar


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """kron-torch 0.3.3's ``merge_dims``: a tensor of 3+ dims is preconditioned as
    the matrix (d_1⋯d_{k−1}, d_k) or (d_1, d_2⋯d_k), whichever is less skewed
    (the first on a tie); others keep their shape."""
    if len(shape) <= 2:
        return shape
    rows_first = (math.prod(shape[:-1]), shape[-1])
    cols_first = (shape[0], math.prod(shape[1:]))
    if rows_first[1] - rows_first[0] <= cols_first[1] - cols_first[0]:
        return rows_first
    return cols_first


def _smart_one_diag(
    shape: tuple[int, ...], diagonal: tuple[bool, ...]
) -> tuple[bool, ...]:
    """kron-torch 0.3.3's 'smart_one_diag': the largest axis, if strictly the
    largest, is diagonal too."""
    if len(shape) < 2:
        return diagonal
    ordered = sorted(shape)
    if ordered[-1] == ordered[-2]:
        return diagonal
    largest = shape.index(ordered[-1])
    return tuple(d or a == largest for a, d in enumerate(diagonal))


def _skew_rule(
    shape: tuple[int, ...], diagonal: tuple[bool, ...], skew: float
) -> tuple[bool, ...]:
    """kron-torch 0.1.0's skew rule: an axis longer than ``skew`` times the second
    largest dim (1 for a vector) is diagonal."""
    second_largest = sorted(shape)[-2] if len(shape) > 1 else 1
    return tuple(
        diag or d > skew * second_largest
        for d, diag in zip(shape, diagonal, strict=True)
    )


# The group entries a parameter's factor plan depends on.
_PLAN_OPTIONS = (
    "merge_dims",
    "memory_save_mode",
    "max_size_triangular",
    "min_ndim_triangular",
    "max_skew_triangular",
    "merge_small_dims",
    "target_merged_dim_size",
)

_plan_options = operator.itemgetter(*_PLAN_OPTIONS)


def factor_plan(
    shape: tuple[int, ...], group: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(preconditioned shape, diagonal per axis) of a parameter (scalars become
    (1,)). An axis is diagonal when its size is 1 or above
    ``max_size_triangular``, when the tensor has fewer than
    ``min_ndim_triangular`` dims, when ``memory_save_mode`` picks it, or when it
    is longer than ``max_skew_triangular`` times the second largest dim (1 for a
    vector): kron-torch 0.1.0's skew rule.

    The shared rules are precond._common's (``factor_plan.plan_diagonal_axes``,
    and ``kron_plan.merge_planned_axes`` for ``merge_small_dims``, after
    kron-torch's rules have decided the diagonal axes); kron-torch's rules (the
    ``merge_dims`` argument's matrix shape, 'smart_one_diag', the skew rule)
    exist only here, as precond.jax.kron plans as distributed-kron, which has
    none of them. No blocking: every axis stays whole. A plan is made once per
    shape and options (a step asks for each parameter's several times)."""
    return _planned(tuple(shape), *_plan_options(group))


@functools.lru_cache(maxsize=1024)
def _planned(
    shape: tuple[int, ...],
    merge_dims: bool,
    mode: str | None,
    max_size_triangular: int,
    min_ndim_triangular: int,
    max_skew_triangular: float,
    merge_small_dims: bool,
    target_merged_dim_size: int,
) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """:func:`factor_plan` of a shape, given the group's plan options."""
    shape = shape or (1,)
    if merge_dims:
        shape = _matrix_shape(shape)
    diagonal = plan_diagonal_axes(
        shape,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=None if mode == "smart_one_diag" else mode,
    )
    if mode == "smart_one_diag":
        diagonal = _smart_one_diag(shape, diagonal)
    diagonal = _skew_rule(shape, diagonal, max_skew_triangular)
    if merge_small_dims:
        shape, diagonal = merge_planned_axes(
            shape,
            diagonal,
            target_merged_dim_size=target_merged_dim_size,
            max_size_triangular=max_size_triangular,
        )
    return shape, diagonal


def cost(shape, group) -> float:
    """Relative cost of one parameter's fit and update: Σ d_i³ + numel·Σ d_i
    (priced once per shape and plan options: a step prices every parameter)."""
    return _priced(tuple(shape), *_plan_options(group))


@functools.lru_cache(maxsize=1024)
def _priced(shape: tuple[int, ...], *plan_options: Any) -> float:
    """:func:`cost` of a shape, given the group's plan options."""
    merged, diagonal = _planned(shape, *plan_options)
    numel = math.prod(merged)
    return sum(
        (d if diag else d**3) + numel * (1 if diag else d)
        for d, diag in zip(merged, diagonal, strict=True)
    )


def buckets(entries, optimizer_state) -> dict[tuple, list]:
    """Entries grouped by everything a batched call must share."""
    grouped: dict[tuple, list] = defaultdict(list)
    for group, p, index in entries:
        state = optimizer_state.get(p) or {}
        key = (
            id(group),
            factor_plan(p.shape, group),
            p.device,
            p.dtype,
            state.get(STEP, 0),
            state.get(UPDATE_COUNTER, 0),
        )
        grouped[key].append((group, p, index))
    return grouped


class BucketStacks:
    """A bucket's factors (one (B, ...) stack per axis) and momenta ((B, *shape)),
    of which each parameter's ``state[FACTORS][axis]`` and ``state[MOMENTUM]``
    are views: a step reads and writes all of them in one call per stack,
    without stacking copies."""

    def __init__(self, states: list[dict[str, Any]]):
        self.factors = [
            torch.stack([s[FACTORS][axis] for s in states])
            for axis in range(len(states[0][FACTORS]))
        ]
        self.momentum = torch.stack([s[MOMENTUM] for s in states])
        for i, state in enumerate(states):
            state[FACTORS] = [F[i] for F in self.factors]
            state[MOMENTUM] = self.momentum[i]
        # The views handed out, to tell whether the states still hold them.
        self._views = [(s[FACTORS], s[FACTORS][:], s[MOMENTUM]) for s in states]

    def viewed_by(self, states: list[dict[str, Any]]) -> bool:
        """Whether ``states`` still hold exactly this stack's views (not another
        bucket's, a loaded state's or a user's tensors)."""
        return len(states) == len(self._views) and all(
            s[FACTORS] is factors
            and s[MOMENTUM] is momentum
            and all(a is b for a, b in zip(factors, views, strict=True))
            for s, (factors, views, momentum) in zip(states, self._views, strict=True)
        )


def bucket_stacks(
    cache: dict[tuple[int, ...], BucketStacks], states: list[dict[str, Any]]
) -> BucketStacks:
    """The stacks of the bucket whose parameters' states are ``states``, kept in
    ``cache`` from step to step; made anew (copying the states' tensors into
    new stacks) when the bucket's members changed or a state's tensors were
    replaced (a loaded state dict), dropping any stack that shared a member."""
    key = tuple(id(s) for s in states)
    stacks = cache.get(key)
    if stacks is None or not stacks.viewed_by(states):
        for other in [k for k in cache if not set(k).isdisjoint(key)]:
            del cache[other]
        stacks = cache[key] = BucketStacks(states)
    return stacks


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    """The complex dtype of at least ``dtype``'s precision (complex64 at least)."""
    if dtype in (torch.float64, torch.complex128):
        return torch.complex128
    return torch.complex64


def state_dtypes(
    p: torch.Tensor, group: dict[str, Any]
) -> tuple[torch.dtype, torch.dtype]:
    """(factor dtype, momentum dtype) of a parameter: complex counterparts of the
    group's dtypes for a complex parameter."""
    factor = group["precond_dtype"] or p.dtype
    momentum = group["mu_dtype"] or p.dtype
    if p.is_complex():
        factor = _complex_of(working_dtype(factor))
        momentum = momentum if momentum.is_complex else _complex_of(momentum)
    return factor, momentum


def cache_layout(group: dict[str, Any]) -> str | None:
    """The factor layout of a group (:func:`precond._common.kron_constants.
    stored_cache`: 'packed' cannot hold PRO's or QEQ's full Q)."""
    return stored_cache(
        group["preconditioner_cache"], group["preconditioner_update_style"]
    )


def generation_2(group: dict[str, Any]) -> bool:
    """A generation-2 style (not 'EQ'): Lipschitz estimates in the state."""
    return group["preconditioner_update_style"] != GENERATION_1_STYLE


def stored(Q: torch.Tensor, cache: str | None, dtype: torch.dtype) -> torch.Tensor:
    """The state array of a (B, ...) stack of factors in the cache layout."""
    if km.is_diagonal(Q) or cache is None:  # diagonal factors: stored as they are
        return as_dtype(Q, dtype)
    if cache == "packed":
        return as_dtype(km.pack_factor(Q), dtype)
    return as_dtype(torch.stack([Q, km.factor_gram(Q)], dim=1), dtype)


def factor_of(F: torch.Tensor, cache: str | None, style: str) -> torch.Tensor:
    """Q (or the diagonal q) from a stack of state arrays."""
    if km.is_diagonal(F) or cache is None:
        return F
    if cache == "dense":
        return F[:, 0]
    Q = km.unpack_factor(F)
    if style == "QUAD":  # Hermitian: only its upper triangle is stored
        Q = Q + torch.triu(Q, 1).mH
    return Q


def gram_of(F: torch.Tensor, cache: str) -> torch.Tensor:
    """P = QᵀQ (q² for a diagonal factor) from a stack of cached state arrays."""
    if km.is_diagonal(F):
        return F * F
    return F[:, 1] if cache == "dense" else km.unpack_gram(F)


def initial_factors(p: torch.Tensor, group: dict[str, Any]) -> list[torch.Tensor]:
    """Q_i = s^(1/k)·I on each of the k axes (s = ``precond_init_scale``), in the
    group's factor dtype and cache layout."""
    shape, diagonal = factor_plan(p.shape, group)
    dtype, _ = state_dtypes(p, group)
    scale = group["precond_init_scale"] ** (1 / len(shape))
    cache, work = cache_layout(group), working_dtype(dtype)
    return [
        torch.full((d,), scale, dtype=dtype, device=p.device)
        if diag
        else stored(
            scale * torch.eye(d, dtype=work, device=p.device)[None], cache, dtype
        )[0]
        for d, diag in zip(shape, diagonal, strict=True)
    ]


# --- checks of a saved state ---------------------------------------------------
