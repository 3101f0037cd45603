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
    """A supervised dataset split into disjoint train and test rows (NumPy arrays).

    Inputs are float32 features or int32 tokens; targets are int32 labels, one per
    row (classification) or one per position of the row (language modelling).
    """

    x_train: np.ndarray  # (n_train, ...) float32 features or int32 tokens
    y_train: np.ndarray  # (n_train,) or (n_train, ...) int32
    x_test: np.ndarray  # (n_test, ...) float32 features or int32 tokens
    y_test: np.ndarray  # (n_test,) or (n_test, ...) int32


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


# --------------------------------------------------------------------------- char-lm


CHAR_LM_VOCAB = 256  # bytes
CHAR_LM_CONTEXT = 64
CHAR_LM_TEST_FRACTION = 0.1
CHAR_LM_D_MODEL = 64
CHAR_LM_HEADS = 4
CHAR_LM_LAYERS = 2
CHAR_LM_MLP_RATIO = 4
# Windows per chunk when scoring a whole split (bounds the evaluation's memory).
CHAR_LM_EVAL_CHUNK = 512


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
    ``numpy.random.default_rng(split_seed)``; the first 10% are the test set.
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


def init_char_lm(seed: int) -> Params:
    """A causal MLP-mixer: byte and position embeddings, ``CHAR_LM_LAYERS`` pre-norm
    blocks of causal token mixing and a GELU channel MLP, a final layer norm and
    an untied output head.

    Token mixing splits the channels into ``CHAR_LM_HEADS`` groups, each mixed
    over time by its own lower-triangular (context × context) matrix (the upper
    triangle of the stored matrix is masked out, so position t sees bytes ≤ t).
    Matrices are N(0, 1/fan_in) (block output projections also scaled by
    1/√(2·layers)), embeddings N(0, 1), layer-norm scales 1, biases 0, and the
    head N(0, 0.02²) so that the initial loss is close to ln 256.
    """
    import jax
    import jax.numpy as jnp

    d, hidden = CHAR_LM_D_MODEL, CHAR_LM_MLP_RATIO * CHAR_LM_D_MODEL
    heads, context = CHAR_LM_HEADS, CHAR_LM_CONTEXT
    out_std = (2 * CHAR_LM_LAYERS) ** -0.5

    def init(key):
        keys = iter(jax.random.split(key, 3 + 3 * CHAR_LM_LAYERS))

        def normal(shape, std):
            return std * jax.random.normal(next(keys), shape, jnp.float32)

        def norm():
            return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

        layers = [
            {
                "norm_1": norm(),
                "token_mix": normal((heads, context, context), out_std / context**0.5),
                "token_mix_bias": jnp.zeros((context, d)),
                "norm_2": norm(),
                "mlp_in": normal((d, hidden), d**-0.5),
                "mlp_in_bias": jnp.zeros(hidden),
                "mlp_out": normal((hidden, d), out_std * hidden**-0.5),
                "mlp_out_bias": jnp.zeros(d),
            }
            for _ in range(CHAR_LM_LAYERS)
        ]
        return {
            "embedding": normal((CHAR_LM_VOCAB, d), 1.0),
            "position": normal((context, d), 1.0),
            "layers": layers,
            "final_norm": norm(),
            "head": normal((d, CHAR_LM_VOCAB), 0.02),
        }

    return jax.jit(init)(jax.random.PRNGKey(seed))  # one compile, not one per op


def _layer_norm(x, norm: dict[str, Any]):
    import jax.numpy as jnp

    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + 1e-5)) * norm["scale"] + norm["bias"]


def char_lm_logits(params: Params, tokens):
    """Next-byte logits of shape (batch, time, 256) for int tokens (batch, time),
    time ≤ ``CHAR_LM_CONTEXT``; position t depends on tokens[:, : t + 1] only."""
    import jax
    import jax.numpy as jnp

    batch, time = tokens.shape
    heads, d = CHAR_LM_HEADS, CHAR_LM_D_MODEL
    causal = jnp.tril(jnp.ones((time, time), dtype=jnp.float32))
    x = params["embedding"][tokens] + params["position"][:time]
    for layer in params["layers"]:
        h = _layer_norm(x, layer["norm_1"]).reshape(batch, time, heads, d // heads)
        mix = layer["token_mix"][:, :time, :time] * causal
        h = jnp.einsum("hts,bshc->bthc", mix, h).reshape(batch, time, d)
        x = x + h + layer["token_mix_bias"][:time]
        h = _layer_norm(x, layer["norm_2"]) @ layer["mlp_in"] + layer["mlp_in_bias"]
        x = x + jax.nn.gelu(h) @ layer["mlp_out"] + layer["mlp_out_bias"]
    return _layer_norm(x, params["final_norm"]) @ params["head"]


def char_lm_loss(params: Params, tokens, targets):
    """Mean next-byte cross-entropy (nats) over every position of the batch."""
    import optax

    logits = char_lm_logits(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def char_lm_metrics(params: Params, tokens, targets) -> dict[str, Any]:
    """Mean cross-entropy ``loss`` (nats), ``bits_per_byte`` (loss / ln 2) and
    next-byte top-1 ``accuracy`` over every position, scored in chunks of
    ``CHAR_LM_EVAL_CHUNK`` windows (``lax.map``) to bound memory."""
    import math

    import jax
    import jax.numpy as jnp
    import optax

    n, time = tokens.shape
    chunk = min(CHAR_LM_EVAL_CHUNK, n)
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    weight = (jnp.arange(chunks * chunk) < n).astype(jnp.float32)

    def pieces(a):
        a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
        return a.reshape(chunks, chunk, *a.shape[1:])

    def score(args):
        x, y, w = args
        logits = char_lm_logits(params, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        correct = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
        return jnp.stack([loss.sum(-1) @ w, correct.sum(-1) @ w])

    weight = weight.reshape(chunks, chunk)
    sums = jax.lax.map(score, (pieces(tokens), pieces(targets), weight))
    loss, correct = sums.sum(axis=0) / (n * time)
    return {"loss": loss, "accuracy": correct, "bits_per_byte": loss / math.log(2)}


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
        Workload(
            name="char-lm",
            description=(
                "2-block causal MLP-mixer (d 64, context 64) predicting the next "
                "byte of Python's pydoc_data help topics, 10% test"
            ),
            load_split=load_char_lm_split,
            init_params=init_char_lm,
            loss=char_lm_loss,
            metrics=char_lm_metrics,
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
