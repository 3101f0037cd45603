"""The PyTorch models of the benchmark workloads: the architectures of
:mod:`precond.bench.jax_models`, with the same initialisation scheme (not the same
numbers), built from ``torch.nn`` layers so that hook-based preconditioners (K-FAC)
see ordinary ``Linear`` and ``Conv2d`` modules. Imports torch: load it lazily.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from precond.bench.data import CHAR_LM_CONTEXT, CHAR_LM_VOCAB
from precond.bench.jax_models import (
    CHAR_LM_D_MODEL,
    CHAR_LM_HEADS,
    CHAR_LM_LAYERS,
    CHAR_LM_MLP_RATIO,
    DEEP_CHAR_LM,
    DIGITS_CNN_CHANNELS,
    DIGITS_CNN_HIDDEN,
    DIGITS_LAYER_SIZES,
    LARGE_CHAR_LM,
    TEACHER_STUDENT_SIZES,
)


def _init_linear(layer: nn.Linear | nn.Conv2d, std: float) -> None:
    nn.init.normal_(layer.weight, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class MLP(nn.Module):
    """ReLU MLP 64→256→256→10, He-normal weights, zero biases."""

    def __init__(self, sizes: tuple[int, ...] = DIGITS_LAYER_SIZES):
        super().__init__()
        linears = [nn.Linear(m, n) for m, n in itertools.pairwise(sizes)]
        for layer, m in zip(linears, sizes[:-1], strict=True):
            _init_linear(layer, math.sqrt(2.0 / m))
        self.layers = nn.ModuleList(linears)

    def hidden_matrices(self) -> list[torch.Tensor]:
        """The weights Muon trains: every layer's but the output layer's."""
        return [cast(nn.Linear, layer).weight for layer in self.layers[:-1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *hidden, last = self.layers
        for layer in hidden:
            x = F.relu(layer(x))
        return last(x)


class TanhMLP(MLP):
    """tanh MLP with a linear output layer, N(0, 1/fan_in) weights, zero biases
    (the teacher–student student)."""

    def __init__(self, sizes: tuple[int, ...]):
        super().__init__(sizes)
        for layer, m in zip(self.layers, sizes[:-1], strict=True):
            _init_linear(cast(nn.Linear, layer), m**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *hidden, last = self.layers
        for layer in hidden:
            x = torch.tanh(layer(x))
        return last(x)


class CNN(nn.Module):
    """(batch, 64) pixels → 1×8×8 → conv 3×3 16 → conv 3×3 stride 2 32 → dense 128
    → 10, ReLU, He-normal weights, zero biases."""

    def __init__(self):
        super().__init__()
        c0, c1, c2 = DIGITS_CNN_CHANNELS
        self.conv_1 = nn.Conv2d(c0, c1, 3, padding=1)
        self.conv_2 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.dense_1 = nn.Linear(4 * 4 * c2, DIGITS_CNN_HIDDEN)
        self.dense_2 = nn.Linear(DIGITS_CNN_HIDDEN, 10)
        _init_linear(self.conv_1, math.sqrt(2 / (9 * c0)))
        _init_linear(self.conv_2, math.sqrt(2 / (9 * c1)))
        _init_linear(self.dense_1, math.sqrt(2 / (16 * c2)))
        _init_linear(self.dense_2, math.sqrt(2 / DIGITS_CNN_HIDDEN))

    def hidden_matrices(self) -> list[torch.Tensor]:
        """The weights Muon trains: ``dense_1``'s (the kernels are 4-D,
        ``dense_2`` is the output layer)."""
        return [self.dense_1.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], 1, 8, 8)
        h = F.relu(self.conv_1(h))
        h = F.relu(self.conv_2(h))
        h = F.relu(self.dense_1(h.permute(0, 2, 3, 1).flatten(1)))
        return self.dense_2(h)


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, GELU MLP."""

    def __init__(self, d: int, heads: int, hidden: int, out_std: float):
        super().__init__()
        self.heads = heads
        self.norm_1 = nn.LayerNorm(d)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.norm_2 = nn.LayerNorm(d)
        self.mlp_in = nn.Linear(d, hidden)
        self.mlp_out = nn.Linear(hidden, d)
        _init_linear(self.attn_qkv, d**-0.5)
        _init_linear(self.attn_out, out_std * d**-0.5)
        _init_linear(self.mlp_in, d**-0.5)
        _init_linear(self.mlp_out, out_std * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, d = x.shape
        qkv = self.attn_qkv(self.norm_1(x)).reshape(batch, time, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, time, d/heads)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(h.transpose(1, 2).reshape(batch, time, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm_2(x))))


class CharLM(nn.Module):
    """The decoder-only byte-level transformer of ``jax_models.init_char_lm``."""

    def __init__(self, d_model: int = CHAR_LM_D_MODEL, layers: int = CHAR_LM_LAYERS):
        super().__init__()
        d = d_model
        out_std = (2 * layers) ** -0.5
        self.embedding = nn.Embedding(CHAR_LM_VOCAB, d)
        self.position = nn.Parameter(torch.randn(CHAR_LM_CONTEXT, d))
        self.layers = nn.ModuleList(
            Block(d, CHAR_LM_HEADS, CHAR_LM_MLP_RATIO * d, out_std)
            for _ in range(layers)
        )
        self.final_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, CHAR_LM_VOCAB, bias=False)
        nn.init.normal_(self.embedding.weight, std=1.0)
        nn.init.normal_(self.head.weight, std=0.02)

    def hidden_matrices(self) -> list[torch.Tensor]:
        """The weights Muon trains: the blocks' attention and MLP matrices (not
        the embeddings, the head, the norms or the biases)."""
        return [
            getattr(block, name).weight
            for block in self.layers
            for name in ("attn_qkv", "attn_out", "mlp_in", "mlp_out")
        ]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final_norm(x))


MODELS = {
    "mlp": MLP,
    "cnn": CNN,
    "char-lm": CharLM,
    "char-lm-large": functools.partial(CharLM, *LARGE_CHAR_LM),
    "char-lm-deep": functools.partial(CharLM, *DEEP_CHAR_LM),
    "teacher-student": functools.partial(TanhMLP, TEACHER_STUDENT_SIZES),
}


def build_model(kind: str, seed: int) -> nn.Module:
    """The model ``kind`` (a key of :data:`MODELS`), initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[kind]()
