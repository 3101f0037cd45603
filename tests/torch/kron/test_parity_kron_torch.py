"""precond.torch.Kron as a drop-in for kron-torch 0.1.0 (issue 18), against the
installed oracle (``tests.oracles.kron_torch()``, the ``parity`` extra).

(a) Signature: kron-torch 0.1.0's parameters in its order, kinds and defaults;
    kron-torch 0.3.3's additions keyword-only right after them, then precond's.
(b) Trajectories: same gradients, same random draws, 20 steps, the updates
    θ_20 − θ_0 within 1e-5 (relative) in float32, over shapes from scalars to
    3-D, weight decay, constant and scheduled update probabilities, diagonal
    factors forced by size and by skew, and float64 state. The draws are made
    equal by seeding torch's global generator identically: with ``seed=None``
    precond draws from it in kron-torch's order (the update decision per group
    and step, then per parameter V and, for 2+ dims, the balancing draw).
    ``store_debiased_momentum=True`` restores 0.1.0's momentum buffer (see
    docs/migrating/kron-torch.md); every other argument is left at its default.
(c) The seed document's usage snippet, with only the import changed.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import numpy as np
import pytest
import torch

from precond.torch import Kron, precond_update_prob_schedule
from precond.torch.kron import kron as kron_module
from tests import oracles

STEPS = 20
RTOL = 1e-5

# kron-torch 0.3.3's additions, in its order, with its defaults (written from
# its signature; 0.3.3 is not installed). precond's defaults keep 0.1.0's
# behaviour where 0.3.3's would change it.
KRON_TORCH_0_3_3_ADDITIONS = {
    "min_ndim_triangular": 2,
    "memory_save_mode": None,
    "momentum_into_precond_update": True,
    "precond_lr": 0.1,
    "precond_init_scale": 1.0,
    "merge_dims": True,
}
# 0.1.0 has no such rule (min_ndim_triangular=1: vectors may be triangular) and
# no merging (merge_dims=False).
SEED_BEHAVIOUR_DEFAULTS = {"min_ndim_triangular": 1, "merge_dims": False}


@pytest.fixture(scope="module")
def kron_torch():
    return oracles.kron_torch()


# --- (a) signature -------------------------------------------------------------


def test_signature_starts_with_kron_torch_0_1_0s(kron_torch):
    ours = list(inspect.signature(Kron).parameters.values())
    theirs = list(inspect.signature(kron_torch.Kron).parameters.values())
    assert len(theirs) == 9
    for mine, seed in zip(ours, theirs, strict=False):
        assert (mine.name, mine.kind, mine.default) == (
            seed.name,
            seed.kind,
            seed.default,
        )
    rest = ours[len(theirs) :]
    assert rest
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest)
    # 0.3.3's additions come first, in its order.
    added = rest[: len(KRON_TORCH_0_3_3_ADDITIONS)]
    assert [p.name for p in added] == list(KRON_TORCH_0_3_3_ADDITIONS)
    for p in added:
        want = SEED_BEHAVIOUR_DEFAULTS.get(p.name, KRON_TORCH_0_3_3_ADDITIONS[p.name])
        assert p.default == want, p.name


def test_schedule_signature_is_kron_torch_0_1_0s(kron_torch):
    ours = inspect.signature(precond_update_prob_schedule).parameters
    theirs = inspect.signature(kron_torch.kron.precond_update_prob_schedule).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_positional_arguments_bind_as_in_kron_torch(kron_torch):
    """The issue's call: the 7th positional argument is max_skew_triangular."""
    args = (1e-2, 0.8, 0.1, 0.5, 16, 3, torch.float64, torch.float64)
    ours = Kron([torch.nn.Parameter(torch.zeros(2))], *args).param_groups[0]
    theirs = kron_torch.Kron([torch.nn.Parameter(torch.zeros(2))], *args)
    theirs = theirs.param_groups[0]
    names = list(inspect.signature(kron_torch.Kron).parameters)[1:]
    assert [ours[n] for n in names] == [theirs[n] for n in names]
    assert ours["max_skew_triangular"] == 3


