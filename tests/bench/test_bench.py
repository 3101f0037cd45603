"""Tests of ``precond bench``: data, steps-to-reach, the suite's report and the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from precond.bench import cli, suite
from precond.bench.analysis import (
    fastest,
    loss_curve,
    reached_and_stayed,
    select_learning_rates,
    summarize,
    value_at,
    winners,
)
from precond.bench.data import BatchStream
from precond.bench.machine import available_cores
from precond.bench.optimizers import OPTIMIZERS
from precond.bench.report import (
    RESULTS_BEGIN,
    RESULTS_END,
    format_fastest,
    format_markdown,
    format_table,
    format_verdicts,
    format_winners,
    json_document,
    replace_results_block,
    results_table,
    run_from_json,
    write_json,
)
from precond.bench.runner import (
    RunConfig,
    RunResult,
    lr_multiplier,
    training_loop,
)
from precond.bench.workloads import (
    CHAR_LM_CONTEXT,
    WORKLOADS,
    batch_indices,
    char_lm_logits,
    char_lm_text,
    get_workload,
    load_char_lm_split,
    load_digits_split,
)

HAS_KFAC = OPTIMIZERS["kfac"].available()


@pytest.fixture(autouse=True)
def _keep_thread_settings():
    """``cli.main`` sets the thread pools' environment variables and torch's
    thread counts for its process: give them back to the other tests."""
    saved = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield
    os.environ.clear()
    os.environ.update(saved)
    if torch is not None or "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads or available_cores())


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in np.ascontiguousarray(x)}


# --------------------------------------------------------------------------- data


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
    # The MLP and the CNN train on the same split.
    assert WORKLOADS["digits-mlp"].load_split is WORKLOADS["digits-cnn"].load_split


def test_teacher_student_rows_are_fresh_and_ill_conditioned():
    """Every step of the default budget draws rows no earlier step drew; the
    inputs' covariance has the condition number the description gives; the
    targets are the teacher's, standardised; a linear fit leaves a nonlinear
    part to learn."""
    from precond.bench.data import (
        TEACHER_CONDITION,
        teacher_network,
        teacher_targets,
    )

    workload = WORKLOADS["teacher-student"]
    split = workload.load_split(workload.split_seed)
    again = workload.load_split(workload.split_seed)
    np.testing.assert_array_equal(split.x_test, again.x_test)
    assert split.x_train.dtype == split.y_train.dtype == np.float32
    assert workload.steps * workload.batch_size <= len(split.x_train)
    order = batch_indices(len(split.x_train), workload.batch_size, workload.steps, 0)
    assert len(np.unique(order)) == order.size  # one epoch: no row seen twice
    assert not _rows(split.x_train) & _rows(split.x_test)

    weights, root = teacher_network(workload.split_seed)
    eigenvalues = np.linalg.eigvalsh(root @ root.T)
    assert eigenvalues.max() / eigenvalues.min() == pytest.approx(TEACHER_CONDITION)
    assert eigenvalues.sum() == pytest.approx(len(root))
    raw = teacher_targets(weights, split.x_test.astype(np.float64))
    correlation = [
        np.corrcoef(raw[:, i], split.y_test[:, i])[0, 1] for i in range(raw.shape[1])
    ]
    np.testing.assert_allclose(correlation, 1.0, atol=1e-6)
    np.testing.assert_allclose(split.y_train.std(axis=0), 1.0, atol=1e-4)
    design = np.c_[split.x_train[:20000], np.ones(20000)]
    fit = np.linalg.lstsq(design, split.y_train[:20000], rcond=None)[0]
    residual = split.y_test - np.c_[split.x_test, np.ones(len(split.x_test))] @ fit
    assert 0.05 < residual.var() < 0.5


def test_regression_loss_is_the_mean_squared_error_in_both_frameworks():
    """The JAX loss and metrics are the mean over rows and outputs of the squared
    error (float64 NumPy oracle); torch's model and loss, given the JAX model's
    weights, give the same loss; there is no accuracy."""
    import jax

    from precond.bench.jax_models import tanh_mlp

    workload = WORKLOADS["teacher-student"]
    split = workload.load_split(0)
    params = workload.init_params(0)
    x, y = split.x_test[:64], split.y_test[:64]
    h = x.astype(np.float64)
    for i, layer in enumerate(params):
        h = h @ np.asarray(layer["w"], np.float64) + np.asarray(layer["b"])
        h = np.tanh(h) if i < len(params) - 1 else h
    expected = np.mean((h - y) ** 2)
    assert tanh_mlp(params, x).shape == y.shape
    np.testing.assert_allclose(float(workload.loss(params, x, y)), expected, rtol=1e-5)
    metrics = jax.jit(workload.metrics)(params, x, y)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    assert np.isnan(float(metrics["accuracy"]))

    torch = pytest.importorskip("torch")
    from precond.bench.torch_models import build_model
    from precond.bench.torch_runner import _loss_function

    model = build_model(workload.torch_model, 0)
    with torch.no_grad():
        for linear, layer in zip(model.layers, params, strict=True):
            linear.weight.copy_(torch.from_numpy(np.array(layer["w"]).T.copy()))
            linear.bias.copy_(torch.from_numpy(np.array(layer["b"])))
        loss = _loss_function(workload)(model(torch.from_numpy(x)), torch.from_numpy(y))
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-5)


def test_default_workloads_are_not_the_saturated_digits_classifiers():
    defaults = [name for name, w in WORKLOADS.items() if w.default]
    assert defaults == ["teacher-student", "char-lm"]
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).workloads == defaults


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


def test_batch_indices_are_deterministic_epochs_and_match_the_stream():
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
    # A time budget's open-ended stream draws the same batches.
    stream = BatchStream(10, 4, seed=3)
    np.testing.assert_array_equal(np.stack([stream.next() for _ in range(5)]), batches)


def test_char_lm_transformer_starts_uniform_is_causal_and_learns():
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


@pytest.mark.parametrize(
    ("text", "shape"), [("256x4", (256, 4)), (" 8x1", (8, 1)), ("64x2", (64, 2))]
)
def test_transformer_shape_builds_that_char_lm(text, shape):
    """``WIDTHxLAYERS`` (``precond.bench.arguments.transformer_shape``) gives
    a transformer of that width and depth that starts near the uniform loss."""
    import jax

    from precond.bench.arguments import transformer_shape
    from precond.bench.jax_models import init_char_lm

    assert transformer_shape(text) == shape
    if shape[0] > 64:
        return  # the small shapes check the model; this one only the parsing
    params = init_char_lm(0, d_model=shape[0], layers=shape[1])
    assert params["embedding"].shape == (256, shape[0])
    assert len(params["layers"]) == shape[1]
    split = get_workload("char-lm").load_split(0)
    x, y = split.x_train[:4], split.y_train[:4]
    loss = get_workload("char-lm").loss
    assert abs(float(jax.jit(loss)(params, x, y)) - np.log(256)) < 0.05


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("256", "not of the form WIDTHxLAYERS"),
        ("ax4", "not of the form WIDTHxLAYERS"),
        ("250x4", "a multiple of the 4 heads"),
        ("256x0", "both numbers >= 1"),
        ("0x2", "both numbers >= 1"),
    ],
)
def test_transformer_shape_refuses_bad_text(text, phrase):
    import argparse

    from precond.bench.arguments import transformer_shape

    with pytest.raises(argparse.ArgumentTypeError, match=phrase):
        transformer_shape(text)


def test_torch_models_match_the_jax_architectures():
    torch = pytest.importorskip("torch")
    import jax

    from precond.bench.torch_models import build_model

    for name, workload in WORKLOADS.items():
        shapes = jax.eval_shape(lambda w=workload: w.init_params(0))
        jax_count = sum(p.size for p in jax.tree.leaves(shapes))
        model = build_model(workload.torch_model, 0)
        torch_count = sum(p.numel() for p in model.parameters())
        # The torch head has no bias (the JAX head neither); equal parameter counts.
        assert torch_count == jax_count, name
        again = build_model(workload.torch_model, 0)
        for p, q in zip(model.parameters(), again.parameters()):
            assert torch.equal(p, q)
    model = build_model("char-lm", 0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, CHAR_LM_CONTEXT), generator=generator)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    # The initial loss is close to uniform over the 256 bytes.
    loss = torch.nn.functional.cross_entropy(a.reshape(-1, 256), tokens.reshape(-1))
    assert abs(loss.item() - math.log(256)) < 0.1


# ------------------------------------------------------------ steps to reach, loop


def test_reached_and_stayed_on_synthetic_curves():
    steps = [0, 10, 20, 30]
    reach = reached_and_stayed
    # Crosses between evaluations: linear interpolation of the step.
    assert reach(steps, [3.0, 2.0, 1.0, 0.5], 1.5) == pytest.approx(15.0)
    # Exactly on an evaluation.
    assert reach(steps, [3.0, 2.0, 1.0, 0.5], 1.0) == pytest.approx(20.0)
    # A transient dip does not count: the curve must stay at or below the target.
    # Here it dips to 0.5 at step 10, rises to 2.0 and comes back down to 1.0,
    # crossing 1.5 for good at step 25.
    assert reach(steps, [3.0, 0.5, 2.0, 1.0], 1.5) == pytest.approx(25.0)
    # A dip that never comes back (final loss above the target): not reached.
    assert reach(steps, [3.0, 0.5, 2.0, 2.5], 1.5) is None
    # Never reached, or below from the start.
    assert reach(steps, [3.0, 2.0, 1.0, 0.9], 0.5) is None
    assert reach(steps, [0.4, 0.3, 0.2, 0.1], 0.5) == 0.0
    # A non-finite point breaks the curve: no interpolation across it.
    assert reach(steps, [3.0, math.nan, 1.0, 0.5], 1.5) == 20.0
    assert reach(steps, [3.0, math.inf, math.inf, 5.0], 1.5) is None
    assert reach(steps, [3.0, 2.0, 1.0, 0.5], math.nan) is None
    # Wall-time axis: the same rule on seconds.
    assert reach([0.0, 0.5, 1.5], [2.0, 1.0, 0.0], 0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="3 x values but 2 losses"):
        reach([0, 1, 2], [1.0, 0.5], 0.7)

    assert value_at(steps, [3.0, 2.0, 1.0, 0.5], 25) == pytest.approx(0.75)
    assert value_at(steps, [3.0, 2.0, 1.0, 0.5], 0) == 3.0
    assert value_at(steps, [3.0, 2.0, 1.0, 0.5], 31) is None


def _run(optimizer, lr, seed, losses, times=None, **fields) -> RunResult:
    steps = [10 * i for i in range(len(losses))]
    times = times or [0.01 * s for s in steps]
    history = [
        {"step": s, "time_s": t, "train_loss": v, "val_loss": v, "val_accuracy": 0.5}
        for s, t, v in zip(steps, times, losses)
    ]
    values = {
        "framework": "jax",
        "workload": "w",
        "optimizer": optimizer,
        "learning_rate": lr,
        "schedule": "cosine",
        "weight_decay": 0.0,
        "seed": seed,
        "batch_size": 1,
        "budget": f"{steps[-1]} steps",
        "devices": 1,
        "steps": steps[-1],
        "final_train_loss": losses[-1],
        "final_val_loss": losses[-1],
        "final_val_accuracy": 0.5,
        "diverged": not math.isfinite(losses[-1]),
        "skipped_steps": 0,
        "median_step_ms": 10.0,
        "compile_s": 1.0,
        "train_s": times[-1],
        "param_bytes": 100,
        "state_bytes": 200,
        "history": history,
    }
    return RunResult(**(values | fields))


def test_loss_curve_reads_the_loss_asked_for():
    run = _run("adamw", 1e-3, 0, [3.0, 2.0, 1.0])
    run.history[0]["train_loss"] = math.nan  # as the runner records step 0
    run.history[1]["train_loss"], run.history[2]["train_loss"] = 2.5, 1.5
    assert loss_curve(run, "step") == ([0.0, 10.0, 20.0], [3.0, 2.0, 1.0])
    xs, train = loss_curve(run, "time_s", "train_loss")
    assert xs == pytest.approx([0.0, 0.1, 0.2])
    assert math.isnan(train[0])
    assert train[1:] == [2.5, 1.5]
    # The training curve reaches 2.0 between its evaluations at 10 and 20.
    curve = loss_curve(run, "step", "train_loss")
    assert reached_and_stayed(*curve, 2.0) == pytest.approx(15.0)


def test_run_from_json_inverts_write_json(tmp_path):
    run = _run("pro", 0.02, 1, [3.0, 2.0, math.inf], compile_s=None)
    run.history[0]["train_loss"] = math.nan  # as the runner records step 0
    run.minibatch_loss[:] = [2.5, math.nan]
    run.step_ms[:] = [10.0, 11.0]
    write_json([run.to_dict()], str(tmp_path / "runs.json"))
    (entry,) = json.loads((tmp_path / "runs.json").read_text())
    back = run_from_json(entry)
    assert back.compile_s is None  # null here means no separate compilation
    assert math.isnan(back.history[0]["train_loss"])
    assert math.isnan(back.final_val_loss)  # ±Inf is not kept, only "not finite"
    assert math.isnan(back.minibatch_loss[1])
    write_json([back.to_dict()], str(tmp_path / "again.json"))
    assert (tmp_path / "again.json").read_text() == (tmp_path / "runs.json").read_text()


def test_summary_selects_rates_and_compares_with_adamw():
    runs = [
        # AdamW: lr 1e-3 ends at 1.0 (mean of seeds 0.9 and 1.1), lr 3e-3 at 2.0.
        _run("adamw", 1e-3, 0, [3.0, 2.0, 1.5, 0.9]),
        _run("adamw", 1e-3, 1, [3.0, 2.0, 1.5, 1.1]),
        _run("adamw", 3e-3, 0, [3.0, 2.5, 2.2, 2.0]),
        _run("adamw", 3e-3, 1, [3.0, 2.5, 2.2, 2.0]),
        # Kron: lr 1e-2 diverged (NaN), lr 3e-3 reaches 1.0 at steps 15 and 10,
        # at 2× AdamW's step time (twice the seconds per step).
        _run("kron", 1e-2, 0, [3.0, math.nan]),
        _run("kron", 1e-2, 1, [3.0, 2.0, 1.0, 0.1]),
        _run(
            "kron",
            3e-3,
            0,
            [3.0, 1.5, 0.5, 0.4],
            [0, 0.2, 0.4, 0.6],
            median_step_ms=20.0,
            state_bytes=400,
        ),
        _run(
            "kron",
            3e-3,
            1,
            [3.0, 1.0, 0.5, 0.3],
            [0, 0.2, 0.4, 0.6],
            median_step_ms=20.0,
            state_bytes=400,
        ),
        # SGD never reaches AdamW's loss.
        _run("sgd", 0.1, 0, [3.0, 2.0, 1.8, 1.5]),
    ]
    chosen = select_learning_rates(runs)
    assert chosen[("jax", "w", "adamw")] == 1e-3
    assert chosen[("jax", "w", "kron")] == 3e-3  # a NaN loss counts as +inf
    rows = {r.optimizer: r for r in summarize(runs, baseline="adamw")}
    adamw, kron, sgd = rows["adamw"], rows["kron"], rows["sgd"]
    assert adamw.val_loss == pytest.approx(1.0)
    assert adamw.target == pytest.approx(1.0)
    assert adamw.val_loss_std == pytest.approx(np.std([0.9, 1.1], ddof=1))
    # Seed 0 crosses 1.0 at step 15 (1.5 → 0.5 over 10..20), seed 1 at step 10.
    assert kron.steps_to_target == pytest.approx(12.5)
    assert kron.steps_ratio == pytest.approx(12.5 / 30)
    # On the time axis: 0.3 s and 0.2 s, against AdamW's 0.3 s of training.
    assert kron.time_to_target == pytest.approx(0.25)
    assert kron.time_ratio == pytest.approx(0.25 / 0.3)
    assert kron.step_ratio == pytest.approx(2.0)
    assert kron.state_ratio == pytest.approx(2.0)
    assert kron.val_loss_at_baseline_steps == pytest.approx(0.35)
    # At AdamW's 0.3 s, Kron (seed 0: 1.0, seed 1: 0.75) is at 0.875.
    assert kron.val_loss_at_baseline_time == pytest.approx(0.875)
    assert kron.swept[1e-2] != kron.swept[1e-2]  # NaN: the mean over a diverged run
    assert sgd.steps_to_target is None
    assert sgd.steps_ratio is None
    table = format_table(list(rows.values()), baseline="adamw").splitlines()
    assert table[0].split()[:4] == ["framework", "workload", "optimizer", "rank"]
    sgd_line = next(line for line in table if " sgd " in line)
    assert "not reached" in sgd_line
    kron_line = next(line for line in table if " kron " in line)
    assert "12 (0.42)" in kron_line
    # Ranks by final validation loss: Kron 0.35, AdamW 1.0, SGD 1.5.
    assert kron_line.split()[3] == "1"
    assert sgd_line.split()[3] == "3"
    adamw_line = next(line for line in table if " adamw (baseline) " in line)
    assert adamw_line.split()[4] == "2"
    (line,) = format_winners(list(rows.values())).splitlines()
    assert line == (
        "w (jax): kron has the lowest mean final validation loss, 0.35 ± 0.071; "
        "runner-up adamw, 1 ± 0.14."
    )
    document = json_document(runs, list(rows.values()), config={}, environment={})
    text = json.dumps(document, allow_nan=False)  # would raise on NaN
    assert json.loads(text)["runs"][4]["final_val_loss"] is None


def test_winner_within_the_seeds_spread_is_not_a_settled_order():
    runs = [
        _run("adamw", 1e-3, 0, [3.0, 1.0]),  # mean 1.2, std 0.28
        _run("adamw", 1e-3, 1, [3.0, 1.4]),
        _run("kron", 1e-3, 0, [3.0, 1.1]),  # mean 1.15, std 0.07
        _run("kron", 1e-3, 1, [3.0, 1.2]),
        _run("sgd", 1e-3, 0, [3.0, math.nan]),  # diverged: never wins
        _run("sgd", 1e-3, 1, [3.0, math.nan]),
    ]
    (winner,) = winners(summarize(runs))
    assert winner.best.optimizer == "kron"
    assert winner.runner_up.optimizer == "adamw"
    assert winner.within_spread
    line = format_winners(summarize(runs))
    assert line.endswith("(within the seeds' spread: not a settled order).")
    # With one seed there is no spread to be within.
    (winner,) = winners(summarize(runs[::2]))
    assert (winner.best.optimizer, winner.within_spread) == ("adamw", False)


def test_fastest_to_adamw_names_the_least_time_and_the_fewest_steps():
    # Evaluations every 10 steps; AdamW ends at 1.0 at step 30 after 0.3 s.
    runs = [
        _run("adamw", 1e-3, 0, [3.0, 2.0, 1.5, 1.0]),
        # Kron: the fewest steps (1.0 at step 10) but 4x AdamW's step time (0.4 s).
        _run("kron", 1e-3, 0, [3.0, 1.0, 0.8, 0.7], [0, 0.4, 0.8, 1.2]),
        # Muon: more steps (step 20) at AdamW's step time: 0.2 s, the least.
        _run("muon", 1e-3, 0, [3.0, 1.5, 1.0, 0.9]),
        # SGD never reaches 1.0.
        _run("sgd", 1e-3, 0, [3.0, 2.5, 2.0, 1.8]),
    ]
    rows = summarize(runs)
    (found,) = fastest(rows)
    assert found.target == pytest.approx(1.0)
    assert found.by_time.optimizer == "muon"
    assert found.by_steps.optimizer == "kron"
    line = format_fastest(rows)
    assert line == (
        "w (jax): to adamw's final validation loss 1, fastest in time muon "
        "(0.2 s, 0.67 of adamw's); fewest steps kron (10 steps, 0.33 of adamw's)."
    )
    markdown = format_markdown(
        rows, command="precond bench", config={}, environment={}, plots=[]
    )
    assert f"- {line}" in markdown
    document = json_document(runs, rows, config={}, environment={})
    (entry,) = document["fastest"]
    assert entry["by_time"]["optimizer"] == "muon"
    assert entry["by_time"]["time_to_target"] == pytest.approx(0.2)
    assert entry["by_steps"] == {
        "optimizer": "kron",
        "steps_to_target": pytest.approx(10.0),
        "time_to_target": pytest.approx(0.4),
    }
    # Without Kron and Muon, AdamW itself is the fastest to its own loss.
    rows = summarize([r for r in runs if r.optimizer in ("adamw", "sgd")])
    (found,) = fastest(rows)
    assert (found.by_time.optimizer, found.by_steps.optimizer) == ("adamw", "adamw")
    # Two AdamW seeds ending at 0.9 and 1.1 (target 1.0): the mean counts only
    # when every seed reaches it, and none of these runs does.
    runs = [
        _run("adamw", 1e-3, 0, [3.0, 2.0, 0.9]),
        _run("adamw", 1e-3, 1, [3.0, 2.0, 1.1]),
        _run("muon", 1e-3, 0, [3.0, 2.0, 1.2]),
        _run("muon", 1e-3, 1, [3.0, 2.0, 0.5]),
    ]
    rows = summarize(runs)
    assert format_fastest(rows) == (
        "w (jax): to adamw's final validation loss 1, none reached it."
    )
    (entry,) = json_document(runs, rows, config={}, environment={})["fastest"]
    assert entry["by_time"] is None
    assert entry["by_steps"] is None
    # Without a baseline run there is no target, and no line.
    assert format_fastest(summarize(runs[2:])) == ""


def test_verdict_names_the_decisive_metric_and_says_when_precond_loses():
    """precond's fastest optimizer against the other libraries' fastest, by the
    time to AdamW's final loss; a loss is said plainly."""
    runs = [
        _run("adamw", 1e-3, 0, [3.0, 2.0, 1.5, 1.0]),
        _run("kron", 1e-3, 0, [3.0, 1.0, 0.8, 0.7], [0, 0.4, 0.8, 1.2]),
        _run("muon", 1e-3, 0, [3.0, 1.5, 1.0, 0.9]),
    ]
    references = ("adamw", "muon", "sgd")
    lines = format_verdicts(summarize(runs), references).splitlines()
    assert lines[0].startswith("Decisive metric: the training time to reach adamw")
    assert lines[1] == (
        "w (jax): precond does not win: kron 0.4 s, muon 0.2 s (2.00×)."
    )
    # Kron at Muon's step time: 0.1 s, half of Muon's.
    runs[1] = _run("kron", 1e-3, 0, [3.0, 1.0, 0.8, 0.7])
    assert format_verdicts(summarize(runs), references).splitlines()[1] == (
        "w (jax): precond wins: kron 0.1 s, muon 0.2 s (0.50×)."
    )
    # Kron never reaches the target.
    runs[1] = _run("kron", 1e-3, 0, [3.0, 2.5, 2.0, 1.8])
    assert format_verdicts(summarize(runs), references).splitlines()[1] == (
        "w (jax): precond does not win: muon reaches adamw's final validation "
        "loss in 0.2 s; none of precond's optimizers reaches it."
    )
    markdown = format_markdown(
        summarize(runs),
        command="precond bench",
        config={},
        environment={},
        plots=[],
        references=references,
    )
    assert "## Verdict" in markdown
    assert "- w (jax): precond does not win: muon" in markdown
    # Without a baseline there is no target and no verdict.
    assert format_verdicts(summarize(runs[1:]), references) == ""


