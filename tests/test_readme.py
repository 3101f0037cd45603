"""The README's and the guides' examples run as written and print what they show,
and their factual sentences about behaviour hold.

The documents: README.md and the long-form pages it points to (:data:`DOCUMENTS`:
``docs/guides/*.md``, ``docs/pro_adamw.md``, ``docs/development.md``). A page
added there with python examples follows the same convention.

Examples: every ```python block of the documents runs (:func:`test_readme_example`,
one test per block, ``exec`` with stdout captured). Convention: a block that
prints is followed directly (blank lines aside) by a ```text block holding its
output, and a block that prints nothing is not. The output is compared line by
line (:func:`_assert_output_matches`): the words exactly (runs of spaces count
as one), integers exactly (steps, shapes, counts), and decimals within
``rel_tol=RTOL`` or ``abs_tol=ATOL`` of the README's. That tolerance is what
training a few dozen steps on another CPU needs and no more than that: the
torch Kron example prints 0.931 and 0.024 on an AMD EPYC of family 25 where the
README shows 0.928 and 0.025 (from one of family 26), 0.3% and 0.001 apart; it
is far smaller than the changes the examples show (a loss falling 5-500×).
Printing fewer digits would not remove the need for it (a value near a rounding
boundary flips either way). After running, a block's claims in its own terms
are checked by the function :data:`EXAMPLE_CHECKS` names for it (the loss
falls, K-FAC ends far below plain SGD, ...).

Sentences: each entry of :data:`CLAIMS` quotes a README sentence (whitespace
normalised) and checks it against the code: defaults against the signatures,
state sizes against ``init``. A sentence that is edited away fails its entry
until the entry is edited too. Every ``precond.…`` name and every repository
path the README gives in backticks must exist.

To refresh a text block after changing an example, run its test: the failure
message shows the whole output.
"""

import ast
import contextlib
import inspect
import io
import itertools
import math
import pathlib
import re
from collections.abc import Callable

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[1]
README = ROOT / "README.md"
DOCUMENTS = [
    README,
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
    ROOT / "docs" / "pro_adamw.md",
    ROOT / "docs" / "development.md",
]
BLOCK = re.compile(r"```python\n(.*?)```\n(?:\s*```text\n(.*?)```\n)?", flags=re.S)
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
RTOL = 0.05
ATOL = 0.005


def _readme() -> str:
    """Every document's text, the README first."""
    return "\n\n".join(path.read_text() for path in DOCUMENTS)


def _flat(text: str) -> str:
    """``text`` with every run of whitespace as one space."""
    return " ".join(text.split())


def _blocks() -> list[tuple[str, str | None, str]]:
    """(code, its text block or None, its document and the heading above it)
    for every python block of the documents, in order."""
    blocks = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            headings = re.findall(r"^#+ (.+)$", text[: match.start()], flags=re.M)
            heading = f"{path.stem} {headings[-1] if headings else 'top'}"
            blocks.append((match.group(1), match.group(2) or None, heading))
    return blocks


def _block_ids() -> list[str]:
    ids = []
    for code, _, heading in _blocks():
        words = re.sub(r"\W+", "-", heading.lower()).strip("-")
        lines = [line.strip() for line in code.splitlines()]
        first = next(line for line in lines if line and not line.startswith("import"))
        ids.append(f"{words}:{first[:30]}")
    return ids


def _python_block(marker: str) -> tuple[str, str | None]:
    """The README's one python example that contains ``marker``, and its output."""
    matching = [block[:2] for block in _blocks() if marker in block[0]]
    assert len(matching) == 1, f"{len(matching)} README examples contain {marker!r}"
    return matching[0]


def _numbers(line: str) -> list[str]:
    return NUMBER.findall(line)


def _words(line: str) -> list[str]:
    return NUMBER.sub("#", line).split()


def _same_number(got: str, want: str) -> bool:
    """Integers exactly; decimals within the module's tolerance."""
    if re.fullmatch(r"[-+]?\d+", want):
        return got == want
    return math.isclose(float(got), float(want), rel_tol=RTOL, abs_tol=ATOL)