def test_default_schedule_has_kron_torch_0_1_0s_flat_start(kron_torch):
    """p(n) = 1 up to n = 200, then the same float32 anneal, bit for bit, down
    to the 0.03 floor."""
    n = np.arange(1, 6001)
    ours = np.array([precond_update_prob_schedule()(int(i)) for i in n], np.float32)
    schedule = kron_torch.kron.precond_update_prob_schedule()
    theirs = np.array([schedule(int(i)) for i in n], np.float32)
    np.testing.assert_array_equal(ours, theirs)
    assert (ours[:200] == 1).all()
    assert ours[200] < 1
    assert ours[-1] == np.float32(0.03)


# --- (b) trajectories ----------------------------------------------------------


# name: (parameter shapes, arguments of both, precond-only arguments)
CASES = {
    # Scalars and vectors (diagonal above 10 by the skew rule, triangular at 3),
    # a tall matrix whose long axis the skew rule makes diagonal.
    "shapes": ([(), (3,), (12,), (5, 4), (3, 4, 2), (40, 3)], {}),
    # Weight decay on every parameter, 1-D and scalars included; λ = 2 makes
    # the [-1, 1] clamp act and the updates' global norm exceed √(number of
    # parameters), where kron-torch's clip_grad_norm_ call, a no-op on tensors
    # without a .grad, would rescale them if it acted.
    "weight_decay": ([(), (3,), (12,), (5, 4), (3, 4, 2)], dict(weight_decay=2.0)),
    # A constant probability: Bernoulli decisions from the global generator.
    "probability_half": (
        [(3,), (5, 4), (3, 4, 2)],
        dict(preconditioner_update_probability=0.5),
    ),
    "diagonal_by_size": ([(5, 4), (3, 4, 2)], dict(max_size_triangular=3)),
    "diagonal_by_skew": ([(8, 2), (2, 3, 9), (4,)], dict(max_skew_triangular=1.5)),
    "all_diagonal_by_skew": ([(5, 4), (3,)], dict(max_skew_triangular=0)),
    "float64_state": (
        [(5, 4), (3,)],
        dict(mu_dtype=torch.float64, precond_dtype=torch.float64),
    ),
    "large_steps": ([(5, 4), (3,)], dict(lr=0.3, b1=0.5)),
    "no_momentum": ([(5, 4), (3,)], dict(b1=0.0, lr=0.05)),
}


def _run(make, shapes, dtype=torch.float32):
    """θ_20 − θ_0 (float64) and the optimizer after 20 steps on fixed gradients,
    with the global generator seeded before construction."""
    source = torch.Generator().manual_seed(123)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=source).to(dtype)) for s in shapes
    ]
    grads = [
        [torch.randn(s, generator=source).to(dtype) for s in shapes]
        for _ in range(STEPS)
    ]
    start = [p.detach().double().clone() for p in params]
    torch.manual_seed(0)
    optimizer = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    moved = [p.detach().double() - s for p, s in zip(params, start, strict=True)]
    return moved, optimizer, params


def _relative(ours, theirs):
    return max(
        float((a - b).norm() / b.norm()) for a, b in zip(ours, theirs, strict=True)
    )


def _structure(factors):
    """('d' or 't', size) per factor; a 0-d scalar factor is a diagonal of 1."""
    return [("d" if Q.ndim < 2 else "t", Q.shape[0] if Q.ndim else 1) for Q in factors]


