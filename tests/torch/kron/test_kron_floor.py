"""benchmarks/_torch_kron_floor.py, the floor under kron-torch's step that
``peer_speed.py`` times, does the algorithm's products: its preconditioning,
triangular solves and grams equal precond.torch's kernels (float64, 1-D
parameters worked on as (d, 1) matrices), for triangular and diagonal factors."""

from __future__ import annotations

import pytest
import torch
from benchmarks import _torch_kron_floor as floor

from precond.torch._core import factor_kernels as km

STACK = 3
CASES = [
    ((5, 7), (False, False)),
    ((5, 7), (False, True)),
    ((5, 7), (True, False)),
    ((6,), (False,)),
    ((6,), (True,)),
]


def _factors(shape, diagonal, generator):
    """Well-conditioned upper-triangular (or positive diagonal) factors."""
    options = dict(generator=generator, dtype=torch.float64)
    return [
        torch.rand(STACK, d, **options) + 0.5
        if diag
        else torch.triu(torch.randn(STACK, d, d, **options)) + 3 * torch.eye(d).double()
        for d, diag in zip(shape, diagonal, strict=True)
    ]


@pytest.mark.parametrize(("shape", "diagonal"), CASES, ids=str)
def test_floor_products_are_the_kernels(shape, diagonal):
    generator = torch.Generator().manual_seed(0)
    Qs = _factors(shape, diagonal, generator)
    X = torch.randn(STACK, *shape, generator=generator, dtype=torch.float64)
    worked = X if len(shape) == 2 else X[..., None]  # the floor's (d, 1) vectors

    exact = dict(rtol=1e-12, atol=0)
    U = worked
    B = worked
    for axis, Q in enumerate(Qs):
        U = floor._product(U, Q, axis, transpose=False)
        U = floor._product(U, Q, axis, transpose=True)
        B = floor._solve(B, Q, axis)
        torch.testing.assert_close(
            floor._gram(worked, axis, Q.ndim == 2),
            km.unfold_gram(X, axis, km.is_diagonal(Q)),
            **exact,
        )
    torch.testing.assert_close(U.reshape(X.shape), km.precondition(Qs, X), **exact)
    expected = X
    for axis, Q in enumerate(Qs):
        expected = km.solve_transposed_along_axis(Q, expected, axis)
    torch.testing.assert_close(B.reshape(X.shape), expected, **exact)