def _assert_output_matches(actual: str, shown: str | None) -> None:
    """``actual`` is the README's ``shown`` output, up to the module's tolerance."""
    assert shown is not None, f"the example prints but shows no output:\n{actual}"
    message = f"The document shows:\n{shown}\nthe example printed:\n{actual}"
    got, want = actual.strip().splitlines(), shown.strip().splitlines()
    assert len(got) == len(want), message
    for got_line, want_line in zip(got, want):
        assert _words(got_line) == _words(want_line), message
        got_numbers, want_numbers = _numbers(got_line), _numbers(want_line)
        assert len(got_numbers) == len(want_numbers), message
        for g, w in zip(got_numbers, want_numbers):
            assert _same_number(g, w), message


def _exec(code: str) -> tuple[dict, str]:
    """Runs ``code``; returns its namespace and what it printed."""
    namespace: dict = {}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(code, namespace)
    return namespace, stdout.getvalue()


def _column(printed: str, word: str) -> list[float]:
    """The number after ``word`` on each line of ``printed``."""
    return [float(v) for v in re.findall(rf"{word}\s+({NUMBER.pattern})", printed)]


# -- what each example claims, checked after it ran ------------------------------


def _losses_fall(steps: int, factor: float) -> Callable[[dict, str], None]:
    """A check that the example printed ``steps`` losses, each below the one
    before, the last below ``factor`` times the first."""

    def check(namespace: dict, printed: str) -> None:
        losses = _column(printed, "loss")
        assert len(losses) == steps, losses
        assert losses[-1] < factor * losses[0], losses
        assert all(b < a for a, b in itertools.pairwise(losses)), losses

    return check


def _jax_pro_adamw_splits_hidden_from_head(namespace: dict, printed: str) -> None:
    _losses_fall(5, 0.05)(namespace, printed)
    import precond.jax as pj

    split = pj.pro_adamw_hidden_matrices(namespace["params"])
    assert split == {"hidden": True, "head": False}, split


def _jax_kron_trains(namespace: dict, printed: str) -> None:
    losses = _column(printed, "loss")
    assert len(losses) == 5
    assert losses[-1] < 0.05 * losses[0], losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert "train_step" in namespace


def _sharded_example_trains_with_split_factors(namespace: dict, printed: str) -> None:
    import jax
    from jax.sharding import PartitionSpec as P

    jnp, mesh = namespace["jnp"], namespace["mesh"]
    params, state = namespace["params"], namespace["state"]
    x = jnp.linspace(-1, 1, 64 * 512).reshape(64, 512)
    y = jnp.sin(x[:, :16])
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(10):
            params, state, loss = namespace["train_step"](params, state, x, y)
            losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0]
    factors = jax.tree.leaves(state[0].preconditioners)
    # 4 layers × 4 blocks = 16 units of 256×256 split over all 8 devices: 2 each.
    assert factors[-1].shape[0] == 16
    assert factors[-1].addressable_shards[0].data.shape[0] == 2
    assert factors[-1].sharding.spec[0] in (("fsdp", "tp"), "fsdp")
    assert params["layers"].sharding.spec == P(None, "fsdp", "tp")


def _hessian_example_solves_in_one_fitted_step(namespace: dict, printed: str) -> None:
    # psgd-jax's README: loss ≈ 0 one step after the first fit (P = H⁻¹ = I/2).
    loss = namespace["loss_fn"](namespace["params"], namespace["x"])
    assert float(loss) < 1e-10


def _regression_data(jnp):
    x = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    return x, jnp.tanh(x[:, :10] + x[:, 10:20])


