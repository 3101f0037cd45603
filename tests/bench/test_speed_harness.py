"""benchmarks/speed.py, the speed harness: its table of cases, one tiny case
measured, and the writer that replaces BENCHMARKS.md's tables between markers.
Times are never asserted (DESIGN.md §8)."""

from __future__ import annotations

import pytest

from tests.bench.helpers import script_module


@pytest.fixture(scope="module")
def speed():
    return script_module("benchmarks/speed.py")


def test_every_case_belongs_to_a_table_and_is_named_once(speed):
    from cases import CASES

    for table, make in CASES.items():
        cases = make(["digits-mlp"])
        assert cases
        assert {c.table for c in cases} == {table}
        keys = [(c.model, c.subject, c.reference, c.setting) for c in cases]
        assert len(set(keys)) == len(keys), table
    pairs = {(c.subject, c.reference) for c in CASES["jax-pairs"](["char-lm"])}
    assert ("kron", "distributed-kron 2.0.0") in pairs
    assert ("pro", "distributed-kron 2.0.0 pro") in pairs


def _tiny_case(speed):
    """optax's SGD against AdamW on one 4×4 matrix, through the JAX stepper."""
    import jax.numpy as jnp
    import optax

    from cases import Case, jax_stepper

    params, grads = {"w": jnp.ones((4, 4))}, {"w": jnp.full((4, 4), 0.1)}

    def make():
        return (
            jax_stepper(optax.sgd(0.1), params, grads),
            jax_stepper(optax.adamw(0.1), params, grads),
        )

    return Case("jax-adamw", "tiny", "sgd", "adamw", "p=1", 3, make)


def test_the_writer_replaces_only_its_blocks(speed, tmp_path):
    row = speed.run_case(_tiny_case(speed), rounds=2, quick=True, missing={})
    assert row["steps"] == 2
    assert row["ratio"] > 0
    missing = {"kron-torch": "ModuleNotFoundError: no kron_torch"}
    skipped = speed.run_case(
        _tiny_case(speed)._replace(table="torch-pairs", reference="kron-torch"),
        rounds=2,
        quick=True,
        missing=missing,
    )
    assert skipped["skipped"] == missing["kron-torch"]
    memory = [
        {
            "model": "m",
            "optimizer": "kron",
            "devices": n,
            "source": "compiled",
            "param_bytes": 8e6,
            "param_bytes_per_device": 8e6 / n,
            "state_bytes_per_device": 16e6 / n,
            "one_device_state_bytes": 16e6,
            "received_bytes": None if n == 1 else 4e6,
        }
        for n in (1, 8)
    ]
    environment = {"cpu": "Test CPU", "available_cores": 2, "commit": "abc1234"}
    head = speed.header(
        "python benchmarks/speed.py --quick",
        environment,
        "2026-12-07T00:00:00",
        quick=True,
        rounds=2,
    )
    path = tmp_path / "BENCHMARKS.md"
    markers = "".join(
        f"## {t}\n<!-- speed:{t}:begin -->\nold\n<!-- speed:{t}:end -->\nkept {t}\n"
        for t in ("jax-adamw", "torch-pairs", "memory", "jax-pairs")
    )
    path.write_text("# Benchmarks\n" + markers)
    speed.write(
        str(path),
        {
            "jax-adamw": speed.block("jax-adamw", [row], head),
            "torch-pairs": speed.block("torch-pairs", [skipped], head),
            "memory": speed.block("memory", memory, head),
        },
    )
    text = path.read_text()
    assert text.count("old") == 1  # jax-pairs was not run: left as it was
    for table in ("jax-adamw", "torch-pairs", "memory", "jax-pairs"):
        assert f"kept {table}\n" in text
    blocks = text.split("<!-- speed:")[1:]
    for written, columns, rows in [
        (blocks[0], 6, 1),
        (blocks[2], 7, 1),
        (blocks[4], 8, 2),
    ]:
        lines = written.split("\n")
        assert lines[1].startswith("`python benchmarks/speed.py --quick` — Test CPU")
        assert "commit `abc1234`, 2026-12-07" in lines[1]
        table = [line for line in lines if line.startswith("|")]
        assert len(table) == 2 + rows
        assert {line.count("|") for line in table} == {columns + 1}
    assert "not run: ModuleNotFoundError" in blocks[2]
    (tmp_path / "none.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="speed:jax-pairs:begin"):
        speed.write(str(tmp_path / "none.md"), {"jax-pairs": "t"})
