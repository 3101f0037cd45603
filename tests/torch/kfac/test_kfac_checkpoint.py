"""K-FAC checkpoints: exact resume at every step of an update cycle, and refused
loads of checkpoints that do not fit the model.

Oracle: the uninterrupted run. A run saved after k steps (``state_dict`` through
``torch.save``/``torch.load(weights_only=True)``, ``copy.deepcopy`` or ``pickle``)
and resumed in a fresh model, optimizer and preconditioner built from the same
initial weights ends with bit-identical parameters, for every k before, on and
after each factor and inverse update step.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precond.torch.kfac import KFAC

INV_UPDATE_STEPS = 3
STEPS = 2 * INV_UPDATE_STEPS + 2


def mlp(hidden=6, depth=2):
    torch.manual_seed(0)
    layers = [nn.Linear(4, hidden), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(hidden, 3))


BATCHES = [
    (torch.randn(8, 4, generator=torch.Generator().manual_seed(s)), torch.arange(8) % 3)
    for s in range(STEPS)
]


def build(initial, options):
    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, KFAC(model, kl_clip=1e-2, **options)


def train(model, optimizer, preconditioner, batches):
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()


def through_torch_save(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resumed(initial, options, k, transport, kaisa_format=False):
    model, optimizer, pre = build(initial, options)
    train(model, optimizer, pre, BATCHES[:k])
    saved = {"model": model.state_dict(), "opt": optimizer.state_dict()}
    saved["kfac"] = pre.state_dict()
    if kaisa_format:  # KAISA's keys only: the decompositions are recomputed
        del saved["kfac"]["second_order"], saved["kfac"]["ready"]
    checkpoint = transport(saved)
    model, optimizer, pre = build(initial, options)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["opt"])
    pre.load_state_dict(checkpoint["kfac"])
    assert pre.steps == k
    train(model, optimizer, pre, BATCHES[k:])
    return list(model.parameters())


OPTIONS = [
    dict(factor_update_steps=1, inv_update_steps=INV_UPDATE_STEPS),
    dict(factor_update_steps=2, inv_update_steps=INV_UPDATE_STEPS),
    dict(
        factor_update_steps=2,
        inv_update_steps=INV_UPDATE_STEPS,
        compute_method="inverse",
    ),
    dict(inv_update_steps=INV_UPDATE_STEPS, compute_eigenvalue_outer_product=False),
]


@pytest.mark.parametrize("options", OPTIONS, ids=["f1", "f2", "f2-inverse", "f1-d"])
def test_resume_at_every_step_of_the_cycle_is_bit_identical(options):
    initial = mlp()
    model, optimizer, pre = build(initial, options)
    train(model, optimizer, pre, BATCHES)
    reference = list(model.parameters())
    kaisa_differs = []
    for k in range(1, 2 * INV_UPDATE_STEPS + 2):
        transport = copy.deepcopy if k == INV_UPDATE_STEPS + 1 else through_torch_save
        got = resumed(initial, options, k, transport)
        for p, q in zip(reference, got, strict=True):
            assert torch.equal(p, q), (k, transport.__name__)
        # A KAISA-format dict (factors only) recomputes the decompositions: exact
        # right before an inverse-update step, not in general.
        got = resumed(initial, options, k, through_torch_save, kaisa_format=True)
        same = all(torch.equal(p, q) for p, q in zip(reference, got, strict=True))
        if k % INV_UPDATE_STEPS == 0:
            assert same, k
        kaisa_differs.append(not same)
    assert any(kaisa_differs)  # the saved decompositions are what makes it exact


def test_state_dict_pickles_and_loading_copies():
    initial = mlp()
    model, optimizer, pre = build(initial, OPTIONS[0])
    train(model, optimizer, pre, BATCHES[:4])
    state = pickle.loads(pickle.dumps(pre.state_dict()))
    before = copy.deepcopy(state)
    other_model, _, other = build(initial, OPTIONS[0])
    other.load_state_dict(state)
    train(
        other_model,
        torch.optim.SGD(other_model.parameters(), lr=0.1),
        other,
        BATCHES[4:],
    )
    for name, tensors in before["second_order"].items():  # not aliased by the load
        for key, tensor in tensors.items():
            assert torch.equal(state["second_order"][name][key], tensor)
    for layer in other.layers:
        for key, tensor in layer.second_order.items():
            assert not torch.equal(tensor, before["second_order"][layer.name][key])


# -- loads that do not fit -----------------------------------------------------


def test_checkpoint_of_another_model_is_refused_before_anything_changes():
    initial = mlp()
    model, optimizer, pre = build(initial, OPTIONS[0])
    train(model, optimizer, pre, BATCHES[:2])
    snapshot = copy.deepcopy(pre.state_dict())

    def other(hidden=6, depth=2, **options):
        m = mlp(hidden, depth)
        p = KFAC(m, **{**OPTIONS[0], **options})
        train(m, torch.optim.SGD(m.parameters(), lr=0.1), p, BATCHES[:2])
        return p.state_dict()

    wider = other(hidden=7)
    deeper = other(depth=3)
    inverse = other(compute_method="inverse")
    bad_second = copy.deepcopy(snapshot)
    bad_second["second_order"]["2"]["q_g"] = torch.zeros(4, 4)
    not_a_tensor = copy.deepcopy(snapshot)
    not_a_tensor["layers"]["0"]["G"] = [[1.0]]
    no_factor = copy.deepcopy(snapshot)
    del no_factor["layers"]["2"]["A"]
    cases = [
        (wider, r"layers\['0'\]\['G'\] has shape \(7, 7\), expected \(6, 6\)"),
        (deeper, r"missing \[\], unexpected \['4'\]"),
        (
            bad_second,
            r"second_order\['2'\]\['q_g'\] has shape \(4, 4\), expected \(3, 3\)",
        ),
        (not_a_tensor, r"layers\['0'\]\['G'\] is a list, expected a tensor"),
        (no_factor, r"layers\['2'\]\['A'\] is missing"),
        ({**snapshot, "steps": -1}, r"Invalid steps=-1: must be >= 0"),
        ({**snapshot, "damping": "big"}, r"Invalid damping='big'"),
    ]
    for state, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            pre.load_state_dict(state)
        now = pre.state_dict()  # nothing changed
        assert now["steps"] == snapshot["steps"]
        for name, factors in snapshot["layers"].items():
            for key, factor in factors.items():
                assert torch.equal(now["layers"][name][key], factor)
    # Another compute method's decompositions do not fit: recomputed from the factors.
    pre.load_state_dict(inverse)
    assert sorted(pre.layers[0].second_order) == ["prediv", "q_a", "q_g"]
