"""SOAP over ``torch.distributed``: 2 and 4 gloo ranks under DDP (with
``Replicated`` and with ``ShardedPreconditioning``) and FSDP2 (``fully_shard``,
DTensor parameters) equal one process, with Shampoo's harness and cases
(``tests/torch/shampoo/test_shampoo_distributed.py``: the model, the NaN step,
the resumed runs, the checks).

Every case ends bitwise where one process fed the ranks' gradients does, its
state bitwise that process's, ShardedPreconditioning included: each owner runs
the one-process arithmetic on its parameters (the eigh and QR of a stack are
LAPACK's per matrix, so a rank's smaller batch changes no result) and shares
its steps, rounded to the parameter's dtype, by an exact all-gather. One
process on the whole global batch, whose gradients differ by the order of the
collectives' sums (~1 ulp), agrees within TOLERANCE: 1e-12 in float64
(measured 5.5e-15 with 2 ranks, 2e-14 with 4), but only 5e-5 in float32
(measured 9.9e-6 with 2 ranks, 2.8e-6 with 4). Not this implementation's
doing: in one process, gradients scaled by 1 ± 1 ulp at random move the
first Adam step by 5e-6 (plain Adam, ``max_precond_dim=0``: 3e-8). The first
bases are the eigenvectors of one gradient's statistic, whose near-equal
eigenvalues let an ulp rotate them by ~ulp·‖S‖/gap, and Adam's first step,
≈ sign(G') per coordinate of the eigenbasis, turns that rotation into
lr·rotation.
"""

from __future__ import annotations

import pytest

from precond.torch import SOAP
from tests.torch.shampoo.test_shampoo_distributed import check_world

TOLERANCE = {"float64": 1e-12, "float32": 5e-5}


def make_soap(params, strategy, dtype_name):
    """Bases refreshed every 2 Adam steps, weight decay; float64: QR refreshes
    of blocks of 5 (uneven: 5 + 4), float32: eigh refreshes of whole tensors.
    The 1-D parameters take Adam's step: a 1-D statistic g·gᵀ is degenerate
    (the harness's docstring)."""
    float64 = dtype_name == "float64"
    return SOAP(
        params,
        lr=0.01,
        weight_decay=0.01,
        precondition_frequency=2,
        refresh="qr" if float64 else "eigh",
        block_size=5 if float64 else None,
        strategy=strategy,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_equal_one_process(tmp_path, world_size):
    check_world(tmp_path, world_size, make_soap, True, TOLERANCE)
