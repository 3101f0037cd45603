"""Writes docs/arguments.md: every public optimizer's arguments, their defaults and
what each accepts, from the same argument tables that validate them.

The "accepts" column is the rule each table's check states in its own error
message (``Invalid <name>=<value!r>: must be <rule>``): the check is called with a
few probe values that no rule accepts (an unrelated object, NaN, a huge negative
integer) and the rules it names are joined. So the docs and the errors cannot
disagree; ``tests/test_docs_arguments.py`` fails when the committed file is stale.

Usage: ``python docs/make_arguments.py`` (rewrites docs/arguments.md) or
``python docs/make_arguments.py --check`` (exits 1 if it is stale).
"""

from __future__ import annotations

import argparse
import enum
import inspect
import pathlib
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

OUTPUT = pathlib.Path(__file__).with_name("arguments.md")
_PROBES = (object(), float("nan"), -(10**18))
_RULE = re.compile(r"^Invalid .*?: must be (.*)$", re.DOTALL)
Check = Callable[[str, Any], None]


def _rules(name: str, check: Check) -> list[str]:
    """The rules ``check`` states when given values nothing accepts, in order."""
    rules: list[str] = []
    for probe in _PROBES:  # NaN first states "finite and <range>", then "<range>"
        try:
            check(name, probe)
        except (TypeError, ValueError) as error:
            match = _RULE.match(str(error))
            rule = match.group(1) if match else str(error)
            if not any(rule in earlier for earlier in rules):
                rules.append(rule)
    return rules


def _accepts(name: str, check: Check | None) -> str:
    if check is None:
        return "not checked at construction"
    rules = _rules(name, check)
    return "; ".join(rules) if rules else "checked by `init`, against the parameters"


def _default(parameter: inspect.Parameter) -> str:
    value = parameter.default
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, enum.Enum):
        return f"`{type(value).__name__}.{value.name}`"
    if callable(value):
        return f"`{getattr(value, '__qualname__', type(value).__name__)}`"
    return f"`{value!r}`"


def _kind(parameter: inspect.Parameter) -> str:
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
        return "keyword"
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
        return "**"
    return "positional"


def _table(
    title: str, function: Callable, checks: dict[str, Check], skip: Iterable[str]
) -> list[str]:
    lines = [
        f"## `{title}`",
        "",
        "| argument | passed as | default | accepts |",
        "|---|---|---|---|",
    ]
    for name, parameter in inspect.signature(function).parameters.items():
        if name in skip:
            continue
        accepts = _accepts(name, checks.get(name)).replace("|", "\\|")
        lines.append(
            f"| `{name}` | {_kind(parameter)} | {_default(parameter)} | {accepts} |"
        )
    return [*lines, ""]


def _entries() -> list[tuple[str, Callable, dict[str, Check], tuple[str, ...]]]:
    import precond.jax as pj
    from precond.jax._core.alias import ALIAS_ARGUMENT_CHECKS
    from precond.jax.kron._arguments import KRON_ARGUMENT_CHECKS
    from precond.jax.kron._pro_config import PRO_ARGUMENT_CHECKS
    from precond.jax.kron.pro_adamw import PRO_ADAMW_ARGUMENT_CHECKS
    from precond.jax.psgd._transform import PSGD_ARGUMENT_CHECKS
    from precond.jax.psgd.affine import AFFINE_ARGUMENT_CHECKS
    from precond.jax.psgd.lra import LRA_ARGUMENT_CHECKS
    from precond.jax.shampoo._config import ARGUMENT_CHECKS as SHAMPOO_CHECKS
    from precond.jax.soap._config import ARGUMENT_CHECKS as SOAP_CHECKS

    psgd = {**ALIAS_ARGUMENT_CHECKS, **PSGD_ARGUMENT_CHECKS}
    entries = [
        (
            "precond.jax.kron",
            pj.kron,
            {**ALIAS_ARGUMENT_CHECKS, **KRON_ARGUMENT_CHECKS},
            (),
        ),
        (
            "precond.jax.pro",
            pj.pro,
            {**ALIAS_ARGUMENT_CHECKS, **PRO_ARGUMENT_CHECKS},
            (),
        ),
        (
            "precond.jax.pro_adamw",
            pj.pro_adamw,
            dict(PRO_ADAMW_ARGUMENT_CHECKS),
            (),
        ),
        ("precond.jax.xmat", pj.xmat, psgd, ()),
        (
            "precond.jax.low_rank_approximation",
            pj.low_rank_approximation,
            {**psgd, **LRA_ARGUMENT_CHECKS},
            (),
        ),
        ("precond.jax.affine", pj.affine, {**psgd, **AFFINE_ARGUMENT_CHECKS}, ()),
        (
            "precond.jax.distributed_shampoo",
            pj.distributed_shampoo,
            dict(SHAMPOO_CHECKS),
            (),
        ),
        ("precond.jax.soap", pj.soap, dict(SOAP_CHECKS), ()),
    ]
    try:
        import precond.torch.kron._kron_arguments as torch_kron
        import precond.torch.kron.kron as torch_kron_optimizer
        import precond.torch.kron.pro as torch_pro
        import precond.torch.kron.pro_adamw as torch_pro_adamw
        import precond.torch.shampoo._arguments as torch_shampoo_arguments
        import precond.torch.soap._soap_arguments as torch_soap_arguments
        from precond.torch import SOAP, Shampoo
        from precond.torch.kfac import preconditioner as kfac
        from precond.torch.kron.strategies import check_strategy
    except ModuleNotFoundError:  # no torch: the JAX tables only
        return entries
    return [
        *entries,
        (
            "precond.torch.Kron",
            torch_kron_optimizer.Kron,
            dict(torch_kron.GROUP_ARGUMENTS + torch_kron.OPTIMIZER_ARGUMENTS),
            ("params",),
        ),
        (
            "precond.torch.Pro",
            torch_pro.Pro,
            dict(torch_pro.GROUP_ARGUMENTS + torch_pro.OPTIMIZER_ARGUMENTS),
            ("params",),
        ),
        (
            "precond.torch.ProAdamW",
            torch_pro_adamw.ProAdamW,
            dict(torch_pro_adamw.GROUP_ARGUMENTS + torch_pro_adamw.OPTIMIZER_ARGUMENTS),
            ("params",),
        ),
        (
            "precond.torch.Shampoo",
            Shampoo,
            {
                **dict(torch_shampoo_arguments.GROUP_ARGUMENTS),
                "strategy": check_strategy,
            },
            ("params",),
        ),
        (
            "precond.torch.SOAP",
            SOAP,
            {
                **dict(torch_soap_arguments.GROUP_ARGUMENTS),
                "strategy": check_strategy,
            },
            ("params",),
        ),
        ("precond.torch.kfac.KFAC", kfac.KFAC, dict(kfac._ARGUMENT_CHECKS), ("model",)),
    ]


def render() -> str:
    lines = [
        "# Arguments: defaults and what each accepts",
        "",
        "Generated by `python docs/make_arguments.py` from the argument tables that",
        "validate each optimizer at construction; do not edit by hand. The *accepts*",
        "column is the rule the error message states for a bad value",
        "(`Invalid <name>=<value!r>: must be <rule>`).",
        "",
    ]
    for entry in _entries():
        lines += _table(*entry)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUTPUT.exists() or OUTPUT.read_text(encoding="utf-8") != text
        if stale:
            print(f"{OUTPUT} is stale: run python docs/make_arguments.py")
        return int(stale)
    OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
