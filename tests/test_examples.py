"""examples/jax_sharded_lm.py trains, and a run interrupted and resumed from its
checkpoint ends in exactly the state of an uninterrupted run (DESIGN.md §7.5).

The example runs in subprocesses (it configures its own simulated devices); a
small model keeps each run to seconds.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).parents[1] / "examples" / "jax_sharded_lm.py"
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32"]
SMALL += ["--batch-size", "8", "--block-size", "16", "--steps", "6", "--warmup", "2"]
SMALL += ["--checkpoint-every", "3", "--log-every", "1"]


def _run(*args):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _final_checkpoint(directory):
    (path,) = sorted(Path(directory).glob("step_*.npz"))
    with np.load(path) as data:
        return dict(data)


def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path):
    whole = _run("--checkpoint-dir", str(tmp_path / "whole"))
    losses = [float(x) for x in re.findall(r"train loss ([\d.]+)", whole)]
    assert len(losses) == 6
    assert losses[-1] < losses[0]

    _run("--checkpoint-dir", str(tmp_path / "split"), "--stop-after", "3")
    resumed = _run("--checkpoint-dir", str(tmp_path / "split"))
    assert "resumed" in resumed

    want = _final_checkpoint(tmp_path / "whole")
    got = _final_checkpoint(tmp_path / "split")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
