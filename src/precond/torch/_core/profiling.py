"""Profiler ranges for the stages of a step, free when no profiler records."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function


def profiled_stage(name: str) -> contextlib.AbstractContextManager:
    """``torch.profiler.record_function(name)`` while a torch profiler records,
    else a context that does nothing: an idle ``record_function`` still costs
    time to open and close, on every stage of every step."""
    if torch.autograd._profiler_enabled():  # pyright: ignore[reportPrivateImportUsage]
        return record_function(name)
    return contextlib.nullcontext()
