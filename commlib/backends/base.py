"""What every backend provides: operations that start and return a :class:`Pending`.

The communicator validates inputs, numbers operations, traces them and
enforces the timeout; a backend only starts an operation on storage arrays
(see :mod:`commlib.arrays`) and reports when it is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: Reduction operators, by name.
REDUCE_OPS = ("sum", "avg", "max", "min")


def split_counts(n: int, size: int) -> list[int]:
    """Element counts of ``size`` near-equal chunks of ``n`` (the first ``n % size`` get one more).

    This is how :meth:`commlib.Communicator.reduce_scatter` splits a buffer
    whose length is not divisible by the world size, as ``numpy.array_split``.

    Example:
        >>> split_counts(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(n, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class Pending:
    """An operation in flight: wait until ``test()`` is true, then call ``finish()`` once if set.

    ``request``: the MPI request to wait on inside MPI (``None`` for backends
    that complete on a device stream: their ``test`` is polled).  ``test``
    must not block; ``finish`` (``None``: nothing to do) runs the completion
    steps (copy back from a staging buffer, divide for ``avg``) and may block
    briefly.  ``keep``: a buffer the operation reads or writes that nothing else
    holds (a copy sent apart from an overlapping ``out``, a float32 stand-in for
    bfloat16), held until the operation is done: MPI reads it after the call that
    posted it returns, and mpi4py's request does not hold every buffer.
    """

    __slots__ = ("test", "finish", "request", "keep")

    def __init__(self, test: Callable[[], bool], finish: Callable[[], None] | None = None,
                 request: Any = None, keep: Any = None):
        #: ``test()``: whether the operation is complete (the backend's own callable:
        #: a wait loop calls it back to back, so no frame of ours sits in between)
        self.test = test
        self.finish = finish
        self.request = request
        self.keep = keep


class Backend(Protocol):
    """The operations a backend implements on flat storage arrays of one dtype.

    ``ctx``: for device arrays, the caller's :class:`~commlib.device.CallerStream`
    captured when the operation was called (the backend orders its work after
    ``ctx.ready`` and hands results back on ``ctx.stream``); ``None`` for host
    arrays.  An operation may start and finish on another thread than the
    caller's.  ``abort`` gives up on everything in flight after an error.
    """

    name: str
    rank: int
    size: int

    def allreduce(self, send: Any, recv: Any, dtype: str, op: str, ctx: Any = None) -> Pending: ...
    def reduce_scatter(self, send: Any, recv: Any, dtype: str, op: str,
                       counts: Sequence[int], ctx: Any = None) -> Pending: ...
    def allgather(self, send: Any, recv: Any, dtype: str, ctx: Any = None) -> Pending: ...
    def allgatherv(self, send: Any, recv: Any, dtype: str, counts: Sequence[int],
                   ctx: Any = None) -> Pending: ...
    def broadcast(self, buf: Any, dtype: str, root: int, ctx: Any = None) -> Pending: ...
    def barrier(self, ctx: Any = None) -> Pending: ...
    def abort(self, reason: str = "aborted") -> None: ...
    def free(self) -> None: ...
