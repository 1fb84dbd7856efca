"""NCCL backend on ``cupy.cuda.nccl``: one NCCL communicator per commlib communicator.

* The NCCL unique id is created on rank 0 and broadcast over MPI.
* Every operation runs on the communicator's own CUDA stream; it first waits
  (``cudaStreamWaitEvent``) for an event recorded on the caller's current
  stream, so it sees the caller's writes, and completion is an event recorded
  after it; :class:`~commlib.backends.base.Pending` polls that event.
* ``allgatherv`` is a ``groupStart``/``groupEnd`` group of broadcasts (NCCL has
  no v-variant); ``reduce_scatter`` pads to a multiple of the size in a
  staging buffer when the length is not divisible.
* ``avg`` is NCCL's native ``ncclAvg``.  Asynchronous NCCL errors are checked
  while polling; on a timeout the communicator calls ``ncclCommAbort``.

Device buffers only: host (numpy) inputs on an NCCL communicator raise a
:class:`~commlib.errors.ValidationError` before anything is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import CommlibError, ValidationError
from .base import Pending

# NCCL enum values (nccl.h), used where cupy does not export a name
_DTYPES = {"float16": ("NCCL_FLOAT16", 6), "bfloat16": ("NCCL_BFLOAT16", 9),
           "float32": ("NCCL_FLOAT32", 7), "float64": ("NCCL_FLOAT64", 8),
           "int32": ("NCCL_INT32", 2), "int64": ("NCCL_INT64", 4)}
_OPS = {"sum": ("NCCL_SUM", 0), "max": ("NCCL_MAX", 2), "min": ("NCCL_MIN", 3),
        "avg": ("NCCL_AVG", 4)}


class NCCLBackend:
    """Collectives over NCCL for cupy device buffers (see module docs)."""

    name = "nccl"

    def __init__(self, mpi_comm: Any):
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self.rank = mpi_comm.rank
        self.size = mpi_comm.size
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.device = cupy.cuda.Device()
        with self.device:
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._dtypes = {k: getattr(nccl, n, v) for k, (n, v) in _DTYPES.items()}
        self._ops = {k: getattr(nccl, n, v) for k, (n, v) in _OPS.items()}

    # -- helpers ---------------------------------------------------------
    def _check_device(self, *arrays: Any) -> None:
        for a in arrays:
            if not hasattr(a, "data") or not hasattr(a.data, "ptr"):
                raise ValidationError("nccl backend: arrays must be on the GPU (cupy, torch "
                                      "CUDA tensors or jax GPU arrays); use the mpi backend for host arrays")

    def _launch(self, body: Any) -> Pending:
        """Order after the caller's stream, run ``body`` on our stream, return its completion."""
        cupy = self._cupy
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        with self.device:
            body(self.stream.ptr)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)

        def test() -> bool:
            if done.done:
                return True
            self.check_async_error()
            return False

        def finish() -> None:
            # the caller's stream waits for the result; no host synchronization
            cupy.cuda.get_current_stream().wait_event(done)

        return Pending(test, finish)

    def check_async_error(self) -> None:
        """Raise :class:`CommlibError` if NCCL reported an asynchronous error."""
        try:
            self.comm.check_async_error()
        except self._nccl.NcclError as exc:
            raise CommlibError(f"NCCL asynchronous error: {exc}") from exc

    # -- operations ------------------------------------------------------
    def allreduce(self, send: Any, recv: Any, dtype: str, op: str) -> Pending:
        self._check_device(send, recv)
        dt, rop = self._dtypes[dtype], self._ops[op]
        return self._launch(lambda s: self.comm.allReduce(
            send.data.ptr, recv.data.ptr, send.size, dt, rop, s))

    def reduce_scatter(self, send: Any, recv: Any, dtype: str, op: str,
                       counts: Sequence[int]) -> Pending:
        self._check_device(send, recv)
        dt, rop = self._dtypes[dtype], self._ops[op]
        n = int(send.size)
        if n % self.size == 0:
            return self._launch(lambda s: self.comm.reduceScatter(
                send.data.ptr, recv.data.ptr, n // self.size, dt, rop, s))
        # uneven: pad every chunk to the largest count, then take our prefix
        chunk = max(counts)
        cp = self._cupy
        padded = cp.zeros(chunk * self.size, dtype=send.dtype)
        out = cp.empty(chunk, dtype=send.dtype)
        offsets = [sum(counts[:r]) for r in range(self.size)]

        def body(s: int) -> None:
            with cp.cuda.ExternalStream(s):
                for r in range(self.size):
                    padded[r * chunk:r * chunk + counts[r]] = send[offsets[r]:offsets[r] + counts[r]]
            self.comm.reduceScatter(padded.data.ptr, out.data.ptr, chunk, dt, rop, s)
            with cp.cuda.ExternalStream(s):
                recv[...] = out[:counts[self.rank]]

        return self._launch(body)

    def allgather(self, send: Any, recv: Any, dtype: str) -> Pending:
        self._check_device(send, recv)
        dt = self._dtypes[dtype]
        return self._launch(lambda s: self.comm.allGather(
            send.data.ptr, recv.data.ptr, send.size, dt, s))

    def allgatherv(self, send: Any, recv: Any, dtype: str, counts: Sequence[int]) -> Pending:
        self._check_device(send, recv)
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

        return self._launch(body)

    def broadcast(self, buf: Any, dtype: str, root: int) -> Pending:
        self._check_device(buf)
        dt = self._dtypes[dtype]
        return self._launch(lambda s: self.comm.bcast(buf.data.ptr, buf.size, dt, root, s))

    def barrier(self) -> Pending:
        one = self._cupy.zeros(1, dtype="int32")
        return self.allreduce(one, one, "int32", "sum")

    def abort(self) -> None:
        """``ncclCommAbort``: unblock and destroy the NCCL communicator."""
        self.comm.abort()

    def free(self) -> None:
        try:
            self.stream.synchronize()
            self.comm.destroy()
        except Exception:  # noqa: BLE001 - freeing at shutdown must not raise
            pass