def _shampoo_example_trains(namespace: dict, printed: str) -> None:
    x, y = _regression_data(namespace["jnp"])
    params, state = namespace["params"], namespace["state"]
    losses = []
    for _ in range(40):
        params, state, loss = namespace["train_step"](params, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


def _scale_by_shampoo_is_the_alias_without_its_rate(namespace: dict, printed: str):
    """The chain trains, and without the clip it is distributed_shampoo at the
    same schedule, bit for bit."""
    jax, optax, pj = __import__("jax"), namespace["optax"], namespace["pj"]
    x, y = _regression_data(namespace["jnp"])

    def loss(p):
        return namespace["jnp"].mean((x @ p["w"] + p["b"] - y) ** 2)

    def run(optimizer, params, state, steps):
        @jax.jit
        def step(params, state):
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        losses = []
        for _ in range(steps):
            params, state, value = step(params, state)
            losses.append(float(value))
        return params, losses

    optimizer, params = namespace["optimizer"], namespace["params"]
    _, losses = run(optimizer, params, namespace["state"], 40)
    assert losses[-1] < 0.5 * losses[1], losses
    arguments = dict(block_size=128, preconditioning_compute_steps=10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 5, 100)
    chained = optax.chain(
        pj.scale_by_shampoo(**arguments), optax.scale_by_learning_rate(schedule)
    )
    alias = pj.distributed_shampoo(schedule, **arguments)
    got, _ = run(chained, params, chained.init(params), 12)
    want, _ = run(alias, params, alias.init(params), 12)
    for name in params:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# The split the guide writes out by hand ("pro on the hidden matrices, AdamW on
# the rest"), with pro_adamw's defaults: pro at 2 × AdamW's rate, b1 0.7, 'QEQ'
# fits on this schedule, and AdamW at 0.01, both at the bench's weight decay.
BENCHMARKED_SCHEDULE = dict(min_prob=0.2, decay=0.005, flat_start=200)
BENCHMARKED_ADAMW_RATE = 0.01


def _pro_with_adamw_is_the_benchmarked_split(namespace: dict, printed: str) -> None:
    """The char-lm recipe labels the bench's char-lm as its Muon splits it, and
    steps as the benchmarked run's optimizer does: pro on the hidden matrices and
    AdamW on the rest, each with the benchmarked run's arguments."""
    import jax
    import jax.numpy as jnp
    import optax

    import precond.jax as pj
    from precond.bench.jax_models import char_lm_hidden_matrices, init_char_lm
    from tests.jax.helpers import params_after

    labelled = namespace["pro_on_hidden_matrices"]
    key = jax.random.key(0)
    params = {
        "embedding": jax.random.normal(key, (16, 8)),
        "layers": [{"w": jax.random.normal(key, (8, 8)), "bias": jnp.zeros(8)}],
        "head": jax.random.normal(key, (8, 16)),
    }
    assert labelled(params) == {
        "embedding": "adamw",
        "layers": [{"w": "pro", "bias": "adamw"}],
        "head": "adamw",
    }
    char_lm = init_char_lm(0)
    readme = [label == "pro" for label in jax.tree.leaves(labelled(char_lm))]
    assert readme == jax.tree.leaves(char_lm_hidden_matrices(char_lm))

    pro = pj.pro(
        2 * namespace["adamw_rate"],
        b1=0.7,
        weight_decay=1e-4,
        preconditioner_update_style="QEQ",
        preconditioner_update_probability=pj.precond_update_prob_schedule(
            **BENCHMARKED_SCHEDULE
        ),
    )
    adamw = optax.adamw(BENCHMARKED_ADAMW_RATE, weight_decay=1e-4)
    benchmarked_optimizer = optax.multi_transform(
        {"pro": pro, "adamw": adamw}, labelled
    )
    grads = [jax.tree.map(lambda x, i=i: jnp.cos(x * i), params) for i in range(3)]
    jax.tree.map(
        np.testing.assert_array_equal,
        params_after(namespace["optimizer"], params, grads),
        params_after(benchmarked_optimizer, params, grads),
    )


def _torch_kron_trains(namespace: dict, printed: str) -> None:
    import torch

    model, x, y = namespace["model"], namespace["x"], namespace["y"]
    with torch.no_grad():
        final = float(torch.nn.functional.cross_entropy(model(x), y))
    losses = _column(printed, "loss")
    # From log(10) = 2.30 (chance) to below 0.7 in the example's 100 steps.
    assert losses[0] > 2.0, losses
    assert losses[-1] < 0.7, losses
    assert final < 0.7, final


def _losses_by_run(printed: str) -> dict[str, list[float]]:
    """The K-FAC example's output: run name -> its losses every 5 steps."""
    lines = dict(
        line.split("loss every 5 steps:") for line in printed.strip().splitlines()
    )
    return {name.strip(): [float(v) for v in v.split()] for name, v in lines.items()}


def _kfac_beats_the_same_sgd(namespace: dict, printed: str) -> None:
    runs = _losses_by_run(printed)
    sgd, kfac = runs["SGD"], runs["SGD + K-FAC"]
    assert sgd[0] == kfac[0] > 2.0  # same model, data and start (chance: 2.30)
    # K-FAC ends ~10x below plain SGD with the same rate and momentum (9.5x
    # shown; the README says "about ten times", tested at 5x).
    assert kfac[-1] < 0.2 * sgd[-1], runs
    assert kfac[-1] < 0.1, runs


# Example marker (a string in exactly one python block) → its claims.
EXAMPLE_CHECKS: dict[str, Callable[[dict, str], None]] = {
    "pj.pro_adamw(learning_rate=1e-2)": _jax_pro_adamw_splits_hidden_from_head,
    "lr=1e-2)  # AdamW's rate; pro's is 2x": _losses_fall(5, 0.05),
    "pj.kron(learning_rate=1e-3": _jax_kron_trains,
    "jax.set_mesh": _sharded_example_trains_with_split_factors,
    "hessian_helper": _hessian_example_solves_in_one_fitted_step,
    "pj.distributed_shampoo(": _shampoo_example_trains,
    "pj.scale_by_shampoo(": _scale_by_shampoo_is_the_alias_without_its_rate,
    "pro_on_hidden_matrices": _pro_with_adamw_is_the_benchmarked_split,
    "from precond.torch import Kron": _torch_kron_trains,
    "from precond.torch.kfac import KFAC": _kfac_beats_the_same_sgd,
}


def test_convention_output_blocks_follow_printing_examples():
    blocks = _blocks()
    assert len(blocks) >= 6
    for code, shown, _ in blocks:
        prints = "print(" in code
        assert prints == (shown is not None), (
            f"{'prints but shows no' if prints else 'shows output but has no print'}"
            f" output block:\n{code[:300]}"
        )


def test_every_example_check_names_one_example():
    for marker in EXAMPLE_CHECKS:
        _python_block(marker)


@pytest.mark.parametrize(
    ("actual", "ok"),
    [
        ("step  0  loss 0.5012\nstep 10  loss 0.0998", True),
        ("step 0 loss 0.52\nstep 10 loss 0.1", True),  # within tolerance
        ("step  0  loss 0.6\nstep 10  loss 0.1", False),  # a number off
        ("step  1  loss 0.5\nstep 10  loss 0.1", False),  # an integer off
        ("step  0  cost 0.5\nstep 10  loss 0.1", False),  # a word off
        ("step  0  loss 0.5", False),  # a line missing
    ],
)
def test_output_comparison(actual, ok):
    shown = "step  0  loss 0.5000\nstep 10  loss 0.1000\n"
    if ok:
        _assert_output_matches(actual, shown)
    else:
        with pytest.raises(AssertionError):
            _assert_output_matches(actual, shown)


# Examples whose checks compare two programs bit for bit: compiled as users'
# programs are (tests/conftest.py's `optimized_xla`), each value computed once.
BITWISE_EXAMPLES = ("pj.scale_by_shampoo(",)


def _example_params() -> list:
    return [
        pytest.param(
            index,
            id=block_id,
            marks=[pytest.mark.optimized_xla]
            if any(marker in code for marker in BITWISE_EXAMPLES)
            else [],
        )
        for index, ((code, _, _), block_id) in enumerate(
            zip(_blocks(), _block_ids(), strict=True)
        )
    ]


@pytest.mark.parametrize("index", _example_params())
def test_readme_example(index):
    code, shown, _ = _blocks()[index]
    namespace, printed = _exec(code)
    if printed or shown is not None:
        _assert_output_matches(printed, shown)
    for marker, check in EXAMPLE_CHECKS.items():
        if marker in code:
            check(namespace, printed)


def test_readme_kfac_example_sgd_catches_up_at_ten_times_the_rate():
    """The README's caveat: plain SGD at a 10x larger rate (0.3) ends at least as
    low as SGD + K-FAC at 0.03 on this problem."""
    code, _ = _python_block("from precond.torch.kfac import KFAC")  # guides/kfac.md
    sgd_rate = "torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)"
    assert sgd_rate in code
    faster = code.replace(
        sgd_rate,
        "torch.optim.SGD(model.parameters(), lr=0.3 if not use_kfac else 0.03, "
        "momentum=0.9)",
    )
    runs = _losses_by_run(_exec(faster)[1])
    assert runs["SGD"][-1] <= runs["SGD + K-FAC"][-1], runs


# -- sentences ---------------------------------------------------------------------


def _parameters(function) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(function).parameters)


