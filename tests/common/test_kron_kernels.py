"""One table: every PSGD Kron kernel of precond.jax and precond.torch against the
same float64 NumPy reference (tests/reference/kron_reference.py).

Each row is a kernel name and float64 inputs built once in NumPy for a stack of
``UNITS`` units. The two kernel modules are mirrors (their module docstrings): a
JAX kernel sees one unit, so it runs ``jax.vmap``-ed over axis 0 of the per-unit
arguments; the torch kernel takes the stack as it is. Both must equal the
reference applied to each unit, and each other, to 1e-12 relative to the largest
entry (they differ only by float64 rounding: summation orders, batched versus
single matmuls, triangular solves versus explicit inverses of well-conditioned
factors). Random kernels get their normal draws injected (the same W for both
frameworks and the reference), so they are compared by value too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable

import numpy as np
import pytest

from tests.reference import kron_reference as ref

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
jnp = jax.numpy

from precond.jax._core import factor_kernels as jkm  # noqa: E402
from precond.torch._core import factor_kernels as tkm  # noqa: E402

# Frameworks and references differ only by float64 rounding of O(1) quantities.
RTOL = 1e-12
UNITS = 2
LR = 0.1
# JAX-only helpers (precond.jax._core.factor_kernels's docstring says why).
JAX_ONLY = {
    "is_complex",
    "complex_dtype",
    "real_dtype",
    "conj",
    "conj_transpose",
    "squared_magnitude",
    "hermitian_part",
}
SHAPES = [(7,), (5, 4), (3, 4, 2)]
CASES = [
    (shape, mask)
    for shape in SHAPES
    for mask in itertools.product([True, False], repeat=len(shape))
] + [
    ((2, 3, 4, 3), mask)
    for mask in (
        (False,) * 4,
        (True,) * 4,
        (False, True, False, False),
        (True, False, True, False),
    )
]


@pytest.fixture(scope="module", autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


class Rng:
    """A per-unit random source: stacked PRNG keys (JAX), one generator (torch)."""


@dataclasses.dataclass
class Draws:
    """Injected normal draws: the n-th draw of a call is ``ws[n]`` (k, d), for
    every unit (torch asks for the stack (B, k, d), JAX for one unit)."""

    ws: list


@dataclasses.dataclass
class Row:
    """``kernel(*args, **kwargs, **mapped)``; ``stacked[i]`` says whether args[i]
    has the leading unit axis (``kwargs`` never do, ``mapped`` always do);
    ``reference(*unit_args, **unit_mapped)`` is one unit's expected output, or
    ``want`` the stacked expected output itself."""

    kernel: str
    args: list
    stacked: list
    reference: Callable | None = None
    kwargs: dict = dataclasses.field(default_factory=dict)
    label: str = ""
    mapped: dict = dataclasses.field(default_factory=dict)
    want: object = None
    case: str = ""

    def __str__(self):
        return "-".join(x for x in (self.kernel, self.case, self.label) if x)


# --- inputs --------------------------------------------------------------------


def random_triangular(rng, d):
    """Upper-triangular Q with a positive diagonal in [0.5, 2] (condition ≲ 10)."""
    Q = np.triu(rng.standard_normal((d, d))) * 0.3
    Q[np.diag_indices(d)] = rng.uniform(0.5, 2.0, d)
    return Q


def random_factor(rng, d, diagonal, dense=False):
    """A diagonal vector, an upper-triangular Q, or (``dense``) a general Q ≈ s·I."""
    if diagonal:
        return rng.uniform(0.5, 2.0, d)
    if dense:
        return np.eye(d) * rng.uniform(0.8, 1.5) + 0.2 * rng.standard_normal((d, d))
    return random_triangular(rng, d)


def stacked_factors(rng, shape, mask, dense=False):
    """One (UNITS, …) stack per axis."""
    return [
        np.stack([random_factor(rng, d, m, dense) for _ in range(UNITS)])
        for d, m in zip(shape, mask, strict=True)
    ]


def stacked_normal(rng, shape, scale=1.0):
    return rng.standard_normal((UNITS, *shape)) * scale


def hermitian(Q):
    """(Q + Qᴴ)/2 of each stacked matrix (vectors as they are)."""
    return Q if Q.ndim == 2 else (Q + np.swapaxes(Q, -1, -2).conj()) / 2


def stored_gram(Q):
    """A factor's gram as the kernels store it: |q|² for a diagonal factor."""
    return np.abs(Q) ** 2 if Q.ndim == 1 else ref.factor_gram(Q)


