"""Single-tensor kernels of PSGD Kron: arrays in, arrays out.

No pytrees, no optimizer state, no random number generation of their own:
callers pass the noise (and the key of the sampled norm bounds). Symbols follow
the PSGD papers (Li 2015, arXiv:1512.04202; Li 2018, arXiv:1809.10232):

* ``G``: gradient (or momentum) tensor of order k with dims d_1..d_k.
* ``Qs``: one factor per axis; a (d, d) upper-triangular matrix or a (d,) vector
  (a diagonal factor). The preconditioner is P = ⊗_i Q_iᵀQ_i.
* ``V``: standard normal noise with the shape of ``G``.
* ``X ×_i M``: mode-i product, multiplying the matrix M into axis i of X.

Complex tensors: every ᵀ above is the conjugate transpose ᴴ (P = ⊗_i Q_iᴴQ_i is
Hermitian positive definite, grams are X_(i)X_(i)ᴴ, solves use Q_i^{-H}, squares
are |x|²), V is circular complex normal with E|v|² = 1 (real and imaginary parts
N(0, 1/2), what ``jax.random.normal`` draws for a complex dtype: E[VVᴴ] = I as in
the real case, so every target and scale is unchanged), triangular factors keep a
real diagonal and the 'PRO' rotation is unitary. For real tensors every
conjugation is a no-op and the kernels are the real ones, bit for bit.

A *packed* triangular factor is a (d + 1, d) array holding Q in its upper triangle
(diagonal included), the strict lower triangle of P_i = Q_iᵀQ_i below it, and
diag(P_i) in its last row. It stores Q and the cached QᵀQ in about the memory of Q
alone, so steps that do not update the preconditioner skip recomputing QᵀQ.

Mirror: ``precond.torch._core.factor_kernels`` has the same kernels, with the
same names, argument names and order, and conventions
(tests/common/test_kron_kernels.py runs every kernel of both against the same
float64 references). Two differences, both the frameworks':

* Stacks. A JAX kernel sees one *unit* (one block; callers ``jax.vmap`` over a
  stack of equal-shaped units, ``STACK_AXES = 0``); a torch kernel takes every
  per-unit argument with a leading stack axis (``STACK_AXES = 1``: batched
  matmuls instead of a vmap). The torch kernel is this kernel vmapped over axis 0
  of its per-unit arguments; arguments shared by all units (axes, diagonal flags,
  step sizes, the style, whitening targets, ``draw``) carry no stack axis. Shapes
  in the docstrings are a unit's: a diagonal factor is a vector per unit
  (:func:`is_diagonal`).
* Randomness. ``rng`` is a PRNG key here and a ``torch.Generator`` (None: the
  global one) in torch; ``draw(rng, shape, dtype)`` here, ``draw(rng, shape,
  dtype, device)`` there (default :func:`normal_draw`). A key is used once, so
  'PRO' splits its key between the two sampled bounds of a factor, where a
  generator draws them in turn.

Only here: the complex-number helpers (:func:`is_complex`, :func:`complex_dtype`,
:func:`real_dtype`, :func:`conj`, :func:`conj_transpose`,
:func:`squared_magnitude`, :func:`hermitian_part`), which torch tensors have as
methods (``is_complex()``, ``conj()``, ``mH``, ``abs().square()``), and which
other JAX PSGD modules (XMat, LRA, Affine) import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from precond._common.kron_constants import (  # the styles both frameworks accept
    UPDATE_STYLES as UPDATE_STYLES,
)
from precond.jax._core import normal_draws
from precond.jax._core.pool_safe_linalg import triangular_solve

# Leading stack axes of a kernel's per-unit arguments: none, callers vmap (module
# doc; 1 in precond.torch._core.factor_kernels).
STACK_AXES = 0
# sqrt(float32 machine epsilon) = 2^-11.5: scale of the damping noise added to G.
DAMPING_SCALE = float(jnp.finfo(jnp.float32).eps) ** 0.5
# Added to step-size denominators so an all-zero gradient never divides by zero.
TINY = float(jnp.finfo(jnp.float32).tiny)


def is_complex(x: Any) -> bool:
    """Whether an array (or a dtype, or a ShapeDtypeStruct) is complex."""
    return jnp.issubdtype(getattr(x, "dtype", x), jnp.complexfloating)


def complex_dtype(dtype: Any) -> jnp.dtype:
    """The complex dtype holding ``dtype``'s precision: complex64 for float32 (and
    for bfloat16 and float16: there is no smaller complex type), complex128 for
    float64; complex dtypes are returned as they are."""
    return jnp.dtype(jnp.promote_types(dtype, jnp.complex64))


def real_dtype(dtype: Any) -> jnp.dtype:
    """The real dtype of ``dtype``'s entries (float32 for complex64)."""
    return jnp.dtype(jnp.finfo(dtype).dtype)


