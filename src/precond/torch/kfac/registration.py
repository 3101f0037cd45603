"""Which layers of a model K-FAC registers: the supported modules (exact
``nn.Linear`` and ``nn.Conv2d``, grouped convolutions excepted), the ``layers``
and ``skip_layers`` options, FSDP1 refused, and the log lines of each choice."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch
from torch import nn

from precond.torch._core.dtensor import dtensors_supported, looks_like_dtensor
from precond.torch.kfac.layers import (
    KFACLayer,
    is_trained_grouped_convolution,
    module_class,
    unsupported_reason,
)

logger = logging.getLogger("precond.torch.kfac")


def _matches(patterns: Sequence[str], name: str, module: nn.Module) -> bool:
    """Whether a pattern matches the module's name or class name in full, ignoring
    case (KAISA compares lower-cased names)."""
    return any(
        re.fullmatch(p, name, re.IGNORECASE)
        or re.fullmatch(p, module_class(module).__name__, re.IGNORECASE)
        for p in patterns
    )


def _check_modules(modules: dict[str, nn.Module], names: Sequence[str] | None):
    """Refuses FSDP1 (and DTensors where torch is too old for them), and
    ``layers`` names that are not modules or not supported ones."""
    for module in modules.values():
        weight = getattr(module, "weight", None)
        if type(module).__name__ == "FullyShardedDataParallel" or (
            isinstance(weight, torch.Tensor)
            and looks_like_dtensor(weight)
            and not dtensors_supported()
        ):
            raise NotImplementedError(
                "precond.torch.kfac.KFAC supports FSDP2 (fully_shard, DTensor "
                "parameters, torch >= 2.6) but not FSDP1 "
                "(FullyShardedDataParallel): use fully_shard, or wrap the "
                "model in DistributedDataParallel"
            )
    if names is None:
        return
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"Invalid layers: {unknown} are not modules of model")
    for n in names:
        reason = unsupported_reason(modules[n])
        if reason is not None:
            raise ValueError(f"Invalid layers: cannot register {n!r}: {reason}")


def _log_unregistered(model: nn.Module, registered: list, grouped: list[str]) -> None:
    """Once per model: an INFO line naming the grouped convolutions left with
    their plain gradients (``grouped``), a WARNING if no layer was registered."""
    if grouped:
        logger.info(
            "K-FAC does not precondition %d grouped convolution(s) of %s, whose "
            "gradients stay as they are: %s",
            len(grouped),
            type(model).__name__,
            ", ".join(grouped),
        )
    if not registered:
        logger.warning("K-FAC registered no layers of %s", type(model).__name__)


def register_layers(
    model: nn.Module,
    names: Sequence[str] | None,
    skip_layers: Sequence[str],
    loglevel: int,
) -> list[KFACLayer]:
    """The layers of ``model`` that K-FAC preconditions, walking it recursively:
    its supported modules with weights (``names``: only those), less those
    under a module matching ``skip_layers``; each decision logged at
    ``loglevel``."""
    modules = dict(model.named_modules())
    _check_modules(modules, names)
    skipped_prefixes: list[str] = []
    registered, grouped = [], []
    for name, module in modules.items():
        if any(name.startswith(p) for p in skipped_prefixes):
            continue
        if skip_layers and _matches(skip_layers, name, module):
            skipped_prefixes.append(name + "." if name else "")
            logger.log(loglevel, "K-FAC skips %r (skip_layers)", name)
            continue
        if names is not None and name not in names:
            continue
        has_params = any(True for _ in module.parameters(recurse=False))
        if not has_params:
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            logger.log(loglevel, "K-FAC skips %r: %s", name, reason)
            if is_trained_grouped_convolution(module):
                grouped.append(f"{name!r} (groups={module.groups})")
            continue
        assert isinstance(module, nn.Linear | nn.Conv2d)  # all it admits
        if module.weight.numel() == 0:
            # nn.Linear(n, 0), nn.Linear(0, n), a 0-channel Conv2d: no weights
            # to precondition (a bias alone keeps its plain gradient).
            logger.log(loglevel, "K-FAC skips %r: its weight is empty", name)
            continue
        registered.append(KFACLayer(name, module))
        logger.log(loglevel, "K-FAC registers %r", registered[-1])
    _log_unregistered(model, registered, grouped)
    return registered
