"""Small helpers on tensors that every step calls: casts and reshapes that skip
their no-op dispatch, the working precision, a learning rate as a number, and
copies of (nested lists of) tensors to a device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without dispatching a no-op when ``t`` already has it (a
    step does this for every parameter, where the dispatch costs more than the
    check)."""
    return t if t.dtype == dtype else t.to(dtype)


def as_shape(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t.reshape(shape)``, without dispatching a no-op when ``t`` has it."""
    return t if t.shape == shape else t.reshape(shape)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: ``dtype`` for float64 and complex128, else float32 or
    complex64 (torch's promotion with float32, without dispatching an operator
    each call: a step asks it per bucket)."""
    if dtype in (torch.float64, torch.complex128):
        return dtype
    return torch.complex64 if dtype.is_complex else torch.float32


def scalar(value: Any) -> float:
    """A learning rate as a Python number (a tensor ``lr`` is read once)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def copy_to_device(value: Any, device: torch.device) -> Any:
    """A copy of a tensor, or of a (nested) list of tensors, on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    return [copy_to_device(v, device) for v in value]
