"""PSGD 'pro' as a ``torch.optim.Optimizer``: the recipe of :func:`precond.jax.pro`
(distributed-kron 2.0's generation-2 PSGD, with its defaults) in PyTorch.

Per parameter, the momentum m̂ is read as a vector (a 0-D or 1-D parameter, or one
whose dims are all 1 but one) or as a matrix (dims merged into the two most
balanced groups) and preconditioned by P = Q_lᵀQ_l ⊗ Q_rᵀQ_r. A matrix side of at
most ``max_size_dense`` is dense and cut into blocks of ``block_size``, each block
with its own dense factors; a longer side keeps one diagonal factor; a vector has
one diagonal factor. The layout is :func:`precond._common.pro_layout._plan`, the
one the JAX transform uses, and equal blocks of all parameters are stacked so
that one batched call (``torch.bmm``) fits each stack.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from precond._common.kron_constants import MAX_UPDATE_RMS
from precond._common.pro_arguments import PRO_SHARED_ARGUMENT_CHECKS
from precond._common.pro_layout import (
    ADAM_STYLE_DIVISOR,
    BALANCE_EVERY,
    _plan,
    _Region,
)
from precond._common.validation import check_int, check_real
from precond.torch._core import factor_kernels as km
from precond.torch._core import optimizer as shared
from precond.torch._core.dtensor import (
    check_dtensor_parameter,
    local_part,
    local_value,
)
from precond.torch._core.profiling import profiled_stage
from precond.torch._core.step_policy import (
    STEP,
    UPDATE_COUNTER,
    count_step,
    finite_entries,
    fit_due,
    probability_at,
    seeded_generator,
)
from precond.torch._core.tensors import scalar

__all__ = ["Pro"]


def _check_gradient(p: torch.Tensor) -> None:
    # gradient_entries checks only parameters with a gradient.
    if p.grad is not None and p.grad.is_sparse:
        raise RuntimeError("Pro does not support sparse gradients")


# Keys of self.state[p]. FACTORS and LIPSCHITZ hold, per block region of the
# parameter (ordered by the region's offset), a list with one tensor per side:
# (blocks, d, d) or (blocks, d) factors, (blocks,) float32 Lipschitz estimates.
# STEP and UPDATE_COUNTER are the step policy's (precond.torch._core.step_policy).
MOMENTUM = "momentum"
FACTORS, LIPSCHITZ = "factors", "lipschitz"
DTYPES = (torch.float32, torch.bfloat16)


def draw_normal(
    generator: torch.Generator,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Every random draw of :class:`Pro` (the damping noise V and the sampled
    norm bounds' vectors) is made by this module-level function, so a test can
    replace it (``monkeypatch.setattr(precond.torch.kron.pro, "draw_normal", f)``)."""
    return km.normal_draw(generator, shape, dtype, device)


def _draw(generator, shape, dtype, device):
    # Looked up at call time: the kernels see a replaced draw_normal too.
    return draw_normal(generator, shape, dtype, device)


def _regions(shape: tuple[int, ...], group: dict[str, Any]) -> list[tuple]:
    """(region, diagonal per side) of one parameter's blocks, by offset."""
    return _regions_of(tuple(shape), group["max_size_dense"], group["block_size"])


@functools.lru_cache(maxsize=1024)
def _regions_of(shape: tuple[int, ...], max_size_dense: int, block_size: int):
    plan = _plan([shape], [False], max_size_dense, block_size, 1)
    found = [(r, s.diagonal) for s in plan.stacks for r in s.regions]
    return sorted(found, key=lambda item: item[0].offset)


@functools.lru_cache(maxsize=64)
def _bucket_plan(shapes: tuple, max_size_dense: int, block_size: int):
    """The layout of a bucket's parameters (planned once per set of shapes)."""
    return _plan(list(shapes), [False] * len(shapes), max_size_dense, block_size, 1)


def _cut(x: torch.Tensor, region: _Region) -> torch.Tensor:
    """The region's blocks of a merged tensor x (no batch axis), as
    (blocks, *block shape)."""
    index = tuple(
        slice(o, o + c * s)
        for o, c, s in zip(region.offset, region.counts, region.shape, strict=True)
    )
    part = x[index]
    if len(region.shape) == 1:
        return part.reshape(region.counts[0], region.shape[0])
    (cr, cc), (r, c) = region.counts, region.shape
    return part.reshape(cr, r, cc, c).permute(0, 2, 1, 3).reshape(-1, r, c)


