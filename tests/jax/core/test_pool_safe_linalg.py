"""precond.jax._core.pool_safe_linalg against float64 references, batched any way,
and the property it exists for: no optimizer's program makes a batched LAPACK
call (jaxlib 0.10 splits those over XLA:CPU's pool and can hang,
tests/jax/test_no_hang.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precond.jax as pj
from precond.jax._core.pool_safe_linalg import eigh, qr, triangular_solve


def _upper(rng, shape, dtype):
    n = shape[-1]
    a = np.triu(rng.standard_normal(shape)) + 4 * np.eye(n)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * np.triu(rng.standard_normal(shape), 1)
    return a.astype(dtype)


def _reference_solve(a, b, left_side, transpose, conjugate):
    """x with op(a)·x = b (left) or x·op(a) = b, in complex128."""
    a = np.asarray(a, np.complex128)
    b = np.asarray(b, np.complex128)
    op = np.conj(a) if conjugate else a
    op = np.swapaxes(op, -1, -2) if transpose else op
    if left_side:
        return np.linalg.solve(op, b)
    return np.swapaxes(
        np.linalg.solve(np.swapaxes(op, -1, -2), np.swapaxes(b, -1, -2)), -1, -2
    )


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("left_side", [True, False])
@pytest.mark.parametrize(
    ("transpose", "conjugate"),
    [(False, False), (True, False), (True, True), (False, True)],
)
def test_triangular_solve_equals_the_float64_reference(
    dtype, left_side, transpose, conjugate
):
    rng = np.random.default_rng(0)
    a = _upper(rng, (3, 6, 6), dtype)
    b = rng.standard_normal((3, 6, 4) if left_side else (3, 4, 6)).astype(dtype)
    expected = _reference_solve(a, b, left_side, transpose, conjugate)
    with jax.enable_x64(True):

        def solve(a, b):
            return triangular_solve(
                a,
                b,
                left_side=left_side,
                lower=False,
                transpose_a=transpose,
                conjugate_a=conjugate,
            )

        batched = jax.jit(jax.vmap(solve))(a, b)
        one = jax.jit(solve)(a[0], b[0])
        eager = solve(a[1], b[1])
    np.testing.assert_allclose(batched, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(one, expected[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(eager, expected[1], rtol=1e-12, atol=1e-12)


def test_triangular_solve_batches_any_way():
    """Nested vmaps, and an operand shared by the batch (broadcast)."""
    rng = np.random.default_rng(1)
    a = _upper(rng, (2, 3, 5, 5), np.float64)
    b = rng.standard_normal((2, 3, 4, 5))
    expected = _reference_solve(a, b, False, False, False).real
    with jax.enable_x64(True):

        def solve(a, b):
            return triangular_solve(a, b, left_side=False, lower=False)

        nested = jax.jit(jax.vmap(jax.vmap(solve)))(a, b)
        shared = jax.jit(jax.vmap(solve, in_axes=(None, 0)))(a[0, 0], b[0])
    np.testing.assert_allclose(nested, expected, rtol=1e-12)
    np.testing.assert_allclose(
        shared, _reference_solve(a[0, 0], b[0], False, False, False).real, rtol=1e-12
    )


def test_eigh_batched_equals_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 6, 6))
    matrices = x @ np.swapaxes(x, -1, -2)
    with jax.enable_x64(True):
        values, vectors = jax.jit(jax.vmap(jax.vmap(eigh)))(matrices)
    values, vectors = np.asarray(values), np.asarray(vectors)
    np.testing.assert_allclose(values, np.linalg.eigvalsh(matrices), rtol=1e-12)
    rebuilt = (vectors * values[..., None, :]) @ np.swapaxes(vectors, -1, -2)
    np.testing.assert_allclose(rebuilt, matrices, rtol=1e-10, atol=1e-10)


def test_qr_batched_equals_numpy():
    """Q of a nested batch, one matrix at a time: orthonormal, and Q·R = A with
    R = QᵀA upper triangular (Q is unique up to its columns' signs)."""
    rng = np.random.default_rng(3)
    matrices = rng.standard_normal((2, 3, 6, 6))
    with jax.enable_x64(True):
        q = np.asarray(jax.jit(jax.vmap(jax.vmap(qr)))(matrices))
    eye = np.broadcast_to(np.eye(6), q.shape)
    np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, eye, atol=1e-12)
    r = np.swapaxes(q, -1, -2) @ matrices
    np.testing.assert_allclose(np.tril(r, -1), 0.0, atol=1e-12)
    want = np.linalg.qr(matrices)[0]
    np.testing.assert_allclose(np.abs(q), np.abs(want), atol=1e-10)