def draws_for(shape, mask, count_per_factor):
    """W (32, d) for each triangular factor's sampled bounds, in call order."""
    rng = np.random.default_rng(99)
    return [
        rng.standard_normal((32, d))
        for d, m in zip(shape, mask, strict=True)
        if not m
        for _ in range(count_per_factor)
    ]


# --- rows ------------------------------------------------------------------------


def axis_rows(shape, mask, seed):
    """Kernels of one axis: mode products, solves, unfoldings, factor grams."""
    rng = np.random.default_rng(seed)
    Qs, X = stacked_factors(rng, shape, mask), stacked_normal(rng, shape)
    rows = []
    for axis, (Q, m) in enumerate(zip(Qs, mask, strict=True)):
        rows += [
            Row("mode_product", [X, Q, axis], [1, 1, 0], ref.mode_product),
            Row(
                "solve_transposed_along_axis",
                [Q, X, axis],
                [1, 1, 0],
                ref.solve_transposed_along_axis,
            ),
            Row("unfold_gram", [X, axis, m], [1, 0, 0], ref.unfold_gram),
            Row("factor_gram", [Q], [1], stored_gram),
        ]
    return rows


def factor_rows(shape, mask, seed, complex_=False):
    """Kernels of all the factors of one case (generation 1)."""
    rng = np.random.default_rng(seed)
    Qs = stacked_factors(rng, shape, mask)
    G, V = stacked_normal(rng, shape, 3.0), stacked_normal(rng, shape)
    if complex_:  # triangular factors get a complex strict upper triangle
        Qs = [
            Q if Q.ndim == 2 else Q + 0.3j * np.triu(rng.standard_normal(Q.shape), 1)
            for Q in Qs
        ]
        G = G + 1j * stacked_normal(rng, shape, 3.0)
        V = (V + 1j * stacked_normal(rng, shape)) / np.sqrt(2)
    grams = [np.stack([stored_gram(q) for q in Q]) for Q in Qs]
    spread = [Q * 10.0 ** (axis - 1) for axis, Q in enumerate(Qs)]
    noise_grams = [
        np.stack([ref.unfold_gram(v, axis, m) for v in V])
        for axis, m in enumerate(mask)
    ]
    factors_ref = functools.partial(ref.update_factors, lr=LR)
    return [
        Row(
            "apply_along_axes",
            [Qs, G],
            [1, 1],
            lambda Qs, G: ref.apply_kron([ref.factor_matrix(Q) for Q in Qs], G),
        ),
        Row("precondition", [Qs, G], [1, 1], ref.precondition),
        Row(
            "precondition_with_grams",
            [grams, G],
            [1, 1],
            lambda Ps, G: ref.apply_kron([ref.factor_matrix(P) for P in Ps], G),
        ),
        Row("add_damping_noise", [G, V], [1, 1], ref.add_damping_noise),
        Row("update_factors", [Qs, G, V, LR], [1, 1, 1, 0], ref.update_factors),
        Row(
            "update_factors",
            [Qs, G, V, LR],
            [1, 1, 1, 0],
            lambda Qs, G, V, lr: factors_ref(Qs, G, V, step_normalizer_order="1st"),
            {"step_normalizer_order": "1st"},
            "1st",
        ),
        Row(
            "update_factors",
            [Qs, G, None, LR],
            [1, 1, 0, 0],
            lambda Qs, G, V, lr, noise_grams: factors_ref(
                Qs, G, None, noise_grams=noise_grams
            ),
            label="noise_grams",
            mapped={"noise_grams": noise_grams},
        ),
        Row("balance_factors", [spread], [1], ref.balance_factors),
        *gen2_rows(shape, mask, seed, G),
    ]


def noise_and_padding_rows(shape, mask, seed):
    """The zero-padding arguments: damping mean over the real entries, balancing
    norms over the real rows and columns."""
    rng = np.random.default_rng(seed)
    Qs = [
        Q * 10.0 ** (axis - 1)
        for axis, Q in enumerate(stacked_factors(rng, shape, mask))
    ]
    valid = [np.arange(d) < max(d - 1, 1) for d in shape]
    G, V = stacked_normal(rng, shape), stacked_normal(rng, shape)
    count = int(np.prod([v.sum() for v in valid]))
    return [
        Row(
            "add_damping_noise",
            [G, V, count],
            [1, 1, 0],
            ref.add_damping_noise,
            label="valid_count",
        ),
        Row(
            "balance_factors",
            [Qs, valid],
            [1, 0],
            ref.balance_factors,
            label="valid",
        ),
        Row(
            "add_relative_damping_noise",
            [G, V, 1e-3],
            [1, 1, 0],
            lambda G, V, floor: ref.add_relative_damping_noise(
                G, V, floor, float(np.finfo(np.float64).eps)
            ),
        ),
    ]


