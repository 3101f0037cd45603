"""K-FAC for PyTorch with KAISA's distribution strategies: ``from precond.torch.kfac
import KFAC`` replaces ``from kfac import KFAC`` (KAISA's arguments), from the
layers' hooks and the worker grid to the second-order work and checkpoints."""

from precond.torch.kfac.assignment import LayerWork, WorkerGrid, assign_layers
from precond.torch.kfac.preconditioner import (
    KFAC,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACPreconditioner,
)
from precond.torch.kfac.scheduler import KFACParamScheduler

__all__ = [
    "KFAC",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KFACParamScheduler",
    "KFACPreconditioner",
    "LayerWork",
    "WorkerGrid",
    "assign_layers",
]
