"""MPI backend on mpi4py: host buffers directly; device buffers CUDA-aware or staged.

Reductions on bfloat16 (which MPI lacks) run in float32 and are rounded back;
data movement of bfloat16 moves its 16-bit storage.  ``avg`` is a sum
divided by the size.  A device (cupy) buffer is handed to MPI directly when
MPI is CUDA-aware (``COMMLIB_MPI_CUDA_AWARE=1``, or detected through
``MPIX_Query_cuda_support``), otherwise it is staged through host memory.
Either way the host first waits for the event the caller recorded on its own
stream when it called the operation (a :class:`~commlib.device.CallerStream`:
the operation may start on the progress engine's thread, whose current
stream is not the caller's), and a staged result is copied back on the
caller's stream.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

from ..device import CallerStream
from .base import Pending

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_BF16 = np.dtype(ml_dtypes.bfloat16)
#: the floating dtypes, whose max and min carry their NaNs beside them (:meth:`MPIBackend._reduce_ordered`)
_FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
_ORDERED_OPS = frozenset({"max", "min"})

def mpi_cuda_aware() -> bool:
    """Whether the loaded MPI library says it accepts CUDA device pointers."""
    for name in (None, "libmpi.so.12", "libmpi.so.40", "libmpi.so"):
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            fn = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return bool(fn())
    return False


def _is_device(a: Any) -> bool:
    return not isinstance(a, np.ndarray)


def _may_overlap(a: Any, b: Any) -> bool:
    """False when two host arrays certainly do not overlap.

    Two distinct arrays that each own their memory (``base`` is None) cannot
    overlap: two attribute reads decide the common case, where a bounds check
    (``np.may_share_memory``) costs a quarter of a per-call budget.
    """
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a is b:
        return True
    if a.base is None and b.base is None:
        return False
    return bool(np.may_share_memory(a, b))


def _apart(send: Any, recv: Any) -> Any:
    """``send``, or a copy of it where it overlaps ``recv`` (host arrays; MPI forbids aliased
    buffers, and the in-place forms are decided before): ``reduce_scatter(x, out=x[chunk])``,
    an ``out`` shifted over ``x``, an ``allgatherv`` input inside its output."""
    return send.copy() if type(send) is np.ndarray and _may_overlap(send, recv) else send


def _reduce_send(send: Any, recv: Any) -> Any:
    """What an all-reduce of ``send`` into ``recv`` sends: ``MPI.IN_PLACE`` for an in-place call
    (the same object, or the same start address), else ``send`` (a host copy where it overlaps
    ``recv``, as :func:`_apart`)."""
    if send is recv:
        return MPI.IN_PLACE
    if not _may_overlap(send, recv):        # one bounds check (an aliased torch tensor's: 1 us)
        return send
    if _ptr(send) == _ptr(recv):
        return MPI.IN_PLACE
    return send.copy() if type(send) is np.ndarray else send


def _ptr(a: Any) -> int:
    if isinstance(a, np.ndarray):       # mpi4py's buffer: 0.2 us; __array_interface__ builds a dict: 1 us
        return MPI.buffer(a).address
    return a.data.ptr


class MPIBackend:
    """Collectives over an ``mpi4py`` communicator (see module docs)."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm, cuda_aware: bool | None = None):
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.cuda_aware = mpi_cuda_aware() if cuda_aware is None else cuda_aware

    # -- helpers ---------------------------------------------------------
    def _host(self, *arrays: Any, ctx: CallerStream | None = None,
              force: bool = False) -> tuple[Any, Any]:
        """Host stand-ins for device arrays (staged) and the copy-backs to do.

        Waits for the caller's ``ctx.ready`` first.  ``force`` stages even
        under CUDA-aware MPI (host arithmetic needed).
        """
        for a in arrays:
            if type(a) is not np.ndarray:
                break
        else:
            return arrays, ()
        with ctx.device:
            ctx.ready.synchronize()      # the caller's writes to the inputs have landed
            if self.cuda_aware and not force:
                return list(arrays), []
            out, back, seen = [], [], {}
            for a in arrays:
                if a is None or not _is_device(a):
                    out.append(a)
                    continue
                key = id(a)
                if key not in seen:
                    seen[key] = a.get()
                    back.append((a, seen[key]))
                out.append(seen[key])
        return out, (ctx, back)

    def _gathers_in_place(self, send: Any, recv: Any) -> bool:
        """Whether ``send`` is this rank's block of ``recv`` (an in-place allgather)."""
        return _may_overlap(send, recv) and _ptr(send) == _ptr(recv) + self.rank * send.nbytes

    @staticmethod
    def _copy_back(staged: Any, only: Any = None) -> None:
        """Copy staged results back to the device, on the caller's stream (in its order)."""
        if not staged:
            return
        ctx, back = staged
        with ctx:
            for dev, host in back:
                if only is None or dev is only:
                    dev.set(host, stream=ctx.stream)

    # -- operations ------------------------------------------------------
    def allreduce(self, send: Any, recv: Any, dtype: str, op: str,
                  ctx: CallerStream | None = None) -> Pending:
        if op in _ORDERED_OPS and dtype in _FLOATING:
            return self._reduce_ordered(send, recv, dtype, op, None, ctx)
        if type(send) is np.ndarray and type(recv) is np.ndarray and dtype != "bfloat16":
            # host arrays (the common case): no staging, nothing to finish but avg.  The general
            # path below handles them too; this branch skips _host and the finish closure, which
            # measured 0.2 us per call (benchmarks.engine_figures.overhead)
            if send is not recv and send.base is None and recv.base is None:
                sbuf = send     # two arrays that own their memory are apart (_may_overlap's first test)
            else:
                sbuf = _reduce_send(send, recv)
            req = self.comm.Iallreduce(sbuf, recv, _MPI_OPS[op])
            return Pending(req.Test, None if op != "avg" else lambda: _divide(recv, self.size, dtype), req,
                           sbuf)
        upcast = dtype == "bfloat16"
        (hsend, hrecv), back = self._host(send, recv, ctx=ctx, force=upcast)
        if upcast:  # MPI has no bfloat16 arithmetic: reduce in float32
            work = keep = hsend.view(_BF16).astype(np.float32)
            req = self.comm.Iallreduce(MPI.IN_PLACE, work, _MPI_OPS[op])
        else:
            work = hrecv
            sbuf = _reduce_send(hsend, hrecv)
            req = self.comm.Iallreduce(sbuf, hrecv, _MPI_OPS[op])
            keep = sbuf

        def finish() -> None:
            if op == "avg":
                _divide(work, self.size, dtype if not upcast else "float32")
            if upcast:
                hrecv[...] = work.astype(_BF16).view(np.uint16)
            self._copy_back(back, recv)

        return Pending(req.Test, finish, req, keep)

    def reduce_scatter(self, send: Any, recv: Any, dtype: str, op: str,
                       counts: Sequence[int], ctx: CallerStream | None = None) -> Pending:
        if op in _ORDERED_OPS and dtype in _FLOATING:
            return self._reduce_ordered(send, recv, dtype, op, counts, ctx)
        if type(send) is np.ndarray and type(recv) is np.ndarray and dtype != "bfloat16":
            sbuf = _apart(send, recv)
            req = self.comm.Ireduce_scatter(sbuf, recv, counts, _MPI_OPS[op])
            return Pending(req.Test, None if op != "avg" else lambda: _divide(recv, self.size, dtype), req,
                           sbuf)
        upcast = dtype == "bfloat16"
        (hsend, hrecv), back = self._host(send, recv, ctx=ctx, force=upcast)
        if upcast:
            sbuf = hsend.view(_BF16).astype(np.float32)
            work = np.empty(hrecv.size, np.float32)
            req = self.comm.Ireduce_scatter(sbuf, work, counts, _MPI_OPS[op])
        else:
            work = hrecv
            sbuf = _apart(hsend, hrecv)
            req = self.comm.Ireduce_scatter(sbuf, hrecv, counts, _MPI_OPS[op])

        def finish() -> None:
            if op == "avg":
                _divide(work, self.size, dtype if not upcast else "float32")
            if upcast:
                hrecv[...] = work.astype(_BF16).view(np.uint16)
            self._copy_back(back, recv)

        return Pending(req.Test, finish, req, sbuf)

    def _reduce_ordered(self, send: Any, recv: Any, dtype: str, op: str, counts: Sequence[int] | None,
                        ctx: CallerStream | None) -> Pending:
        """``max``/``min`` of floating values, all-reduced (``counts`` None) or reduce-scattered.
        MPI compares a NaN in the order its algorithm meets the ranks' values, so that the ranks'
        results differed (a NaN on one rank: NaN on some ranks, a number on others, with nonblocking
        MPICH); so where each element is NaN on some rank travels beside it (one byte an element, a
        max of its own, posted with it) and is NaN on every rank, as numpy's max gives."""
        upcast = dtype == "bfloat16"
        (hsend, hrecv), back = self._host(send, recv, ctx=ctx, force=True)
        values = hsend.view(_BF16).astype(np.float32) if upcast else hsend    # read before any write
        nan = np.isnan(values.reshape(-1)).view(np.uint8)     # an array, a 0-d input too
        if counts is None:
            work = values if upcast else hrecv
            sbuf = MPI.IN_PLACE if upcast else _reduce_send(hsend, hrecv)
            mask = nan
            reqs = [self.comm.Iallreduce(sbuf, work, _MPI_OPS[op]),
                    self.comm.Iallreduce(MPI.IN_PLACE, mask, MPI.MAX)]
        else:
            work = np.empty(hrecv.size, np.float32) if upcast else hrecv
            sbuf = values if upcast else _apart(hsend, hrecv)
            mask = np.empty(hrecv.size, np.uint8)
            reqs = [self.comm.Ireduce_scatter(sbuf, work, counts, _MPI_OPS[op]),
                    self.comm.Ireduce_scatter(nan, mask, counts, MPI.MAX)]

        def finish() -> None:
            MPI.Request.Waitall(reqs)       # the engine waited for the last one
            if mask.any():
                work[mask.view(bool)] = np.nan
            if upcast:
                hrecv[...] = work.astype(_BF16).view(np.uint16)
            self._copy_back(back, recv)

        return Pending(lambda: MPI.Request.Testall(reqs), finish, reqs[-1], (sbuf, values, nan, mask, work))

    def allgather(self, send: Any, recv: Any, dtype: str, ctx: CallerStream | None = None) -> Pending:
        if type(send) is np.ndarray and type(recv) is np.ndarray:
            sbuf = MPI.IN_PLACE if self._gathers_in_place(send, recv) else _apart(send, recv)
            req = self.comm.Iallgather(sbuf, recv)
            return Pending(req.Test, None, req, sbuf)
        (hsend, hrecv), back = self._host(send, recv, ctx=ctx)
        inplace = not back and self._gathers_in_place(hsend, hrecv)
        sbuf = MPI.IN_PLACE if inplace else _apart(hsend, hrecv)
        req = self.comm.Iallgather(sbuf, hrecv)
        return Pending(req.Test, lambda: self._copy_back(back, recv), req, sbuf)

    def allgatherv(self, send: Any, recv: Any, dtype: str, counts: Sequence[int],
                   ctx: CallerStream | None = None) -> Pending:
        (hsend, hrecv), back = self._host(send, recv, ctx=ctx)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()
        sbuf = _apart(hsend, hrecv)
        req = self.comm.Iallgatherv(sbuf, [hrecv, list(counts), displs, None])
        return Pending(req.Test, lambda: self._copy_back(back, recv), req, sbuf)

    def broadcast(self, buf: Any, dtype: str, root: int, ctx: CallerStream | None = None) -> Pending:
        if type(buf) is np.ndarray:      # host (the common case): nothing staged, nothing to finish
            req = self.comm.Ibcast(buf, root)
            return Pending(req.Test, None, req)
        (hbuf,), back = self._host(buf, ctx=ctx)
        req = self.comm.Ibcast(hbuf, root)
        return Pending(req.Test, lambda: self._copy_back(back), req)

    def barrier(self, ctx: CallerStream | None = None) -> Pending:
        req = self.comm.Ibarrier()
        return Pending(req.Test, None, req)

    def abort(self, reason: str = "aborted") -> None:
        """Nothing to do: MPI collectives cannot be cancelled.  An operation given up stays
        posted, and the exit hook ends the job with ``MPI_Abort`` (``commlib.shutdown``)."""

    def free(self) -> None:
        try:
            self.comm.Free()
        except MPI.Exception:  # pragma: no cover - freeing at shutdown
            pass


def _divide(a: Any, size: int, dtype: str) -> None:
    """In-place ``a /= size`` for a float storage array (``avg``)."""
    if dtype == "bfloat16":
        v = a.view(_BF16)
        v[...] = (v.astype(np.float32) / size).astype(_BF16)
    else:
        a /= size
