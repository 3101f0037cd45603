"""pro's layout (precond._common.pro_layout): equal blocks of the whole model
share one stack, and every block keeps its place in distributed-kron 2.0's key
streams (its draws; the JAX parity tests check the draws themselves)."""

import numpy as np

from precond._common.pro_layout import _plan, stream_kind


def _units(stack):
    """[(stream, index)] of each unit of ``stack``, in order."""
    return [(stream, int(i)) for stream, index in stack.keys for i in index]


def test_equal_blocks_of_different_parameters_share_one_stack():
    # Two vectors of 6, one of 4; two (5, 3) matrices whose long side is
    # diagonal (max_size_dense=4), dense sides cut into blocks of 2.
    shapes = [(6,), (4,), (6,), (5, 3), (5, 3)]
    plan = _plan(shapes, [False] * len(shapes), 4, 2, 1)
    groups = [
        (stream_kind(s.keys[0][0]), s.diagonal, s.shape, s.draw_shape)
        for s in plan.stacks
    ]
    assert len(groups) == len(set(groups)) == 4
    by_shape = {s.shape: s for s in plan.stacks}
    assert [r.leaf for r in by_shape[(6,)].regions] == [0, 2]
    assert _units(by_shape[(6,)]) == [(("vector", 0), 0), (("vector", 2), 0)]
    assert _units(by_shape[(4,)]) == [(("vector", 1), 0)]
    # Each matrix is its own 'columns' stream (distributed-kron's): its full
    # block is unit 0 of it, its remainder unit 1.
    assert _units(by_shape[(5, 2)]) == [(("columns", 3), 0), (("columns", 4), 0)]
    assert _units(by_shape[(5, 1)]) == [(("columns", 3), 1), (("columns", 4), 1)]
    assert plan.stream_sizes[("columns", 3)] == plan.stream_sizes[("columns", 4)] == 2


def test_every_block_keeps_its_key_and_padding_takes_index_0():
    # A scanned (2, 3, 2) parameter: 2 layers of 3 × 2, blocks of 2 → per
    # layer a (2, 2) and a (1, 2) block, in the shared 'dense' stream (4 keys)
    # after another dense (2, 2) block; stacks padded to the pipeline size 2.
    shapes = [(2, 2), (2, 3, 2)]
    plan = _plan(shapes, [False, True], 4, 2, 2)
    by_shape = {s.shape: s for s in plan.stacks}
    assert plan.stream_sizes == {"dense": 6}
    # Layer-major order in each parameter: layer b's blocks are 2b and 2b + 1.
    padding = ("dense", 0)
    assert _units(by_shape[(2, 2)]) == [
        ("dense", 0),
        ("dense", 1),
        ("dense", 3),
        padding,
    ]
    assert by_shape[(2, 2)].padding == 1
    assert by_shape[(2, 2)].units == 4
    assert _units(by_shape[(1, 2)]) == [("dense", 2), ("dense", 4)]
    assert by_shape[(1, 2)].padding == 0
    for stack in plan.stacks:
        assert all(isinstance(index, np.ndarray) for _, index in stack.keys)
