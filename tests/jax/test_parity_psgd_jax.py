"""precond's XMat, LRA, Affine and hessian_helper against psgd-jax 0.1.5 (the oracle).

Signatures are compared with ``inspect.signature``.
"""

import inspect

import pytest

import precond.jax as pj
from precond.jax.hessian import hessian_helper
from tests import oracles

STEPS = 20
RTOL = 1e-5
NAMES = ("xmat", "low_rank_approximation", "affine")
# precond's own keyword-only additions (psgd-jax 0.2.9 added none to these).
NEWER_KEYWORDS: dict[str, set[str]] = {}


def _precond(name):
    return getattr(pj, name)


def _oracle(name):
    return getattr(oracles.psgd_jax(), name)


@pytest.mark.parametrize("name", NAMES)
def test_signature_matches_psgd_jax(name):
    ours = inspect.signature(_precond(name)).parameters
    theirs = inspect.signature(_oracle(name)).parameters
    seed_names = list(theirs)
    assert list(ours)[: len(seed_names)] == seed_names
    for key in seed_names:
        assert ours[key].kind == theirs[key].kind, key
        assert ours[key].default == theirs[key].default, key
    newer = list(ours)[len(seed_names) :]
    assert set(newer) <= NEWER_KEYWORDS.get(name, set())
    assert all(ours[k].kind is inspect.Parameter.KEYWORD_ONLY for k in newer)


def test_hessian_helper_signature_matches_psgd_jax():
    ours = inspect.signature(hessian_helper).parameters
    theirs = inspect.signature(oracles.psgd_jax().hessian_helper).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]
