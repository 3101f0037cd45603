"""precond.torch.SOAP against the float64 NumPy reference
(``tests/reference/soap_reference.py``, the definition), in float64: 26 calls
(25 Adam steps, bases refreshed at t = 5, 10, ..., 25) on fixed random gradient
streams, displacement of the parameter equal to a relative 1e-10.

Well-posedness. An eigenbasis is unique only up to its columns' signs (the
update is sign-invariant) and, for a repeated eigenvalue, up to a rotation inside
its eigenspace (the update is not invariant: V is taken coordinate-wise). The
first call's statistic S_k = (1−β)·G ⋅_{¬k} G has rank at most the product of
the other dims: a (5, 7) matrix's 7×7 statistic has rank 5, a vector's (with
``precondition_1d``) rank 1, so the first bases are arbitrary inside the null
space (eigenvalue 0, repeated), and two LAPACK calls may pick different ones;
the power steps then carry that choice on. So after the first call each test
checks that the bases agree (up to sign) on the columns of nonzero eigenvalue
and hands precond's bases to the reference; from there every basis is a
continuous function of well-conditioned data: random streams give statistics
of full rank and distinct eigenvalues by the first refresh.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from precond._common.blocking import axis_segments, grid_regions
from precond.torch import SOAP
from precond.torch.soap._soap_layout import layout
from precond.torch.soap.soap import BASES
from tests.reference.soap_reference import SoapReference

STEPS = 26

CASES = {
    "matrix": ((5, 7), {}),
    "square_matrix": ((6, 6), {"lr": 0.01}),
    "tensor_3d": ((3, 4, 5), {}),
    "merge_dims": ((2, 3, 5), {"merge_dims": True, "max_precond_dim": 8}),
    "one_dim_above_max": ((4, 20), {"max_precond_dim": 10}),
    "all_dims_above_max_adam": ((12, 15), {"max_precond_dim": 10}),
    "vector_adam": ((7,), {}),
    "vector_precondition_1d": ((6,), {"precondition_1d": True}),
    "scalar": ((), {}),
    "normalize_grads": ((5, 7), {"normalize_grads": True}),
    "no_bias_correction": ((5, 7), {"correct_bias": False}),
    "refresh_eigh": ((5, 7), {"refresh": "eigh"}),
    "refresh_eigh_3d": ((3, 4, 5), {"refresh": "eigh"}),
    "weight_decay": ((5, 7), {"weight_decay": 0.5, "lr": 0.02}),
    "no_weight_decay": ((5, 7), {"weight_decay": 0.0}),
    "shampoo_beta": ((5, 7), {"shampoo_beta": 0.8, "betas": (0.9, 0.99)}),
    "block_size": ((6, 8), {"block_size": 4}),
    "block_size_3d": ((5, 4, 3), {"block_size": 3, "refresh": "eigh"}),
}


def _blocks(x: np.ndarray, block_size: int | None) -> list[np.ndarray]:
    """The blocks of ``x`` in precond's order: region by region
    (``grid_regions``), each region's blocks in row-major order of its grid."""
    out = []
    for region in grid_regions([axis_segments(d, block_size) for d in x.shape]):
        for index in itertools.product(*[range(n) for n in region.grid]):
            out.append(
                x[
                    tuple(
                        slice(s + i * b, s + (i + 1) * b)
                        for s, i, b in zip(
                            region.starts, index, region.block_shape, strict=True
                        )
                    )
                ]
            )
    return out


def _unblock(shape, blocks, block_size) -> np.ndarray:
    x, k = np.empty(shape), 0
    for region in grid_regions([axis_segments(d, block_size) for d in shape]):
        for index in itertools.product(*[range(n) for n in region.grid]):
            x[
                tuple(
                    slice(s + i * b, s + (i + 1) * b)
                    for s, i, b in zip(
                        region.starts, index, region.block_shape, strict=True
                    )
                )
            ] = blocks[k]
            k += 1
    return x


def _our_bases(optimizer, p) -> list[list[np.ndarray]]:
    """precond's bases per block (precond's block order), per axis with one."""
    lay = layout(p.shape, optimizer.param_groups[0])
    flat, per_block, start = optimizer.state[p][BASES], [], 0
    for region, axes in zip(lay.regions, lay.axes, strict=True):
        stacks = flat[start : start + len(axes)]
        start += len(axes)
        for b in range(region.count):
            per_block.append([q[b].numpy() for q in stacks])
    return per_block


def _hand_over_bases(optimizer, p, references) -> None:
    """Checks the first bases agree up to sign on the columns of nonzero
    eigenvalue, then gives the reference precond's (module docstring)."""
    for ours, ref in zip(_our_bases(optimizer, p), references, strict=True):
        axes = [k for k, s in enumerate(ref.statistics) if s is not None]
        assert len(axes) == len(ours)
        for k, q in zip(axes, ours, strict=True):
            s, theirs = ref.statistics[k], ref.bases[k]
            values = np.diag(theirs.T @ s @ theirs)
            for j in np.flatnonzero(values > 1e-9 * values.max()):
                a, b = q[:, j], theirs[:, j]
                assert min(np.abs(a - b).max(), np.abs(a + b).max()) < 1e-9
            ref.bases[k] = q.copy()


@pytest.mark.parametrize("case", list(CASES))
def test_soap_matches_the_float64_reference(case):
    shape, kwargs = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    start = rng.standard_normal(shape)
    p = torch.nn.Parameter(torch.tensor(start))
    optimizer = SOAP([p], precondition_frequency=5, **kwargs)
    block_size = kwargs.get("block_size")
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "block_size"}
    if block_size is None:
        references = [SoapReference(shape, precondition_frequency=5, **ref_kwargs)]
        values = [start.copy()]
    else:
        values = _blocks(start.copy(), block_size)
        references = [
            SoapReference(v.shape, precondition_frequency=5, **ref_kwargs)
            for v in values
        ]
    for call in range(STEPS):
        g = rng.standard_normal(shape)
        p.grad = torch.tensor(g)
        optimizer.step()
        grads = [g] if block_size is None else _blocks(g, block_size)
        values = [r.step(v, h) for r, v, h in zip(references, values, grads)]
        if call == 0:
            _hand_over_bases(optimizer, p, references)
    expected = values[0] if block_size is None else _unblock(shape, values, block_size)
    moved = expected - start
    error = np.abs(p.detach().numpy() - expected).max() / np.abs(moved).max()
    assert error < 1e-10, error
    assert optimizer.state[p]["step"] == STEPS
