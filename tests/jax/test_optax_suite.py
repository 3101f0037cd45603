"""optax's own test suite, run against precond's JAX optimizers.

optax's wheel ships its tests: ``optax/_src/alias_test.py`` (``AliasTest``, the
checks every optax optimizer passes), ``optax/contrib/_common_test.py``
(``ContribTest``, the same for optax.contrib, on more targets),
``optax/_src/sharding_test.py`` and ``optax/_src/float64_test.py``. Their test
methods are absl ``parameterized`` over optax's optimizers, and absl keeps, on
each method it generates, the undecorated test function (``__wrapped__``) and
its parameters (``testcase_params``, in its closure). This file calls those
functions, unchanged, under pytest: for each precond optimizer
(:data:`OPTIMIZERS`) and each combination of the other parameters optax runs
(target, dtype, ...), with the module's lookup of an optimizer by name
(``_get_opt``, ``_get_opt_factory``) patched to return precond's. Which shipped
tests run, and why the others do not: :data:`TESTS`.

How optax's tests see precond's aliases (docs/ecosystem-differences.md):

* their static arguments (the integers that fix shapes or seeds, which
  ``optax.inject_hyperparams`` would turn into traced arrays: ``KRON_STATIC_ARGS``
  and the like) are bound and left out of the signature, as
  ``inject_hyperparams(..., static_args=...)`` keeps them; the suite
  ``alias_as_is`` runs optax's inject test without that;
* ``learning_rate`` is annotated ``optax.ScalarOrSchedule`` (precond's
  annotations are strings), which optax's schedule test looks for;
* sharding_test sees a ``jax`` whose version compares as new: it compares
  version strings, and '0.10.2' < '0.7.2' skipped all its checks.

A case that differs from optax's expectation by precond's deliberate policy is a
:data:`KNOWN_DIFFERENCES` entry: the case runs and must still raise what the
entry says, or, where the outcome depends on rounding, is skipped with the
reason. docs/ecosystem-differences.md has them as one table, kept equal to the
entries by :func:`test_known_differences_are_the_documented_table`. Any other
failure is a bug.

By default a share of the cases runs (about a minute of CPU): every known
difference and, per shipped test, the rows of its ``quick`` (each row in
several tests). ``PRECOND_OPTAX_SUITE=full`` runs every row on every case
(about 5 minutes of CPU; measured: 264 pass, and the table's 2 skip).
Without a shipped module (an optax that does not ship it, or a missing
dependency: alias_test imports scikit-learn), its cases skip with the reason.

Also here: the regression tests of what the suite found (issue 62).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import inspect
import os
import pathlib
import re
import types
import warnings
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj

FULL = os.environ.get("PRECOND_OPTAX_SUITE") == "full"
DOCS = pathlib.Path(__file__).parents[2] / "docs" / "ecosystem-differences.md"

# ------------------------------------------------------------------ the rows


@dataclasses.dataclass(frozen=True)
class Row:
    """One precond optimizer as optax's tests get it."""

    factory: Callable[..., optax.GradientTransformation]  # the public alias
    kwargs: dict  # optax's ``opt_kwargs``: passed, and injected by inject tests
    static_args: tuple = ()  # bound, and hidden (inject_hyperparams' static_args)
    static: dict = dataclasses.field(default_factory=dict)  # values of some


