"""Every optimizer setting of ``tests/trajectories.py`` repeats its recorded
trajectory bit for bit (issue 20: behaviour held fixed through a redesign) on the
kind of CPU it was recorded on, and to ``CROSS_MACHINE_RTOL`` of each array's
largest entry on another (kernels chosen by other vector extensions round
differently).

A recording is only valid in the environment it was made in (JAX/torch versions,
XLA settings): under another one its case is skipped, saying why.
"""

import numpy as np
import pytest

from tests import trajectories as tr

HOW_TO_RERECORD = (
    "If this change is deliberate, list it in CHANGELOG.md and re-record: "
    "`python -m tests.trajectories --record {name}`."
)


def load_recording(name: str) -> tuple[str, str, dict[str, np.ndarray]]:
    """(environment, machine, arrays) of case ``name``'s recording; fails if there
    is none."""
    path = tr.recording_path(name)
    if not path.exists():
        pytest.fail(
            f"no recording {path}: `python -m tests.trajectories --record {name}`"
        )
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    return str(arrays.pop("environment")), str(arrays.pop("machine")), arrays


def assert_close_across_machines(actual, expected, err_msg):
    """|actual − expected| ≤ CROSS_MACHINE_RTOL · max|expected|, entry by entry
    (NaN where the recording has NaN)."""
    scale = float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(
        actual, expected, rtol=0, atol=tr.CROSS_MACHINE_RTOL * scale, err_msg=err_msg
    )


@pytest.mark.parametrize("name", sorted(tr.CASES))
def test_trajectory_is_bitwise_recorded(name):
    environment, machine, expected = load_recording(name)
    if environment != tr.environment():
        pytest.skip(f"recorded under {environment}, running under {tr.environment()}")
    compare = np.testing.assert_array_equal
    if machine != tr.machine():
        compare = assert_close_across_machines
    actual = tr.CASES[name].run()
    message = f"case {name!r}: " + HOW_TO_RERECORD.format(name=name)
    assert sorted(actual) == sorted(expected), message
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, f"{key}: {message}"
        compare(actual[key], value, err_msg=f"{key}: {message}")


def test_cross_machine_comparison_fails_a_changed_step():
    """The tolerance of other machines still fails a change of the math: a
    preconditioner step of 0.1001 instead of Kron's 0.1 (see CROSS_MACHINE_RTOL)."""
    _, _, expected = load_recording("kron_eq")
    changed = tr.jax_case("changed", tr.kron(preconditioner_lr=0.1001)).run()
    failed = []
    for key, value in expected.items():
        try:
            assert_close_across_machines(changed[key], value, err_msg=key)
        except AssertionError:
            failed.append(key)
    assert failed, "a changed preconditioner step passed the cross-machine check"


def test_every_recording_belongs_to_a_case():
    recorded = {path.stem for path in tr.DATA_DIR.glob("*.npz")}
    stale = sorted(recorded - set(tr.CASES))
    assert not stale, f"recordings of no case in tests/trajectories.py: {stale}"