def gen2_rows(shape, mask, seed, G):
    """'QUAD', 'PRO' and 'QEQ' fits, with and without sampled bounds."""
    rows = []
    for style in ("QUAD", "PRO", "QEQ"):
        rng = np.random.default_rng(seed + 1)
        Qs = stacked_factors(rng, shape, mask, dense=True)
        if np.iscomplexobj(G):
            Qs = [
                Q if Q.ndim == 2 else Q + 0.2j * rng.standard_normal(Q.shape)
                for Q in Qs
            ]
        if style == "QUAD":
            Qs = [hermitian(Q) for Q in Qs]
        lipschitz = [
            np.full(UNITS, 0.0 if i % 2 == 0 else 1e3) for i in range(len(shape))
        ]
        valid = [np.ones(d, bool) for d in shape]
        targets = ref.whitening_targets(valid, mask)
        args = [Qs, lipschitz, G, targets, 0.5, style]

        def reference(Qs, Ls, G, targets, lr, style, *_, draws=None):
            return ref.update_factors_gen2(Qs, Ls, G, targets, lr, style, draws=draws)

        rows.append(
            Row("update_factors_gen2", args, [1, 1, 1, 0, 0, 0], reference, label=style)
        )
        if np.iscomplexobj(G) or all(mask):
            continue
        ws = draws_for(shape, mask, 2 if style == "PRO" else 1)
        rngs = [None if m else Rng() for m in mask]
        rows.append(
            Row(
                "update_factors_gen2",
                [*args, rngs, Draws(ws)],
                [1, 1, 1, 0, 0, 0, 1, 0],
                functools.partial(reference, draws=ws),
                label=f"{style}-sampled",
            )
        )
    return rows


