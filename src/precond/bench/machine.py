"""The machine a benchmark runs on: the threads each framework may use, and the
record of versions, CPU, cores and threads written beside every result.

:func:`configure_threads` runs before JAX or torch starts computing. It gives
each framework the same number of intra-op threads (XLA:CPU's thread pool, torch's
OpenMP pool) and keeps the libraries under them from adding their own: LAPACK
(OpenBLAS, under JAX's ``eigh``) runs single-threaded, and torch gets one inter-op
thread. Thread pools that each size themselves to the whole machine oversubscribe
the cores when both frameworks live in one process, or when the machine is busy.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from importlib import metadata
from typing import Any

# Environment variables read once, when a library starts its thread pool.
POOL_SIZE_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# XLA:CPU sizes its intra-op thread pool from PJRT_NPROC (else from the cores).
XLA_POOL_VARIABLE = "PJRT_NPROC"
# Distributions whose versions are recorded: always, and per framework run.
RECORDED_PACKAGES = ("precond", "numpy", "scikit-learn", "matplotlib")
FRAMEWORK_PACKAGES = {"jax": ("jax", "jaxlib", "optax"), "torch": ("torch",)}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_threads(
    threads: int,
    frameworks: tuple[str, ...],
    devices: int = 1,
    xla_pool: int | None = None,
) -> dict[str, int]:
    """Gives JAX and torch ``threads`` intra-op threads each; returns what was set.

    Call before JAX is imported: XLA reads ``PJRT_NPROC`` once, when its CPU
    backend starts; afterwards, and with ``devices`` > 1 simulated JAX devices
    (which share the pool), XLA's pool is left as it is (:func:`environment`
    records it).

    Args:
      threads: intra-op threads of torch, and of XLA unless ``xla_pool`` is given.
      frameworks: the frameworks to configure (``"jax"``, ``"torch"``).
      devices: the number of simulated JAX devices.
      xla_pool: XLA:CPU's pool size when it must differ from ``threads`` (a
        program that blocks pool threads needs more of them); None: ``threads``.
    """
    for name in POOL_SIZE_VARIABLES:
        os.environ[name] = str(threads)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    settings = {"threads": threads, "openblas_threads": 1}
    if "jax" in frameworks and devices == 1 and "jax" not in sys.modules:
        os.environ[XLA_POOL_VARIABLE] = str(threads if xla_pool is None else xla_pool)
    if "torch" in frameworks:
        import torch

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # its inter-op pool started already
            torch.set_num_interop_threads(1)
        settings["torch_threads"] = torch.get_num_threads()
        settings["torch_interop_threads"] = torch.get_num_interop_threads()
    return settings


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else the platform's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions(frameworks: tuple[str, ...]) -> dict[str, str]:
    """Versions of :data:`RECORDED_PACKAGES` and of ``frameworks``' packages."""
    names = RECORDED_PACKAGES + tuple(
        name for framework in frameworks for name in FRAMEWORK_PACKAGES[framework]
    )
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def source_commit() -> str:
    """The git commit of the precond checkout this package runs from (short hash,
    "+changes" when tracked files differ from it), or "unknown" outside one (an
    installed wheel, no git)."""
    import subprocess

    folder = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=folder, capture_output=True, text=True, timeout=10
        )
        if done.returncode:
            raise OSError(done.stderr)
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


def environment(frameworks: tuple[str, ...], threads: dict[str, int]) -> dict[str, Any]:
    """What a result depends on besides the command: package versions, Python,
    CPU model, core counts, thread settings, XLA flags and the JAX device."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        **package_versions(frameworks),
        "os": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "available_cores": available_cores(),
        **threads,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "commit": source_commit(),
    }
    if "jax" in frameworks and "jax" in sys.modules:
        import jax

        device = jax.devices()[0]
        env |= {
            "backend": jax.default_backend(),
            "device": getattr(device, "device_kind", str(device)),
            "device_count": jax.device_count(),
            "xla_pool_threads": os.environ.get(XLA_POOL_VARIABLE, "cores"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }
    return env