# Every public JAX alias of precond.jax (test_every_public_alias_is_a_row), at its
# defaults but for the learning rate, which optax's table also sets per
# optimizer.
OPTIMIZERS: dict[str, Row] = {
    "kron": Row(pj.kron, {"learning_rate": 1e-2}, pj.KRON_STATIC_ARGS),
    # pro's default decoupled weight decay (0.1, distributed-kron 2.0's) moves
    # the minimum off the targets' (optax's adamw runs at its 1e-4).
    "pro": Row(
        pj.pro, {"learning_rate": 1e-2, "weight_decay": 0.0}, pj.PRO_STATIC_ARGS
    ),
    "pro_adamw": Row(
        pj.pro_adamw,
        {"learning_rate": 1e-2},
        importlib.import_module("precond.jax.kron.pro_adamw").PRO_ADAMW_STATIC_ARGS,
    ),
    "xmat": Row(pj.xmat, {"learning_rate": 1e-2}),
    "low_rank_approximation": Row(
        pj.low_rank_approximation, {"learning_rate": 1e-2}, pj.LRA_STATIC_ARGS
    ),
    "affine": Row(pj.affine, {"learning_rate": 1e-2}, pj.AFFINE_STATIC_ARGS),
    # The default SGD grafting takes SGD's step lengths: optax's sgd row runs at
    # 1e-3 too (at 1e-2 they leave Rosenbrock's valley).
    "distributed_shampoo": Row(
        pj.distributed_shampoo,
        {"learning_rate": 1e-3},
        pj.SHAMPOO_STATIC_ARGS,
        {"block_size": 128},
    ),
    # SOAP's default decoupled weight decay (0.01, the paper's) moves the minimum
    # off the targets', as pro's.
    "soap": Row(
        pj.soap, {"learning_rate": 1e-2, "weight_decay": 0.0}, pj.SOAP_STATIC_ARGS
    ),
}
# Public functions of precond.jax that are not optimizers, or another name of
# one (lra is low_rank_approximation); scale_by_* are the aliases' cores.
NOT_ALIASES = {
    "lra",
    "skipped_steps",
    "hessian_helper",
    "precond_update_prob_schedule",
    "pro_adamw_hidden_matrices",
    "get_opt_state_partition_specs",
    "pro_opt_state_partition_specs",
    "distributed_shampoo_partition_specs",
    "distributed_shampoo_state_shapes",
    "kron_state_from_distributed_kron",
    "kron_state_to_distributed_kron",
    "seed_parameter_stats",
    "shampoo_state_from_seed",
    "matrix_inverse_pth_root",
    "matrix_inverse_pth_root_eigh",
    "power_iteration",
}


def optax_factory(row: Row, hide_static: bool = True) -> Callable:
    """``row.factory`` with ``row.static`` bound, ``learning_rate`` annotated
    ``optax.ScalarOrSchedule``, and ``row.static_args`` left out of its
    signature (``hide_static``) or kept in it (``row.static`` as defaults)."""
    signature = inspect.signature(row.factory)
    parameters = []
    for name, parameter in signature.parameters.items():
        if name == "learning_rate":
            parameter = parameter.replace(annotation=optax.ScalarOrSchedule)
        if name in row.static and not hide_static:
            parameter = parameter.replace(default=row.static[name])
        if name not in row.static_args or not hide_static:
            parameters.append(parameter)

    @functools.wraps(row.factory)
    def factory(*args, **kwargs):
        return row.factory(*args, **{**row.static, **kwargs})

    factory.__signature__ = signature.replace(parameters=parameters)
    return factory


# ------------------------------------------------------------------ the suites


@dataclasses.dataclass(frozen=True)
class Suite:
    """One shipped test module."""

    module: str
    test_case: str  # its absl TestCase class
    lookup: str | None  # its function finding an optimizer by name, patched
    label: str  # in the docs table
    hide_static: bool = True  # see optax_factory


SUITES = {
    "alias": Suite(
        "optax._src.alias_test", "AliasTest", "_get_opt", "optax/_src/alias_test.py"
    ),
    "alias_as_is": Suite(
        "optax._src.alias_test",
        "AliasTest",
        "_get_opt",
        "optax/_src/alias_test.py, without static_args",
        hide_static=False,
    ),
    "contrib": Suite(
        "optax.contrib._common_test",
        "ContribTest",
        "_get_opt_factory",
        "optax/contrib/_common_test.py",
    ),
    "sharding": Suite(
        "optax._src.sharding_test", "ShardingTest", None, "optax/_src/sharding_test.py"
    ),
    "float64": Suite(
        "optax._src.float64_test", "Float64Test", None, "optax/_src/float64_test.py"
    ),
}
# The parameters of optax's grids that name its optimizer: replaced by the row.
OPTIMIZER_PARAMETERS = {
    "opt_name",
    "opt_kwargs",
    "wrapper_name",
    "wrapper_kwargs",
    "optimizer",
    "transform_constr",
    "transform_kwargs",
}


def _alias_parameters(name: str, row: Row, factory: Callable) -> dict:
    return {"opt_name": name, "opt_kwargs": row.kwargs}


def _contrib_parameters(name: str, row: Row, factory: Callable) -> dict:
    return {
        **_alias_parameters(name, row, factory),
        "wrapper_name": None,
        "wrapper_kwargs": None,
    }