def conj(x: jax.Array) -> jax.Array:
    """x̄ (no operation at all on a real array)."""
    return jnp.conj(x) if is_complex(x) else x


def conj_transpose(M: jax.Array) -> jax.Array:
    """Mᴴ of a matrix (Mᵀ for a real one)."""
    return conj(M).T


def squared_magnitude(x: jax.Array) -> jax.Array:
    """|x|² elementwise, real: x·x for a real x, re² + im² for a complex one."""
    if is_complex(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return x * x


def hermitian_part(S: jax.Array) -> jax.Array:
    """(S + Sᴴ)/2 for a complex S (its diagonal exactly real); S if real."""
    if is_complex(S):
        return 0.5 * (S + conj_transpose(S))
    return S


def is_diagonal(factor: jax.Array) -> bool:
    """A factor is diagonal when it is stored as a vector (per unit)."""
    return factor.ndim == STACK_AXES + 1


def mode_product(X: jax.Array, M: jax.Array, axis: int) -> jax.Array:
    """X ×_axis M: ``M @ X`` along ``axis`` (M a (d', d) matrix), or ``M ⊙ X``."""
    if is_diagonal(M):
        shape = [1] * X.ndim
        shape[axis] = M.shape[0]
        return X * M.reshape(shape)
    return jnp.moveaxis(jnp.tensordot(M, X, axes=(1, axis)), 0, axis)


def apply_along_axes(factors: Sequence[jax.Array], X: jax.Array) -> jax.Array:
    """X ×_1 F_1 ×_2 F_2 … ×_k F_k for matrix or vector factors F_i."""
    for axis, F in enumerate(factors):
        X = mode_product(X, F, axis)
    return X


def unfold_gram(X: jax.Array, axis: int, diagonal: bool) -> jax.Array:
    """X_(i) X_(i)ᴴ: contracts every axis but ``axis`` (only the diagonal, real, if
    asked). Exactly Hermitian for a complex X."""
    others = tuple(a for a in range(X.ndim) if a != axis)
    if diagonal:
        return jnp.sum(squared_magnitude(X), axis=others)
    return hermitian_part(jnp.tensordot(X, conj(X), axes=(others, others)))


def solve_transposed_along_axis(Q: jax.Array, X: jax.Array, axis: int) -> jax.Array:
    """X ×_axis Q^{-T} (Q^{-H} if complex) for an upper-triangular Q (a vector Q
    divides)."""
    if is_diagonal(Q):
        shape = [1] * X.ndim
        shape[axis] = Q.shape[0]
        return X / conj(Q).reshape(shape)
    moved = jnp.moveaxis(X, axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    # Row-vector form of Q^{-H} x: solve y Q̄ = xᵀ for y.
    solved = triangular_solve(
        Q, rows, left_side=False, lower=False, conjugate_a=is_complex(Q)
    )
    return jnp.moveaxis(solved.reshape(moved.shape), -1, axis)


def norm_lower_bound(S: jax.Array) -> jax.Array:
    """A cheap lower bound on the spectral norm ‖S‖₂ of a square matrix S.

    With s = max|S|, Ŝ = S/s and x the column of Ŝ with the largest norm,
    returns s·‖Ŝ Ŝᴴ x‖/‖Ŝᴴ x‖ (two steps of power iteration on ŜŜᴴ from x). It
    satisfies ‖S‖_F/√d ≤ max column norm ≤ bound ≤ ‖S‖₂, so it is within a factor
    √d of the spectral norm, and much closer in practice. Returns 0 for S = 0.
    The bound is real (of S's real dtype) for a complex S.
    """
    scale = jnp.max(jnp.abs(S))
    safe_scale = jnp.where(scale > 0, scale, 1)
    S_hat = S / safe_scale
    column = jnp.argmax(jnp.sum(squared_magnitude(S_hat), axis=0))
    x = jax.lax.dynamic_index_in_dim(S_hat, column, axis=1, keepdims=False)
    y = conj(x) @ S_hat  # conj(Ŝᴴx)
    y_norm = jnp.linalg.norm(y)
    y = y / jnp.where(y_norm > 0, y_norm, 1)
    bound = safe_scale * jnp.linalg.norm(y @ conj_transpose(S_hat))
    return jnp.where(scale > 0, bound, 0).astype(real_dtype(S.dtype))


def normal_draw(rng: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
    """N(0, I) of ``shape`` from the key ``rng`` (the default ``draw`` of the
    sampled norm bounds; tests inject their own)."""
    return normal_draws.standard_normal(rng, shape, dtype)


def sampled_norm_lower_bound(
    S: jax.Array,
    rng: jax.Array,
    draw: Callable | None = None,
    vectors: int = 32,
    iterations: int = 2,
) -> jax.Array:
    """A lower bound on ‖S‖₂ of a real square S from sampled power iterations
    (tighter than :func:`norm_lower_bound`, at the cost of a (k, d) draw).

    s = max|S|, Ŝ = S/s, x = the row of Ŝ with the largest norm. Each of k start
    vectors is x + sign(⟨x, w⟩)·w with w ~ N(0, I) (so it leans toward x); each
    iteration maps v ↦ Ŝᵀ(Ŝᵀv/‖Ŝᵀv‖) (row vectors: v ↦ (vŜ/‖vŜ‖)Ŝ). Returns
    s·max_k‖v_k‖, the largest of k Rayleigh-type lower bounds (the bound is
    exactly what distributed-kron 2.0's generation-2 rule estimates). ``draw(rng,
    shape, dtype)`` draws w (default :func:`normal_draw`).
    """
    scale = jnp.max(jnp.abs(S)) + TINY
    S_hat = S / scale
    row = jnp.argmax(jnp.sum(S_hat * S_hat, axis=1))
    x = jax.lax.dynamic_index_in_dim(S_hat, row, axis=0, keepdims=False)
    W = (draw or normal_draw)(rng, (vectors, S.shape[1]), S.dtype)
    V = x + jnp.sign(jnp.sum(x * W, axis=1, keepdims=True)) * W
    for _ in range(iterations):
        V = V @ S_hat
        V = V / (jnp.linalg.norm(V, axis=1, keepdims=True) + TINY)
        V = V @ S_hat
    return scale * jnp.max(jnp.linalg.norm(V, axis=1))


def add_damping_noise(
    G: jax.Array, V: jax.Array, valid_count: jax.Array | int | None = None
) -> jax.Array:
    """G̃ = G + sqrt(ε_f32)·mean|G|·V (|G| the modulus for a complex G).

    The noise keeps the fit well posed when G is tiny or rank deficient. For a
    zero-padded block, pass the number of real entries as ``valid_count`` so the
    mean ignores the padding.
    """
    count = G.size if valid_count is None else valid_count
    return G + DAMPING_SCALE * (jnp.sum(jnp.abs(G)) / count).astype(G.dtype) * V


def update_factors(
    Qs: Sequence[jax.Array],
    G: jax.Array,
    V: jax.Array | None,
    preconditioner_lr: jax.Array | float,
    *,
    step_normalizer_order: str = "2nd",
    noise_grams: Sequence[jax.Array] | None = None,
) -> list[jax.Array]:
    """One PSGD step on the Kronecker factors, fitting P = ⊗ Q_iᵀQ_i to the pair (G, V).

    A = G ×_1 Q_1 … ×_k Q_k and B = V ×_1 Q_1^{-T} … ×_k Q_k^{-T}. For each axis i,
    with T1 = A_(i)A_(i)ᵀ and T2 = B_(i)B_(i)ᵀ (only their diagonals for a
    diagonal factor), every factor is moved from the same A and B:

        triangular: Q_i ← Q_i − η / (lb(T1 + T2) + tiny) · triu(T1 − T2) · Q_i
        diagonal:   q_i ← q_i − η / (max|T1 + T2| + tiny) · (T1 − T2) ⊙ q_i

    where lb is :func:`norm_lower_bound`. The fixed point E[T1] = E[T2] makes
    P ≈ E[GGᵀ]^{-1/2} (whitening, V independent noise) or P ≈ H^{-1} (Newton,
    G = H·V) in the Kronecker-factored sense. ``G`` should already carry any
    damping noise (:func:`add_damping_noise`). Factors must be unpacked.

    Args:
        step_normalizer_order: '2nd' (above) or '1st': the step is normalised by
            the gradient instead, η / (lb(triu(T1 − T2)) + tiny) (diagonal:
            η / (max|T1 − T2| + tiny)).
        noise_grams: per axis, a given T2 (a matrix, or the diagonal vector for a
            diagonal factor) used instead of the one from V, e.g. E[T2] with V
            integrated out (PSGD Affine); ``V`` is then not used and may be None.
    """
    A = apply_along_axes(Qs, G)
    B = V
    if noise_grams is None:
        assert B is not None  # V is used unless noise_grams are given
        for axis, Q in enumerate(Qs):
            B = solve_transposed_along_axis(Q, B, axis)
    first_order = step_normalizer_order == "1st"
    new_Qs = []
    for axis, Q in enumerate(Qs):
        diagonal = is_diagonal(Q)
        T1 = unfold_gram(A, axis, diagonal)
        if noise_grams is None:
            assert B is not None
            T2 = unfold_gram(B, axis, diagonal)
        else:
            T2 = noise_grams[axis]
        if diagonal:
            normalizer = jnp.abs(T1 - T2) if first_order else jnp.abs(T1 + T2)
            step = preconditioner_lr / (jnp.max(normalizer) + TINY)
            new_Qs.append(Q - step * (T1 - T2) * Q)
        else:
            gradient = jnp.triu(T1 - T2)
            normalizer = gradient if first_order else T1 + T2
            step = preconditioner_lr / (norm_lower_bound(normalizer) + TINY)
            new_Qs.append(Q - step * (gradient @ Q))
    return new_Qs


def balance_factors(
    Qs: Sequence[jax.Array], valid: Sequence[jax.Array] | None = None
) -> list[jax.Array]:
    """Rescales factors to equal max-abs norms without changing ⊗ Q_iᵀQ_i.

    With n_i = max|Q_i| and γ = (∏ n_i)^{1/k}: Q_i ← Q_i·γ/n_i. Prevents one factor
    from growing while another shrinks until they under- or overflow. ``valid``
    (one boolean vector per axis) restricts the norms to the real rows and columns
    of a zero-padded block.
    """
    norms = []
    for i, Q in enumerate(Qs):
        magnitude = jnp.abs(Q)
        if valid is not None:
            mask = valid[i] if is_diagonal(Q) else valid[i][:, None] & valid[i][None, :]
            magnitude = jnp.where(mask, magnitude, 0)
        norms.append(jnp.max(magnitude))
    norms = jnp.stack(norms)
    safe = jnp.where(norms > 0, norms, 1)
    gamma = jnp.exp(jnp.mean(jnp.log(safe)))
    return [Q * (gamma / safe[i]).astype(Q.dtype) for i, Q in enumerate(Qs)]


def factor_gram(Q: jax.Array) -> jax.Array:
    """P_i = Q_iᵀQ_i (Q_iᴴQ_i) for a matrix factor, q_i² (|q_i|²) for a diagonal
    one."""
    if is_diagonal(Q):
        return conj(Q) * Q
    return hermitian_part(conj_transpose(Q) @ Q)


def precondition(Qs: Sequence[jax.Array], G: jax.Array) -> jax.Array:
    """U = P·G = G ×_1 Q_1ᵀQ_1 … ×_k Q_kᵀQ_k, applying Q_i then Q_iᵀ (Q_iᴴ) per
    axis."""
    for axis, Q in enumerate(Qs):
        G = mode_product(G, Q, axis)
        G = mode_product(G, conj(Q) if is_diagonal(Q) else conj_transpose(Q), axis)
    return G


def precondition_with_grams(Ps: Sequence[jax.Array], G: jax.Array) -> jax.Array:
    """U = G ×_1 P_1 … ×_k P_k with precomputed (symmetric or Hermitian)
    P_i = Q_iᵀQ_i."""
    return apply_along_axes(Ps, G)


def pack_factor(Q: jax.Array) -> jax.Array:
    """Packs upper-triangular Q and P = QᵀQ (QᴴQ) into one (d + 1, d) array (module
    doc)."""
    P = factor_gram(Q)
    body = jnp.triu(Q) + jnp.tril(P, -1)
    return jnp.concatenate([body, jnp.diagonal(P)[None, :]], axis=0)


def unpack_factor(packed: jax.Array) -> jax.Array:
    """The triangular Q stored in a packed factor."""
    return jnp.triu(packed[:-1])


def unpack_gram(packed: jax.Array) -> jax.Array:
    """The symmetric (Hermitian) P = QᵀQ stored in a packed factor."""
    strict_lower = jnp.tril(packed[:-1], -1)
    return strict_lower + conj_transpose(strict_lower) + jnp.diag(packed[-1])


# Smoothing β_L of the Lipschitz estimates L_i of the generation-2 rules.
LIPSCHITZ_DECAY = 0.95
# The Procrustes rotation step is at most this (its series is second order).
MAX_PROCRUSTES_STEP = 0.125


def whitening_targets(valid: Sequence[jax.Array], diagonal: Sequence[bool]):
    """E[V_(i)V_(i)ᵀ] for V ~ N(0, I) on the real entries of a zero-padded block:
    c_i·diag(valid_i), c_i = ∏_{j≠i} (number of real entries of axis j), in
    float32; vectors for diagonal factors, matrices otherwise. ``valid``: one
    boolean vector per axis (all True for a block without padding)."""
    counts = [jnp.sum(v.astype(jnp.float32)) for v in valid]
    targets = []
    for i, (v, diag) in enumerate(zip(valid, diagonal, strict=True)):
        c = 1.0  # ∏_{j≠i} counts[j], multiplied in order
        for j, count in enumerate(counts):
            if j != i:
                c = c * count
        t = c * v.astype(jnp.float32)
        targets.append(t if diag else jnp.diag(t))
    return targets


def procrustes_step(
    Q: jax.Array, rng: jax.Array | None = None, draw: Callable | None = None
) -> jax.Array:
    """Rotates Q toward the symmetric positive semi-definite polar factor of QᵀQ.

    R = Qᵀ − Q (skew), normalised by a lower bound of ‖R‖₂; the rotation
    exp(aR)·Q ≈ Q + aRQ + (a²/2)R²Q with a maximising tr(exp(aR)Q) to second
    order, a = min(−tr(RQ)/tr(R²Q), 1/8) when tr(R²Q) < 0, else 1/8. It leaves
    P = QᵀQ unchanged to second order in a. Complex Q: R = Qᴴ − Q is
    skew-Hermitian, exp(aR) unitary, and the traces are their real parts (a
    maximises Re tr(exp(aR)Q), the pull toward the Hermitian polar factor).
    With a key ``rng``, ‖R‖₂ is bounded by :func:`sampled_norm_lower_bound`
    instead (``draw``: its normal draws).
    """
    R = conj_transpose(Q) - Q
    if rng is None:
        bound = norm_lower_bound(R)
    else:
        bound = sampled_norm_lower_bound(R, rng, draw)
    R = R / (bound + TINY)
    RQ = R @ Q
    RRQ = R @ RQ
    tr_RQ, tr_RRQ = jnp.real(jnp.trace(RQ)), jnp.real(jnp.trace(RRQ))
    a = jnp.where(
        tr_RRQ < 0,
        jnp.minimum(-tr_RQ / jnp.where(tr_RRQ < 0, tr_RRQ, -1), MAX_PROCRUSTES_STEP),
        MAX_PROCRUSTES_STEP,
    )
    return Q + a * RQ + (0.5 * a * a) * RRQ


def update_factors_gen2(
    Qs: Sequence[jax.Array],
    lipschitz: Sequence[jax.Array],
    G: jax.Array,
    targets: Sequence[jax.Array],
    preconditioner_lr: jax.Array | float,
    style: str,
    rngs: Sequence[jax.Array | None] | None = None,
    draw: Callable | None = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """One generation-2 PSGD step ('QUAD', 'PRO' or 'QEQ'), fitting P = ⊗ Q_iᵀQ_i
    with no triangular solves.

    With Pg = P·G (current factors) and, per axis i, T1 = Pg_(i)Pg_(i)ᵀ and the
    target T2 (E[V_(i)V_(i)ᵀ] in whitening, see :func:`whitening_targets`; the
    sample V_(i)V_(i)ᵀ of the Newton vector), the fixed point T1 = T2 makes
    P·E[GGᵀ]·P = I (whitening) or P = H⁻¹ (Newton). The step size is normalised by
    a smoothed Lipschitz estimate ℓ = lb(T1) + lb(T2) (max for diagonal factors),
    L_i ← max(β_L·L_i + (1 − β_L)·ℓ, ℓ), μ = η/L_i:

        PRO:  Q ← Q − μ(T1 − T2)Q, then :func:`procrustes_step`;
              q ← q⊙(1 − μ(T1 − T2)) for a diagonal factor.
        QEQ:  Q ← Q − μQ(T1 − T2), so that P_i = Q_iᴴQ_i ← (I − μE)P_i(I − μE)
              with E = T1 − T2 whatever Q is: no rotation is needed to keep
              the step symmetric in P (one d³ product where PRO takes three);
              q ← q⊙(1 − μ(T1 − T2)) for a diagonal factor.
        QUAD: Q' = Q − (μ/2)(T1 − T2)Q, Q'' = Q' − (μ/2)Q'(T1 − T2),
              Q ← (Q'' + Q''ᵀ)/2 (Q stays symmetric; Hermitian if complex);
              q ← q⊙(1 − (μ/2)(T1 − T2))² for a diagonal factor.

    ``G`` should already carry its damping noise. ``rngs`` (one key or None per
    factor, used by matrix factors; real tensors): lb(T1) is
    :func:`sampled_norm_lower_bound` instead, and for 'PRO' the key is split
    between it and the rotation's bound (``draw``: their normal draws, see there).
    Returns the new factors and L_i.
    """
    Pg = precondition(Qs, G)
    rngs = [None] * len(Qs) if rngs is None else rngs
    new_Qs, new_L = [], []
    for axis, (Q, L, T2, rng) in enumerate(
        zip(Qs, lipschitz, targets, rngs, strict=True)
    ):
        diagonal = is_diagonal(Q)
        T1 = unfold_gram(Pg, axis, diagonal)
        T2 = T2.astype(T1.dtype)
        rotation_rng = None
        if diagonal:
            ell = jnp.max(T1) + jnp.max(T2)
        elif rng is None:
            ell = norm_lower_bound(T1) + norm_lower_bound(T2)
        else:
            if style == "PRO":
                rng, rotation_rng = jax.random.split(rng)
            ell = sampled_norm_lower_bound(T1, rng, draw) + norm_lower_bound(T2)
        L = jnp.maximum(LIPSCHITZ_DECAY * L + (1 - LIPSCHITZ_DECAY) * ell, ell)
        mu = preconditioner_lr / (L + TINY)
        E = T1 - T2
        if diagonal:
            gain = 1 - (0.5 * mu if style == "QUAD" else mu) * E
            Q = Q * (gain * gain if style == "QUAD" else gain)
        elif style == "PRO":
            Q = procrustes_step(Q - mu * (E @ Q), rotation_rng, draw)
        elif style == "QEQ":
            Q = Q - mu * (Q @ E)
        else:
            Q = Q - (0.5 * mu) * (E @ Q)
            Q = Q - (0.5 * mu) * (Q @ E)
            Q = 0.5 * (Q + conj_transpose(Q))
        new_Qs.append(Q)
        new_L.append(L.astype(jnp.asarray(lipschitz[axis]).dtype))
    return new_Qs, new_L


def add_relative_damping_noise(
    G: jax.Array, V: jax.Array, floor: float | jax.Array = 1e-9
) -> jax.Array:
    """G̃ = G + (δ + ε·|G|)⊙V with δ = ``floor`` and ε the machine epsilon of G's
    dtype (of its real part for a complex G): the generation-2 rules'
    elementwise damping (V zero on padding)."""
    return G + (floor + jnp.finfo(G.dtype).eps * jnp.abs(G)) * V
