"""``KFAC``: a K-FAC gradient preconditioner for (distributed) PyTorch training.

Used beside any optimizer, KAISA's way::

    loss.backward()
    preconditioner.step()   # replaces .grad of registered layers by K-FAC's
    optimizer.step()

Per step t (the count of ``step()`` calls):

1. Forward/backward hooks collect each registered layer's factor contributions
   A_batch = E[ā āᵀ] and G_batch = E[g gᵀ] (see :mod:`.layers`) when
   ``t % factor_update_steps == 0``. Micro-batches (``accumulation_steps``) are
   averaged. Factors are kept in float32 at least (``factor_dtype``), and under
   AMP g is divided by the ``grad_scaler``'s scale.
2. ``step()`` all-reduces the contributions (mean over ranks) and folds them in:
   F ← α F + (1 − α) F_batch, F starting at I. A contribution that is not finite,
   or whose squared Frobenius norm overflows the factor dtype (float32: entries
   ≥ ~1.8e19), is dropped for that step (logged), and the decompositions in use
   are kept: a NaN/Inf or huge finite activation or gradient never reaches the
   factors, so the factors and decompositions stay finite.
3. When ``t % inv_update_steps == 0`` each layer's inverse worker decomposes (eigen)
   or inverts (inverse) its factors and broadcasts the result to the layer's
   gradient workers (:mod:`.assignment`).
4. The gradient workers precondition ∇ (:mod:`.second_order`) and broadcast the
   result to the other ranks of their row; all ranks scale every layer by the
   KL-clip factor ν and write it into ``.grad``. Both are scale-safe: a layer's
   gradient is preconditioned divided by a power of two 2^e ≥ max|∇| (when
   max|∇| ≥ 1) and ν is computed in float64 with the powers of two apart, so a
   huge finite gradient (1e30, float32's max) gets a finite, clipped update.
   A non-finite gradient gives a non-finite update (ν = 1), as without K-FAC:
   skip such steps in the optimizer (``GradScaler`` does).

Data parallelism: the gradients must be averaged over ranks (DDP does this), so
the loss being minimised is the mean of the ranks' losses and the output gradient
of the global loss is g/W. The hooks use g/W, so the factors (and every step) are
those of one process on the global batch: K-FAC does not change with the number of
ranks (KAISA's G grows with W², which changes what a given damping means;
``world_size_invariant=False`` gives KAISA's factors).

FSDP2 (``fully_shard``, DTensor parameters): the hooks see whole activations and
output gradients, as under DDP; ``step()`` gathers each layer's whole gradient ∇
(G⁻¹∇A⁻¹ mixes all of its rows), preconditions it as above and writes each
rank's shard back into ``.grad``, so every step equals one process's.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from precond.torch._core.optimizer import eager_step
from precond.torch._core.profiling import profiled_stage
from precond.torch.kfac.arguments import (
    _ARGUMENT_CHECKS as _ARGUMENT_CHECKS,  # re-exported: docs/make_arguments.py
)
from precond.torch.kfac.arguments import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    Schedulable,
    _grad_workers,
    _takes_step,
    check_arguments,
    colocate_under_mem_opt,
    distributed_strategy,
)
from precond.torch.kfac.assignment import LayerWork, WorkerGrid, assign_layers
from precond.torch.kfac.checkpoint import Checkpointing
from precond.torch.kfac.communication import Communicator
from precond.torch.kfac.layers import (
    KFACLayer,
    input_covariance,
    output_grad_covariance,
)
from precond.torch.kfac.registration import register_layers
from precond.torch.kfac.second_order_work import SecondOrderWork

__all__ = [
    "KFAC",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KFACPreconditioner",
]

logger = logging.getLogger("precond.torch.kfac")

# The hyperparameters KAISA keeps in ``param_groups[0]`` (what LR schedulers and
# ``KFACParamScheduler`` change), besides the step count ``step``.
_GROUP_HYPERPARAMETERS = (
    "damping",
    "factor_decay",
    "factor_update_steps",
    "inv_update_steps",
    "kl_clip",
    "lr",
)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _scheduled(name: str, convert: Callable[[Any], Any]) -> property:
    """A read-only property: ``param_groups[0][name]`` (a schedulable
    hyperparameter, evaluated at the current step), converted."""

    def value(self: KFAC) -> Any:
        return convert(self._value(name))

    return property(value, doc=f"``{name}`` at the current step.")


class KFAC(Checkpointing, SecondOrderWork, torch.optim.Optimizer):
    """K-FAC gradient preconditioner with KAISA's distribution strategies.

    A ``torch.optim.Optimizer`` as KAISA's ``KFAC`` is: ``param_groups[0]`` holds
    ``damping``, ``factor_decay``, ``factor_update_steps``, ``inv_update_steps``,
    ``kl_clip``, ``lr`` and the step count ``step``, so PyTorch's LR schedulers
    (``LambdaLR(preconditioner, f)``, ``StepLR``...) schedule ``lr`` and
    :class:`~precond.torch.kfac.KFACParamScheduler` the damping and intervals.
    Its one parameter is a placeholder scalar: ``step()`` changes the ``.grad`` of
    the model's registered layers, not parameters of its own.

    The arguments up to ``verbose`` are KAISA 0.4's (names, positional order,
    meanings and defaults); those marked "schedulable" may also be a callable:
    with no arguments it is called as is, KAISA 0.4's way, and with one required
    argument it gets the step count, the way of KAISA's later
    ``KFACPreconditioner``. The keyword-only ones after it come from that later
    ``KFACPreconditioner`` and from precond.

    Args:
        model: the module whose ``nn.Linear`` and ``nn.Conv2d`` layers (exact types;
            grouped convolutions excepted, named in one INFO line on the
            ``precond.torch.kfac`` logger) are registered, walking it recursively.
        factor_update_steps: steps between factor updates (schedulable).
        inv_update_steps: steps between decompositions (schedulable).
        damping: λ > 0 (schedulable).
        factor_decay: running-average coefficient α in (0, 1] (schedulable).
        kl_clip: κ > 0 of the KL clip, or ``None`` for no clip (schedulable).
        lr: the learning rate, used by the KL clip only (schedulable).
        accumulation_steps: forward/backward passes per step; contributions of the
            passes of a step are averaged (a warning says if a layer saw another
            number).
        allreduce_bucket_cap_mb: bucket size of the factor all-reduce (0: none).
        assignment_strategy: ``AssignmentStrategy`` (or 'compute'/'memory').
        colocate_factors: decompose a layer's A and G on the same rank. Under
            MEM_OPT (one gradient worker per layer) False is switched to True,
            with a warning, as KAISA 0.4 does.
        compute_method: ``ComputeMethod`` (or 'eigen'/'inverse').
        compute_eigenvalue_outer_product: eigen only: precompute 1 ⊘ (d_G d_Aᵀ + λ)
            on the inverse worker (needs ``colocate_factors``).
        grad_worker_fraction: a ``DistributedStrategy`` (COMM_OPT: 1, HYBRID_OPT:
            1/2, MEM_OPT: 1/world_size) or a fraction in [0, 1] (0 means
            1/world_size) of ranks that precondition each layer. The attribute of
            that name holds the fraction, ``distributed_strategy`` the strategy.
        symmetry_aware: send symmetric matrices as their upper triangle.
        grad_scaler: a ``torch.amp.GradScaler`` (or a callable returning the loss
            scale) whose scale the output gradients are divided by.
        factor_dtype: dtype of the factors (default: the weight's dtype promoted to
            at least float32).
        inv_dtype: dtype of decompositions and preconditioning (default float32).
        skip_layers: a name or a list of names (regular expressions, matched in
            full and ignoring case); a module whose name or class name matches one
            is not registered, nor is anything inside it.
        update_factors_in_hook: accepted for KAISA compatibility: contributions are
            always computed in the hooks and folded in by ``step()``.
        verbose: log the registration and assignment lines at ``logging.INFO``
            (at least) on the ``precond.torch.kfac`` logger.
        loglevel: level of the registration and assignment log lines.
        layers: precond's: names of the modules to register (default: every
            supported one). A named module that is not supported is an error.
        world_size_invariant: precond's. True: the hooks use the output gradient
            of the global (rank-averaged) loss, g/world_size, so the factors, and
            what a given damping means, do not change with the number of ranks.
            False: KAISA's factors, whose G is world_size² times larger under data
            parallelism (the same in one process).

    Example, SGD preconditioned by K-FAC:
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        ... )
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> preconditioner = KFAC(model, lr=0.1, damping=0.003)
        >>> model(torch.randn(16, 4)).square().mean().backward()
        >>> preconditioner.step()  # the layers' .grad become K-FAC's
        >>> optimizer.step()
    """

    def __init__(
        self,
        model: nn.Module,
        factor_update_steps: Callable[..., int] | int = 1,
        inv_update_steps: Callable[..., int] | int = 1,
        damping: Schedulable = 0.001,
        factor_decay: Schedulable = 0.95,
        kl_clip: Schedulable | None = 0.001,
        lr: Schedulable = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float = (
            DistributedStrategy.COMM_OPT
        ),
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: Sequence[str] | str | None = [],  # KAISA's; never mutated
        update_factors_in_hook: bool = True,
        verbose: bool = False,
        *,
        loglevel: int = logging.DEBUG,
        layers: Sequence[str] | None = None,
        world_size_invariant: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Invalid model={model!r}: must be a torch.nn.Module")
        arguments = locals()
        assignment_strategy, compute_method = check_arguments(arguments)
        defaults = {name: arguments[name] for name in _GROUP_HYPERPARAMETERS}
        # No parameters of its own: a placeholder, as torch.optim needs one.
        super().__init__([torch.zeros(())], {**defaults, "step": 0})
        self._takes_step: dict[str, tuple[Callable, bool]] = {}
        self._set_options(arguments, assignment_strategy, compute_method)
        self._loss_scale: float | None = None  # cached for the step (AMP)
        self._warned_accumulation = False
        self._build_grid(grad_worker_fraction)
        self.colocate_factors = colocate_under_mem_opt(
            self.colocate_factors, grad_worker_fraction, self.grid.world_size
        )
        self.layers = register_layers(model, layers, self.skip_layers, self.loglevel)
        self._assign_work()
        self._ready: dict[str, bool] = {l.name: False for l in self.layers}
        self._hooks = [
            l.module.register_forward_hook(partial(self._forward_hook, l))
            for l in self.layers
        ]

    def _set_options(
        self,
        arguments: dict[str, Any],
        assignment_strategy: AssignmentStrategy,
        compute_method: ComputeMethod,
    ) -> None:
        """The constructor's options as attributes, by KAISA's names."""
        self.accumulation_steps = arguments["accumulation_steps"]
        self.allreduce_bucket_cap_mb = arguments["allreduce_bucket_cap_mb"]
        self.assignment_strategy = assignment_strategy
        self.colocate_factors = arguments["colocate_factors"]
        self.compute_method = compute_method
        self.compute_eigenvalue_outer_product = arguments[
            "compute_eigenvalue_outer_product"
        ]
        self.symmetry_aware = arguments["symmetry_aware"]
        self.grad_scaler = arguments["grad_scaler"]
        self.factor_dtype = arguments["factor_dtype"]
        self.inv_dtype = arguments["inv_dtype"]
        skip_layers = arguments["skip_layers"]
        if isinstance(skip_layers, str):  # KAISA takes one name as a str
            skip_layers = [skip_layers]
        self.skip_layers = list(skip_layers or [])
        self.update_factors_in_hook = arguments["update_factors_in_hook"]
        self.verbose = arguments["verbose"]
        loglevel = arguments["loglevel"]
        self.loglevel = max(loglevel, logging.INFO) if self.verbose else loglevel
        self.world_size_invariant = arguments["world_size_invariant"]

    def _build_grid(self, grad_worker_fraction: Any) -> None:
        """The communicator and the grid of workers; KAISA's attributes
        ``grad_worker_fraction`` (a number) and ``distributed_strategy``."""
        self.communicator = Communicator(
            bucket_cap_mb=self.allreduce_bucket_cap_mb,
            symmetry_aware=self.symmetry_aware,
        )
        world = self.communicator.world_size
        self.grid = WorkerGrid(world, _grad_workers(grad_worker_fraction, world))
        self.grad_worker_fraction = self.grid.grad_workers / world
        self.distributed_strategy = distributed_strategy(self.grid.grad_workers, world)

    def _assign_work(self) -> None:
        """Each layer's inverse and gradient workers (balanced by dim³ or dim²),
        and the process groups of the grid's columns and rows."""
        power = 3 if self.assignment_strategy is AssignmentStrategy.COMPUTE else 2
        self.assignment: dict[str, LayerWork] = assign_layers(
            {l.name: (l.a_dim**power, l.g_dim**power) for l in self.layers},
            self.grid,
            colocate_factors=self.colocate_factors,
        )
        logger.log(
            self.loglevel, "K-FAC grid %s, assignment %s", self.grid, self.assignment
        )
        # Every rank creates every group, in the same order.
        self._column_groups = [
            self.communicator.new_group(self.grid.column_ranks(c))
            for c in range(self.grid.columns)
        ]
        self._row_groups = [
            self.communicator.new_group(self.grid.row_ranks(r))
            for r in range(self.grid.grad_workers)
        ]

    def remove_hooks(self) -> None:
        """Detaches K-FAC from the model."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __getstate__(self) -> dict[str, Any]:
        # All of it: torch.optim's keeps only defaults, state and param_groups,
        # so copy.deepcopy of a model (whose hooks hold this object) would lose
        # the layers.
        return self.__dict__.copy()

    # -- hyperparameters: param_groups[0], callables evaluated at the step --
    def _value(self, name: str):
        value = self.param_groups[0][name]
        if not callable(value):
            return value
        cached = self._takes_step.get(name)
        if cached is None or cached[0] is not value:
            cached = self._takes_step[name] = (value, _takes_step(value))
        return value(self._steps) if cached[1] else value()

    @property
    def _steps(self) -> int:
        return self.param_groups[0]["step"]

    @_steps.setter
    def _steps(self, value: int) -> None:
        self.param_groups[0]["step"] = value

    @property
    def steps(self) -> int:
        """Number of ``step()`` calls so far."""
        return self._steps

    factor_update_steps = _scheduled("factor_update_steps", int)
    inv_update_steps = _scheduled("inv_update_steps", int)
    damping = _scheduled("damping", float)
    factor_decay = _scheduled("factor_decay", float)
    kl_clip = _scheduled("kl_clip", _float_or_none)
    lr = _scheduled("lr", float)

    def __repr__(self) -> str:
        group = self.param_groups[0]
        fields = {
            "layers": len(self.layers),
            "steps": self._steps,
            **{name: group[name] for name in _GROUP_HYPERPARAMETERS},
            "compute_method": self.compute_method.name,
            "distributed_strategy": self.distributed_strategy.name,
            "grid": f"{self.grid.grad_workers}x{self.grid.columns}",
        }
        return "KFAC(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    # -- hooks --
    def _collecting(self, module: nn.Module) -> bool:
        return (
            module.training
            and torch.is_grad_enabled()
            and self._steps % self.factor_update_steps == 0
        )

    def _dtype(self, layer: KFACLayer) -> torch.dtype:
        if self.factor_dtype is not None:
            return self.factor_dtype
        return torch.promote_types(layer.module.weight.dtype, torch.float32)

    def _forward_hook(self, layer: KFACLayer, module, inputs, output) -> None:
        if not self._collecting(module):
            return
        x = inputs[0].detach()
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            layer.add_a(input_covariance(module, x.to(self._dtype(layer))))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._output_grad_hook, layer))

    def _output_grad_hook(self, layer: KFACLayer, grad: torch.Tensor) -> None:
        if self._loss_scale is None:
            scaler = self.grad_scaler
            if scaler is None:
                scale = 1.0
            elif hasattr(scaler, "get_scale"):
                scale = float(scaler.get_scale())
            else:
                scale = float(scaler())
            self._loss_scale = scale
        # g of the global loss: unscaled (AMP) and divided by the data-parallel size
        # (KAISA's g, of the rank's own loss, with world_size_invariant=False).
        divisor = self._loss_scale
        if self.world_size_invariant:
            divisor *= self.communicator.world_size
        with torch.no_grad(), torch.autocast(grad.device.type, enabled=False):
            g = grad.detach().to(self._dtype(layer))
            layer.add_g(output_grad_covariance(layer.module, g, divisor))

    # -- step --
    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Preconditions the gradients of the registered layers in place.

        Call after the backward pass(es) (and, under AMP, ``scaler.unscale_``),
        before ``optimizer.step()``. Gradients must already be averaged over ranks.
        ``closure`` (torch.optim's convention), if given, is called first, with
        gradients enabled, and its value returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._steps % self.factor_update_steps == 0:
            with profiled_stage("precond/kfac/update_factors"):
                self._update_factors()
        if self._steps % self.inv_update_steps == 0:
            with profiled_stage("precond/kfac/update_second_order"):
                self._update_second_order()
        with profiled_stage("precond/kfac/precondition"):
            self._precondition()
        self._steps += 1
        self._loss_scale = None
        return loss

    def _update_factors(self) -> None:
        """All-reduce this step's contributions (mean over the contributing ranks)
        and fold the finite ones into the running factors."""
        tensors, counts = [], []
        for layer in self.layers:
            if layer.a_count and layer.a_count != self.accumulation_steps:
                self._warn_accumulation(layer)
            dtype, device = self._dtype(layer), layer.module.weight.device
            for total, count, dim in (
                (layer.a_sum, layer.a_count, layer.a_dim),
                (layer.g_sum, layer.g_count, layer.g_dim),
            ):
                if count:
                    assert total is not None  # count contributions were added
                    tensors.append(total / count if count > 1 else total)
                else:
                    tensors.append(torch.zeros(dim, dim, dtype=dtype, device=device))
                counts.append(1.0 if count else 0.0)
            layer.clear_contributions()
        if not tensors:
            return
        device = self.layers[0].module.weight.device
        counts_tensor = torch.tensor(counts, dtype=torch.float64, device=device)
        reduced = self.communicator.all_reduce_sum(
            [*tensors, counts_tensor], [True] * len(tensors) + [False]
        )
        contributors = reduced[-1].tolist()
        # A contribution is folded in only if its squared Frobenius norm is finite
        # in the factor dtype: NaN/Inf, and finite entries so large (≥ ~1.8e19 in
        # float32: activations or output gradients ≥ ~4e9) that the factor's
        # decompositions would overflow, are dropped for the step.
        finite = torch.stack([t.square().sum() for t in reduced[:-1]])
        finite = finite.isfinite().tolist()
        alpha = self.factor_decay
        for i, layer in enumerate(self.layers):
            for j, attr in enumerate(("A", "G")):
                k = 2 * i + j
                if not contributors[k]:
                    continue
                if not finite[k]:
                    logger.warning(
                        "K-FAC dropped a non-finite (or overflowing) %s contribution "
                        "of %r at step %d",
                        attr,
                        layer.name,
                        self._steps,
                    )
                    continue
                batch = reduced[k]
                if contributors[k] > 1:
                    batch = batch / contributors[k]
                old = getattr(layer, attr)
                if old is None:
                    eye = torch.eye(len(batch), dtype=batch.dtype, device=batch.device)
                    setattr(layer, attr, alpha * eye + (1 - alpha) * batch)
                else:
                    old.lerp_(batch, 1 - alpha)  # α·F + (1 − α)·F_batch

    def _warn_accumulation(self, layer: KFACLayer) -> None:
        if not self._warned_accumulation:
            self._warned_accumulation = True
            warnings.warn(
                f"K-FAC layer {layer.name!r} saw {layer.a_count} forward passes in "
                f"step {self._steps} but accumulation_steps={self.accumulation_steps}; "
                "its factor contributions are averaged over the passes seen",
                stacklevel=3,
            )

    def memory_bytes(self) -> int:
        """Bytes of the factors and second-order data this rank holds."""
        tensors = [t for l in self.layers for t in (l.A, l.G) if t is not None]
        tensors += [t for l in self.layers for t in l.second_order.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


# KAISA ≥ 0.4 names the class ``kfac.preconditioner.KFACPreconditioner``.
KFACPreconditioner = KFAC