def _sharding_parameters(name: str, row: Row, factory: Callable) -> dict:
    return {"optimizer": factory(**row.kwargs)}


def _float64_parameters(name: str, row: Row, factory: Callable) -> dict:
    return {"transform_constr": factory, "transform_kwargs": row.kwargs}


def _all(*_) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class ShippedTest:
    """How one shipped test runs against the rows."""

    parameters: Callable[[str, Row, Callable], dict]  # the row as its arguments
    quick: tuple[str, ...]  # the rows run by default ("*": all)
    keep: Callable[[dict], bool] = _all  # which of optax's combinations run
    applies: Callable[[str, Row], bool] = _all  # which rows


def _has_mu_dtype(name: str, row: Row) -> bool:
    return "mu_dtype" in inspect.signature(row.factory).parameters


def _has_static_args(name: str, row: Row) -> bool:
    return bool(row.static_args)


def _contrib_target(grid: dict) -> bool:
    names = ("_setup_matrix_parabola", "_setup_mixed_tensor_target")
    return grid["target"].__name__ in names


SCHEDULE_TEST = (
    "test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_such"
)
# (suite, test) ↦ how it runs. Not run: AliasTest's LBFGSTest (L-BFGS only);
# ContribTest's test_preserve_dtype, test_gradient_accumulation and
# test_state_shape_dtype_shard_stability (AliasTest's bodies again);
# ShardingTest's test_microbatch_with_explicit_sharding (no optimizer).
TESTS = {
    ("alias", "test_optimization"): ShippedTest(_alias_parameters, ("kron",)),
    ("alias", "test_optimizers_accept_extra_args"): ShippedTest(
        _alias_parameters, ("pro_adamw",)
    ),
    ("alias", "test_optimizers_can_be_wrapped_in_inject_hyperparams"): ShippedTest(
        _alias_parameters, ("xmat", "distributed_shampoo")
    ),
    # Every numeric argument injected: the rows with static arguments.
    ("alias_as_is", "test_optimizers_can_be_wrapped_in_inject_hyperparams"): (
        ShippedTest(_alias_parameters, ("*",), applies=_has_static_args)
    ),
    # optax's sgd/adam/adamw rows, as adam's (mu_dtype): the rows with one.
    ("alias", "test_explicit_dtype"): ShippedTest(
        lambda name, row, factory: {"opt_name": "adam"},
        ("*",),
        keep=lambda grid: grid["opt_name"] == "adam",
        applies=_has_mu_dtype,
    ),
    ("alias", "test_preserve_dtype"): ShippedTest(_alias_parameters, ("pro",)),
    ("alias", "test_state_shape_dtype_shard_stability"): ShippedTest(
        _alias_parameters, ("xmat",)
    ),
    ("alias", "test_gradient_accumulation"): ShippedTest(
        _alias_parameters, ("affine",)
    ),
    # The matrix and mixed-tensor targets (30000 scanned steps); the parabola
    # and Rosenbrock are AliasTest's.
    ("contrib", "test_optimizers"): ShippedTest(
        _contrib_parameters, ("low_rank_approximation",), keep=_contrib_target
    ),
    # rtol = atol = 1e-5 on the state (AliasTest's: rtol 1e-3, 1e-4).
    ("contrib", "test_optimizers_can_be_wrapped_in_inject_hyperparams"): ShippedTest(
        _contrib_parameters, ("distributed_shampoo",)
    ),
    # And no recompilation on the second step. wrap=True is the same without
    # a wrapper.
    ("contrib", "test_optimizers_accept_extra_args"): ShippedTest(
        _contrib_parameters, ("kron",), keep=lambda grid: not grid["wrap"]
    ),
    ("contrib", SCHEDULE_TEST): ShippedTest(_contrib_parameters, ("xmat",)),
    ("sharding", "test_init_with_abstract_input"): ShippedTest(
        _sharding_parameters, ("*",)
    ),
    ("sharding", "test_state_sharding_type_init_match_update"): ShippedTest(
        _sharding_parameters, ("xmat",)
    ),
    ("sharding", "test_state_sharding_type_preserved_with_jit"): ShippedTest(
        _sharding_parameters, ("distributed_shampoo",)
    ),
    ("float64", "test_mixed_dtype_input_outputs"): ShippedTest(
        _float64_parameters, ("kron",)
    ),
}


