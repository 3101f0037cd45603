"""Helpers shared by the tests of the bench and of the benchmark scripts."""

import importlib.util
import pathlib


def psgd_quality():
    """benchmarks/psgd_quality.py as a module."""
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "psgd_quality.py"
    spec = importlib.util.spec_from_file_location("psgd_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
