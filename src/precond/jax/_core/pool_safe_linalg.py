"""Linear algebra that never waits on XLA:CPU's thread pool.

jaxlib 0.10 runs a batch of LAPACK problems (triangular solves, eigh, ...) on the
CPU in one call that hands pieces of the batch to XLA's intra-op thread pool and
blocks its own pool thread until they are done. When every thread of the pool
blocks so at once (two independent solves run side by side by XLA:CPU's
scheduler on a 2-core machine, or simulated devices whose threads wait in a
collective), nothing is left to run the pieces and the program hangs
(``docs/xla_cpu_deadlock_repro.py`` shows it with JAX alone). So precond's
programs make no batched LAPACK call:

* :func:`triangular_solve` emits XLA's own TriangularSolve operation on the
  CPU, which XLA expands into loops of matrix products inside the program:
  nothing waits on the pool, and batch axes are split over devices like any
  other (it is also several times faster than the LAPACK call there).
* :func:`eigh` and :func:`qr` map a batch one matrix at a time (``lax.map``)
  on the CPU: a LAPACK call on one matrix runs on its caller's thread.

Other backends get ``jax.lax.linalg``'s kernels unchanged, batched (the choice
is ``jax.lax.platform_dependent``'s, made when the program is lowered: the
compiler sees one branch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching, mlir

_solve_p = Primitive("precond_triangular_solve")


@jax.custom_batching.custom_vmap
def eigh(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``jnp.linalg.eigh`` of a symmetric (Hermitian) matrix; ``jax.vmap``
    batches it into a loop over the batch on the CPU, into one batched call
    elsewhere (module docstring).

    Args:
      matrix: one (n, n) symmetric matrix (its lower triangle is read).

    Returns:
      (eigenvalues ascending, (n,); eigenvectors as columns, (n, n)).
    """
    return _plain_eigh(matrix)


def _plain_eigh(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
    eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
    return eigenvalues, eigenvectors


@eigh.def_vmap
def _eigh_batched(axis_size, in_batched, matrices):
    del axis_size, in_batched  # one argument, batched: the rule is only called so
    decompositions = jax.lax.platform_dependent(
        matrices,
        cpu=functools.partial(jax.lax.map, eigh),
        default=jax.vmap(_plain_eigh),
    )
    return decompositions, (True, True)


@jax.custom_batching.custom_vmap
def qr(matrix: jax.Array) -> jax.Array:
    """The orthonormal factor Q of ``jnp.linalg.qr`` (Householder, R's diagonal
    of either sign); ``jax.vmap`` batches it as :func:`eigh`.

    Args:
      matrix: one (m, n) matrix, m >= n.

    Returns:
      Q, (m, n), with ``matrix = Q·R`` for an upper triangular R.
    """
    return _plain_q(matrix)


def _plain_q(matrix: jax.Array) -> jax.Array:
    return jnp.linalg.qr(matrix)[0]


@qr.def_vmap
def _qr_batched(axis_size, in_batched, matrices):
    del axis_size, in_batched  # as eigh's rule
    factors = jax.lax.platform_dependent(
        matrices,
        cpu=functools.partial(jax.lax.map, qr),
        default=jax.vmap(_plain_q),
    )
    return factors, True


def triangular_solve(
    a: jax.Array,
    b: jax.Array,
    *,
    left_side: bool,
    lower: bool,
    transpose_a: bool = False,
    conjugate_a: bool = False,
) -> jax.Array:
    """``jax.lax.linalg.triangular_solve`` without a diagonal of ones, computed
    inside the XLA program on the CPU (module docstring).

    Args:
      a: (..., m, m) triangular matrices (the other triangle is ignored).
      b: (..., m, n) right-hand sides if ``left_side``, else (..., n, m); the
        batch axes equal ``a``'s.
      left_side: solve op(a)·x = b if True, x·op(a) = b if False.
      lower: whether ``a`` is lower (True) or upper (False) triangular.
      transpose_a: op(a) is aᵀ (aᴴ with ``conjugate_a``) if True.
      conjugate_a: op(a) conjugates ``a`` (complex matrices).

    Returns:
      x, of ``b``'s shape and dtype.
    """
    if conjugate_a and not transpose_a:
        a = jnp.conj(a)
        conjugate_a = False
    transpose = "NO_TRANSPOSE"
    if transpose_a:
        transpose = "ADJOINT" if conjugate_a else "TRANSPOSE"
    return _solve_p.bind(a, b, left_side=left_side, lower=lower, transpose=transpose)


def _library_solve(a, b, *, left_side, lower, transpose):
    """The same solve through ``jax.lax.linalg`` (eager calls, other backends)."""
    return jax.lax.linalg.triangular_solve(
        a,
        b,
        left_side=left_side,
        lower=lower,
        transpose_a=transpose != "NO_TRANSPOSE",
        conjugate_a=transpose == "ADJOINT",
    )


def _abstract_eval(a, b, **_):
    return b.update(weak_type=False)


def _cpu_lowering(ctx, a, b, *, left_side, lower, transpose):
    del ctx
    return [
        stablehlo.triangular_solve(
            a,
            b,
            ir.BoolAttr.get(left_side),
            ir.BoolAttr.get(lower),
            ir.BoolAttr.get(False),  # unit_diagonal
            stablehlo.TransposeAttr.get(transpose),
        )
    ]


def _batch_rule(args, dims, **params):
    """Both operands batched along a leading axis (XLA's op takes equal batch
    axes; an unbatched operand is broadcast)."""
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    a, b = (batching.bdim_at_front(x, d, size) for x, d in zip(args, dims, strict=True))
    return _solve_p.bind(a, b, **params), 0


_solve_p.def_impl(_library_solve)
_solve_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[_solve_p] = _batch_rule
mlir.register_lowering(_solve_p, mlir.lower_fun(_library_solve, multiple_results=False))
mlir.register_lowering(_solve_p, _cpu_lowering, platform="cpu")
