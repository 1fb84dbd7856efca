"""NCCL backend on ``cupy.cuda.nccl``: one NCCL communicator per commlib communicator.

* The NCCL unique id is created on rank 0 and broadcast over MPI; the NCCL
  communicator lives on one GPU (chosen at :func:`commlib.init`), and every
  CUDA call of this backend runs with that device current, whatever thread
  (the caller's or the progress engine's) starts or finishes the operation.
* Every operation runs on the communicator's own CUDA stream.  It first
  waits (``cudaStreamWaitEvent``) for the event the caller recorded on its
  own stream when it called the operation (a
  :class:`~commlib.device.CallerStream`), so it sees the caller's writes; its
  completion is an event recorded after it, which
  :class:`~commlib.backends.base.Pending` polls, and on completion the
  caller's stream waits for that event (no host synchronization).
* Temporaries (the padded uneven ``reduce_scatter``, the barrier's word) are
  allocated on the communicator's stream and kept alive until the
  completion event has fired.
* ``allgatherv`` is a ``groupStart``/``groupEnd`` group of broadcasts (NCCL has
  no v-variant); ``reduce_scatter`` pads to a multiple of the size in a
  staging buffer when the length is not divisible.
* ``avg`` is NCCL's native ``ncclAvg``.  An NCCL error, raised at launch or
  reported asynchronously while polling, aborts the NCCL communicator
  (``ncclCommAbort``) and raises :class:`~commlib.errors.CommAbortedError`.

Device buffers only: the communicator routes host (numpy) arrays to its MPI
backend, as torch routes CPU tensors to gloo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..device import CallerStream
from ..errors import CommAbortedError
from .base import Pending

# NCCL enum values (nccl.h), used where cupy does not export a name
_DTYPES = {"float16": ("NCCL_FLOAT16", 6), "bfloat16": ("NCCL_BFLOAT16", 9),
           "float32": ("NCCL_FLOAT32", 7), "float64": ("NCCL_FLOAT64", 8),
           "int32": ("NCCL_INT32", 2), "int64": ("NCCL_INT64", 4)}
_OPS = {"sum": ("NCCL_SUM", 0), "max": ("NCCL_MAX", 2), "min": ("NCCL_MIN", 3),
        "avg": ("NCCL_AVG", 4)}
#: NCCL has no complex type: complex numbers travel as pairs of reals, whose sums and averages
#: are the complex ones (max and min, which would not be, are refused before any backend)
_PAIRS = {"complex64": "float32", "complex128": "float64"}


def _as_pairs(dtype: str, arrays: Sequence[Any],
              counts: Sequence[int] | None = None) -> tuple[str, list[Any], list[int] | None]:
    """``dtype``, ``arrays`` and element ``counts`` as NCCL takes them (complex: real pairs)."""
    real = _PAIRS.get(dtype)
    if real is None:
        return dtype, list(arrays), None if counts is None else list(counts)
    return real, [a.view(real) for a in arrays], None if counts is None else [2 * c for c in counts]


class NCCLBackend:
    """Collectives over NCCL for cupy device buffers on one GPU (see module docs).

    Example (what :func:`commlib.init` does on a GPU job):
        >>> be = NCCLBackend(mpi_comm, device_id=local_rank)
        >>> p = be.allreduce(x, x, "float32", "sum", CallerStream(local_rank))
    """

    name = "nccl"

    def __init__(self, mpi_comm: Any, device_id: int):
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self.rank = mpi_comm.rank
        self.size = mpi_comm.size
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        #: the GPU of this communicator: every array it is given must live there
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._dtypes = {k: getattr(nccl, n, v) for k, (n, v) in _DTYPES.items()}
        self._ops = {k: getattr(nccl, n, v) for k, (n, v) in _OPS.items()}
        self._aborted: str | None = None

    # -- helpers ---------------------------------------------------------
    def _launch(self, ctx: CallerStream, body: Callable[[int], Any]) -> Pending:
        """Order after the caller's ``ready`` event, run ``body(stream_ptr)`` on our stream with
        our device current, and return its completion.

        ``body`` may return temporaries (device arrays it allocated): they are
        kept alive until the completion event has fired.
        """
        cupy = self._cupy
        if self._aborted is not None:
            raise CommAbortedError(f"NCCL communicator aborted: {self._aborted}")
        with self.device, self.stream:     # cupy work inside body lands on our stream
            self.stream.wait_event(ctx.ready)
            try:
                keep = [body(self.stream.ptr)]
            except self._nccl.NcclError as exc:
                self.abort(str(exc))
                raise CommAbortedError(f"NCCL error at launch: {exc}") from exc
            done = cupy.cuda.Event(block=False, disable_timing=True)
            done.record(self.stream)

        def test() -> bool:
            if done.done:
                return True
            self.check_async_error()
            return False

        def finish() -> None:
            ctx.after(done)     # the caller's stream waits for the result, not the host
            keep.clear()        # temporaries: the operation has finished with them

        return Pending(test, finish)

    def check_async_error(self) -> None:
        """Abort and raise :class:`CommAbortedError` if NCCL reported an asynchronous error."""
        if self._aborted is not None:    # the NCCL communicator is gone: never touch it again
            raise CommAbortedError(f"NCCL communicator aborted: {self._aborted}")
        try:
            with self.device:
                self.comm.check_async_error()
        except self._nccl.NcclError as exc:
            self.abort(str(exc))
            raise CommAbortedError(f"NCCL asynchronous error: {exc}") from exc

    # -- operations ------------------------------------------------------
    def allreduce(self, send: Any, recv: Any, dtype: str, op: str,
                  ctx: CallerStream | None = None) -> Pending:
        dtype, (send, recv), _ = _as_pairs(dtype, (send, recv))
        dt, rop = self._dtypes[dtype], self._ops[op]
        return self._launch(ctx, lambda s: self.comm.allReduce(
            send.data.ptr, recv.data.ptr, send.size, dt, rop, s))

    def reduce_scatter(self, send: Any, recv: Any, dtype: str, op: str,
                       counts: Sequence[int], ctx: CallerStream | None = None) -> Pending:
        dtype, (send, recv), counts = _as_pairs(dtype, (send, recv), counts)
        dt, rop = self._dtypes[dtype], self._ops[op]
        n = int(send.size)
        if counts == [n // self.size] * self.size:     # even (not n % size: complex pairs double n)
            return self._launch(ctx, lambda s: self.comm.reduceScatter(
                send.data.ptr, recv.data.ptr, n // self.size, dt, rop, s))
        # uneven: pad every chunk to the largest count, then take our prefix
        chunk = max(counts)
        offsets = [sum(counts[:r]) for r in range(self.size)]

        def body(s: int) -> tuple[Any, Any]:
            cp = self._cupy       # our device and stream are current (see _launch)
            padded = cp.zeros(chunk * self.size, dtype=send.dtype)
            out = cp.empty(chunk, dtype=send.dtype)
            for r in range(self.size):
                padded[r * chunk:r * chunk + counts[r]] = send[offsets[r]:offsets[r] + counts[r]]
            self.comm.reduceScatter(padded.data.ptr, out.data.ptr, chunk, dt, rop, s)
            recv[...] = out[:counts[self.rank]]
            return padded, out

        return self._launch(ctx, body)

    def allgather(self, send: Any, recv: Any, dtype: str, ctx: CallerStream | None = None) -> Pending:
        dtype, (send, recv), _ = _as_pairs(dtype, (send, recv))
        dt = self._dtypes[dtype]
        return self._launch(ctx, lambda s: self.comm.allGather(
            send.data.ptr, recv.data.ptr, send.size, dt, s))

    def allgatherv(self, send: Any, recv: Any, dtype: str, counts: Sequence[int],
                   ctx: CallerStream | None = None) -> Pending:
        dtype, (send, recv), counts = _as_pairs(dtype, (send, recv), counts)
        dt = self._dtypes[dtype]
        nccl = self._nccl
        item = recv.itemsize
        offsets = [sum(counts[:r]) for r in range(self.size)]

        def body(s: int) -> None:
            nccl.groupStart()
            try:
                for r in range(self.size):
                    if counts[r] == 0:
                        continue
                    dst = recv.data.ptr + offsets[r] * item
                    src = send.data.ptr if r == self.rank else dst
                    self.comm.broadcast(src, dst, counts[r], dt, r, s)
            finally:
                nccl.groupEnd()

        return self._launch(ctx, body)

    def broadcast(self, buf: Any, dtype: str, root: int, ctx: CallerStream | None = None) -> Pending:
        dtype, (buf,), _ = _as_pairs(dtype, (buf,))
        dt = self._dtypes[dtype]
        return self._launch(ctx, lambda s: self.comm.bcast(buf.data.ptr, buf.size, dt, root, s))

    def barrier(self, ctx: CallerStream | None = None) -> Pending:
        """An all-reduce of one word on this GPU, after the caller's queued work (as torch's)."""
        def body(s: int) -> Any:
            one = self._cupy.zeros(1, dtype="int32")
            self.comm.allReduce(one.data.ptr, one.data.ptr, 1, self._dtypes["int32"],
                                self._ops["sum"], s)
            return one

        return self._launch(ctx, body)

    def abort(self, reason: str = "aborted") -> None:
        """``ncclCommAbort`` (once): unblock and destroy the NCCL communicator."""
        if self._aborted is not None:
            return
        self._aborted = reason
        try:
            with self.device:
                self.comm.abort()
        except Exception:  # noqa: BLE001 - aborting after an error must not raise another
            pass

    def free(self) -> None:
        if self._aborted is not None:
            return
        try:
            self.stream.synchronize()
            with self.device:
                self.comm.destroy()
        except Exception:  # noqa: BLE001 - freeing at shutdown must not raise
            pass