def _assert_defaults(function, listed: str, keyword_only: bool = False) -> None:
    """Every ``name=value`` in ``listed`` (backticked, as the README writes them)
    is a parameter of ``function`` with that default (and keyword-only if
    ``keyword_only``)."""
    parameters = _parameters(function)
    pairs = re.findall(r"`(\w+)=([^`]+)`", listed)
    assert pairs, listed
    for name, value in pairs:
        assert name in parameters, f"{function.__qualname__} has no {name}"
        default = parameters[name].default
        assert default == ast.literal_eval(value), f"{name}: {default!r} != {value}"
        if keyword_only:
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def _readme_span(start: str, end: str) -> str:
    """The README's text from ``start`` to the next ``end`` (whitespace
    normalised)."""
    text = _flat(_readme())
    assert start in text, start
    tail = text[text.index(start) :]
    return tail[: tail.index(end)]


def _kron_takes_distributed_kron_arguments_in_order_with_defaults():
    import precond.jax as pj

    listed = _readme_span(
        "with distributed-kron 1.0.0's arguments in its order", "; and"
    )
    names = re.findall(r"`(\w+)(?:=[^`]+)?`", listed)
    assert names == list(_parameters(pj.kron))[: len(names)], names
    _assert_defaults(pj.kron, listed)


