"""Nothing lost, and bad input rejected: checkpoint/resume and argument validation."""

import inspect
import os
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precond.jax as pj
from precond.jax.kron._arguments import KRON_ARGUMENT_CHECKS

# The training run shared by this process and the resumed one (its source is run in
# both, so they cannot drift apart).
TRAINING = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    import precond.jax as pj

    optimizer = pj.kron(
        learning_rate=3e-3, weight_decay=0.01, preconditioner_update_probability=0.5
    )
    params = {
        "w": jnp.linspace(-1.0, 1.0, 48).reshape(8, 6),
        "b": jnp.zeros(6),
        "s": jnp.array(0.5),
        "t": jnp.ones((3, 2, 4)),
    }

    def loss(p):
        h = jnp.tanh(p["w"] @ (p["t"].reshape(6, 4)) + p["s"])
        return jnp.sum(h**2) + jnp.sum((p["b"] - 1.0) ** 2)

    @jax.jit
    def train_step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def save(path, params, state):
        leaves = jax.tree.leaves((params, state))
        np.savez(path, *[np.asarray(x) for x in leaves])

    def restore(path):
        template = (params, optimizer.init(params))
        stored = np.load(path)
        leaves = [stored[f"arr_{i}"] for i in range(len(stored.files))]
        return jax.tree.unflatten(jax.tree.structure(template), leaves)
    """
)


def test_resume_from_checkpoint_in_new_process_is_bit_identical(tmp_path):
    namespace: dict = {}
    exec(TRAINING, namespace)  # the fixed training script shared with the subprocess
    params = namespace["params"]
    state = namespace["optimizer"].init(params)
    for step in range(10):
        params, state = namespace["train_step"](params, state)
        if step == 3:
            namespace["save"](tmp_path / "step4.npz", params, state)
    namespace["save"](tmp_path / "uninterrupted.npz", params, state)

    resume = TRAINING + textwrap.dedent(
        f"""
        params, state = restore({str(tmp_path / "step4.npz")!r})
        for _ in range(6):
            params, state = train_step(params, state)
        save({str(tmp_path / "resumed.npz")!r}, params, state)
        """
    )
    subprocess.run(
        [sys.executable, "-c", resume], check=True, env=os.environ.copy(), timeout=300
    )
    expected = np.load(tmp_path / "uninterrupted.npz")
    resumed = np.load(tmp_path / "resumed.npz")
    assert expected.files == resumed.files
    for name in expected.files:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learning_rate": -1e-3}, "Invalid learning_rate=-0.001: must be >= 0.0"),
        ({"learning_rate": float("nan")}, "Invalid learning_rate=nan"),
        ({"learning_rate": float("inf")}, "Invalid learning_rate=inf: must be finite"),
        ({"learning_rate": "fast"}, "Invalid learning_rate='fast'"),
        ({"b1": 1.0}, "Invalid b1=1.0: must be in [0.0, 1.0)"),
        ({"b1": -0.1}, "Invalid b1=-0.1"),
        ({"weight_decay": -0.01}, "Invalid weight_decay=-0.01"),
        (
            {"preconditioner_update_probability": 1.5},
            "preconditioner_update_probability=1.5",
        ),
        (
            {"preconditioner_update_probability": -0.1},
            "preconditioner_update_probability=-0.1",
        ),
        ({"max_size_triangular": -1}, "Invalid max_size_triangular=-1: must be >= 0"),
        (
            {"max_size_triangular": 10.5},
            "Invalid max_size_triangular=10.5: must be a Python int",
        ),
        ({"min_ndim_triangular": True}, "Invalid min_ndim_triangular=True"),
        (
            {"memory_save_mode": "some_diag"},
            "Invalid memory_save_mode='some_diag': "
            "must be one of None, 'one_diag', 'all_diag'",
        ),
        (
            {"preconditioner_lr": 0.0},
            "Invalid preconditioner_lr=0.0: must be > 0.0",
        ),
        ({"preconditioner_init_scale": -1.0}, "Invalid preconditioner_init_scale=-1.0"),
        ({"mu_dtype": jnp.int32}, "must be a floating dtype"),
        ({"precond_dtype": "int8"}, "Invalid precond_dtype='int8'"),
        ({"precond_update_precision": "fp8"}, "Invalid precond_update_precision='fp8'"),
        ({"precond_grads_precision": 3}, "Invalid precond_grads_precision=3"),
        ({"seed": 1.5}, "Invalid seed=1.5"),
        ({"seed": "abc"}, "Invalid seed='abc'"),
        ({"mu_dtype": "no dtype"}, "Invalid mu_dtype='no dtype'"),
        (
            {"merge_small_dims": "no"},
            "Invalid merge_small_dims='no': must be True or False",
        ),
        ({"momentum_into_precond_update": 0}, "Invalid momentum_into_precond_update=0"),
        ({"lax_map_scanned_layers": "yes"}, "Invalid lax_map_scanned_layers='yes'"),
        (
            {"partition_grads_into_blocks": None},
            "Invalid partition_grads_into_blocks=None",
        ),
        (
            {"preconditioner_cache": True},
            "Invalid preconditioner_cache=True: must be one of 'packed', 'dense', None",
        ),
    ],
)
def test_invalid_arguments_raise_at_construction(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        pj.kron(**kwargs)


def test_every_argument_has_a_check():
    """The table of checks names every argument of scale_by_kron, in order
    (``**kwargs`` takes only kron's own arguments, checked by kron)."""
    parameters = inspect.signature(pj.scale_by_kron).parameters.values()
    assert list(KRON_ARGUMENT_CHECKS) == [
        p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="preconditioner_learning_rate"):
        pj.kron(preconditioner_learning_rate=0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"min_prob": 0.5, "max_prob": 0.1},
            "Invalid min_prob=0.5: must be <= max_prob=0.1",
        ),
        ({"max_prob": 2.0}, "Invalid max_prob=2.0"),
        ({"decay": -1.0}, "Invalid decay=-1.0"),
        ({"flat_start": -5}, "Invalid flat_start=-5"),
    ],
)
def test_invalid_schedule_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pj.precond_update_prob_schedule(**kwargs)


def test_schedules_are_accepted_where_documented():
    optimizer = pj.kron(
        learning_rate=optax.linear_schedule(0.0, 1e-3, 10),
        preconditioner_update_probability=lambda n: 0.5,
    )
    params = {"w": jnp.ones((3, 2))}
    updates, _ = optimizer.update(params, optimizer.init(params))
    np.testing.assert_array_equal(updates["w"], 0.0)  # lr(0) = 0
