"""Factor planning: diagonal vs triangular axes (algorithms.md Part 1 §1.1), merging."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precond._common.factor_plan import (
    MEMORY_SAVE_MODES,
    merge_dims,
    plan_diagonal_axes,
)


def plan(shape, *, max_size=8192, min_ndim=2, mode=None):
    return plan_diagonal_axes(
        shape,
        max_size_triangular=max_size,
        min_ndim_triangular=min_ndim,
        memory_save_mode=mode,
    )


def test_defaults_give_every_axis_a_triangular_factor():
    assert plan((256, 128)) == (False, False)
    assert plan((3, 4, 5)) == (False, False, False)


def test_size_one_axes_are_diagonal():
    assert plan((1, 5)) == (True, False)
    assert plan((4, 1, 3)) == (False, True, False)
    assert plan((1, 1)) == (True, True)


def test_axes_larger_than_max_size_triangular_are_diagonal():
    assert plan((10, 3), max_size=8) == (True, False)
    # The bound is inclusive: a dimension equal to it stays triangular.
    assert plan((8, 9, 3), max_size=8) == (False, True, False)
    assert plan((8193, 8192)) == (True, False)
    assert plan((2, 3), max_size=0) == (True, True)


def test_tensors_with_fewer_than_min_ndim_triangular_dims_are_all_diagonal():
    assert plan((5,)) == (True,)
    assert plan((5,), min_ndim=1) == (False,)
    assert plan((5, 4), min_ndim=3) == (True, True)
    assert plan((5, 4, 3), min_ndim=3) == (False, False, False)
    assert plan((5, 4), min_ndim=0) == (False, False)


def test_one_diag_makes_the_last_of_the_largest_axes_diagonal():
    assert plan((256, 128), mode="one_diag") == (True, False)
    assert plan((4, 6, 6), mode="one_diag") == (False, False, True)
    assert plan((6, 4, 6), mode="one_diag") == (False, False, True)
    assert plan((6, 6, 4), mode="one_diag") == (False, True, False)
    assert plan((7,), min_ndim=1, mode="one_diag") == (True,)
    # It adds to the other rules, never removes a diagonal axis.
    assert plan((1, 3), mode="one_diag") == (True, True)
    assert plan((20, 3, 5), max_size=10, mode="one_diag") == (True, False, False)


def test_all_diag_makes_every_axis_diagonal():
    assert plan((256, 128), mode="all_diag") == (True, True)
    assert plan((2, 3, 4), min_ndim=1, mode="all_diag") == (True, True, True)


def test_scalar_is_planned_as_a_length_one_vector():
    for mode in MEMORY_SAVE_MODES:
        assert plan((), mode=mode) == (True,)
        assert plan((), min_ndim=0, mode=mode) == (True,)


def test_accepts_any_integer_sequence():
    assert plan([5, np.int64(1)]) == (False, True)
    assert plan(np.array([3, 4])) == (False, False)


@pytest.mark.parametrize("mode", ["smart_one_diag", "", "ONE_DIAG", 1])
def test_unknown_memory_save_mode_raises_value_error_naming_it(mode):
    with pytest.raises(ValueError, match="memory_save_mode") as info:
        plan((3, 4), mode=mode)
    message = str(info.value)
    assert message.startswith(f"Invalid memory_save_mode={mode!r}: must be one of ")
    for valid in MEMORY_SAVE_MODES:
        assert repr(valid) in message


@settings(max_examples=200, deadline=None, database=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=0, max_size=5),
    max_size=st.integers(0, 50),
    min_ndim=st.integers(0, 4),
    mode=st.sampled_from(MEMORY_SAVE_MODES),
)
def test_matches_the_rules_on_random_shapes(shape, max_size, min_ndim, mode):
    dims = shape or [1]
    expected = [d == 1 or d > max_size or len(dims) < min_ndim for d in dims]
    if mode == "all_diag":
        expected = [True] * len(dims)
    elif mode == "one_diag":
        expected[len(dims) - 1 - int(np.argmax(dims[::-1]))] = True
    got = plan(shape, max_size=max_size, min_ndim=min_ndim, mode=mode)
    assert got == tuple(expected)
    assert all(type(x) is bool for x in got)


@pytest.mark.parametrize(
    ("shape", "target", "merged"),
    [
        ((64, 32, 3, 3), 2048, (64, 288)),  # not (18432,), (6144, 3) or (2048, 9)
        ((3, 3, 64, 64), 2048, (576, 64)),  # HWIO conv kernel
        ((64, 256), 2048, (64, 256)),
        ((512, 2048), 2048, (512, 2048)),
        ((4096, 4096), 2048, (4096, 4096)),  # too big alone: untouched
        ((2, 3, 4, 5, 6), 2048, (24, 30)),  # never flattened to one dim
        ((10, 10, 10, 10), 2048, (100, 100)),
        ((8, 1, 1, 1024), 2048, (8, 1024)),
        ((1, 512), 2048, (1, 512)),
        ((7,), 2048, (7,)),
        ((), 2048, ()),
    ],
)
def test_merge_dims_examples(shape, target, merged):
    groups = merge_dims(shape, target)
    assert tuple(math.prod(shape[a] for a in g) for g in groups) == merged


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=0, max_size=6).map(tuple),
    target=st.integers(1, 5000),
)
def test_merge_dims_properties(shape, target):
    groups = merge_dims(shape, target)
    # The groups cut the axes into contiguous runs, in order.
    assert [a for g in groups for a in g] == list(range(len(shape)))
    assert all(list(g) == list(range(g[0], g[-1] + 1)) for g in groups)
    # A tensor stays a tensor; no merge creates a dim above the target.
    assert len(groups) >= min(2, len(shape))
    for g in groups:
        assert len(g) == 1 or math.prod(shape[a] for a in g) <= target


def test_merge_dims_by_loss_examples():
    from precond._common.factor_plan import merge_dims_by_loss

    assert merge_dims_by_loss((128, 10), 4096) == ((0, 1),)  # one 1280-long axis
    assert merge_dims_by_loss((784, 128), 4096) == ((0,), (1,))
    assert merge_dims_by_loss((1, 1, 1), 4096) == ((0, 1, 2),)
    assert merge_dims_by_loss((), 4096) == ()


def test_merge_dims_by_loss_equals_distributed_kron():
    """The merged shapes of distributed-kron 1.0.0 (the oracle) on 2,000 random
    shapes and targets."""
    import math
    import random

    from precond._common.factor_plan import merge_dims_by_loss
    from tests import oracles

    dk = oracles.distributed_kron()
    rng = random.Random(0)
    sizes = (1, 2, 3, 4, 5, 8, 10, 16, 32, 64, 100, 128, 256, 512, 784, 3000, 10000)
    for _ in range(2000):
        shape = tuple(rng.choice(sizes) for _ in range(rng.randint(1, 5)))
        target = rng.choice((16, 256, 2048, 4096))
        theirs, _, _ = dk._merge_small_dims(shape, target, [False] * len(shape))
        groups = merge_dims_by_loss(shape, target)
        ours = [math.prod(shape[a] for a in group) for group in groups]
        assert ours == [int(d) for d in theirs], (shape, target)
