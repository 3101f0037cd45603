"""KAISA's placement of K-FAC work on the ranks of a data-parallel job.

With W ranks and gradient-worker fraction f, the ranks form a grid of
``grad_workers = max(1, round(W·f))`` rows by ``W / grad_workers`` columns, filled
row-major. Every layer belongs to one column: the ranks of that column (its
*gradient workers*) hold the layer's second-order data and precondition its
gradient; the other ranks of each row (its *receivers*) get the preconditioned
gradient from their row's gradient worker. The factors' decompositions are computed
once, on one rank of the column (the *inverse worker*), and broadcast down it.

* COMM_OPT (f = 1): one column of all ranks; no gradient broadcast.
* MEM_OPT (f = 1/W): W columns of one rank; no second-order broadcast.
* HYBRID_OPT (f = 1/2): two rows.

Layers are placed greedily, largest first (LPT): to the least-loaded column, then
the least-loaded rank in it, with cost dim³ per factor (compute) or dim² (memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LayerWork", "WorkerGrid", "assign_layers"]


@dataclass(frozen=True)
class WorkerGrid:
    """The ``grad_workers × columns`` grid of ``world_size`` ranks (row-major).

    Args:
        world_size: the number of ranks (>= 1).
        grad_workers: the ranks that precondition each layer's gradient, one
            column of the grid; must divide ``world_size``.

    Example:
        >>> WorkerGrid(world_size=4, grad_workers=2).column_ranks(1)
        [1, 3]
    """

    world_size: int
    grad_workers: int

    def __post_init__(self):
        if self.world_size < 1 or self.grad_workers < 1:
            raise ValueError(f"Invalid grid: {self}")
        if self.world_size % self.grad_workers:
            raise ValueError(
                f"Invalid grad_workers={self.grad_workers}: must divide the world "
                f"size {self.world_size} (each layer's gradient workers form one "
                "column of an equal grid)"
            )

    @property
    def columns(self) -> int:
        return self.world_size // self.grad_workers

    def column_of(self, rank: int) -> int:
        return rank % self.columns

    def row_of(self, rank: int) -> int:
        return rank // self.columns

    def column_ranks(self, column: int) -> list[int]:
        """The gradient workers of the layers in ``column``."""
        return [column + row * self.columns for row in range(self.grad_workers)]

    def row_ranks(self, row: int) -> list[int]:
        """The ranks that receive preconditioned gradients from each other."""
        return [row * self.columns + column for column in range(self.columns)]


@dataclass(frozen=True)
class LayerWork:
    """Where one layer's work happens: its column and its factors' inverse workers.

    Args:
        column: the grid column whose ranks precondition the layer's gradient.
        a_worker: the rank that decomposes (or inverts) the layer's factor A.
        g_worker: the rank that decomposes (or inverts) the layer's factor G.
    """

    column: int
    a_worker: int
    g_worker: int


def assign_layers(
    costs: Mapping[str, tuple[float, float]],
    grid: WorkerGrid,
    *,
    colocate_factors: bool = True,
) -> dict[str, LayerWork]:
    """Greedy LPT placement of each layer's (A cost, G cost).

    Layers are taken in decreasing total cost (ties: registration order); each goes
    to the column with the least summed load, then its factors to the least-loaded
    rank of that column: both to one rank with ``colocate_factors``, else the
    costlier factor first and the other to the then least-loaded rank.

    Args:
        costs: each layer's name → the costs of its (A, G) factors, in the
            order of registration.
        grid: the worker grid the layers are placed on.
        colocate_factors: put a layer's two factors on the same rank.

    Returns:
        Each layer's :class:`LayerWork`, by name.

    Example, three layers' (A, G) costs on two ranks of one worker each:
        >>> work = assign_layers(
        ...     {"a": (4.0, 1.0), "b": (2.0, 2.0), "c": (1.0, 1.0)},
        ...     WorkerGrid(world_size=2, grad_workers=1),
        ... )
        >>> {name: w.a_worker for name, w in work.items()}
        {'a': 0, 'b': 1, 'c': 1}
    """
    load = [0.0] * grid.world_size
    order = sorted(enumerate(costs.items()), key=lambda t: (-sum(t[1][1]), t[0]))
    work: dict[str, LayerWork] = {}
    for _, (name, (cost_a, cost_g)) in order:
        column = min(
            range(grid.columns),
            key=lambda c: (sum(load[r] for r in grid.column_ranks(c)), c),
        )
        ranks = grid.column_ranks(column)

        def least_loaded(ranks=ranks):
            return min(ranks, key=lambda r: (load[r], r))

        if colocate_factors:
            a_worker = g_worker = least_loaded()
            load[a_worker] += cost_a + cost_g
        elif cost_a >= cost_g:
            a_worker = least_loaded()
            load[a_worker] += cost_a
            g_worker = least_loaded()
            load[g_worker] += cost_g
        else:
            g_worker = least_loaded()
            load[g_worker] += cost_g
            a_worker = least_loaded()
            load[a_worker] += cost_a
        work[name] = LayerWork(column, a_worker, g_worker)
    return {name: work[name] for name in costs}
