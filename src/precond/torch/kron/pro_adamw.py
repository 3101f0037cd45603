"""pro on the hidden weight matrices and AdamW on the rest, as one
``torch.optim.Optimizer``: the recipe of :func:`precond.jax.pro_adamw` (the
setting measured best on the bench's char-lm), with the same defaults, the same
rule for which parameters pro takes, and the same steps.

Pro's part is :class:`precond.torch.Pro`'s step, run on the parameters pro
takes with each group's rate times ``pro_lr_multiplier``; AdamW's is written
here (batched ``torch._foreach`` operations) as optax's ``adamw`` computes it.
One state dict holds both parts (checkpoints, ``load_state_dict``), and every
group's ``lr`` is AdamW's, so that LR schedulers drive both.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from precond._common import pro_adamw_recipe as recipe
from precond._common.validation import check_real
from precond.torch._core import optimizer as shared
from precond.torch._core import step_policy
from precond.torch._core.dtensor import looks_like_dtensor
from precond.torch._core.step_policy import count_step
from precond.torch._core.tensors import scalar
from precond.torch.kron import pro as pro_module
from precond.torch.kron.pro import Pro
from precond.torch.kron.schedule import precond_update_prob_schedule

__all__ = ["ProAdamW"]

# Keys of self.state[p] of AdamW's parameters (torch.optim.AdamW's names; the
# step count is an int, as Pro's).
EXP_AVG, EXP_AVG_SQ = "exp_avg", "exp_avg_sq"
STEP = step_policy.STEP
# A param group's choice of part: True (pro), False (AdamW), None (the rule).
PRECONDITIONED = "preconditioned"

# The default update-probability schedule (a param group holds None for it, so
# that its state dict pickles).
_DEFAULT_SCHEDULE = precond_update_prob_schedule(
    **recipe.PRO_UPDATE_PROBABILITY_SCHEDULE
)


@functools.lru_cache(maxsize=4096)
def _named_hidden_matrix(name: str, ndim: int) -> bool:
    return recipe.is_hidden_matrix(recipe.torch_name_parts(name), ndim)


def takes_pro(choice: bool | None, name: str | None, ndim: int) -> bool:
    """Whether pro takes a parameter of ``ndim`` dimensions called ``name``
    (None: given without names) in a group whose ``preconditioned`` is
    ``choice``: the choice if given; else the rule of
    :func:`precond._common.pro_adamw_recipe.is_hidden_matrix` on the name, or,
    without a name, every parameter of at least 2 dimensions."""
    if choice is not None:
        return bool(choice)
    if name is None:
        return ndim >= 2
    return _named_hidden_matrix(name, ndim)


class ProAdamW(Pro):
    """PSGD pro on the hidden weight matrices and AdamW on the other
    parameters, given AdamW's learning rate: θ ← θ − c·lr·(U + λθ), with U
    pro's update (:class:`precond.torch.Pro`, ``lr_style='adam'``) and c =
    ``pro_lr_multiplier`` on the matrices, U = m̂/(√v̂ + ε) and c = 1 on the
    rest. Steps equal :func:`precond.jax.pro_adamw`'s given the same draws.

    Which parameters pro takes: a param group's ``preconditioned`` key, True
    (all of its parameters) or False (none); or, with None (the default), the
    rule of :func:`precond.jax.pro_adamw` on the parameters' names when they
    are given (``model.named_parameters()``): at least 2-D and named neither
    an embedding (a word starting with 'emb') nor, in the first name or the
    last two, a position table or an output head ('wte', 'wpe', 'pos',
    'position', 'positional', 'head', 'logits', 'output', 'classifier',
    'readout'); parameters given without names: every one of at least 2
    dimensions (embeddings and heads included: give names, or put them in a
    group with ``preconditioned=False``).

    A step with an unusable gradient anywhere (NaN, ±Inf, or a squared norm
    that overflows) changes no state and moves the parameters by weight decay
    alone; it is counted in :attr:`skipped_steps`. Every group's ``lr`` is
    AdamW's (LR schedulers set it; pro's rate follows), ``momentum`` is
    pro's ``b1`` (the key torch's schedulers cycle). Parameters must be real
    floating tensors; DDP works as for Pro (the same draws on every rank),
    FSDP2's DTensor parameters are refused (Pro takes them; AdamW's part here
    does not yet).

    Args:
        params: named parameters (``model.named_parameters()``), parameters,
            or param groups; every argument but ``seed`` may be set per group.
        lr: AdamW's learning rate (a float or a one-element tensor).
        b1: pro's momentum coefficient in [0, 1) (bias-corrected).
        adam_betas: AdamW's (β₁, β₂), each in [0, 1).
        adam_eps: AdamW's ε, added to √v̂.
        weight_decay: decoupled weight decay λ of both parts.
        pro_lr_multiplier: pro's rate over ``lr``.
        preconditioned: True, False or None: which parameters pro takes (above).
        preconditioner_update_style: pro's fit, 'QEQ', 'PRO' or 'QUAD'.
        preconditioner_update_probability: p in (0, 1], a function of the step
            n, or None for ``precond_update_prob_schedule(min_prob=0.2,
            decay=0.005, flat_start=200)``: fit on the first step, then once
            1/p steps have passed.
        preconditioner_lr: the fit's step size η (over the Lipschitz estimate).
        preconditioner_init_scale: every factor starts as this times identity.
        normalize_grads: divide each of pro's momentum tensors by its norm first.
        max_size_dense: matrix sides longer than this get a diagonal factor.
        block_size: length of the blocks a dense side is cut into.
        noise_scale: δ, the floor of the fit's damping noise.
        dtype: torch.float32 or torch.bfloat16, of pro's momentum and factors.
        seed: an int seeding pro's draws (with the step and the stack).

    Example (pro takes ``mlp.weight``; AdamW the embedding, the head and the
    bias):
        >>> from collections import OrderedDict
        >>> model = torch.nn.Sequential(OrderedDict(
        ...     embedding=torch.nn.Embedding(16, 8),
        ...     mlp=torch.nn.Linear(8, 8),
        ...     head=torch.nn.Linear(8, 16, bias=False),
        ... ))
        >>> optimizer = ProAdamW(model.named_parameters(), lr=3e-3)
        >>> model(torch.tensor([[1, 2]])).square().sum().backward()
        >>> optimizer.step()
        >>> sorted(n for n, p in model.named_parameters()
        ...        if "factors" in optimizer.state[p])
        ['mlp.weight']
    """

    # AdamW's moments too: loaded as copies, as Pro's factors, so that a state
    # dict taken from a live optimizer shares no tensor with it.
    _KEPT_STATE = (*Pro._KEPT_STATE, EXP_AVG, EXP_AVG_SQ)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        *,
        b1: float = recipe.PRO_B1,
        adam_betas: tuple[float, float] = (recipe.ADAM_B1, recipe.ADAM_B2),
        adam_eps: float = recipe.ADAM_EPS,
        weight_decay: float = recipe.WEIGHT_DECAY,
        pro_lr_multiplier: float = recipe.PRO_LR_MULTIPLIER,
        preconditioned: bool | None = None,
        preconditioner_update_style: str = recipe.PRO_UPDATE_STYLE,
        preconditioner_update_probability: float | Callable[[int], float] | None = None,
        preconditioner_lr: float = 0.5,
        preconditioner_init_scale: float = 1.0,
        normalize_grads: bool = False,
        max_size_dense: int = 16384,
        block_size: int = 256,
        noise_scale: float = 1e-9,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        shared.check_arguments(locals(), OPTIMIZER_ARGUMENTS)
        defaults = shared.group_defaults(locals(), GROUP_ARGUMENTS)
        self.seed = seed
        shared.CheckedOptimizer.__init__(self, params, defaults)

    def _check_param_group(self, group: dict[str, Any]) -> None:
        shared.check_arguments(group, GROUP_ARGUMENTS)
        for p in group["params"]:
            if looks_like_dtensor(p):
                raise TypeError(
                    "Invalid parameter: a DTensor (FSDP2); ProAdamW takes plain "
                    "tensors (DDP works), precond.torch.Pro takes DTensors"
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"Invalid parameter of dtype {p.dtype}: ProAdamW supports real "
                    "floating parameters"
                )

    @shared.eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; ``closure`` re-evaluates the loss (grads enabled)."""
        loss = shared.closure_loss(closure)
        self._sync_momentum()
        entries = self._entries_by_part()
        everything = entries[True] + entries[False]
        if not everything:
            return loss
        if self._skipped_for_unusable_gradients(everything):
            return loss
        if entries[True]:
            self._step_entries(entries[True], [p.grad for _, p, _ in entries[True]])
        if entries[False]:
            _adamw_step(self.state, entries[False])
        return loss

    def _entries_by_part(self) -> dict[bool, list]:
        """(group, parameter, index) of each parameter with a gradient, under
        True for pro's part and False for AdamW's; pro's groups are views of
        the groups with pro's rate (lr × ``pro_lr_multiplier``), its
        ``lr_style`` and its resolved update probability."""
        entries = shared.gradient_entries(self.param_groups, pro_module._check_gradient)
        choices = {}
        views = {}
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for p, name in zip(group["params"], names, strict=True):
                choices[id(p)] = takes_pro(group[PRECONDITIONED], name, p.ndim)
            views[id(group)] = _pro_view(group)
        parts: dict[bool, list] = {True: [], False: []}
        for group, p, index in entries:
            if choices[id(p)]:
                parts[True].append((views[id(group)], p, index))
            else:
                parts[False].append((group, p, index))
        return parts