def test_trajectories_match_kron_torch(kron_torch):
    """Measured: at most 5.3e-7 apart (no_momentum; 0 in four of the cases)."""
    cases = {name: (shapes, kwargs, kwargs) for name, (shapes, kwargs) in CASES.items()}
    # Annealed from step 5 on: the decisions come from the draws; each side's
    # own schedule function.
    schedule = dict(flat_start=5, decay=0.2)
    cases["schedule"] = (
        [(3,), (5, 4)],
        dict(
            preconditioner_update_probability=precond_update_prob_schedule(**schedule)
        ),
        dict(
            preconditioner_update_probability=(
                kron_torch.kron.precond_update_prob_schedule(**schedule)
            )
        ),
    )
    for name, (shapes, ours_kwargs, theirs_kwargs) in cases.items():
        theirs, oracle, _ = _run(
            lambda p, kw=theirs_kwargs: kron_torch.Kron(p, **kw), shapes
        )
        ours, optimizer, params = _run(
            lambda p, kw=ours_kwargs: Kron(
                p, seed=None, store_debiased_momentum=True, **kw
            ),
            shapes,
        )
        assert _relative(ours, theirs) <= RTOL, name
        assert all(float(m.norm()) > 1e-3 for m in theirs), name  # it moved
        for p, (their_factors, _) in zip(params, oracle._Qs_exprs, strict=True):
            factors = optimizer.state[p][kron_module.FACTORS]
            assert _structure(factors) == _structure(their_factors), name
            assert {Q.dtype for Q in factors} == {Q.dtype for Q in their_factors}


def test_kron_torch_0_1_0s_momentum_buffer_is_what_store_debiased_momentum_restores(
    kron_torch,
):
    """Without it (precond's default: the buffer keeps m) the same run ends far
    from kron-torch's, so the parity above depends on the argument."""
    shapes, kwargs = CASES["shapes"]
    theirs, _, _ = _run(lambda p: kron_torch.Kron(p, **kwargs), shapes)
    ours, _, _ = _run(lambda p: Kron(p, seed=None, **kwargs), shapes)
    assert _relative(ours, theirs) > 0.1


def test_bfloat16_trajectory_is_close_to_kron_torch(kron_torch):
    """bfloat16 parameters, factors and momentum (kron-torch's default dtypes for
    them; diagonal factors, since 0.1.0 cannot solve triangular systems in
    bfloat16). kron-torch computes in bfloat16, precond in float32 (its factors
    still stored in bfloat16), so they differ by bfloat16 rounding: measured
    2.9e-3 relative after 20 steps (bfloat16's ulp at 1 is 7.8e-3)."""
    shapes, kwargs = [(5, 4), (3,)], dict(max_size_triangular=0)
    theirs, _, _ = _run(
        lambda p: kron_torch.Kron(p, **kwargs), shapes, dtype=torch.bfloat16
    )
    ours, optimizer, params = _run(
        lambda p: Kron(p, seed=None, store_debiased_momentum=True, **kwargs),
        shapes,
        dtype=torch.bfloat16,
    )
    assert _relative(ours, theirs) <= 1e-2
    for p in params:
        state = optimizer.state[p]
        assert state[kron_module.MOMENTUM].dtype == torch.bfloat16
        assert {Q.dtype for Q in state[kron_module.FACTORS]} == {torch.bfloat16}


# --- (c) the seed document's snippet ------------------------------------------


