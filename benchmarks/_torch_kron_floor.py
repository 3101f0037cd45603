"""A floor under the step time of any implementation of kron-torch 0.1.0's
step, eager or ``torch.compile``-d, for ``peer_speed.py``'s torch-kron pair.

The floor is an optimizer-like object whose ``step()`` does only the work that
the algorithm cannot do without, with nothing to check, plan or draw:
parameters with the same shape and factor plan (precond's, which is
kron-torch's: the parity tests) are stacked once, at construction, and each
step

- stacks each bucket's gradients (they arrive as separate tensors) and updates
  the momenta, m ← β₁m + (1 − β₁)g, m̂ = m/(1 − β₁ⁿ): one call each per stack;
- on a fitting step (every round(1/p) steps, p the update probability), does
  the fit's matrix products: A = m̂ ×ᵢ Qᵢ, B = V ×ᵢ Qᵢ⁻ᵀ (triangular solves),
  then per axis T1 = A₍ᵢ₎A₍ᵢ₎ᵀ, T2 = B₍ᵢ₎B₍ᵢ₎ᵀ and
  Qᵢ ← Qᵢ − c·triu(T1 − T2)·Qᵢ (diagonal factors: the same on the diagonals);
- preconditions, U = m̂ ×ᵢ QᵢᵀQᵢ (Qᵢ, then Qᵢᵀ, along each axis; a diagonal
  factor elementwise);
- updates the parameters, θ ← θ − lr·clamp(U + λθ, −1, 1), one ``_foreach``
  call per stage.

Left out, though kron-torch's step (and precond's) does them: the norm bounds
that set each fit's step size c (fixed here), the balancing of the factors,
the damping and the noise draws (V is drawn once), the finiteness checks, and
any per-parameter Python. So no implementation of the algorithm steps faster
than this floor on the same machine, up to timing noise: a floor above half of
kron-torch's step puts the issue's ≤ 0.5 target out of reach there.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from precond.torch import Kron
from precond.torch._kron_math import _along
from precond.torch._kron_state import factor_plan

FIT_STEP = 0.1  # c above: a constant where the algorithm computes one per fit


class _Bucket:
    """The stacked state of parameters with one shape and factor plan."""

    def __init__(self, params: list[torch.Tensor], diagonal: tuple[bool, ...]):
        self.params = params
        shape = tuple(params[0].shape)
        if len(shape) not in (1, 2):
            raise ValueError(f"the floor takes 1-D and 2-D parameters, not {shape}")
        n, device = len(params), params[0].device
        # A vector is worked on as a (d, 1) matrix: its products are matrix ones.
        self.stacked_shape = (n, *shape) if len(shape) == 2 else (n, shape[0], 1)
        self.momentum = torch.zeros(self.stacked_shape, device=device)
        self.factors = [
            torch.ones(n, d, device=device)
            if diag
            else torch.eye(d, device=device).expand(n, d, d).clone()
            for d, diag in zip(shape, diagonal, strict=True)
        ]
        generator = torch.Generator().manual_seed(0)
        self.noise = torch.randn(self.stacked_shape, generator=generator).to(device)


# The products below are the kernels' (precond.torch._kron_math) in their
# leanest form for 2-D stacks: one bmm or solve, no axis moves or reshapes.


def _product(X: torch.Tensor, M: torch.Tensor, axis: int, transpose: bool):
    """X ×_axis M (Mᵀ with ``transpose``) for a (B, d, d) stack M, or X ⊙ m."""
    if M.ndim == 2:
        return X * _along(M, X, axis)
    M = M.mT if transpose else M
    return torch.bmm(M, X) if axis == 0 else torch.bmm(X, M.mT)


def _solve(X: torch.Tensor, Q: torch.Tensor, axis: int) -> torch.Tensor:
    """X ×_axis Q⁻ᵀ for upper-triangular Q, or X / q."""
    if Q.ndim == 2:
        return X / _along(Q, X, axis)
    if axis == 0:
        return torch.linalg.solve_triangular(Q.mT, X, upper=False)
    return torch.linalg.solve_triangular(Q, X, upper=True, left=False)


def _gram(X: torch.Tensor, axis: int, diagonal: bool) -> torch.Tensor:
    """X₍ᵢ₎X₍ᵢ₎ᵀ per stack entry, or its diagonal."""
    rows = X if axis == 0 else X.mT
    if diagonal:
        return (rows * rows).sum(dim=2)
    return torch.bmm(rows, rows.mT)


def _fit(bucket: _Bucket, m_hat: torch.Tensor) -> None:
    """The fit's products (module docstring), the factors updated in place."""
    A, B = m_hat, bucket.noise
    for axis, Q in enumerate(bucket.factors):
        A = _product(A, Q, axis, transpose=False)
        B = _solve(B, Q, axis)
    for axis, Q in enumerate(bucket.factors):
        diagonal = Q.ndim == 2
        step = _gram(A, axis, diagonal) - _gram(B, axis, diagonal)
        if diagonal:
            Q.sub_(FIT_STEP * step * Q)
        else:
            Q.sub_(FIT_STEP * torch.bmm(torch.triu(step), Q))