def test_results_table_has_its_header_and_replaces_the_marked_block():
    runs = [
        _run("adamw", 1e-3, 0, [3.0, 2.0, 1.5, 1.0]),
        _run("kron", 1e-3, 0, [3.0, 1.0, 0.8, 0.7], [0, 0.4, 0.8, 1.2]),
    ]
    environment = {"cpu": "Some CPU", "available_cores": 2, "commit": "abc1234"}
    table = results_table(
        summarize(runs),
        command="precond bench --seeds 3",
        environment=environment,
        date="2026-12-07T01:00:00Z",
    )
    header, blank, *rows = table.splitlines()
    assert header.startswith(
        "`precond bench --seeds 3`: Some CPU, 2 cores, commit `abc1234`, 2026-12-07"
    )
    assert blank == ""
    assert rows[0].startswith("| workload | optimizer | val loss | time to adamw")
    assert rows[2].startswith("| w | adamw | 1 | 0.3s (1.00) | 30 (1.00) |")
    assert rows[3].startswith("| w | kron | 0.7 | 0.4s (1.33) | 10 (0.33) |")
    text = f"# Title\n\n{RESULTS_BEGIN}\nold table\n{RESULTS_END}\n\nrest\n"
    replaced = replace_results_block(text, table)
    assert replaced == f"# Title\n\n{RESULTS_BEGIN}\n{table}{RESULTS_END}\n\nrest\n"
    assert replace_results_block(replaced, table) == replaced  # idempotent
    with pytest.raises(ValueError, match=r"README\.md has no results block"):
        replace_results_block("# no markers\n", table, "README.md")