def matrix_rows():
    """Norm bounds, the Procrustes step, packing and the whitening targets."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((5, 5))
    S = np.stack([A @ A.T, rng.standard_normal((5, 5)) * 1e3])
    S_rank1 = np.stack(
        [np.outer(rng.standard_normal(5), rng.standard_normal(5)), -np.eye(5) * 1e-30]
    )
    S_zero = np.stack([np.zeros((5, 5)), np.diag(np.arange(1.0, 6.0))])
    S_1x1 = np.array([[[-3.0]], [[0.5]]])
    Q = np.stack([random_factor(rng, 5, False, dense=True) for _ in range(UNITS)])
    T = np.stack([random_triangular(rng, 6) for _ in range(UNITS)])
    packed = np.stack([ref.pack_factor(t) for t in T])
    W = rng.standard_normal((32, 5))
    valid = [np.arange(4) < 3, np.arange(6) < 5, np.ones(3, bool)]
    return [
        Row("norm_lower_bound", [S], [1], ref.norm_lower_bound, label="full"),
        Row("norm_lower_bound", [S_rank1], [1], ref.norm_lower_bound, label="rank1"),
        Row("norm_lower_bound", [S_zero], [1], ref.norm_lower_bound, label="zero"),
        Row("norm_lower_bound", [S_1x1], [1], ref.norm_lower_bound, label="1x1"),
        Row(
            "sampled_norm_lower_bound",
            [S, Rng(), Draws([W])],
            [1, 1, 0],
            lambda S, *_: ref.sampled_norm_lower_bound(S, W),
        ),
        Row("procrustes_step", [Q], [1], ref.procrustes_step),
        Row(
            "procrustes_step",
            [Q, Rng(), Draws([W])],
            [1, 1, 0],
            lambda Q, *_: ref.procrustes_step(Q, W),
            label="sampled",
        ),
        Row("pack_factor", [T], [1], ref.pack_factor),
        Row("unpack_factor", [packed], [1], want=T),
        Row(
            "unpack_gram",
            [packed],
            [1],
            want=np.stack([ref.factor_gram(t) for t in T]),
        ),
        *[
            Row("whitening_targets", [valid, list(diag)], [0, 0], ref.whitening_targets)
            for diag in ([True, False, True], [False, True, False])
        ],
    ]


def all_rows():
    rows = matrix_rows()
    for seed, (shape, mask) in enumerate(CASES):
        case = axis_rows(shape, mask, seed) + factor_rows(shape, mask, seed)
        rows += _named(case + noise_and_padding_rows(shape, mask, seed), shape, mask)
    for seed, mask in enumerate(itertools.product([True, False], repeat=2)):
        case = factor_rows((5, 4), mask, 100 + seed, complex_=True)
        rows += _named(case, (5, 4), mask, "complex-")
    return rows


def _named(rows, shape, mask, prefix=""):
    """The rows of one case, with the case in their test ids."""
    case = prefix + "x".join(map(str, shape)) + "-" + "".join("dt"[not m] for m in mask)
    for row in rows:
        row.case = case
    return rows


ROWS = all_rows()


# --- running a row in each framework ---------------------------------------------


def _jax_value(x):
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    if isinstance(x, list):
        return [_jax_value(v) for v in x]
    if isinstance(x, dict):
        return {k: _jax_value(v) for k, v in x.items()}
    if isinstance(x, Rng):
        return jax.random.split(jax.random.key(0), UNITS)
    if isinstance(x, Draws):
        calls = iter(x.ws)
        return lambda rng, shape, dtype: jnp.asarray(next(calls), dtype)
    return x


def _torch_value(x):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, list):
        return [_torch_value(v) for v in x]
    if isinstance(x, dict):
        return {k: _torch_value(v) for k, v in x.items()}
    if isinstance(x, Rng):
        return torch.Generator().manual_seed(0)
    if isinstance(x, Draws):
        calls = iter(x.ws)

        def draw(rng, shape, dtype, device):
            W = torch.from_numpy(next(calls)).to(dtype=dtype, device=device)
            return W.expand(tuple(shape))

        return draw
    return x


def run_jax(row):
    """The JAX kernel vmapped over axis 0 of the stacked arguments."""
    kernel = getattr(jkm, row.kernel)
    values = [_jax_value(a) for a in row.args]
    if not any(row.stacked):
        return kernel(*values, **row.kwargs)
    mapped = [v for v, s in zip(values, row.stacked, strict=True) if s]

    def unit(*unit_values, **unit_mapped):
        it = iter(unit_values)
        full = [next(it) if s else v for v, s in zip(values, row.stacked, strict=True)]
        return kernel(*full, **row.kwargs, **unit_mapped)

    return jax.vmap(unit)(*mapped, **_jax_value(row.mapped))


def run_torch(row):
    kernel = getattr(tkm, row.kernel)
    return kernel(
        *[_torch_value(a) for a in row.args], **row.kwargs, **_torch_value(row.mapped)
    )


def expected(row):
    """The reference of each unit, stacked like the kernels' outputs."""
    if row.want is not None:
        return row.want
    if not any(row.stacked):
        return row.reference(*row.args)
    units = []
    for b in range(UNITS):
        args = [
            _unit(a, b) if s else a for a, s in zip(row.args, row.stacked, strict=True)
        ]
        mapped = {k: _unit(v, b) for k, v in row.mapped.items()}
        units.append(row.reference(*args, **mapped))
    return _stack(units)


def _unit(x, b):
    if isinstance(x, list):
        return [_unit(v, b) for v in x]
    return x[b] if isinstance(x, np.ndarray) else x


def _stack(units):
    if isinstance(units[0], list | tuple):
        return [_stack([u[i] for u in units]) for i in range(len(units[0]))]
    return np.stack([np.asarray(u) for u in units])


def assert_close(actual, desired, name, same_dtype=True):
    """Leaf by leaf, relative to the largest entry of the leaf; float64 (or
    complex128) in, the same dtype out unless ``same_dtype`` is False."""
    if isinstance(desired, list | tuple):
        assert len(actual) == len(desired), name
        for a, d in zip(actual, desired, strict=True):
            assert_close(a, d, name, same_dtype)
        return
    actual = np.asarray(actual.numpy() if isinstance(actual, torch.Tensor) else actual)
    desired = np.asarray(desired)
    assert actual.shape == desired.shape, name
    if same_dtype:
        assert actual.dtype == desired.dtype, name
    scale = np.max(np.abs(desired)) if desired.size else 0.0
    np.testing.assert_allclose(
        actual, desired, rtol=RTOL, atol=RTOL * scale, err_msg=name
    )