def _step(
    buckets: list[_Bucket],
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    fit: bool,
    b1: float,
    correction: torch.Tensor,
    lr: float,
    decay: float,
) -> None:
    """One floor step (module docstring); ``grads[b]`` are bucket b's,
    ``correction`` is 1 − β₁ⁿ."""
    updates = []
    for bucket, bucket_grads in zip(buckets, grads, strict=True):
        stacked = torch.stack(bucket_grads).view(bucket.stacked_shape)
        bucket.momentum.lerp_(stacked, 1 - b1)
        U = bucket.momentum / correction
        if fit:
            _fit(bucket, U)
        for axis, Q in enumerate(bucket.factors):
            U = _product(U, Q, axis, transpose=False)
            U = _product(U, Q, axis, transpose=True)
        updates.extend(U.view(len(bucket.params), *bucket.params[0].shape).unbind(0))
    steps = torch._foreach_add(updates, params, alpha=decay)  # pyright: ignore[reportPrivateImportUsage]
    torch._foreach_clamp_min_(steps, -1.0)  # pyright: ignore[reportPrivateImportUsage]
    torch._foreach_clamp_max_(steps, 1.0)  # pyright: ignore[reportPrivateImportUsage]
    torch._foreach_add_(params, steps, alpha=-lr)  # pyright: ignore[reportPrivateImportUsage]


class KronFloor:
    """``step()`` runs the floor program on ``params``' gradients (float32,
    2-D or 1-D parameters); ``compiled`` runs it through ``torch.compile``
    (one program for fitting steps, one for the others)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float,
        weight_decay: float,
        preconditioner_update_probability: float,
        compiled: bool = False,
    ):
        group = Kron(params).param_groups[0]  # kron-torch's default plan options
        grouped = defaultdict(list)
        for p in params:
            plan = factor_plan(tuple(p.shape), group)
            if plan[0] != tuple(p.shape):
                raise ValueError(f"the floor keeps shapes as they are, not {plan}")
            grouped[plan].append(p)
        self.buckets = [_Bucket(ps, plan[1]) for plan, ps in grouped.items()]
        # The parameters in the order their updates come out of the buckets.
        self.params = [p for bucket in self.buckets for p in bucket.params]
        self.lr, self.decay = lr, weight_decay
        self.interval = round(1 / preconditioner_update_probability)
        self.b1, self.count = 0.9, 0  # kron-torch's default β₁; steps taken
        self._step = torch.compile(_step) if compiled else _step

    @torch.no_grad()
    def step(self) -> None:
        self.count += 1
        grads = [[p.grad for p in bucket.params] for bucket in self.buckets]
        self._step(
            self.buckets,
            self.params,
            grads,
            fit=(self.count - 1) % self.interval == 0,
            b1=self.b1,
            # A tensor: a compiled program would be made anew for each float.
            correction=torch.tensor(
                1 - self.b1**self.count, device=self.params[0].device
            ),
            lr=self.lr,
            decay=self.decay,
        )


def warmup_steps(probability: float) -> int:
    """Steps that run both of a compiled floor's programs (a fit, then not)."""
    return math.ceil(1 / probability) + 2