def test_lr_multiplier_warms_up_then_decays_to_zero():
    assert lr_multiplier(0.0, "cosine") == 0.0
    assert lr_multiplier(0.025, "cosine") == pytest.approx(0.5)
    assert lr_multiplier(0.05, "cosine") == pytest.approx(1.0)
    assert lr_multiplier(0.525, "cosine") == pytest.approx(0.5)
    assert lr_multiplier(1.0, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(2.0, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(0.7, "constant") == 1.0


@pytest.mark.parametrize(("warmup", "final"), [(0.01, 0.1), (0.2, 0.5), (0.0, 0.0)])
def test_lr_multiplier_with_a_warmup_and_a_floor(warmup, final):
    """Linear to 1 over ``warmup``, then a cosine from 1 down to ``final``, halfway
    at the middle of the decay and never below ``final``."""
    if warmup:
        assert lr_multiplier(warmup / 2, "cosine", warmup, final) == pytest.approx(0.5)
    assert lr_multiplier(warmup, "cosine", warmup, final) == pytest.approx(1.0)
    middle = (1 + warmup) / 2
    assert lr_multiplier(middle, "cosine", warmup, final) == pytest.approx(
        final + (1 - final) / 2
    )
    assert lr_multiplier(1.0, "cosine", warmup, final) == pytest.approx(final)
    decay = [
        lr_multiplier(warmup + i / 100, "cosine", warmup, final) for i in range(100)
    ]
    assert all(a >= b >= final for a, b in itertools.pairwise(decay))


def test_run_config_schedule_fractions_are_checked_and_recorded():
    with pytest.raises(ValueError, match=r"lr_warmup_fraction=1\.0"):
        RunConfig(lr_warmup_fraction=1.0)
    with pytest.raises(ValueError, match=r"lr_final_fraction=-0\.1"):
        RunConfig(lr_final_fraction=-0.1)
    config = RunConfig(steps=2000, lr_warmup_fraction=0.01, lr_final_fraction=0.1)
    assert config.multiplier(1.0) == pytest.approx(0.1)
    assert config.schedule_text() == (
        "cosine (warm-up 0.01 of the budget, to 0.1 of the peak)"
    )
    assert RunConfig().schedule_text() == "cosine"


def test_training_loop_budgets_evaluations_and_divergence():
    evaluations = []

    def evaluate():
        evaluations.append(len(scales))
        return 1.0 / (1 + len(scales)), 0.5

    scales: list[float] = []

    def step(idx, scale):
        assert idx.shape == (4,)
        scales.append(scale)
        return 2.0, len(scales) in (3, 7)  # the step guard refused steps 3 and 7

    config = RunConfig(steps=25, batch_size=4, eval_every=10, warmup_steps=0)
    loop = training_loop(step, evaluate, config, n_train=10)
    assert [h["step"] for h in loop.history] == [0, 10, 20, 25]
    assert evaluations == [0, 10, 20, 25]
    assert len(loop.minibatch_loss) == len(loop.step_seconds) == 25
    assert math.isnan(loop.history[0]["train_loss"])
    assert loop.history[-1]["train_loss"] == 2.0
    assert loop.history[-1]["val_loss"] == pytest.approx(1 / 26)
    # Step k runs at the schedule's value at (k − ½)/25 of the budget.
    assert scales[0] == pytest.approx(lr_multiplier(0.5 / 25, "cosine"))
    assert scales[-1] == pytest.approx(lr_multiplier(24.5 / 25, "cosine"))
    assert not loop.diverged
    assert loop.skipped_steps == 2

    # A time budget stops after the step that uses it up.
    scales.clear()
    timed = RunConfig(steps=None, time_budget_s=0.05, batch_size=4, eval_every=1000)

    def slow_step(idx, scale):
        import time

        time.sleep(0.01)
        scales.append(scale)
        return 1.0, False

    loop = training_loop(slow_step, evaluate, timed, n_train=10)
    assert 2 <= len(scales) <= 6
    assert loop.train_s >= 0.05
    assert [h["step"] for h in loop.history] == [0, len(scales)]
    # The first step of a time budget starts the warm-up at rate 0.
    assert scales[0] == 0.0

    # A non-finite loss stops the run at that step.
    losses = iter([1.0, 0.5, math.nan, 0.1])
    loop = training_loop(
        lambda idx, scale: (next(losses), False), evaluate, config, n_train=10
    )
    assert loop.diverged
    assert len(loop.minibatch_loss) == 3
    assert loop.history[-1]["step"] == 3


# -------------------------------------------------------------------------- Muon


def _muon_adam_rate(workload: str, framework: str) -> float:
    return OPTIMIZERS["muon"].part_learning_rates["adam_learning_rate"][framework][
        workload
    ]


def _torch_names(model, params) -> list[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for p in params]


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_muon_trains_the_same_hidden_matrices_in_both_frameworks(workload):
    """Muon gets the hidden-layer weight matrices, AdamW the embeddings, the
    output layer, the convolution kernels, biases and norms: in JAX (the Muon
    momentum optax keeps) and in PyTorch (the parameters of each optimizer)."""
    import jax
    from optax import MaskedNode

    spec, work = OPTIMIZERS["muon"], WORKLOADS[workload]
    params = work.init_params(0)
    hidden = jax.tree.leaves(work.hidden_matrices(params))
    leaves = jax.tree.leaves_with_path(params)
    jax_hidden = [
        (jax.tree_util.keystr(k), x.shape)
        for (k, x), h in zip(leaves, hidden, strict=True)
        if h
    ]
    state = spec.build("jax", work, 0.02, 1e-4).init(params)
    muon_state = state.inner_states["muon"].inner_state[0]
    momentum = jax.tree.leaves(
        muon_state.mu, is_leaf=lambda x: isinstance(x, MaskedNode)
    )
    assert [not isinstance(m, MaskedNode) for m in momentum] == hidden
    adam_state = state.inner_states["adam"].inner_state[0]
    moments = jax.tree.leaves(
        adam_state.mu, is_leaf=lambda x: isinstance(x, MaskedNode)
    )
    assert [isinstance(m, MaskedNode) for m in moments] == hidden
    # Every hidden matrix is 2-D; no embedding table or output layer is hidden.
    assert jax_hidden
    assert all(len(shape) == 2 for _, shape in jax_hidden)
    output_layer = f"[{len(params) - 1}]" if isinstance(params, list) else "head"
    assert not any(
        name in path
        for path, _ in jax_hidden
        for name in ("embedding", "position", "head", "dense_2", output_layer)
    )
    expected = {
        "teacher-student": [f"layers.{i}.weight" for i in range(3)],
        "char-lm-large": [
            f"layers.{i}.{name}.weight"
            for i in range(4)
            for name in ("attn_qkv", "attn_out", "mlp_in", "mlp_out")
        ],
        "char-lm-deep": [
            f"layers.{i}.{name}.weight"
            for i in range(6)
            for name in ("attn_qkv", "attn_out", "mlp_in", "mlp_out")
        ],
        "digits-mlp": ["layers.0.weight", "layers.1.weight"],
        "digits-cnn": ["dense_1.weight"],
        "char-lm": [
            f"layers.{i}.{name}.weight"
            for i in range(2)
            for name in ("attn_qkv", "attn_out", "mlp_in", "mlp_out")
        ],
    }[workload]

    torch = pytest.importorskip("torch")
    from precond.bench.torch_models import build_model

    model = build_model(work.torch_model, 0)
    optimizer = spec.build("torch", work, 0.02, 1e-4, model)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon)
    assert type(adamw) is torch.optim.AdamW
    (muon_group,), (adamw_group,) = muon.param_groups, adamw.param_groups
    assert _torch_names(model, muon_group["params"]) == expected
    rest = [n for n, _ in model.named_parameters() if n not in expected]
    assert _torch_names(model, adamw_group["params"]) == rest
    # The same layers in both frameworks (torch stores Linear weights (out, in)).
    shapes = sorted(tuple(p.shape[::-1]) for p in muon_group["params"])
    assert shapes == sorted(tuple(shape) for _, shape in jax_hidden)
    # Both parts decay weights; the AdamW part runs at its own rate.
    assert muon_group["weight_decay"] == adamw_group["weight_decay"] == 1e-4
    adam_lr = _muon_adam_rate(workload, "torch")
    assert adamw_group["lr"] == adam_lr
    # The bench's schedule scales both rates, keeping their ratio.
    optimizer.set_lr(0.25 * 0.02)
    assert muon_group["lr"] == 0.25 * 0.02
    assert adamw_group["lr"] == pytest.approx(0.25 * adam_lr)


def _well_conditioned(shape, seed):
    """A matrix of ``shape`` with singular values spread over [1, 8]."""
    rng = np.random.default_rng(seed)
    m, n = shape
    r = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, r)))
    v, _ = np.linalg.qr(rng.standard_normal((n, r)))
    return ((u * np.linspace(1.0, 8.0, r)) @ v.T).astype(np.float32)


