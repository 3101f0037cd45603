"""Newton mode: the extra arguments of an optimizer's ``update`` (``Hvp``, ``vector``,
``update_preconditioner``) that fit its preconditioner to Hessian-vector products.
"""

from __future__ import annotations

from typing import Any

import jax

# Extra arguments of an optimizer's ``update`` that switch its fit to Newton mode.
NEWTON_ARGS = ("Hvp", "vector", "update_preconditioner")


def newton_arguments(updates: Any, extra_args: dict) -> dict | None:
    """The Newton-mode extra arguments of ``update``, checked; None if absent.

    All three of :data:`NEWTON_ARGS` or none; ``Hvp`` and ``vector`` must have the
    gradients' structure and shapes.
    """
    given = {name: extra_args.get(name) for name in NEWTON_ARGS}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == len(NEWTON_ARGS):
        return None
    if missing:
        raise ValueError(
            f"Newton-mode fitting needs {', '.join(NEWTON_ARGS)} together; "
            f"missing {', '.join(missing)} (precond.jax.hessian_helper returns "
            "all three)"
        )
    treedef = jax.tree.structure(updates)
    for name in ("Hvp", "vector"):
        if jax.tree.structure(given[name]) != treedef:
            raise ValueError(
                f"Invalid {name}: must have the structure of the gradients "
                f"({treedef}); got {jax.tree.structure(given[name])}"
            )
        for (path, x), g in zip(
            jax.tree_util.tree_flatten_with_path(given[name])[0],
            jax.tree.leaves(updates),
            strict=True,
        ):
            if x.shape != g.shape:
                raise ValueError(
                    f"Invalid {name}{jax.tree_util.keystr(path)}: shape "
                    f"{x.shape} differs from the gradient's {g.shape}"
                )
    return given
