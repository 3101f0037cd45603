"""examples/torch_kfac_digits.py runs under torchrun (2 gloo processes) and trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_kfac_digits.py"
EPOCH_LINE = re.compile(r"epoch\s+(\d+) \| step\s+\d+ \| train loss ([0-9.]+) \|")


def test_example_trains_under_torchrun(tmp_path):
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
        "mem-opt",
        "--epochs",
        "3",
        "--batch-size",
        "128",
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
    assert "2 process(es) on cpu" in result.stdout, output
    losses = [float(loss) for _, loss in EPOCH_LINE.findall(result.stdout)]
    assert len(losses) == 3, output  # rank 0 prints, once per epoch
    assert losses[-1] < 0.5 * losses[0], output