def _check_muon_step(hidden_updates, other_updates, lr, adam_lr):
    """A first step orthogonalizes each hidden matrix's gradient (its singular
    values, spread over [1, 8], all come out near 1, times lr and the shape
    factor sqrt(max(1, out/in))), and moves every other entry by about ±adam_lr
    (Adam's first step is sign(g) times its rate)."""
    for (fan_in, fan_out), update in hidden_updates:
        scale = lr * math.sqrt(max(1.0, fan_out / fan_in))
        singular = np.linalg.svd(
            np.asarray(update, np.float64) / scale, compute_uv=False
        )
        assert singular.min() > 0.5, singular
        assert singular.max() < 1.5, singular
    for update in other_updates:
        size = np.abs(np.asarray(update, np.float64)).ravel() / adam_lr
        # 1 for torch's AdamW; optax.contrib.muon's Adam part is Nesterov's,
        # whose first step is (1 + 2·0.9)/(1 + 0.9) ≈ 1.47.
        assert np.ptp(size) < 1e-2 * size.max()  # ε = 1e-8 against small |g|
        assert size.min() > 0.99, size
        assert size.max() < 1.5, size


def test_muon_first_step_orthogonalizes_hidden_matrices_only():
    import jax.numpy as jnp

    spec, work = OPTIMIZERS["muon"], WORKLOADS["digits-mlp"]
    lr = 0.02
    adam_lr = _muon_adam_rate("digits-mlp", "jax")
    params = work.init_params(0)
    grads = [
        {
            "w": jnp.asarray(_well_conditioned(p["w"].shape, i)),
            "b": jnp.ones_like(p["b"]),
        }
        for i, p in enumerate(params)
    ]
    tx = spec.build("jax", work, lr, 0.0)
    updates, _ = tx.update(grads, tx.init(params), params)
    _check_muon_step(
        [(layer["w"].shape, -u["w"]) for layer, u in zip(params[:2], updates[:2])],
        [updates[2]["w"], *(u["b"] for u in updates)],
        lr,
        adam_lr,
    )

    torch = pytest.importorskip("torch")
    from precond.bench.torch_models import build_model

    adam_lr = _muon_adam_rate("digits-mlp", "torch")
    model = build_model(work.torch_model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = spec.build("torch", work, lr, 0.0, model)
    for i, layer in enumerate(model.layers):
        layer.weight.grad = torch.from_numpy(_well_conditioned(layer.weight.shape, i))
        layer.bias.grad = torch.ones_like(layer.bias)
    optimizer.step()
    moved = [(b - p.detach()).numpy() for b, p in zip(before, model.parameters())]
    names = [n for n, _ in model.named_parameters()]
    hidden = {"layers.0.weight", "layers.1.weight"}
    _check_muon_step(
        [
            (p.shape[::-1], m)
            for n, p, m in zip(names, model.parameters(), moved)
            if n in hidden
        ],
        [m for n, m in zip(names, moved) if n not in hidden],
        lr,
        adam_lr,
    )


def test_lr_sets_muons_adamw_part_and_the_sweep_scales_muons_rate_only():
    argv = ["bench", "--optimizers", "muon", "--lr", "muon=0.05"]
    args = cli.build_parser().parse_args(
        [*argv, "--lr", "muon.adam_learning_rate=1e-3"]
    )
    overrides = cli._check_lr(args, [OPTIMIZERS["muon"]])
    assert overrides == {"muon": 0.05, "muon.adam_learning_rate": 1e-3}
    jobs = suite.plan(
        ["jax", "torch"],
        [WORKLOADS["digits-mlp"], WORKLOADS["char-lm"]],
        [OPTIMIZERS["muon"], OPTIMIZERS["adamw"]],
        seeds=[0],
        lr_multipliers=[1.0, 3.0],
        lr_overrides=overrides,
    )
    muon = [j for j in jobs if j.spec.name == "muon"]
    assert len(muon) == 8
    assert sorted({j.learning_rate for j in muon}) == [0.05, pytest.approx(0.15)]
    for job in muon:
        arguments = job.spec.factory_arguments(job.framework, job.workload)
        assert arguments["adam_learning_rate"] == 1e-3
    # The registry keeps its rates, and AdamW is not affected.
    assert _muon_adam_rate("char-lm", "jax") != 1e-3
    adamw = [j for j in jobs if j.spec.name == "adamw"]
    assert adamw[0].spec is OPTIMIZERS["adamw"]


def test_muon_and_pro_adamw_are_in_the_default_suite():
    for frameworks in (["jax"], ["torch"], ["jax", "torch"]):
        names = [s.name for s in cli._resolve_optimizers(None, frameworks)]
        assert "muon" in names, frameworks
        assert "adamw" in names, frameworks
        assert "pro-adamw" in names, frameworks
    for name in ("muon", "pro", "pro-adamw"):
        assert set(OPTIMIZERS[name].frameworks()) == {"jax", "torch"}, name


@pytest.mark.parametrize("workload", ["teacher-student", "digits-cnn", "char-lm"])
def test_bench_s_pro_adamw_is_the_alias_called_with_the_rate_alone(workload):
    """The bench measures the one-call alias as a user calls it: the same
    update as ``pro_adamw(lr, weight_decay=...)`` (its own split of the
    parameters, not Muon's), and in PyTorch the same split as
    ``ProAdamW(model.named_parameters(), ...)``."""
    import jax
    import jax.numpy as jnp

    import precond.jax as pj

    spec, entry = OPTIMIZERS["pro-adamw"], WORKLOADS[workload]
    params = entry.init_params(0)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01) + 0.1 * p, params)
    expected = pj.pro_adamw(0.01, weight_decay=1e-4)
    built = spec.build("jax", entry, 0.01, 1e-4)
    got, _ = built.update(grads, built.init(params), params)
    want, _ = expected.update(grads, expected.init(params), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    torch = pytest.importorskip("torch")
    from precond.bench.torch_models import build_model
    from precond.torch import ProAdamW

    model = build_model(entry.torch_model, 0)
    direct = ProAdamW(model.named_parameters(), lr=0.01, weight_decay=1e-4)
    bench = spec.build("torch", entry, 0.01, 1e-4, model=model).optimizer
    adamw_parts = []
    for optimizer in (direct, bench):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01)
        optimizer.step()
        adamw_parts.append(
            [
                name
                for name, p in model.named_parameters()
                if "exp_avg" in optimizer.state[p]
            ]
        )
    assert adamw_parts[0] == adamw_parts[1]


