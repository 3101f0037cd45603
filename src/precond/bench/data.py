"""The data of the benchmark workloads: fixed splits and minibatch orders, in NumPy.

Nothing is downloaded: the digits come with scikit-learn and the text with Python
(``pydoc_data.topics``). Every function is deterministic for its seed, and the same
arrays feed the JAX and the PyTorch models.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Split:
    """A supervised dataset split into disjoint train and test rows (NumPy arrays).

    Inputs are float32 features or int32 tokens; targets are int32 labels, one per
    row (classification) or one per position of the row (language modelling), or
    float32 vectors, one per row (regression).
    """

    x_train: np.ndarray  # (n_train, ...) float32 features or int32 tokens
    y_train: np.ndarray  # (n_train,) or (n_train, ...) int32, or float32 vectors
    x_test: np.ndarray  # (n_test, ...) float32 features or int32 tokens
    y_test: np.ndarray  # (n_test,) or (n_test, ...) int32, or float32 vectors


def batch_indices(n_rows: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """Row indices of every minibatch: shape (steps, batch_size), int32.

    Epochs are consecutive random permutations of the ``n_rows`` rows (drawn from
    ``numpy.random.default_rng(seed)``), concatenated and cut into batches, so every
    row is seen once per epoch and the order is the same for the same seed; the
    first ``k`` batches do not depend on ``steps`` (a prefix of a longer order).
    """
    import numpy as np

    if batch_size > n_rows:
        raise ValueError(
            f"Invalid batch_size={batch_size!r}: must be <= {n_rows} training rows"
        )
    rng = np.random.default_rng(seed)
    needed = steps * batch_size
    epochs = -(-needed // n_rows)
    order = np.concatenate([rng.permutation(n_rows) for _ in range(epochs)])
    return order[:needed].reshape(steps, batch_size).astype(np.int32)


class BatchStream:
    """Minibatch row indices for an open-ended number of steps (time budgets).

    ``next()`` returns the indices of the next batch; the sequence equals
    :func:`batch_indices` for the same rows, batch size and seed, however many
    steps are taken.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int):
        import numpy as np

        if batch_size > n_rows:
            raise ValueError(
                f"Invalid batch_size={batch_size!r}: must be <= {n_rows} training rows"
            )
        self._rng = np.random.default_rng(seed)
        self._n_rows, self._batch_size = n_rows, batch_size
        self._buffer = np.empty(0, dtype=np.int32)

    def next(self) -> np.ndarray:
        import numpy as np

        while len(self._buffer) < self._batch_size:
            epoch = self._rng.permutation(self._n_rows).astype(np.int32)
            self._buffer = np.concatenate([self._buffer, epoch])
        batch, self._buffer = np.split(self._buffer, [self._batch_size])
        return batch


# --------------------------------------------------------------------------- digits

DIGITS_TEST_FRACTION = 0.2


def load_digits_split(split_seed: int) -> Split:
    """scikit-learn's 8×8 digits (1797 rows), 20% held out, features standardised.

    Rows are permuted by ``numpy.random.default_rng(split_seed)``; the first 20% are
    the test set, the rest the train set (disjoint by construction, and the dataset
    has no duplicate rows). Each pixel is standardised with the train set's mean and
    standard deviation (pixels constant on the train set are only centred). Rows
    are the 64 pixels in row-major order (the CNN reshapes them to 8×8).
    """
    import numpy as np
    from sklearn.datasets import load_digits

    pixels, labels = load_digits(return_X_y=True)
    x = np.asarray(pixels, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int32)
    order = np.random.default_rng(split_seed).permutation(len(x))
    n_test = round(DIGITS_TEST_FRACTION * len(x))
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std = np.where(std > 0, std, 1.0)
    x = ((x - mean) / std).astype(np.float32)
    return Split(x[train], y[train], x[test], y[test])


# --------------------------------------------------------------------------- teacher