def _pro_view(group: dict[str, Any]) -> dict[str, Any]:
    """The group as Pro's step reads it: pro's rate, ``lr_style='adam'``, the
    update probability resolved."""
    probability = group["preconditioner_update_probability"]
    return {
        **group,
        "lr": scalar(group["lr"]) * group["pro_lr_multiplier"],
        "lr_style": "adam",
        "preconditioner_update_probability": (
            _DEFAULT_SCHEDULE if probability is None else probability
        ),
    }


def _adamw_step(state: dict, entries: list) -> None:
    """AdamW on the parameters of ``entries``, as optax's ``adamw``: m ← β₁m +
    (1 − β₁)g, v ← β₂v + (1 − β₂)g², U = (m/(1 − β₁ⁿ))/(√(v/(1 − β₂ⁿ)) + ε),
    θ ← θ − lr·(U + λθ); batched over the parameters of a group that share a
    step count."""
    buckets: dict[tuple, list] = defaultdict(list)
    for group, p, _ in entries:
        entry = state[p]
        if EXP_AVG not in entry:
            entry[STEP] = 0
            entry[EXP_AVG] = torch.zeros_like(p, memory_format=torch.preserve_format)
            entry[EXP_AVG_SQ] = torch.zeros_like(p, memory_format=torch.preserve_format)
        count_step([entry])
        buckets[(id(group), entry[STEP])].append((group, p, entry))
    for bucket in buckets.values():
        group, n = bucket[0][0], bucket[0][2][STEP]
        (b1, b2), eps = group["adam_betas"], group["adam_eps"]
        lr, decay = scalar(group["lr"]), group["weight_decay"]
        params = [p for _, p, _ in bucket]
        grads = [p.grad for p in params]
        m = [entry[EXP_AVG] for _, _, entry in bucket]
        v = [entry[EXP_AVG_SQ] for _, _, entry in bucket]
        torch._foreach_mul_(m, b1)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(m, grads, alpha=1 - b1)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(v, b2)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)  # pyright: ignore[reportPrivateImportUsage]
        denominator = torch._foreach_div(v, 1 - b2**n)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_sqrt_(denominator)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(denominator, eps)  # pyright: ignore[reportPrivateImportUsage]
        update = torch._foreach_div(m, 1 - b1**n)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_div_(update, denominator)  # pyright: ignore[reportPrivateImportUsage]
        if decay:
            torch._foreach_add_(update, params, alpha=decay)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(params, update, alpha=-lr)  # pyright: ignore[reportPrivateImportUsage]