# ------------------------------------------------------------------- full suites


def _suite_optimizers(framework: str) -> list[str]:
    """Every registered optimizer that runs in ``framework`` here."""
    return [
        name
        for name, spec in OPTIMIZERS.items()
        if framework in spec.frameworks() and (name != "kfac" or HAS_KFAC)
    ]


def _suite(tmp_path, capsys, workload: str, framework: str):
    folder = tmp_path / workload
    status = cli.main(
        [
            "bench",
            "--frameworks",
            framework,
            "--workloads",
            workload,
            "--steps",
            "3",
            "--optimizers",
            ",".join(_suite_optimizers(framework)),
            "--batch-size",
            "16",
            "--output",
            str(folder),
        ]
    )
    captured = capsys.readouterr()
    document = json.loads((folder / "results.json").read_text())
    markdown = (folder / "report.md").read_text()
    assert status == 0, captured.err
    return document, markdown, captured.out, folder


TINY_TEST_ROWS = 48
# The tiny suite's workloads: all but char-lm-deep, which is char-lm-large's
# code and width with two more blocks (every optimizer would compile a deeper
# copy of the same program, and nothing the suite checks depends on depth).
TINY_SUITE_WORKLOADS = [name for name in WORKLOADS if name != "char-lm-deep"]


@pytest.fixture
def small_test_splits(monkeypatch):
    """Every workload scored on its first TINY_TEST_ROWS test rows: unoptimised
    programs make scoring the full splits the slowest part of a tiny suite, and
    what the suite checks (the report agrees with the runs) does not depend on it."""
    for name, workload in list(WORKLOADS.items()):

        def load_split(seed, load=workload.load_split):
            split = load(seed)
            return dataclasses.replace(
                split,
                x_test=split.x_test[:TINY_TEST_ROWS],
                y_test=split.y_test[:TINY_TEST_ROWS],
            )

        monkeypatch.setitem(
            WORKLOADS, name, dataclasses.replace(workload, load_split=load_split)
        )