@functools.cache
def _shipped(module_name: str) -> tuple[types.ModuleType | None, str]:
    """(the module, "") or (None, why it cannot be imported here)."""
    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():
            # sharding_test builds optax.noisy_sgd without a key: a UserWarning.
            warnings.simplefilter("ignore", UserWarning)
            return importlib.import_module(module_name), ""
    except ImportError as error:
        return None, (
            f"optax {optax.__version__} does not ship {module_name}, or it does "
            f"not import here: {error!r}"
        )
    finally:
        # sharding_test sets XLA_FLAGS when imported: too late for this process
        # (jax has started), but processes that tests start would inherit it.
        os.environ.clear()
        os.environ.update(environ)


@functools.cache
def _grid(suite: str, test: str) -> tuple[Callable | None, tuple[dict, ...]]:
    """The shipped test function (None if absent) and optax's combinations of
    its parameters besides the optimizer, each once, in optax's order."""
    module, _ = _shipped(SUITES[suite].module)
    if module is None:
        return None, ()
    function, grid, seen = None, [], set()
    for method in vars(getattr(module, SUITES[suite].test_case)).values():
        wrapped = getattr(method, "__wrapped__", None)
        if getattr(wrapped, "__name__", None) != test:
            continue
        function = wrapped
        # absl's bound_param_test(self) calls test_method(self, **testcase_params).
        parameters = inspect.getclosurevars(method).nonlocals["testcase_params"]
        if not isinstance(parameters, Mapping):  # named_parameters: positional
            bound = inspect.signature(wrapped).bind(None, *parameters).arguments
            parameters = dict(list(bound.items())[1:])  # less self
        if not TESTS[suite, test].keep(parameters):
            continue
        rest = {k: v for k, v in parameters.items() if k not in OPTIMIZER_PARAMETERS}
        if _case_id(rest) not in seen:
            seen.add(_case_id(rest))
            grid.append(rest)
    return function, tuple(grid)


def _case_id(parameters: dict) -> str:
    def show(value):
        if isinstance(value, type) or callable(value):
            return getattr(value, "__name__", repr(value))
        return str(value)

    return "-".join(f"{k}={show(v)}" for k, v in sorted(parameters.items()))


# ------------------------------------------------------------------ differences


@dataclasses.dataclass(frozen=True)
class Difference:
    """Cases of optax's suite where precond differs on purpose."""

    suite: str
    test: str
    optimizers: tuple[str, ...]
    case: str  # a pattern (fnmatch) of the cases' ids, e.g. "*dtype=complex64*"
    cases: str  # the same, in words (docs table)
    what: str  # what differs (docs table)
    why: str  # why (docs table)
    # What the case still raises, and a pattern of its message; None: skipped.
    raises: type[BaseException] | None
    match: str = ""


