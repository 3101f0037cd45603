"""Float64 NumPy reference for Distributed Shampoo with grafting, written from the math.

This follows ``shared/reference/algorithms.md`` Part 2 §1 and the semantics of
``precond.jax.distributed_shampoo`` step by step, with no JAX and no shared helpers:

* shape plan: greedy merge of small dims, then lexicographic blocks of at most
  ``block_size`` per axis (remainder chunk last);
* statistics S_{b,k} ← β2·S_{b,k} + c·(G_b ⋅_{¬k} G_b) with c = 1-β2 (1 if β2 = 1);
* inverse roots by ``np.linalg.eigh`` with the relative ridge ε·max(λmax, 1e-6);
* grafting (SGD, AdaGrad, RMSProp, their normalized variants, sign), the grafted
  Shampoo step u_s = P(G)·‖u_g‖/(‖P(G)‖ + 1e-16), coupled weight decay, the two
  momentum buffers and Nesterov, and update = -lr(t)·v.

Plain AdaGrad and RMSProp references (the grafting-only path of the optimizer) are
at the end, written independently of the Shampoo class.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

# Grafting types, by the integer values of precond's GraftingType.
SGD = 1
ADAGRAD = 2
RMSPROP = 3
RMSPROP_NORMALIZED = 4
SQRT_N = 5
ADAGRAD_NORMALIZED = 6

# Guard added to the norms of the grafted Shampoo step and of normalized gradients.
NORM_GUARD = 1e-16


def merge_small_dims(shape: Sequence[int], max_dim: int) -> list[int]:
    """Google's greedy merge: all dims 1 → [1]; otherwise walk the dims keeping a
    running product, multiplying d in while product·d ≤ max_dim, else emitting the
    product (when > 1) and restarting from d; emit the last product when > 1."""
    shape = [int(d) for d in shape]
    if all(d == 1 for d in shape):
        return [1]
    merged, product = [], 1
    for d in shape:
        if product * d <= max_dim:
            product *= d
        else:
            if product > 1:
                merged.append(product)
            product = d
    if product > 1:
        merged.append(product)
    return merged


def axis_chunks(d: int, block_size: int) -> list[slice]:
    """Chunks of an axis of size d: [0:b], [b:2b], …, remainder last; the whole
    axis when d ≤ b or b ≤ 0."""
    if block_size <= 0 or d <= block_size:
        return [slice(0, d)]
    return [
        slice(start, min(start + block_size, d)) for start in range(0, d, block_size)
    ]


def block_slices(shape: Sequence[int], block_size: int) -> list[tuple[slice, ...]]:
    """Blocks as index tuples, one chunk per axis, axis 0 outermost (lexicographic)."""
    return list(itertools.product(*(axis_chunks(d, block_size) for d in shape)))


def partition(X: np.ndarray, block_size: int) -> list[np.ndarray]:
    """The blocks of X in lexicographic order (copies)."""
    X = np.asarray(X, dtype=np.float64)
    return [X[index].copy() for index in block_slices(X.shape, block_size)]


def merge_blocks(
    blocks: Sequence[np.ndarray], shape: Sequence[int], block_size: int
) -> np.ndarray:
    """Inverse of :func:`partition`: write each block back at its place."""
    out = np.full(tuple(shape), np.nan)
    slices = block_slices(shape, block_size)
    assert len(slices) == len(blocks)
    for index, block in zip(slices, blocks):
        out[index] = block
    return out


def axis_gram(X: np.ndarray, k: int) -> np.ndarray:
    """X ⋅_{¬k} X: X contracted with itself over every axis but k, i.e.
    X_(k)X_(k)ᵀ for the mode-k unfolding (GGᵀ for k = 0 and GᵀG for k = 1 of a
    matrix)."""
    unfolded = np.moveaxis(np.asarray(X, dtype=np.float64), k, 0)
    unfolded = unfolded.reshape(X.shape[k], -1)
    return unfolded @ unfolded.T


def relative_ridge(S: np.ndarray, eps: float) -> float:
    """ε' = ε·max(λmax(S), 1e-6) with the exact largest eigenvalue."""
    return eps * max(float(np.linalg.eigvalsh(S)[-1]), 1e-6)


