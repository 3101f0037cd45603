"""The torchrun examples run under ``python -m torch.distributed.run`` (2 gloo
processes on the CPU, one thread each) and train:

* ``examples/torch_kfac_digits.py``: SGD + K-FAC under DDP (MEM_OPT), the
  train loss halves in 3 epochs;
* ``examples/torch_kron_fsdp2.py``: Kron on FSDP2 with sharded preconditioning,
  the loss falls and the run ends where one process on the whole batches does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EPOCH_LINE = re.compile(r"epoch\s+(\d+) \| step\s+\d+ \| train loss ([0-9.]+) \|")
LOSS_LINE = re.compile(r"step\s+\d+ \| loss ([0-9.]+)")
DIFFERENCE_LINE = re.compile(r"max relative difference from one process: (\S+)")


def _torchrun(example: str, arguments: list[str], cwd: Path) -> tuple[str, str]:
    """(stdout, stdout + stderr) of the example on 2 processes; fails unless it
    exits with 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLES / example),
        *arguments,
    ]
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return result.stdout, output


def test_kfac_example_trains_under_torchrun(tmp_path):
    stdout, output = _torchrun(
        "torch_kfac_digits.py",
        ["--strategy", "mem-opt", "--epochs", "3", "--batch-size", "128"],
        tmp_path,
    )
    assert "2 process(es) on cpu" in stdout, output
    losses = [float(loss) for _, loss in EPOCH_LINE.findall(stdout)]
    assert len(losses) == 3, output  # rank 0 prints, once per epoch
    assert losses[-1] < 0.5 * losses[0], output


def test_kron_fsdp2_example_trains_under_torchrun_as_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    stdout, output = _torchrun(
        "torch_kron_fsdp2.py",
        ["--strategy", "sharded", "--steps", "30", "--log-every", "10", "--compare"],
        tmp_path,
    )
    assert "2 process(es) on cpu, Kron (sharded), float64" in stdout, output
    losses = [float(loss) for loss in LOSS_LINE.findall(stdout)]
    assert len(losses) == 4, output  # rank 0 prints steps 0, 10, 20, 29
    assert losses[-1] < losses[0] - 0.05, output
    (difference,) = DIFFERENCE_LINE.findall(stdout)
    assert float(difference) < 1e-10, output
