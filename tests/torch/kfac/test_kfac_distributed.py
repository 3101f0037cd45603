"""precond.torch.kfac.KFAC under torch.distributed equals one process on the global
batch, for every KAISA distribution strategy.

One spawned run per world size (1, 2, 4; gloo, ``file://`` rendezvous, timeouts:
the helpers of ``test_kron_distributed``). Every rank loops over ``CONFIGS``: the
same float64 CNN (Conv2d with stride and padding, Linear; with and without bias)
wrapped in DDP, SGD with momentum, ``KFAC(ddp, ..., inv_dtype=float64)``, trained
on its shard of each global batch. It writes, per configuration, the gradients
after ``preconditioner.step()`` of every step, the final parameters, the bytes its
communicator sent by kind and which layers it holds second-order data for. The
parent compares them with one process on the whole global batch, and checks the
communication and the memory placement against the strategy's grid. A last
few configurations (``RESUME``) stop after some steps, save their ``state_dict``s, and
continue in a fresh DDP model, SGD and KFAC that load them: rank 0's dicts on every
rank at an inverse-update boundary, or each rank's own K-FAC dict in the middle of
an inverse cycle (the only exact way there: see ``KFAC.load_state_dict``).

Tolerance (float64): DDP's all-reduce of the gradients and K-FAC's all-reduce of
the factor contributions sum in another order than one process does (~1e-16
relative); the decompositions and inverses are continuous functions of the factors
(the preconditioned gradient is one even where eigenvectors are not), so the
difference stays at rounding level. Measured over every configuration with 2 and
4 ranks: max relative difference 4.1e-15 (preconditioned gradients, every step)
and 1.2e-15 (parameters, which moved by 0.035-0.045). RELATIVE_TOLERANCE = 1e-10
leaves a wide margin, while real errors are far above it: dropping the 1/W of the
output gradients in the hooks (G grows by W², so the damping means another thing)
gives 9e-4 to 1.5e-3 in the gradients with 4 ranks; not recomputing the
decompositions on load gives 5e-2 at the step after the resume.

Also: unit tests of ``WorkerGrid`` and ``assign_layers`` (no processes).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from precond.torch.kfac import (
    KFAC,
    DistributedStrategy,
    LayerWork,
    WorkerGrid,
    assign_layers,
)
from precond.torch.kfac.preconditioner import _grad_workers
from tests.torch.spawned import check_spawned_cases

STEPS = 5
GLOBAL_BATCH = 16
LR = 0.1
RELATIVE_TOLERANCE = 1e-10

# name → KFAC keyword arguments (besides damping, lr and inv_dtype).
CONFIGS = {
    "comm-opt-eigen": {"grad_worker_fraction": DistributedStrategy.COMM_OPT},
    "hybrid-opt-inverse-symmetric": {
        "grad_worker_fraction": DistributedStrategy.HYBRID_OPT,
        "compute_method": "inverse",
        "symmetry_aware": True,
    },
    "mem-opt-eigen-not-colocated-unbucketed": {
        "grad_worker_fraction": DistributedStrategy.MEM_OPT,
        "colocate_factors": False,
        "compute_eigenvalue_outer_product": False,
        "allreduce_bucket_cap_mb": 0,
    },
    "fraction-0.5-intervals-symmetric": {
        "grad_worker_fraction": 0.5,
        "factor_update_steps": 2,
        "inv_update_steps": 4,
        "symmetry_aware": True,
        "kl_clip": None,
    },
    "mem-opt-inverse-not-colocated-intervals": {
        "grad_worker_fraction": DistributedStrategy.MEM_OPT,
        "compute_method": "inverse",
        "colocate_factors": False,
        "factor_update_steps": 2,
        "inv_update_steps": 2,
    },
}
# Configuration → (steps before the save, whether each rank loads its own K-FAC
# dict). Rank 0's dict holds the decompositions of rank 0's column only; the other
# columns recompute theirs from the saved factors on load, which continues the run
# exactly only right before an inverse update. "mem-opt-...": factors and inverses
# at steps 0 and 2, saved after 3 (recomputing gives those step 3 uses, and without
# them step 3 would not be preconditioned). The other two are saved in the middle
# of an inverse cycle (factors moved on since the decompositions in use), so each
# rank saves and loads its own dict.
RESUME = {
    "mem-opt-inverse-not-colocated-intervals": (3, False),
    "fraction-0.5-intervals-symmetric": (3, True),  # factors at 0, 2; inverses at 0
    "hybrid-opt-inverse-symmetric": (2, True),
}


class CNN(nn.Module):
    """1×8×8 → conv 3×3 (pad 1, bias) → conv 3×3 stride 2 (pad 1, no bias) →
    Linear(96 → 16, bias) → Linear(16 → 10, no bias); tanh between."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
        self.fc1 = nn.Linear(6 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10, bias=False)

    def forward(self, x):
        h = torch.tanh(self.conv1(x))
        h = torch.tanh(self.conv2(h))
        return self.fc2(torch.tanh(self.fc1(h.flatten(1))))


