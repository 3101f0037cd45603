"""precond.torch.Kron and Pro on FSDP2 (``fully_shard``) DTensor parameters equal
one process on the global batch.

Each run spawns 2 or 4 gloo processes (the harness of tests/torch/spawned.py:
``file://`` rendezvous, timeouts on every collective and on the run). Every rank
shards the same model with ``fully_shard`` on an ``init_device_mesh("cpu",
(world,))`` mesh (parameters become DTensors sharded on dim 0), trains STEPS
steps on its rows of each global batch (FSDP2 reduce-scatters the mean
gradient), and writes its shards, the whole parameters, its optimizer state's
keys and a resume check to the temporary directory; the parent compares them
with one process on the whole batch.

The model has a 63-wide layer (dim 0 does not divide 2 or 4: shards of 16, 16,
16, 15), a 5-row layer (4 ranks: 2, 2, 1, 0 rows, one rank holds an empty
shard) and a one-element scale (fully_shard refuses 0-dim parameters: with 4
ranks three hold nothing), and a parameter that never gets a gradient. A NaN
in rank 0's rows at step ``PROBLEM.nan_step`` makes every rank skip that step,
as the single process does; a run resumed from a step-RESUME_AT
``state_dict``, and one resumed from a ``torch.distributed.checkpoint``
checkpoint of ``get_model_state_dict`` and ``get_optimizer_state_dict``
(parameter names for keys), must end bitwise where the uninterrupted one does.
Such a checkpoint saved on 4 ranks must also resume on 2 and end where one
process does.

Measured max relative difference (max |distributed − single| / max |single|, per
parameter, over all cases and ranks, 2 and 4 ranks): float64 9e-16, float32
6e-7 (Pro's 4e-7). The three tests together take ~60 s on 2 cores (beside
another test run).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from precond.torch import Kron, Pro, ShardedPreconditioning
from precond.torch._core.dtensor import is_dtensor
from tests.torch.small_net import (
    Problem,
    fully_sharded,
    load_checkpoint,
    local_values,
    rows_of,
    save_checkpoint,
)
from tests.torch.spawned import check_spawned_cases

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

STEPS = 10
RESUME_AT = 5  # the resumed run reloads the state_dict saved after this step
# A 63-wide hidden layer, 5 outputs; a NaN at step 3 (the step is skipped, only
# the weight decay applies).
PROBLEM = Problem(hidden=63, out_features=5, nan_step=3)
# Relative to the parameter's largest entry. float64: the only difference is the
# gradient reduction order (~1e-16), kept small by 10 Kron steps. float32: the
# same ~1e-7 relative gradient difference through the factor fits and clipping.
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}

# name → (dtype, ShardedPreconditioning, update_clipping): each strategy of Kron
# with each dtype and each clipping ('norm_and_value' with weight decay gathers
# θ); "pro-" cases run Pro (float32 state, its own clipping) instead.
CASES = {
    "replicated-float64": ("float64", False, "norm_and_value"),
    "sharded-float64": ("float64", True, "rms"),
    "replicated-float32": ("float32", False, "rms"),
    "sharded-float32": ("float32", True, "norm_and_value"),
    "pro-float32": ("float32", False, None),
}
WORLD_SIZES = (2, 4)


def optimizer_for(params, case_name, distributed=True):
    """The case's Kron or Pro; ``distributed=False``: the single process's
    (Replicated)."""
    dtype_name, sharded, clipping = CASES[case_name]
    if case_name.startswith("pro-"):
        return Pro(
            params, lr=0.05, weight_decay=0.01, preconditioner_update_probability=1.0
        )
    return Kron(
        params,
        lr=0.05,
        weight_decay=0.01,
        preconditioner_update_probability=1.0,
        precond_dtype=torch.float64 if dtype_name == "float64" else None,
        update_clipping=clipping,
        strategy=ShardedPreconditioning() if sharded and distributed else None,
    )


def sharded_model(case_name, world_size):
    """The case's model, ``fully_shard``-ed on a ``world_size`` CPU mesh."""
    model = fully_sharded(PROBLEM.build(CASES[case_name][0]), world_size)
    assert all(is_dtensor(p) for p in model.parameters())
    return model


def run_case(case_name, rank, world_size, out_dir):
    """FSDP2 training of one case, and the same steps again from the state saved
    after step RESUME_AT: its state_dict, and a torch.distributed.checkpoint
    checkpoint. Returns what the parent checks."""
    dtype_name = CASES[case_name][0]
    model = sharded_model(case_name, world_size)
    optimizer = optimizer_for(model.parameters(), case_name)
    rows = rows_of(rank, world_size)
    PROBLEM.train(model, optimizer, dtype_name, rows, range(RESUME_AT))
    saved_params = local_values(model)
    saved_state = copy.deepcopy(optimizer.state_dict())
    checkpoint = os.path.join(out_dir, f"checkpoint-{case_name}")
    save_checkpoint(model, optimizer, checkpoint)
    PROBLEM.train(model, optimizer, dtype_name, rows, range(RESUME_AT, STEPS))
    names = {id(p): n for n, p in model.named_parameters()}
    result = {
        "local": local_values(model),
        "full": {n: p.full_tensor() for n, p in model.named_parameters()},
        "stateful": sorted(names[id(p)] for p in optimizer.state),
        "momentum_shapes": {
            names[id(p)]: tuple(s["momentum"].shape) for p, s in optimizer.state.items()
        },
    }
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(saved_params[n])
    resumed = optimizer_for(model.parameters(), case_name)
    resumed.load_state_dict(saved_state)
    PROBLEM.train(model, resumed, dtype_name, rows, range(RESUME_AT, STEPS))
    result["resumed"] = local_values(model)
    resumed = optimizer_for(model.parameters(), case_name)
    load_checkpoint(model, resumed, checkpoint, CASES[case_name][1])
    PROBLEM.train(model, resumed, dtype_name, rows, range(RESUME_AT, STEPS))
    result["resumed_dcp"] = local_values(model)
    return result