def _paste(out: torch.Tensor, blocks: torch.Tensor, region: _Region) -> None:
    """Writes (blocks, *block shape) back into the region of ``out``."""
    index = tuple(
        slice(o, o + c * s)
        for o, c, s in zip(region.offset, region.counts, region.shape, strict=True)
    )
    if len(region.shape) == 1:
        out[index] = blocks.reshape(-1)
        return
    (cr, cc), (r, c) = region.counts, region.shape
    out[index] = blocks.reshape(cr, cc, r, c).permute(0, 2, 1, 3).reshape(cr * r, -1)


class Pro(shared.CheckedOptimizer):
    """PSGD 'pro': :func:`precond.jax.pro`'s arguments (less the JAX-only ones),
    defaults and steps, as a ``torch.optim.Optimizer``.

    Each step, per parameter θ with gradient g and n its 1-based step count:

    1. m ← b1·m + (1 − b1)·g, m̂ = m/(1 − b1ⁿ) (in float32, stored in ``dtype``);
       with ``normalize_grads``, m̂ ← m̂/(‖m̂‖ + 1e-6).
    2. Every 100 steps, each matrix block's two factors are rebalanced to equal
       max-abs norms. When the factors are due a fit (step 1, then once 1/p steps
       have passed, p = ``preconditioner_update_probability``), each block fits
       its factors to G̃ = m̂ + (δ + ε|m̂|)⊙V (δ·V for vectors; V ~ N(0, I),
       δ = ``noise_scale``) by one generation-2 step
       (``factor_kernels.update_factors_gen2``: step ``preconditioner_lr`` over a
       smoothed Lipschitz estimate with sampled norm bounds; 'PRO' adds a
       Procrustes rotation, 'QUAD' keeps Q symmetric, 'QEQ' steps Q on its
       right), whitening targets.
    3. U = P·m̂ with the new factors, per block; U ← U·1.1/max(RMS(U), 1.1) per
       tensor; U ← U/5 when ``lr_style='adam'`` (so AdamW's learning rates carry
       over).
    4. θ ← θ − lr·(U + λθ), λ = ``weight_decay``.

    Random draws come from a ``torch.Generator`` seeded by (``seed``, n, the
    stack's first block): every DDP rank and every resumed run draws the same.
    FSDP2 (``fully_shard``) parameters work as in Kron (torch >= 2.6): each
    whole gradient is gathered and each rank applies its shard's slice of U
    (``precond.torch._core.dtensor``).
    A step in which some gradient is not usable (NaN, ±Inf, or so large its
    squared norm overflows) changes no state and moves the parameters only by
    weight decay; a fit that overflows keeps that block's old factors. Skipped
    steps are counted in :attr:`skipped_steps` (kept in ``param_groups[0]``,
    so checkpoints keep it), and the first is logged at WARNING on the
    ``precond.torch`` logger.

    Args:
        params: parameters or param groups (every argument but ``seed`` may be
            set per group).
        lr: learning rate (a float or a one-element tensor).
        lr_style: 'adam' divides the clipped update by 5; None leaves it.
        b1: momentum coefficient in [0, 1) (bias-corrected). Each param group
            also holds it as ``momentum``, the name torch's schedulers set
            (OneCycleLR and CyclicLR with ``cycle_momentum=True``); a group may
            give either, and a change to either is what the next step uses.
        weight_decay: decoupled weight decay λ.
        normalize_grads: divide each momentum tensor by its norm (+1e-6) first.
        max_size_dense: matrix sides longer than this get a diagonal factor.
        preconditioner_lr: the fit's step size η (over the Lipschitz estimate).
        preconditioner_init_scale: every factor starts as this times identity.
        preconditioner_update_style: 'PRO', 'QUAD' or 'QEQ' (see
            :func:`precond.jax.pro`).
        dtype: torch.float32 or torch.bfloat16, of the momentum, the factors and
            the fit (Lipschitz estimates are float32).
        block_size: length of the blocks a dense side is cut into.
        noise_scale: δ, the floor of the damping noise's scale.
        preconditioner_update_probability: p in (0, 1] or a function of the
            step n: fit on the first step, then once 1/p steps have passed (every
            step at 1); other steps precondition with the stored factors.
        seed: an int seeding every draw (with the step and the stack).

    Example (with a closure that re-evaluates the loss):
        >>> model = torch.nn.Linear(8, 4)
        >>> optimizer = Pro(model.parameters(), lr=1e-3)
        >>> inputs = torch.randn(2, 8)
        >>> def closure():
        ...     optimizer.zero_grad()
        ...     loss = model(inputs).square().sum()
        ...     loss.backward()
        ...     return loss
        >>> loss = optimizer.step(closure)
    """

    # The state entries load_state_dict copies as saved (dtype kept, storage
    # not shared with the state dict's tensors).
    _KEPT_STATE: tuple[str, ...] = (MOMENTUM, FACTORS, LIPSCHITZ)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        lr_style: str | None = "adam",
        b1: float = 0.95,
        weight_decay: float = 0.1,
        normalize_grads: bool = False,
        max_size_dense: int = 16384,
        preconditioner_lr: float = 0.5,
        preconditioner_init_scale: float = 1.0,
        preconditioner_update_style: str = "PRO",
        dtype: torch.dtype = torch.float32,
        block_size: int = 256,
        noise_scale: float = 1e-9,
        *,
        preconditioner_update_probability: float | Callable[[int], float] = 1.0,
        seed: int = 0,
    ):
        shared.check_arguments(locals(), OPTIMIZER_ARGUMENTS)
        defaults = shared.group_defaults(locals(), GROUP_ARGUMENTS)
        self.seed = seed
        super().__init__(params, defaults)

    def _check_param_group(self, group: dict[str, Any]) -> None:
        shared.check_arguments(group, GROUP_ARGUMENTS)
        for p in group["params"]:
            check_dtensor_parameter(p, "precond.torch.Pro")
            if not p.is_floating_point():
                raise TypeError(
                    f"Invalid parameter of dtype {p.dtype}: Pro supports real "
                    "floating parameters"
                )

    @shared.eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = shared.closure_loss(closure)
        self._sync_momentum()
        usable = self._usable_entries(_check_gradient)
        if usable is not None:
            self._step_entries(*usable)
        return loss

    def _step_entries(self, entries: list, full: list[torch.Tensor]) -> None:
        """Steps the parameters of ``entries`` ((group, parameter, index), from
        ``shared.gradient_entries``) on their whole gradients ``full``, bucket
        by bucket (parameters of one group sharing a step count and an update
        counter)."""
        grads = {index: g for (_, _, index), g in zip(entries, full, strict=True)}
        buckets: dict[tuple, list] = defaultdict(list)
        for group, p, i in entries:
            state = self.state[p]
            key = (id(group), state.get(STEP, 0), state.get(UPDATE_COUNTER, 0))
            buckets[key].append((group, p, i))
        for bucket in buckets.values():
            self._step_bucket(bucket, grads)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict:
        state = self.state[p]
        if FACTORS in state:
            return state
        dtype, scale = group["dtype"], group["preconditioner_init_scale"]
        state[STEP] = 0
        state[UPDATE_COUNTER] = 0
        state[MOMENTUM] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        factors, lipschitz = [], []
        for region, diagonal in _regions(p.shape, group):
            units = math.prod(region.counts)
            sides = []
            for d, diag in zip(region.shape, diagonal, strict=True):
                one = (
                    torch.ones(d, dtype=dtype, device=p.device)
                    if diag
                    else torch.eye(d, dtype=dtype, device=p.device)
                )
                sides.append((scale * one).expand(units, *one.shape).clone())
            factors.append(sides)
            lipschitz.append(
                [
                    torch.zeros(units, dtype=torch.float32, device=p.device)
                    for _ in region.shape
                ]
            )
        state[FACTORS], state[LIPSCHITZ] = factors, lipschitz
        return state

    def _step_bucket(self, bucket: list, grads: dict[int, torch.Tensor]) -> None:
        """Momentum, fit and update of the parameters of one group that share a
        step count and an update counter (all of them, in a plain run);
        ``grads`` holds the whole gradients by parameter index."""
        group = bucket[0][0]
        states = [self._init_state(p, group) for _, p, _ in bucket]
        with profiled_stage("precond/pro/momentum"):
            momenta = _momentum_step(bucket, states, grads)
        do_fit = _fit_due(group, states)
        plan = _bucket_plan(
            tuple(tuple(p.shape) for _, p, _ in bucket),
            group["max_size_dense"],
            group["block_size"],
        )
        # merged is None only for 0-size parameters, which gradient_entries leaves out.
        views = [
            m.reshape(cast(tuple[int, ...], merged))
            for m, merged in zip(momenta, plan.merged, strict=True)
        ]
        updates = [torch.empty_like(v) for v in views]
        for stack in plan.stacks:
            self._step_stack(stack, bucket, states, views, updates, do_fit)
        with profiled_stage("precond/pro/apply_updates"):
            _apply_updates(bucket, updates)

    def _step_stack(self, stack, bucket, states, views, updates, do_fit) -> None:
        """Balance (every 100 steps), fit (when due) and apply one stack's
        factors to its blocks of m̂, writing P·m̂ into ``updates``."""
        group, step = bucket[0][0], states[0][STEP]
        stored = [
            self._stored_region(states[r.leaf], bucket[r.leaf][1], group, r)
            for r in stack.regions
        ]
        factors = [
            torch.cat([s[0][side] for s in stored]) for side in range(len(stack.shape))
        ]
        lipschitz = [
            torch.cat([s[1][side] for s in stored]) for side in range(len(stack.shape))
        ]
        G = torch.cat([_cut(views[r.leaf], r) for r in stack.regions])
        with profiled_stage("precond/pro/update_factors"):
            if step % BALANCE_EVERY == 0 and len(factors) == 2:
                factors = km.balance_factors(factors)
            if do_fit:
                first = stack.regions[0]
                generator = seeded_generator(
                    G.device, self.seed, step, bucket[first.leaf][2], *first.first
                )
                factors, lipschitz = self._fit(
                    factors, lipschitz, G, stack.diagonal, generator, group
                )
        with profiled_stage("precond/pro/precondition"):
            PG = km.precondition(factors, G)
        start = 0
        for r, (Qs, Ls) in zip(stack.regions, stored, strict=True):
            units = math.prod(r.counts)
            for side in range(len(stack.shape)):
                Qs[side].copy_(factors[side][start : start + units])
                Ls[side].copy_(lipschitz[side][start : start + units])
            _paste(updates[r.leaf], PG[start : start + units], r)
            start += units

    @staticmethod
    def _stored_region(state, p, group, region) -> tuple[list, list]:
        """The stored factors and Lipschitz estimates of one region of ``p``."""
        offsets = [r.offset for r, _ in _regions(p.shape, group)]
        position = offsets.index(region.offset)
        return state[FACTORS][position], state[LIPSCHITZ][position]

    @staticmethod
    def _fit(factors, lipschitz, G, diagonal, generator, group):
        """One generation-2 fit of a stack; a block whose fit overflows keeps
        its old factors and estimates."""
        noise_scale = group["noise_scale"]
        V = _draw(generator, tuple(G.shape), G.dtype, G.device)
        if G.ndim == 2:  # vectors: δ·V only
            noisy = G + noise_scale * V
        else:
            noisy = km.add_relative_damping_noise(G, V, noise_scale)
        rngs = [None if diag else generator for diag in diagonal]
        valid = [torch.ones(d, dtype=torch.bool, device=G.device) for d in G.shape[1:]]
        targets = km.whitening_targets(valid, diagonal)
        new_factors, new_lipschitz = km.update_factors_gen2(
            factors,
            lipschitz,
            noisy,
            targets,
            group["preconditioner_lr"],
            group["preconditioner_update_style"],
            rngs,
            _draw,
        )
        finite = finite_entries([*new_factors, *new_lipschitz])
        kept_factors = [
            torch.where(km._expand(finite, new), new, old).to(old.dtype)
            for new, old in zip(new_factors, factors, strict=True)
        ]
        kept_lipschitz = [
            torch.where(finite, new, old)
            for new, old in zip(new_lipschitz, lipschitz, strict=True)
        ]
        return kept_factors, kept_lipschitz

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state; momenta, factors and Lipschitz estimates keep their
        saved dtypes (torch would cast them to the parameter's dtype, e.g.
        float32 factors of a bfloat16 weight). A state whose factors do not fit
        a parameter's layout (another model's checkpoint, another
        ``max_size_dense`` or ``block_size``) raises ValueError and changes
        nothing."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"])
            for g, mine in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "Invalid state_dict: its param groups do not match this "
                "optimizer's (another model's checkpoint?)"
            )
        params = shared.saved_parameters(self.param_groups, state_dict)
        hyper = {
            index: {**self.defaults, **saved}
            for saved in groups
            for index in saved["params"]
        }
        for index, entry in state_dict["state"].items():
            if index not in params:
                raise ValueError(
                    f"Invalid state_dict: state for parameter {index!r}, which no "
                    "group lists"
                )
            p = params[index]
            if FACTORS in entry:
                expected = [
                    [
                        (math.prod(r.counts), d)
                        if diag
                        else (math.prod(r.counts), d, d)
                        for d, diag in zip(r.shape, diagonal, strict=True)
                    ]
                    for r, diagonal in _regions(p.shape, hyper[index])
                ]
                found = [[tuple(Q.shape) for Q in sides] for sides in entry[FACTORS]]
                if found != expected:
                    raise ValueError(
                        f"Invalid state_dict: parameter {index!r} has factors of "
                        f"shapes {found}, expected {expected} (another model's "
                        "checkpoint, or another max_size_dense or block_size?)"
                    )
        self._load_keeping_dtypes(state_dict, self._KEPT_STATE)