def build() -> CNN:
    torch.manual_seed(0)
    return CNN().to(torch.float64)


def batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)
    return x, y


def make(model, ddp_or_model, config_name):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    preconditioner = KFAC(
        ddp_or_model,
        damping=0.01,
        lr=LR,
        inv_dtype=torch.float64,
        **CONFIGS[config_name],
    )
    return optimizer, preconditioner


def train(model, net, optimizer, preconditioner, rows, steps):
    """Trains ``net`` (the model or its DDP wrapper) over ``steps``; returns the
    gradients after ``preconditioner.step()`` of each step, by parameter name."""
    grads = []
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
        preconditioner.step()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return grads


def distributed_run(config_name, rank, world_size, out):
    model = build()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer, preconditioner = make(model, ddp, config_name)
    shard = GLOBAL_BATCH // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    stop, own_dict = RESUME.get(config_name, (STEPS, False))
    grads = train(model, ddp, optimizer, preconditioner, rows, range(stop))
    bytes_sent = dict(preconditioner.communicator.bytes_sent)
    if config_name in RESUME:
        saved = out / f"resume-{config_name}.pt"
        own = out / f"resume-{config_name}-kfac-rank{rank}.pt"
        if rank == 0:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "kfac": preconditioner.state_dict(),
                },
                saved,
            )
        if own_dict:
            torch.save(preconditioner.state_dict(), own)
        dist.barrier()
        state = torch.load(saved, weights_only=False)
        model = build()
        model.load_state_dict(state["model"])
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer, preconditioner = make(model, ddp, config_name)
        optimizer.load_state_dict(state["optimizer"])
        kfac_state = torch.load(own, weights_only=True) if own_dict else state["kfac"]
        preconditioner.load_state_dict(kfac_state)
        grads += train(model, ddp, optimizer, preconditioner, rows, range(stop, STEPS))
        for kind, count in preconditioner.communicator.bytes_sent.items():
            bytes_sent[kind] = bytes_sent.get(kind, 0) + count
    return {
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "bytes_sent": bytes_sent,
        "grid": (preconditioner.grid.world_size, preconditioner.grid.grad_workers),
        "assignment": {
            layer.name.removeprefix("module."): tuple(
                vars(preconditioner.assignment[layer.name]).values()
            )
            for layer in preconditioner.layers
        },
        "second_order": {
            layer.name.removeprefix("module."): sorted(layer.second_order)
            for layer in preconditioner.layers
        },
        "layers": {
            layer.name.removeprefix("module."): (layer.a_dim, layer.g_dim)
            for layer in preconditioner.layers
        },
    }


def single_process(config_name):
    model = build()
    optimizer, preconditioner = make(model, model, config_name)
    grads = train(model, model, optimizer, preconditioner, slice(None), range(STEPS))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grads, params


def relative_error(value, reference):
    return ((value - reference).abs().max() / reference.abs().max()).item()


