"""Tracing: NVTX ranges for Nsight, and a Chrome-trace / Perfetto timeline.

Every operation is bracketed by an NVTX range named
``commlib.<op>[<tag>] #<seq> <bytes>`` (the ``nvtx`` package) whenever an
NVTX tool is attached (Nsight Systems sets ``NVTX_INJECTION64_PATH``;
``COMMLIB_NVTX=force`` emits them regardless, ``COMMLIB_NVTX=0`` never).
With ``COMMLIB_TIMELINE=path`` each rank also writes the same events as a
Chrome-trace JSON (open it in ``chrome://tracing`` or https://ui.perfetto.dev),
with three phases per operation:

* ``queued``  (an async slice beside track ``engine``: several overlap, one per
  operation, matched by its ``seq``): submitted, waiting for earlier operations;
* ``running`` (track ``engine``): inside the backend;
* ``waiting`` (track ``caller``): the caller blocked in ``Work.wait()``, or in a
  blocking call queued behind operations in flight (one that finds the engine idle
  runs on the caller's thread: its ``running`` phase is the whole call).

Each communicator of a file has its own three tracks (``engine (communicator 1)``
for the second one made, a split: the first's are plain ``caller``, ``engine``,
``control``), so that the slices of a track nest, as the trace format needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

try:  # the nvtx package is a hard dependency, but keep commlib importable without it
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None

_COLORS = {"allreduce": "green", "reduce_scatter": "blue", "allgather": "purple",
           "allgatherv": "purple", "broadcast": "orange", "barrier": "red",
           "check": "yellow"}
_TIDS = {"caller": 1, "engine": 2, "control": 3}
#: thread ids of a communicator's tracks: lane k's are ``_TIDS`` + k * _LANE_TIDS
_LANE_TIDS = 10
#: by timeline path: (the tracer that writes it, its events, their lock, perf_counter and wall
#: clock at its start, the lanes taken: one per communicator whose tracer writes there)
_RECORDS: dict[str, tuple[Any, list[dict[str, Any]], threading.Lock, float, float, list[int]]] = {}


def timeline_problem(path: str | None) -> str | None:
    """Why the timeline cannot be written at ``path`` (``None``: it can, or there is none); its
    folder is made here.  :func:`commlib.init` asks every rank before it starts, so that a bad
    path on one rank fails on every rank at once, not at exit with its peers left waiting.

    Example:
        >>> timeline_problem("/proc/x/t.json")
        "timeline /proc/x/t.json: [Errno 2] No such file or directory: '/proc/x'"
    """
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"timeline {path}: {exc}"
    if os.path.isdir(path):
        return f"timeline {path}: a folder is there"
    try:    # a file made and removed: os.access says yes to root everywhere (/proc, /sys)
        fd, probe = tempfile.mkstemp(prefix=".commlib-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"timeline {path}: folder {folder} is not writable ({exc.strerror or exc})"
    return None


def format_bytes(n: int) -> str:
    """Human-readable byte count, e.g. ``4.0MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


