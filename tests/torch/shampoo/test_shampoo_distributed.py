"""Shampoo over ``torch.distributed``, and the harness SOAP's distributed test
shares (``tests/torch/soap/test_soap_distributed.py``).

One spawn per world size (2 and 4 gloo ranks, ``tests/torch/spawned.py``) runs
every case of :data:`CASES`: DDP with ``Replicated`` (the default) and with
``ShardedPreconditioning``, and FSDP2 (``fully_shard`` on an
``init_device_mesh("cpu", (world,))`` mesh: DTensor parameters, each gradient
gathered whole, each rank applying its shard's slice) with either strategy.
Every rank trains STEPS steps on its rows of each global batch (a NaN in rank
0's rows at PROBLEM.nan_step: every rank skips that step) and the parent checks:

* every rank ends with the same parameters (bitwise), each FSDP2 shard being
  ``torch.chunk``'s slice of them;
* one process fed the gradients the ranks stepped with (DDP's all-reduced
  mean; FSDP2's gathered reduce-scatter), rank 0's recording, ends bitwise
  where they do, and its optimizer state is bitwise each rank's: the same
  arithmetic on the same numbers, whoever computed it (with the sharded
  strategy each parameter's state lives on its owner only, a partition);
* one process on the whole global batch ends within TOLERANCE (relative to each
  parameter's largest entry): the gradients differ only by the order of the
  collectives' sums (~1 ulp), carried through STEPS steps;
* under FSDP2, a run resumed from the ``state_dict`` saved after RESUME_AT
  steps, and one resumed from a ``torch.distributed.checkpoint`` checkpoint of
  ``get_model_state_dict``/``get_optimizer_state_dict``, end bitwise where the
  uninterrupted run does.

The model: Linear(10 → 9) → tanh → Linear(9 → 9), times a one-element scale,
plus a parameter the forward pass never uses (no gradient, no state). With 4
ranks FSDP2's shards are uneven (9 rows: 3, 3, 3, 0) and three ranks hold no
part of the scale. Its matrices are near square so that every statistic of
the first step (16 rows) has at most a one-dimensional null space: SOAP's
first bases are eigenvectors, arbitrary within a degenerate eigenspace, and
Adam is not rotation invariant, so there an ulp in a gradient changes the
run at O(lr) (a 1-D parameter with ``precondition_1d``, or a 5 × 9 matrix's
9 × 9 statistic, makes one process differ by 1e-2 from itself with its
gradients scaled by 1 + 1e-15).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable

import pytest
import torch

from precond.torch import GraftingType, Shampoo, ShardedPreconditioning
from tests.torch.small_net import (
    DTYPES,
    Problem,
    fully_sharded,
    load_checkpoint,
    local_values,
    rows_of,
    save_checkpoint,
)
from tests.torch.spawned import check_spawned_cases

STEPS = 6
RESUME_AT = 3  # the resumed runs reload the state saved after this many steps
# A 9-wide hidden layer, 9 outputs (near square: the module docstring says why);
# a NaN in rank 0's rows at step 2: the step is skipped on every rank.
PROBLEM = Problem(hidden=9, out_features=9, nan_step=2)
# Max |difference| (the parameters are at most ~1.5 in size): the global-batch
# gradients differ from the ranks' by summation order only (~1e-16 / ~1e-7
# relative); six steps carry that through the roots or bases (measured: see
# the module docstring).
TOLERANCE = {"float64": 1e-12, "float32": 1e-6}
# name → (wrapper, ShardedPreconditioning, dtype)
CASES = {
    "ddp-replicated-float64": ("ddp", False, "float64"),
    "ddp-sharded-float64": ("ddp", True, "float64"),
    "fsdp-replicated-float64": ("fsdp", False, "float64"),
    "fsdp-sharded-float32": ("fsdp", True, "float32"),
}
# make(params, strategy, dtype name) -> the optimizer under test
Make = Callable[[object, object, str], torch.optim.Optimizer]


def make_shampoo(params, strategy, dtype_name):
    """Blocks of 4 (uneven), AdaGrad grafting, the roots from step 2 on, coupled
    weight decay (which gathers a DTensor θ); float64 statistics for float64."""
    del dtype_name
    return Shampoo(
        params,
        lr=0.05,
        block_size=4,
        graft_type=GraftingType.ADAGRAD,
        start_preconditioning_step=2,
        weight_decay=0.01,
        strategy=strategy,
    )


def wrapped(wrapper, dtype_name, world_size):
    """(the model as built, the module to train): DDP, or each layer and the
    whole ``fully_shard``-ed on a CPU mesh (every parameter a DTensor)."""
    model = PROBLEM.build(dtype_name)
    if wrapper == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=True
        )
        return model, ddp
    return model, fully_sharded(model, world_size)


def states_by_name(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: copy.deepcopy(s) for p, s in optimizer.state.items()}


def resumed_runs(make, case_name, model, rank, world_size, out_dir):
    """FSDP2: RESUME_AT steps, then the rest three times: straight on, from the
    saved ``state_dict`` and from a DCP checkpoint; each run's local shards."""
    _, sharded, dtype_name = CASES[case_name]
    strategy = ShardedPreconditioning if sharded else lambda: None
    rows = rows_of(rank, world_size)
    optimizer = make(model.parameters(), strategy(), dtype_name)
    record: list = []
    PROBLEM.train(model, optimizer, dtype_name, rows, range(RESUME_AT), record)
    saved_params = local_values(model)
    saved_state = copy.deepcopy(optimizer.state_dict())
    checkpoint = os.path.join(out_dir, f"checkpoint-{case_name}")
    save_checkpoint(model, optimizer, checkpoint)
    PROBLEM.train(model, optimizer, dtype_name, rows, range(RESUME_AT, STEPS), record)
    runs = {"local": local_values(model)}
    ended = {n: p.full_tensor() for n, p in model.named_parameters()}
    state = states_by_name(model, optimizer)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(saved_params[n])
    resumed = make(model.parameters(), strategy(), dtype_name)
    resumed.load_state_dict(saved_state)
    PROBLEM.train(model, resumed, dtype_name, rows, range(RESUME_AT, STEPS))
    runs["resumed"] = local_values(model)
    resumed = make(model.parameters(), strategy(), dtype_name)
    load_checkpoint(model, resumed, checkpoint, sharded)
    PROBLEM.train(model, resumed, dtype_name, rows, range(RESUME_AT, STEPS))
    runs["resumed_dcp"] = local_values(model)
    return ended, state, record, runs