# A regression task with an unlimited supply of fresh samples: inputs drawn from a
# Gaussian whose covariance has a condition number of 10⁴ (eigenvalues
# log-spaced from 1 down to 10⁻⁴, in a random basis), targets from a fixed random
# tanh network (the teacher). The train rows are enough for every step of the
# bench's budget to see rows it has not seen before.
TEACHER_SIZES = (32, 64, 64, 8)  # the teacher network: inputs, hidden, outputs
TEACHER_CONDITION = 1e4  # largest / smallest eigenvalue of the inputs' covariance
TEACHER_TRAIN_ROWS = 1 << 19
TEACHER_TEST_ROWS = 4096


def teacher_network(seed: int):
    """The teacher's weight matrices (float64), N(0, 1/fan_in) entries, and the
    square root of the inputs' covariance ((d, d), float64), from ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = TEACHER_SIZES
    weights = [rng.normal(0.0, m**-0.5, (m, n)) for m, n in itertools.pairwise(sizes)]
    d = sizes[0]
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    variances = TEACHER_CONDITION ** -np.linspace(0.0, 1.0, d)
    variances *= d / variances.sum()  # trace d: unit variance on average
    return weights, (basis * np.sqrt(variances)) @ basis.T


def teacher_targets(weights, x):
    """The teacher's outputs for inputs ``x``: tanh hidden layers, linear output."""
    import numpy as np

    *hidden, last = weights
    for w in hidden:
        x = np.tanh(x @ w)
    return x @ last


@functools.lru_cache(maxsize=1)
def load_teacher_student_split(split_seed: int) -> Split:
    """``TEACHER_TRAIN_ROWS`` training and ``TEACHER_TEST_ROWS`` test rows of the
    teacher–student regression, float32: inputs ``x = z·C^{1/2}`` with z
    standard normal, targets the teacher's outputs standardised with the train
    rows' mean and standard deviation. ``split_seed`` draws the teacher, the
    covariance and the rows. Cached: every run of a suite shares one copy (the
    arrays must not be written to)."""
    import numpy as np

    weights, root = teacher_network(split_seed)
    rng = np.random.default_rng(split_seed + 1)
    z = rng.normal(size=(TEACHER_TRAIN_ROWS + TEACHER_TEST_ROWS, TEACHER_SIZES[0]))
    x = z @ root
    y = teacher_targets(weights, x)
    n = TEACHER_TRAIN_ROWS
    y = (y - y[:n].mean(axis=0)) / y[:n].std(axis=0)
    x, y = x.astype(np.float32), y.astype(np.float32)
    return Split(x[:n], y[:n], x[n:], y[n:])


# --------------------------------------------------------------------------- char-lm

CHAR_LM_VOCAB = 256  # bytes
CHAR_LM_CONTEXT = 64
CHAR_LM_TEST_FRACTION = 0.1


def char_lm_text() -> bytes:
    """The text of the standard library's ``pydoc_data.topics`` (Python's help
    topics, ~465 KB): its topics in sorted key order, concatenated, UTF-8."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def load_char_lm_split(split_seed: int) -> Split:
    """Next-byte prediction windows of :func:`char_lm_text`, 10% held out.

    The bytes are cut into consecutive windows of ``CHAR_LM_CONTEXT + 1`` bytes
    starting every ``CHAR_LM_CONTEXT`` bytes (neighbours share one byte); a
    window's first 64 bytes are the input (int32 tokens) and its last 64 the
    targets, so position t predicts byte t + 1. Windows are permuted by
    ``numpy.random.default_rng(split_seed)``; the first 10% are the validation
    (test) set.
    """
    import numpy as np

    data = np.frombuffer(char_lm_text(), dtype=np.uint8).astype(np.int32)
    context = CHAR_LM_CONTEXT
    n = (len(data) - 1) // context
    windows = data[np.arange(n)[:, None] * context + np.arange(context + 1)]
    order = np.random.default_rng(split_seed).permutation(n)
    n_test = round(CHAR_LM_TEST_FRACTION * n)
    test, train = order[:n_test], order[n_test:]
    x, y = windows[:, :-1], windows[:, 1:]
    return Split(x[train], y[train], x[test], y[test])