def inverse_pth_root(S: np.ndarray, p: int, eps: float) -> tuple[np.ndarray, float]:
    """(A^{-1/p}, error) for A = S + ε'I, ε' = ε·max(λmax(S), 1e-6).

    With S = U diag(λ) Uᵀ: root = U diag((max(λ, 0) + ε')^{-1/p}) Uᵀ, and
    error = max|root^p·A − I|.
    """
    S = np.asarray(S, dtype=np.float64)
    S = (S + S.T) / 2
    lam, U = np.linalg.eigh(S)
    ridge = eps * max(float(lam[-1]), 1e-6)
    root = (U * (np.maximum(lam, 0.0) + ridge) ** (-1.0 / p)) @ U.T
    A = S + ridge * np.eye(len(S))
    error = float(np.max(np.abs(np.linalg.matrix_power(root, p) @ A - np.eye(len(S)))))
    return root, error


def apply_preconditioners(X: np.ndarray, Ps: Sequence[np.ndarray]) -> np.ndarray:
    """X ×_0 P_0 ×_1 P_1 …: axis k of X contracted with axis 0 of P_k, the result
    keeping X's axis order."""
    X = np.asarray(X, dtype=np.float64)
    for k, P in enumerate(Ps):
        X = np.moveaxis(np.tensordot(X, P, axes=([k], [0])), -1, k)
    return X


class _ParamState:
    """Shape plan and state of one parameter."""

    def __init__(self, shape, block_size, merge, skip_dim_gt, exponent_override, eps):
        self.shape = tuple(shape)
        self.merged_shape = (
            tuple(merge_small_dims(shape, block_size)) if merge else self.shape
        )
        self.block_size = block_size
        self.skipped = len(self.shape) < 1 or any(d > skip_dim_gt for d in self.shape)
        rank = len(self.merged_shape)
        self.exponent = exponent_override if exponent_override > 0 else 2 * rank
        self.slices = (
            [] if self.skipped else block_slices(self.merged_shape, block_size)
        )
        # statistics[b][k] and preconditioners[b][k] for block b and axis k.
        self.statistics = [
            [eps * np.eye(index[k].stop - index[k].start) for k in range(rank)]
            for index in self.slices
        ]
        self.preconditioners = [[np.eye(len(S)) for S in Ss] for Ss in self.statistics]
        self.errors = [[0.0 for _ in Ss] for Ss in self.statistics]
        self.diagonal = np.zeros(self.shape)
        self.momentum = np.zeros(self.shape)  # m_s (for SQRT_N: the mixed m)
        self.diagonal_momentum = np.zeros(self.shape)  # m_g (unused for SQRT_N)

    @property
    def num_statistics(self) -> int:
        return sum(len(Ss) for Ss in self.statistics)


