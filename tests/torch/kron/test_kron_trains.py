"""Kron trains a small CNN on sklearn's digits, and beats a tuned AdamW.

Protocol (the same for both optimizers): a fixed stratified 75/25 split of
``load_digits`` (1347 train, 450 test images of 8×8), a CNN of two 3×3
convolutions (16 and 32 channels), a 2×2 max-pool and a 512→10 linear layer,
200 steps of batch 64 drawn with a fixed generator, the learning rate decayed
linearly to 0 (``LambdaLR``), each optimizer's learning rate tuned over 3
values around its optimum (Kron's README: about 3× smaller than Adam's),
otherwise default hyperparameters. The loss compared is the cross-entropy on the
whole training set after the last step; the learning rate with the lowest one is
each optimizer's tuned result.

Measured (torch 2.13 CPU, init/batch seeds 0-3; the test uses seed 0):

==========  ======================  =====================  ====================
seed        Kron best train loss    AdamW best train loss  Kron test accuracy
==========  ======================  =====================  ====================
0           0.00041 (lr 1e-2)       0.0060 (lr 3e-2)       0.989
1           0.0025 (lr 1e-2)        0.0126 (lr 3e-2)       0.980
2           0.00086 (lr 1e-2)       0.0040 (lr 1e-1)       0.989
3           0.0054 (lr 1e-2)        0.0076 (lr 3e-2)       0.987
==========  ======================  =====================  ====================

Kron's training loss is lower at every seed (by 1.4× to 15×); the assertions
below leave margins for other BLAS builds: Kron's loss at most half of AdamW's
at seed 0 (measured 1/15), and a test accuracy of at least 0.96 (measured
0.980-0.989, i.e. at least 7 more of the 450 test images wrong). About 10-15 s.
"""

from __future__ import annotations

import pytest
import torch

from precond.torch import Kron
from tests.torch.kron.test_kron_optimizer import PRECOND_RULES

sklearn_datasets = pytest.importorskip("sklearn.datasets")
sklearn_model_selection = pytest.importorskip("sklearn.model_selection")

STEPS = 200
BATCH = 64
SEED = 0
KRON_LRS = (3e-3, 1e-2, 3e-2)
ADAMW_LRS = (1e-2, 3e-2, 1e-1)
MIN_TEST_ACCURACY = 0.96
MAX_LOSS_RATIO = 0.5


@pytest.fixture(scope="module")
def digits():
    X, y = sklearn_datasets.load_digits(return_X_y=True)
    X_train, X_test, y_train, y_test = sklearn_model_selection.train_test_split(
        X, y, test_size=0.25, random_state=0, stratify=y
    )

    def images(X):
        return torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)

    return (
        images(X_train),
        torch.tensor(y_train),
        images(X_test),
        torch.tensor(y_test),
    )


@pytest.fixture
def one_thread():
    """One intra-op thread: faster for this model on a shared CPU, deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cnn(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )


def train(make_optimizer, lr, data, seed=SEED):
    """(final train loss on the whole training set, test accuracy)."""
    X_train, y_train, X_test, y_test = data
    model = cnn(seed)
    optimizer = make_optimizer(model.parameters(), lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / STEPS)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(STEPS):
        rows = torch.randint(0, len(X_train), (BATCH,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X_train[rows]), y_train[rows])
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        train_loss = torch.nn.functional.cross_entropy(model(X_train), y_train)
        accuracy = (model(X_test).argmax(dim=1) == y_test).float().mean()
    return train_loss.item(), accuracy.item()


def tuned(make_optimizer, lrs, data):
    """{lr: (train loss, accuracy)} and the lr with the lowest train loss."""
    results = {lr: train(make_optimizer, lr, data) for lr in lrs}
    best = min(results, key=lambda lr: results[lr][0])
    return results, best


# The rules Kron had when the table above was measured (before kron-torch
# 0.1.0's became its defaults, issue 18), passed explicitly so the figures hold.
# (With the new defaults, seed 0 measured: 0.0011 at lr 3e-2, 0.0013 at 1e-2,
# test accuracy 0.993; AdamW's best 0.0060.)
MEASURED_RULES = PRECOND_RULES


def test_kron_trains_a_cnn_on_digits_better_than_tuned_adamw(digits, one_thread):
    kron, kron_lr = tuned(
        lambda p, lr: Kron(p, lr=lr, **MEASURED_RULES), KRON_LRS, digits
    )
    adamw, adamw_lr = tuned(
        lambda p, lr: torch.optim.AdamW(p, lr=lr), ADAMW_LRS, digits
    )
    summary = f"Kron {kron} (best {kron_lr}); AdamW {adamw} (best {adamw_lr})"
    kron_loss, kron_accuracy = kron[kron_lr]
    adamw_loss, _ = adamw[adamw_lr]
    assert kron_accuracy >= MIN_TEST_ACCURACY, summary
    assert kron_loss <= MAX_LOSS_RATIO * adamw_loss, summary
    # The grids bracket each optimizer's optimum rather than favour one of them:
    # neither's best learning rate is the largest tried.
    assert kron_lr != max(KRON_LRS), summary
    assert adamw_lr != max(ADAMW_LRS), summary