def _default(function: str, setting: str, keyword_only: bool = False):
    """A check that ``function`` (a dotted name) has the parameter and default of
    ``setting`` (``"name=value"``), keyword-only if ``keyword_only``."""

    def check():
        import importlib

        module, _, name = function.rpartition(".")
        _assert_defaults(
            getattr(importlib.import_module(module), name), f"`{setting}`", keyword_only
        )

    return check


def _kron_default_update_style_is_eq():
    import precond.jax as pj
    import precond.torch as pt

    assert _parameters(pj.kron)["preconditioner_update_style"].default == "EQ"
    assert _parameters(pt.Kron)["preconditioner_update_style"].default == "EQ"


def _pro_defaults():
    import precond.jax as pj
    from precond._common.kron_constants import MAX_UPDATE_RMS
    from precond._common.pro_layout import ADAM_STYLE_DIVISOR

    defaults = {k: p.default for k, p in _parameters(pj.pro).items()}
    assert defaults["b1"] == 0.95
    assert defaults["preconditioner_update_style"] == "PRO"
    assert defaults["preconditioner_update_probability"] == 1.0  # every step
    assert defaults["preconditioner_lr"] == 0.5
    assert defaults["block_size"] == 256
    assert defaults["max_size_dense"] == 16384
    assert defaults["lr_style"] == "adam"
    assert (MAX_UPDATE_RMS, ADAM_STYLE_DIVISOR) == (1.1, 5)


