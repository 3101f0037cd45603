"""Benchmark workloads: a dataset split, a model, its loss and its metrics.

A workload is a :class:`Workload` registered by name in :data:`WORKLOADS`. Its data
is NumPy (loaded once, deterministic for a split seed); its model functions are pure
JAX functions of a parameter pytree, so the runner can ``jit`` them with any optax
optimizer. JAX and scikit-learn are imported inside functions, never at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

Params = Any  # a pytree of jax.Array


@dataclass(frozen=True)
class Split:
    """A supervised dataset split into disjoint train and test rows (NumPy arrays)."""

    x_train: np.ndarray  # (n_train, ...) float32
    y_train: np.ndarray  # (n_train,) int32
    x_test: np.ndarray  # (n_test, ...) float32
    y_test: np.ndarray  # (n_test,) int32


@dataclass(frozen=True)
class Workload:
    """One benchmark task.

    Attributes:
        name: registry key, used on the command line.
        description: one line for ``precond bench --list``.
        load_split: split_seed ↦ :class:`Split`, deterministic for the seed.
        init_params: seed ↦ parameter pytree, deterministic for the seed.
        loss: (params, x, y) ↦ scalar mean training loss (traceable by JAX).
        metrics: (params, x, y) ↦ dict of scalar evaluation metrics (traceable).
        split_seed: the seed of the train/test split used by the bench, fixed so
            every training seed is scored on the same test rows.
    """

    name: str
    description: str
    load_split: Callable[[int], Split]
    init_params: Callable[[int], Params]
    loss: Callable[[Params, Any, Any], Any]
    metrics: Callable[[Params, Any, Any], dict[str, Any]]
    split_seed: int = 0


def batch_indices(n_rows: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """Row indices of every minibatch: shape (steps, batch_size), int32.

    Epochs are consecutive random permutations of the ``n_rows`` rows (drawn from
    ``numpy.random.default_rng(seed)``), concatenated and cut into batches, so every
    row is seen once per epoch and the order is the same for the same seed.
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


# --------------------------------------------------------------------------- digits


DIGITS_TEST_FRACTION = 0.2
DIGITS_LAYER_SIZES = (64, 256, 256, 10)


def load_digits_split(split_seed: int) -> Split:
    """scikit-learn's 8×8 digits (1797 rows), 20% held out, features standardised.

    Rows are permuted by ``numpy.random.default_rng(split_seed)``; the first 20% are
    the test set, the rest the train set (disjoint by construction, and the dataset
    has no duplicate rows). Each pixel is standardised with the train set's mean and
    standard deviation (pixels constant on the train set are only centred).
    """
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64)
    y = np.asarray(data.target, dtype=np.int32)
    order = np.random.default_rng(split_seed).permutation(len(x))
    n_test = round(DIGITS_TEST_FRACTION * len(x))
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std = np.where(std > 0, std, 1.0)
    x = ((x - mean) / std).astype(np.float32)
    return Split(x[train], y[train], x[test], y[test])


def init_mlp(seed: int, sizes: tuple[int, ...] = DIGITS_LAYER_SIZES) -> Params:
    """He-normal weights and zero biases: ``[{"w": (m, n), "b": (n,)}, ...]``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    params = []
    for key, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        w = jax.random.normal(key, (fan_in, fan_out), jnp.float32)
        params.append({"w": w * jnp.sqrt(2.0 / fan_in), "b": jnp.zeros(fan_out)})
    return params


def mlp_logits(params: Params, x):
    """ReLU MLP: logits of shape (batch, classes)."""
    import jax

    *hidden, last = params
    for layer in hidden:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def softmax_cross_entropy(params: Params, x, y):
    """Mean cross-entropy of the MLP's logits against integer labels."""
    import optax

    logits = mlp_logits(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def classification_metrics(params: Params, x, y) -> dict[str, Any]:
    """Mean cross-entropy ``loss`` and ``accuracy`` in [0, 1]."""
    import jax.numpy as jnp
    import optax

    logits = mlp_logits(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == y)
    return {"loss": loss, "accuracy": accuracy}


# ------------------------------------------------------------------------- registry

WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        Workload(
            name="digits-mlp",
            description="MLP 64→256→256→10 (ReLU) on scikit-learn digits, 20% test",
            load_split=load_digits_split,
            init_params=init_mlp,
            loss=softmax_cross_entropy,
            metrics=classification_metrics,
        ),
    )
}


def get_workload(name: str) -> Workload:
    """The registered workload called ``name``; ``KeyError`` naming the valid ones."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(
            f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}"
        ) from None
