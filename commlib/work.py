"""The progress engine and the ``Work`` handle of a nonblocking operation.

A communicator's nonblocking operations run one after another, in submission
order, on one background thread that waits for each inside MPI (so MPI
progresses it at the speed of its own blocking call) or on the
communicator's stream (NCCL); the caller holds a :class:`Work` and computes
meanwhile.  An operation submitted while the engine is idle is started at
once on the caller's thread (and completed there if it already finished, as
small operations on one rank do): only operations that take time are handed
to the thread.  A blocking call that finds the engine idle runs entirely on
the caller's thread (no hand-off); otherwise it queues behind the pending
operations and waits, so the order is kept.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import CommlibError

#: how long the engine thread leaves a small operation its caller already posted to
#: that caller's ``wait()`` before taking it over.  Each time the thread wakes it takes
#: the GIL from the caller, which costs a scheduler slice where ranks share cores (measured:
#: one wake per millisecond slowed a stream of 4 KiB all-reduces on 4 ranks sharing 2 cores
#: by half), so neither a submission nor a claim wakes a napping thread for such an
#: operation: the thread looks at the queue when its nap ends.  Operations up to
#: :data:`CLAIM_MAX_BYTES` (about 1 ms on one host) that their caller waits for
#: complete without any wake.  Larger operations go to the thread at once: their progress
#: while the caller computes matters more than one hand-off.
CLAIM_WINDOW_S = 1e-3
CLAIM_MAX_BYTES = 1 << 20
#: a nap that found nothing left unattended doubles, up to this: a stream of small
#: operations that their callers wait for costs a few wakes a second, and one left
#: unattended after such a stream is taken over within this much
MAX_IDLE_NAP_S = 16e-3
#: after the last submission the thread keeps napping this long, then sleeps until the
#: next submission wakes it
IDLE_GRACE_S = 0.05


class Work:
    """Handle of a nonblocking operation: ``wait()`` for its result, ``test()`` to poll.

    Example:
        >>> import numpy as np, commlib
        >>> comm = commlib.init()
        >>> work = comm.iallreduce(np.ones(4, np.float32), op="avg")
        >>> # ... compute while it runs ...
        >>> work.wait()
        array([1., 1., 1., 1.], dtype=float32)
    """

    __slots__ = ("op", "started", "submitted", "_done", "_gate", "_result", "_error", "_waiter")

    def __init__(self, op: Any, waiter: Callable[["Work", float | None], None] | None = None):
        self.op = op
        #: the operation as started (a backend's ``Pending``), or ``None`` while queued
        self.started: Any = None
        #: ``time.monotonic()`` at submission
        self.submitted = time.monotonic()
        # completion: a flag, and a lock held until then that sleepers block on (a C-level
        # lock costs a tenth of a threading.Event, which every nonblocking call creates)
        self._done = False
        self._gate = threading.Lock()
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self._waiter = waiter

    def complete(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake the waiters (whoever completed the operation; the first one stays)."""
        if self._done:
            return
        self._result, self._error = result, error
        self._done = True
        self._gate.release()

    def sleep(self, seconds: float | None) -> bool:
        """Sleep until the operation finishes or ``seconds`` pass (``None``: no limit); True if finished."""
        if self._done:
            return True
        if self._gate.acquire(timeout=-1 if seconds is None else max(seconds, 0.0)):
            self._gate.release()    # the next sleeper passes too
            return True
        return self._done

    def test(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._done

    is_completed = test

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes and return its result (or raise its error).

        ``timeout`` bounds this wait only (``TimeoutError``, the operation goes
        on); the communicator's own timeout bounds the operation itself.
        """
        if not self._done:
            if self._waiter is not None:
                self._waiter(self, timeout)
            elif not self.sleep(timeout):
                raise TimeoutError(f"{self.op} still running after wait(timeout={timeout})")
        if self._error is not None:
            raise self._error
        return self._result


class ProgressEngine:
    """Completes submitted operations one at a time, in submission order.

    ``complete(work)`` starts ``work.op`` if ``work.started`` is ``None``,
    waits for it and finishes it on the engine's thread.  A caller completes
    operations itself when the engine is idle (:meth:`enter_if_idle`, the
    ``start`` of :meth:`submit`) or when it waits for the next queued one
    (:meth:`claim`).  An operation is always completed by one thread, so no
    MPI request is ever waited on by two threads.

    The thread is woken only when the operation at the head of the queue needs
    it before the thread would look anyway (see :data:`CLAIM_WINDOW_S`).
    """

    def __init__(self, complete: Callable[[Work], Any], name: str):
        self._complete = complete
        self._name = name
        self._queue: collections.deque[Work] = collections.deque()
        # ``with self._lock`` (a C-level lock) rather than ``with self._cv``: the same lock,
        # without the Condition's Python-level __enter__ on every call
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)       # the engine thread sleeps on it
        self._settled = threading.Condition(self._lock)  # drain() sleeps on it
        self._pending = 0
        self._claimed = False   # a caller is completing the head operation (claim())
        self._busy = False      # the thread is completing an operation
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wake_at = 0.0     # when the sleeping thread looks again (inf: when woken; 0: awake)
        self._nap = CLAIM_WINDOW_S
        self._last_submit = 0.0

    @property
    def idle(self) -> bool:
        """No operation queued or running."""
        return self._pending == 0

    def _unattended(self) -> Work | None:
        """The head operation if nobody is completing it (under the lock)."""
        if self._queue and not self._claimed:
            return self._queue[0]
        return None

    def _due(self, now: float) -> float:
        """When the thread must look at the queue next (under the lock); inf: only when woken."""
        work = self._unattended()
        if work is not None:
            if self._closed or work.started is None or work.op.nbytes > CLAIM_MAX_BYTES:
                return now
            return work.submitted + CLAIM_WINDOW_S
        if self._closed and not self._queue:    # nothing left: the thread ends
            return now
        if now - self._last_submit < IDLE_GRACE_S:
            return now + self._nap
        return math.inf

    def _poke(self) -> None:
        """Wake the thread if the queue needs it now, or if it sleeps until woken (under the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        elif self._wake_at:     # asleep (an awake thread looks at the queue before it sleeps)
            now = time.monotonic()
            if self._wake_at == math.inf or self._due(now) <= now:
                self._cv.notify()

    def submit(self, work: Work, start: Callable[[Work], bool]) -> Work:
        """Queue ``work``; when the engine is idle, ``start(work)`` runs first on this thread
        and returns True if it already completed ``work`` (then nothing is queued)."""
        with self._lock:
            if self._closed:
                raise CommlibError(f"{self._name}: communicator is closed")
            self._pending += 1
            self._last_submit = work.submitted
            if self._pending == 1:
                # nothing ahead: start now, on the caller's thread, in submission order
                try:
                    if start(work):
                        self._pending -= 1
                        return work
                except BaseException:
                    self._pending -= 1
                    raise
            self._queue.append(work)
            self._poke()
        return work

    def enter_if_idle(self) -> bool:
        """Hold the engine on this thread if nothing is queued or running: True, and the caller
        runs its operation then calls :meth:`leave` (submissions from other threads wait
        meanwhile); else False.

        Example (what a blocking call does):
            >>> if engine.enter_if_idle():
            ...     try:
            ...         result = run_here(op)       # post and wait on this thread
            ...     finally:
            ...         engine.leave()
        """
        self._lock.acquire()
        if self._closed or self._pending:
            self._lock.release()
            if self._closed:
                raise CommlibError(f"{self._name}: communicator is closed")
            return False
        return True

    def leave(self) -> None:
        """End :meth:`enter_if_idle`'s hold."""
        self._lock.release()

    def claim(self, work: Work) -> bool:
        """Take ``work`` off the queue if it is next and the thread has not picked it up;
        the caller then completes it and calls :meth:`done`.  Saves two thread
        hand-offs when the caller waits right after submitting."""
        with self._lock:
            if self._queue and self._queue[0] is work and not (self._claimed or self._busy):
                self._queue.popleft()
                self._claimed = True
                return True
        return False

    def done(self, claimed: bool = False) -> None:
        """One operation (run by the thread, or ``claimed``) has completed."""
        with self._lock:
            self._pending -= 1
            if claimed:
                self._claimed = False
                self._poke()
            if not self._pending:
                self._settled.notify_all()

    def _run_one(self, work: Work) -> None:
        try:
            work.complete(self._complete(work))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            work.complete(error=exc)
        with self._lock:
            self._busy = False
        self.done()

    def settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every submitted operation to finish; True once they
        have (:meth:`Runner.drain <commlib.runner.Runner.drain>` watches peers between such waits)."""
        with self._lock:
            if self._pending:
                self._settled.wait(timeout)
            return not self._pending

    def head(self) -> Any:
        """The operation first in the queue (``None``: nothing queued)."""
        with self._lock:
            return self._queue[0].op if self._queue else None

    def close(self) -> None:
        """Take no more submissions; the thread ends once what is queued has finished
        (:meth:`Runner.close_engine <commlib.runner.Runner.close_engine>` waits for that)."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()

    def join(self) -> None:
        """After :meth:`close` and once nothing is pending: wait for the thread to end."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed and not self._queue:
                        return
                    now = time.monotonic()
                    due = self._due(now)
                    if due <= now and self._unattended() is not None:
                        break
                    self._wake_at = due
                    self._cv.wait(None if due == math.inf else due - now)
                    self._wake_at = 0.0
                    if self._unattended() is None:
                        self._nap = min(2 * self._nap, MAX_IDLE_NAP_S)   # nobody needed it
                work = self._queue.popleft()
                self._busy = True
                self._nap = CLAIM_WINDOW_S
            self._run_one(work)
