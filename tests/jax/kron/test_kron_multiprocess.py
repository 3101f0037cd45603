"""Kron sharded over 2 JAX processes equals Kron sharded over 8 devices of one.

Two worker processes (tests/jax/multiprocess_worker.py) with 4 simulated CPU
devices each join with ``jax.distributed.initialize`` on localhost and run 3
float64 Kron steps on a (2, 4) mesh spanning all 8 devices, so the sharded update
moves gradients, units and updates between processes over gloo collectives. Their
updates of every step, final momentum and final factors equal those of the same
steps on a (2, 4) mesh of this process's 8 simulated devices.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.jax import multiprocess_worker
from tests.jax.helpers import float64

WORKER = Path(multiprocess_worker.__file__)
REPO_ROOT = WORKER.parents[2]
TIMEOUT_S = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch_workers(out_dir):
    """Starts processes 0 and 1, each logging stdout and stderr to a file."""
    env = {
        **os.environ,
        # Not this process's flags: 4 devices per worker, not 8.
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("PJRT_NPROC", None)
    port = str(_free_port())
    workers = []
    for process_id in range(2):
        log = out_dir / f"worker{process_id}.log"
        with log.open("w") as f:
            command = [sys.executable, str(WORKER), str(process_id), port, str(out_dir)]
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
            )
        workers.append((process, log))
    return workers


def _wait_for(workers):
    """Waits up to TIMEOUT_S for both to exit 0; else fails with both outputs."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        codes = [process.poll() for process, _ in workers]
        if codes == [0, 0]:
            return
        if any(code not in (None, 0) for code in codes):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report = "\n".join(
        f"worker process {process_id} "
        f"{'still running' if code is None else f'exited with {code}'}; "
        f"output tail:\n{log.read_text()[-3000:]}"
        for process_id, (code, (_, log)) in enumerate(zip(codes, workers))
    )
    pytest.fail(f"workers failed or ran past {TIMEOUT_S} s (killed)\n{report}")


def _kill_running(workers):
    for process, _ in workers:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_two_processes_equal_one(tmp_path):
    workers = _launch_workers(tmp_path)
    try:
        with float64():  # The reference, computed while the workers run.
            want = multiprocess_worker.sharded_steps()
        _wait_for(workers)
    finally:
        _kill_running(workers)
    with np.load(tmp_path / "results.npz") as results:
        got = dict(results)
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert np.any(x != 0), name
        # Float64, 1e-10: only the order of reductions may differ between the runs
        # (gloo's cross-process sums against in-process ones); each unit's math
        # runs whole on one device and the noise is keyed by unit identity.
        np.testing.assert_allclose(got[name], x, rtol=1e-10, atol=1e-14, err_msg=name)