# A solver call (jaxlib's FFI: lapack_ssyevd_ffi, cusolver_geqrf_ffi, ...), its
# library and the number of batch axes it was given.
SOLVER_CALL = re.compile(r'@(lapack|cusolver)_\w+?_ffi\(.*num_batch_dims = "(\d+)"')


def _exported(kernel, platform: str) -> str:
    """The StableHLO of ``kernel`` vmapped over 3 matrices, exported for
    ``platform`` (no device of it needed)."""
    exported = jax.export.export(jax.jit(jax.vmap(kernel)), platforms=[platform])
    return exported(jnp.ones((3, 4, 4))).mlir_module()


@pytest.mark.parametrize("kernel", [eigh, qr], ids=["eigh", "qr"])
def test_batches_loop_on_the_cpu_only(kernel):
    """Batched, the CPU program loops over the matrices and hands LAPACK one at
    a time; the GPU program is jax's kernel on the whole batch, no loop."""
    cpu, gpu = _exported(kernel, "cpu"), _exported(kernel, "cuda")
    assert "stablehlo.while" in cpu
    assert {call for call in SOLVER_CALL.findall(cpu)} == {("lapack", "0")}
    assert "stablehlo.while" not in gpu
    assert {call for call in SOLVER_CALL.findall(gpu)} == {("cusolver", "1")}


# A stack of equal-shaped layers, so that every optimizer vmaps its kernels.
PARAMS = {
    "w": jnp.ones((4, 24, 24)) + jnp.eye(24),
    "v": jnp.ones((4, 24, 24)) - jnp.eye(24),
    "b": jnp.ones(24),
}
OPTIMIZERS = {
    "kron": lambda: pj.kron(1e-3, preconditioner_update_probability=1.0),
    "pro": lambda: pj.pro(1e-3),
    "affine": lambda: pj.affine(1e-3),
    "shampoo-eigh": lambda: pj.distributed_shampoo(1e-3, block_size=8, eigh=True),
    "soap": lambda: pj.soap(1e-3, block_size=8),
}
# The optimizers whose programs make LAPACK calls (one matrix at a time).
WITH_LAPACK = ("shampoo-eigh", "soap")
# A LAPACK call through jaxlib's FFI (lapack_strsm_ffi, lapack_ssyevd_ffi, ...)
# and the number of batch axes it was given.
LAPACK_CALL = re.compile(r'@lapack_(\w+?)_ffi\(.*num_batch_dims = "(\d+)"')


def _lapack_calls(name: str) -> list[tuple[str, str]]:
    """(routine, batch axes) of each LAPACK call in ``name``'s update."""
    tx = OPTIMIZERS[name]()
    state = tx.init(PARAMS)

    def step(grads, state):
        return tx.update(grads, state, PARAMS)

    grads = jax.tree.map(lambda x: 0.1 * x, PARAMS)
    text = jax.jit(step).lower(grads, state).as_text()
    return LAPACK_CALL.findall(text)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_no_batched_lapack_call(name):
    """Every LAPACK call left (Shampoo's eigh, SOAP's eigh and QR, one matrix at
    a time) takes one matrix, where jaxlib's batch splitting has nothing to
    split; the check sees the calls."""
    calls = _lapack_calls(name)
    assert all(batch_axes == "0" for _, batch_axes in calls), calls
    assert bool(calls) == (name in WITH_LAPACK), calls