def test_basic_usage_snippet_runs_with_only_the_import_changed(kron_torch):
    """The README's basic usage (construct with the parameters alone, zero_grad,
    backward, step), with ``from precond.torch import Kron``: the defaults equal
    kron-torch's in the param group, and repeating the snippet lowers the loss
    of a small least-squares fit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    inputs, targets = torch.randn(32, 6), torch.randn(32, 1)

    def compute_loss():
        return torch.nn.functional.mse_loss(model(inputs), targets)

    params = model.parameters()
    optimizer = Kron(params)
    with torch.no_grad():
        first = float(compute_loss())
    for _ in range(30):
        loss = compute_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        assert float(compute_loss()) < first

    theirs = kron_torch.Kron([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    ours = optimizer.param_groups[0]
    shared = set(inspect.signature(kron_torch.Kron).parameters) - {
        "params",
        "preconditioner_update_probability",  # kron-torch stores its schedule
    }
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    assert ours["preconditioner_update_probability"] is None


# --- the migration page ---------------------------------------------------------


def test_migration_page_names_only_real_arguments():
    """Every argument that the "Differences from the original" table says turns
    a difference back off is an argument of Kron."""
    page = pathlib.Path(__file__).parents[3] / "docs" / "migrating" / "kron-torch.md"
    text = page.read_text(encoding="utf-8")
    table = text.split("## Differences from the original", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    assert rows
    named = set()
    for row in rows:
        last = row.strip("|").split("|")[-1]
        named |= set(re.findall(r"`(\w+)=", last))
    assert named
    assert named <= set(inspect.signature(Kron).parameters)


def test_kron_torch_state_dict_loads_and_the_run_continues_as_kron_torchs(
    kron_torch,
):
    """A kron-torch 0.1.0 state dict (momenta and step in its param groups, no
    factors) loaded into Kron: the next 10 steps equal kron-torch's own resumed
    run (which restarts its factors too), within 1e-5."""
    shapes = [(5, 4), (3,), ()]
    source = torch.Generator().manual_seed(5)
    start = [torch.randn(s, generator=source) for s in shapes]
    grads = [[torch.randn(s, generator=source) for s in shapes] for _ in range(15)]

    def train(optimizer, params, step_grads):
        for gs in step_grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            optimizer.step()

    torch.manual_seed(1)
    params = [torch.nn.Parameter(t.clone()) for t in start]
    first = kron_torch.Kron(params, weight_decay=0.1)
    train(first, params, grads[:5])
    checkpoint = first.state_dict()
    middle = [p.detach().clone() for p in params]

    runs = []
    for make in (
        lambda p: kron_torch.Kron(p, weight_decay=0.1),
        lambda p: Kron(p, weight_decay=0.1, seed=None, store_debiased_momentum=True),
    ):
        resumed = [torch.nn.Parameter(t.clone()) for t in middle]
        optimizer = make(resumed)
        optimizer.load_state_dict(checkpoint)
        torch.manual_seed(2)
        train(optimizer, resumed, grads[5:])
        runs.append([p.detach().double() - m for p, m in zip(resumed, middle)])
    theirs, ours = runs
    assert _relative(ours, theirs) <= RTOL
    assert all(float(m.norm()) > 1e-3 for m in theirs)


# (shape, kron-torch 0.3.3's arguments, factor structure it plans)
KRON_TORCH_0_3_3_PLANS = [
    ((5,), dict(min_ndim_triangular=2), [("d", 5)]),
    ((5,), {}, [("t", 5)]),  # 0.1.0: a vector no longer than 10 is triangular
    ((8, 4), dict(memory_save_mode="smart_one_diag"), [("d", 8), ("t", 4)]),
    ((4, 4), dict(memory_save_mode="smart_one_diag"), [("t", 4), ("t", 4)]),
    ((4, 4), dict(memory_save_mode="one_diag"), [("t", 4), ("d", 4)]),
    ((2, 3, 4), dict(merge_dims=True), [("t", 6), ("t", 4)]),
    ((4, 3, 2), dict(merge_dims=True), [("t", 12), ("t", 2)]),
    ((2, 3, 40), dict(merge_dims=True), [("t", 6), ("t", 40)]),
    ((2, 3, 40), {}, [("t", 2), ("t", 3), ("d", 40)]),  # 0.1.0's skew rule
]


@pytest.mark.parametrize(
    ("shape", "kwargs", "plan"),
    KRON_TORCH_0_3_3_PLANS,
    ids=[f"{s}-{sorted(k.items())}" for s, k, _ in KRON_TORCH_0_3_3_PLANS],
)
def test_kron_torch_0_3_3_planning_arguments(shape, kwargs, plan):
    """0.3.3's min_ndim_triangular, memory_save_mode (with 'smart_one_diag')
    and merge_dims (a 3+-D tensor as the less skewed of (d₁⋯d_{k−1}, d_k) and
    (d₁, d₂⋯d_k)) plan the factors as 0.3.3 does; max_skew_triangular=inf
    (0.3.3 has no skew rule) wherever merging is asked."""
    if kwargs.get("merge_dims"):
        kwargs = dict(kwargs, max_skew_triangular=float("inf"))
    p = torch.nn.Parameter(torch.zeros(shape))
    optimizer = Kron([p], **kwargs)
    p.grad = torch.ones(shape)
    optimizer.step()
    assert _structure(optimizer.state[p][kron_module.FACTORS]) == plan
