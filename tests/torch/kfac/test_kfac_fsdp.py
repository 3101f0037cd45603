"""precond.torch.kfac.KFAC on FSDP2 (``fully_shard``) DTensor parameters equals
one process on the global batch.

One spawned gloo run per world size (2, 4; the harness of
tests/torch/spawned.py). Every rank shards test_kfac_distributed's float64 CNN
(every Conv2d and Linear, then the root) with ``fully_shard`` on an
``init_device_mesh("cpu", (world,))`` mesh: the layers' dim 0 (4, 6, 16 and 10
output channels) splits unevenly over 4 ranks (conv2: 2, 2, 2, 0). It trains with
SGD and KFAC(model) on its rows of each global batch, for some of
test_kfac_distributed's configurations (each KAISA strategy, eigen and inverse),
and writes the whole preconditioned gradients of every step and the final whole
parameters. KFAC gathers each layer's whole gradient (G⁻¹∇A⁻¹ mixes its rows),
preconditions it as under DDP and writes back the rank's shard.

Measured max relative difference from one process (gradients every step and
parameters, both world sizes): ~3e-15; RELATIVE_TOLERANCE = 1e-10 as for DDP.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.torch.kfac.test_kfac_distributed import (
    GLOBAL_BATCH,
    RELATIVE_TOLERANCE,
    STEPS,
    batch,
    build,
    make,
    relative_error,
    single_process,
)
from tests.torch.spawned import check_spawned_cases

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

CONFIG_NAMES = (
    "comm-opt-eigen",
    "hybrid-opt-inverse-symmetric",
    "mem-opt-eigen-not-colocated-unbucketed",
)


def distributed_run(config_name, rank, world_size, out_dir):
    """One rank of one configuration: each step's whole preconditioned
    gradients and the final parameters."""
    del out_dir  # the result is returned
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer, preconditioner = make(model, model, config_name)
    shard = GLOBAL_BATCH // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    grads = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        preconditioner.step()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        optimizer.step()
    return {
        "grads": grads,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "layers": len(preconditioner.layers),
    }


def check(results, config_name):
    """Raises AssertionError at the first disagreement; returns the largest
    relative difference."""
    ref_grads, ref_params = single_process(config_name)
    worst = 0.0
    for rank, result in enumerate(results):
        assert result["layers"] == 4, result["layers"]
        pairs = [
            (f"step {step}, grad of {name}", value, ref[name])
            for step, (grads, ref) in enumerate(
                zip(result["grads"], ref_grads, strict=True)
            )
            for name, value in grads.items()
        ]
        pairs += [(name, v, ref_params[name]) for name, v in result["params"].items()]
        for what, value, reference in pairs:
            error = relative_error(value, reference)
            worst = max(worst, error)
            assert error <= RELATIVE_TOLERANCE, (
                f"rank {rank}, {what}: relative difference {error:.3g} > "
                f"{RELATIVE_TOLERANCE:g}"
            )
    return worst


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_equals_single_process(tmp_path, world_size):
    worst = check_spawned_cases(
        tmp_path, world_size, CONFIG_NAMES, distributed_run, check
    )
    print(f"{world_size} ranks, max relative difference: {worst}")
