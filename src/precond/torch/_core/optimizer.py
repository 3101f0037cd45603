"""The base of precond's torch optimizers (Kron, Pro, ProAdamW, Shampoo,
SOAP): the step's preamble (the closure, the gradients to use, the count of
skipped steps), the argument tables and the learning-rate check, the momentum
under torch's name, copies and pickling, checked param groups, state loads
that keep dtypes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.validation import check_real
from precond.torch._core.dtensor import check_dtensor_parameter, full_gradients
from precond.torch._core.step_policy import skipped_for_unusable_gradients
from precond.torch._core.tensors import copy_to_device

# Key of the optimizer's count of skipped steps, in its first param group (from
# the first skip on; precond's K-FAC, as KAISA's, keeps its step count there
# too), so that whatever saves an optimizer (torch.save, torch.distributed.
# checkpoint) saves it, and no parameter gets a partial state.
SKIPPED_STEPS = "skipped_steps"
# Where Kron, Pro and ProAdamW log (K-FAC logs on its child, precond.torch.kfac):
# one name, whichever module the optimizer's class lives in.
LOGGER = logging.getLogger("precond.torch")
# The momentum β₁: its argument name (the seeds'), and the param-group key that
# torch's schedulers read and set (OneCycleLR and CyclicLR with
# cycle_momentum=True), which holds the same value.
B1, MOMENTUM_ALIAS = "b1", "momentum"
_check_b1 = KRON_SHARED_ARGUMENT_CHECKS[B1]  # [0, 1), Kron's and Pro's rule


def eager_step(step: Callable) -> Callable:
    """An optimizer's ``step``, left out of ``torch.compile``'s tracing: under
    ``torch.compile(optimizer.step)``, or a compiled training step that calls
    it, it runs eagerly as written (the compiled code breaks its graph there).

    Traced, the step broke into dozens of graphs (it branches on host values:
    the usable-gradients check, the fit schedule) whose per-bucket Python
    dynamo re-specialised bucket by bucket, past its recompile limit, and it
    ran slower than eagerly. What the step
    compiles itself (``compile_kernels``) is still compiled.

    ``torch.compiler.disable`` is applied at the first call, not here: it
    imports torch._dynamo, which would double ``import precond.torch``'s time
    (about 1 s) for users who never compile."""

    disabled: Callable | None = None

    @functools.wraps(step)
    def step_eagerly(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(step)
        return disabled(*args, **kwargs)

    return step_eagerly


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """``closure()`` with gradients enabled (an optimizer's ``step(closure)``), or
    None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def gradient_entries(
    param_groups: list[dict], check_gradient: Callable[[torch.Tensor], None]
) -> list[tuple[dict, torch.Tensor, int]]:
    """(group, parameter, index among all the parameters) of each non-empty
    parameter that has a gradient, in order; ``check_gradient(p)`` refuses the
    gradients the optimizer cannot take."""
    entries, index = [], 0
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None and p.numel() > 0:
                check_gradient(p)
                entries.append((group, p, index))
            index += 1
    return entries


def tensor_checks(
    optimizer: str, complex_allowed: bool
) -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]]:
    """The checks of an optimizer's parameters (at construction) and of their
    gradients (each step): floating parameters (and complex ones where
    ``complex_allowed``), DTensors only where torch can gather them, dense
    gradients of the parameter's kind. Errors name ``optimizer`` (``"Kron"``).
    """

    def check_parameter(p: torch.Tensor) -> None:
        check_dtensor_parameter(p, f"precond.torch.{optimizer}")
        if p.is_floating_point() or (complex_allowed and p.is_complex()):
            return
        kinds = "floating and complex" if complex_allowed else "real floating-point"
        raise TypeError(
            f"Invalid parameter of dtype {p.dtype}: {optimizer} supports {kinds} "
            "parameters"
        )

    def check_gradient(p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:  # gradient_entries checks only parameters with a gradient
            return
        if grad.is_sparse:
            raise RuntimeError(
                f"{optimizer} does not support sparse gradients "
                "(e.g. nn.Embedding(sparse=True))"
            )
        if grad.is_complex() != p.is_complex() or not (
            grad.is_floating_point() or grad.is_complex()
        ):
            raise RuntimeError(
                f"{optimizer} got a gradient of dtype {grad.dtype} for a parameter "
                f"of dtype {p.dtype}"
            )

    return check_parameter, check_gradient


def check_lr(name: str, value: Any) -> None:
    """A number >= 0, or a one-element floating tensor holding one (as
    ``torch.optim.Adam`` accepts, and refuses with the same words)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"Invalid {name}={value!r}: Tensor {name} must be 1-element"
            )
        if not value.is_floating_point():
            raise ValueError(
                f"Invalid {name}={value!r}: a tensor {name} must be floating"
            )
        value = value.item()
    check_real(name, value, low=0.0)


def check_arguments(arguments: dict[str, Any], table) -> None:
    """Runs each ``(name, check)`` of ``table`` on ``arguments[name]``: raises
    ``Invalid <name>=<value!r>: must be ...`` at the first bad one."""
    for name, check in table:
        check(name, arguments[name])


def group_defaults(arguments: dict[str, Any], table) -> dict[str, Any]:
    """The per-group arguments named by ``table`` (a constructor's ``locals()``),
    in the table's order: an optimizer's ``defaults``."""
    return {name: arguments[name] for name, _ in table}


def saved_parameters(
    param_groups: list[dict], state_dict: dict[str, Any]
) -> dict[Any, torch.Tensor]:
    """Each key that ``state_dict``'s groups list (a parameter's index, or the
    name ``torch.distributed.checkpoint`` gives it) → the parameter at the same
    place in ``param_groups``, as torch's ``load_state_dict`` pairs them."""
    return {
        key: p
        for saved, group in zip(state_dict["param_groups"], param_groups, strict=True)
        for key, p in zip(saved["params"], group["params"], strict=True)
    }


def _with_momentum_alias(defaults: dict[str, Any], b1: str = B1) -> dict[str, Any]:
    """``defaults`` with ``momentum`` next to ``b1`` (the momentum's argument
    name), holding its value."""
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        out[key] = value
        if key == b1:
            out[MOMENTUM_ALIAS] = value
    return out


def _momentum_conflict(group: dict[str, Any], name: str = B1) -> str | None:
    """What is wrong when a group gives ``name`` (the momentum's argument name,
    ``b1``) and ``momentum`` different values."""
    if name in group and MOMENTUM_ALIAS in group:
        b1, momentum = group[name], group[MOMENTUM_ALIAS]
        if bool(b1 != momentum):
            return (
                f"{name}={b1!r} and momentum={momentum!r} differ: momentum is "
                f"another name of {name} (the key torch's schedulers set), so give "
                "one of them, or equal values"
            )
    return None


def _fill_momentum_alias(group: dict[str, Any], name: str = B1) -> str:
    """Gives a group that names one of ``name`` (the momentum's argument name,
    ``b1``) and ``momentum`` the other too; returns the name it gave (``name``
    if it gave both or neither)."""
    if name in group:
        group.setdefault(MOMENTUM_ALIAS, group[name])
        return name
    if MOMENTUM_ALIAS in group:
        group[name] = group[MOMENTUM_ALIAS]
        return MOMENTUM_ALIAS
    return name


class CheckedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose copies and pickles keep its public
    attributes, whose new param groups are checked (``_check_param_group``)
    and refused whole, leaving the optimizer as it was, whose momentum ``b1`` is
    also each group's ``momentum`` (:meth:`_sync_momentum`), and which counts
    the steps it skips (:attr:`skipped_steps`). A subclass whose momentum has
    another argument name (Shampoo's ``beta1``) sets ``_momentum_name`` and
    ``_check_momentum`` (the rule ``momentum`` is checked by)."""

    _momentum_name: str = B1
    _check_momentum: Callable[[str, Any], None] = staticmethod(_check_b1)

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        # Per group (by id): (the group, its b1 at the last sync).
        self._synced_momenta: dict[int, tuple[dict, Any]] = {}
        self._warned_skip = False
        super().__init__(params, _with_momentum_alias(defaults, self._momentum_name))

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, groups) plus every public attribute
        (the seed, and any a subclass or user sets), so that ``copy.deepcopy``
        and ``pickle`` give an optimizer that steps exactly like this one."""
        self._sync_momentum()
        public = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return {**public, **super().__getstate__()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, run by copies, pickles and ``load_state_dict``, less the
        ``differentiable`` it adds to the defaults (an option these optimizers
        lack, which every group added later would inherit); groups saved with
        ``b1`` alone get ``momentum`` too."""
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("_warned_skip", False)
        b1 = self._momentum_name
        for group in (self.defaults, *self.param_groups):
            _fill_momentum_alias(group, b1)
        self._synced_momenta = {id(g): (g, g.get(b1)) for g in self.param_groups}

    def state_dict(self) -> dict[str, Any]:
        self._sync_momentum()
        return super().state_dict()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        b1 = given = self._momentum_name
        if isinstance(param_group, dict):  # torch's refuses anything else
            problem = _momentum_conflict(param_group, b1)
            if problem:
                raise ValueError(f"Invalid param group: {problem}")
            given = _fill_momentum_alias(param_group, b1)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            if given == MOMENTUM_ALIAS:
                self._check_momentum(MOMENTUM_ALIAS, group[MOMENTUM_ALIAS])
            self._check_param_group(group)
        except Exception:
            self.param_groups.pop()
            raise
        self._synced_momenta[id(group)] = (group, group[b1])

    def _sync_momentum(self) -> None:
        """Makes each group's ``b1`` and ``momentum`` equal, to the one that was
        changed since the last sync (``momentum``, the schedulers', if both
        were). Run before each step and each save."""
        synced, name = self._synced_momenta, self._momentum_name
        for group in self.param_groups:
            b1 = group[name]
            momentum = group.setdefault(MOMENTUM_ALIAS, b1)
            if not bool(b1 != momentum):
                continue
            seen, value = synced.get(id(group), (None, None))
            b1_changed = seen is group and not bool(momentum != value)
            group[name] = group[MOMENTUM_ALIAS] = b1 if b1_changed else momentum
        self._synced_momenta = {id(g): (g, g[name]) for g in self.param_groups}

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped because a gradient was unusable (NaN,
        ±Inf, or so large that its squared norm overflows): since the optimizer
        was made, or over the run whose state it loaded. After the first skip
        it is kept in the first param group, ``param_groups[0]['skipped_steps']``,
        so state dicts and copies keep it."""
        return self.param_groups[0].get(SKIPPED_STEPS, 0)

    def _skipped_for_unusable_gradients(
        self,
        entries: list[tuple[dict, torch.Tensor, int]],
        grads: list[torch.Tensor] | None = None,
        *,
        decay: bool = True,
    ) -> bool:
        """:func:`skipped_for_unusable_gradients`, counting a skipped step in
        :attr:`skipped_steps`; the first skip is logged at WARNING on the
        ``precond.torch`` logger (once per optimizer object). With ``decay``
        False (Shampoo, whose JAX twin returns zero updates) the parameters
        do not move either, not even by weight decay."""
        if grads is None:
            grads = cast("list[torch.Tensor]", [p.grad for _, p, _ in entries])
        if not skipped_for_unusable_gradients(entries if decay else [], grads):
            return False
        first = self.param_groups[0]
        first[SKIPPED_STEPS] = first.get(SKIPPED_STEPS, 0) + 1
        if not self._warned_skip:
            self._warned_skip = True
            LOGGER.warning(
                "%s skipped a step: a gradient is NaN, ±Inf or so large that its "
                "squared norm overflows, so no state changed and the parameters "
                "%s. optimizer.skipped_steps counts such steps; this warning is "
                "not repeated.",
                type(self).__name__,
                "moved by weight decay alone" if decay else "did not move",
            )
        return True

    def _usable_entries(
        self, check_gradient: Callable[[torch.Tensor], None], *, decay: bool = True
    ) -> tuple[list[tuple[dict, torch.Tensor, int]], list[torch.Tensor]] | None:
        """The step's preamble: ``(entries, gradients)``, the (group, parameter,
        index) of each parameter with a gradient (:func:`gradient_entries`,
        which refuses through ``check_gradient`` a gradient the optimizer cannot
        take) and their whole gradients (a DTensor's gathered on every rank);
        None when there is nothing to step: no parameter has a gradient, or one
        is unusable and the step is skipped
        (:meth:`_skipped_for_unusable_gradients`, whose ``decay`` this is)."""
        entries = gradient_entries(self.param_groups, check_gradient)
        if not entries:
            return None
        grads = full_gradients([p for _, p, _ in entries])
        if self._skipped_for_unusable_gradients(entries, grads, decay=decay):
            return None
        return entries, grads

    def _load_keeping_dtypes(
        self, state_dict: dict[str, Any], kept: tuple[str, ...]
    ) -> None:
        """torch's ``load_state_dict``, then the ``kept`` entries of each
        parameter's state as saved (copied to its device): torch would cast
        them to the parameter's dtype. The state's keys are found through the
        saved groups (:func:`saved_parameters`). A group whose ``b1`` and
        ``momentum`` differ (an edited state dict: saves make them equal) is
        refused, as it is unclear which is meant."""
        for g, group in enumerate(state_dict["param_groups"]):
            problem = _momentum_conflict(group, self._momentum_name)
            if problem:
                raise ValueError(f"Invalid state_dict: in param group {g}, {problem}")
        params = saved_parameters(self.param_groups, state_dict)
        saved = {
            key: {name: entry[name] for name in kept if name in entry}
            for key, entry in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        for key, entries in saved.items():
            p = params[key]
            for name, value in entries.items():
                self.state[p][name] = copy_to_device(value, p.device)

    def _check_param_group(self, group: dict[str, Any]) -> None:
        """Raises for a group's bad hyperparameter or parameter."""
        raise NotImplementedError
