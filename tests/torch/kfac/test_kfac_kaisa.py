"""KAISA 0.4's interface of ``KFAC``, each property against its oracle: PyTorch's LR
schedulers (a ``torch.optim.Optimizer``), schedules as zero-argument callables
(same run as the values they return), ``verbose``, case-insensitive
``skip_layers``, ``DistributedStrategy`` fractions on a 4-rank grid, and KAISA's
state-dict layout (``param_groups`` + a list of factors), which resumes exactly
where recomputing the inverses is exact. Also precond's equivalents of KAISA's own
unit tests (initialisation from names or enums, training a tiny model with every
method, the parameter scheduler's checkpoints); accumulation, AMP and factor
correctness are in test_kfac.py.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precond.torch.kfac.preconditioner as preconditioner_module
from precond.torch.kfac import (
    KFAC,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACParamScheduler,
)
from tests.torch.spawned import init_gloo, spawn


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def data(steps, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(steps)
    ]


def train(model, pre, batches, lr=0.1, schedulers=()):
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        sgd.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pre.step()
        sgd.step()
        for scheduler in schedulers:
            scheduler.step()
        losses.append(loss.item())
    return losses


def parameters(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# -- torch.optim.Optimizer: LR schedulers ---------------------------------------


def test_param_groups_hold_kaisas_hyperparameters():
    pre = KFAC(TinyModel(), 2, 4, damping=0.01, kl_clip=None, lr=0.3)
    assert isinstance(pre, torch.optim.Optimizer)
    group = pre.param_groups[0]
    assert {k: v for k, v in group.items() if k != "params"} == dict(
        damping=0.01,
        factor_decay=0.95,
        factor_update_steps=2,
        inv_update_steps=4,
        kl_clip=None,
        lr=0.3,
        step=0,
    )
    train(TinyModel(), pre, data(3))
    assert pre.param_groups[0]["step"] == pre.steps == 3


@pytest.mark.parametrize("kind", ["StepLR", "LambdaLR"], ids=["StepLR", "LambdaLR"])
def test_lr_schedulers_schedule_the_kl_clip_lr(kind):
    """A scheduled lr gives the run of the same lr passed as a callable."""

    def rule(step):
        return 0.5 ** (step // 2)

    model, other = TinyModel(), TinyModel()
    pre = KFAC(model, lr=0.4, kl_clip=1e-3)
    if kind == "StepLR":
        scheduler = torch.optim.lr_scheduler.StepLR(pre, step_size=2, gamma=0.5)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(pre, rule)
    seen = []
    batches = data(6)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        seen.append(pre.lr)
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        sgd.step()
        scheduler.step()
    assert seen == pytest.approx([0.4 * rule(s) for s in range(6)])
    scheduled_run = parameters(model)
    train(other, KFAC(other, lr=lambda step: 0.4 * rule(step), kl_clip=1e-3), batches)
    assert torch.equal(scheduled_run, parameters(other))
    assert not torch.equal(scheduled_run, parameters(TinyModel()))


# -- callables, verbose, skip_layers ----------------------------------------------


def test_zero_argument_callables_give_the_run_of_their_values():
    """KAISA 0.4 calls schedules with no argument; the run equals the one with the
    values they return passed per step (a step-count callable)."""
    schedules = dict(
        factor_update_steps=lambda s: 1 if s < 4 else 2,
        inv_update_steps=lambda s: 1 if s < 3 else 3,
        damping=lambda s: 0.01 / (1 + s),
        factor_decay=lambda s: 0.9 if s < 5 else 0.95,
        kl_clip=lambda s: 1e-3 * (1 + s),
        lr=lambda s: 0.1 + 0.01 * s,
    )
    model, other = TinyModel(), TinyModel()
    by_step = KFAC(model, **schedules)
    train(model, by_step, data(8))

    clock = {"step": 0}
    zero_argument = {
        name: (lambda f=f: f(clock["step"])) for name, f in schedules.items()
    }
    pre = KFAC(other, **zero_argument)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1)
    for x, y in data(8):
        assert pre.damping == schedules["damping"](clock["step"])
        sgd.zero_grad()
        F.cross_entropy(other(x), y).backward()
        pre.step()
        sgd.step()
        clock["step"] += 1
    assert torch.equal(parameters(model), parameters(other))


def test_verbose_logs_the_registration(caplog):
    with caplog.at_level(logging.INFO, logger="precond.torch.kfac"):
        KFAC(TinyModel())
    assert "registers" not in caplog.text
    with caplog.at_level(logging.INFO, logger="precond.torch.kfac"):
        KFAC(TinyModel(), verbose=True)
    assert "K-FAC registers KFACLayer('conv'" in caplog.text
    assert "K-FAC registers KFACLayer('fc'" in caplog.text


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.Stem = nn.Conv2d(1, 1, 1)
        self.block = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.head = nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("skip", "registered"),
    [
        (["linear"], ["Stem"]),
        (["LINEAR"], ["Stem"]),
        ("conv2d", ["block.0", "block.1", "head"]),
        (["SEQUENTIAL", "stem"], ["head"]),
        (["Head", "BLOCK"], ["Stem"]),
        ([], ["Stem", "block.0", "block.1", "head"]),
    ],
    ids=["class-lower", "class-upper", "str", "class-and-name", "names", "none"],
)
def test_skip_layers_ignore_case(skip, registered):
    assert [l.name for l in KFAC(Blocks(), skip_layers=skip).layers] == registered


# -- DistributedStrategy on a 4-rank grid ----------------------------------------


class FourRanks:
    """What KFAC reads of its Communicator, for rank 0 of 4 (no process group)."""

    def __init__(self, **_):
        self.rank, self.world_size = 0, 4

    def new_group(self, ranks):
        return tuple(ranks)


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (DistributedStrategy.COMM_OPT, (1.0, DistributedStrategy.COMM_OPT, 4)),
        (DistributedStrategy.HYBRID_OPT, (0.5, DistributedStrategy.HYBRID_OPT, 2)),
        (DistributedStrategy.MEM_OPT, (0.25, DistributedStrategy.MEM_OPT, 1)),
        (1, (1.0, DistributedStrategy.COMM_OPT, 4)),
        (0.5, (0.5, DistributedStrategy.HYBRID_OPT, 2)),
        (0.25, (0.25, DistributedStrategy.MEM_OPT, 1)),
        (0, (0.25, DistributedStrategy.MEM_OPT, 1)),
    ],
    ids=["COMM_OPT", "HYBRID_OPT", "MEM_OPT", "1", "0.5", "0.25", "0"],
)
def test_strategies_give_kaisas_fractions(monkeypatch, fraction, expected):
    monkeypatch.setattr(preconditioner_module, "Communicator", FourRanks)
    pre = KFAC(TinyModel(), grad_worker_fraction=fraction, colocate_factors=True)
    found = (pre.grad_worker_fraction, pre.distributed_strategy, pre.grid.grad_workers)
    assert found == expected


@pytest.mark.parametrize(
    ("fraction", "ranks", "switched"),
    [
        (DistributedStrategy.MEM_OPT, 4, True),
        (0.25, 4, True),
        (0, 4, True),
        (DistributedStrategy.MEM_OPT, 1, True),  # KAISA's own test, in one process
        (DistributedStrategy.HYBRID_OPT, 4, False),
        (DistributedStrategy.COMM_OPT, 4, False),
        (1, 1, False),
    ],
    ids=["MEM_OPT", "0.25", "0", "MEM_OPT-1-rank", "HYBRID_OPT", "COMM_OPT", "1"],
)
def test_mem_opt_warns_and_colocates_the_factors(
    monkeypatch, fraction, ranks, switched
):
    """As KAISA 0.4: under MEM_OPT (a layer's one gradient worker holds both of
    its factors) ``colocate_factors=False`` warns, naming the user's line, and
    is switched on; other strategies keep it off, silently."""
    if ranks == 4:
        monkeypatch.setattr(preconditioner_module, "Communicator", FourRanks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = KFAC(
            TinyModel(),
            grad_worker_fraction=fraction,
            colocate_factors=False,
            compute_method="inverse",
        )
    caught = [w for w in caught if issubclass(w.category, UserWarning)]
    assert pre.colocate_factors is switched
    if not switched:
        assert not caught
        return
    assert len(caught) == 1
    assert "MEM_OPT" in str(caught[0].message)
    assert "colocate_factors=True" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert all(w.a_worker == w.g_worker for w in pre.assignment.values())


# -- KAISA's state-dict layout ------------------------------------------------------


def kaisa_state_dict(pre):
    """The layout KAISA 0.4's KFAC.state_dict() returns: torch.optim's ``state`` and
    ``param_groups`` (hyperparameters and ``step``) and the factors as a list."""
    group = {k: v for k, v in pre.param_groups[0].items() if k != "params"}
    return {
        "state": {},
        "param_groups": [{**group, "params": [0]}],
        "layers": [{"A": l.A.clone(), "G": l.G.clone()} for l in pre.layers],
    }


def test_kaisa_state_dict_resumes_at_an_inverse_update_step():
    options = dict(
        factor_update_steps=1, inv_update_steps=3, kl_clip=1e-2, damping=0.01
    )
    batches = data(9)
    model = TinyModel()
    train(model, KFAC(model, **options), batches)

    first = TinyModel()
    pre = KFAC(first, **options)
    train(first, pre, batches[:6])  # step 6 recomputes the inverses anyway
    saved = kaisa_state_dict(pre)
    resumed = TinyModel()
    resumed.load_state_dict(first.state_dict())
    fresh = KFAC(resumed, damping=0.5, inv_update_steps=3)  # hyperparameters load
    fresh.load_state_dict(saved)
    assert fresh.steps == 6
    assert (fresh.damping, fresh.kl_clip) == (0.01, 1e-2)
    train(resumed, fresh, batches[6:])
    assert torch.equal(parameters(model), parameters(resumed))


def test_kaisa_state_dict_of_another_model_is_refused():
    model = TinyModel()
    pre = KFAC(model)
    train(model, pre, data(1))
    saved = kaisa_state_dict(pre)
    saved["layers"] = saved["layers"][:1]
    with pytest.raises(ValueError, match="it has 1 layers, K-FAC registered 2"):
        KFAC(TinyModel()).load_state_dict(saved)
    saved = kaisa_state_dict(pre)
    saved["layers"][0]["A"] = torch.eye(3)
    with pytest.raises(ValueError, match=r"layers\['conv'\]\['A'\] has shape \(3, 3\)"):
        KFAC(TinyModel()).load_state_dict(saved)


# -- equivalents of KAISA's unit tests --------------------------------------------


def test_init_from_names_equals_init_from_enums():
    by_name = KFAC(TinyModel(), assignment_strategy="memory", compute_method="inverse")
    by_enum = KFAC(
        TinyModel(),
        assignment_strategy=AssignmentStrategy.MEMORY,
        compute_method=ComputeMethod.INVERSE,
    )
    assert by_name.assignment_strategy is by_enum.assignment_strategy
    assert by_name.compute_method is by_enum.compute_method is ComputeMethod.INVERSE


@pytest.mark.parametrize(
    "options",
    [
        dict(compute_method="eigen"),
        dict(compute_method="eigen", compute_eigenvalue_outer_product=False),
        dict(compute_method="inverse", colocate_factors=False),
        dict(grad_worker_fraction=DistributedStrategy.MEM_OPT, accumulation_steps=1),
    ],
    ids=["eigen", "eigen-no-prediv", "inverse", "mem-opt"],
)
def test_training_a_tiny_model_lowers_its_loss(options):
    model = TinyModel()
    batches = data(1) * 12
    losses = train(model, KFAC(model, 1, 2, 0.01, kl_clip=0.1, **options), batches)
    assert losses[-1] < 0.7 * losses[0]


def test_param_scheduler_state_dict_round_trip():
    pre = KFAC(TinyModel(), damping=0.1, factor_update_steps=4, inv_update_steps=8)
    scheduler = KFACParamScheduler(
        pre,
        damping_alpha=0.5,
        damping_schedule=[1],
        update_freq_alpha=0.5,
        update_freq_schedule=[2],
    )
    for _ in range(2):
        scheduler.step()
    other = KFAC(TinyModel(), damping=0.1, factor_update_steps=4, inv_update_steps=8)
    restored = KFACParamScheduler(
        other,
        damping_alpha=0.5,
        damping_schedule=[1],
        update_freq_alpha=0.5,
        update_freq_schedule=[2],
    )
    restored.load_state_dict(scheduler.state_dict())
    group = {k: v for k, v in other.param_groups[0].items() if k != "params"}
    assert group == {k: v for k, v in pre.param_groups[0].items() if k != "params"}
    assert (other.damping, other.factor_update_steps, other.inv_update_steps) == (
        0.05,
        2,
        4,
    )


# -- world_size_invariant=False: KAISA's factors under data parallelism ---------


def factor_worker(rank, world_size, init_file, out_dir):
    """One rank: one step of K-FAC on its half of a batch of 16 under DDP (float64),
    with world_size_invariant True and False; writes the first folds of A and G."""
    out = Path(out_dir)
    try:
        init_gloo(rank, world_size, init_file)
        ((x, y),) = data(1)
        x, y = torch.cat([x, -x]).double(), torch.cat([y, y])
        shard = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
        found = {}
        for invariant in (True, False):
            model = torch.nn.parallel.DistributedDataParallel(TinyModel().double())
            pre = KFAC(model, factor_decay=0.5, world_size_invariant=invariant)
            F.cross_entropy(model(x[shard]), y[shard]).backward()
            pre.step()
            found[invariant] = {l.name: (l.A, l.G) for l in pre.layers}
        torch.save(found, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_kaisas_factor_scaling_under_data_parallelism(tmp_path):
    """With 2 ranks, KAISA's G (g of each rank's own mean loss) is 2² times the G
    of the global loss that precond uses by default; A is the same, and in one
    process both are the same run."""
    error = spawn(factor_worker, (2, tmp_path / "init", tmp_path), 2, tmp_path)
    assert error is None, error
    found = torch.load(tmp_path / "rank0.pt", weights_only=True)
    for name, (a, g) in found[True].items():
        kaisa_a, kaisa_g = found[False][name]
        torch.testing.assert_close(kaisa_a, a, rtol=1e-12, atol=0)
        eye = torch.eye(len(g), dtype=g.dtype)
        g_batch = 2 * g - eye  # first fold: (I + G_batch) / 2
        kaisa_g_batch = 2 * kaisa_g - eye
        torch.testing.assert_close(kaisa_g_batch, 4 * g_batch, rtol=1e-9, atol=1e-15)
        assert g_batch.abs().max() > 1e-6


def test_step_takes_torch_optims_closure():
    """``step(closure)`` runs the closure (forward and backward) first, returns its
    loss, and then preconditions: the same run as the backward outside."""
    ((x, y),) = data(1)
    model, other = TinyModel(), TinyModel()
    pre, pre_other = KFAC(model), KFAC(other)

    def closure():
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = pre.step(closure)
    other.zero_grad()
    expected = F.cross_entropy(other(x), y)
    expected.backward()
    assert pre_other.step() is None
    assert torch.equal(loss, expected)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert pre.steps == 1
