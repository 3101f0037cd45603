"""Helpers shared by the tests of the bench, the speed harness and the docs
generator: a repository script loaded as a module."""

import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]


def script_module(relative_path: str) -> types.ModuleType:
    """The repository's script at ``relative_path`` (e.g. ``docs/make_arguments.py``)
    as a module, without running its ``__main__`` block."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