def run_case(make, case_name, rank, world_size, out_dir):
    """One case on one rank: what the parent checks."""
    wrapper, sharded, dtype_name = CASES[case_name]
    model, trained = wrapped(wrapper, dtype_name, world_size)
    if wrapper == "fsdp":
        ended, state, record, runs = resumed_runs(
            make, case_name, model, rank, world_size, out_dir
        )
    else:
        strategy = ShardedPreconditioning() if sharded else None
        optimizer = make(model.parameters(), strategy, dtype_name)
        record, runs = [], {}
        rows = rows_of(rank, world_size)
        PROBLEM.train(trained, optimizer, dtype_name, rows, range(STEPS), record)
        ended = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = states_by_name(model, optimizer)
    return {
        "full": ended,
        "state": state,
        "grads": record if rank == 0 else None,
        **runs,
    }


def single_process(make, dtype_name, grads=None):
    """One process (Replicated): on the whole global batches, or fed ``grads``
    (a list of each step's gradients by name). Its parameters and state."""
    model = PROBLEM.build(dtype_name)
    optimizer = make(model.parameters(), None, dtype_name)
    if grads is None:
        PROBLEM.train(model, optimizer, dtype_name, slice(None), range(STEPS))
    for step_grads in grads or []:
        for n, p in model.named_parameters():
            p.grad = step_grads.get(n)
        optimizer.step()
    params = {n: p.detach() for n, p in model.named_parameters()}
    return params, states_by_name(model, optimizer)


