"""Kron's checkpoints: the checks of a saved state against the parameters (the
first mismatching entry named, nothing changed), loads that keep the state's
dtypes, and kron-torch 0.1.0's state dicts (momenta in the param groups)."""

from __future__ import annotations

from typing import Any

import torch

from precond.torch._core.optimizer import CheckedOptimizer
from precond.torch.kron._kron_state import (
    FACTORS,
    LIPSCHITZ,
    MOMENTUM,
    STEP,
    UPDATE_COUNTER,
    cache_layout,
    factor_plan,
    generation_2,
    state_dtypes,
)

# Key of kron-torch 0.1.0's param groups holding the momenta (loaded, not kept).
KRON_TORCH_MOMENTA = "momentum_buffer"


def _counter_problem(entry: dict) -> str | None:
    """What is wrong with the saved step and update counter, or None."""
    for key in (STEP, UPDATE_COUNTER):
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key!r} is {value!r}, expected an int >= 0"
    return None


def _tensor_problem(name: str, value: Any, shape, complex_: bool) -> str | None:
    """What makes ``value`` not a floating (or complex) tensor of ``shape``."""
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


def _factors_problem(
    p: torch.Tensor, group: dict[str, Any], factors: Any
) -> str | None:
    """What makes saved factors unfit for ``p``'s plan and cache layout."""
    shape, diagonal = factor_plan(p.shape, group)
    if not isinstance(factors, list | tuple) or len(factors) != len(shape):
        got = len(factors) if isinstance(factors, list | tuple) else factors
        return f"{FACTORS!r} has {got!r} factors, expected {len(shape)}"
    cache = cache_layout(group)
    for axis, (F, d, diag) in enumerate(zip(factors, shape, diagonal, strict=True)):
        if diag:
            expected = (d,)
        else:
            expected = {None: (d, d), "dense": (2, d, d), "packed": (d + 1, d)}[cache]
        problem = _tensor_problem(f"{FACTORS!r}[{axis}]", F, expected, p.is_complex())
        if problem:
            return problem
    return None


def _lipschitz_problem(estimates: Any, axes: int) -> str | None:
    """What makes saved Lipschitz estimates not ``axes`` real scalars."""
    if not isinstance(estimates, list | tuple) or len(estimates) != axes:
        return f"{LIPSCHITZ!r} has the wrong length, expected {axes}"
    for axis, L in enumerate(estimates):
        problem = _tensor_problem(f"{LIPSCHITZ!r}[{axis}]", L, (), False)
        if problem:
            return problem
    return None


def state_entry_problem(
    p: torch.Tensor, group: dict[str, Any], entry: Any
) -> str | None:
    """What makes a saved ``self.state[p]`` unfit for ``p`` under ``group``'s
    hyperparameters, or None."""
    if not isinstance(entry, dict):
        return f"state is a {type(entry).__name__}, expected a dict"
    keys = {STEP, UPDATE_COUNTER, MOMENTUM, FACTORS}
    if generation_2(group):
        keys.add(LIPSCHITZ)
    missing = sorted(keys - set(entry))
    if missing:
        return f"state lacks {missing[0]!r}"
    momentum = entry[MOMENTUM]
    return (
        _counter_problem(entry)
        or _tensor_problem(repr(MOMENTUM), momentum, p.shape, p.is_complex())
        or _factors_problem(p, group, entry[FACTORS])
        or (
            _lipschitz_problem(entry[LIPSCHITZ], len(entry[FACTORS]))
            if LIPSCHITZ in keys
            else None
        )
    )


def state_dict_problem(param_groups: list[dict], state_dict: Any) -> str | None:
    """The first entry of ``state_dict`` that does not fit the groups' parameters
    (checked against the saved groups' hyperparameters, which a load installs),
    or None."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(
        state_dict
    ):
        return "must be a dict with 'state' and 'param_groups'"
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        return f"{len(saved_groups)} param groups, expected {len(param_groups)}"
    known, position = set(), 0
    for g, (group, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            return (
                f"group {g} has {len(saved['params'])} parameters, expected "
                f"{len(group['params'])}"
            )
        hyper = {**group, **{k: v for k, v in saved.items() if k != "params"}}
        for p, index in zip(group["params"], saved["params"], strict=True):
            known.add(index)
            entry = state_dict["state"].get(index)
            problem = entry is not None and state_entry_problem(p, hyper, entry)
            if problem:
                return f"parameter {position} (group {g}) {problem}"
            position += 1
    unknown = [index for index in state_dict["state"] if index not in known]
    if unknown:
        return f"state for parameter {unknown[0]!r}, which no group lists"
    return None


class KronCheckpointing(CheckedOptimizer):
    """Kron's ``load_state_dict``: checked against the parameters first, keeping
    the saved dtypes, and taking kron-torch 0.1.0's state dicts too."""

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