def _momentum_step(
    bucket: list, states: list, grads: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """Counts the step; m ← b1·m + (1 − b1)·g in float32 (stored in ``dtype``);
    returns each m̂ = m/(1 − b1ⁿ) in ``dtype``, divided by ‖m̂‖ + 1e-6 with
    ``normalize_grads``."""
    group = bucket[0][0]
    dtype, b1 = group["dtype"], group["b1"]
    step = count_step(states)
    correction = 1 - torch.tensor(b1, dtype=torch.float32) ** step
    momenta = []
    for (_, _, index), state in zip(bucket, states, strict=True):
        mu = b1 * state[MOMENTUM].float() + (1 - b1) * grads[index].float()
        state[MOMENTUM].copy_(mu)
        m_hat = (mu / correction).to(dtype)
        if group["normalize_grads"]:
            m_hat = m_hat / (torch.linalg.vector_norm(m_hat) + 1e-6)
        momenta.append(m_hat)
    return momenta


def _fit_due(group: dict[str, Any], states: list) -> bool:
    """Whether the factors are fitted this step (the step policy's
    :func:`fit_due`): the first, then once 1/p(n) steps have passed."""
    probability = probability_at(
        group["preconditioner_update_probability"], states[0][STEP]
    )
    return fit_due(states, probability, first_step=True)


def _apply_updates(bucket: list, updates: list[torch.Tensor]) -> None:
    """θ ← θ − lr·(U + λθ), U = P·m̂ scaled to an RMS of at most 1.1 (and divided
    by 5 with ``lr_style='adam'``); on this rank's shard of a DTensor θ."""
    group = bucket[0][0]
    lr, decay = scalar(group["lr"]), group["weight_decay"]
    for (_, p, _), u in zip(bucket, updates, strict=True):
        rms = u.float().square().mean().sqrt()
        u = u * (MAX_UPDATE_RMS / torch.clamp(rms, min=MAX_UPDATE_RMS)).to(u.dtype)
        if group["lr_style"] == "adam":
            u = u / ADAM_STYLE_DIVISOR
        u = u.reshape(p.shape).to(p.dtype)
        local = local_value(p)
        local.add_(local_part(p, u) + decay * local, alpha=-lr)


def _check_dtype(name: str, value: Any) -> None:
    if value not in DTYPES:
        raise ValueError(
            f"Invalid {name}={value!r}: must be torch.float32 or torch.bfloat16"
        )


def _check_seed(name: str, value: Any) -> None:
    check_int(name, value)


# Every per-group argument and its check (Invalid <name>=<value!r>: must be ...),
# in the signature's order. The arguments precond.jax.pro takes under the same
# name and rule are checked by precond._common.pro_arguments; the rest are
# torch's own and checked here: lr and weight_decay (the alias's in JAX) and the
# dtype (a torch dtype).
_SHARED = PRO_SHARED_ARGUMENT_CHECKS
GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", shared.check_lr),
    ("lr_style", _SHARED["lr_style"]),
    ("b1", _SHARED["b1"]),
    ("weight_decay", lambda n, v: check_real(n, v, low=0.0)),
    ("normalize_grads", _SHARED["normalize_grads"]),
    ("max_size_dense", _SHARED["max_size_dense"]),
    ("preconditioner_lr", _SHARED["preconditioner_lr"]),
    ("preconditioner_init_scale", _SHARED["preconditioner_init_scale"]),
    ("preconditioner_update_style", _SHARED["preconditioner_update_style"]),
    ("dtype", _check_dtype),
    ("block_size", _SHARED["block_size"]),
    ("noise_scale", _SHARED["noise_scale"]),
    ("preconditioner_update_probability", _SHARED["preconditioner_update_probability"]),
)
# The optimizer-wide arguments and their checks.
OPTIMIZER_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("seed", _check_seed),
)