def same(a, b, tolerance):
    """Bitwise equal (``tolerance`` None), or within ``tolerance``."""
    if not isinstance(a, torch.Tensor):
        return a == b
    if tolerance is None or a.dtype not in DTYPES.values():
        return torch.equal(a, b)
    return a.shape == b.shape and difference(a, b) <= tolerance


def assert_same_state(ours, theirs, where, tolerance):
    """Every state entry equal (tensors, lists of them, counts): bitwise, or
    within ``tolerance``."""
    assert ours.keys() == theirs.keys(), where
    for key, value in ours.items():
        values = value if isinstance(value, list) else [value]
        others = theirs[key] if isinstance(value, list) else [theirs[key]]
        assert len(values) == len(others), (where, key)
        for a, b in zip(values, others, strict=True):
            assert same(a, b, tolerance), (
                f"{where}: state {key!r} differs from one process's"
            )


def difference(value, reference):
    return (value - reference).abs().max().item()


def check_case(make, sharded_exact, tolerance, results, case_name):
    """Raises AssertionError naming what differs; returns the largest
    difference from one process on the global batch. ``sharded_exact``: with
    ShardedPreconditioning too the ranks end bitwise where one process fed
    their gradients does (else within ``tolerance``, by dtype, as from one
    process on the global batch)."""
    wrapper, sharded, dtype_name = CASES[case_name]
    exact = None if sharded_exact or not sharded else tolerance[dtype_name]
    replayed, replayed_state = single_process(make, dtype_name, results[0]["grads"])
    reference, _ = single_process(make, dtype_name)
    worst = 0.0
    for rank, result in enumerate(results):
        for name, value in result["full"].items():
            assert torch.equal(value, results[0]["full"][name]), (rank, name)
            assert same(value, replayed[name], exact), (
                f"rank {rank}, {name}: not one process's on the same gradients"
            )
            error = difference(value, reference[name])
            worst = max(worst, error)
            assert error <= tolerance[dtype_name], (
                f"rank {rank}, {name}: max difference {error:.3g} from one "
                f"process on the global batch > {tolerance[dtype_name]:g}"
            )
            if wrapper == "fsdp":
                chunks = torch.chunk(value, len(results))
                chunk = chunks[rank] if rank < len(chunks) else value[:0]
                assert torch.equal(result["local"][name], chunk), (rank, name)
                for run in ("resumed", "resumed_dcp"):
                    assert torch.equal(result[run][name], chunk), (
                        f"rank {rank}, {name}: the run {run} differs"
                    )
        for name, state in result["state"].items():
            where = f"rank {rank}, {name}"
            assert_same_state(state, replayed_state[name], where, exact)
    stateful = [set(result["state"]) for result in results]
    with_grad = set(replayed_state)
    assert with_grad == {n for n in reference if n != "unused"}, with_grad
    if sharded:  # a partition: each parameter's state on its owner only
        assert set().union(*stateful) == with_grad, stateful
        assert sum(len(s) for s in stateful) == len(with_grad), stateful
    else:
        assert all(s == with_grad for s in stateful), stateful
    return worst


def check_world(tmp_path, world_size, make, sharded_exact, tolerance=TOLERANCE):
    """Every case on ``world_size`` spawned ranks, checked (``check_case``);
    prints the largest difference from one process on the global batch per
    dtype."""
    worst = check_spawned_cases(
        tmp_path,
        world_size,
        list(CASES),
        functools.partial(run_case, make),
        functools.partial(check_case, make, sharded_exact, tolerance),
    )
    for dtype_name in DTYPES:
        errors = [e for c, e in worst.items() if CASES[c][2] == dtype_name]
        print(f"{world_size} ranks, {dtype_name}: max difference {max(errors):.3g}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_equal_one_process(tmp_path, world_size):
    check_world(tmp_path, world_size, make_shampoo, sharded_exact=False)