def check_equal_to_single_process(results, config_name):
    """Preconditioned gradients at every step and final parameters, every rank."""
    ref_grads, ref_params = single_process(config_name)
    initial = dict(build().named_parameters())
    for rank, result in enumerate(results):
        assert len(result["grads"]) == STEPS
        for step, (grads, ref) in enumerate(zip(result["grads"], ref_grads)):
            assert grads.keys() == ref.keys()
            for name, value in grads.items():
                error = relative_error(value, ref[name])
                assert error <= RELATIVE_TOLERANCE, (
                    f"rank {rank}, step {step}, grad of {name}: relative difference "
                    f"{error:.3g} > {RELATIVE_TOLERANCE:g}"
                )
        for name, value in result["params"].items():
            error = relative_error(value, ref_params[name])
            assert error <= RELATIVE_TOLERANCE, (
                f"rank {rank}, {name}: relative difference {error:.3g}"
            )
            assert not torch.equal(value, initial[name].detach()), f"{name} unmoved"


def second_order_keys(config):
    if config.get("compute_method") == "inverse":
        return {"A": ["a_inv"], "G": ["g_inv"]}
    if config.get("compute_eigenvalue_outer_product", True):
        return {"A": ["q_a", "prediv"], "G": ["q_g"]}
    return {"A": ["d_a", "q_a"], "G": ["d_g", "q_g"]}


def second_order_numel(config, a_dim, g_dim, symmetry_aware):
    """Elements broadcast down the column for one layer's decompositions."""
    if config.get("compute_method") == "inverse":
        if symmetry_aware:  # sent as upper triangles
            return a_dim * (a_dim + 1) // 2 + g_dim * (g_dim + 1) // 2
        return a_dim**2 + g_dim**2
    if config.get("compute_eigenvalue_outer_product", True):
        return a_dim**2 + g_dim**2 + a_dim * g_dim
    return a_dim**2 + g_dim**2 + a_dim + g_dim


