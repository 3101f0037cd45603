"""The JAX models of the benchmark workloads: pure functions of a parameter pytree.

Written in plain JAX (no model library), so ``pip install 'precond[jax,bench]'`` is
all the benchmark needs. Every model gives logits; :func:`cross_entropy` and
:func:`scored_metrics` turn them into a training loss and evaluation metrics.
:mod:`precond.bench.torch_models` builds the same architectures in PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from precond.bench.data import CHAR_LM_CONTEXT, CHAR_LM_VOCAB

Params = Any  # a pytree of jax.Array

# Rows per chunk when scoring a whole split (bounds the evaluation's memory).
EVAL_CHUNK = 512


def _normal(key, shape, std):
    import jax
    import jax.numpy as jnp

    return std * jax.random.normal(key, shape, jnp.float32)


def cross_entropy(logits_fn: Callable) -> Callable:
    """(params, x, y) ↦ mean softmax cross-entropy of ``logits_fn(params, x)``
    against integer labels (over rows, and positions for a language model)."""

    def loss(params: Params, x, y):
        import optax

        logits = logits_fn(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


def scored_metrics(logits_fn: Callable) -> Callable:
    """(params, x, y) ↦ {"loss", "accuracy"}: mean cross-entropy (nats) and top-1
    accuracy over every row (and position), scored in chunks of ``EVAL_CHUNK``
    rows (``lax.map``) to bound memory."""

    def metrics(params: Params, x, y) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp
        import optax

        n = x.shape[0]
        per_row = math.prod(y.shape[1:])
        chunk = min(EVAL_CHUNK, n)
        chunks = -(-n // chunk)
        pad = chunks * chunk - n
        weight = (jnp.arange(chunks * chunk) < n).astype(jnp.float32)

        def pieces(a):
            a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
            return a.reshape(chunks, chunk, *a.shape[1:])

        def score(args):
            xs, ys, w = args
            logits = logits_fn(params, xs)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, ys)
            correct = (jnp.argmax(logits, axis=-1) == ys).astype(jnp.float32)
            loss, correct = loss.reshape(chunk, -1), correct.reshape(chunk, -1)
            return jnp.stack([loss.sum(-1) @ w, correct.sum(-1) @ w])

        sums = jax.lax.map(score, (pieces(x), pieces(y), weight.reshape(chunks, -1)))
        loss, accuracy = sums.sum(axis=0) / (n * per_row)
        return {"loss": loss, "accuracy": accuracy}

    return metrics


def mean_squared_error(predict_fn: Callable) -> Callable:
    """(params, x, y) ↦ mean over rows of the squared error ‖f(x) − y‖² / outputs
    of ``predict_fn(params, x)`` against float targets ``y``."""

    def loss(params: Params, x, y):
        import jax.numpy as jnp

        return jnp.square(predict_fn(params, x) - y).mean()

    return loss


def regression_metrics(predict_fn: Callable) -> Callable:
    """(params, x, y) ↦ {"loss", "accuracy"}: :func:`mean_squared_error` over
    every row, and NaN (a regression has no accuracy; reports leave it out)."""
    loss_fn = mean_squared_error(predict_fn)

    def metrics(params: Params, x, y) -> dict[str, Any]:
        import jax.numpy as jnp

        return {"loss": loss_fn(params, x, y), "accuracy": jnp.float32(jnp.nan)}

    return metrics


# ---------------------------------------------------------------------------- MLP

DIGITS_LAYER_SIZES = (64, 256, 256, 10)


def init_mlp(seed: int, sizes: tuple[int, ...] = DIGITS_LAYER_SIZES) -> Params:
    """He-normal weights and zero biases: ``[{"w": (m, n), "b": (n,)}, ...]``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    return [
        {"w": _normal(key, (m, n), math.sqrt(2.0 / m)), "b": jnp.zeros(n)}
        for key, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_logits(params: Params, x):
    """ReLU MLP: logits of shape (batch, classes)."""
    import jax

    *hidden, last = params
    for layer in hidden:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


# The teacher–student student: a tanh MLP, linear output.
TEACHER_STUDENT_SIZES = (32, 256, 256, 256, 8)


def init_tanh_mlp(seed: int, sizes: tuple[int, ...]) -> Params:
    """N(0, 1/fan_in) weights and zero biases, laid out as :func:`init_mlp`'s."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    return [
        {"w": _normal(key, (m, n), m**-0.5), "b": jnp.zeros(n)}
        for key, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def tanh_mlp(params: Params, x):
    """tanh MLP with a linear output layer: outputs of shape (batch, outputs)."""
    import jax.numpy as jnp

    *hidden, last = params
    for layer in hidden:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def mlp_hidden_matrices(params: Params) -> Params:
    """True for the weight matrices Muon trains (every layer's but the output
    layer's), False for the output layer and the biases."""
    return [{"w": i < len(params) - 1, "b": False} for i in range(len(params))]


# ---------------------------------------------------------------------------- CNN

# conv 3×3 1→16, conv 3×3 stride 2 16→32 (8×8 → 4×4), dense 512→128→10.
DIGITS_CNN_CHANNELS = (1, 16, 32)
DIGITS_CNN_HIDDEN = 128


def init_cnn(seed: int) -> Params:
    """He-normal kernels (HWIO) and dense weights, zero biases."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    c0, c1, c2 = DIGITS_CNN_CHANNELS
    flat, hidden = 4 * 4 * c2, DIGITS_CNN_HIDDEN
    return {
        "conv_1": _normal(keys[0], (3, 3, c0, c1), math.sqrt(2 / (9 * c0))),
        "conv_1_bias": jnp.zeros(c1),
        "conv_2": _normal(keys[1], (3, 3, c1, c2), math.sqrt(2 / (9 * c1))),
        "conv_2_bias": jnp.zeros(c2),
        "dense_1": _normal(keys[2], (flat, hidden), math.sqrt(2 / flat)),
        "dense_1_bias": jnp.zeros(hidden),
        "dense_2": _normal(keys[3], (hidden, 10), math.sqrt(2 / hidden)),
        "dense_2_bias": jnp.zeros(10),
    }


def cnn_logits(params: Params, x):
    """(batch, 64) pixels → 8×8×1 images → two ReLU convolutions → ReLU dense →
    logits (batch, 10)."""
    import jax

    def conv(h, w, stride):
        return jax.lax.conv_general_dilated(
            h, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    h = x.reshape(x.shape[0], 8, 8, 1)
    h = jax.nn.relu(conv(h, params["conv_1"], 1) + params["conv_1_bias"])
    h = jax.nn.relu(conv(h, params["conv_2"], 2) + params["conv_2_bias"])
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["dense_1"] + params["dense_1_bias"])
    return h @ params["dense_2"] + params["dense_2_bias"]


def cnn_hidden_matrices(params: Params) -> Params:
    """True for ``dense_1`` only: the convolution kernels are 4-D (Muon, as
    ``torch.optim.Muon`` ships it, takes 2-D parameters only, and both frameworks
    split alike), ``dense_2`` is the output layer."""
    return {name: name == "dense_1" for name in params}


# -------------------------------------------------------------------- transformer

CHAR_LM_D_MODEL = 64
CHAR_LM_HEADS = 4
CHAR_LM_LAYERS = 2
CHAR_LM_MLP_RATIO = 4
# (d_model, layers) of the larger transformer (among the models pro_adamw's
# defaults were measured on), and of the deeper one, a model no default of the
# bench or of pro_adamw was chosen on.
LARGE_CHAR_LM = (256, 4)
DEEP_CHAR_LM = (256, 6)


def init_char_lm(
    seed: int, d_model: int = CHAR_LM_D_MODEL, layers: int = CHAR_LM_LAYERS
) -> Params:
    """A decoder-only transformer: byte and position embeddings, ``layers``
    pre-norm blocks of width ``d_model`` (causal multi-head self-attention, then
    a GELU MLP), a final layer norm and an untied output head (the bench's
    char-lm: ``CHAR_LM_D_MODEL`` and ``CHAR_LM_LAYERS``; other sizes on request).

    Matrices are N(0, 1/fan_in), block output projections also scaled by
    1/√(2·layers); embeddings N(0, 1), layer-norm scales 1, biases 0, and the head
    N(0, 0.02²) so that the initial loss is close to ln 256.
    """
    import jax
    import jax.numpy as jnp

    d, hidden = d_model, CHAR_LM_MLP_RATIO * d_model
    out_std = (2 * layers) ** -0.5

    def init(key):
        keys = iter(jax.random.split(key, 3 + 4 * layers))

        def norm():
            return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

        blocks = [
            {
                "norm_1": norm(),
                "attn_qkv": _normal(next(keys), (d, 3 * d), d**-0.5),
                "attn_qkv_bias": jnp.zeros(3 * d),
                "attn_out": _normal(next(keys), (d, d), out_std * d**-0.5),
                "attn_out_bias": jnp.zeros(d),
                "norm_2": norm(),
                "mlp_in": _normal(next(keys), (d, hidden), d**-0.5),
                "mlp_in_bias": jnp.zeros(hidden),
                "mlp_out": _normal(next(keys), (hidden, d), out_std * hidden**-0.5),
                "mlp_out_bias": jnp.zeros(d),
            }
            for _ in range(layers)
        ]
        return {
            "embedding": _normal(next(keys), (CHAR_LM_VOCAB, d), 1.0),
            "position": _normal(next(keys), (CHAR_LM_CONTEXT, d), 1.0),
            "layers": blocks,
            "final_norm": norm(),
            "head": _normal(next(keys), (d, CHAR_LM_VOCAB), 0.02),
        }

    return jax.jit(init)(jax.random.PRNGKey(seed))  # one compile, not one per op


CHAR_LM_HIDDEN_MATRICES = ("attn_qkv", "attn_out", "mlp_in", "mlp_out")


def char_lm_hidden_matrices(params: Params) -> Params:
    """True for the blocks' attention and MLP weight matrices; False for the
    byte and position embeddings, the output head, the norms and the biases."""
    import jax

    def hidden(path, _) -> bool:
        return getattr(path[-1], "key", None) in CHAR_LM_HIDDEN_MATRICES

    return jax.tree_util.tree_map_with_path(hidden, params)


def layer_norm(x, norm: dict[str, Any]):
    import jax.numpy as jnp

    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + 1e-5)) * norm["scale"] + norm["bias"]


def char_lm_logits(params: Params, tokens):
    """Next-byte logits of shape (batch, time, 256) for int tokens (batch, time),
    time ≤ ``CHAR_LM_CONTEXT``; position t depends on tokens[:, : t + 1] only.
    The width and depth are the params' own."""
    import jax
    import jax.numpy as jnp

    batch, time = tokens.shape
    heads, d = CHAR_LM_HEADS, params["embedding"].shape[-1]
    causal = jnp.tril(jnp.ones((time, time), dtype=bool))
    x = params["embedding"][tokens] + params["position"][:time]
    for layer in params["layers"]:
        h = layer_norm(x, layer["norm_1"]) @ layer["attn_qkv"] + layer["attn_qkv_bias"]
        q, k, v = jnp.split(h.reshape(batch, time, 3 * heads, d // heads), 3, axis=2)
        scores = jnp.einsum("bthc,bshc->bhts", q, k) / math.sqrt(d // heads)
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        h = jnp.einsum("bhts,bshc->bthc", jax.nn.softmax(scores, axis=-1), v)
        h = h.reshape(batch, time, d) @ layer["attn_out"] + layer["attn_out_bias"]
        x = x + h
        h = layer_norm(x, layer["norm_2"]) @ layer["mlp_in"] + layer["mlp_in_bias"]
        x = x + jax.nn.gelu(h) @ layer["mlp_out"] + layer["mlp_out_bias"]
    return layer_norm(x, params["final_norm"]) @ params["head"]