@pytest.mark.usefixtures("small_test_splits")
@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("workload", TINY_SUITE_WORKLOADS)
def test_tiny_suite_of_every_optimizer_writes_a_consistent_report(
    workload, framework, tmp_path, capsys
):
    if not cli.module_installed(framework):
        pytest.skip(f"{framework} is not installed")
    document, markdown, out, folder = _suite(tmp_path, capsys, workload, framework)
    frameworks = (framework,)
    expected = {(f, name) for f in frameworks for name in _suite_optimizers(f)}
    runs = {(r["framework"], r["optimizer"]): r for r in document["runs"]}
    assert set(runs) == expected
    summary = {(s["framework"], s["optimizer"]): s for s in document["summary"]}
    assert set(summary) == expected

    import jax

    shapes = jax.eval_shape(lambda: WORKLOADS[workload].init_params(0))
    jax_params = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(shapes))
    for key, run in runs.items():
        assert run["steps"] == 3
        assert len(run["minibatch_loss"]) == len(run["step_ms"]) == 3
        # Evaluated before the first step and after the last.
        assert [h["step"] for h in run["history"]] == [0, 3]
        final = run["history"][-1]
        assert run["final_val_loss"] == final["val_loss"]
        assert run["final_val_accuracy"] == final["val_accuracy"]
        assert run["final_train_loss"] == pytest.approx(np.mean(run["minibatch_loss"]))
        assert run["train_s"] == pytest.approx(sum(run["step_ms"]) / 1e3, rel=1e-6)
        assert run["learning_rate"] == OPTIMIZERS[key[1]].learning_rate(
            workload, framework
        )
        assert run["param_bytes"] == jax_params
        assert run["state_bytes"] > 0
        assert (run["compile_s"] is None) == (key[0] == "torch")
        assert run["skipped_steps"] == 0
        # The summary of one seed repeats the run; the table prints it.
        row = summary[key]
        assert row["val_loss"] == run["final_val_loss"]
        assert row["steps"] == 3
        line = next(
            line
            for line in out.splitlines()
            if line.split()[:3] == [*key[:1], workload, key[1]]
        )
        cells = line.replace(" (baseline)", "").split()
        assert cells[5] == f"{run['final_val_loss']:.4g}"
        name = f"{key[1]} (baseline)" if key[1] == "adamw" else key[1]
        assert f"| {key[0]} | {workload} | {name} | " in markdown
    # AdamW keeps two moments like the parameters, plus one 4-byte step count
    # (JAX) or one per parameter tensor (torch); SGD one momentum.
    counts = 1 if framework == "jax" else len(jax.tree.leaves(shapes))
    adamw = runs[framework, "adamw"]
    assert adamw["state_bytes"] == 2 * jax_params + 4 * counts
    assert runs[framework, "sgd"]["state_bytes"] == jax_params
    assert summary[framework, "adamw"]["target"] == adamw["final_val_loss"]
    for framework in frameworks:
        assert (folder / f"{workload}-{framework}.png").stat().st_size > 1000
        assert f"({workload}-{framework}.png)" in markdown
    # The winner is named, in the terminal and in the report.
    best = min(runs.values(), key=lambda r: r["final_val_loss"])
    winner = f"{workload} ({framework}): {best['optimizer']} has the lowest"
    assert winner in out
    # No step's gradient was refused by the step guard (over-skipping check).
    skipped = "Steps skipped by the step guard (non-finite or overflowing gradients)"
    assert f"{skipped}: none." in out
    assert f"{skipped}: none." in markdown
    assert f"- {winner}" in markdown
    # So are the fastest to AdamW's final validation loss, in time and in steps.
    fastest_line = f"{workload} ({framework}): to adamw's final validation loss "
    assert fastest_line in out
    assert f"- {fastest_line}" in markdown
    (entry,) = document["fastest"]
    assert entry["target"] == runs[framework, "adamw"]["final_val_loss"]
    # And the verdict: the decisive metric, and whether precond wins here.
    assert "Decisive metric: the training time to reach adamw" in out
    pattern = rf"^{workload} \({framework}\): (precond|no optimizer)"
    verdict = re.search(pattern, out, re.M)
    assert verdict is not None, out
    assert f"- {verdict[0]}" in markdown
    shown = workload if framework == "jax" else f"{workload} ({framework})"
    table = (folder / "results-table.md").read_text()
    assert table.count(f"| {shown} |") == len(runs)
    assert "report written to" in out
    # What the figures depend on is recorded: versions, CPU, cores, threads and
    # the exact command.
    env = document["environment"]
    for key in ("precond", "numpy", framework, "python", "cpu", "cpu_count"):
        assert env[key], key
    assert env["threads"] == available_cores()
    if framework == "torch":
        assert env["torch_threads"] == env["threads"]
        assert env["torch_interop_threads"] >= 1
    else:  # jax started before the bench (tests/conftest.py): its pool stays
        assert env["xla_pool_threads"] == os.environ.get("PJRT_NPROC", "cores")
    assert document["config"]["command"].startswith("precond bench --frameworks")