def _factor_shapes(**kron_options) -> list[tuple[int, ...]]:
    import jax
    import jax.numpy as jnp

    import precond.jax as pj

    state = pj.kron(**kron_options).init({"w": jnp.zeros((12, 10))})[0]
    return [f.shape for f in jax.tree.leaves(state.preconditioners)]


def _packed_cache_adds_d_numbers_per_factor():
    """'packed' (the default): each d × d factor stored as (d + 1) × d; None: Q
    alone; 'dense': Q and QᵀQ, twice the factor memory."""
    import precond.jax as pj

    assert _parameters(pj.kron)["preconditioner_cache"].default == "packed"
    assert _factor_shapes() == [(1, 13, 12), (1, 11, 10)]
    assert _factor_shapes(preconditioner_cache=None) == [(1, 12, 12), (1, 10, 10)]
    dense = _factor_shapes(preconditioner_cache="dense")
    assert dense == [(1, 2, 12, 12), (1, 2, 10, 10)]


def _pro_keyword_only_additions():
    import precond.jax as pj

    for name in ("draws", "preconditioner_update_probability"):
        assert _parameters(pj.pro)[name].kind is inspect.Parameter.KEYWORD_ONLY


def _shampoo_matrix_functions_are_public():
    import precond.jax as pj

    names = (
        "matrix_inverse_pth_root",
        "matrix_inverse_pth_root_eigh",
        "power_iteration",
    )
    for name in names:
        assert name in pj.__all__
        assert callable(getattr(pj, name))


