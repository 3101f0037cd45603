"""Every optimizer setting of ``tests/trajectories.py`` repeats its recorded
trajectory (issue 20: behaviour held fixed through a redesign): bit for bit in a
process whose fingerprint is one of those the recording lists, the processes
known to produce exactly these numbers; within ``CROSS_MACHINE_RTOL`` of each
array's largest entry anywhere else.

Why a fingerprint and not the kind of CPU: a second AMD EPYC of the same family,
model and vector extensions as the recorder gave 14 cases one float32 ulp off,
and a process in which programs had been compiled with XLA's optimizations on
before gave the LRA cases other bits. Bits are claimed only where they were
seen: the fingerprint names the machine itself (a hash of its machine id)
besides its CPU (identity, microcode, every feature flag, caches), the CPUs the
process may use, the thread and kernel settings of XLA, OpenBLAS and torch, and
JAX's live configuration (``tests/trajectories.py`` says what each was found to
decide). ``python -m tests.trajectories --confirm`` adds a machine's fingerprint
to the recordings it reproduces bit for bit; ``--record`` writes new numbers.

Elsewhere the tolerance absorbs another CPU's rounding (measured at most 3.5e-5
of an array's largest entry) and still fails a change of the math: the
``test_cross_machine_comparison_fails_*`` tests change one hyperparameter
slightly (a learning rate by 1%, b1 or Shampoo's beta2 by 0.01, a
preconditioner step by 0.1%) and require the comparison to fail.

A recording is only valid in the environment it was made in (JAX/torch/numpy
versions, XLA settings): under another one its case is skipped, saying why.
"""

import numpy as np
import pytest

from tests import trajectories as tr

HOW_TO_RERECORD = (
    "If this change is deliberate, list it in CHANGELOG.md and re-record: "
    "`python -m tests.trajectories --record {name}`."
)


def load_recording(name: str) -> tuple[str, list[dict], dict[str, np.ndarray]]:
    """(environment, fingerprints, arrays) of case ``name``'s recording; fails if
    there is none."""
    path = tr.recording_path(name)
    if not path.exists():
        pytest.fail(
            f"no recording {path}: `python -m tests.trajectories --record {name}`"
        )
    return tr.load_recording(name)


def assert_close_across_machines(actual, expected, err_msg):
    """|actual − expected| ≤ CROSS_MACHINE_RTOL · max|expected|, entry by entry
    (NaN where the recording has NaN)."""
    scale = float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(
        actual, expected, rtol=0, atol=tr.CROSS_MACHINE_RTOL * scale, err_msg=err_msg
    )


def choose_comparison(fingerprints: list[dict], here: dict) -> tuple[str, object]:
    """("bit for bit", assert_array_equal) if ``here`` is one of the recording's
    ``fingerprints``, else ("within CROSS_MACHINE_RTOL ...", the tolerance)
    with the fields in which ``here`` differs from the nearest fingerprint."""
    if here in fingerprints:
        return "bit for bit", np.testing.assert_array_equal
    differences = min(
        (tr.fingerprint_differences(here, f) for f in fingerprints),
        key=len,
        default=["no fingerprint recorded"],
    )
    return (
        f"within {tr.CROSS_MACHINE_RTOL} of the largest entry (bits not known "
        f"here: differs from the recording's fingerprints in {differences})",
        assert_close_across_machines,
    )


@pytest.mark.parametrize("name", sorted(tr.CASES))
def test_trajectory_repeats_its_recording(name):
    environment, fingerprints, expected = load_recording(name)
    if environment != tr.environment():
        pytest.skip(f"recorded under {environment}, running under {tr.environment()}")
    how, compare = choose_comparison(fingerprints, tr.fingerprint())
    actual = tr.CASES[name].run()
    message = f"case {name!r}, compared {how}: " + HOW_TO_RERECORD.format(name=name)
    assert sorted(actual) == sorted(expected), message
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, f"{key}: {message}"
        compare(actual[key], value, err_msg=f"{key}: {message}")


def test_comparison_is_bitwise_only_under_a_recorded_fingerprint():
    here = tr.fingerprint()
    other = dict(here, **{"cpu microcode": "another"})
    assert choose_comparison([other, here], here)[0] == "bit for bit"
    how, compare = choose_comparison([other], here)
    assert compare is assert_close_across_machines
    assert "['cpu microcode']" in how
    assert choose_comparison([], here)[1] is assert_close_across_machines


def test_fingerprint_names_the_settings_that_choose_threads_and_kernels(monkeypatch):
    here = tr.fingerprint()
    assert here == tr.fingerprint(), "the fingerprint must be stable in a process"
    for name, value in [("PJRT_NPROC", "3"), ("OPENBLAS_NUM_THREADS", "7")]:
        monkeypatch.setenv(name, value)
        assert tr.fingerprint_differences(here, tr.fingerprint()) == [name]
        monkeypatch.undo()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    assert tr.fingerprint_differences(here, tr.fingerprint()) == ["XLA_FLAGS"]


def _fails_across_machines(name: str, changed: tr.Case) -> list[str]:
    """The arrays of ``changed``'s run that fail the cross-machine comparison
    with case ``name``'s recording."""
    _, _, expected = load_recording(name)
    actual = changed.run()
    failed = []
    for key, value in expected.items():
        try:
            assert_close_across_machines(actual[key], value, err_msg=key)
        except AssertionError:
            failed.append(key)
    return failed


@pytest.mark.parametrize(
    ("name", "changed"),
    [
        # kron_eq: learning rate 0.01 → 0.0101, b1 0.9 → 0.91, preconditioner
        # step 0.1 → 0.1001.
        ("kron_eq", tr.jax_case("changed", tr.kron(learning_rate=0.0101))),
        ("kron_eq", tr.jax_case("changed", tr.kron(b1=0.91))),
        ("kron_eq", tr.jax_case("changed", tr.kron(preconditioner_lr=0.1001))),
        # shampoo: beta2 0.999 → 0.989 (its statistics' decay).
        ("shampoo", tr.jax_case("changed", tr.shampoo(beta2=0.989))),
        # torch_kron_eq: lr 0.01 → 0.0101.
        ("torch_kron_eq", tr.torch_case("changed", tr.torch_kron(lr=0.0101))),
    ],
    ids=["kron_lr_1pc", "kron_b1", "kron_precond_lr", "shampoo_beta2", "torch_lr_1pc"],
)
def test_cross_machine_comparison_fails_a_changed_hyperparameter(name, changed):
    """The tolerance of other machines still fails a small change of the math
    (with the recording's own setting, the same comparison passes: the main
    test runs it wherever the bits are not known)."""
    failed = _fails_across_machines(name, changed)
    assert failed, f"a changed hyperparameter passed the cross-machine check of {name}"


def test_every_recording_belongs_to_a_case():
    recorded = {path.stem for path in tr.DATA_DIR.glob("*.npz")}
    stale = sorted(recorded - set(tr.CASES))
    assert not stale, f"recordings of no case in tests/trajectories.py: {stale}"
