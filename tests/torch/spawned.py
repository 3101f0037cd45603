"""The harness of the multi-process torch tests: cases run on spawned gloo ranks.

One spawn per world size (each costs ~10 s of imports, mostly torch): the
ranks join one gloo group (``file://`` rendezvous in the test's temporary
directory, one thread per process, a timeout on every collective) and run the
cases one after the other, each rank saving ``rank{r}-{case}.pt``; the parent
then checks every case against its oracle and fails naming each case that
failed or did not finish, with the tracebacks of the ranks that raised. A
whole run that outlives ``RUN_TIMEOUT_S`` is killed.

A rank that finished every case frees what the cases left (FSDP2's modules
and meshes hold the process group in reference cycles), leaves the group
and ends with ``os._exit(0)`` (:func:`leave_group_and_exit`), skipping interpreter
finalization: gloo's worker threads outlive ``destroy_process_group`` (a gloo
group has no shutdown), and a barrier holds the collectives before it until a
worker frees it. A worker that frees their tensors after finalization began
needs the GIL and aborts the process (SIGABRT, "terminate called without an
active exception", pytorch/pytorch#179291); CI saw it on a loaded machine,
after every case had been saved.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# Seconds allowed to one collective, and to a whole spawned run (4 processes on a
# shared 2-core machine take ~10 s, mostly importing torch).
COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 120

# run_case(case name, rank, world size, output directory) -> what the parent checks
RunCase = Callable[[str, int, int, Path], Any]


def init_gloo(rank: int, world_size: int, init_file) -> None:
    """Joins the gloo group of a spawned test run (one thread per process, a
    timeout on every collective)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def leave_group_and_exit() -> NoReturn:
    """Frees what is left, waits for every rank, leaves the group and ends the
    process without interpreter finalization (module docstring)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run_cases(rank, world_size, init_file, out_dir, case_names, run_case: RunCase):
    """One rank: every case in turn, saving ``run_case(...)`` as
    rank{r}-{case}.pt (a barrier after each); on an error, rank{r}.err holds
    the case and the traceback."""
    out = Path(out_dir)
    case_name = "init_process_group"
    try:
        init_gloo(rank, world_size, init_file)
        for case_name in case_names:
            result = run_case(case_name, rank, world_size, out)
            torch.save(result, out / f"rank{rank}-{case_name}.pt")
            dist.barrier()
        case_name = "destroy_process_group"
        leave_group_and_exit()
    except BaseException:
        (out / f"rank{rank}.err").write_text(
            f"in case {case_name}:\n{traceback.format_exc()}"
        )
        raise


def spawn(fn, args, nprocs, out_dir):
    """Runs ``fn(rank, *args)`` on ``nprocs`` processes; returns None, or a message
    naming the ranks that failed or hung, with their tracebacks."""
    context = mp.start_processes(
        fn, args=args, nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    error = None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
                error = f"ranks {alive} still running after {RUN_TIMEOUT_S} s"
                break
    except ProcessException as e:
        error = f"rank {e.error_index} failed first: {e}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    if error is None:
        return None
    tracebacks = "\n".join(
        f"--- rank {rank} ---\n{(out_dir / f'rank{rank}.err').read_text()}"
        for rank in range(nprocs)
        if (out_dir / f"rank{rank}.err").exists()
    )
    return f"{error}\n{tracebacks}"


def check_spawned_cases(
    tmp_path: Path,
    world_size: int,
    case_names: Sequence[str],
    run_case: RunCase,
    check: Callable[[list, str], Any],
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Runs ``case_names`` on ``world_size`` spawned ranks, then
    ``check(results, case)`` (results: each rank's saved value) for each case;
    fails naming every case whose check raised AssertionError or that did not
    finish. Returns what ``check`` returned, by case."""
    error = spawn(
        run_cases,
        (world_size, str(tmp_path / "init"), str(tmp_path), list(case_names), run_case),
        world_size,
        tmp_path,
    )
    failures, checked = [], {}
    for case_name in case_names:
        files = [tmp_path / f"rank{r}-{case_name}.pt" for r in range(world_size)]
        if not all(f.exists() for f in files):
            failures.append(f"{case_name}: not finished on every rank")
            continue
        results = [torch.load(f, weights_only=weights_only) for f in files]
        try:
            checked[case_name] = check(results, case_name)
        except AssertionError as e:
            failures.append(f"{case_name}: {e}")
    if error is not None or failures:
        pytest.fail("\n".join(failures + ([error] if error else [])))
    return checked