def _pyproject_line(key: str) -> str:
    """The value of ``key = ...`` in pyproject.toml (tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    (value,) = re.findall(rf"^{re.escape(key)} = (.+)$", text, flags=re.M)
    return value.strip()


def _python_floor():
    assert _pyproject_line("requires-python") == '">=3.10"'


def _jax_floor():
    assert _pyproject_line("jax") == '["jax>=0.8.0", "optax>=0.2.5"]'


def _psgd_state_sizes():
    """XMat: 3n numbers with momentum; LRA: n·(2r + 1) numbers (its factors)."""
    import jax
    import jax.numpy as jnp

    import precond.jax as pj

    def size(tree) -> int:
        return sum(x.size for x in jax.tree.leaves(tree))

    params = {"w": jnp.zeros((6, 5)), "b": jnp.zeros(7)}
    n, rank = 37, 4
    xmat = pj.xmat().init(params)[0]
    assert size((xmat.preconditioner, xmat.mu)) == 3 * n
    lra = pj.low_rank_approximation(uvd_rank_of_approximation=rank).init(params)[0]
    assert size(lra.preconditioner) == n * (2 * rank + 1)


def _torch_kron_defaults():
    import precond.torch as pt

    assert _parameters(pt.Kron)["max_skew_triangular"].default == 10
    assert _parameters(pt.Kron)["preconditioner_cache"].default is None


def _shampoo_grafts_as_sgd_by_default():
    import precond.jax as pj

    default = _parameters(pj.distributed_shampoo)["graft_type"].default
    assert default == pj.GraftingType.SGD


def _hessian_helper_signature():
    import precond.jax as pj

    opening = "- `hessian_helper("
    listed = _readme_span(opening, ")` (psgd-jax's signature")[len(opening) :]
    items = [item.strip().split("=") for item in listed.split(",")]
    parameters = _parameters(pj.hessian_helper)
    assert [item[0] for item in items] == list(parameters), listed
    for name, *value in items:
        if value:
            assert parameters[name].default == ast.literal_eval(value[0]), name


def _trajectory_table():
    from tests import trajectories

    assert (len(trajectories.CASES), trajectories.STEPS) == (75, 20)
    assert trajectories.CROSS_MACHINE_RTOL == 2e-4


# A sentence of the documents (whitespace normalised) → the check that it holds.
CLAIMS: dict[str, Callable[[], None]] = {
    "with distributed-kron 1.0.0's arguments in its order and its defaults": (
        _kron_takes_distributed_kron_arguments_in_order_with_defaults
    ),
    "- `momentum_into_precond_update=True` (keyword-only here)": _default(
        "precond.jax.kron", "momentum_into_precond_update=True", keyword_only=True
    ),
    "and `independent_scanned_layers=False` (True:": _default(
        "precond.jax.kron", "independent_scanned_layers=False", keyword_only=True
    ),
    "- `seed=42`: noise and balancing are drawn": _default(
        "precond.jax.kron", "seed=42", keyword_only=True
    ),
    "- `mesh=None`: the mesh": _default("precond.jax.kron", "mesh=None", True),
    "- `preconditioner_update_style='EQ'` (the default, distributed-kron's rule": (
        _kron_default_update_style_is_eq
    ),
    "momentum 0.95, a 'PRO' fit every step with step size 0.5": _pro_defaults,
    "blocks of 256, diagonal factors on sides over 16384, each update clipped to "
    "RMS 1.1 and, with `lr_style='adam'`, divided by 5": _pro_defaults,
    "(d extra numbers per d×d factor)": _packed_cache_adds_d_numbers_per_factor,
    "`'dense'` keeps it as its own matrix (twice the factor memory;": (
        _packed_cache_adds_d_numbers_per_factor
    ),
    "(a d × d factor is stored as (d + 1) × d with the default "
    "`preconditioner_cache='packed'`": _packed_cache_adds_d_numbers_per_factor,
    "Keyword-only additions: `draws='compact'` and "
    "`preconditioner_update_probability`": _pro_keyword_only_additions,
    "The matrix functions are public: `matrix_inverse_pth_root`, "
    "`matrix_inverse_pth_root_eigh`, `power_iteration`": (
        _shampoo_matrix_functions_are_public
    ),
    "(Python >= 3.10, CPU is enough)": _python_floor,
    "(jax and jaxlib 0.8.0 with optax 0.2.5, the floor of the `jax` extra": _jax_floor,
    "JAX's default `'packed'` layout": _packed_cache_adds_d_numbers_per_factor,
    "XMat: Q = diag(a) + antidiag(b) over all parameters flattened (3n numbers with "
    "momentum)": _psgd_state_sizes,
    "LRA: Q = (I + UVᵀ)·diag(d), rank `uvd_rank_of_approximation` (n·(2r + 1) "
    "numbers)": _psgd_state_sizes,
    "`max_skew_triangular` defaults to kron-torch's 10": _torch_kron_defaults,
    "# per-parameter step size (default: SGD's)": _shampoo_grafts_as_sgd_by_default,
    "(psgd-jax's signature": _hessian_helper_signature,
    "holds 75 optimizer settings, 20 steps each": _trajectory_table,
    "each entry must lie within 2e-4 of its array's largest entry": _trajectory_table,
}


def test_a_wrong_default_or_a_missing_sentence_fails():
    import precond.jax as pj

    with pytest.raises(AssertionError):
        _assert_defaults(pj.kron, "`block_size=128`")
    with pytest.raises(AssertionError):
        _assert_defaults(pj.kron, "`block_size=256`", keyword_only=True)
    with pytest.raises(AssertionError):
        _readme_span("a sentence the README does not hold", ".")


@pytest.mark.parametrize("sentence", list(CLAIMS))
def test_readme_sentence_holds(sentence):
    assert _flat(sentence) in _flat(_readme()), f"no document says {sentence!r}"
    CLAIMS[sentence]()


def test_every_precond_name_in_the_readme_exists():
    import importlib

    names = set(re.findall(r"`(precond(?:\.\w+)+)", _readme()))
    assert names
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                value = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attribute in parts[cut:]:
                    value = getattr(value, attribute)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"the documents name what does not exist: {missing}"


def test_every_repository_path_in_the_readme_exists():
    paths = set(
        re.findall(
            r"(?:`|\]\()((?:tests|docs|examples|benchmarks|src|\.ci)/[\w./-]+)",
            _readme(),
        )
    )
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p.split("#")[0]).exists())
    assert not missing, f"the documents name files that do not exist: {missing}"
