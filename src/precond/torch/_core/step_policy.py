"""The step policy of precond's torch optimizers: the step count and the
schedule of the factor fits (the same state keys in every optimizer), generators
seeded from integers (the same draws on every rank and in every resumed run),
and the decision to skip a step whose gradients are unusable (NaN, ±Inf, or so
large that their squared norm overflows), with the per-entry check of a fit."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from precond.torch._core.dtensor import local_value
from precond.torch._core.tensors import as_dtype, scalar, working_dtype

# Keys of self.state[p] that the policy keeps: the 1-based count of steps taken
# and the steps since the last factor fit (ints, saved in state dicts).
STEP, UPDATE_COUNTER = "step", "update_counter"


def count_step(states: list[dict[str, Any]]) -> int:
    """Counts a step in each of ``states`` (states stepped together share their
    count); returns the new 1-based step n of the first."""
    for state in states:
        state[STEP] += 1
    return states[0][STEP]


def probability_at(probability: float | Callable[[int], float], step: int) -> float:
    """An update probability at the 1-based ``step``: a number as is, a
    function of the step called."""
    if callable(probability):
        return probability(step)
    return probability


def fit_due(
    states: list[dict[str, Any]],
    probability: float | None = None,
    *,
    drawn: bool | None = None,
    first_step: bool = False,
) -> bool:
    """Counts the steps since the last fit in each of ``states``; whether the
    factors are fitted this step: once 1/p steps have passed (p =
    ``probability``, in float32 as both frameworks compare it), or as a draw
    made elsewhere decided (``drawn``: Kron's ``seed=None``), and on the first
    step with ``first_step``. A due fit resets the count."""
    for state in states:
        state[UPDATE_COUNTER] += 1
    if drawn is not None:
        due = drawn
    else:
        due = (first_step and states[0][STEP] == 1) or states[0][
            UPDATE_COUNTER
        ] >= 1.0 / np.float32(probability)
    if due:
        for state in states:
            state[UPDATE_COUNTER] = 0
    return bool(due)


def seeded_generator(device: torch.device, *integers: int) -> torch.Generator:
    """A generator seeded from integers (a seed, a step, an index...): the same
    draws on every rank, process, Python build and platform.

    Its seed is the first 8 bytes of BLAKE2b over the integers' decimal text
    joined by commas (b"42,7,-1"), read little-endian, modulo 2⁶³."""
    text = ",".join(str(int(i)) for i in integers).encode("ascii")
    digest = hashlib.blake2b(text, digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") % (2**63))
    return generator


def _working_tensor(g: torch.Tensor) -> torch.Tensor:
    """``g`` in its working precision (:func:`working_dtype`: float32, or float64
    for float64 and complex128), complex entries as (real, imaginary) pairs."""
    g = as_dtype(g, working_dtype(g.dtype))
    return torch.view_as_real(g) if g.is_complex() else g


def gradients_are_usable(grads: list[torch.Tensor]) -> bool:
    """True when every gradient's squared norm Σ|g|² is finite in its working
    precision (float32, or float64 for float64/complex128 gradients): False for
    NaN and ±Inf entries, and for finite entries so large (≳ 1.8e19 in float32)
    that their squares overflow, as :func:`precond.jax.kron`'s guard.

    Σ|g|² is ‖g‖², each squared in its gradient's working precision: finite
    when Σ|g|² is (up to rounding at the precision's largest value), however
    ``torch._foreach_norm`` reaches ‖g‖ (it takes |g| for one entry, so
    ‖[3e19]‖ is finite in float32 where its square is not). Two fused calls
    over the real views, where one ``torch.dot`` per gradient dispatched as
    many operators as there are parameters; one host sync per step."""
    norms = torch._foreach_norm(  # pyright: ignore[reportPrivateImportUsage]
        [_working_tensor(g) for g in grads]
    )
    squared_norms = torch._foreach_mul(  # pyright: ignore[reportPrivateImportUsage]
        norms, norms
    )
    # Stacking promotes float32 values to float64 where both occur: exactly.
    return bool(torch.stack(squared_norms).isfinite().all())


def skipped_for_unusable_gradients(
    entries: list[tuple[dict, torch.Tensor, int]],
    grads: list[torch.Tensor] | None = None,
) -> bool:
    """True when some gradient of ``entries`` (or ``grads``, their whole
    gradients where the parameters are sharded) is unusable
    (:func:`gradients_are_usable`): the step is skipped, its state unchanged, and
    only the decoupled weight decay is applied."""
    if grads is None:
        grads = cast("list[torch.Tensor]", [p.grad for _, p, _ in entries])
    if gradients_are_usable(grads):
        return False
    for group, p, _ in entries:
        local_value(p).mul_(1 - scalar(group["lr"]) * group["weight_decay"])
    return True


def finite_entries(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per stack entry, whether every value of every (B, ...) tensor is finite:
    (B,) booleans.

    x·0 is 0 for a finite x and NaN for ±inf and NaN, so the sum of x·0 over an
    entry is finite exactly when all of its values are (a sum of zeros cannot
    overflow): two passes over each tensor, where ``torch.isfinite`` makes four
    on a CPU (a composite of abs, ne, eq and the product of the two masks)."""
    sums = torch.stack([(x * 0).reshape(x.shape[0], -1).sum(dim=1) for x in tensors])
    return sums.isfinite().all(dim=0)
