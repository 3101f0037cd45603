"""precond.torch.Kron under torch.distributed equals one process on the global batch.

Each test spawns 2 or 4 processes (``torch.multiprocessing``, gloo, ``file://``
rendezvous in a temporary directory, a timeout on every collective and on the
whole run). Every rank wraps the same model in DDP, trains on its shard of each
global batch (DDP averages the gradients) and writes its final parameters and the
names of the parameters it keeps optimizer state for to the temporary directory;
the parent compares them with a single-process run on the whole global batch.

* ``Replicated`` (the default): every rank fits and applies every factor.
* ``ShardedPreconditioning()``: each rank fits and applies only its own
  parameters' factors, keeps only their state, and one all-gather shares the
  updates. Checked with an uneven 63-wide layer, a parameter that never gets a
  gradient (it must stay untouched and stateless), a layer that only every
  other step uses (its gradient comes and goes: every parameter must keep its
  owner and state), a layer added by ``add_param_group`` after two steps (the
  same) and more ranks than parameters.

float64 (factors in float64 too) agrees to 1e-12: the only difference is DDP's
all-reduce order. float32 agrees to FLOAT32_TOLERANCE (see there).
"""

from __future__ import annotations

import pytest
import torch

from precond.torch import Kron, ShardedPreconditioning
from tests.torch.spawned import check_spawned_cases

STEPS = 5
GLOBAL_BATCH = 16
IN_FEATURES, HIDDEN, OUT_FEATURES = 10, 63, 5
# float64: the ranks' gradients are DDP's all-reduced average and the reference's
# are the full-batch mean, equal up to summation order (~1e-16 relative); five
# Kron steps keep that far below 1e-12 (measured: 6e-17).
FLOAT64_TOLERANCE = 1e-12
# float32: the same ~1e-7 relative difference in the gradients, passed through the
# factor fits (each normalises by a lower bound of a norm of A·Aᵀ + B·Bᵀ) and
# the RMS clip. Measured max |difference| over the cases here: 3e-8 with
# parameters of size <= 2.3 that moved by up to 0.08; 1e-6 leaves a margin of 30.
FLOAT32_TOLERANCE = 1e-6


class Net(torch.nn.Module):
    """Linear(10 → 63) → tanh → Linear(63 → 5), times a scalar, plus a parameter
    that the forward pass never uses (its gradient stays None on every rank)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.unused = torch.nn.Parameter(torch.randn(7, 3))

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))) * self.scale


class Tiny(torch.nn.Module):
    """Two parameters: with 4 ranks, two of them own nothing."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x):
        return self.layer(x)


