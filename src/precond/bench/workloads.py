"""Benchmark workloads: a dataset split, a model, its loss, metrics and budget.

A workload is a :class:`Workload` registered by name in :data:`WORKLOADS`. Its data
is NumPy (:mod:`precond.bench.data`, deterministic for a split seed); its JAX model
is pure functions of a parameter pytree (:mod:`precond.bench.jax_models`), and
``torch_model`` names the same architecture in :mod:`precond.bench.torch_models`.
JAX, PyTorch and scikit-learn are imported inside functions, never at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from precond.bench.data import (  # re-exported: the benchmark scripts use them
    CHAR_LM_CONTEXT,
    CHAR_LM_VOCAB,
    Split,
    batch_indices,
    char_lm_text,
    load_char_lm_split,
    load_digits_split,
    load_teacher_student_split,
)
from precond.bench.jax_models import (
    DEEP_CHAR_LM,
    LARGE_CHAR_LM,
    TEACHER_STUDENT_SIZES,
    char_lm_hidden_matrices,
    char_lm_logits,
    cnn_hidden_matrices,
    cnn_logits,
    cross_entropy,
    init_char_lm,
    init_cnn,
    init_mlp,
    init_tanh_mlp,
    mean_squared_error,
    mlp_hidden_matrices,
    mlp_logits,
    regression_metrics,
    scored_metrics,
    tanh_mlp,
)

__all__ = [
    "CHAR_LM_CONTEXT",
    "CHAR_LM_VOCAB",
    "WORKLOADS",
    "Split",
    "Workload",
    "batch_indices",
    "char_lm_logits",
    "char_lm_text",
    "get_workload",
    "load_char_lm_split",
    "load_digits_split",
]

Params = Any  # a pytree of jax.Array


@dataclass(frozen=True)
class Workload:
    """One benchmark task.

    Attributes:
        name: registry key, used on the command line.
        description: one line for ``precond bench --list``.
        load_split: split_seed ↦ :class:`Split`, deterministic for the seed.
        init_params: seed ↦ JAX parameter pytree, deterministic for the seed.
        loss: (params, x, y) ↦ scalar mean training loss (traceable by JAX).
        metrics: (params, x, y) ↦ {"loss", "accuracy"} on a whole split (traceable).
        torch_model: key of ``precond.bench.torch_models.MODELS``: the same model in
            PyTorch.
        steps: default step budget of one run.
        batch_size: default minibatch size (rows).
        eval_every: steps between evaluations on the validation (test) rows.
        split_seed: the seed of the train/test split used by the bench, fixed so
            every training seed is scored on the same test rows.
        hidden_matrices: params ↦ a tree of bools, True for the hidden-layer
            weight matrices (every 2-D weight but embedding tables and the output
            layer): the parameters Muon trains, AdamW the rest. The PyTorch
            model's ``hidden_matrices()`` selects the same layers.
        task: "classification" (cross-entropy against integer labels, with an
            accuracy) or "regression" (mean squared error against float targets,
            no accuracy).
        default: run by a bare ``precond bench``.
    """

    name: str
    description: str
    load_split: Callable[[int], Split]
    init_params: Callable[[int], Params]
    loss: Callable[[Params, Any, Any], Any]
    metrics: Callable[[Params, Any, Any], dict[str, Any]]
    torch_model: str
    steps: int
    batch_size: int
    eval_every: int
    split_seed: int = 0
    hidden_matrices: Callable[[Params], Params] | None = None
    task: str = "classification"
    default: bool = True


TASKS = ("classification", "regression")


def _workload(
    name,
    description,
    load_split,
    init,
    model,
    hidden,
    torch_model,
    task="classification",
    **budget,
):
    """A :class:`Workload` whose loss and metrics are ``task``'s, of ``model``'s
    outputs (logits or predictions)."""
    loss, metrics = {
        "classification": (cross_entropy, scored_metrics),
        "regression": (mean_squared_error, regression_metrics),
    }[task]
    return Workload(
        name=name,
        description=description,
        load_split=load_split,
        init_params=init,
        loss=loss(model),
        metrics=metrics(model),
        torch_model=torch_model,
        hidden_matrices=hidden,
        task=task,
        **budget,
    )


WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        _workload(
            "teacher-student",
            "tanh MLP 32→256→256→256→8 fitting a fixed random tanh network "
            "(32→64→64→8) on Gaussian inputs with covariance condition number 1e4, "
            "fresh rows every step; mean squared error",
            load_teacher_student_split,
            functools.partial(init_tanh_mlp, sizes=TEACHER_STUDENT_SIZES),
            tanh_mlp,
            mlp_hidden_matrices,
            "teacher-student",
            task="regression",
            steps=400,
            batch_size=1024,
            eval_every=20,
        ),
        _workload(
            "digits-mlp",
            "MLP 64→256→256→10 (ReLU) on scikit-learn digits, 20% test",
            load_digits_split,
            init_mlp,
            mlp_logits,
            mlp_hidden_matrices,
            "mlp",
            steps=300,
            batch_size=128,
            eval_every=20,
            default=False,
        ),
        _workload(
            "digits-cnn",
            "CNN conv16→conv32/2→128→10 (ReLU) on scikit-learn digits, 20% test",
            load_digits_split,
            init_cnn,
            cnn_logits,
            cnn_hidden_matrices,
            "cnn",
            steps=200,
            batch_size=128,
            eval_every=20,
            default=False,
        ),
        _workload(
            "char-lm",
            "2-layer decoder-only transformer (d 64, 4 heads, context 64) "
            "predicting the next byte of Python's pydoc_data help topics, 10% "
            "validation",
            load_char_lm_split,
            init_char_lm,
            char_lm_logits,
            char_lm_hidden_matrices,
            "char-lm",
            steps=400,
            batch_size=32,
            eval_every=25,
        ),
        _workload(
            "char-lm-large",
            "4-layer decoder-only transformer (d 256, 4 heads, context 64) on "
            "char-lm's text; not in the default suite: one of the models "
            "pro_adamw's defaults were measured on",
            load_char_lm_split,
            functools.partial(
                init_char_lm, d_model=LARGE_CHAR_LM[0], layers=LARGE_CHAR_LM[1]
            ),
            char_lm_logits,
            char_lm_hidden_matrices,
            "char-lm-large",
            steps=300,
            batch_size=16,
            eval_every=25,
            default=False,
        ),
        _workload(
            "char-lm-deep",
            "6-layer decoder-only transformer (d 256, 4 heads, context 64) on "
            "char-lm's text; not in the default suite: a model no default of the "
            "bench or of pro_adamw was chosen on",
            load_char_lm_split,
            functools.partial(
                init_char_lm, d_model=DEEP_CHAR_LM[0], layers=DEEP_CHAR_LM[1]
            ),
            char_lm_logits,
            char_lm_hidden_matrices,
            "char-lm-deep",
            steps=300,
            batch_size=16,
            eval_every=25,
            default=False,
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
