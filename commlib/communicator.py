"""The Communicator: validated, numbered, traced collectives over one backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from . import board as _board
from . import shutdown
from .arrays import HOST_RESULTS, View, as_view, host_alias, host_alias_result, host_pair
from .backends.base import Backend, Pending, split_counts
from .config import Config
from .control import Control
from .device import CallerStream
from .errors import CommAbortedError, ValidationError
from .ops import OPS, Op, check_reduce_op, fingerprint, out_buffer, reduce_op_ok
from .runner import Runner
from .tracing import Tracer
from .work import Work


class Closable(Protocol):
    """What :meth:`Communicator.close_with` takes: a collective ``close()``, a no-op when repeated."""

    def close(self) -> None: ...


class Communicator:
    """Collectives among the ranks of one MPI communicator, over MPI or NCCL.

    Obtain one from :func:`commlib.init`.  Every operation takes numpy or cupy
    arrays, torch tensors or jax arrays (through DLPack) of float16, bfloat16,
    float32, float64, int32, int64, complex64 or complex128 (summed and averaged,
    not ordered), contiguous, of any shape (treated as flat).  Results come back
    as the caller's kind of array.

    * ``out=None`` allocates the result; ``out=x`` works in place; any other
      ``out`` receives the result (same dtype and device, right size).
    * ``allreduce``/``reduce_scatter`` take ``op`` in ``sum``, ``avg``,
      ``max``, ``min`` (``avg`` only for floating dtypes).
    * every operation has an ``i``-prefixed nonblocking form returning a
      :class:`~commlib.work.Work`; operations run in the order they are called.
    * ``tag`` names the operation in NVTX ranges and the timeline.

    Example:
        >>> import numpy as np, commlib
        >>> comm = commlib.init()            # under mpiexec -n N
        >>> g = np.full(5, comm.rank, np.float32)
        >>> total = comm.allreduce(g)        # sum over ranks, new array
        >>> comm.allreduce(g, op="avg", out=g)  # in place
        >>> mine = comm.reduce_scatter(np.ones(10, np.float32))  # ranks get 3,3,2,2 for n=4
    """

    def __init__(self, mpi_comm: Any, config: Config, backend: str = "mpi",
                 tracer: Tracer | None = None):
        self.config = config
        ctl = mpi_comm.Dup()                # control traffic: checks, counts (control.py)
        self._user = mpi_comm.Dup()         # what mpi_comm hands out: never the engine's
        self.rank: int = mpi_comm.rank
        self.size: int = mpi_comm.size
        self._mpi = mpi_comm
        from .backends.mpi import MPIBackend

        #: host (numpy) arrays always travel over MPI, as torch routes CPU tensors to gloo
        self._host_backend: Backend = MPIBackend(mpi_comm, config.cuda_aware)
        #: device arrays: over NCCL on an NCCL communicator, else over MPI too
        self._backend: Backend = self._host_backend
        #: the GPU of an NCCL communicator (None: MPI, device arrays on any GPU)
        self._device: int | None = None
        if backend == "nccl":
            from .backends.nccl import NCCLBackend

            if config.device is None:
                raise ValidationError("backend nccl needs a device (commlib.init chooses one)")
            self._device = int(config.device)
            self._backend = NCCLBackend(mpi_comm, self._device)
        self.backend: str = self._backend.name
        self._board = _board.Board(ctl, OPS)
        world_rank = MPI.COMM_WORLD.rank
        self._tracer = tracer or Tracer(world_rank, config.timeline_path(world_rank), config.nvtx)
        self._run = Runner(self.rank, self.size, config, self._backend, self._board, self._tracer,
                           f"commlib-engine-r{self.rank}")
        self._control = Control(ctl, mpi_comm.Dup(), self._run, self._tracer)
        self._seq = 0
        self._split: dict[int, list[int]] = {}   # split_counts(n, size) by n
        # blocking calls on plain host arrays skip Op and View (Runner.call_host) unless checked or traced
        self._host = not config.check and not self._tracer.active
        #: what close() closes first (newest first): objects made over this communicator
        self._resources: list[Closable] = []
        shutdown.track(self, self._run)

    # ------------------------------------------------------------------ state
    @property
    def timeout(self) -> float:
        """Seconds an operation may take before :class:`CommTimeoutError` (0: no limit).

        With 0 a hang stays a hang (a :class:`~commlib.errors.CommStallWarning` after ``stall_warning``
        seconds still names who is missing); a peer's rejected input or abort ends the wait.
        """
        return self._run.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValidationError(f"timeout {seconds!r}: expected seconds >= 0")
        self._run.timeout = float(seconds)

    @property
    def seq(self) -> int:
        """Number of operations called so far (the last one's sequence number)."""
        return self._seq

    @property
    def tracer(self) -> Tracer:
        return self._tracer

    @property
    def mpi_comm(self) -> Any:
        """An mpi4py communicator of the same ranks (for one-sided windows and point-to-point
        traffic that commlib does not wrap); do not free it.

        It is a duplicate, never the one commlib's operations run on, so calls made on it
        cannot interleave with queued operations.
        """
        return self._user

    def abort(self, reason: str = "abort() called") -> None:
        """Mark this communicator unusable on this rank; later operations raise
        :class:`CommAbortedError`, and peers on this node waiting in an
        operation with this rank raise it too instead of waiting for the timeout."""
        if self._run.aborted is None:
            self._run.aborted = CommAbortedError(reason)
            self._tracer.instant("abort", reason=str(reason))
            self._board.set(self._seq, "?", _board.ABORTED, reason)

    def dangling(self) -> list[str]:
        """Operations this rank gave up on (timeout, a peer's failure) that MPI still holds."""
        return self._run.unfinished()

    def _number(self) -> int:
        """The next operation's sequence number (raises if the communicator is closed or aborted)."""
        run = self._run
        if run.aborted is not None or run.closed or run.rejection is not None:
            run.check_alive()
        self._seq += 1
        return self._seq

    def _call(self, name: str, build: Callable[..., Op], args: tuple, blocking: bool) -> Any:
        """Number, validate (``build(*args)``), check across ranks and run one operation."""
        run = self._run
        seq = self._number()
        try:
            op, err = build(*args), None
        except Exception as exc:     # a ValidationError, or an input that cannot be read (deleted jax array)
            op, err = None, exc if isinstance(exc, ValidationError) else ValidationError(f"{name}: {exc!r}")
        if self.config.check:
            self._control.agree(name, seq, fingerprint(*op.check_args) if op else [], err)
        elif err is not None:
            if self.size > 1:     # peers may already be inside it (Runner.reject)
                run.reject(err, name, seq)
            raise err
        assert op is not None
        op.seq = seq
        return run.call(op, blocking)

    def _route(self, v: View, what: str) -> tuple[Backend, CallerStream | None]:
        """The backend for ``v`` and, for a device array, the caller's stream captured now
        (on the caller's thread; raises :class:`ValidationError` for a GPU that is not the
        NCCL communicator's)."""
        if v.device == "cpu":
            return self._host_backend, None
        if self._device is not None and v.device_id != self._device:
            raise ValidationError(
                f"{what}: the array is on GPU {v.device_id}, this NCCL communicator on GPU "
                f"{self._device} (commlib.init(device=...) or COMMLIB_DEVICE chooses it)")
        return self._backend, CallerStream(v.device_id)

    @staticmethod
    def _result(v: View, data: Any, shape: tuple, ctx: CallerStream | None) -> Callable[[], Any]:
        """The result of an allocated output: ``data`` as the caller's kind of array, handed
        over on the caller's stream (DLPack orders the framework's stream after it)."""
        if ctx is None:
            return lambda: v.wrap(data, shape)

        def wrap() -> Any:
            with ctx:
                return v.wrap(data, shape)

        return wrap

    # ------------------------------------------------------------- operations
    def _allreduce(self, x: Any, op: str, out: Any, tag: str | None) -> Op:
        v = as_view(x, "allreduce: x", read_only=out is not x)
        check_reduce_op(op, v.dtype, "allreduce")
        recv, value = out_buffer(v, out, v.count, "allreduce")
        be, ctx = self._route(v, "allreduce")
        return Op("allreduce", be.allreduce, (v.data, recv, v.dtype, op, ctx),
                  None if value is not None else self._result(v, recv, v.shape, ctx), value,
                  v.data.nbytes, tag, ("allreduce", v, v.count, -1, op))

    def allreduce(self, x: Any, op: str = "sum", *, out: Any = None,
                  tag: str | None = None) -> Any:
        """Reduce ``x`` over all ranks (``sum``, ``avg``, ``max``, ``min``); every rank gets the result.

        Example:
            >>> comm.allreduce(np.ones(3, np.float32), op="avg")
            array([1., 1., 1.], dtype=float32)
        """
        if self._host:
            dt = host_pair(x, out)
            if dt is not None and reduce_op_ok(op, dt):
                if out is None:
                    out = HOST_RESULTS.like(x)
                if out.size == x.size:
                    return self._run.call_host("allreduce", self._number(), self._host_backend.allreduce,
                                               (x, out, dt, op), out, x.nbytes, tag)
            elif dt is None and (pair := host_alias(x, out)) is not None:
                return host_alias_result(self.allreduce(pair[0], op, out=pair[1], tag=tag), out, pair[2])
        return self._call("allreduce", self._allreduce, (x, op, out, tag), True)

    def iallreduce(self, x: Any, op: str = "sum", *, out: Any = None,
                   tag: str | None = None) -> Work:
        """Nonblocking :meth:`allreduce`; ``wait()`` returns the result."""
        return self._call("allreduce", self._allreduce, (x, op, out, tag), False)

    def _reduce_scatter(self, x: Any, op: str, out: Any, tag: str | None) -> Op:
        v = as_view(x, "reduce_scatter: x", read_only=out is not x)
        check_reduce_op(op, v.dtype, "reduce_scatter")
        counts = self._split.get(v.count)
        if counts is None:
            counts = self._split[v.count] = split_counts(v.count, self.size)
        mine = counts[self.rank]
        recv, value = out_buffer(v, out, mine, "reduce_scatter")
        be, ctx = self._route(v, "reduce_scatter")
        return Op("reduce_scatter", be.reduce_scatter, (v.data, recv, v.dtype, op, counts, ctx),
                  None if value is not None else self._result(v, recv, (mine,), ctx), value,
                  v.data.nbytes, tag, ("reduce_scatter", v, v.count, -1, op))

    def reduce_scatter(self, x: Any, op: str = "sum", *, out: Any = None,
                       tag: str | None = None) -> Any:
        """Reduce ``x`` (flattened) over ranks and give rank r the r-th chunk of the result.

        The chunks are those of :func:`commlib.split_counts`: for n elements
        and ``size`` ranks, the first ``n % size`` ranks get ``n // size + 1``
        elements and the others ``n // size``, in rank order (as
        ``numpy.array_split``), so any n works, zero and n < size included.

        Example:
            >>> comm.reduce_scatter(np.arange(10.0))   # 4 ranks: rank 0 gets 4*[0, 1, 2]
        """
        if self._host:
            dt = host_pair(x, out)
            counts = self._split.get(x.size) if dt is not None else None
            if counts is not None and reduce_op_ok(op, dt):
                if out is None:
                    out = HOST_RESULTS.empty((counts[self.rank],), x.dtype)
                if out.size == counts[self.rank]:
                    return self._run.call_host("reduce_scatter", self._number(),
                                               self._host_backend.reduce_scatter,
                                               (x, out, dt, op, counts), out, x.nbytes, tag)
            elif dt is None and (pair := host_alias(x, out)) is not None:
                return host_alias_result(self.reduce_scatter(pair[0], op, out=pair[1], tag=tag), out, pair[2])
        return self._call("reduce_scatter", self._reduce_scatter, (x, op, out, tag), True)

    def ireduce_scatter(self, x: Any, op: str = "sum", *, out: Any = None,
                        tag: str | None = None) -> Work:
        """Nonblocking :meth:`reduce_scatter`."""
        return self._call("reduce_scatter", self._reduce_scatter, (x, op, out, tag), False)

    def _allgather(self, x: Any, out: Any, tag: str | None) -> Op:
        v = as_view(x, "allgather: x", read_only=True)
        recv, value = out_buffer(v, out, v.count * self.size, "allgather")
        be, ctx = self._route(v, "allgather")
        return Op("allgather", be.allgather, (v.data, recv, v.dtype, ctx),
                  None if value is not None else self._result(v, recv, (self.size, *v.shape), ctx), value,
                  v.data.nbytes * self.size, tag, ("allgather", v, v.count))

    def allgather(self, x: Any, *, out: Any = None, tag: str | None = None) -> Any:
        """Gather equal-sized ``x`` from every rank; the result has shape ``(size, *x.shape)``.

        In place: pass ``out`` (``size * x.size`` elements) with ``x`` being
        ``out``'s rank-th slice.

        Example:
            >>> comm.allgather(np.array([comm.rank]))   # [[0], [1], ...]
        """
        if self._host:
            dt = host_pair(x, out)
            if dt is not None:
                if out is None:
                    out = HOST_RESULTS.empty((self.size, *x.shape), x.dtype)
                if out.size == x.size * self.size:
                    return self._run.call_host("allgather", self._number(), self._host_backend.allgather,
                                               (x, out, dt), out, out.nbytes, tag)
            elif (pair := host_alias(x, out)) is not None:
                return host_alias_result(self.allgather(pair[0], out=pair[1], tag=tag), out, pair[2])
        return self._call("allgather", self._allgather, (x, out, tag), True)

    def iallgather(self, x: Any, *, out: Any = None, tag: str | None = None) -> Work:
        """Nonblocking :meth:`allgather`."""
        return self._call("allgather", self._allgather, (x, out, tag), False)

    def _allgatherv(self, x: Any, counts: Sequence[int] | None, out: Any,
                    tag: str | None) -> Op:
        try:
            v = as_view(x, "allgatherv: x", read_only=True)
        except ValidationError as exc:
            if counts is None:
                if self.config.check:
                    self._control.agree("allgatherv", self._seq, [], exc)
                self._control.exchange_counts(-1, self._seq)
            raise
        if counts is None:
            if self.config.check:   # the same call everywhere before the counts travel
                self._control.agree("allgatherv", self._seq, fingerprint("allgatherv", v), None)
            counts = self._control.exchange_counts(v.count, self._seq)
            if min(counts) < 0:
                bad = [r for r, c in enumerate(counts) if c < 0]
                raise ValidationError(f"allgatherv: ranks {bad} rejected their input")
        counts = [int(c) for c in counts]
        if len(counts) != self.size or min(counts, default=0) < 0:
            raise ValidationError(
                f"allgatherv: counts must be {self.size} non-negative integers, got {counts}")
        if counts[self.rank] != v.count:
            raise ValidationError(
                f"allgatherv: counts[{self.rank}] = {counts[self.rank]} but x has {v.count} elements")
        total = sum(counts)
        recv, value = out_buffer(v, out, total, "allgatherv")
        be, ctx = self._route(v, "allgatherv")
        return Op("allgatherv", be.allgatherv, (v.data, recv, v.dtype, counts, ctx),
                  None if value is not None else self._result(v, recv, (total,), ctx), value,
                  total * v.data.itemsize, tag, ("allgatherv", v, total))

    def allgatherv(self, x: Any, counts: Sequence[int] | None = None, *, out: Any = None,
                   tag: str | None = None) -> Any:
        """Gather ``x`` of a different length on each rank into one flat array, in rank order.

        ``counts`` (every rank's element count) saves an exchange when known;
        without it the counts are all-gathered first.

        Example:
            >>> comm.allgatherv(np.arange(comm.rank + 1.0))   # 2 ranks: [0., 0., 1.]
        """
        return self._call("allgatherv", self._allgatherv, (x, counts, out, tag), True)

    def allgather_object(self, obj: Any, *, label: str = "allgather_object") -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking, as mpi4py's ``comm.allgather``).

        Outside the operations' order, on a communicator of its own: it never pairs with an
        operation in flight, which goes on.  While this rank waits in it, the status board
        shows it in ``label``: a peer waiting for an operation this rank has not called yet
        raises :class:`MismatchError` at once, naming ``label``, instead of waiting for the
        timeout; ranks calling it with different labels raise it too.

        Example:
            >>> comm.allgather_object({"rank": comm.rank}, label="config")    # [{'rank': 0}, {'rank': 1}]
        """
        self._run.check_alive()
        return self._control.allgather_object(obj, label, self._seq)

    def iallgatherv(self, x: Any, counts: Sequence[int] | None = None, *, out: Any = None,
                    tag: str | None = None) -> Work:
        """Nonblocking :meth:`allgatherv` (the counts exchange, if any, happens now)."""
        return self._call("allgatherv", self._allgatherv, (x, counts, out, tag), False)

    def _broadcast(self, x: Any, root: int, out: Any, tag: str | None) -> Op:
        v = as_view(x, "broadcast: x")
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValidationError(f"broadcast: root {root!r} is not a rank of 0..{self.size - 1}")
        root = int(root)
        if (out is None or out is x) and v.writable:
            buf, value = v.data, x
        else:
            buf, value = out_buffer(v, None if out is x else out, v.count, "broadcast")
        copy = self.rank == root and buf is not v.data
        if copy and v.device != "cpu":
            with v.data.device:       # on the caller's current stream, before the event _route records
                buf[...] = v.data
            copy = False
        be, ctx = self._route(v, "broadcast")

        def start() -> Pending:
            if copy:
                buf[...] = v.data
            return be.broadcast(buf, v.dtype, root, ctx)

        return Op("broadcast", start, (), None if value is not None else self._result(v, buf, v.shape, ctx),
                  value, v.data.nbytes, tag, ("broadcast", v, v.count, root))

    def broadcast(self, x: Any, root: int = 0, *, out: Any = None, tag: str | None = None) -> Any:
        """Give every rank root's ``x``: in place where ``x`` is writable, else a new array.

        Example:
            >>> w = comm.broadcast(np.random.rand(4), root=0)   # same on all ranks
        """
        return self._call("broadcast", self._broadcast, (x, root, out, tag), True)

    def ibroadcast(self, x: Any, root: int = 0, *, out: Any = None,
                   tag: str | None = None) -> Work:
        """Nonblocking :meth:`broadcast`."""
        return self._call("broadcast", self._broadcast, (x, root, out, tag), False)

    def _barrier(self, tag: str | None) -> Op:
        ctx = None if self._device is None else CallerStream(self._device)
        return Op("barrier", self._backend.barrier, (ctx,), None, None, 0, tag, ("barrier",))

    def barrier(self, *, tag: str | None = None) -> None:
        """Block until every rank has called ``barrier``."""
        return self._call("barrier", self._barrier, (tag,), True)

    def ibarrier(self, *, tag: str | None = None) -> Work:
        """Nonblocking :meth:`barrier`."""
        return self._call("barrier", self._barrier, (tag,), False)

    # ---------------------------------------------------------- structure
    def split(self, color: int, key: int | None = None) -> "Communicator":
        """A new communicator of the ranks that pass the same ``color`` (collective).

        Ranks are ordered by ``key`` (default: this rank); a negative ``color`` returns ``None`` on that
        rank (``MPI_UNDEFINED``).  Waits on a split of every rank in order also watch this one's board.

        Example:
            >>> half = comm.split(color=comm.rank % 2)
        """
        self._run.check_alive()
        self._run.engine.drain()
        sub = self._mpi.Split(MPI.UNDEFINED if color < 0 else color,
                              self.rank if key is None else key)
        if sub == MPI.COMM_NULL:
            return None  # type: ignore[return-value]
        comm = Communicator(sub, self.config, self.backend, tracer=self._tracer)
        comm.timeout = self.timeout
        if comm.size == self.size and key is None:      # the same ranks, in order: its waits watch ours
            comm._run.parent = self._run
        return comm

    def synchronize(self) -> None:
        """Wait until every nonblocking operation submitted so far has finished."""
        self._run.engine.drain()

    def close(self) -> None:
        """Finish pending operations, close what :meth:`close_with` was given, free MPI resources
        and write the timeline.

        Collective, like ``MPI_Comm_free``: every rank closes its communicators
        in the same order.  Done for every open communicator at interpreter exit
        (before MPI is finalized; an OFI fabric with live objects fails to close).
        A communicator that is aborted here or on a node-local peer frees
        nothing, since its peers may never join the collective frees.
        """
        run = self._run
        if run.closed:
            return
        if run.rejection is not None and run.aborted is None:
            run.settle_rejection()
        if run.aborted is None and any(p.rank != self.rank for p in self._board.aborted()):
            run.aborted = CommAbortedError("a peer aborted this communicator")
        if run.aborted is None:
            run.close_engine()
        if run.aborted is None:     # peers waiting for an operation this rank never called: fail now
            self._board.set(self._seq, "?", _board.CLOSING)
        if run.aborted is None:
            resources, self._resources = self._resources, []
            for resource in reversed(resources):
                resource.close()
        run.closed = True
        self._tracer.write()
        if run.aborted is None:
            self._board.free()
            if self._backend is not self._host_backend:
                self._backend.free()
            self._host_backend.free()
            self._control.free()
            self._user.Free()

    def close_with(self, resource: Closable) -> None:
        """Have :meth:`close` (explicit, or at interpreter exit) close ``resource`` first.

        For objects made collectively over this communicator with a collective ``close()`` (MPI
        windows, duplicated communicators): closed newest first, before this communicator's own
        frees, not at all when it is aborted.  ``close()`` must do nothing when already called.

        Example:
            >>> store = ParamStore(comm, 1000)      # calls comm.close_with(store)
            >>> comm.close()                        # closes the store, then the communicator
        """
        self._run.check_alive()
        self._resources.append(resource)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<commlib.Communicator {self.backend} rank {self.rank}/{self.size}>"
