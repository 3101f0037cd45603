"""examples/torch_kron_fsdp2.py runs under torchrun (2 gloo processes, FSDP2),
trains, and ends where one process on the whole batches does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_kron_fsdp2.py"
LOSS_LINE = re.compile(r"step\s+\d+ \| loss ([0-9.]+)")
DIFFERENCE_LINE = re.compile(r"max relative difference from one process: (\S+)")


def test_example_trains_under_torchrun_as_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        "--strategy",
        "sharded",
        "--steps",
        "30",
        "--log-every",
        "10",
        "--compare",
    ]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "2 process(es) on cpu, Kron (sharded), float64" in result.stdout, output
    losses = [float(loss) for loss in LOSS_LINE.findall(result.stdout)]
    assert len(losses) == 4, output  # rank 0 prints steps 0, 10, 20, 29
    assert losses[-1] < losses[0] - 0.05, output
    (difference,) = DIFFERENCE_LINE.findall(result.stdout)
    assert float(difference) < 1e-10, output
