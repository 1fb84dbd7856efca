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
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import CommlibError

#: how long the engine thread leaves a small operation its caller already posted to
#: that caller's ``wait()`` before taking it over.  Each time the thread wakes it takes
#: the GIL from the caller, which costs a scheduler slice where ranks share cores, so a
#: claim does not wake it; operations up to :data:`CLAIM_MAX_BYTES` (about 1 ms on one
#: host) then complete without a second wake, and an operation nobody waits for loses
#: at most this much progress.  Larger operations go to the thread at once: their
#: progress while the caller computes matters more than one hand-off.
CLAIM_WINDOW_S = 1e-3
CLAIM_MAX_BYTES = 1 << 20


class Work:
    """Handle of a nonblocking operation: ``wait()`` for its result, ``test()`` to poll.

    Example:
        >>> import numpy as np, commlib
        >>> comm = commlib.init()
        >>> work = comm.iallreduce(np.ones(4, np.float32))
        >>> # ... compute while it runs ...
        >>> work.wait()
        array([1., 1., 1., 1.], dtype=float32)
    """

    __slots__ = ("op", "started", "submitted", "_event", "_result", "_error", "_waiter")

    def __init__(self, op: Any, waiter: Callable[["Work", float | None], None] | None = None):
        self.op = op
        #: the operation as started (a backend's ``Pending``), or ``None`` while queued
        self.started: Any = None
        #: ``time.monotonic()`` at submission
        self.submitted = time.monotonic()
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._waiter = waiter

    def complete(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake the waiters (called once, by whoever completed the operation)."""
        self._result, self._error = result, error
        self._event.set()

    def sleep(self, seconds: float) -> bool:
        """Sleep until the operation finishes or ``seconds`` pass; True if it finished."""
        return self._event.wait(seconds)

    def test(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._event.is_set()

    is_completed = test

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes and return its result (or raise its error).

        ``timeout`` bounds this wait only (``TimeoutError``, the operation goes
        on); the communicator's own timeout bounds the operation itself.
        """
        if not self._event.is_set():
            if self._waiter is not None:
                self._waiter(self, timeout)
            elif not self._event.wait(timeout):
                raise TimeoutError(f"{self.op} still running after wait(timeout={timeout})")
        if self._error is not None:
            raise self._error
        return self._result


class ProgressEngine:
    """Completes submitted operations one at a time, in submission order.

    ``complete(work)`` starts ``work.op`` if ``work.started`` is ``None``,
    waits for it and finishes it on the engine's thread.  A caller completes
    operations itself when the engine is idle (:meth:`run_if_idle`, the
    ``start`` of :meth:`submit`) or when it waits for the next queued one
    (:meth:`claim`).  An operation is always completed by one thread, so no
    MPI request is ever waited on by two threads.
    """

    def __init__(self, complete: Callable[[Work], Any], name: str):
        self._complete = complete
        self._name = name
        self._queue: collections.deque[Work] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._pending = 0
        self._claimed = False   # a caller is completing the head operation (claim())
        self._busy = False      # the thread is completing an operation
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        """No operation queued or running."""
        return self._pending == 0

    def submit(self, work: Work, start: Callable[[Work], bool]) -> Work:
        """Queue ``work``; when the engine is idle, ``start(work)`` runs first on this thread
        and returns True if it already completed ``work`` (then nothing is queued)."""
        with self._cv:
            if self._closed:
                raise CommlibError(f"{self._name}: communicator is closed")
            self._pending += 1
            if self._pending == 1:
                # nothing ahead: start now, on the caller's thread, in submission order
                try:
                    if start(work):
                        self._pending -= 1
                        return work
                except BaseException:
                    self._pending -= 1
                    raise
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._queue.append(work)
            self._cv.notify()
        return work

    def run_if_idle(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``fn`` on this thread if nothing is queued or running: ``(True, fn())``;
        else ``(False, None)``.  Submissions from other threads wait meanwhile."""
        with self._cv:
            if self._closed:
                raise CommlibError(f"{self._name}: communicator is closed")
            if self._pending:
                return False, None
            return True, fn()

    def claim(self, work: Work) -> bool:
        """Take ``work`` off the queue if it is next and the thread has not picked it up;
        the caller then completes it and calls :meth:`done`.  Saves two thread
        hand-offs when the caller waits right after submitting."""
        with self._cv:
            if self._queue and self._queue[0] is work and not (self._claimed or self._busy):
                self._queue.popleft()
                self._claimed = True
                return True
        return False

    def done(self, claimed: bool = False) -> None:
        """One operation (run by the thread, or ``claimed``) has completed."""
        with self._cv:
            self._pending -= 1
            if claimed:
                self._claimed = False
            self._cv.notify_all()

    def _run_one(self, work: Work) -> None:
        try:
            work.complete(self._complete(work))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            work.complete(error=exc)
        with self._cv:
            self._busy = False
        self.done()

    def drain(self) -> None:
        """Wait until every submitted operation has finished."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the thread; False if it is still busy
        after ``timeout`` seconds (an operation that never completes)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._queue or self._claimed) and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                work = self._queue[0]
                small = work.op.nbytes <= CLAIM_MAX_BYTES
                if work.started is not None and small and not self._closed:
                    # posted by its caller, who may wait for it at once: leave it to
                    # them for a moment (claim()), which saves two thread hand-offs
                    self._cv.wait(CLAIM_WINDOW_S)
                    if not self._queue or self._queue[0] is not work:
                        continue
                self._queue.popleft()
                self._busy = True
            self._run_one(work)
