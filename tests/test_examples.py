"""examples/jax_sharded_lm.py trains, and a run interrupted and resumed from its
checkpoint ends in exactly the state of an uninterrupted run (DESIGN.md §7.5);
examples/README.md names the extras each example needs.

The example runs in subprocesses (it configures its own simulated devices); a
small model keeps each run to seconds.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "jax_sharded_lm.py"
SMALL = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32"]
SMALL += ["--batch-size", "8", "--block-size", "16", "--steps", "6", "--warmup", "2"]
SMALL += ["--checkpoint-every", "3", "--log-every", "1"]


def _run(*args, compilation_cache=None):
    """The example with SMALL and ``args``; ``compilation_cache``: a folder for
    JAX's persistent compilation cache, shared by the runs of one test (a program
    is looked up by its HLO and compile options, so a run whose programs differ
    still compiles its own)."""
    env = dict(os.environ)
    if compilation_cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(compilation_cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _final_checkpoint(directory):
    (path,) = sorted(Path(directory).glob("step_*.npz"))
    with np.load(path) as data:
        return dict(data)


def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path):
    cache = tmp_path / "jax-cache"
    whole = _run("--checkpoint-dir", str(tmp_path / "whole"), compilation_cache=cache)
    losses = [float(x) for x in re.findall(r"train loss ([\d.]+)", whole)]
    assert len(losses) == 6
    assert losses[-1] < losses[0]

    split = str(tmp_path / "split")
    _run("--checkpoint-dir", split, "--stop-after", "3", compilation_cache=cache)
    resumed = _run("--checkpoint-dir", split, compilation_cache=cache)
    assert "resumed" in resumed

    want = _final_checkpoint(tmp_path / "whole")
    got = _final_checkpoint(tmp_path / "split")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# Import names that differ from the distribution that provides them.
_DISTRIBUTION_OF = {"sklearn": "scikit-learn"}


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def _third_party_imports(path: Path) -> set[str]:
    """Top-level modules ``path`` imports, other than the standard library's and
    precond itself."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "precond"}


def test_examples_readme_names_the_extras_each_example_needs():
    """examples/README.md's table gives, per example, the extras whose packages
    (with the core dependencies) provide everything the example imports."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = {
        extra: {_requirement_name(r) for r in requirements}
        for extra, requirements in project["optional-dependencies"].items()
    }
    core = {_requirement_name(r) for r in project["dependencies"]}
    table = (root / "examples" / "README.md").read_text()
    scripts = sorted(p for p in (root / "examples").glob("*.py"))
    assert scripts
    for script in scripts:
        rows = [
            line
            for line in table.splitlines()
            if line.startswith(f"| `{script.name}` |")
        ]
        assert len(rows) == 1, f"examples/README.md: no table row for {script.name}"
        named = re.findall(r"`([\w-]+)`", rows[0].split("|")[2])
        assert named, f"examples/README.md: no extras for {script.name}"
        assert set(named) <= set(extras), (script.name, named)
        provided = core.union(*(extras[e] for e in named))
        needed = {
            _DISTRIBUTION_OF.get(m, m).lower() for m in _third_party_imports(script)
        }
        assert needed <= provided, (
            f"{script.name} imports {sorted(needed - provided)}, which the extras "
            f"{named} (examples/README.md) do not install"
        )
