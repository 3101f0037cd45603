"""Every optimizer setting of ``tests/trajectories.py`` repeats its recorded
trajectory bit for bit (issue 20: behaviour held fixed through a redesign).

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


def load_recording(name: str) -> tuple[str, dict[str, np.ndarray]]:
    """(environment, arrays) of case ``name``'s recording; fails if there is none."""
    path = tr.recording_path(name)
    if not path.exists():
        pytest.fail(
            f"no recording {path}: `python -m tests.trajectories --record {name}`"
        )
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    return str(arrays.pop("environment")), arrays


@pytest.mark.parametrize("name", sorted(tr.CASES))
def test_trajectory_is_bitwise_recorded(name):
    environment, expected = load_recording(name)
    if environment != tr.environment():
        pytest.skip(f"recorded under {environment}, running under {tr.environment()}")
    actual = tr.CASES[name].run()
    message = f"case {name!r}: " + HOW_TO_RERECORD.format(name=name)
    assert sorted(actual) == sorted(expected), message
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, f"{key}: {message}"
        np.testing.assert_array_equal(actual[key], value, err_msg=f"{key}: {message}")


def test_every_recording_belongs_to_a_case():
    recorded = {path.stem for path in tr.DATA_DIR.glob("*.npz")}
    stale = sorted(recorded - set(tr.CASES))
    assert not stale, f"recordings of no case in tests/trajectories.py: {stale}"