def test_sweep_and_seeds_select_the_best_mean(tmp_path, capsys):
    folder = tmp_path / "sweep"
    argv = ["bench", "--frameworks", "jax", "--workloads", "digits-mlp"]
    argv += ["--optimizers", "adamw", "--steps", "4", "--batch-size", "32"]
    argv += ["--lr-sweep", "0.1,10", "--seeds", "2", "--seed", "5"]
    argv += ["--output", str(folder), "--json", str(tmp_path / "copy.json")]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    # One progress bar per run, on stderr only.
    assert "jax digits-mlp adamw lr 0.0003 seed 5" in captured.err
    assert "4/4" in captured.err
    assert "4/4" not in captured.out
    document = json.loads((folder / "results.json").read_text())
    assert document == json.loads((tmp_path / "copy.json").read_text())
    runs = document["runs"]
    pairs = sorted((r["learning_rate"], r["seed"]) for r in runs)
    assert [seed for _, seed in pairs] == [5, 6, 5, 6]
    np.testing.assert_allclose([lr for lr, _ in pairs], [3e-4, 3e-4, 3e-2, 3e-2])
    means = {
        lr: np.mean([r["final_val_loss"] for r in runs if r["learning_rate"] == lr])
        for lr in {r["learning_rate"] for r in runs}
    }
    (row,) = document["summary"]
    assert row["learning_rate"] == min(means, key=means.get)
    assert row["val_loss"] == pytest.approx(means[row["learning_rate"]])
    assert row["seeds"] == [5, 6]
    markdown = (folder / "report.md").read_text()
    assert "## Learning-rate sweep" in markdown
    assert f"**{row['learning_rate']:g}: " in markdown


def test_interrupt_keeps_finished_runs(tmp_path, capsys, monkeypatch):
    real = suite.run_job
    calls = []

    def interrupt_second(job, *args, **kwargs):
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(job, *args, **kwargs)

    monkeypatch.setattr(suite, "run_job", interrupt_second)
    folder = tmp_path / "interrupted"
    argv = ["bench", "--frameworks", "jax", "--workloads", "digits-mlp"]
    argv += ["--optimizers", "adamw,sgd", "--steps", "2", "--no-progress"]
    argv += ["--output", str(folder)]
    assert cli.main(argv) == cli.INTERRUPTED
    captured = capsys.readouterr()
    assert "interrupted after 1 of 2 runs" in captured.err
    document = json.loads((folder / "results.json").read_text())
    assert document["interrupted"] is True
    assert [r["optimizer"] for r in document["runs"]] == ["adamw"]
    assert "**Interrupted**" in (folder / "report.md").read_text()


def test_devices_shard_the_jax_batch(tmp_path, capsys):
    import jax

    assert jax.device_count() >= 8  # tests/conftest.py
    argv = ["bench", "--frameworks", "jax", "--workloads", "digits-mlp"]
    argv += ["--optimizers", "adamw,sgd", "--steps", "2", "--batch-size", "16"]
    argv += ["--devices", "8", "--no-progress", "--no-plots"]
    argv += ["--output", str(tmp_path / "sharded")]
    assert cli.main(argv) == 0
    capsys.readouterr()
    document = json.loads((tmp_path / "sharded" / "results.json").read_text())
    assert [r["devices"] for r in document["runs"]] == [8, 8]
    assert all(math.isfinite(r["final_val_loss"]) for r in document["runs"])


# -------------------------------------------------------------------------- CLI