_REFUSES_COMPLEX = (
    "refuses complex parameters at init (a TypeError naming the parameter)"
)
_PRO_COMPLEX = (
    "distributed-kron 2.0's pro (the seed) keeps a real momentum and real "
    "factors for complex parameters and so drops their imaginary parts; precond "
    "refuses rather than do that silently. kron, xmat, low_rank_approximation "
    "and affine take complex parameters."
)
_SHAMPOO_COMPLEX = (
    "Google's Distributed Shampoo is real-only too: complex parameters would "
    "need Hermitian statistics GGᴴ and their roots."
)
_SOAP_COMPLEX = (
    "SOAP is defined for real parameters (its paper and reference code): complex "
    "ones would need unitary eigenbases of Hermitian statistics GGᴴ and a second "
    "moment of the squared modulus, which precond does not guess."
)
_DIVERGES = (
    "float32 Rosenbrock at the default learning rate (1e-2): the iterates "
    "leave the valley after converging (steps 2000-9500), and then every "
    "gradient is above the step guard's limit (1.8e19): every step is skipped "
    "and the parameters stop: `precond.jax.skipped_steps(state)` counts them "
    "(and the first one logs a WARNING on the `precond.jax` logger when its "
    "level is set to WARNING)"
)
_PSGD_JAX_DIVERGES = (
    "psgd-jax 0.1.5 does the same with the same defaults (the seed contract): "
    "whitening fits P to ever smaller gradients near the optimum, so steps do "
    "not shrink. Its outcome depends on rounding, so it is skipped. Measured in "
    "10000 steps, 30 seeds: {}"
)
_SHAMPOO_INJECTED = (
    "Google's arithmetic (the seed's): 1 − β2 is formed in Python from 0.999, "
    "but from float32 β2 when injected, 1.3e-5 smaller, and the roots' Newton "
    "iterations amplify that. Forming it from float32 β2 in both runs would make "
    "them agree, but move precond's steps up to 2.7e-5 from optax-shampoo "
    "0.0.6's (the parity tests allow 1e-5) and change the recorded trajectories"
)
KNOWN_DIFFERENCES: list[Difference] = [
    *[
        Difference(
            suite="alias",
            test=test,
            optimizers=(name,),
            case="*dtype=complex*",
            cases="complex dtypes",
            what=_REFUSES_COMPLEX,
            why=why,
            raises=TypeError,
            match="does not support complex parameters",
        )
        for test in ("test_optimization", "test_state_shape_dtype_shard_stability")
        for name, why in (
            ("pro", _PRO_COMPLEX),
            ("distributed_shampoo", _SHAMPOO_COMPLEX),
            ("soap", _SOAP_COMPLEX),
        )
    ],
    Difference(
        suite="alias",
        test="test_optimization",
        optimizers=("xmat",),
        case="dtype=float32-target=_setup_rosenbrock",
        cases="Rosenbrock, float32",
        what=_DIVERGES,
        why=_PSGD_JAX_DIVERGES.format(
            "diverged 4/30 (psgd-jax 1/30; with the default seed both follow "
            "the same path bit for bit and leave it at step 8469, where psgd-jax "
            "turns NaN); 0/30 at 5e-3."
        ),
        raises=None,
    ),
    Difference(
        suite="alias",
        test="test_optimization",
        optimizers=("low_rank_approximation",),
        case="dtype=float32-target=_setup_rosenbrock",
        cases="Rosenbrock, float32",
        what=_DIVERGES,
        why=_PSGD_JAX_DIVERGES.format(
            "diverged 19/30 (psgd-jax 2/30; balance_method='norm', psgd-jax's "
            "balancing, 3/30): precond's default rebalancing of U, V (which "
            "stops a float32 blow-up after 2e4-1.5e5 steps) makes it more "
            "likely; 15/30 at 3e-3."
        ),
        raises=None,
    ),
    Difference(
        suite="alias",
        test="test_explicit_dtype",
        optimizers=("kron", "xmat", "low_rank_approximation", "affine"),
        case="params_dtype=complex64-state_dtype=[bf]*",
        cases="complex64 params, bfloat16 or float32 mu_dtype",
        what="a complex parameter's momentum is complex64 where optax's adam "
        "keeps mu_dtype: mu_dtype sets its precision",
        why="a real momentum drops the imaginary part of complex gradients",
        raises=AssertionError,
        match="complex64",
    ),
    *[
        Difference(
            suite=suite,
            test="test_optimizers_can_be_wrapped_in_inject_hyperparams",
            optimizers=("distributed_shampoo",),
            case="",
            cases="",
            what="after one step in optax.inject_hyperparams the state is up to "
            "1.4e-4 (relative) from the plain optimizer's, more than the test's "
            f"{tolerance}; the updates agree to 1e-3",
            why=_SHAMPOO_INJECTED,
            raises=AssertionError,
            match="Not equal to tolerance",
        )
        for suite, tolerance in (
            ("alias", "rtol 1e-4"),
            ("contrib", "rtol = atol = 1e-5"),
        )
    ],
    *[
        Difference(
            suite=suite,
            test="test_optimizers_can_be_wrapped_in_inject_hyperparams",
            optimizers=("pro",),
            case="",
            cases="weight_decay=0",
            what="with weight_decay=0 the plain pro's chain has no "
            "add_decayed_weights (2 states), the injected one has it (3: λ is an "
            "array); the updates agree",
            why="pro's chain is distributed-kron 2.0's (the decay only for a weight "
            "decay above 0), and so are pro_opt_state_partition_specs and its "
            "states; kron keeps one state tree whatever weight_decay is",
            raises=AssertionError,
            match="Trees have different structures",
        )
        for suite in ("alias", "contrib")
    ],
    Difference(
        suite="alias_as_is",
        test="test_optimizers_can_be_wrapped_in_inject_hyperparams",
        optimizers=(
            "kron",
            "pro",
            "pro_adamw",
            "low_rank_approximation",
            "affine",
            "distributed_shampoo",
            "soap",
        ),
        case="",
        cases="",
        what="inject_hyperparams without static_args injects every numeric "
        "argument, the integers that fix shapes or seeds too (block_size, "
        "max_size_triangular, ...): a TypeError names the argument and static_args",
        why="shapes are fixed when the step is traced: pass each alias's static "
        "arguments (static_args=KRON_STATIC_ARGS and the like), as optax's "
        "adafactor needs static_args (optax issue 412); the rest of the suite does",
        raises=TypeError,
        match="must be a Python int",
    ),
]


