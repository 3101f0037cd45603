"""Tests of ``precond bench``: its data split, its measurements and its CLI errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from precond.bench import cli
from precond.bench.optimizers import OPTIMIZERS
from precond.bench.report import format_table, json_document
from precond.bench.runner import RunResult
from precond.bench.workloads import (
    CHAR_LM_CONTEXT,
    batch_indices,
    char_lm_logits,
    char_lm_text,
    get_workload,
    load_char_lm_split,
    load_digits_split,
)


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in np.ascontiguousarray(x)}


def test_digits_split_is_deterministic_and_disjoint():
    first, again, other = (load_digits_split(s) for s in (0, 0, 1))
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.y_test, other.y_test)

    # All 1797 rows are used once, and no row of the test set is a train row.
    assert len(first.x_train) + len(first.x_test) == 1797
    assert len(first.x_test) == round(0.2 * 1797)
    train_rows, test_rows = _rows(first.x_train), _rows(first.x_test)
    assert len(train_rows) == len(first.x_train)
    assert len(test_rows) == len(first.x_test)
    assert not train_rows & test_rows

    # Standardised with the train set's statistics: zero mean, unit or zero std.
    np.testing.assert_allclose(first.x_train.mean(axis=0), 0.0, atol=1e-5)
    std = first.x_train.std(axis=0)
    assert np.all((np.abs(std - 1) < 1e-4) | (std < 1e-6))
    assert first.x_train.dtype == np.float32
    assert first.y_train.dtype == np.int32


def test_char_lm_split_is_deterministic_shifted_and_disjoint():
    first, again = load_char_lm_split(0), load_char_lm_split(0)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert first.x_train.dtype == first.y_train.dtype == np.int32
    assert first.x_train.shape[1] == CHAR_LM_CONTEXT
    assert first.x_train.min() >= 0
    assert first.x_train.max() < 256
    # Targets are the inputs shifted by one byte.
    np.testing.assert_array_equal(first.x_train[:, 1:], first.y_train[:, :-1])
    np.testing.assert_array_equal(first.x_test[:, 1:], first.y_test[:, :-1])
    # The train and test windows are a partition of all windows of the text.
    data = np.frombuffer(char_lm_text(), dtype=np.uint8)
    n = (len(data) - 1) // CHAR_LM_CONTEXT
    assert len(first.x_train) + len(first.x_test) == n
    assert len(first.x_test) == round(0.1 * n)
    windows = [
        data[i * CHAR_LM_CONTEXT : (i + 1) * CHAR_LM_CONTEXT + 1].astype(np.int32)
        for i in range(n)
    ]
    split_windows = [
        np.append(x, y[-1])
        for xs, ys in ((first.x_train, first.y_train), (first.x_test, first.y_test))
        for x, y in zip(xs, ys)
    ]
    assert sorted(w.tobytes() for w in windows) == sorted(
        w.tobytes() for w in split_windows
    )


def test_char_lm_starts_at_uniform_loss_is_causal_and_learns():
    import jax
    import optax

    workload = get_workload("char-lm")
    split = workload.load_split(workload.split_seed)
    params = workload.init_params(0)
    x, y = split.x_train[:8], split.y_train[:8]

    # Position t sees only bytes <= t: changing the last byte of the input changes
    # no earlier logit.
    changed = x.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    logits = jax.jit(char_lm_logits)
    a, b = np.asarray(logits(params, x)), np.asarray(logits(params, changed))
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-5)
    assert not np.allclose(a[:, -1], b[:, -1])

    metrics = jax.jit(workload.metrics)(params, x, y)
    assert abs(float(metrics["loss"]) - np.log(256)) < 0.05
    assert float(metrics["bits_per_byte"]) == pytest.approx(
        float(metrics["loss"]) / np.log(2), rel=1e-6
    )
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0

    optimizer = optax.adamw(1e-2)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(workload.loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(11):  # the loss before each update
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[0] == pytest.approx(float(metrics["loss"]), abs=1e-4)
    assert losses[-1] < losses[0] - 1.0


def test_batch_indices_are_deterministic_epochs():
    batches = batch_indices(n_rows=10, batch_size=4, steps=5, seed=3)
    np.testing.assert_array_equal(batches, batch_indices(10, 4, 5, seed=3))
    assert not np.array_equal(batches, batch_indices(10, 4, 5, seed=4))
    assert batches.shape == (5, 4)
    assert batches.dtype == np.int32
    flat = batches.ravel()
    # Each epoch of 10 consecutive indices is a permutation of the 10 rows.
    np.testing.assert_array_equal(np.sort(flat[:10]), np.arange(10))
    np.testing.assert_array_equal(np.sort(flat[10:20]), np.arange(10))
    with pytest.raises(ValueError, match="batch_size=11"):
        batch_indices(10, 11, 1, seed=0)


def test_tiny_run_writes_consistent_json(tmp_path, capsys):
    path = tmp_path / "results.json"
    status = cli.main(
        [
            "bench",
            "--steps",
            "5",
            "--batch-size",
            "32",
            "--no-progress",
            "--workloads",
            "digits-mlp",
            "--lr",
            "kron=5e-4",
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    document = json.loads(path.read_text())
    runs = {run["optimizer"]: run for run in document["runs"]}
    assert set(runs) == set(OPTIMIZERS) == {"kron", "adamw", "shampoo"}
    assert runs["kron"]["learning_rate"] == 5e-4
    assert runs["adamw"]["learning_rate"] == OPTIMIZERS["adamw"].default_lr
    assert document["config"]["steps"] == 5

    workload = get_workload("digits-mlp")
    params = workload.init_params(0)
    param_bytes = sum(np.asarray(p).nbytes for layer in params for p in layer.values())
    for run in runs.values():
        assert run["param_bytes"] == param_bytes
        assert len(run["minibatch_loss"]) == 5
        # The final loss is the last logged one, taken after the last step.
        assert run["history"][-1]["step"] == 5
        assert run["final_train_loss"] == run["history"][-1]["train_loss"]
        assert run["test_accuracy"] == run["history"][-1]["test_accuracy"]
        assert 0.0 <= run["test_accuracy"] <= 1.0
        assert run["median_step_ms"] > 0
        assert run["compile_s"] > 0
    # AdamW keeps two moments like the parameters, plus two int32 step counts:
    # Adam's (bias correction) and the learning-rate schedule's.
    assert runs["adamw"]["state_bytes"] == 2 * param_bytes + 2 * 4
    # Kron keeps momentum plus preconditioner factors: more than the momentum;
    # Shampoo keeps two momenta, the grafting accumulator and its statistics and
    # roots: more than AdamW.
    assert runs["kron"]["state_bytes"] > param_bytes
    assert runs["shampoo"]["state_bytes"] > runs["adamw"]["state_bytes"]

    # The table shows both runs and the state ratio of AdamW to itself.
    lines = out.splitlines()
    adamw_row = next(line for line in lines if " adamw " in line)
    assert adamw_row.split()[-1] == "1.00"
    assert any(" kron " in line for line in lines)


def test_shampoo_weight_decay_is_decoupled():
    import jax
    import jax.numpy as jnp

    # With zero gradients Shampoo's direction is 0, so the update is the decay
    # alone, −lr·λ·θ, not passed through the momentum (which would give
    # −lr·(1 + β1)·λ·θ with Nesterov, as distributed_shampoo's own weight_decay).
    params = {"w": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.ones(4)}
    optimizer = OPTIMIZERS["shampoo"].make(0.1, 0.01)
    state = optimizer.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for _ in range(2):
        updates, state = optimizer.update(zeros, state, params)
        for name in params:
            np.testing.assert_allclose(
                updates[name], -0.1 * 0.01 * params[name], rtol=1e-6
            )


def test_progress_bar_goes_to_stderr(capsys):
    argv = ["bench", "--steps", "3", "--batch-size", "16", "--optimizers", "adamw"]
    argv += ["--workloads", "digits-mlp"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "digits-mlp adamw" in captured.err
    assert "3/3" in captured.err
    assert "3/3" not in captured.out
    assert " adamw " in captured.out


def _result(optimizer: str, loss: float, state_bytes: int, step_ms: float):
    return RunResult(
        workload="w",
        optimizer=optimizer,
        learning_rate=1e-3,
        schedule="constant",
        weight_decay=0.0,
        steps=1,
        batch_size=1,
        seed=0,
        final_train_loss=loss,
        test_loss=loss,
        test_accuracy=0.5,
        median_step_ms=step_ms,
        compile_s=1.0,
        train_s=1.0,
        param_bytes=100,
        state_bytes=state_bytes,
        history=[{"step": 1, "train_loss": loss}],
    )


def test_table_ratios_and_json_without_nan():
    kron_run = _result("kron", float("nan"), state_bytes=300, step_ms=4.0)
    adamw_run = _result("adamw", 0.25, state_bytes=200, step_ms=2.0)
    table = format_table([kron_run, adamw_run], baseline="adamw").splitlines()
    assert table[0].split()[:2] == ["workload", "optimizer"]
    kron_cells = table[2].split()
    assert kron_cells[3] == "nan"
    assert kron_cells[-1] == "1.50"  # state bytes 300 / 200
    assert kron_cells[7] == "2.00"  # step time 4 ms / 2 ms
    # Without the baseline in the results, ratios are "-".
    alone = format_table([kron_run], baseline="adamw").splitlines()[2].split()
    assert alone[-1] == "-"
    assert alone[7] == "-"

    document = json_document([kron_run], config={}, environment={})
    text = json.dumps(document, allow_nan=False)  # would raise on NaN
    assert json.loads(text)["runs"][0]["final_train_loss"] is None


def test_list_names_every_optimizer(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name, spec in OPTIMIZERS.items():
        assert any(
            line.split()[:3] == [name, "lr", f"{spec.default_lr:g}"]
            for line in out.splitlines()
        )
    assert "digits-mlp" in out
    assert "char-lm" in out


def test_help_documents_every_flag(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--steps",
        "--batch-size",
        "--seed",
        "--optimizers",
        "--workloads",
        "--lr",
        "--weight-decay",
        "--schedule",
        "--json",
        "--no-progress",
        "--list",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--optimizers", "kron,sgd"], "unknown optimizer 'sgd'"),
        (["--optimizers", "kron,kron"], "more than once"),
        (["--steps", "0"], "--steps: 0 must be an integer >= 1"),
        (["--steps", "-3"], "--steps: -3 must be an integer >= 1"),
        (["--steps", "ten"], "'ten' is not an integer"),
        (["--batch-size", "0"], "--batch-size: 0 must be an integer >= 1"),
        (["--seed", "-1"], "--seed: -1 must be an integer >= 0"),
        (["--lr", "kron"], "not of the form NAME=VALUE"),
        (["--lr", "sgd=1e-3"], "unknown optimizer 'sgd'"),
        (["--lr", "kron=0"], "must be a finite number > 0"),
        (["--lr", "kron=nan"], "must be a finite number > 0"),
        (["--lr", "adamw=1e-3", "--optimizers", "kron"], "not in --optimizers"),
        (["--lr", "kron=1e-3", "--lr", "kron=2e-3"], "more than once"),
        (["--weight-decay", "-1"], "--weight-decay"),
        (["--schedule", "linear"], "invalid choice: 'linear'"),
        (["--workloads", "imagenet"], "unknown workload 'imagenet'"),
        (["--json", "/nonexistent/folder/out.json"], "does not exist"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--batch-size", "100000"], "exceeds the 1438 training rows"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, phrase, capsys):
    assert cli.main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("precond bench: error:")
    assert phrase in lines[0]


def test_missing_jax_says_how_to_install(monkeypatch, capsys):
    real_find_spec = cli.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "jax" else real_find_spec(name, *args)

    monkeypatch.setattr(cli.importlib.util, "find_spec", find_spec)
    assert cli.main(["bench", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "pip install 'precond[jax]'" in err


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().err


def test_cli_import_does_not_import_jax():
    import subprocess
    import sys

    code = (
        "import sys, precond.bench.cli; "
        "print(any(m == 'jax' or m.startswith(('jax.', 'sklearn', 'optax')) "
        "for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