def _check_betas(name: str, value: Any) -> None:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(
            f"Invalid {name}={value!r}: must be a pair (β₁, β₂), each in [0.0, 1.0)"
        )
    for index, beta in enumerate(value):
        check_real(f"{name}[{index}]", beta, low=0.0, high=1.0, high_inclusive=False)


def _check_probability(name: str, value: Any) -> None:
    recipe.check_probability_or_none(name, value, _PRO[name])


_PRO = dict(pro_module.GROUP_ARGUMENTS)
_RECIPE = recipe.PRO_ADAMW_ARGUMENT_CHECKS
# Every per-group argument and its check (Invalid <name>=<value!r>: must be
# ...), in the signature's order: pro's as torch Pro checks them, AdamW's and
# the recipe's own.
GROUP_ARGUMENTS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("lr", _PRO["lr"]),
    ("b1", _PRO["b1"]),
    ("adam_betas", _check_betas),
    ("adam_eps", _RECIPE["adam_eps"]),
    ("weight_decay", _PRO["weight_decay"]),
    ("pro_lr_multiplier", _RECIPE["pro_lr_multiplier"]),
    (PRECONDITIONED, recipe.check_bool_or_none),
    ("preconditioner_update_style", _PRO["preconditioner_update_style"]),
    ("preconditioner_update_probability", _check_probability),
    ("preconditioner_lr", _PRO["preconditioner_lr"]),
    ("preconditioner_init_scale", _PRO["preconditioner_init_scale"]),
    ("normalize_grads", _PRO["normalize_grads"]),
    ("max_size_dense", _PRO["max_size_dense"]),
    ("block_size", _PRO["block_size"]),
    ("noise_scale", _PRO["noise_scale"]),
    ("dtype", _PRO["dtype"]),
)
OPTIMIZER_ARGUMENTS = pro_module.OPTIMIZER_ARGUMENTS
