"""Views of Distributed Shampoo's state: its shapes, its partition specs, and the
seed's per-parameter layout (to read a precond state as the seed's, or to load
the seed's checkpoint), each for the arguments of ``distributed_shampoo``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import jax

from precond.jax.shampoo._config import (
    Config,
    validated,
)
from precond.jax.shampoo._seed import (
    parameter_stats_view,
    state_from_seed,
)
from precond.jax.shampoo._state import (
    InitFnState,
    ShampooState,
    state_partition_specs,
)


def _seed_init_fns(arguments: dict, state_init: Callable) -> Callable:
    """The seed's sharded ``init``: called with anything, it returns the
    :class:`InitFnState` triple for ``distributed_shampoo(**arguments)``."""
    plain = {**arguments, "sharded_init_fns": False}

    def pspec_fn(params, params_partition_spec, partition_spec_for_statistics=None):
        spec = partition_spec_for_statistics or plain["statistics_partition_spec"]
        return distributed_shampoo_partition_specs(
            params,
            params_partition_spec,
            **{**plain, "statistics_partition_spec": spec},
        )

    def init(params):
        del params  # the seed's init_fn is called with anything
        return InitFnState(
            init_fn=state_init,
            pspec_fn=pspec_fn,
            shape_and_dtype_fn=functools.partial(
                distributed_shampoo_state_shapes, **plain
            ),
        )

    return init


def _bound_config(args, kwargs) -> Config:
    """The config of ``distributed_shampoo(*args, **kwargs)``."""
    from precond.jax.shampoo.transform import distributed_shampoo  # it imports us

    bound = inspect.signature(distributed_shampoo).bind(*args, **kwargs)
    bound.apply_defaults()
    return validated(**bound.arguments)


def distributed_shampoo_state_shapes(params, *args, **kwargs) -> ShampooState:
    """Shapes and dtypes (``jax.ShapeDtypeStruct``) of the state that
    ``distributed_shampoo(*args, **kwargs).init(params)`` returns (params may be
    abstract); the seed's ``shape_and_dtype_fn``.

    Args:
        params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
        *args: the positional arguments of :func:`distributed_shampoo`
            (``learning_rate``, ``block_size``, ...).
        **kwargs: its keyword arguments.

    Returns:
        A :class:`ShampooState` of ``jax.ShapeDtypeStruct`` leaves.

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
        >>> shapes = distributed_shampoo_state_shapes(params, 0.1, block_size=128)
        >>> shapes.momentum["w"]
        ShapeDtypeStruct(shape=(4, 3), dtype=float32)
    """
    kwargs = {**kwargs, "sharded_init_fns": False}
    from precond.jax.shampoo.transform import distributed_shampoo  # it imports us

    return jax.eval_shape(distributed_shampoo(*args, **kwargs).init, params)


def distributed_shampoo_partition_specs(
    params, params_partition_spec, *args, **kwargs
) -> ShampooState:
    """The ``PartitionSpec`` of every leaf of ``distributed_shampoo(*args,
    **kwargs).init(params)``: per-parameter buffers follow their parameter's spec
    (``params_partition_spec``, a tree like ``params``), the stacks follow
    ``statistics_partition_spec`` (replicated without one), the rest replicates.
    Use it for ``jax.jit(..., out_shardings=...)``; the seed's ``pspec_fn``.

    Args:
        params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
        params_partition_spec: a PartitionSpec per parameter, a pytree like ``params``.
        *args: the positional arguments of :func:`distributed_shampoo`
            (``learning_rate``, ``block_size``, ...).
        **kwargs: its keyword arguments.

    Returns:
        A :class:`ShampooState` of ``PartitionSpec`` leaves.

    Example, rows of ``w`` split over a mesh axis "data":

        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> specs = distributed_shampoo_partition_specs(
        ...     params, {"w": PartitionSpec("data")}, 0.1, block_size=128
        ... )
        >>> specs.momentum["w"] == PartitionSpec("data", None)
        True
    """
    config = _bound_config(args, kwargs)
    shapes = distributed_shampoo_state_shapes(params, *args, **kwargs)
    return state_partition_specs(shapes, params, params_partition_spec, config)


def seed_parameter_stats(state: ShampooState, params, *args, **kwargs):
    """``state`` seen as the seed's ``ShampooState.stats``: a tree like ``params``
    of :class:`ParameterStats`, for code that reads the seed's per-parameter
    fields (``stats[name].statistics[i]``, ``.training_metrics`` …). ``args`` and
    ``kwargs`` are the ``distributed_shampoo`` arguments the state was made with.
    :func:`shampoo_state_from_seed` is the inverse.

    Args:
        state: a :class:`ShampooState` of ``distributed_shampoo(*args, **kwargs)``.
        params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
        *args: the positional arguments of :func:`distributed_shampoo`
            (``learning_rate``, ``block_size``, ...).
        **kwargs: its keyword arguments.

    Returns:
        A tree like ``params`` of :class:`ParameterStats`.

    Example:
        >>> import jax.numpy as jnp
        >>> from precond.jax import distributed_shampoo
        >>> params = {"w": jnp.ones((4, 3))}
        >>> state = distributed_shampoo(0.1, block_size=128).init(params)
        >>> stats = seed_parameter_stats(state, params, 0.1, block_size=128)
        >>> errors = stats["w"].training_metrics.inverse_pth_root_errors
    """
    return parameter_stats_view(state, params, _bound_config(args, kwargs))


def shampoo_state_from_seed(seed_state, params, *args, **kwargs) -> ShampooState:
    """The :class:`ShampooState` holding what a state in the seed's layout holds:
    load a checkpoint written by Google's ``distributed_shampoo`` (the seed
    revision or optax-shampoo 0.0.6) into precond. The inverse of
    :func:`seed_parameter_stats`.

    ``seed_state`` has ``count`` and ``stats`` (the seed's ``ShampooState``, or
    :class:`SeedShampooState`): ``stats`` is a tree like ``params`` of
    ``ParameterStats(diagonal_statistics, statistics, preconditioners,
    diagonal_momentum, momentum, training_metrics)``, or with
    ``shard_optimizer_states`` the seed's ``ShardedShampooStats(global_stats,
    local_stats)``. Members may be the seed's ``QuantizedValue`` (memory mode):
    they are dequantized (values·bucket sizes per column, plus the diagonal) and
    stored as ``distributed_shampoo(*args, **kwargs)`` stores them (int8 momenta
    and int16 statistics requantize to the same integers). ``args`` and
    ``kwargs`` are the arguments precond's optimizer will run with (those the
    checkpoint was written with, plus 0.0.6's values where they differ, e.g.
    ``merge_small_dims_block_size=4096``): they fix which statistics each
    parameter has, and a checkpoint that does not fit them is refused naming
    the parameter. Only ``inverse_pth_root_errors`` of the training metrics is
    kept; with ``generate_training_metrics`` and none in the checkpoint it
    starts at 0.

    Example (``seed_state`` would come from a checkpoint of the seed, e.g.
    ``orbax_checkpointer.restore(path, item=google_state)``; here it is
    :func:`seed_parameter_stats` of a precond state):
        >>> import jax.numpy as jnp
        >>> from precond.jax import SeedShampooState, distributed_shampoo
        >>> params = {"w": jnp.ones((4, 3))}
        >>> opt = distributed_shampoo(0.1, block_size=128)
        >>> stats = seed_parameter_stats(opt.init(params), params, 0.1, block_size=128)
        >>> seed_state = SeedShampooState(count=jnp.zeros([], jnp.int32), stats=stats)
        >>> state = shampoo_state_from_seed(seed_state, params, 0.1, block_size=128)
        >>> updates, state = opt.update({"w": jnp.ones((4, 3))}, state, params)

    Args:
        seed_state: the seed's state: ``count`` and ``stats`` (see above).
        params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
        *args: the positional arguments of :func:`distributed_shampoo`
            (``learning_rate``, ``block_size``, ...).
        **kwargs: its keyword arguments.

    Returns:
        The :class:`ShampooState` of ``distributed_shampoo(*args, **kwargs)`` holding
        the checkpoint's values.
    """
    return state_from_seed(seed_state, params, _bound_config(args, kwargs))
