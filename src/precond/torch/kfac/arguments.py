"""K-FAC's constructor arguments: KAISA's enums, the check of each argument
(``Invalid <name>=<value!r>: must be <rule>``), the rule between them, and what
a ``grad_worker_fraction`` means for a given world size."""

from __future__ import annotations

import enum
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import torch

from precond._common.validation import check_bool, check_int, check_real


class DistributedStrategy(enum.Enum):
    """Preset gradient-worker fractions: COMM_OPT 1, HYBRID_OPT 1/2, MEM_OPT
    1/world_size (KAISA's members and values)."""

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


class ComputeMethod(enum.Enum):
    """Eigendecompositions ((G ⊗ A + λI)⁻¹) or damped inverses ((G+λI)⁻¹⊗(A+λI)⁻¹)."""

    EIGEN = 1
    INVERSE = 2


class AssignmentStrategy(enum.Enum):
    """Cost of a factor for load balancing: dim³ (compute) or dim² (memory)."""

    COMPUTE = 1
    MEMORY = 2


Schedulable = Callable[[], float] | Callable[[int], float] | float


def _takes_step(function: Callable) -> bool:
    """Whether a schedule is called with the step count: KAISA 0.4 calls its
    callables with no argument, KFACPreconditioner (later releases) with the step."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins without a signature: as KAISA 0.4
        return False
    try:
        signature.bind()
    except TypeError:
        return True
    return False


_E = TypeVar("_E", bound=enum.Enum)


def _enum_member(name: str, value: Any, enum_type: type[_E]) -> _E:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str) and value.upper() in enum_type.__members__:
        return enum_type[value.upper()]
    choices = ", ".join(f"{enum_type.__name__}.{m}" for m in enum_type.__members__)
    raise ValueError(
        f"Invalid {name}={value!r}: must be one of {choices} (or its name as a str)"
    )


def _grad_workers(fraction: Any, world_size: int) -> int:
    """The number of gradient workers per layer for ``grad_worker_fraction``."""
    if isinstance(fraction, DistributedStrategy):
        return {
            DistributedStrategy.COMM_OPT: world_size,
            DistributedStrategy.HYBRID_OPT: max(1, world_size // 2),
            DistributedStrategy.MEM_OPT: 1,
        }[fraction]
    check_real("grad_worker_fraction", fraction, low=0.0, high=1.0)
    workers = max(1, round(world_size * fraction))
    if world_size % workers:
        raise ValueError(
            f"Invalid grad_worker_fraction={fraction!r}: with world size "
            f"{world_size} it gives {workers} gradient workers per layer, which "
            "must divide the world size (use a DistributedStrategy, or a fraction "
            "k/world_size with k dividing world_size)"
        )
    return workers


def _check_steps(name: str, value: Any) -> None:
    if not callable(value):
        check_int(name, value, low=1)


def _check_optional_positive(name: str, value: Any) -> None:
    if value is not None:
        check_real(name, value, low=0.0, low_inclusive=False, allow_schedule=True)


def _check_choice(enum_type: type[enum.Enum]) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        _enum_member(name, value, enum_type)

    return check


def _check_grad_worker_fraction(name: str, value: Any) -> None:
    if isinstance(value, DistributedStrategy):
        return
    if isinstance(value, enum.Enum):  # e.g. another library's enum
        raise TypeError(
            f"Invalid {name}={value!r}: must be a DistributedStrategy or a number"
        )
    check_real(name, value, low=0.0, high=1.0)


def _check_grad_scaler(name: str, value: Any) -> None:
    if value is not None and not (hasattr(value, "get_scale") or callable(value)):
        raise TypeError(
            f"Invalid {name}={value!r}: must be a GradScaler or a callable returning "
            "the loss scale"
        )


def _check_dtype(name: str, value: Any) -> None:
    if value is None and name == "factor_dtype":
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"Invalid {name}={value!r}: must be a floating torch.dtype")
    if name == "inv_dtype" and value not in (torch.float32, torch.float64):
        raise ValueError(
            f"Invalid inv_dtype={value!r}: must be float32 or float64 (eigh and inv "
            "do not run in half precision)"
        )


def _check_patterns(name: str, value: Any) -> None:
    if value is None:
        return
    if name == "skip_layers" and isinstance(value, str):
        value = [value]  # KAISA takes one name as a str
    kind = "a str or a list of str" if name == "skip_layers" else "a list of str"
    if isinstance(value, str) or not isinstance(value, Sequence | set):
        raise TypeError(f"Invalid {name}={value!r}: must be {kind}")
    for pattern in value:
        if not isinstance(pattern, str):
            raise TypeError(f"Invalid {name}={value!r}: must be {kind}")
        if name == "skip_layers":
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"Invalid {name}={value!r}: must be regular expressions "
                    f"({pattern!r}: {error})"
                ) from None


def _positive_schedulable(name: str, value: Any) -> None:
    check_real(name, value, low=0.0, low_inclusive=False, allow_schedule=True)


# One row per constructor argument (after ``model``), in signature order: the check
# raises ``Invalid <name>=<value!r>: must be <rule>`` (TypeError for a wrong type).
_ARGUMENT_CHECKS: tuple[tuple[str, Callable[[str, Any], None]], ...] = (
    ("factor_update_steps", _check_steps),
    ("inv_update_steps", _check_steps),
    ("damping", _positive_schedulable),
    (
        "factor_decay",
        partial(
            check_real, low=0.0, high=1.0, low_inclusive=False, allow_schedule=True
        ),
    ),
    ("kl_clip", _check_optional_positive),
    ("lr", partial(check_real, low=0.0, allow_schedule=True)),
    ("accumulation_steps", partial(check_int, low=1)),
    ("allreduce_bucket_cap_mb", partial(check_real, low=0.0)),
    ("assignment_strategy", _check_choice(AssignmentStrategy)),
    ("colocate_factors", check_bool),
    ("compute_method", _check_choice(ComputeMethod)),
    ("compute_eigenvalue_outer_product", check_bool),
    ("grad_worker_fraction", _check_grad_worker_fraction),
    ("symmetry_aware", check_bool),
    ("grad_scaler", _check_grad_scaler),
    ("factor_dtype", _check_dtype),
    ("inv_dtype", _check_dtype),
    ("skip_layers", _check_patterns),
    ("update_factors_in_hook", check_bool),
    ("verbose", check_bool),
    ("loglevel", partial(check_int, low=0)),
    ("layers", _check_patterns),
    ("world_size_invariant", check_bool),
)


def check_arguments(
    arguments: Mapping[str, Any],
) -> tuple[AssignmentStrategy, ComputeMethod]:
    """Checks every constructor argument (:data:`_ARGUMENT_CHECKS`) and the rule
    between them; returns the assignment strategy and the compute method as
    enum members."""
    for name, check in _ARGUMENT_CHECKS:
        check(name, arguments[name])
    assignment_strategy = _enum_member(
        "assignment_strategy", arguments["assignment_strategy"], AssignmentStrategy
    )
    compute_method = _enum_member(
        "compute_method", arguments["compute_method"], ComputeMethod
    )
    if (
        compute_method is ComputeMethod.EIGEN
        and arguments["compute_eigenvalue_outer_product"]
        and not arguments["colocate_factors"]
    ):
        raise ValueError(
            "Invalid colocate_factors=False: compute_eigenvalue_outer_product="
            "True needs both factors of a layer on one rank (set "
            "colocate_factors=True or compute_eigenvalue_outer_product=False)"
        )
    return assignment_strategy, compute_method


def mem_opt_requested(fraction: Any, world_size: int) -> bool:
    """Whether ``grad_worker_fraction`` asks for MEM_OPT as KAISA 0.4 reads it:
    the member itself (even in one process), or a fraction other than 1 of at
    most 1/world_size (0 included)."""
    if isinstance(fraction, DistributedStrategy):
        return fraction is DistributedStrategy.MEM_OPT
    return fraction != 1 and fraction <= 1 / world_size


def colocate_under_mem_opt(colocate: bool, fraction: Any, world_size: int) -> bool:
    """``colocate_factors`` as used: KAISA 0.4's rule switches it on under
    MEM_OPT (:func:`mem_opt_requested`), where a layer's one gradient worker
    holds both of its factors, with a warning pointing at the line that made
    the ``KFAC``."""
    if colocate or not mem_opt_requested(fraction, world_size):
        return colocate
    warnings.warn(
        "colocate_factors=False does not apply under MEM_OPT "
        f"(grad_worker_fraction={fraction!r}: each layer has one gradient "
        "worker, which holds both of its factors): using colocate_factors=True, "
        "as KAISA does",
        UserWarning,
        stacklevel=3,
    )
    return True


def distributed_strategy(grad_workers: int, world_size: int) -> DistributedStrategy:
    """The preset that ``grad_workers`` gradient workers per layer amount to."""
    if grad_workers == world_size:
        return DistributedStrategy.COMM_OPT
    if grad_workers == 1:
        return DistributedStrategy.MEM_OPT
    return DistributedStrategy.HYBRID_OPT