def test_list_names_every_workload_and_optimizer(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, spec in OPTIMIZERS.items():
        (at,) = [i for i, line in enumerate(lines) if line.split()[:1] == [name]]
        # Its tuned rate on every workload, in each of its frameworks.
        for offset, framework in enumerate(spec.frameworks(), start=1):
            rates = ", ".join(
                f"{w} {spec.learning_rate(w, framework):g}" for w in WORKLOADS
            )
            assert lines[at + offset].split() == [framework, "lr:", *rates.split()]
        # Then the rates of a part trained by a second rule (Muon's AdamW part).
        offset = at + len(spec.frameworks())
        for keyword, by_framework in spec.part_learning_rates.items():
            for framework in spec.frameworks():
                offset += 1
                rates = ", ".join(
                    f"{w} {by_framework[framework][w]:g}" for w in WORKLOADS
                )
                assert lines[offset].split() == [
                    framework,
                    f"{keyword}:",
                    *rates.split(),
                ]
    muon = next(i for i, line in enumerate(lines) if line.split()[:1] == ["muon"])
    assert lines[muon + 3].split()[:2] == ["jax", "adam_learning_rate:"]
    for name, workload in WORKLOADS.items():
        assert any(
            line.split()[:3] == [name, str(workload.steps), "steps,"]
            for line in out.splitlines()
        )


def test_help_documents_every_flag(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    flags = {
        option
        for action in cli.build_parser()
        ._subparsers._group_actions[0]
        .choices["bench"]
        ._actions
        for option in action.option_strings
    }
    assert len(flags) > 15
    for flag in flags:
        assert re.search(rf"{flag}\b", out), flag


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--optimizers", "kron,lion"], "unknown optimizer 'lion'"),
        (["--optimizers", "kron,kron"], "more than once"),
        (["--workloads", "imagenet"], "unknown workload 'imagenet'"),
        (["--frameworks", "tensorflow"], "unknown framework 'tensorflow'"),
        (["--steps", "0"], "--steps: 0 must be an integer >= 1"),
        (["--steps", "-3"], "--steps: -3 must be an integer >= 1"),
        (["--steps", "ten"], "'ten' is not an integer"),
        (["--time-budget", "0"], "--time-budget: 0 must be a number > 0"),
        (["--time-budget", "nan"], "--time-budget: nan must be a number > 0"),
        (["--time-budget", "soon"], "'soon' is not a number"),
        (["--steps", "5", "--time-budget", "9"], "not allowed with argument"),
        (["--batch-size", "0"], "--batch-size: 0 must be an integer >= 1"),
        (["--seed", "-1"], "--seed: -1 must be an integer >= 0"),
        (["--seeds", "0"], "--seeds: 0 must be an integer >= 1"),
        (["--lr-sweep", "0.3,0"], "multiplier 0 must be a finite number > 0"),
        (["--lr-sweep", "0.3,x"], "multiplier 'x' is not a number"),
        (["--lr", "kron=x"], "learning rate for 'kron': 'x' is not a number"),
        (["--lr-sweep", "1,1"], "more than once"),
        (["--lr", "kron"], "not of the form NAME=VALUE"),
        (["--lr", "lion=1e-3"], "unknown optimizer 'lion'"),
        (["--lr", "kron=0"], "must be a finite number > 0"),
        (["--lr", "kron=nan"], "must be a finite number > 0"),
        (["--lr", "adamw=1e-3", "--optimizers", "kron"], "not among the optimizers"),
        (["--lr", "kron=1e-3", "--lr", "kron=2e-3"], "more than once"),
        (["--lr", "kron.adam_learning_rate=1e-3"], "'kron' has no part rate"),
        (["--lr", "muon.beta=0.9"], "no part rate 'beta'; choose from adam_lear"),
        (["--lr", "muon.adam_learning_rate=0"], "must be a finite number > 0"),
        (["--lr", "muon.adam_learning_rate=1", "--optimizers", "kron"], "not among"),
        (["--weight-decay", "-1"], "--weight-decay"),
        (["--schedule", "linear"], "invalid choice: 'linear'"),
        (["--optimizers", "xmat", "--frameworks", "torch"], "exists in jax only"),
        (["--devices", "2", "--frameworks", "torch"], "applies to jax"),
        (["--devices", "3", "--frameworks", "jax"], "not divisible by --devices 3"),
        (["--devices", "16", "--batch-size", "16"], "jax sees 8 device(s)"),
        (["--json", "/nonexistent/folder/out.json"], "does not exist"),
        (["--output", "/nonexistent/folder/out"], "does not exist"),
        (["--readme", "/nonexistent/README.md"], "--readme '/nonexistent/README.md'"),
        (["--readme", "pyproject.toml"], "pyproject.toml has no results block"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--batch-size", "100000"], "exceeds the 6555 training rows of workload 'c"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, phrase, capsys):
    if "torch" in argv and not cli.module_installed("torch"):
        pytest.skip("torch is not installed")
    assert cli.main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("precond bench: error:")
    assert phrase in lines[0]


def _hide(monkeypatch, hidden: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == hidden else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_framework_is_one_line(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "jax")
    assert cli.main(["bench", "--frameworks", "jax", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "jax is not installed" in err
    assert "pip install 'precond[jax]'" in err

    monkeypatch.undo()
    _hide(monkeypatch, "torch")
    assert cli.main(["bench", "--frameworks", "torch"]) == 2
    assert "pip install 'precond[torch]'" in capsys.readouterr().err
    # By default a missing torch is skipped with one line, and JAX runs.
    argv = ["bench", "--workloads", "digits-mlp", "--optimizers", "adamw"]
    argv += ["--steps", "1", "--no-progress", "--no-plots"]
    argv += ["--output", str(tmp_path / "no-torch")]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "torch" in line]
    assert notes == [
        "precond bench: torch is not installed: skipping the torch workloads "
        "(pip install 'precond[torch]' to run them)"
    ]
    assert " jax " in captured.out.replace("\n", " ")


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().err


def test_cli_import_does_not_import_frameworks():
    code = (
        "import sys, precond.bench.cli; "
        "print(any(m.split('.')[0] in ('jax', 'torch', 'sklearn', 'optax', "
        "'matplotlib', 'tqdm') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


# ------------------------------------------------------- fresh machines, processes

# Runs ``precond bench`` with the arguments after ``-c``'s code; with HIDE_TORCH
# set, torch cannot be found or imported, as on a machine where only
# '.[jax,bench]' is installed, and the run fails if anything imported it.
RUN_BENCH = """
import importlib.abc, os, sys

class HideTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

if os.environ.get("HIDE_TORCH"):
    sys.meta_path.insert(0, HideTorch())
from precond.bench.cli import main
status = main(sys.argv[1:])
assert not os.environ.get("HIDE_TORCH") or "torch" not in sys.modules
sys.exit(status)
"""


def _bench_process(argv, **env) -> subprocess.CompletedProcess:
    """``precond bench ARGV`` in a new Python process with a clean XLA setup
    (the suite's 8 simulated devices removed) and ``env`` added."""
    clean = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")
    }
    return subprocess.run(
        [sys.executable, "-c", RUN_BENCH, "bench", *argv],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_torch_list_and_run_work(tmp_path):
    listed = _bench_process(["--list"], HIDE_TORCH="1")
    assert listed.returncode == 0, listed.stderr
    assert "PyTorch only (not installed)" in listed.stdout
    argv = ["--workloads", "digits-mlp", "--optimizers", "adamw,muon", "--steps", "2"]
    argv += ["--no-progress", "--no-plots", "--output", str(tmp_path / "out")]
    run = _bench_process(argv, HIDE_TORCH="1")
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        "precond bench: torch is not installed: skipping the torch workloads "
        "(pip install 'precond[torch]' to run them)"
    ]
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["framework"] for r in document["runs"]] == ["jax", "jax"]
    assert "torch" not in document["environment"]


# Fields that measure time (and so differ between runs), by JSON section.
TIMING_FIELDS = {
    "config": ("wall_s", "date", "command"),
    "environment": ("load_average_1min",),
    "summary": (
        "median_step_ms",
        "compile_s",
        "train_s",
        "time_to_target",
        "time_ratio",
        "val_loss_at_baseline_time",
        "step_ratio",
    ),
    "runs": ("median_step_ms", "compile_s", "train_s", "step_ms"),
}


def _without_timings(document: dict) -> dict:
    for section, fields in TIMING_FIELDS.items():
        for entry in (
            document[section] if section in ("summary", "runs") else [document[section]]
        ):
            for name in fields:
                entry.pop(name)
            for point in entry.get("history", []):
                point.pop("time_s")
    return document


def test_same_command_gives_identical_numbers_in_new_processes(tmp_path):
    """The same command twice, in processes with different hash seeds (as on
    two invocations): every number of results.json but the timings is equal."""
    frameworks = [f for f in ("jax", "torch") if cli.module_installed(f)]
    argv = ["--frameworks", ",".join(frameworks), "--workloads", "digits-mlp"]
    argv += ["--optimizers", "kron", "--steps", "4", "--batch-size", "32"]
    argv += ["--no-progress", "--no-plots"]
    documents = []
    for hash_seed in ("1", "2"):
        folder = tmp_path / hash_seed
        run = _bench_process(
            [*argv, "--output", str(folder)],
            PYTHONHASHSEED=hash_seed,
        )
        assert run.returncode == 0, run.stderr
        document = json.loads((folder / "results.json").read_text())
        documents.append(_without_timings(document))
    assert len(documents[0]["runs"]) == len(frameworks)
    assert documents[0] == documents[1]