def elastic_checkpoint(out_dir, case_name):
    """Where ``save_case`` saves and ``resume_case`` loads: beside the two
    runs' directories (each spawn needs its own, for its rendezvous file)."""
    return os.path.join(os.path.dirname(out_dir), f"elastic-{case_name}")


def save_case(case_name, rank, world_size, out_dir):
    """RESUME_AT steps of one case, then a checkpoint for ``resume_case``."""
    model = sharded_model(case_name, world_size)
    optimizer = optimizer_for(model.parameters(), case_name)
    PROBLEM.train(
        model,
        optimizer,
        CASES[case_name][0],
        rows_of(rank, world_size),
        range(RESUME_AT),
    )
    save_checkpoint(model, optimizer, elastic_checkpoint(out_dir, case_name))
    return {}


def resume_case(case_name, rank, world_size, out_dir):
    """The rest of ``save_case``'s run from its checkpoint, on ``world_size``
    ranks: the whole parameters at the end."""
    model = sharded_model(case_name, world_size)
    optimizer = optimizer_for(model.parameters(), case_name)
    load_checkpoint(
        model, optimizer, elastic_checkpoint(out_dir, case_name), CASES[case_name][1]
    )
    PROBLEM.train(
        model,
        optimizer,
        CASES[case_name][0],
        rows_of(rank, world_size),
        range(RESUME_AT, STEPS),
    )
    return {"full": {n: p.full_tensor() for n, p in model.named_parameters()}}


def single_process(case_name):
    dtype_name = CASES[case_name][0]
    model = PROBLEM.build(dtype_name)
    optimizer = optimizer_for(model.parameters(), case_name, distributed=False)
    PROBLEM.train(model, optimizer, dtype_name, slice(None), range(STEPS))
    return {n: p.detach() for n, p in model.named_parameters()}


def relative_error(value, reference):
    """max |value − reference| / max |reference|."""
    scale = reference.abs().max().clamp(min=torch.finfo(reference.dtype).tiny)
    return ((value - reference).abs().max() / scale).item()


def check_case(results, case_name):
    """Raises AssertionError naming the rank and parameter that disagree; returns
    the largest relative difference from the single process."""
    dtype_name, sharded, _ = CASES[case_name]
    reference = single_process(case_name)
    initial = dict(PROBLEM.build(dtype_name).named_parameters())
    worst = 0.0
    for rank, result in enumerate(results):
        assert result["full"].keys() == reference.keys()
        for name, value in result["full"].items():
            error = relative_error(value, reference[name])
            worst = max(worst, error)
            assert error <= TOLERANCE[dtype_name], (
                f"rank {rank}, {name}: relative difference {error:.3g} from one "
                f"process > {TOLERANCE[dtype_name]:g}"
            )
            # Every rank holds the same parameters (the shards of one update).
            assert torch.equal(value, results[0]["full"][name]), (rank, name)
            # The local shard is this rank's chunk of the whole parameter
            # (torch.chunk's, as FSDP2 shards; empty past the last chunk).
            chunks = torch.chunk(value, len(results))
            chunk = chunks[rank] if rank < len(chunks) else value[:0]
            assert torch.equal(result["local"][name], chunk), (rank, name)
            for resumed in ("resumed", "resumed_dcp"):
                assert torch.equal(result[resumed][name], result["local"][name]), (
                    f"rank {rank}, {name}: the run {resumed} differs"
                )
    for name, value in reference.items():  # trained ones moved, 'unused' did not
        assert (not torch.equal(value, initial[name].detach())) == (name != "unused")
    stateful = [set(result["stateful"]) for result in results]
    with_grad = {n for n in reference if n != "unused"}
    if sharded:  # a partition: each rank keeps its own parameters' state only
        assert set().union(*stateful) == with_grad, stateful
        assert sum(len(s) for s in stateful) == len(with_grad), stateful
    else:
        assert all(s == with_grad for s in stateful), stateful
    for result in results:  # the momentum is whole, as the factors
        for name, shape in result["momentum_shapes"].items():
            assert shape == tuple(reference[name].shape), (name, shape)
    return worst


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_equals_single_process(tmp_path, world_size):
    worst = check_spawned_cases(tmp_path, world_size, list(CASES), run_case, check_case)
    print(f"{world_size} ranks, max relative difference: {worst}")


def check_resumed_case(results, case_name):
    """The whole parameters, the same on every rank, within the tolerance of the
    single process's."""
    dtype_name = CASES[case_name][0]
    reference = single_process(case_name)
    for rank, result in enumerate(results):
        for name, value in result["full"].items():
            error = relative_error(value, reference[name])
            assert error <= TOLERANCE[dtype_name], (rank, name, error)
            assert torch.equal(value, results[0]["full"][name]), (rank, name)


def test_a_checkpoint_of_4_ranks_resumes_on_2(tmp_path):
    """A torch.distributed.checkpoint checkpoint carries a run to another number
    of ranks: saved on 4 after RESUME_AT steps, loaded on 2 (FSDP2 reshards the
    parameters, ShardedPreconditioning's shares change), the run ends where one
    process does."""
    runs = {world_size: tmp_path / f"on{world_size}" for world_size in (4, 2)}
    for directory in runs.values():
        directory.mkdir()
    check_spawned_cases(runs[4], 4, list(CASES), save_case, lambda results, case: None)
    check_spawned_cases(runs[2], 2, list(CASES), resume_case, check_resumed_case)