def _difference(suite: str, test: str, name: str, case: str) -> Difference | None:
    for difference in KNOWN_DIFFERENCES:
        if (
            (difference.suite, difference.test) == (suite, test)
            and name in difference.optimizers
            and fnmatch.fnmatchcase(case, difference.case)
        ):
            return difference
    return None


def documented_rows() -> list[str]:
    """The docs table's rows: suite | test (cases) | optimizers | what | why."""
    rows = []
    for d in KNOWN_DIFFERENCES:
        test = f"`{d.test}`" + (f" ({d.cases})" if d.cases else "")
        names = ", ".join(f"`{name}`" for name in d.optimizers)
        outcome = "skipped" if d.raises is None else f"asserts: {d.raises.__name__}"
        rows.append(
            f"| {SUITES[d.suite].label} | {test} | {names} | {d.what} | "
            f"{d.why} ({outcome}) |"
        )
    return rows


# ------------------------------------------------------------------ the cases


class _JaxOfComparableVersion(types.ModuleType):
    """jax, for optax's sharding_test, which compares ``jax.__version__`` as a
    string ('0.10.2' < '0.7.2') and so skipped its checks on every jax from
    0.10: here a version that compares as newer (precond needs jax >= 0.8)."""

    __version__ = "9999"

    def __getattr__(self, name):
        return getattr(jax, name)


def _cases():
    for (suite, test), how in TESTS.items():
        function, grid = _grid(suite, test)
        if function is None:  # skips with the reason (test_optax_suite)
            yield pytest.param(suite, test, None, None, id=f"{suite}-{test}")
            continue
        for name, row in OPTIMIZERS.items():
            if not how.applies(name, row):
                continue
            for parameters in grid:
                case = _case_id(parameters)
                difference = _difference(suite, test, name, case)
                quick = "*" in how.quick or name in how.quick
                if not (FULL or quick or difference):
                    continue
                marks = ()
                if difference is not None and difference.raises is None:
                    marks = pytest.mark.skip(reason=f"{difference.what}: see docs")
                yield pytest.param(
                    suite,
                    test,
                    name,
                    parameters,
                    id="-".join(x for x in (suite, test, name, case) if x),
                    marks=marks,
                )


@pytest.mark.parametrize(("suite", "test", "name", "parameters"), list(_cases()))
def test_optax_suite(suite, test, name, parameters, monkeypatch):
    """optax's shipped ``test`` of ``suite``, unchanged, on the row ``name``:
    passes, or raises what its known difference says."""
    module, reason = _shipped(SUITES[suite].module)
    function, _ = _grid(suite, test)
    if function is None:
        pytest.skip(reason or f"optax {optax.__version__} has no {suite} {test}")
    row = OPTIMIZERS[name]
    factory = optax_factory(row, SUITES[suite].hide_static)
    lookup = SUITES[suite].lookup
    if lookup == "_get_opt":
        monkeypatch.setattr(module, lookup, lambda self, opt_name: factory)
    elif lookup == "_get_opt_factory":
        monkeypatch.setattr(module, lookup, lambda opt_name: factory)
    if suite == "sharding":
        monkeypatch.setattr(module, "jax", _JaxOfComparableVersion("jax"))
    self = getattr(module, SUITES[suite].test_case)()
    arguments = {**parameters, **TESTS[suite, test].parameters(name, row, factory)}
    difference = _difference(suite, test, name, _case_id(parameters))
    x64 = jax.config.jax_enable_x64
    try:
        if difference is None:
            function(self, **arguments)
        else:
            with pytest.raises(difference.raises, match=difference.match):
                function(self, **arguments)
    finally:  # float64_test turns x64 on, and off only when it passes
        jax.config.update("jax_enable_x64", x64)


