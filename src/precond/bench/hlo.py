"""Communication of a compiled SPMD program, read from its optimized HLO text.

Used by the sharding tests and ``benchmarks/memory.py``. The figure is the
bytes one device receives per call, which does not depend on how XLA splits a
collective into steps (an all-gather over two mesh axes may run as two):

    all-gather over k devices     (k−1)/k · result bytes
    all-to-all over k devices     (k−1)/k · result bytes
    reduce-scatter over k devices (k−1)   · result bytes
    all-reduce over k devices     2(k−1)/k · bytes  (ring: reduce-scatter + gather)
    collective-permute            result bytes

Collectives inside both branches of a conditional are all counted (an upper bound
for a step that takes one branch).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "reduce-scatter",
    "collective-permute",
)
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: groups along axis_1.
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")


class Collective(NamedTuple):
    op: str  # e.g. "all-gather"
    result_bytes: int  # bytes of the result on one device
    group_size: int  # devices taking part in each group
    received_bytes: float  # bytes one device receives (see the module docstring)


def _array_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        numel = math.prod(int(d) for d in dims.split(",") if d)
        total += numel * DTYPE_BYTES[dtype]
    return total


def _group_size(line: str, num_devices: int) -> int:
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    listed = _GROUPS_LIST.search(line)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    if "replica_groups" in line:
        raise ValueError(f"Unrecognised replica_groups in HLO line: {line[:300]}")
    return num_devices


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective in ``hlo_text`` (``compiled.as_text()``) with its bytes."""
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if not match or "-done(" in line:
            continue
        op = match.group("op")
        result = _array_bytes(match.group("shape"))
        k = _group_size(line, num_devices)
        if op == "collective-permute":
            received = float(result)
        elif op == "all-reduce":
            received = 2 * (k - 1) / k * result
        elif op == "reduce-scatter":
            received = float((k - 1) * result)
        else:
            received = (k - 1) / k * result
        found.append(Collective(op, result, k, received))
    return found


def received_bytes(hlo_text: str, num_devices: int) -> float:
    """Bytes one device receives in one call of the program (module docstring)."""
    return sum(c.received_bytes for c in collectives(hlo_text, num_devices))
