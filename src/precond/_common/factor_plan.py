"""Which axes of a tensor get a dense (triangular) factor and which a diagonal one.

The rule is shared by every Kronecker-factored optimizer in precond, in both
frameworks, so that a parameter gets the same preconditioner structure in JAX and
in PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence

MEMORY_SAVE_MODES = (None, "one_diag", "all_diag")


def plan_diagonal_axes(
    shape: Sequence[int],
    *,
    max_size_triangular: int,
    min_ndim_triangular: int,
    memory_save_mode: str | None,
) -> tuple[bool, ...]:
    """Returns, per axis of ``shape``, True where that axis gets a diagonal factor.

    An axis is diagonal when its size is 1, when its size exceeds
    ``max_size_triangular``, when the tensor has fewer than ``min_ndim_triangular``
    dimensions, or when ``memory_save_mode`` selects it: ``'one_diag'`` makes the
    largest axis diagonal (the last one among equally large axes), ``'all_diag'``
    makes every axis diagonal. A scalar (shape ``()``) is planned as shape ``(1,)``.

    Example:
        >>> plan_diagonal_axes((256, 128), max_size_triangular=8192,
        ...                    min_ndim_triangular=2, memory_save_mode="one_diag")
        (True, False)
    """
    if memory_save_mode not in MEMORY_SAVE_MODES:
        raise ValueError(
            f"Invalid memory_save_mode={memory_save_mode!r}: must be one of "
            + ", ".join(repr(m) for m in MEMORY_SAVE_MODES)
        )
    shape = tuple(int(d) for d in shape) or (1,)
    diagonal = [
        d == 1 or d > max_size_triangular or len(shape) < min_ndim_triangular
        for d in shape
    ]
    if memory_save_mode == "all_diag":
        diagonal = [True] * len(shape)
    elif memory_save_mode == "one_diag":
        largest = max(shape)
        last_largest = max(i for i, d in enumerate(shape) if d == largest)
        diagonal[last_largest] = True
    return tuple(diagonal)
