"""Float64 NumPy reference for SOAP (Vyas et al. 2024, arXiv:2409.11321), written
from the paper's Algorithm 3 and its authors' description, with no JAX, no torch and
no shared helpers. One instance is one tensor (a block of a blocked tensor is a
tensor of its own).

The definition precond implements, step by step:

* **Shape.** A tensor of rank ≥ 2 (or rank 1 with ``precondition_1d``) gets one
  statistic per axis of its working shape; the working shape is the tensor's own, or
  with ``merge_dims`` the greedy merge of adjacent dims while the product stays
  ≤ ``max_precond_dim``. An axis longer than ``max_precond_dim`` gets no statistic:
  its basis is the identity (one-sided SOAP); with no statistic at all the tensor is
  trained by Adam.
* **Statistics.** ``S_k ← β_s·S_k + (1-β_s)·G ⋅_{¬k} G`` (the contraction of G with
  itself over every axis but k), with β_s = ``shampoo_beta``, or ``betas[1]`` when
  ``shampoo_beta < 0``.
* **First call.** The statistics are accumulated and each basis ``Q_k`` is the
  eigenvectors of ``S_k`` by descending eigenvalue; the parameter is not changed by
  the preconditioned step (so the current gradient never enters its own projection),
  and the Adam step counter stays at 0.
* **Every later call** (t = 1, 2, ...: the Adam step counter):
  1. ``G' = G ×_k Q_k`` for every axis (project into the eigenbasis: contract axis k
     of G with the rows of Q_k, i.e. ``Q_kᵀ`` applied along k);
  2. ``M ← β1·M + (1-β1)·G'``, ``V ← β2·V + (1-β2)·G'²``: both moments live in
     the eigenbasis;
  3. ``N = M / (sqrt(V) + eps)``, then ``U = N ×_k Q_kᵀ`` (project back);
     with ``normalize_grads``, ``U ← U / (1e-30 + rms(U))``;
  4. ``step = lr · sqrt(1-β2^t) / (1-β1^t)`` (``lr`` alone without
     ``correct_bias``); ``p ← p - step·U - lr·wd·p`` (decoupled weight decay on the
     parameter before the step, as torch's AdamW and optax's ``adamw``; the authors'
     code decays the already updated parameter, a difference of order lr²·wd);
  5. statistics update with G (as above), then the basis refresh:
     ``M`` is projected back with the old bases; when ``t % precondition_frequency
     == 0`` each ``Q_k`` is refreshed by one power step: the eigenvalue estimates
     ``diag(Q_kᵀ S_k Q_k)`` are sorted descending, the columns of ``Q_k`` and the
     entries of ``V`` along axis k are permuted by that order, and
     ``Q_k ← qr(S_k Q_k).Q``; with ``refresh="eigh"`` the eigenvectors of ``S_k`` by
     descending eigenvalue are taken instead (V is then left as it is); ``M`` is then
     projected into the (new or unchanged) bases.

The weight decay of the first call: applied as in step 4 (``p ← p - lr·wd·p``),
since optax's ``add_decayed_weights`` and the torch optimizer decay every step; the
authors' code skips the first call whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def merged_shape(shape: Sequence[int], max_precond_dim: int) -> list[int]:
    """The authors' greedy merge: adjacent dims are multiplied together while
    the product stays ≤ ``max_precond_dim``; a dim larger on its own stands alone."""
    merged, product = [], 1
    for d in shape:
        if product * d > max_precond_dim:
            if product > 1:
                merged.append(product)
                product = d
            else:
                merged.append(d)
                product = 1
        else:
            product *= d
    if product > 1 or not merged:
        merged.append(product)
    return merged


def along(x: np.ndarray, q: np.ndarray, axis: int) -> np.ndarray:
    """Contracts ``axis`` of ``x`` with the first index of ``q``: ``x ×_axis qᵀ``
    in mode-product notation; the new index takes the axis's place."""
    return np.moveaxis(np.tensordot(x, q, axes=([axis], [0])), -1, axis)


