"""A parameter store in MPI one-sided windows, for asynchronous (ASP) and stale-synchronous (SSP) training.

The flat parameter vector lives in ``MPI.Win.Allocate`` windows on a
duplicate of the communicator.  Workers *pull* it (``MPI_Get_accumulate``
with ``MPI_NO_OP``: an atomic read, element by element) and *push* updates
(``MPI_Accumulate`` with ``MPI_SUM``: element-wise atomic adds, so concurrent
pushes from any number of workers are never lost), all passive-target: the
owner of the memory takes no part in the traffic.

Layouts (``layout=``):

* ``"sharded"`` (default): rank r owns the r-th of ``split_counts(numel,
  size)`` contiguous pieces.  A push or pull of the whole vector moves
  ``(n-1)/n`` of it over this rank's link and serves ``(n-1)/n`` of the others'
  traffic, the same bytes per link as one ring all-reduce; no rank is a hot
  spot.
* ``"server"``: rank ``server`` holds it all.  Its link carries ``n-1`` times
  the vector each way per round of pushes and pulls, so it is the bottleneck
  from two workers on (measured in ``benchmarks/syncswitch.py --store-only``).

Epochs and progress.  Every rank opens one shared passive epoch on the
window at creation (``Lock_all(MPI_MODE_NOCHECK)``: no exclusive lock is ever
taken, so no lock messages travel) and completes its operations with
``Flush_all``.  Whether an operation completes without the target calling
MPI depends on the transport (measured with MPICH 5.0.2 from the ``mpich``
wheel):

* ranks on one node (ch4 shared-memory RMA): the origin applies the operation
  itself, no target progress is needed;
* ``ch4:ofi`` with the ``tcp`` provider (the emulated cluster:
  ``MPIR_CVAR_NOLOCAL=1``): accumulates and reads travel as active messages
  that the *target* must progress.  A target that is computing (or sleeping,
  as an injected straggler) delays every worker that touches its shard: 3 s of
  target sleep made a 100-element accumulate take 3 s.  Without a lock
  epoch held (``Lock``/``Unlock`` per access) the lock request itself waits
  for the target even on one node.

``progress=`` chooses who progresses the target side:

* ``"thread"``: a daemon thread calls ``MPI_Iprobe`` on the store's
  communicator every ``progress_interval_s`` (default 1 ms) while the store is
  *active* (:meth:`activate`); measured on the 2-core VM with 4 ranks over
  ofi/tcp: an accumulate to a sleeping target took 1.2-1.6 ms (100 elements)
  instead of the sleep; the thread's wake-ups cost 10-30 % of compute
  throughput on oversubscribed cores (2 ms / 0.5 ms interval), much less with
  a spare core.
* ``"mpich"``: ``MPIR_CVAR_ASYNC_PROGRESS=1`` was set before MPI started, so
  MPICH runs its own spinning progress thread: works, but on the
  oversubscribed VM it made compute 2.3x slower and 2 MB accumulates 5x
  slower than the Iprobe thread.
* ``"none"``: nobody; operations complete when the target next calls MPI
  (its own push or pull, a collective).  No deadlock is possible (every rank
  calls MPI again), only delays.
* ``"auto"`` (default): ``"mpich"`` when ``MPIR_CVAR_ASYNC_PROGRESS`` is on,
  ``"none"`` when every rank shares this node's memory and
  ``MPIR_CVAR_NOLOCAL`` is off, else ``"thread"``.

Pitfall (found while measuring): an origin buffer must stay alive until the
flush.  ``win.Accumulate(-x, ...)`` hands MPI a temporary that Python may
free before ``Flush``; MPI then reads freed memory and updates are silently
wrong.  The store keeps every origin buffer referenced until its flush.

SSP clocks: a second window holds one int64 per rank (each rank hosts its
own clock).  :meth:`tick` adds one to this rank's clock; :meth:`clocks` reads
all of them atomically element by element; :meth:`wait_bounded` blocks while
``own clock - min(clocks) > s`` (``s = 0``: lockstep), raising
:class:`commlib.CommTimeoutError` naming the slowest ranks after ``timeout``.

A small *board* window (float64 slots per rank plus a command word on rank 0)
lets policies exchange statistics and decisions without a collective while
ranks run at different speeds (:meth:`publish`, :meth:`read_board`,
:meth:`post_command`, :meth:`read_command`).

Example:
    >>> store = ParamStore(comm, numel=1000, dtype="float32", init=np.zeros(1000, np.float32))
    >>> store.activate()                     # progress thread on (if needed)
    >>> store.push(-0.1 * grad)              # atomic: store += delta
    >>> store.pull(params)                   # params <- store
    >>> store.tick(); store.wait_bounded(2)  # SSP with staleness 2
    >>> store.close()                        # collective
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from commlib import CommTimeoutError, Communicator, ValidationError, split_counts
from commlib.shutdown import at_exit

from .rma_progress import PROGRESS_MODES, Pump, resolve_progress

#: the dtypes a store holds (MPI's one-sided accumulate: no 16-bit floats)
STORE_DTYPES = ("float32", "float64", "complex64", "complex128")
_DTYPES = {name: np.dtype(name) for name in STORE_DTYPES}
#: where a store's windows live: sharded over the ranks, or all on a server rank
LAYOUTS = ("sharded", "server")
#: board slots per rank (float64)
BOARD_SLOTS = 4
_OPEN: list[weakref.ref] = []


def _stop_all_pumps() -> None:
    for ref in _OPEN:
        store = ref()
        if store is not None:
            store.deactivate()


at_exit(_stop_all_pumps)


def _as_host(x: Any, name: str, numel: int, dtype: np.dtype, writable: bool) -> np.ndarray:
    """A flat numpy alias of ``x`` (numpy, or anything with ``__array__`` on the host)."""
    if type(x).__module__.split(".")[0] == "cupy":
        raise ValidationError(f"{name}: the parameter store lives in host memory; pass a host array")
    a = np.asarray(x)
    if a.dtype != dtype:
        raise ValidationError(f"{name}: dtype {a.dtype} but the store holds {dtype}")
    if a.size != numel:
        raise ValidationError(f"{name}: {a.size} elements but the store holds {numel}")
    if not a.flags.c_contiguous:
        raise ValidationError(f"{name}: must be contiguous")
    if writable and not a.flags.writeable:
        raise ValidationError(f"{name}: must be writable")
    return a.reshape(-1)


class ParamStore:
    """A flat vector of ``numel`` elements (float32 or float64) in one-sided windows; collective to make.

    ``comm``: a :class:`commlib.Communicator` (or an mpi4py communicator); the
    store duplicates it.  ``init``: the initial contents, the same on every
    rank (each rank copies its own piece; zeros if omitted).  ``layout``:
    ``"sharded"`` or ``"server"`` (with ``server`` the holding rank).
    ``progress``: see the module docstring.  ``timeout``: seconds
    :meth:`wait_bounded` waits before raising (0: forever).

    Example:
        >>> store = ParamStore(comm, 10, "float64", init=np.arange(10.0))
        >>> out = np.empty(10); store.pull(out)   # [0., 1., ..., 9.]
        >>> store.close()
    """

    def __init__(self, comm: Any, numel: int, dtype: Any = "float32", init: Any = None,
                 layout: str = "sharded", server: int = 0, progress: str = "auto",
                 progress_interval_s: float = 1e-3, timeout: float | None = None):
        base = comm.mpi_comm if isinstance(comm, Communicator) else comm
        self.rank: int = base.rank
        self.size: int = base.size
        err: str | None = None
        try:  # validate on every rank, then agree, before any collective
            name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
            if name not in _DTYPES:
                raise ValidationError(f"dtype {dtype!r}: the store holds {', '.join(_DTYPES)}")
            if not isinstance(numel, (int, np.integer)) or numel < 0:
                raise ValidationError(f"numel {numel!r}: expected an integer >= 0")
            if layout not in LAYOUTS:
                raise ValidationError(f"layout {layout!r}: expected one of {LAYOUTS}")
            if not (isinstance(server, (int, np.integer)) and 0 <= server < self.size):
                raise ValidationError(f"server {server!r}: not a rank of 0..{self.size - 1}")
            if not progress_interval_s > 0:
                raise ValidationError(f"progress_interval_s {progress_interval_s!r}: expected > 0")
            if progress not in PROGRESS_MODES:
                raise ValidationError(f"progress {progress!r}: expected one of {PROGRESS_MODES}")
            if timeout is not None and not timeout >= 0:
                raise ValidationError(f"timeout {timeout!r}: expected seconds >= 0 (0: no limit)")
            init_a = None if init is None else _as_host(init, "init", int(numel), _DTYPES[name], False)
        except (ValidationError, TypeError) as exc:
            err = str(exc)
        errors = base.allgather(err) if self.size > 1 else [err]
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            raise ValidationError("ParamStore: " + "; ".join(f"rank {r}: {e}" for r, e in bad))
        self.dtype = _DTYPES[name]
        self.numel = int(numel)
        self.layout = layout
        if timeout is None:
            timeout = comm.timeout if isinstance(comm, Communicator) else 0.0
        self.timeout = float(timeout)
        self._mpi = base.Dup()
        self.progress = resolve_progress(progress, self._mpi)
        self._interval = float(progress_interval_s)
        if layout == "sharded":
            self.counts = split_counts(self.numel, self.size)
        else:
            self.counts = [self.numel if r == server else 0 for r in range(self.size)]
        self.offsets = [0] * self.size
        for r in range(1, self.size):
            self.offsets[r] = self.offsets[r - 1] + self.counts[r - 1]
        item = self.dtype.itemsize
        mine = self.counts[self.rank]
        self._win = MPI.Win.Allocate(max(mine, 1) * item, item, comm=self._mpi)
        self.local = np.frombuffer(self._win.tomemory(), dtype=self.dtype)[:mine]
        self._clock_win = MPI.Win.Allocate(8, 8, comm=self._mpi)
        self._clock = np.frombuffer(self._clock_win.tomemory(), dtype=np.int64)
        nboard = BOARD_SLOTS + (1 if self.rank == 0 else 0)
        self._board_win = MPI.Win.Allocate(nboard * 8, 8, comm=self._mpi)
        self._board = np.frombuffer(self._board_win.tomemory(), dtype=np.float64)
        self._clock[:] = 0
        self._board[:] = 0.0
        if init_a is not None:
            self.local[:] = init_a[self.offsets[self.rank]:self.offsets[self.rank] + mine]
        else:
            self.local[:] = 0
        for w in (self._win, self._clock_win, self._board_win):
            w.Lock_all(MPI.MODE_NOCHECK)
            w.Sync()
        self._mpi.Barrier()
        # NO_OP reads need an origin buffer of the right count (MPICH reads the count from
        # it; a zero count returns nothing); it is never read, so one serves every target
        self._scratch = np.zeros(max(self.counts), self.dtype)
        self._upd: np.ndarray | None = None
        self._ones = np.ones(1, np.int64)
        self._clock_buf = np.zeros(self.size, np.int64)
        self._clock_scratch = np.zeros(1, np.int64)
        self._order = [(self.rank + 1 + i) % self.size for i in range(self.size)]
        self._pump: Pump | None = None
        self._my_clock = 0
        self._closed = False
        self.stats = {"pushes": 0, "pulls": 0, "bytes_pushed": 0, "bytes_pulled": 0,
                      "push_s": 0.0, "pull_s": 0.0, "ssp_wait_s": 0.0}
        _OPEN.append(weakref.ref(self))
        if isinstance(comm, Communicator):     # its windows are freed when comm closes, at exit too
            comm.close_with(self)

    # ------------------------------------------------------------------ progress
    def activate(self) -> None:
        """Serve one-sided traffic without the caller (starts the thread if ``progress="thread"``)."""
        self._check()
        if self.progress == "thread" and self._pump is None and self.size > 1:
            self._pump = Pump(self._mpi, self._interval, f"commlib-paramstore-r{self.rank}")
            self._pump.start()

    def deactivate(self) -> None:
        """Stop the progress thread (it costs CPU wake-ups; BSP phases need none)."""
        if self._pump is not None:
            self._pump.stop()
            self._pump = None

    @property
    def active(self) -> bool:
        return self._pump is not None

    # ------------------------------------------------------------------ data
    def _check(self) -> None:
        if self._closed:
            raise ValidationError("the parameter store is closed")

    def _targets(self) -> list[int]:
        return [t for t in self._order if self.counts[t]]

    def _issue_pull(self, out: np.ndarray) -> None:
        win, noop = self._win, MPI.NO_OP
        for t in self._targets():
            o, c = self.offsets[t], self.counts[t]
            win.Get_accumulate(self._scratch[:c], out[o:o + c], t, op=noop)

    def _issue_push(self, delta: np.ndarray) -> None:
        win, add = self._win, MPI.SUM
        for t in self._targets():
            o, c = self.offsets[t], self.counts[t]
            win.Accumulate(delta[o:o + c], t, op=add)

    def _delta(self, delta: Any, scale: float | None) -> np.ndarray:
        d = _as_host(delta, "push: delta", self.numel, self.dtype, False)
        if scale is None or scale == 1:
            return d
        if self._upd is None:
            self._upd = np.empty(self.numel, self.dtype)
        np.multiply(d, self.dtype.type(scale), out=self._upd)
        return self._upd

    def pull(self, out: Any = None) -> np.ndarray:
        """Read the whole store into ``out`` (allocated if None); atomic per element, not as a whole."""
        self._check()
        o = np.empty(self.numel, self.dtype) if out is None else _as_host(
            out, "pull: out", self.numel, self.dtype, True)
        t0 = time.perf_counter()
        self._issue_pull(o)
        self._win.Flush_all()
        self.stats["pull_s"] += time.perf_counter() - t0
        self.stats["pulls"] += 1
        self.stats["bytes_pulled"] += self.numel * self.dtype.itemsize
        return o

    def push(self, delta: Any, scale: float | None = None) -> None:
        """Add ``scale * delta`` (or ``delta``) to the store, atomically per element; complete on return."""
        self._check()
        d = self._delta(delta, scale)
        t0 = time.perf_counter()
        self._issue_push(d)
        self._win.Flush_all()          # d stays referenced until here
        self.stats["push_s"] += time.perf_counter() - t0
        self.stats["pushes"] += 1
        self.stats["bytes_pushed"] += self.numel * self.dtype.itemsize

    def push_pull(self, delta: Any, out: Any, scale: float | None = None) -> np.ndarray:
        """:meth:`push` then :meth:`pull` in one flush: MPI orders accumulate operations from one
        origin to one target (the default ``accumulate_ordering``), so ``out`` includes this push."""
        self._check()
        d = self._delta(delta, scale)
        o = _as_host(out, "push_pull: out", self.numel, self.dtype, True)
        if np.shares_memory(d, o):
            raise ValidationError("push_pull: delta and out must not overlap")
        t0 = time.perf_counter()
        self._issue_push(d)
        self._issue_pull(o)
        self._win.Flush_all()
        dt = time.perf_counter() - t0
        self.stats["push_s"] += dt / 2
        self.stats["pull_s"] += dt / 2
        self.stats["pushes"] += 1
        self.stats["pulls"] += 1
        nb = self.numel * self.dtype.itemsize
        self.stats["bytes_pushed"] += nb
        self.stats["bytes_pulled"] += nb
        return o

    def load(self, values: Any) -> None:
        """Collective: set the store to ``values`` (the same on every rank, e.g. identical replicas).

        Each rank writes its own piece locally, between two barriers, so no
        one-sided operation overlaps the writes and no data travels.
        """
        self._check()
        v = _as_host(values, "load: values", self.numel, self.dtype, False)
        self._win.Flush_all()
        self._mpi.Barrier()
        self._win.Sync()
        o = self.offsets[self.rank]
        self.local[:] = v[o:o + self.counts[self.rank]]
        self._win.Sync()
        self._mpi.Barrier()

    def barrier(self) -> None:
        """Complete this rank's operations, then wait for every rank (collective)."""
        self._check()
        self._win.Flush_all()
        self._mpi.Barrier()

    # ------------------------------------------------------------------ SSP clocks
    def tick(self, n: int = 1) -> None:
        """Advance this rank's clock by ``n`` (after its push for the step is complete)."""
        self._check()
        self._ones[0] = n
        self._clock_win.Accumulate(self._ones, self.rank, op=MPI.SUM)
        self._clock_win.Flush(self.rank)
        self._my_clock += int(n)

    def clocks(self) -> np.ndarray:
        """Every rank's clock (a copy)."""
        self._check()
        for r in range(self.size):
            self._clock_win.Get_accumulate(self._clock_scratch, self._clock_buf[r:r + 1], r, op=MPI.NO_OP)
        self._clock_win.Flush_all()
        return self._clock_buf.copy()

    @property
    def clock(self) -> int:
        """This rank's clock."""
        return self._my_clock

    def set_clocks(self, value: int) -> None:
        """Collective: set every clock to ``value`` (phase changes, restored checkpoints)."""
        self._check()
        self._clock_win.Flush_all()
        self._mpi.Barrier()
        self._clock_win.Sync()
        self._clock[0] = int(value)
        self._my_clock = int(value)
        self._clock_win.Sync()
        self._mpi.Barrier()

    def wait_bounded(self, staleness: int, timeout: float | None = None) -> float:
        """Block while this rank's clock is over ``staleness`` ahead of the slowest; return seconds waited.

        Raises :class:`commlib.CommTimeoutError` after ``timeout`` seconds
        (default: the store's; 0 waits forever) naming the slowest ranks.
        """
        self._check()
        if staleness < 0:
            raise ValidationError(f"staleness {staleness!r}: expected >= 0")
        limit = self.timeout if timeout is None else float(timeout)
        t0 = time.perf_counter()
        pause = 20e-6
        while True:
            c = self.clocks()
            mine = int(c[self.rank])
            if mine - int(c.min()) <= staleness:
                waited = time.perf_counter() - t0
                self.stats["ssp_wait_s"] += waited
                return waited
            elapsed = time.perf_counter() - t0
            if limit > 0 and elapsed > limit:
                slow = [int(r) for r in np.nonzero(c == c.min())[0]]
                self.stats["ssp_wait_s"] += elapsed
                raise CommTimeoutError(
                    f"ssp wait: rank {self.rank} at clock {mine} waited {elapsed:.1f} s for ranks {slow} "
                    f"(clock {int(c.min())}) to come within staleness {staleness}; clocks {c.tolist()}",
                    "ssp_wait", mine, [self.rank], slow)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    # ------------------------------------------------------------------ board
    def publish(self, values: Sequence[float]) -> None:
        """Write up to :data:`BOARD_SLOTS` float64 values into this rank's board slots."""
        self._check()
        v = np.zeros(BOARD_SLOTS, np.float64)
        v[:len(values)] = values
        self._board_win.Accumulate(v, self.rank, target=(0, BOARD_SLOTS, MPI.DOUBLE), op=MPI.REPLACE)
        self._board_win.Flush(self.rank)

    def read_board(self) -> np.ndarray:
        """Every rank's board slots, shape ``(size, BOARD_SLOTS)``."""
        self._check()
        out = np.empty((self.size, BOARD_SLOTS), np.float64)
        scratch = np.zeros(BOARD_SLOTS, np.float64)
        for r in range(self.size):
            self._board_win.Get_accumulate(scratch, out[r], r, target=(0, BOARD_SLOTS, MPI.DOUBLE),
                                           op=MPI.NO_OP)
        self._board_win.Flush_all()
        return out

    def post_command(self, value: float) -> None:
        """Set the command word (on rank 0) that :meth:`read_command` returns everywhere."""
        self._check()
        v = np.array([value], np.float64)
        self._board_win.Accumulate(v, 0, target=(BOARD_SLOTS, 1, MPI.DOUBLE), op=MPI.REPLACE)
        self._board_win.Flush(0)

    def read_command(self) -> float:
        self._check()
        out, scratch = np.empty(1, np.float64), np.zeros(1, np.float64)
        self._board_win.Get_accumulate(scratch, out, 0, target=(BOARD_SLOTS, 1, MPI.DOUBLE), op=MPI.NO_OP)
        self._board_win.Flush(0)
        return float(out[0])

    # ------------------------------------------------------------------ end
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the windows are freed)."""
        return self._closed

    def close(self) -> None:
        """Collective: complete everything and free the windows (a :class:`Communicator` it was
        made over does this when it closes, at interpreter exit too)."""
        if self._closed:
            return
        self.deactivate()
        for w in (self._win, self._clock_win, self._board_win):
            w.Flush_all()
        self._mpi.Barrier()
        for w in (self._win, self._clock_win, self._board_win):
            w.Unlock_all()
            w.Free()
        self._mpi.Free()
        self._closed = True
        # no view of freed window memory stays reachable; the buffers go (comm keeps this object)
        self.local = self._clock = self._board = self._scratch = np.empty(0, self.dtype)
        self._upd = None

    def __enter__(self) -> ParamStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ParamStore({self.numel}, {self.dtype.name}, layout={self.layout!r}, "
                f"progress={self.progress!r}, rank {self.rank}/{self.size})")
