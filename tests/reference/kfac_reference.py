"""Float64 NumPy references for K-FAC, written from the math.

Deliberately explicit and slow: convolution patches are read position by position
from an explicitly padded input (no unfold), factors are sums of per-row outer
products, and the preconditioner is the dense damped matrix acting on vec ∇.
Nothing here imports precond.

Conventions: ∇ is the (out, in [+1]) matrix [∇W_flat | ∇b] and vec is the C-order
ravel, so vec(G X Aᵀ) = (G ⊗ A) vec(X) with ``np.kron(G, A)``. A convolution weight
(C_out, C_in, kh, kw) flattens in that C order, matching patch entries (c, i, j).
"""

from __future__ import annotations

import numpy as np


def with_bias_column(rows: np.ndarray, bias: bool) -> np.ndarray:
    return np.concatenate([rows, np.ones((len(rows), 1))], axis=1) if bias else rows


def second_moment(rows: np.ndarray) -> np.ndarray:
    """(1/n) Σ_r row_r row_rᵀ, as a sum of outer products."""
    rows = np.asarray(rows, dtype=np.float64)
    return sum(np.outer(r, r) for r in rows) / len(rows)


def conv_patch_rows(
    x: np.ndarray,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int, int, int],
    dilation: tuple[int, int],
    pad_mode: str = "constant",
) -> np.ndarray:
    """Rows (N·oh·ow, C·kh·kw): the input entries each output position reads.

    ``padding`` is (top, bottom, left, right); ``pad_mode`` a NumPy pad mode
    ('constant' = zeros, 'reflect', 'edge' = replicate, 'wrap' = circular).
    """
    n, c, h, w = x.shape
    top, bottom, left, right = padding
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), mode=pad_mode)
    kh, kw = kernel
    span_h, span_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    oh = (h + top + bottom - span_h) // stride[0] + 1
    ow = (w + left + right - span_w) // stride[1] + 1
    rows = []
    for example in range(n):
        for p in range(oh):
            for q in range(ow):
                patch = np.empty((c, kh, kw))
                for i in range(kh):
                    for j in range(kw):
                        patch[:, i, j] = xp[
                            example,
                            :,
                            p * stride[0] + i * dilation[0],
                            q * stride[1] + j * dilation[1],
                        ]
                rows.append(patch.ravel())
    return np.array(rows), oh * ow


def conv_factors(
    x, grad_out, kernel, stride, padding, dilation, bias, pad_mode="constant"
):
    """(A, G) of a Conv2d: patch rows and output-gradient rows divided by S."""
    rows, positions = conv_patch_rows(x, kernel, stride, padding, dilation, pad_mode)
    a_rows = with_bias_column(rows, bias) / positions
    g_rows = np.transpose(grad_out, (0, 2, 3, 1)).reshape(-1, grad_out.shape[1])
    return second_moment(a_rows), second_moment(g_rows / positions)


def eigen_preconditioned(grad, A, G, damping):
    """(G ⊗ A + λI)⁻¹ vec ∇, densely."""
    dense = np.kron(G, A) + damping * np.eye(A.shape[0] * G.shape[0])
    return np.linalg.solve(dense, grad.ravel()).reshape(grad.shape)


def inverse_preconditioned(grad, A, G, damping):
    """(G + λI)⁻¹ ∇ (A + λI)⁻¹."""
    a_inv = np.linalg.inv(A + damping * np.eye(len(A)))
    g_inv = np.linalg.inv(G + damping * np.eye(len(G)))
    return g_inv @ grad @ a_inv


def kl_clip_scale(preconditioned, grads, lr, kl_clip):
    """ν = min(1, √(κ / |Σ lr² ⟨P, ∇⟩|)), 1 for a zero sum."""
    total = abs(sum(float(np.sum(p * g)) for p, g in zip(preconditioned, grads)))
    total *= lr**2
    return 1.0 if total == 0 else min(1.0, np.sqrt(kl_clip / total))


# -- a whole K-FAC run (KAISA's step), for trajectory tests ------------------------


def layer_factors(kind, x, grad_out, bias, conv=None):
    """(A_batch, G_batch) of one layer from its input and output gradient.

    ``kind`` is 'linear' (leading axes are rows) or 'conv' (``conv`` = (kernel,
    stride, padding (top, bottom, left, right), dilation))."""
    x = np.asarray(x, dtype=np.float64)
    grad_out = np.asarray(grad_out, dtype=np.float64)
    if kind == "conv":
        return conv_factors(x, grad_out, *conv, bias)
    rows = with_bias_column(x.reshape(-1, x.shape[-1]), bias)
    return second_moment(rows), second_moment(grad_out.reshape(-1, grad_out.shape[-1]))


class KFACRun:
    """K-FAC as KAISA steps it, densely, for a list of layers.

    At step t (0-based count of ``step`` calls):

    1. if t % factor_update_steps == 0: F ← α F + (1 − α) F_batch for F = A, G,
       starting from F = I;
    2. if t % inv_update_steps == 0: remember A, G (and, with ``prediv``, the
       damping) as the layer's preconditioner;
    3. P = (G ⊗ A + λI)⁻¹ vec ∇ (eigen) or (G + λI)⁻¹ ∇ (A + λI)⁻¹ (inverse)
       with the remembered factors; λ is the damping of step 2 for the inverses
       and for eigen with ``prediv`` (both are computed there), the current one
       for eigen without;
    4. ν = min(1, √(κ / |Σ lr² ⟨P, ∇⟩|)) (no clip for κ = None); returns ν·P.
    """

    def __init__(self, count, method, prediv=True):
        self.method, self.prediv = method, prediv
        self.A = [None] * count
        self.G = [None] * count
        self.held = [None] * count
        self.steps = 0
        self.nus = []

    def step(
        self,
        batches,
        grads,
        *,
        factor_update_steps,
        inv_update_steps,
        damping,
        factor_decay,
        kl_clip,
        lr,
    ):
        """``batches``: per layer (A_batch, G_batch) (used on factor steps);
        ``grads``: per layer the (out, in [+1]) gradient matrix."""
        t = self.steps
        if t % factor_update_steps == 0:
            for i, (a, g) in enumerate(batches):
                for factors, new in ((self.A, a), (self.G, g)):
                    old = np.eye(len(new)) if factors[i] is None else factors[i]
                    factors[i] = factor_decay * old + (1 - factor_decay) * new
        if t % inv_update_steps == 0:
            self.held = [(a.copy(), g.copy(), damping) for a, g in zip(self.A, self.G)]
        out = []
        for (a, g, held_damping), grad in zip(self.held, grads):
            grad = np.asarray(grad, dtype=np.float64)
            if self.method == "eigen":
                lam = held_damping if self.prediv else damping
                out.append(eigen_preconditioned(grad, a, g, lam))
            else:
                out.append(inverse_preconditioned(grad, a, g, held_damping))
        nu = 1.0 if kl_clip is None else kl_clip_scale(out, grads, lr, kl_clip)
        self.nus.append(nu)
        self.steps += 1
        return [nu * p for p in out]