class Gated(Net):
    """Net with a 63 × 63 mixing layer between its two layers that only odd
    steps use (``use_gate``): the set of parameters with gradients changes from
    step to step, as with a branch or an expert that a batch may not reach. The
    mixing layer is the costliest to precondition, so it weighs in the ranks'
    shares."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.gate = torch.nn.Parameter(
            torch.eye(HIDDEN) + 0.1 * torch.randn(HIDDEN, HIDDEN, generator=generator)
        )
        self.use_gate = False

    def forward(self, x):
        h = torch.tanh(self.hidden(x))
        if self.use_gate:
            h = h @ self.gate
        return self.out(h) * self.scale


class Grown(Gated):
    """Gated with its mixing layer used on every step, but left out of the
    optimizer until step GROW_AT, when ``add_param_group`` adds it (as when
    layers are unfrozen one by one): a group added later must move no other
    parameter, or its state, to another rank."""

    def __init__(self):
        super().__init__()
        self.use_gate = True


GROW_AT = 2
MODELS = {"net": Net, "tiny": Tiny, "gated": Gated, "grown": Grown}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def build(model_name, dtype_name):
    torch.manual_seed(0)
    return MODELS[model_name]().to(DTYPES[dtype_name])


def optimizer_for(params, dtype_name, strategy):
    precond_dtype = torch.float64 if dtype_name == "float64" else None
    return Kron(
        params,
        lr=0.05,
        weight_decay=0.01,
        preconditioner_update_probability=1.0,
        precond_dtype=precond_dtype,
        strategy=strategy,
    )


def batch(step, dtype_name):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
    y = torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=generator)
    return x.to(DTYPES[dtype_name]), y.to(DTYPES[dtype_name])


def first_params(model):
    """The parameters the optimizer starts with (Grown's mixing layer joins later)."""
    return [
        p
        for p in model.parameters()
        if not (isinstance(model, Grown) and p is model.gate)
    ]


def train(model, optimizer, dtype_name, rows):
    module = getattr(model, "module", model)  # under DDP, the model it wraps
    for step in range(STEPS):
        if isinstance(module, Grown) and step == GROW_AT:
            optimizer.add_param_group({"params": [module.gate]})
        elif type(module) is Gated:
            module.use_gate = step % 2 == 1
        x, y = batch(step, dtype_name)
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()


# name → (model, dtype, sharded preconditioning).
CASES = {
    "ddp-float64": ("net", "float64", False),
    "sharded-float64": ("net", "float64", True),
    "ddp-float32": ("net", "float32", False),
    "sharded-float32": ("net", "float32", True),
    "sharded-2params-float64": ("tiny", "float64", True),
    "sharded-2params-float32": ("tiny", "float32", True),
    "sharded-gated-float64": ("gated", "float64", True),
    "sharded-grown-float64": ("grown", "float64", True),
}
# One spawn per world size (each spawn costs ~10 s of imports), the cases run one
# after the other on the same process group. A case that may abort its processes
# (a collective with mismatched sizes kills gloo with SIGABRT) comes last, so that
# an abort loses no other case.
RUNS = {
    "2ranks": (
        2,
        [
            "ddp-float64",
            "sharded-float64",
            "sharded-gated-float64",
            "sharded-grown-float64",
        ],
    ),
    "4ranks": (
        4,
        [
            "ddp-float64",
            "sharded-float64",
            "ddp-float32",
            "sharded-float32",
            "sharded-2params-float32",
            "sharded-2params-float64",
        ],
    ),
}


def run_case(case_name, rank, world_size, out_dir):
    """One rank of one case: DDP over its shard of every global batch; the final
    parameters and the names of the parameters the optimizer keeps state for."""
    del out_dir  # the result is returned
    model_name, dtype_name, sharded = CASES[case_name]
    model = build(model_name, dtype_name)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=model_name != "tiny"
    )
    strategy = ShardedPreconditioning() if sharded else None
    optimizer = optimizer_for(first_params(model), dtype_name, strategy)
    shard = GLOBAL_BATCH // world_size
    train(ddp, optimizer, dtype_name, slice(rank * shard, (rank + 1) * shard))
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: p.detach() for n, p in model.named_parameters()},
        "stateful": sorted(names[id(p)] for p in optimizer.state),
    }


def single_process(model_name, dtype_name):
    model = build(model_name, dtype_name)
    optimizer = optimizer_for(first_params(model), dtype_name, None)
    train(model, optimizer, dtype_name, slice(None))
    return {n: p.detach() for n, p in model.named_parameters()}


def check_against_single_process(results, model_name, dtype_name, sharded):
    """Raises AssertionError naming the rank and parameter that disagree."""
    tolerance = FLOAT64_TOLERANCE if dtype_name == "float64" else FLOAT32_TOLERANCE
    reference = single_process(model_name, dtype_name)
    initial = dict(build(model_name, dtype_name).named_parameters())
    for rank, result in enumerate(results):
        params = result["params"]
        assert params.keys() == reference.keys()
        for name, value in params.items():
            error = (value - reference[name]).abs().max().item()
            assert error <= tolerance, (
                f"rank {rank}, {name}: max |distributed - single| = {error:.3g} "
                f"> {tolerance:g}"
            )
            # Every rank applied the same update (all-gathered or replicated).
            assert torch.equal(value, results[0]["params"][name]), (
                f"rank {rank}, {name}: differs from rank 0"
            )
    # Trained parameters moved; the unused one did not (no gradient: no decay).
    for name, value in reference.items():
        moved = not torch.equal(value, initial[name].detach())
        assert moved == (name != "unused"), name

    stateful = [set(result["stateful"]) for result in results]
    with_grad = {n for n in reference if n != "unused"}
    if sharded:
        # A partition of the parameters with gradients: each rank keeps the state
        # of its own parameters only. The shares are of all the optimizer's
        # parameters (a parameter keeps its owner whichever have gradients), so
        # with 4 ranks the rank whose share is 'unused' alone keeps no state.
        assert set().union(*stateful) == with_grad, stateful
        assert sum(len(s) for s in stateful) == len(with_grad), stateful
    else:
        assert all(s == with_grad for s in stateful), stateful


@pytest.mark.parametrize("run_name", list(RUNS))
def test_distributed_equals_single_process(tmp_path, run_name):
    world_size, case_names = RUNS[run_name]
    check_spawned_cases(
        tmp_path,
        world_size,
        case_names,
        run_case,
        lambda results, case: check_against_single_process(results, *CASES[case]),
    )
