"""The Communicator: validated, numbered, traced collectives over one backend."""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from mpi4py import MPI

from . import board as _board
from . import shutdown
from .backends.base import Backend
from .communicator_ops import CommunicatorOps
from .config import Config
from .control import Control
from .errors import CommAbortedError, CommlibError, CommStallWarning, ValidationError
from .ops import OPS, Op, fingerprint
from .runner import Runner
from .tracing import Tracer


class Closable(Protocol):
    """What :meth:`Communicator.close_with` takes: a collective ``close()``, a no-op when repeated,
    and whether it has run."""

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


def _split_problem(color: Any, key: Any) -> str | None:
    """What is wrong with a split's ``color`` and ``key`` (C ints: MPI's; ``key`` may be ``None``)."""
    for name, value in (("color", color), ("key", key)):
        if value is None and name == "key":
            continue
        try:
            v = operator.index(value)       # an int (numpy's too), not a float or a string
        except TypeError:
            return f"{name} {value!r} is not an integer"
        if not -2**31 <= v < 2**31:
            return f"{name} {v} does not fit a C int (MPI's)"
    return None


class Communicator(CommunicatorOps):
    """Collectives among the ranks of one MPI communicator, over MPI or NCCL.

    Obtain one from :func:`commlib.init`.  Every operation takes numpy or cupy
    arrays, torch tensors or jax arrays (through DLPack) of float16, bfloat16,
    float32, float64, int32, int64, complex64 or complex128 (summed and averaged,
    not ordered), of any shape (treated as flat; a non-contiguous input is read
    through a contiguous copy, an in-place one must be contiguous).  Results come
    back as the caller's kind of array (``allgather``'s of shape ``(size, *x.shape)``).

    * ``out=None`` allocates the result; ``out=x`` works in place; any other
      ``out`` receives the result (same dtype and device, right size).
    * ``allreduce``/``reduce_scatter`` take ``op`` in ``sum``, ``avg``,
      ``max``, ``min`` (``avg`` for floating and complex dtypes, ``max``/``min`` not for complex).
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
    def closed(self) -> bool:
        """Whether :meth:`close` has run (operations then raise :class:`CommAbortedError`)."""
        return self._run.closed

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

    def leave(self, reason: str = "leave() called") -> bool:
        """Give this communicator up on this rank without freeing it, once every operation it called
        has completed here (``False``, and nothing done, while one is in flight): peers still
        waiting for those operations go on (this rank's part of them is done), a peer's wait for a
        later one fails at once, and no rank frees it (freeing is collective).  For a layer that
        ends with its process (the Horovod API at exit); later calls here raise
        :class:`CommAbortedError`.

        Example:
            >>> if not comm.leave("process exiting"):
            ...     comm.abort("process exiting with operations in flight")
        """
        run = self._run
        if run.aborted is not None or run.closed or run.unfinished() or run.running is not None \
                or not run.engine.settled(0.0):
            return False
        self._tracer.instant("leave", reason=str(reason))
        run.left(reason, self._seq)
        return True

    def refuse(self, name: str, err: Exception) -> NoReturn:
        """Raise ``err`` as this rank's refusal of its next operation ``name``, found bad before the
        call (a layer above that validates first: the JAX binding while tracing), so that peers that
        make that call with valid input raise too, as for an input the operation itself rejects:
        within milliseconds on this node without check mode (the communicator is then aborted
        unless every rank refused alike), through the agreement under ``COMMLIB_CHECK=1``.

        Example:
            >>> if op not in ("sum", "avg"):
            ...     comm.refuse("allreduce", ValidationError(f"allreduce: op {op!r}"))
        """
        def build() -> Op:
            raise err
        self._call(name, build, (), True)
        raise AssertionError("unreachable: _call raised")     # pragma: no cover

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
        except CommlibError as exc:
            if not isinstance(exc, ValidationError):    # check mode's agreement in build (allgatherv's):
                raise               # a mismatch (every rank raises it), a timeout or abort; no input's fault
            op, err = None, exc
        except Exception as exc:     # an input that cannot be read (a deleted jax array)
            op, err = None, ValidationError(f"{name}: {exc!r}")
        if err is not None and err.agreed:      # check mode's agreement in build (allgatherv's, before
            raise err                           # its counts travel) raised it on every rank
        if self.config.check:
            self._control.agree(name, seq, fingerprint(*op.check_args) if op else [], err)
        elif err is not None:
            if self.size > 1:     # peers may already be inside it (Runner.reject)
                run.reject(err, name, seq)
            raise err
        assert op is not None
        op.seq = seq
        return run.call(op, blocking)

    # ---------------------------------------------------------- structure
    def split(self, color: int, key: int | None = None) -> "Communicator | None":
        """A new communicator of the ranks that pass the same ``color`` (collective).

        Ranks are ordered by ``key`` (default: this rank); a negative ``color`` returns ``None`` on that
        rank (``MPI_UNDEFINED``).  Waits on a split of every rank in order also watch this one's board.

        Example:
            >>> half = comm.split(color=comm.rank % 2)
        """
        self._run.check_alive()
        self._run.drain()
        problem = _split_problem(color, key)
        # every rank into the split first, watched as any call (MPI's split waits without limit):
        # a rank that splits alone (one rank tracing a jitted collective) fails on the timeout,
        # its peers at once where they wait in an operation instead; a rank's bad color or key
        # comes with it, raised on every rank (raised on its rank alone, after, it left its peers
        # in MPI's split for good)
        problems = self._control.allgather_object(problem, "split", self._seq)
        if any(problems):
            raise ValidationError("split: " + "; ".join(
                f"rank {r}'s {p}" for r, p in enumerate(problems) if p))
        color = operator.index(color)
        sub = self._mpi.Split(MPI.UNDEFINED if color < 0 else color,
                              self.rank if key is None else operator.index(key))
        if sub == MPI.COMM_NULL:
            return None
        comm = Communicator(sub, self.config, self.backend, tracer=self._tracer.sibling())
        comm.timeout = self.timeout
        if comm.size == self.size and key is None:      # the same ranks, in order: its waits watch ours
            comm._run.parent = self._run
        return comm

    def synchronize(self) -> None:
        """Wait until every nonblocking operation submitted so far has finished (their results
        and errors stay with their :class:`~commlib.work.Work`).  Raises, and aborts the
        communicator, where a :class:`~commlib.work.Work`'s wait would: on the timeout, or when
        a peer failed or will not call the operation in progress.

        Example:
            >>> works = [comm.iallreduce(g) for g in grads]
            >>> comm.synchronize()          # every one done; each works[i].wait() returns at once
        """
        self._run.drain()

    def close(self) -> None:
        """Finish pending operations, close what :meth:`close_with` was given, free MPI resources
        and write the timeline.

        Collective, like ``MPI_Comm_free``: every rank closes its communicators
        in the same order.  Done for every open communicator at interpreter exit
        (before MPI is finalized; an OFI fabric with live objects fails to close).
        A communicator that is aborted here or on a node-local peer frees
        nothing, since its peers may never join the collective frees; nor does one whose peers
        do not close within its timeout (a :class:`~commlib.errors.CommStallWarning` says so, and
        a rank that closes later frees nothing either).  At exit every open communicator shows
        this rank closing first, so that peers waiting in any of them fail at once.
        """
        run = self._run
        if run.closed:
            return
        if run.rejection is not None and run.aborted is None:
            run.settle_rejection()
        if run.aborted is None and any(p.rank != self.rank for p in self._board.gone()):
            run.aborted = CommAbortedError("a peer aborted or left this communicator")
        if run.aborted is None:
            run.close_engine()
        gave_up = ""
        if run.aborted is None:     # peers waiting for an operation this rank never called: fail now
            self._board.set(self._seq, "?", _board.CLOSING, shutdown.ended_by())
            since = time.monotonic()
            gone = self._board.wait_to_free(run.timeout)
            if gone:                # they free nothing: the frees would wait for them for good
                run.aborted = CommAbortedError("peers will not free this communicator: " + "; ".join(
                    p.describe() for p in gone))
                if 0 < run.timeout <= time.monotonic() - since:     # (not peers shown gone: aborted)
                    # shown aborted: a peer closing later frees nothing either (it read this rank's
                    # slot, closing, as ready for the collective frees, and waited in them alone)
                    self._board.set(self._seq, "?", _board.ABORTED, str(run.aborted))
                    gave_up = (f"rank {self.rank} gave up closing {self!r} after {run.timeout:g} s "
                               f"({'; '.join(p.describe() for p in gone)}): its MPI resources are "
                               "not freed, nor by a rank that closes later (a longer timeout lets a "
                               "rank's last checkpoint or evaluation finish first)")
        if run.aborted is None:
            resources, self._resources = self._resources, []
            for resource in reversed(resources):
                resource.close()
        run.closed = True
        if run.aborted is None:
            self._board.free()
            if self._backend is not self._host_backend:
                self._backend.free()
            self._host_backend.free()
            self._control.free()
            self._user.Free()
        self._tracer.write()    # after the collective frees: a failed write must not skip them
        if gave_up:     # last: a warnings filter that makes it an error raises with the close done
            warnings.warn_explicit(gave_up, CommStallWarning, "commlib", 0, module="commlib")

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
        # those closed by their owner since go (a Sync-Switch wrapped again and again: one store each)
        self._resources = [r for r in self._resources if not r.closed]
        self._resources.append(resource)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<commlib.Communicator {self.backend} rank {self.rank}/{self.size}>"
