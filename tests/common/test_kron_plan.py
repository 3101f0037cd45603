"""Kron's planning layer on shapes alone (precond._common.kron_plan, kron_constants,
kron_arguments): what each parameter's units are, how they are stacked, and the
constants and argument checks both frameworks share. No jax, no torch."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precond._common.factor_plan import plan_diagonal_axes
from precond._common.kron_arguments import KRON_SHARED_ARGUMENT_CHECKS
from precond._common.kron_constants import (
    PRECONDITIONER_CACHES,
    UPDATE_STYLES,
    stored_cache,
)
from precond._common.kron_plan import (
    PADDING_UNIT,
    TensorPlan,
    merge_planned_axes,
    plan_stacks,
    plan_tensor,
    seed_factor_sizes,
    unit_extents,
)


def plan(shape, *, scanned=False, block_size=None, **options):
    arguments = dict(
        max_size_triangular=8192,
        min_ndim_triangular=2,
        memory_save_mode=None,
        merge_small_dims=True,
        target_merged_dim_size=4096,
    )
    arguments.update(options)
    return plan_tensor(
        shape, scanned=scanned, path="['p']", block_size=block_size, **arguments
    )


def test_importing_the_planning_layer_imports_no_framework():
    code = (
        "import sys, precond._common.kron_plan, precond._common.kron_arguments, "
        "precond._common.pro_arguments, precond._common.pro_layout; "
        "assert not {'jax', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_scalar_is_one_diagonal_axis_and_a_scanned_scalar_is_refused():
    assert plan(()) == TensorPlan(False, (1,), (True,), (1,))
    with pytest.raises(ValueError, match=r"scanned_layers: parameter \['p'\] is 0-d"):
        plan((), scanned=True)


def test_merging_groups_axes_and_keeps_diagonal_only_where_every_source_is():
    conv = plan((64, 32, 3, 3))
    assert conv.shape == (64, 288)
    assert conv.diagonal == (False, False)
    one_diag = plan((64, 32, 3, 3), memory_save_mode="one_diag")
    assert one_diag.shape == (64, 288)
    assert one_diag.diagonal == (True, False)  # 64 was the largest axis
    # distributed-kron's rule merges a small matrix into one long axis.
    assert plan((128, 10), merge_rule="distributed_kron").shape == (1280,)


def test_a_merged_axis_longer_than_max_size_triangular_is_diagonal():
    merged = plan((10, 20, 30), max_size_triangular=100, target_merged_dim_size=600)
    assert merged.shape == (200, 30)  # every source axis <= 100, the merge is not
    assert merged.diagonal == (True, False)


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    max_size_triangular=st.integers(0, 400),
    target=st.integers(1, 2000),
    memory_save_mode=st.sampled_from([None, "one_diag", "all_diag"]),
    merge_rule=st.sampled_from(["balanced", "distributed_kron"]),
)
def test_plan_tensor_merges_by_merge_planned_axes_on_its_own_diagonal_axes(
    shape, max_size_triangular, target, memory_save_mode, merge_rule
):
    """plan_tensor = plan_diagonal_axes on the unmerged axes, then
    merge_planned_axes (the function torch Kron calls after its own rules)."""
    shape = tuple(shape)
    options = dict(
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=2,
        memory_save_mode=memory_save_mode,
    )
    planned = plan(
        shape, target_merged_dim_size=target, merge_rule=merge_rule, **options
    )
    diagonal = plan_diagonal_axes(shape, **options)
    merged = merge_planned_axes(
        shape,
        diagonal,
        target_merged_dim_size=target,
        max_size_triangular=max_size_triangular,
        merge_rule=merge_rule,
    )
    assert (planned.shape, planned.diagonal) == merged
    assert math.prod(merged[0]) == math.prod(shape)


def test_merge_planned_axes_keeps_a_diagonal_decided_before_the_merge():
    """A merged axis is diagonal iff all its sources are (whatever rule made them
    diagonal) or, with the balanced rule only, it is longer than
    max_size_triangular."""
    options = dict(target_merged_dim_size=600, max_size_triangular=1000)
    assert merge_planned_axes((10, 20, 30), (True, True, False), **options) == (
        (200, 30),
        (True, False),
    )
    assert merge_planned_axes((10, 20, 30), (True, False, True), **options) == (
        (200, 30),
        (False, True),
    )
    long = dict(target_merged_dim_size=600, max_size_triangular=100)
    assert merge_planned_axes((10, 20, 30), (False,) * 3, **long) == (
        (200, 30),
        (True, False),
    )
    # distributed-kron's rule never makes a merged axis diagonal for its length.
    by_loss = merge_planned_axes(
        (128, 10), (False, False), merge_rule="distributed_kron", **long
    )
    assert by_loss == ((1280,), (False,))


def test_blocks_cut_triangular_axes_and_keep_diagonal_axes_whole():
    blocked = plan((600, 40), block_size=256, max_size_triangular=500)
    assert blocked.diagonal == (True, False)
    assert blocked.block_shape == (600, 40)
    assert blocked.blocks_per_axis == (1, 1)
    cut = plan((600, 40), block_size=256)
    assert cut.block_shape == (256, 40)
    assert cut.blocks_per_axis == (3, 1)
    assert cut.padded_shape == (768, 40)


def test_distributed_kron_padding_pads_every_axis_to_whole_blocks_and_fits_it():
    fitted = plan((600, 40), block_size=256, block_padding="distributed_kron")
    assert fitted.fitted_padding
    assert fitted.block_shape == (256, 256)
    assert unit_extents(fitted, ()).tolist() == [[256, 256]] * 3
    assert seed_factor_sizes(fitted, blocked=True, block_size=256) == [256, 256]
    inert = plan((600, 40), block_size=256)
    assert seed_factor_sizes(inert, blocked=True, block_size=256) == [256, 256]
    assert seed_factor_sizes(inert, blocked=False, block_size=256) == [256, 40]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=0, max_size=3),
    layers=st.integers(1, 3),
    block_size=st.integers(1, 24),
)
def test_the_units_of_a_parameter_tile_it_exactly(shape, layers, block_size):
    """Inert padding: the valid extents of a parameter's units cover each layer's
    merged shape once, so Σ_units Π extent = numel."""
    scanned = plan((layers, *shape), scanned=True, block_size=block_size)
    extents = unit_extents(scanned, (layers,))
    assert len(extents) == layers * math.prod(scanned.blocks_per_axis)
    assert int(np.prod(extents, axis=1).sum()) == layers * math.prod(shape)
    assert np.all(extents <= np.array(scanned.block_shape))


def test_stacks_group_equal_units_pad_to_the_shards_and_skip_empty_parameters():
    shapes = [(300, 40), (0, 5), (40, 300), (3, 40, 40), (7,)]
    plans = [
        plan((300, 40), block_size=128),
        plan((0, 5), block_size=128),
        plan((40, 300), block_size=128),
        plan((3, 40, 40), scanned=True, block_size=128),
        plan((7,), block_size=128, complex=True),
    ]
    stacks = plan_stacks(plans, shapes, units_multiple_of=4)
    assert all(1 not in stack.members for stack in stacks)  # no entries, no units
    for stack in stacks:
        assert len(stack.extents) % 4 == 0
        real = stack.unit_ids[:, 0] != PADDING_UNIT
        assert stack.real_units == int(real.sum())
        assert not stack.extents[~real].any()  # padding units are empty
        ids = {tuple(i) for i in stack.unit_ids[real]}
        assert len(ids) == stack.real_units  # each unit once
    by_members = {stack.members: stack for stack in stacks}
    # (300, 40) cut to 128-row blocks; its 44-row edge has the shape of the
    # others' blocks only if equal, so the two matrices stack by block shape.
    assert by_members[(0,)].block_shape == (128, 40)
    assert by_members[(2,)].block_shape == (40, 128)
    assert by_members[(3,)].real_units == 3  # one unit per layer
    assert by_members[(4,)].complex  # complex units stack alone


def test_a_full_factor_style_stores_its_packed_cache_dense():
    assert stored_cache("packed", "PRO") == stored_cache("packed", "QEQ") == "dense"
    for style in UPDATE_STYLES:
        for cache in PRECONDITIONER_CACHES:
            full = style in ("PRO", "QEQ")
            expected = "dense" if full and cache == "packed" else cache
            assert stored_cache(cache, style) == expected


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("b1", 1.0),
        ("max_size_triangular", -1),
        ("min_ndim_triangular", 1.5),
        ("momentum_into_precond_update", "yes"),
        ("merge_small_dims", 1),
        ("target_merged_dim_size", 0),
        ("preconditioner_update_style", "eq"),
        ("preconditioner_cache", "lower"),
    ],
)
def test_the_shared_argument_checks_name_the_argument_and_its_value(name, bad):
    with pytest.raises((ValueError, TypeError), match=rf"Invalid {name}={bad!r}"):
        KRON_SHARED_ARGUMENT_CHECKS[name](name, bad)
