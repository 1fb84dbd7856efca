"""The sparse exchange over a commlib communicator, and its traffic model.

A step of an index-based selector moves three things:

1. **counts**: one small fixed-size int64 record per rank, all-gathered
   (:func:`exchange_records`): a status word (so that a rank with bad input
   makes every rank raise before any data moves), the selected count, and
   what the threshold rule needs (its histogram);
2. **indices**: each rank's selected indices, all-gathered with the counts
   just learned (``allgatherv``: no padding to the largest count);
3. **values**: every rank reads its own accumulated gradient at the union of
   indices and the values are all-reduced (sum / n, :func:`average_at`).

Bytes are counted as what one rank puts on the wire under ring algorithms
(:class:`Traffic`): an all-gather of ``T`` bytes in total sends ``(n-1)/n T``,
an all-reduce of ``m`` bytes ``2 (n-1)/n m``, a broadcast of ``m`` bytes
``(n-1)/n m``.  Dense all-reduce of N float32 is then ``8 (n-1)/n N``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib import Communicator, ValidationError

from ._arrays import to_host

STATUS_OK = 0
STATUS_BAD = 1


class Traffic:
    """Bytes one rank sends in a step under the ring model (see the module docs)."""

    def __init__(self, n: int):
        self.n = n
        self.bytes = 0.0

    def allgather(self, total_bytes: float) -> None:
        self.bytes += (self.n - 1) / self.n * total_bytes

    def allreduce(self, nbytes: float) -> None:
        self.bytes += 2.0 * (self.n - 1) / self.n * nbytes

    def broadcast(self, nbytes: float) -> None:
        self.bytes += (self.n - 1) / self.n * nbytes


def exchange_records(comm: Communicator, fields: list[Any], length: int,
                     problem: str | None, who: str, traffic: Traffic | None = None,
                     dtype: Any = np.int64) -> np.ndarray:
    """All-gather one record per rank: ``[status, *fields]`` padded to ``length`` words.

    ``fields`` are ints/floats or 1-D numpy or cupy arrays, concatenated.  A rank
    with a ``problem`` sends a record marked bad; then every rank raises
    :class:`commlib.ValidationError` naming the ranks (the exchange itself
    completed, so the communicator stays usable).  The record is a host array
    whatever the gradient's device (a few words of control: over MPI on an NCCL
    communicator, no device round trip); returns the table, shape ``(n, length)``.
    """
    rec = np.zeros(length, dtype=dtype)
    if problem is None:
        pos = 1
        for f in fields:
            if isinstance(f, (int, float, np.integer, np.floating)):
                rec[pos] = f
                pos += 1
            else:
                size = int(f.size)
                rec[pos:pos + size] = to_host(f)     # a cupy field: its one device-to-host copy
                pos += size
        assert pos <= length, (pos, length)
    else:
        rec[0] = STATUS_BAD
    table = comm.allgather(rec, tag=f"{who}:counts")
    if traffic is not None:
        traffic.allgather(comm.size * length * np.dtype(dtype).itemsize)
    table = table.reshape(comm.size, length)
    bad = [r for r in range(comm.size) if table[r, 0] != STATUS_OK]
    if bad:
        mine = f"; this rank ({comm.rank}): {problem}" if problem else ""
        raise ValidationError(f"{who}: ranks {bad} rejected their input before any data moved{mine}")
    return table


def gather_indices(comm: Communicator, idx: Any, counts: list[int], who: str,
                   traffic: Traffic | None = None) -> Any:
    """Every rank's selected indices, concatenated in rank order (``allgatherv``, no padding)."""
    union = comm.allgatherv(idx, counts=counts, tag=f"{who}:indices")
    if traffic is not None:
        traffic.allgather(sum(counts) * idx.dtype.itemsize)
    return union


def average_at(comm: Communicator, acc: Any, union: Any, who: str,
               traffic: Traffic | None = None) -> Any:
    """This rank's ``acc`` at ``union``, all-reduced and divided by n (exact on the union)."""
    values = acc[union]
    comm.allreduce(values, "avg", out=values, tag=f"{who}:values")
    if traffic is not None:
        traffic.allreduce(values.nbytes)
    return values
