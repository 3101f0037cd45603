"""Which axes of a tensor get a dense (triangular) factor and which a diagonal one.

The rule is shared by every Kronecker-factored optimizer in precond, in both
frameworks, so that a parameter gets the same preconditioner structure in JAX and
in PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def merge_dims(
    shape: Sequence[int], target_merged_dim_size: int
) -> tuple[tuple[int, ...], ...]:
    """Groups adjacent axes of ``shape`` so the merged dims precondition well.

    Among all ways to cut ``shape`` into runs of adjacent axes, picks the one that

    1. keeps at least two merged dims when ``shape`` has two or more (flattening a
       tensor to a vector would give one dense factor of numel² numbers),
    2. keeps every merged dim <= ``target_merged_dim_size`` (an axis already larger
       stays alone),
    3. then has the fewest merged dims (fewer, larger Kronecker factors model more
       of the curvature),
    4. then is the most balanced: the largest smallest merged dim, then the smallest
       Σ dᵢ² (factor memory).

    So (64, 32, 3, 3) with target 2048 becomes (64, 288), not (18432,) nor
    (6144, 3) (factors of 38M numbers for 18k parameters) nor (2048, 9) (a 9×9
    factor adds little); (3, 3, 64, 64) becomes (576, 64) and (2, 3, 4, 5, 6)
    becomes (24, 30).

    Returns:
        The axis groups, e.g. ((0,), (1, 2, 3)); merged dim i is the product of
        ``shape`` over group i. A scalar gives ().

    Example:
        >>> merge_dims((64, 32, 3, 3), 2048)
        ((0,), (1, 2, 3))
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        return ()
    best_key, best_groups = None, None
    for cuts in range(2 ** (len(shape) - 1)):  # bit i set: cut after axis i
        groups, start = [], 0
        for axis in range(len(shape)):
            if axis == len(shape) - 1 or cuts >> axis & 1:
                groups.append(tuple(range(start, axis + 1)))
                start = axis + 1
        if len(groups) < min(2, len(shape)):
            continue
        dims = [_product(shape[a] for a in group) for group in groups]
        oversized = sum(
            d > target_merged_dim_size and len(g) > 1
            for d, g in zip(dims, groups, strict=True)
        )
        key = (oversized, len(dims), -min(dims), sum(d * d for d in dims))
        if best_key is None or key < best_key:
            best_key, best_groups = key, tuple(groups)
    # The cut after every axis always qualifies, so some cut was chosen.
    assert best_groups is not None
    return best_groups


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Google Shampoo's greedy merge of adjacent small dims (``best_effort_shape_
    interpretation``): walking left to right, multiply dims into the current one
    while the product stays <= ``max_dim``; size-1 dims vanish; an all-ones shape
    becomes (1,). Kron's :func:`merge_dims` searches for the best cut instead;
    Shampoo keeps this rule so that it plans exactly as the optimizer it replaces.

    Example:
        >>> merge_small_dims((1, 2, 512, 1, 2048, 1, 3, 4), 1024)
        (1024, 2048, 12)
    """
    shape = tuple(int(d) for d in shape)
    if shape and all(d == 1 for d in shape):
        return (1,)
    merged, product = [], 1
    for d in shape:
        if product * d <= max_dim:
            product *= d
        else:
            if product > 1:
                merged.append(product)
            product = d
    if product > 1:
        merged.append(product)
    return tuple(merged)


def _product(values) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def merge_dims_by_loss(
    shape: Sequence[int], target_merged_dim_size: int
) -> tuple[tuple[int, ...], ...]:
    """distributed-kron 1.0.0's merge rule: the cut into runs of adjacent axes that
    minimises Σ loss(dᵢ) over the merged dims dᵢ, where with t the target

        loss(d) = log₂(t/d) + 100·log₂(t/(8d))·[d < t/8]       for d < t,
        loss(d) = 10·log₂(d/t) + 1000·log₂(d/(8t))·[d > 8t]    for d >= t.

    Small dims are penalised hard, so a small tensor may merge into one long axis
    (a (128, 10) kernel becomes (1280,) under target 4096). Ties go to the cut
    listed first when cuts are listed by the length of their first run, shortest
    first, then recursively by the rest. An all-ones shape is one group; a scalar
    gives ().

    Example:
        >>> merge_dims_by_loss((128, 10), 4096)
        ((0, 1),)
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        return ()
    if all(d == 1 for d in shape):
        return (tuple(range(len(shape))),)
    target = target_merged_dim_size

    def loss(d: int) -> float:
        value = 0
        if d < target:
            value += np.log2(target / d)
            if d < target / 8:
                value += 100 * np.log2(target / 8 / d)
        else:
            value += 10 * np.log2(d / target)
            if d > 8 * target:
                value += 1000 * np.log2(d / (8 * target))
        return value

    def cuts(start: int):
        """Every cut of axes start..n-1 into runs, shortest first run first."""
        if start == len(shape):
            yield []
            return
        for end in range(start + 1, len(shape) + 1):
            for rest in cuts(end):
                yield [tuple(range(start, end)), *rest]

    best_loss, best_groups = float("inf"), None
    for groups in cuts(0):
        total = 0
        for group in groups:
            total += loss(_product(shape[a] for a in group))
        if total < best_loss:
            best_loss, best_groups = total, tuple(groups)
    # Positive dims give a finite loss, so the first cut already beats inf.
    assert best_groups is not None
    return best_groups