def test_every_public_alias_is_a_row():
    """A new optimizer in precond.jax runs through optax's suite too."""
    public = {
        name
        for name in pj.__all__
        if inspect.isfunction(getattr(pj, name)) and not name.startswith("scale_by")
    }
    assert public - NOT_ALIASES == set(OPTIMIZERS)


def test_known_differences_are_the_documented_table():
    """docs/ecosystem-differences.md's table is the entries of
    KNOWN_DIFFERENCES, row for row (documented_rows renders them)."""
    lines = DOCS.read_text(encoding="utf-8").splitlines()
    table = [line for line in lines if re.match(r"^\| (?!suite |---)", line)]
    assert table == documented_rows(), "\n".join(["", *documented_rows()])


def test_every_known_difference_has_cases():
    """No stale entry: each names rows and cases that optax's suite has."""
    for difference in KNOWN_DIFFERENCES:
        _, grid = _grid(difference.suite, difference.test)
        if not grid and _shipped(SUITES[difference.suite].module)[0] is None:
            continue
        cases = [_case_id(parameters) for parameters in grid]
        assert set(difference.optimizers) <= set(OPTIMIZERS), difference
        assert any(fnmatch.fnmatchcase(c, difference.case) for c in cases), difference


# ------------------------------------------------------------------ issue 62

# The optimizers that keep a momentum in ``mu_dtype``.
MU_DTYPE_OPTIMIZERS = {
    "kron": pj.kron,
    "xmat": pj.xmat,
    "low_rank_approximation": pj.low_rank_approximation,
    "affine": pj.affine,
}


def _run(optimizer, params, steps=2):
    """(updates of each step, first state, last state) of ``steps`` jitted steps
    on gradients params·(1 + step) (of the initial params: a difference in one
    step's updates does not change the next step's gradients)."""
    state = optimizer.init(params)
    first, update, history = state, jax.jit(optimizer.update), []
    for step in range(steps):
        grads = jax.tree.map(lambda p, s=step: (p * (1 + s)).astype(p.dtype), params)
        updates, state = update(grads, state, params)
        history.append(updates)
    return history, first, state


def _dtypes(tree):
    return jax.tree.map(lambda x: jnp.result_type(x), tree)


@pytest.mark.parametrize("name", sorted(MU_DTYPE_OPTIMIZERS))
def test_complex_mu_dtype_is_the_momentum_dtype(name):
    """Issue 62 (1), optax's ``test_explicit_dtype`` with mu_dtype=complex64: the
    momentum is complex64 for real parameters (as optax's adam and the seed
    packages keep it) and for complex ones; updates in the gradients' dtypes,
    state dtypes stable. Real parameters step as with mu_dtype=float32 (their
    momentum's imaginary part stays 0), to bfloat16 rounding: XLA may keep the
    float32 momentum's (1 − β₁)·g of a bfloat16 g in float32, the complex one
    is rounded to bfloat16 first (XMat and LRA flatten all parameters into one
    vector, so that reaches the float32 "w" too)."""
    factory = MU_DTYPE_OPTIMIZERS[name]
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=3), jnp.bfloat16),
    }
    history, first, last = _run(factory(0.1, mu_dtype=jnp.complex64), params)
    want, _, _ = _run(factory(0.1, mu_dtype=jnp.float32), params)
    mu = optax.tree.get(first, "mu")
    assert set(jax.tree.leaves(_dtypes(mu))) == {jnp.dtype(jnp.complex64)}
    assert _dtypes(last) == _dtypes(first)
    for got, expected in zip(history, want, strict=True):
        assert _dtypes(got) == _dtypes(params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            np.testing.assert_allclose(a, b, rtol=2**-7, atol=2**-7 * np.abs(b).max())
    # Complex parameters: traced, not run (float32's counterpart is complex64).
    z = jnp.zeros((3, 2), jnp.complex64)
    optimizer = factory(0.1, mu_dtype=jnp.complex64)
    state = jax.eval_shape(optimizer.init, {"z": z})
    updates, new_state = jax.eval_shape(optimizer.update, {"z": z}, state, {"z": z})
    assert optax.tree.get(state, "mu")["z"].dtype == jnp.complex64
    assert updates["z"].dtype == jnp.complex64
    assert _dtypes(new_state) == _dtypes(state)


@pytest.mark.parametrize("name", sorted(MU_DTYPE_OPTIMIZERS))
@pytest.mark.parametrize("mu_dtype", [jnp.int32, jnp.bool_, "no dtype"], ids=str)
def test_mu_dtype_that_is_not_floating_or_complex_is_refused(name, mu_dtype):
    """Integer and bool momenta (every update would round to 0) are refused at
    construction, the error naming the argument, its value and what is allowed."""
    with pytest.raises(ValueError, match=r"^Invalid mu_dtype=") as error:
        MU_DTYPE_OPTIMIZERS[name](0.1, mu_dtype=mu_dtype)
    message = str(error.value)
    assert message.startswith(f"Invalid mu_dtype={mu_dtype!r}: must be "), message
    assert "floating" in message, message
    assert "complex" in message, message
    assert "None" in message, message


def _largest_relative_difference(got, want) -> float:
    """max over leaves of max|got − want| / max|want|, less the roots' residuals
    (training_metrics: rounding-sized numbers, any two runs differ in them)."""
    worst = 0.0
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        if "training_metrics" not in jax.tree_util.keystr(path):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-30)
            worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)) / scale)
    return worst


