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