def gram(g: np.ndarray, axis: int) -> np.ndarray:
    """``G ⋅_{¬axis} G``: the contraction of ``g`` with itself over every other axis."""
    others = [a for a in range(g.ndim) if a != axis]
    return np.tensordot(g, g, axes=(others, others))


def descending_eigenvectors(s: np.ndarray) -> np.ndarray:
    _, vectors = np.linalg.eigh(s)
    return vectors[:, ::-1]


class SoapReference:
    """SOAP on one tensor of shape ``shape`` (module docstring); ``step(p, g)``
    returns the new parameter."""

    def __init__(
        self,
        shape: Sequence[int],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1.0,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        correct_bias: bool = True,
        refresh: str = "qr",
    ):
        self.shape = tuple(shape)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.shampoo_beta = shampoo_beta if shampoo_beta >= 0 else betas[1]
        self.weight_decay = weight_decay
        self.frequency = precondition_frequency
        self.normalize_grads, self.correct_bias = normalize_grads, correct_bias
        self.refresh = refresh
        if len(self.shape) >= 2 and merge_dims:
            self.work_shape = tuple(merged_shape(self.shape, max_precond_dim))
        else:
            self.work_shape = self.shape
        rank_ok = len(self.shape) >= 2 or (len(self.shape) == 1 and precondition_1d)
        self.statistics = [
            np.zeros((d, d)) if rank_ok and d <= max_precond_dim else None
            for d in self.work_shape
        ]
        self.bases: list[np.ndarray | None] = [None] * len(self.work_shape)
        self.m = np.zeros(self.work_shape)
        self.v = np.zeros(self.work_shape)
        self.t = 0
        self.initialised = False

    def project(self, x: np.ndarray) -> np.ndarray:
        for k, q in enumerate(self.bases):
            if q is not None:
                x = along(x, q, k)
        return x

    def project_back(self, x: np.ndarray) -> np.ndarray:
        for k, q in enumerate(self.bases):
            if q is not None:
                x = along(x, q.T, k)
        return x

    def _accumulate(self, g: np.ndarray) -> None:
        b = self.shampoo_beta
        for k, s in enumerate(self.statistics):
            if s is not None:
                self.statistics[k] = b * s + (1 - b) * gram(g, k)

    def _refresh_bases(self) -> None:
        for k, s in enumerate(self.statistics):
            if s is None:
                continue
            q = self.bases[k]
            if self.refresh == "eigh":
                self.bases[k] = descending_eigenvectors(s)
                continue
            order = np.argsort(-np.diag(q.T @ s @ q), kind="stable")
            self.v = np.take(self.v, order, axis=k)
            self.bases[k] = np.linalg.qr(s @ q[:, order])[0]

    def step(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        p = np.asarray(p, np.float64)
        g = np.asarray(g, np.float64).reshape(self.work_shape)
        p = p - self.lr * self.weight_decay * p
        if not self.initialised:
            self._accumulate(g)
            self.bases = [
                None if s is None else descending_eigenvectors(s)
                for s in self.statistics
            ]
            self.initialised = True
            return p
        self.t += 1
        b1, b2 = self.betas
        projected = self.project(g)
        self.m = b1 * self.m + (1 - b1) * projected
        self.v = b2 * self.v + (1 - b2) * projected**2
        u = self.project_back(self.m / (np.sqrt(self.v) + self.eps))
        if self.normalize_grads:
            u = u / (1e-30 + math.sqrt(np.mean(u**2)))
        size = self.lr
        if self.correct_bias:
            size = size * math.sqrt(1 - b2**self.t) / (1 - b1**self.t)
        p = p - size * u.reshape(self.shape)
        self._accumulate(g)
        self.m = self.project_back(self.m)
        if self.t % self.frequency == 0:
            self._refresh_bases()
        self.m = self.project(self.m)
        return p
