"""Train one workload with one optimizer in PyTorch (eager, on the CPU).

The model is :mod:`precond.bench.torch_models`' version of the workload's, the data
and the budget logic the JAX runner's (:func:`precond.bench.runner.training_loop`).
Imports torch: load it lazily.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn import functional as F

from precond.bench.optimizers import DEFAULT_WEIGHT_DECAY, OptimizerSpec
from precond.bench.runner import RunConfig, RunResult, result_from_loop, training_loop
from precond.bench.torch_models import build_model
from precond.bench.workloads import Workload
from precond.torch._core.step_policy import gradients_are_usable

# Rows per chunk when scoring a whole split.
EVAL_CHUNK = 512


def _tensor(array) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.long() if tensor.dtype == torch.int32 else tensor


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction
    )


def _squared_error(outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
    """Mean (or, with reduction "sum", the sum over rows of the mean over outputs)
    squared error: the JAX workloads' regression loss."""
    error = (outputs - y).square().mean(dim=-1)
    return error.mean() if reduction == "mean" else error.sum()


def _loss_function(workload: Workload) -> Callable:
    return _squared_error if workload.task == "regression" else _cross_entropy


def run_torch(
    workload: Workload,
    spec: OptimizerSpec,
    config: RunConfig,
    *,
    learning_rate: float,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    on_compiled: Callable[[float], None] | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> RunResult:
    """Trains ``workload`` with ``spec``'s PyTorch optimizer within ``config``'s
    budget; every step (forward, backward, optimizer) is timed. There is no
    compilation: ``compile_s`` is None and ``on_compiled`` gets 0."""
    split = workload.load_split(workload.split_seed)
    x_train, y_train = _tensor(split.x_train), _tensor(split.y_train)
    x_test, y_test = _tensor(split.x_test), _tensor(split.y_test)
    loss_fn = _loss_function(workload)
    torch.manual_seed(config.seed)
    model = build_model(workload.torch_model, config.seed)
    optimizer = spec.build("torch", workload, learning_rate, weight_decay, model)
    if on_compiled is not None:
        on_compiled(0.0)

    def step(idx, scale: float) -> tuple[float, bool]:
        rows = torch.from_numpy(idx).long()
        optimizer.set_lr(learning_rate * scale)
        optimizer.zero_grad()
        loss = loss_fn(model(x_train[rows]), y_train[rows])
        loss.backward()
        refused = not gradients_are_usable(
            [p.grad for p in model.parameters() if p.grad is not None]
        )
        optimizer.step()
        return float(loss.item()), refused

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        model.eval()
        loss_sum, correct, count = 0.0, 0.0, 0
        for start in range(0, len(x_test), EVAL_CHUNK):
            x = x_test[start : start + EVAL_CHUNK]
            y = y_test[start : start + EVAL_CHUNK]
            outputs = model(x)
            loss_sum += loss_fn(outputs, y, reduction="sum").item()
            if workload.task == "classification":
                correct += (outputs.argmax(dim=-1) == y).sum().item()
                count += y.numel()
            else:
                count += len(y)
        model.train()
        accuracy = correct / count if workload.task == "classification" else math.nan
        return loss_sum / count, accuracy

    loop = training_loop(step, evaluate, config, len(split.x_train), on_step)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return result_from_loop(
        loop,
        config,
        framework="torch",
        workload=workload.name,
        optimizer=spec.name,
        learning_rate=float(learning_rate),
        weight_decay=float(weight_decay),
        devices=1,
        compile_s=None,
        param_bytes=param_bytes,
        state_bytes=optimizer.state_bytes(),
    )