class Tracer:
    """Records operation phases to NVTX and, optionally, a per-rank timeline file.

    Example:
        >>> tr = Tracer(rank=0, path=None, nvtx=False)
        >>> with tr.span("running", "allreduce", "engine", seq=1, nbytes=8):
        ...     pass
    """

    def __init__(self, rank: int, path: str | None, nvtx: bool | str = True):
        self.rank = rank
        self.path = path
        self._nvtx_setting = nvtx
        # NVTX ranges cost label formatting per call: build them only when a tool
        # (Nsight Systems sets NVTX_INJECTION64_PATH) is attached to collect them, or when forced
        self.nvtx = _nvtx is not None and (nvtx == "force" or (
            bool(nvtx) and bool(os.environ.get("NVTX_INJECTION64_PATH"))))
        #: whether begin()/end() do anything (NVTX or timeline)
        self.active = bool(self.nvtx or path)
        # the events of one file: tracers of one path in a process (two communicators from
        # init() with one COMMLIB_TIMELINE) share them, so that no write replaces another's
        shared = _RECORDS.get(path) if path else None
        if shared is None:
            shared = (self, [], threading.Lock(), time.perf_counter(), time.time(), [0])
            if path:
                _RECORDS[path] = shared
                from .shutdown import at_exit  # here: importing it imports mpi4py.MPI (starts MPI)
                at_exit(self.write)
        else:
            with shared[2]:
                shared[5][0] += 1
        self._writer, self._events, self._lock, self._t0, self._t0_wall, self._lanes = shared
        #: this tracer's tracks among the file's: one lane per communicator
        self.lane = self._lanes[0]

    def sibling(self) -> "Tracer":
        """A tracer of the same file and settings for another communicator (a split): its own
        tracks, the same clock.

        Example:
            >>> Communicator(sub, config, backend, tracer=self._tracer.sibling())
        """
        return Tracer(self.rank, self.path, self._nvtx_setting)

    def _tid(self, track: str) -> int:
        return _TIDS.get(track, 9) + _LANE_TIDS * self.lane

    @property
    def recording(self) -> bool:
        return self.path is not None

    def now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def add(self, phase: str, op: str, track: str, start_us: float, end_us: float,
            **args: Any) -> None:
        """Add one completed phase to the timeline (no-op when not recording)."""
        if not self.path:
            return
        ev = {"name": f"{op} {phase}", "cat": phase, "ph": "X", "pid": self.rank,
              "tid": self._tid(track), "ts": round(start_us, 3),
              "dur": round(max(end_us - start_us, 0.0), 3), "args": {"op": op, **args}}
        with self._lock:
            self._events.append(ev)

    def add_overlapping(self, phase: str, op: str, track: str, key: int, start_us: float,
                        end_us: float, **args: Any) -> None:
        """Add one completed phase that may overlap others of its track without nesting in them
        (an operation's ``queued``: the next was submitted before it started): an async slice,
        ``key`` (its ``seq``) telling it from the others (no-op when not recording)."""
        if not self.path:
            return
        ident = f"{self.lane}.{key}"
        common = {"name": f"{op} {phase}", "cat": phase, "id": ident, "pid": self.rank,
                  "tid": self._tid(track)}
        begin = {**common, "ph": "b", "ts": round(start_us, 3), "args": {"op": op, **args}}
        end = {**common, "ph": "e", "ts": round(max(end_us, start_us), 3)}
        with self._lock:
            self._events += (begin, end)

    def instant(self, name: str, track: str = "control", **args: Any) -> None:
        """Add a point event (a decision, an error) to the timeline."""
        if not self.path:
            return
        ev = {"name": name, "ph": "i", "s": "t", "pid": self.rank,
              "tid": self._tid(track), "ts": round(self.now_us(), 3), "args": args}
        with self._lock:
            self._events.append(ev)

    def begin(self, phase: str, op: str, track: str, tag: str | None = None,
              **args: Any) -> tuple[Any, float, tuple] | None:
        """Open a phase (NVTX range + timeline start); pass the token to :meth:`end`.

        Returns ``None`` when neither NVTX nor the timeline is on (no cost).
        """
        if not self.nvtx and not self.path:
            return None
        rng = None
        if self.nvtx:
            label = f"commlib.{op}" + (f"[{tag}]" if tag else "")
            if "seq" in args:
                label += f" #{args['seq']}"
            if "nbytes" in args:
                label += f" {format_bytes(args['nbytes'])}"
            rng = _nvtx.start_range(message=f"{label} {phase}", color=_COLORS.get(op, "grey"),
                                    domain="commlib")
        return rng, (self.now_us() if self.path else 0.0), (phase, op, track, tag, args)

    def end(self, token: tuple[Any, float, tuple] | None) -> None:
        """Close a phase opened by :meth:`begin`."""
        if token is None:
            return
        rng, start, (phase, op, track, tag, args) = token
        if rng is not None:
            _nvtx.end_range(rng)
        if self.path:
            self.add(phase, op, track, start, self.now_us(), **({"tag": tag} if tag else {}), **args)

    @contextlib.contextmanager
    def span(self, phase: str, op: str, track: str, tag: str | None = None,
             **args: Any) -> Iterator[None]:
        """Bracket a phase with an NVTX range and a timeline event (context manager)."""
        token = self.begin(phase, op, track, tag, **args)
        try:
            yield
        finally:
            self.end(token)

    def write(self) -> str | None:
        """Write the timeline file now (also done at exit), with the events of every tracer of
        its path in this process; return its path."""
        if not self.path:
            return None
        if self._writer is not self:
            return self._writer.write()
        with self._lock:
            events = list(self._events)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid + _LANE_TIDS * lane,
                  "args": {"name": name if not lane else f"{name} (communicator {lane})"}}
                 for lane in range(self._lanes[0] + 1) for name, tid in _TIDS.items()]
        doc = {"traceEvents": meta + events, "displayTimeUnit": "ms",
               "otherData": {"rank": self.rank, "start_unix_s": self._t0_wall}}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)
        return self.path
