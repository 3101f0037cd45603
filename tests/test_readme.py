"""The README's Python examples run as written, and print what the README shows.

Convention: a ```python block that prints is followed directly (blank lines
aside) by a ```text block holding its output, and a block that prints nothing is
not. Each test below runs one block (``exec``, with stdout captured) and compares
what it printed with its text block (:func:`_assert_output_matches`): line by
line, the words exactly (runs of spaces count as one) and the numbers within
``rel_tol=RTOL`` or ``abs_tol=ATOL`` of the README's. The tolerance absorbs
rounding differences between CPUs and BLAS builds over a few dozen training steps;
it is far smaller than the changes the examples show (a loss falling 5-500×).
Each test also asserts what the example claims, in its own terms (the loss falls,
K-FAC ends far below plain SGD, ...).

To refresh a text block after changing an example, run its test: the failure
message shows the whole output.
"""

import itertools
import math
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```\n(?:\s*```text\n(.*?)```\n)?", flags=re.S)
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
RTOL = 0.05
ATOL = 0.005


def _blocks() -> list[tuple[str, str | None]]:
    """(code, its text block or None) for every python block of the README."""
    return [(code, text or None) for code, text in BLOCK.findall(README.read_text())]


def _python_block(marker: str) -> tuple[str, str | None]:
    """The README's one python example that contains ``marker``, and its output."""
    matching = [block for block in _blocks() if marker in block[0]]
    assert len(matching) == 1, f"{len(matching)} README examples contain {marker!r}"
    return matching[0]


def _numbers(line: str) -> list[float]:
    return [float(n) for n in NUMBER.findall(line)]


def _words(line: str) -> list[str]:
    return NUMBER.sub("#", line).split()


def _assert_output_matches(actual: str, shown: str | None) -> None:
    """``actual`` is the README's ``shown`` output, up to the module's tolerance."""
    assert shown is not None, f"the example prints but shows no output:\n{actual}"
    message = f"README shows:\n{shown}\nthe example printed:\n{actual}"
    got, want = actual.strip().splitlines(), shown.strip().splitlines()
    assert len(got) == len(want), message
    for got_line, want_line in zip(got, want):
        assert _words(got_line) == _words(want_line), message
        got_numbers, want_numbers = _numbers(got_line), _numbers(want_line)
        assert len(got_numbers) == len(want_numbers), message
        for g, w in zip(got_numbers, want_numbers):
            assert math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL), message


def _run(marker: str, capsys) -> tuple[dict, str]:
    """Runs the example containing ``marker``, checks its printed output against
    the README; returns its namespace and output."""
    code, shown = _python_block(marker)
    namespace: dict = {}
    capsys.readouterr()
    exec(code, namespace)
    printed = capsys.readouterr().out
    if printed or shown is not None:
        _assert_output_matches(printed, shown)
    return namespace, printed


def _column(printed: str, word: str) -> list[float]:
    """The number after ``word`` on each line of ``printed``."""
    return [float(v) for v in re.findall(rf"{word}\s+({NUMBER.pattern})", printed)]


def test_convention_output_blocks_follow_printing_examples():
    blocks = _blocks()
    assert len(blocks) >= 6
    for code, shown in blocks:
        prints = "print(" in code
        assert prints == (shown is not None), (
            f"{'prints but shows no' if prints else 'shows output but has no print'}"
            f" output block:\n{code[:300]}"
        )


@pytest.mark.parametrize(
    ("actual", "ok"),
    [
        ("step  0  loss 0.5012\nstep 10  loss 0.0998", True),
        ("step 0 loss 0.52\nstep 10 loss 0.1", True),  # within tolerance
        ("step  0  loss 0.6\nstep 10  loss 0.1", False),  # a number off
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


def test_readme_jax_example_trains(capsys):
    namespace, printed = _run("pj.kron(learning_rate=1e-3", capsys)
    losses = _column(printed, "loss")
    assert len(losses) == 5
    assert losses[-1] < 0.05 * losses[0], losses
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert "train_step" in namespace


def test_readme_sharded_example_trains_with_split_factors():
    import jax
    from jax.sharding import PartitionSpec as P

    namespace: dict = {}
    exec(_python_block("jax.set_mesh")[0], namespace)  # the "Sharded training" one
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


def test_readme_hessian_example_solves_in_one_fitted_step(capsys):
    namespace, _ = _run("hessian_helper", capsys)  # the XMat/HVP example
    # psgd-jax's README: loss ≈ 0 one step after the first fit (P = H⁻¹ = I/2).
    loss = namespace["loss_fn"](namespace["params"], namespace["x"])
    assert float(loss) < 1e-10


def test_readme_shampoo_example_trains():
    namespace: dict = {}
    exec(_python_block("pj.distributed_shampoo(")[0], namespace)
    jnp = namespace["jnp"]
    x = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    y = jnp.tanh(x[:, :10] + x[:, 10:20])
    params, state = namespace["params"], namespace["state"]
    losses = []
    for _ in range(40):
        params, state, loss = namespace["train_step"](params, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


def test_readme_scale_by_shampoo_example_trains_and_is_the_alias_without_its_rate():
    namespace: dict = {}
    exec(_python_block("pj.scale_by_shampoo(")[0], namespace)
    jax, optax, pj = __import__("jax"), namespace["optax"], namespace["pj"]
    jnp = namespace["jnp"]
    x = jnp.linspace(-1, 1, 32 * 64).reshape(32, 64)
    y = jnp.tanh(x[:, :10] + x[:, 10:20])

    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

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
    # Without the clip, the chain is distributed_shampoo at the same schedule.
    arguments = dict(block_size=128, preconditioning_compute_steps=10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 5, 100)
    chained = optax.chain(
        pj.scale_by_shampoo(**arguments), optax.scale_by_learning_rate(schedule)
    )
    alias = pj.distributed_shampoo(schedule, **arguments)
    got, _ = run(chained, params, chained.init(params), 12)
    want, _ = run(alias, params, alias.init(params), 12)
    for name in params:
        assert jnp.array_equal(got[name], want[name]), name


# The run BENCHMARKS.md reports for the README's recipe ("pro on the hidden
# matrices, AdamW on the rest"), by its name in benchmarks/psgd_quality.py, at
# 4 × AdamW's rate and the bench's weight decay of 1e-4.
BENCHMARKED_PRO_SPLIT = (
    "pro-s200-0.005-0.2:b1=0.5:preconditioner_update_style='QEQ':adam_part=0.01"
)


def test_readme_pro_with_adamw_on_the_rest_is_the_benchmarked_split():
    """The char-lm recipe labels the bench's char-lm as its Muon splits it, and
    steps as the benchmarked run's optimizer does (the benchmark's own test shows
    that each part steps as pro or AdamW alone)."""
    import jax
    import jax.numpy as jnp

    from precond.bench.jax_models import char_lm_hidden_matrices, init_char_lm
    from tests.bench.helpers import psgd_quality
    from tests.jax.helpers import params_after

    namespace: dict = {}
    exec(_python_block("pro_on_hidden_matrices")[0], namespace)
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

    (benchmarked,) = psgd_quality()._specs([BENCHMARKED_PRO_SPLIT])
    benchmarked_optimizer = benchmarked.make(
        4 * namespace["adamw_rate"],
        1e-4,
        hidden_matrices=lambda p: jax.tree.map(lambda x: x == "pro", labelled(p)),
    )
    grads = [jax.tree.map(lambda x, i=i: jnp.cos(x * i), params) for i in range(3)]
    jax.tree.map(
        np.testing.assert_array_equal,
        params_after(namespace["optimizer"], params, grads),
        params_after(benchmarked_optimizer, params, grads),
    )


def test_readme_torch_example_trains(capsys):
    import torch

    namespace, printed = _run("from precond.torch import Kron", capsys)
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


def test_readme_kfac_example_beats_the_same_sgd(capsys):
    _, printed = _run("from precond.torch.kfac import KFAC", capsys)
    runs = _losses_by_run(printed)
    sgd, kfac = runs["SGD"], runs["SGD + K-FAC"]
    assert sgd[0] == kfac[0] > 2.0  # same model, data and start (chance: 2.30)
    # K-FAC ends ~10x below plain SGD with the same rate and momentum (9.5x
    # shown; the README says "about ten times", tested at 5x).
    assert kfac[-1] < 0.2 * sgd[-1], runs
    assert kfac[-1] < 0.1, runs


def test_readme_kfac_example_sgd_catches_up_at_ten_times_the_rate(capsys):
    """The README's caveat: plain SGD at a 10x larger rate (0.3) ends at least as
    low as SGD + K-FAC at 0.03 on this problem."""
    code, _ = _python_block("from precond.torch.kfac import KFAC")
    sgd_rate = "torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)"
    assert sgd_rate in code
    faster = code.replace(
        sgd_rate,
        "torch.optim.SGD(model.parameters(), lr=0.3 if not use_kfac else 0.03, "
        "momentum=0.9)",
    )
    capsys.readouterr()
    exec(faster, {})
    runs = _losses_by_run(capsys.readouterr().out)
    assert runs["SGD"][-1] <= runs["SGD + K-FAC"][-1], runs