# --- the table ---------------------------------------------------------------------


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_kernel_equals_float64_reference(row):
    want = expected(row)
    jax_out, torch_out = run_jax(row), run_torch(row)
    # Whitening targets are float32 in both frameworks (exact integers).
    same_dtype = row.kernel != "whitening_targets"
    assert_close(jax_out, want, f"jax {row}", same_dtype)
    assert_close(torch_out, want, f"torch {row}", same_dtype)
    # And the frameworks agree with each other.
    jax_numpy = jax.tree.map(np.asarray, jax_out)
    assert_close(torch_out, jax_numpy, f"jax vs torch {row}")
    if row.kernel == "update_factors":
        # triu(T)·Q of upper-triangular matrices stays exactly upper-triangular.
        for Q in [*jax_numpy, *(Q.numpy() for Q in torch_out)]:
            if Q.ndim == 3:
                assert np.all(np.tril(Q, -1) == 0), row


def test_every_kernel_is_in_the_table_of_both_frameworks():
    """The mirrors: the same public kernels, with the same parameter names in
    the same order; every one of them runs in the table."""

    def public(module):
        return {
            name: value
            for name, value in vars(module).items()
            if inspect.isfunction(value)
            and not name.startswith("_")
            and value.__module__ == module.__name__
        }

    jax_kernels, torch_kernels = public(jkm), public(tkm)
    assert set(jax_kernels) - JAX_ONLY == set(torch_kernels)
    for name, torch_kernel in torch_kernels.items():
        parameters = list(inspect.signature(jax_kernels[name]).parameters)
        # The one difference (module docstrings): a torch draw takes a device.
        parameters += ["device"] if name == "normal_draw" else []
        assert list(inspect.signature(torch_kernel).parameters) == parameters, name
    untested = set(torch_kernels) - {row.kernel for row in ROWS}
    assert untested <= {"is_diagonal", "normal_draw"}, untested
    for name in (
        "STACK_AXES",
        "DAMPING_SCALE",
        "TINY",
        "UPDATE_STYLES",
        "LIPSCHITZ_DECAY",
        "MAX_PROCRUSTES_STEP",
    ):
        assert hasattr(jkm, name), name
        assert hasattr(tkm, name), name
    assert (jkm.DAMPING_SCALE, jkm.TINY) == (tkm.DAMPING_SCALE, tkm.TINY)
    assert jkm.UPDATE_STYLES is tkm.UPDATE_STYLES


def test_is_diagonal_reads_a_units_vector_in_both_frameworks():
    """A diagonal factor is a vector per unit: (d,) for a JAX kernel, (B, d)
    for a torch one, whose extra axis is the stack (``STACK_AXES``)."""
    vector, matrix = np.ones(3), np.eye(3)
    assert jkm.is_diagonal(jnp.asarray(vector))
    assert not jkm.is_diagonal(jnp.asarray(matrix))
    assert tkm.is_diagonal(torch.from_numpy(np.stack([vector] * UNITS)))
    assert not tkm.is_diagonal(torch.from_numpy(np.stack([matrix] * UNITS)))
    assert (jkm.STACK_AXES, tkm.STACK_AXES) == (0, 1)


def test_normal_draw_is_a_seeded_standard_normal_in_both_frameworks():
    """The default ``draw``: the requested shape and dtype, repeatable from the
    same key or seed, and standard normal (mean 0, variance 1 within 5 σ)."""
    shape = (64, 64)
    W_jax = jkm.normal_draw(jax.random.key(0), shape, jnp.float64)
    W_torch = tkm.normal_draw(
        torch.Generator().manual_seed(0), shape, torch.float64, torch.device("cpu")
    )
    again = tkm.normal_draw(
        torch.Generator().manual_seed(0), shape, torch.float64, torch.device("cpu")
    )
    assert torch.equal(W_torch, again)
    np.testing.assert_array_equal(
        W_jax, jkm.normal_draw(jax.random.key(0), shape, jnp.float64)
    )
    for W in (np.asarray(W_jax), W_torch.numpy()):
        assert W.shape == shape
        assert W.dtype == np.float64
        n = W.size
        assert abs(W.mean()) < 5 / np.sqrt(n)
        assert abs(W.var() - 1) < 5 * np.sqrt(2 / n)
