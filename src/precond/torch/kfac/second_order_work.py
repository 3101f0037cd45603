"""The second-order work of a K-FAC step, spread over the worker grid: each
layer's decompositions (or inverses) on its inverse workers, broadcast down its
column; the gradients preconditioned by its gradient workers, broadcast along
their rows, and scaled by the KL clip."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from precond.torch.kfac.arguments import ComputeMethod
from precond.torch.kfac.second_order import (
    damped_inverse,
    eigen_decomposition,
    kl_clip_scale,
    precondition_eigen,
    precondition_inverse,
)

if TYPE_CHECKING:
    from precond.torch.kfac.assignment import LayerWork, WorkerGrid
    from precond.torch.kfac.communication import Communicator
    from precond.torch.kfac.layers import KFACLayer


class SecondOrderWork:
    """:class:`~precond.torch.kfac.KFAC`'s decompositions and preconditioning (a
    mixin: it reads the preconditioner's layers, worker grid, assignment and
    scheduled hyperparameters)."""

    # What the mixin reads from KFAC (annotations only: KFAC sets them).
    layers: list[KFACLayer]
    grid: WorkerGrid
    communicator: Communicator
    assignment: dict[str, LayerWork]
    compute_method: ComputeMethod
    compute_eigenvalue_outer_product: bool
    inv_dtype: torch.dtype
    _ready: dict[str, bool]
    _column_groups: list[Any]  # process groups (None where no communication)
    _row_groups: list[Any]

    if TYPE_CHECKING:  # KFAC's scheduled hyperparameters (properties)

        @property
        def damping(self) -> float: ...

        @property
        def kl_clip(self) -> float | None: ...

        @property
        def lr(self) -> float: ...

    # -- second-order data --
    def _second_order_layout(self, layer: KFACLayer) -> list[tuple[str, str, tuple]]:
        """(key, factor it comes from, shape) of each second-order tensor."""
        a, g = layer.a_dim, layer.g_dim
        if self.compute_method is ComputeMethod.INVERSE:
            return [("a_inv", "A", (a, a)), ("g_inv", "G", (g, g))]
        if self.compute_eigenvalue_outer_product:
            return [("q_a", "A", (a, a)), ("q_g", "G", (g, g)), ("prediv", "A", (g, a))]
        return [
            ("q_a", "A", (a, a)),
            ("d_a", "A", (a,)),
            ("q_g", "G", (g, g)),
            ("d_g", "G", (g,)),
        ]

    def _compute_second_order(self, layer: KFACLayer, work: LayerWork) -> None:
        rank, damping, dtype = self.communicator.rank, self.damping, self.inv_dtype
        A, G = layer.A, layer.G
        # Called for layers with both factors only.
        assert A is not None
        assert G is not None
        out = layer.second_order
        if self.compute_method is ComputeMethod.INVERSE:
            if rank == work.a_worker:
                out["a_inv"] = damped_inverse(A, damping, dtype)
            if rank == work.g_worker:
                out["g_inv"] = damped_inverse(G, damping, dtype)
            return
        if rank == work.a_worker:
            d_a, out["q_a"] = eigen_decomposition(A, dtype)
        if rank == work.g_worker:
            d_g, out["q_g"] = eigen_decomposition(G, dtype)
        if self.compute_eigenvalue_outer_product:
            if rank == work.a_worker:  # == g_worker (colocated)
                out["prediv"] = 1.0 / (torch.outer(d_g, d_a) + damping)
        else:
            if rank == work.a_worker:
                out["d_a"] = d_a
            if rank == work.g_worker:
                out["d_g"] = d_g

    def _update_second_order(self) -> None:
        """Decompose on the inverse workers; broadcast down each layer's column."""
        comm, grid = self.communicator, self.grid
        my_column = grid.column_of(comm.rank)
        for layer in self.layers:
            has_factors = layer.A is not None and layer.G is not None
            self._ready[layer.name] = has_factors
            work = self.assignment[layer.name]
            if has_factors and work.column == my_column:
                self._compute_second_order(layer, work)
        if grid.grad_workers == 1:
            return
        group = self._column_groups[my_column]
        for src in grid.column_ranks(my_column):
            keys, tensors = [], []
            for layer in self.layers:
                work = self.assignment[layer.name]
                if not self._ready[layer.name] or work.column != my_column:
                    continue
                for key, factor, shape in self._second_order_layout(layer):
                    worker = work.a_worker if factor == "A" else work.g_worker
                    if worker != src:
                        continue
                    if comm.rank == src:
                        tensors.append(layer.second_order[key])
                    else:
                        device = layer.module.weight.device
                        tensors.append(
                            torch.empty(shape, dtype=self.inv_dtype, device=device)
                        )
                    keys.append((layer, key))
            received = comm.broadcast(
                tensors,
                [key.endswith("_inv") for _, key in keys],  # inverses are symmetric
                src=src,
                group=group,
                kind="second_order",
            )
            for (layer, key), tensor in zip(keys, received, strict=True):
                layer.second_order[key] = tensor

    # -- preconditioning --
    def _precondition_layer(self, layer: KFACLayer, grad: torch.Tensor) -> torch.Tensor:
        s = layer.second_order
        if self.compute_method is ComputeMethod.INVERSE:
            return precondition_inverse(grad, s["a_inv"], s["g_inv"])
        if self.compute_eigenvalue_outer_product:
            return precondition_eigen(grad, s["q_a"], s["q_g"], prediv=s["prediv"])
        return precondition_eigen(
            grad, s["q_a"], s["q_g"], d_a=s["d_a"], d_g=s["d_g"], damping=self.damping
        )

    def _precondition(self) -> None:
        comm, grid = self.communicator, self.grid
        my_column, my_row = grid.column_of(comm.rank), grid.row_of(comm.rank)
        active = [l for l in self.layers if self._ready[l.name] and l.has_grad()]
        if not active:
            return
        grads = {l.name: l.grad_matrix() for l in active}
        # Scale-safe: each layer preconditions 2^−e ∇ with 2^(e−1) ≤ max|∇| < 2^e
        # (e ≥ 0: only gradients of 1 and more are scaled, and powers of two
        # scale exactly), and 2^e is applied with the KL clip's ν at the end, so a
        # huge finite gradient (1e30, float32's max) does not overflow on the way.
        maxima = torch.stack(
            [grads[l.name].abs().amax().to(torch.float64) for l in active]
        ).tolist()
        exponents = [
            max(math.frexp(m)[1], 0) if math.isfinite(m) else 0 for m in maxima
        ]
        for layer, e in zip(active, exponents, strict=True):
            grads[layer.name] = grads[layer.name].to(self.inv_dtype)
            if e:
                grads[layer.name] = grads[layer.name] * math.ldexp(1.0, -e)
        result: dict[str, torch.Tensor] = {}
        for layer in active:
            if self.assignment[layer.name].column == my_column:
                result[layer.name] = self._precondition_layer(layer, grads[layer.name])
        if grid.columns > 1:
            group = self._row_groups[my_row]
            for column, src in enumerate(grid.row_ranks(my_row)):
                mine = [l for l in active if self.assignment[l.name].column == column]
                tensors = [
                    result[l.name]
                    if column == my_column
                    else torch.empty(
                        l.g_dim,
                        l.a_dim,
                        dtype=self.inv_dtype,
                        device=l.module.weight.device,
                    )
                    for l in mine
                ]
                received = comm.broadcast(
                    tensors,
                    [False] * len(tensors),
                    src=src,
                    group=group,
                    kind="gradients",
                )
                result.update({l.name: t for l, t in zip(mine, received, strict=True)})
        kl_clip = self.kl_clip
        preconditioned = [result[l.name] for l in active]
        nu = (
            1.0
            if kl_clip is None
            else kl_clip_scale(
                preconditioned,
                [grads[l.name] for l in active],
                self.lr,
                kl_clip,
                exponents,
            )
        )
        for layer, update, e in zip(active, preconditioned, exponents, strict=True):
            try:
                scale = math.ldexp(nu, e)
            except OverflowError:  # float64 gradients near their max, not clipped
                scale = math.inf
            layer.set_grad(update * scale if scale != 1.0 else update)
