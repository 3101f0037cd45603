"""All of K-FAC's communication over ``torch.distributed``, in one place.

Three kinds, counted in :attr:`Communicator.bytes_sent` (bytes this rank puts in
collectives, by kind):

* ``factors``: the all-reduce of every layer's factor contributions, packed into
  buckets of at most ``bucket_cap_mb`` (0: one all-reduce per tensor), all launched
  asynchronously, then awaited; symmetric matrices travel as their upper triangle
  with ``symmetry_aware``;
* ``second_order``: broadcasts of decompositions/inverses down a layer's column;
* ``gradients``: broadcasts of preconditioned gradients along a row.

Without an initialised process group the world is one rank and nothing is sent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Communicator"]


class Communicator:
    """The rank's view of the job, and the collectives K-FAC needs."""

    def __init__(self, *, bucket_cap_mb: float, symmetry_aware: bool):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.symmetry_aware = symmetry_aware
        self.bytes_sent: Counter[str] = Counter()
        self._triu: dict[tuple[int, torch.device], torch.Tensor] = {}

    def new_group(self, ranks: Sequence[int]):
        """A process group of ``ranks`` (every rank must call this for every group,
        in the same order); ``None`` where no communication is needed."""
        if not self.distributed or len(ranks) < 2:
            return None
        if len(ranks) == self.world_size:
            return dist.group.WORLD
        return dist.new_group(list(ranks))

    # -- packing --
    def _triu_indices(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, device)
        if key not in self._triu:
            rows, cols = torch.triu_indices(n, n, device=device)
            self._triu[key] = rows * n + cols
        return self._triu[key]

    def _pack(self, tensor: torch.Tensor, symmetric: bool) -> torch.Tensor:
        if symmetric and self.symmetry_aware:
            return tensor.reshape(-1)[
                self._triu_indices(tensor.shape[0], tensor.device)
            ]
        return tensor.reshape(-1)

    def _unpack(self, flat: torch.Tensor, like: torch.Tensor, symmetric: bool):
        if symmetric and self.symmetry_aware:
            n = like.shape[0]
            full = flat.new_zeros(n * n)
            full[self._triu_indices(n, flat.device)] = flat
            upper = full.reshape(n, n)
            return upper + upper.T - torch.diag(upper.diagonal())
        return flat.reshape(like.shape)

    # -- collectives --
    def all_reduce_sum(
        self, tensors: Sequence[torch.Tensor], symmetric: Sequence[bool]
    ) -> list[torch.Tensor]:
        """Sums of ``tensors`` over all ranks (new tensors; inputs are not changed).

        Tensors are grouped into buckets by dtype and size; each bucket is one
        asynchronous all-reduce.
        """
        if not self.distributed or self.world_size == 1:
            return list(tensors)
        packed = [self._pack(t, s) for t, s in zip(tensors, symmetric, strict=True)]
        buckets: list[list[int]] = []
        size = 0
        for i, flat in enumerate(packed):
            nbytes = flat.numel() * flat.element_size()
            same_dtype = buckets and packed[buckets[-1][0]].dtype == flat.dtype
            if (
                not buckets
                or not same_dtype
                or self.bucket_cap_bytes == 0
                or size + nbytes > self.bucket_cap_bytes
            ):
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        pending = []
        for bucket in buckets:
            buffer = torch.cat([packed[i] for i in bucket])
            self.bytes_sent["factors"] += buffer.numel() * buffer.element_size()
            pending.append((bucket, buffer, dist.all_reduce(buffer, async_op=True)))
        out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for bucket, buffer, work in pending:
            work.wait()
            offset = 0
            for i in bucket:
                n = packed[i].numel()
                flat = buffer[offset : offset + n]
                out[i] = self._unpack(flat, tensors[i], symmetric[i])
                offset += n
        return out

    def broadcast(
        self,
        tensors: Sequence[torch.Tensor],
        symmetric: Sequence[bool],
        *,
        src: int,
        group,
        kind: str,
    ) -> list[torch.Tensor]:
        """``tensors`` as held on rank ``src``, on every rank of ``group``.

        Non-source ranks pass tensors of the right shapes and dtype (their values
        are ignored). All tensors travel in one buffer (one dtype).
        """
        if group is None or not tensors:
            return list(tensors)
        packed = [self._pack(t, s) for t, s in zip(tensors, symmetric, strict=True)]
        buffer = torch.cat(packed)
        if self.rank == src:
            self.bytes_sent[kind] += buffer.numel() * buffer.element_size()
        dist.broadcast(buffer, src=src, group=group)
        if self.rank == src:
            return list(tensors)
        out, offset = [], 0
        for flat, like, sym in zip(packed, tensors, symmetric, strict=True):
            out.append(self._unpack(buffer[offset : offset + flat.numel()], like, sym))
            offset += flat.numel()
        return out