def check_placement_and_communication(results, config_name):
    """Every rank agrees on the grid and the assignment; a rank holds second-order
    data for the layers of its column only (MEM_OPT's memory saving); the bytes
    sent by kind are those the strategy implies (float64: 8 bytes per element)."""
    config = CONFIGS[config_name]
    world_size = len(results)
    grid = WorkerGrid(*results[0]["grid"])
    assignment = {n: LayerWork(*w) for n, w in results[0]["assignment"].items()}
    layers = results[0]["layers"]
    fraction = config["grad_worker_fraction"]
    expected_workers = {
        DistributedStrategy.COMM_OPT: world_size,
        DistributedStrategy.HYBRID_OPT: max(1, world_size // 2),
        DistributedStrategy.MEM_OPT: 1,
    }.get(fraction) or max(1, round(world_size * fraction))
    assert grid == WorkerGrid(world_size, expected_workers)
    assert list(layers) == ["conv1", "conv2", "fc1", "fc2"]
    keys = second_order_keys(config)
    for rank, result in enumerate(results):
        assert result["grid"] == results[0]["grid"]
        assert result["assignment"] == results[0]["assignment"]
        for name, held in result["second_order"].items():
            work = assignment[name]
            if work.column == grid.column_of(rank):
                assert held == sorted(keys["A"] + keys["G"]), (rank, name, held)
            else:
                assert held == [], f"rank {rank} holds {held} of {name}"

    symmetry_aware = config.get("symmetry_aware", False)
    factor_updates = len(range(0, STEPS, config.get("factor_update_steps", 1)))
    inverse_updates = len(range(0, STEPS, config.get("inv_update_steps", 1)))
    if config_name in RESUME and not RESUME[config_name][1]:
        inverse_updates += 1  # the load recomputes and broadcasts

    def packed(n):
        return n * (n + 1) // 2 if symmetry_aware else n * n

    sent = [result["bytes_sent"] for result in results]
    if world_size == 1:
        assert all(not any(s.values()) for s in sent), sent
        return
    # Factors: every rank sends every packed factor once per factor update (plus
    # the count of contributing passes, 2 numbers per layer).
    payload = (
        factor_updates * 8 * sum(packed(a) + packed(g) for a, g in layers.values())
    )
    overhead = factor_updates * 8 * 2 * len(layers)
    assert all(s["factors"] == payload + overhead for s in sent), (payload, sent)
    # Second order: each layer's decompositions go down its column once per
    # inverse update, when the column has more than one rank.
    second_order = sum(s.get("second_order", 0) for s in sent)
    if grid.grad_workers == 1:
        assert second_order == 0, sent
    else:
        per_update = sum(
            second_order_numel(config, a, g, symmetry_aware) for a, g in layers.values()
        )
        assert second_order == 8 * inverse_updates * per_update, sent
    # Gradients: each row receives every layer's preconditioned gradient from the
    # row's rank in the layer's column, every step; none with one column.
    gradients = sum(s.get("gradients", 0) for s in sent)
    if grid.columns == 1:
        assert gradients == 0, sent
    else:
        per_step = sum(a * g for a, g in layers.values())
        assert gradients == 8 * STEPS * grid.grad_workers * per_step, sent
    if fraction is DistributedStrategy.COMM_OPT:
        assert all("gradients" not in s for s in sent)
    if fraction is DistributedStrategy.MEM_OPT:
        assert all("second_order" not in s for s in sent)


def check_all(results, config_name):
    """Both checks of a configuration, the failing one named."""
    for check in (check_equal_to_single_process, check_placement_and_communication):
        try:
            check(results, config_name)
        except AssertionError as e:
            raise AssertionError(f"{check.__name__}: {e}") from None


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_distributed_equals_single_process(tmp_path, world_size):
    check_spawned_cases(
        tmp_path, world_size, CONFIGS, distributed_run, check_all, weights_only=False
    )


# --------------------------------------------------------------- placement units


def test_grid_columns_and_rows():
    grid = WorkerGrid(8, 2)
    assert grid.columns == 4
    assert [grid.column_ranks(c) for c in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [grid.row_ranks(r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank in range(8):
        assert rank in grid.column_ranks(grid.column_of(rank))
        assert rank in grid.row_ranks(grid.row_of(rank))
    # COMM_OPT: one column of everyone; MEM_OPT: one column per rank.
    assert WorkerGrid(4, 4).column_ranks(0) == [0, 1, 2, 3]
    assert WorkerGrid(4, 4).row_ranks(2) == [2]
    assert [WorkerGrid(4, 1).column_ranks(c) for c in range(4)] == [[0], [1], [2], [3]]
    assert WorkerGrid(4, 1).row_ranks(0) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("world_size", "grad_workers"), [(8, 3), (4, 0), (0, 1), (6, 4), (4, 8)]
)
def test_invalid_grid(world_size, grad_workers):
    with pytest.raises(ValueError, match="Invalid"):
        WorkerGrid(world_size, grad_workers)


@pytest.mark.parametrize(("fraction", "world_size"), [(0.75, 8), (0.375, 8), (0.4, 5)])
def test_invalid_fraction_names_the_world_size(fraction, world_size):
    with pytest.raises(ValueError, match=f"world size {world_size}"):
        _grad_workers(fraction, world_size)


def test_fractions_and_strategies_give_their_grids():
    for world_size in (1, 2, 4, 8):
        assert _grad_workers(DistributedStrategy.COMM_OPT, world_size) == world_size
        assert _grad_workers(DistributedStrategy.MEM_OPT, world_size) == 1
        assert _grad_workers(DistributedStrategy.HYBRID_OPT, world_size) == max(
            1, world_size // 2
        )
        assert _grad_workers(1.0, world_size) == world_size
        assert _grad_workers(1 / world_size, world_size) == 1
    assert _grad_workers(0.25, 8) == 2
    # One process (no process group): a fraction 0 means 1/world_size.
    assert KFAC(nn.Linear(3, 2), grad_worker_fraction=0).grid == WorkerGrid(1, 1)


def loads(work, costs, world_size):
    load = [0.0] * world_size
    for name, w in work.items():
        load[w.a_worker] += costs[name][0]
        load[w.g_worker] += costs[name][1]
    return load


def random_costs(seed, layers):
    rng = random.Random(seed)
    return {
        f"layer{i}": (rng.randint(1, 64) ** 3, rng.randint(1, 64) ** 3)
        for i in range(layers)
    }


@pytest.mark.parametrize(("world_size", "grad_workers"), [(8, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("colocate", [True, False])
def test_every_layer_has_one_column_and_workers_in_it(
    world_size, grad_workers, colocate
):
    grid = WorkerGrid(world_size, grad_workers)
    for seed in range(20):
        costs = random_costs(seed, layers=1 + seed)
        work = assign_layers(costs, grid, colocate_factors=colocate)
        assert list(work) == list(costs)  # registration order
        for w in work.values():
            assert 0 <= w.column < grid.columns
            column = grid.column_ranks(w.column)
            assert w.a_worker in column
            assert w.g_worker in column
            if colocate:
                assert w.a_worker == w.g_worker
        if grad_workers == world_size:  # COMM_OPT: one column
            assert {w.column for w in work.values()} == {0}
        if grad_workers == 1:  # MEM_OPT: the column's only rank does everything
            assert all(w.a_worker == w.g_worker == w.column for w in work.values())


@pytest.mark.parametrize("colocate", [True, False])
@pytest.mark.parametrize(("world_size", "grad_workers"), [(4, 4), (8, 8), (4, 1)])
def test_greedy_balance(world_size, grad_workers, colocate):
    """Where each rank is its own choice (one column, or one rank per column), the
    greedy placement is list scheduling: the most loaded rank got its last item
    while it was the least loaded, so max − min load ≤ the largest item."""
    grid = WorkerGrid(world_size, grad_workers)
    for seed, layers in itertools.product(range(20), (world_size + 1, 3 * world_size)):
        costs = random_costs(seed, layers)
        work = assign_layers(costs, grid, colocate_factors=colocate)
        load = loads(work, costs, world_size)
        if colocate or grad_workers == 1:
            largest = max(a + g for a, g in costs.values())
        else:
            largest = max(max(c) for c in costs.values())
        assert max(load) - min(load) <= largest, (seed, load)
        assert min(load) > 0  # more layers than ranks: nobody idle


def test_greedy_balance_of_columns():
    """With several ranks per column, the columns' summed loads are balanced."""
    grid = WorkerGrid(8, 2)
    for seed in range(20):
        costs = random_costs(seed, layers=12)
        work = assign_layers(costs, grid)
        load = loads(work, costs, 8)
        column_load = [sum(load[r] for r in grid.column_ranks(c)) for c in range(4)]
        largest = max(a + g for a, g in costs.values())
        assert max(column_load) - min(column_load) <= largest, (seed, column_load)


def test_hand_computed_placements():
    # W=8, 2 gradient workers: 8 equal layers fill columns {0,4},{1,5},{2,6},{3,7}
    # in turn, then the second rank of each column.
    grid = WorkerGrid(8, 2)
    work = assign_layers({f"l{i}": (1.0, 1.0) for i in range(8)}, grid)
    assert [(w.column, w.a_worker) for w in work.values()] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    ]
    # Largest first: y (27 + 1) before x (8 + 1).
    costs = {"x": (8.0, 1.0), "y": (1.0, 27.0)}
    comm_opt = WorkerGrid(2, 2)
    assert assign_layers(costs, comm_opt) == {
        "x": LayerWork(0, 1, 1),
        "y": LayerWork(0, 0, 0),
    }
    # Not colocated: y's G (27) to rank 0, its A to rank 1 (then least loaded);
    # x's A (8) to rank 1 (load 1 → 9), its G to rank 1 (9 < 27).
    assert assign_layers(costs, comm_opt, colocate_factors=False) == {
        "x": LayerWork(0, 1, 1),
        "y": LayerWork(0, 1, 0),
    }
    # MEM_OPT: one rank per column.
    assert assign_layers(costs, WorkerGrid(2, 1)) == {
        "x": LayerWork(1, 1, 1),
        "y": LayerWork(0, 0, 0),
    }