def _plain_and_injected_shampoo(steps: int, **kwargs) -> list[tuple[float, float]]:
    """(largest relative difference of the updates, of the state) per step
    between distributed_shampoo and the same wrapped in optax.inject_hyperparams
    (every float hyperparameter injected as a float32 array)."""
    kwargs = (
        dict(learning_rate=0.01, block_size=128, start_preconditioning_step=3) | kwargs
    )
    plain = pj.distributed_shampoo(**kwargs)
    injected = optax.inject_hyperparams(
        pj.distributed_shampoo, static_args=pj.SHAMPOO_STATIC_ARGS
    )(**kwargs)
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    rng = np.random.default_rng(0)
    state, wrapped = jax.jit(plain.init)(params), jax.jit(injected.init)(params)
    step, wrapped_step = jax.jit(plain.update), jax.jit(injected.update)
    differences = []
    for _ in range(steps):
        grads = [jnp.asarray(rng.normal(size=p.shape), jnp.float32) for p in params]
        updates, state = step(grads, state, params)
        wrapped_updates, wrapped = wrapped_step(grads, wrapped, params)
        differences.append(
            (
                _largest_relative_difference(wrapped_updates, updates),
                _largest_relative_difference(wrapped.inner_state, state),
            )
        )
    return differences


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {
            "graft_type": pj.GraftingType.RMSPROP,
            "weight_decay": 1e-3,
            "nesterov": False,
            "diagonal_epsilon": 1e-8,
            "matrix_epsilon": 1e-5,
        },
    ],
    ids=["sgd_grafting", "rmsprop_grafting_weight_decay"],
)
def test_shampoo_state_differs_with_injected_hyperparameters_only_through_1_minus_beta(
    kwargs,
):
    """Issue 62 (2), optax's ``test_optimizers_can_be_wrapped_in_inject_hyperparams``
    (a known difference): distributed_shampoo in optax.inject_hyperparams keeps
    the plain optimizer's state only up to rounding amplified by the roots, as
    Google's does: 1 − β₂ is formed in Python from 0.999 when β₂ is a float
    (Google's arithmetic, which the parity tests hold to 1e-5), from float32 β₂
    when injected, 1.3e-5 smaller. That is the only source: with β₂ = 1 (a
    sum, weight 1 in both), updates and state agree over 6 steps to 1e-6 with
    every other float hyperparameter injected (measured 1.3e-7); with β₂ = 0.999
    the state drifts apart (measured 1.4e-4 after one step, 5.8e-4 after six,
    at most 8e-5 in the updates)."""
    summed = _plain_and_injected_shampoo(6, beta2=1.0, **kwargs)
    assert max(max(pair) for pair in summed) <= 1e-6, summed
    averaged = _plain_and_injected_shampoo(6, beta2=0.999, **kwargs)
    assert 1e-6 < max(state for _, state in averaged) <= 3e-3, averaged
