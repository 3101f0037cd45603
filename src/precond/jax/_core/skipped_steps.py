"""``precond.jax.skipped_steps``: the count of skipped steps in an optax state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from precond.jax.kron._pro_config import ProState
from precond.jax.kron._state import KronState
from precond.jax.psgd._transform import PSGDState
from precond.jax.shampoo._state import ShampooState
from precond.jax.soap._state import SoapState

# The states whose ``skipped`` field counts their optimizer's skipped steps.
STATES_WITH_SKIP_COUNTS = (KronState, ProState, PSGDState, ShampooState, SoapState)


def _is_counting_state(node: Any) -> bool:
    return isinstance(node, STATES_WITH_SKIP_COUNTS)


def skipped_steps(state: Any) -> jax.Array:
    """How many steps precond's JAX optimizers in ``state`` skipped: an int32
    scalar, the sum of the counters found anywhere in the optax state tree
    (``optax.chain``, ``inject_hyperparams`` and ``multi_transform`` states
    included, and flax ``nnx.Optimizer``'s ``opt_state``; 0 when there are
    none). Two optimizers that skip one step (parts of a ``multi_transform``,
    each with a bad gradient) count it twice; ``pro_adamw``'s parts skip
    together and its pro part counts (nothing when no leaf is pro's).

    A step is skipped when some gradient (or Hessian-vector product) is NaN,
    ±Inf or so large that its squared norm overflows: its update is zero
    (the parameters move by decoupled weight decay alone, if any) and no state
    changes but this count (``skipped`` in ``KronState``, ``ProState``,
    ``PSGDState``, ``ShampooState`` and ``SoapState``, saturating at 2³¹ − 1).
    Works eagerly and under ``jit``.

    Asked for, the first skipped step of each optimizer (each ``kron(...)``,
    ``scale_by_pro(...)``, ... call) is also logged once per process at
    WARNING on the logger ``"precond.jax"``, from inside the jitted step by a
    host callback that runs on skipped steps only: call
    ``logging.getLogger("precond.jax").setLevel(logging.WARNING)`` before the
    step is traced (its first call under ``jit``). By default the callback is
    left out: it costs every step, taken or not, and a program holding one is
    not written to JAX's persistent compilation cache.

    Args:
        state: an optax state (or a tree holding one, such as ``nnx.Optimizer``'s
            ``opt_state``).

    Returns:
        An int32 scalar: the steps skipped by every precond optimizer in ``state``.

    Example:
        >>> import jax.numpy as jnp
        >>> import precond.jax as pj
        >>> optimizer = pj.kron(learning_rate=1e-3)
        >>> params = {"w": jnp.ones((3, 2))}
        >>> state = optimizer.init(params)
        >>> _, state = optimizer.update({"w": jnp.full((3, 2), jnp.nan)}, state)
        >>> int(pj.skipped_steps(state))
        1
    """
    nodes = jax.tree.leaves(state, is_leaf=_is_counting_state)
    # jnp.asarray also unwraps flax nnx variables (nnx.Optimizer's opt_state).
    counts = [
        jnp.asarray(node.skipped, jnp.int32)
        for node in nodes
        if _is_counting_state(node)
    ]
    if not counts:
        return jnp.zeros([], jnp.int32)
    return jnp.sum(jnp.stack(counts))
