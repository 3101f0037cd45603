"""The seed packages, imported as test oracles (the ``parity`` extra).

Their code never enters precond: tests import them only to compare signatures and
trajectories. Two of them were written for older JAX / optax releases and do not
import as they are on today's; the shims below are the smallest change that lets
them import, and they touch only the oracle, never precond:

- distributed-kron 1.0.0 annotates arguments ``PartitionSpec[str, str]``, which
  today's ``PartitionSpec`` refuses at definition time. Its module is compiled with
  ``from __future__ import annotations`` so the annotations are never evaluated.
- psgd-jax 0.1.5 imports ``optax._src.clipping``, a module later optax releases
  moved to ``optax.transforms._clipping``; the old name is registered as an alias.
  Its Affine also calls ``jax.tree_unflatten``, which JAX has since removed: the
  alias ``jax.tree_util.tree_unflatten`` is added to ``jax`` (nothing else changes).

Each ``import_*`` function calls ``pytest.importorskip``-style skipping only when the
package is absent; CI installs the extra, so there a missing oracle is a failure
(``PRECOND_REQUIRE_ORACLES=1``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest


def _missing(name: str):
    message = f"the oracle {name!r} is not installed (pip install -e '.[parity]')"
    if os.environ.get("PRECOND_REQUIRE_ORACLES") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _import_with_lazy_annotations(module_name: str) -> types.ModuleType:
    """Imports ``module_name`` with its annotations left unevaluated (PEP 563)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    package_name, _, _ = module_name.rpartition(".")
    if package_name not in sys.modules:
        # The package's __init__ imports the module the plain way: register the
        # package without running it.
        package_spec = importlib.util.find_spec(package_name)
        package = importlib.util.module_from_spec(package_spec)
        sys.modules[package_name] = package
    spec = importlib.util.find_spec(module_name)
    with open(spec.origin, encoding="utf-8") as file:
        source = "from __future__ import annotations\n" + file.read()
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    return module


def distributed_kron() -> types.ModuleType:
    """distributed-kron 1.0.0's ``distributed_kron.kron`` module."""
    if importlib.util.find_spec("distributed_kron") is None:
        _missing("distributed-kron==1.0.0")
    return _import_with_lazy_annotations("distributed_kron.kron")


# distributed-kron 2.0.0 has the same distribution name as 1.0.0 (the `parity`
# extra's), so it cannot share their environment: the README's test command
# installs it with `pip install --no-deps --target` into this folder.
DISTRIBUTED_KRON_2_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ".oracles",
    "distributed-kron-2.0.0",
)


def distributed_kron_pro() -> types.ModuleType:
    """distributed-kron 2.0.0's ``pro`` module (``pro``, ``scale_by_pro``,
    ``get_opt_state_partition_specs``), loaded from its file as the module
    ``distributed_kron_2_pro`` so that it does not replace 1.0.0's package."""
    name = "distributed_kron_2_pro"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(DISTRIBUTED_KRON_2_DIR, "distributed_kron", "pro.py")
    if not os.path.exists(path):
        _missing(
            "distributed-kron==2.0.0 (pip install --no-deps --target "
            f"{DISTRIBUTED_KRON_2_DIR} distributed-kron==2.0.0)"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def psgd_jax() -> types.SimpleNamespace:
    """psgd-jax 0.1.5: ``xmat``, ``low_rank_approximation``, ``affine`` and
    ``hessian_helper``."""
    if not _installed("psgd_jax"):
        _missing("psgd-jax==0.1.5")
    import optax.transforms._clipping as clipping

    sys.modules.setdefault("optax._src.clipping", clipping)
    import jax
    import optax._src

    optax._src.clipping = clipping
    if not hasattr(jax, "tree_unflatten"):
        jax.tree_unflatten = jax.tree_util.tree_unflatten
    return types.SimpleNamespace(
        xmat=importlib.import_module("psgd_jax.xmat").xmat,
        low_rank_approximation=importlib.import_module(
            "psgd_jax.low_rank_approximation"
        ).low_rank_approximation,
        affine=importlib.import_module("psgd_jax.affine").affine,
        hessian_helper=importlib.import_module("psgd_jax.utils").hessian_helper,
        utils=importlib.import_module("psgd_jax.utils"),
    )


def kron_torch() -> types.ModuleType:
    """kron-torch 0.1.0's ``kron_torch`` package (``Kron``)."""
    if not _installed("kron_torch"):
        _missing("kron-torch==0.1.0")
    return importlib.import_module("kron_torch")


def optax_shampoo() -> types.ModuleType:
    """optax-shampoo 0.0.6's ``distributed_shampoo`` module (the newer Google code)."""
    if not _installed("optax_shampoo"):
        _missing("optax-shampoo==0.0.6")
    return importlib.import_module("optax_shampoo.distributed_shampoo")


def import_heavyball() -> types.ModuleType:
    """HeavyBall 3.2.1's ``heavyball`` package (``SOAP``, the oracle of
    precond.torch.SOAP), with its ``torch.compile`` of each step turned off
    (``heavyball.utils.compile_mode = None``): the same math, run eagerly, which
    keeps a test's CPU time low."""
    if not _installed("heavyball"):
        _missing("heavyball==3.2.1")
    heavyball = importlib.import_module("heavyball")
    heavyball.utils.compile_mode = None
    return heavyball
