"""Tensor fusion: which gradients travel together, and where each sits in its bucket.

A *bucket* is one flat buffer holding several tensors back to back.  Buckets
are homogeneous in dtype, device and optimizer parameter group (so that one
collective and one optimizer group cover a bucket), filled in the order the
gradients become ready during backward, capped in bytes (the first bucket
smaller, as in DDP, so that communication starts early), and padded to a
multiple of the world size (so that reduce-scatter and all-gather shards are
equal).  This module is pure bookkeeping: it knows sizes, not frameworks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

MiB = 1 << 20
DEFAULT_CAP = 25 * MiB
DEFAULT_FIRST_CAP = 1 * MiB


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs to know of one tensor: its index in the caller's
    list, element count, dtype name, item size in bytes, device and group."""

    index: int
    numel: int
    dtype: str
    itemsize: int
    device: str = "cpu"
    group: int = 0


@dataclass(frozen=True)
class Slot:
    """Tensor ``index`` occupies ``[offset, offset + numel)`` of its bucket."""

    index: int
    offset: int
    numel: int


class Move(NamedTuple):
    """Where a tensor that trains before and after a re-plan moved: ``numel`` elements from
    ``[old_offset, ...)`` of bucket ``old_bucket`` of the old plan to ``[offset, ...)`` of bucket
    ``bucket`` of the new one (:meth:`Strategy.replanned <collectives.strategy.Strategy.replanned>`)."""

    old_bucket: int
    old_offset: int
    bucket: int
    offset: int
    numel: int


@dataclass
class Bucket:
    """One fused buffer: its tensors (``slots``), ``numel`` used, ``padded`` length.

    ``padded`` is a multiple of the world size; rank r's shard is
    ``shard(r)`` = ``[r * padded // size, (r + 1) * padded // size)``.
    """

    index: int
    dtype: str
    itemsize: int
    device: str
    group: int
    world_size: int
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0

    @property
    def padded(self) -> int:
        n = self.world_size
        return max(n, -(-self.numel // n) * n)

    @property
    def nbytes(self) -> int:
        return self.padded * self.itemsize

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world_size

    def shard(self, rank: int) -> slice:
        """The slice of the flat buffer that ``rank`` owns after a reduce-scatter."""
        s = self.shard_numel
        return slice(rank * s, (rank + 1) * s)

    def pieces(self, rank: int) -> list[tuple[int, slice, slice]]:
        """Intersections of ``rank``'s shard with the tensors of this bucket:
        ``(tensor index, slice of the flat tensor, slice of the bucket)``."""
        sh = self.shard(rank)
        out = []
        for s in self.slots:
            lo, hi = max(sh.start, s.offset), min(sh.stop, s.offset + s.numel)
            if lo < hi:
                out.append((s.index, slice(lo - s.offset, hi - s.offset), slice(lo, hi)))
        return out

    def describe(self) -> dict:
        return {"bucket": self.index, "tensors": len(self.slots), "numel": self.numel,
                "bytes": self.nbytes, "dtype": self.dtype, "device": self.device, "group": self.group}


def plan_buckets(specs: Sequence[TensorSpec], world_size: int, cap_bytes: int = DEFAULT_CAP,
                 first_cap_bytes: int | None = DEFAULT_FIRST_CAP,
                 last_cap_bytes: int | None = None) -> list[Bucket]:
    """Assign tensors, given in gradient-ready order, to buckets.

    One bucket is open per (dtype, device, group); a tensor joins the open
    bucket of its kind, and the bucket closes once it holds ``cap_bytes`` (the
    first bucket to close: ``first_cap_bytes``, so that communication starts
    early).  A tensor of at least the cap gets a bucket of its own and the
    open bucket stays open (no sliver buckets of biases between big layers).
    ``last_cap_bytes``: the last tensors to become ready (the model's first
    layers), up to this many bytes of one kind, get a bucket of their own, so
    that the communication left after backward, and DeAR's first all-gather
    before forward, are short.  Buckets are numbered in the order they close,
    which is the order they become ready in backward.

    Example:
        >>> specs = [TensorSpec(i, n, "float32", 4) for i, n in enumerate([10, 300_000, 20, 5])]
        >>> [len(b.slots) for b in plan_buckets(specs, world_size=4, cap_bytes=1 << 20)]
        [1, 3]
        >>> [len(b.slots) for b in plan_buckets(specs, 4, 1 << 20, last_cap_bytes=100)]
        [1, 1, 2]
    """
    if last_cap_bytes and specs:
        key = (specs[-1].dtype, specs[-1].device, specs[-1].group)
        tail, size = 0, 0
        for s in reversed(specs):
            if (s.dtype, s.device, s.group) != key or size + s.numel * s.itemsize > last_cap_bytes:
                break
            size += s.numel * s.itemsize
            tail += 1
        if 0 < tail < len(specs):
            head = plan_buckets(specs[:-tail], world_size, cap_bytes, first_cap_bytes)
            last = plan_buckets(specs[-tail:], world_size, cap_bytes, None)
            for b in last:
                b.index = len(head)
                head.append(b)
            return head
    if world_size < 1:
        raise ValueError(f"world_size {world_size}: expected >= 1")
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes {cap_bytes}: expected > 0")
    seen: set[int] = set()
    open_: dict[tuple[str, str, int], Bucket] = {}
    closed: list[Bucket] = []

    def close(key: tuple[str, str, int]) -> None:
        b = open_.pop(key)
        b.index = len(closed)
        closed.append(b)

    for s in specs:
        if s.index in seen:
            raise ValueError(f"tensor {s.index} listed twice")
        seen.add(s.index)
        if s.numel <= 0:
            continue
        key = (s.dtype, s.device, s.group)
        cap = first_cap_bytes if (first_cap_bytes and not closed) else cap_bytes
        if s.numel * s.itemsize >= cap:     # a tensor over the cap travels alone
            alone = Bucket(len(closed), s.dtype, s.itemsize, s.device, s.group, world_size,
                           [Slot(s.index, 0, s.numel)], s.numel)
            closed.append(alone)
            continue
        b = open_.get(key)
        if b is None:
            b = open_[key] = Bucket(-1, s.dtype, s.itemsize, s.device, s.group, world_size)
        b.slots.append(Slot(s.index, b.numel, s.numel))
        b.numel += s.numel
        if b.numel * b.itemsize >= cap:
            close(key)
    # leftovers close in the order of their last tensor
    last = {k: max(sl.index for sl in b.slots) for k, b in open_.items()}
    order = {s.index: i for i, s in enumerate(specs)}
    for key in sorted(open_, key=lambda k: order[last[k]]):
        close(key)
    return closed