class ShampooReference:
    """Whole Shampoo steps on a dict of float64 parameters (one shared count t).

    Per parameter W with gradient G, at t = number of completed steps:

    1. G' = G reshaped to s' (merged or original shape), cut into blocks G_b.
    2. If t % statistics_compute_steps == 0: S_{b,k} ← β2·S_{b,k} + c·(G_b ⋅_{¬k} G_b).
    3. If t % preconditioning_compute_steps == 0: P_{b,k} ← root(S_{b,k}, p), kept
       unchanged when the error is ≥ inverse_failure_threshold or NaN.
    4. Grafting direction u_g (see :meth:`_graft`).
    5. P(G) = blocks G_b ×_0 P_{b,0} ×_1 … merged back (u_g for a skipped
       parameter); u_s = P(G)·‖u_g‖/(‖P(G)‖ + 1e-16).
    6. u_s += wd·W and u_g += wd·W.
    7. w = 1-β1 (EMA momentum) or 1; m_s ← β1 m_s + w u_s; m_g ← β1 m_g + w u_g
       (SQRT_N: m_g = β1·m_s_old + w u_g); r = 1[t ≥ start];
       m = r m_s + (1-r) m_g, u = r u_s + (1-r) u_g; v = w u + β1 m (Nesterov)
       or m; update = -lr(t)·v. For SQRT_N the stored m_s is m.

    A step with a non-finite gradient anywhere returns zeros and changes nothing.
    """

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        learning_rate: float | Callable[[int], float],
        block_size: int,
        beta1: float = 0.9,
        beta2: float = 0.999,
        diagonal_epsilon: float = 1e-10,
        matrix_epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        start_preconditioning_step: int = 5,
        preconditioning_compute_steps: int = 1,
        statistics_compute_steps: int = 1,
        best_effort_shape_interpretation: bool = True,
        graft_type: int = SGD,
        nesterov: bool = True,
        exponent_override: int = 0,
        inverse_failure_threshold: float = 0.1,
        moving_average_for_momentum: bool = False,
        skip_preconditioning_dim_size_gt: int = 4096,
        clip_by_scaled_gradient_norm: float | None = None,
    ):
        self.learning_rate = learning_rate
        self.beta1 = beta1
        self.beta2 = beta2
        self.diagonal_epsilon = diagonal_epsilon
        self.matrix_epsilon = matrix_epsilon
        self.weight_decay = weight_decay
        self.start = start_preconditioning_step
        self.preconditioning_compute_steps = preconditioning_compute_steps
        self.statistics_compute_steps = statistics_compute_steps
        self.graft_type = int(graft_type)
        self.nesterov = nesterov
        self.inverse_failure_threshold = inverse_failure_threshold
        self.moving_average_for_momentum = moving_average_for_momentum
        self.clip = clip_by_scaled_gradient_norm
        self.count = 0
        self.params = {
            name: _ParamState(
                np.shape(value),
                block_size,
                best_effort_shape_interpretation,
                skip_preconditioning_dim_size_gt,
                exponent_override,
                matrix_epsilon,
            )
            for name, value in params.items()
        }

    @property
    def c(self) -> float:
        """Weight of new statistics: 1 if β2 == 1 else 1-β2."""
        return 1.0 if self.beta2 == 1.0 else 1.0 - self.beta2

    def lr(self, t: int) -> float:
        lr = self.learning_rate
        return float(lr(t)) if callable(lr) else float(lr)

    def step(
        self, grads: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The updates of one step (lr and sign included); advances the state."""
        grads = {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}
        if not all(np.all(np.isfinite(g)) for g in grads.values()):
            return {k: np.zeros_like(g) for k, g in grads.items()}
        t = self.count
        updates = {
            name: self._param_step(state, grads[name], np.asarray(params[name]), t)
            for name, state in self.params.items()
        }
        self.count += 1
        return updates

    def _param_step(self, st: _ParamState, G: np.ndarray, W: np.ndarray, t: int):
        if not st.skipped:
            blocks = partition(G.reshape(st.merged_shape), st.block_size)
            if t % self.statistics_compute_steps == 0:
                for b, G_b in enumerate(blocks):
                    for k in range(G_b.ndim):
                        st.statistics[b][k] = self.beta2 * st.statistics[b][
                            k
                        ] + self.c * axis_gram(G_b, k)
            if t % self.preconditioning_compute_steps == 0:
                for b, Ss in enumerate(st.statistics):
                    for k, S in enumerate(Ss):
                        root, error = inverse_pth_root(
                            S, st.exponent, self.matrix_epsilon
                        )
                        st.errors[b][k] = error
                        if (
                            np.isfinite(error)
                            and error < self.inverse_failure_threshold
                        ):
                            st.preconditioners[b][k] = root

        u_g = self._graft(st, G)
        if st.skipped:
            direction = u_g
        else:
            preconditioned = [
                apply_preconditioners(G_b, Ps)
                for G_b, Ps in zip(blocks, st.preconditioners)
            ]
            direction = merge_blocks(preconditioned, st.merged_shape, st.block_size)
            direction = direction.reshape(st.shape)
        u_s = direction * np.linalg.norm(u_g) / (np.linalg.norm(direction) + NORM_GUARD)

        if self.weight_decay != 0:
            u_s = u_s + self.weight_decay * W
            u_g = u_g + self.weight_decay * W

        b1 = self.beta1
        w = 1.0 - b1 if self.moving_average_for_momentum else 1.0
        m_s = b1 * st.momentum + w * u_s
        if self.graft_type == SQRT_N:
            m_g = b1 * st.momentum + w * u_g
        else:
            m_g = b1 * st.diagonal_momentum + w * u_g
        r = 1.0 if t >= self.start else 0.0
        m = r * m_s + (1 - r) * m_g
        u = r * u_s + (1 - r) * u_g
        v = w * u + b1 * m if self.nesterov else m
        if self.graft_type == SQRT_N:
            st.momentum = m
        else:
            st.momentum = m_s
            st.diagonal_momentum = m_g
        return -self.lr(t) * v

    def _graft(self, st: _ParamState, G: np.ndarray) -> np.ndarray:
        """u_g. SGD: G. ADAGRAD: D ← D + G², G/(√D + ε_d). RMSPROP: D ← β2 D + c G²,
        G/(√D + ε_d), then divided by max(1, (‖u_g‖/√size)/clip) when clipping.
        *_NORMALIZED: the same with G/(‖G‖ + 1e-16). SQRT_N: sign(G)."""
        kind = self.graft_type
        if kind == SGD:
            return G
        if kind == SQRT_N:
            return np.sign(G)
        if kind in (ADAGRAD_NORMALIZED, RMSPROP_NORMALIZED):
            G = G / (np.linalg.norm(G) + NORM_GUARD)
        if kind in (ADAGRAD, ADAGRAD_NORMALIZED):
            st.diagonal = st.diagonal + G**2
            return G / (np.sqrt(st.diagonal) + self.diagonal_epsilon)
        if kind in (RMSPROP, RMSPROP_NORMALIZED):
            st.diagonal = self.beta2 * st.diagonal + self.c * G**2
            u_g = G / (np.sqrt(st.diagonal) + self.diagonal_epsilon)
            if self.clip:
                scaled_norm = np.linalg.norm(u_g) / np.sqrt(u_g.size)
                u_g = u_g / max(1.0, scaled_norm / self.clip)
            return u_g
        raise ValueError(f"unknown graft type {kind}")


def run_shampoo(
    params: Mapping[str, np.ndarray],
    grads_per_step: Sequence[Mapping[str, np.ndarray]],
    **options,
) -> tuple[list[dict[str, np.ndarray]], ShampooReference]:
    """Run :class:`ShampooReference` over the gradients, applying each step's
    updates to the parameters; the per-step updates and the final reference."""
    params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    ref = ShampooReference(params, **options)
    outputs = []
    for grads in grads_per_step:
        updates = ref.step(grads, params)
        params = {k: params[k] + updates[k] for k in params}
        outputs.append(updates)
    return outputs, ref


def _momentum_updates(
    directions: Callable[[str, np.ndarray, np.ndarray], np.ndarray],
    params: Mapping[str, np.ndarray],
    grads_per_step: Sequence[Mapping[str, np.ndarray]],
    learning_rate: float,
    beta1: float,
    nesterov: bool,
    moving_average_for_momentum: bool,
    weight_decay: float,
) -> list[dict[str, np.ndarray]]:
    """u = direction(name, G, W) + wd·W; m ← β1 m + w u; v = w u + β1 m (Nesterov)
    or m; update = -lr·v; parameters advance by the updates."""
    params = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    w = 1.0 - beta1 if moving_average_for_momentum else 1.0
    m = {k: np.zeros_like(v) for k, v in params.items()}
    outputs = []
    for grads in grads_per_step:
        step = {}
        for k, W in params.items():
            u = directions(k, np.asarray(grads[k], dtype=np.float64), W)
            u = u + weight_decay * W
            m[k] = beta1 * m[k] + w * u
            v = w * u + beta1 * m[k] if nesterov else m[k]
            step[k] = -learning_rate * v
        params = {k: params[k] + step[k] for k in params}
        outputs.append(step)
    return outputs


def adagrad_updates(
    params: Mapping[str, np.ndarray],
    grads_per_step: Sequence[Mapping[str, np.ndarray]],
    learning_rate: float,
    beta1: float = 0.9,
    epsilon: float = 1e-10,
    nesterov: bool = True,
    moving_average_for_momentum: bool = False,
    weight_decay: float = 0.0,
) -> list[dict[str, np.ndarray]]:
    """AdaGrad with heavy-ball/Nesterov momentum: D ← D + G², u = G/(√D + ε)."""
    accumulators = {k: np.zeros(np.shape(v)) for k, v in params.items()}

    def direction(k, G, W):
        accumulators[k] = accumulators[k] + G * G
        return G / (np.sqrt(accumulators[k]) + epsilon)

    return _momentum_updates(
        direction,
        params,
        grads_per_step,
        learning_rate,
        beta1,
        nesterov,
        moving_average_for_momentum,
        weight_decay,
    )


def rmsprop_updates(
    params: Mapping[str, np.ndarray],
    grads_per_step: Sequence[Mapping[str, np.ndarray]],
    learning_rate: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-10,
    nesterov: bool = True,
    moving_average_for_momentum: bool = False,
    weight_decay: float = 0.0,
    clip_by_scaled_gradient_norm: float | None = None,
) -> list[dict[str, np.ndarray]]:
    """RMSProp with momentum: D ← β2 D + (1-β2) G² (β2 = 1: D + G²),
    u = G/(√D + ε), optionally u /= max(1, RMS(u)/clip)."""
    accumulators = {k: np.zeros(np.shape(v)) for k, v in params.items()}
    weight = 1.0 if beta2 == 1.0 else 1.0 - beta2

    def direction(k, G, W):
        accumulators[k] = beta2 * accumulators[k] + weight * G * G
        u = G / (np.sqrt(accumulators[k]) + epsilon)
        if clip_by_scaled_gradient_norm:
            rms = np.sqrt(np.mean(u * u))
            u = u / max(1.0, rms / clip_by_scaled_gradient_norm)
        return u

    return _momentum_updates(
        direction,
        params,
        grads_per_step,
        learning_rate,
        beta1,
        nesterov,
        moving_average_for_momentum,
        weight_decay,
    )
