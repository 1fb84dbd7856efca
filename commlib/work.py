"""The progress engine and the ``Work`` handle of a nonblocking operation.

A communicator's nonblocking operations run one after another, in submission
order, on one background thread (MPI) or on the communicator's stream (NCCL);
the caller holds a :class:`Work` and computes meanwhile.  A blocking call that
finds the engine idle runs on the caller's thread (no hand-off); otherwise it
queues behind the pending operations and waits, so the order is kept.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import CommlibError


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

    __slots__ = ("op", "_event", "_result", "_error", "_waiter", "_poll")

    def __init__(self, op: Any, waiter: Callable[["Work", float | None], None] | None = None,
                 poll: Callable[[], bool] | None = None):
        self.op = op
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._waiter = waiter
        self._poll = poll

    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def test(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        if not self._event.is_set() and self._poll is not None:
            self._poll()
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
    """Runs submitted operations one at a time, in submission order.

    Whoever holds the run lock executes the operation at the head of the
    queue: the background thread, so that operations progress while the
    caller computes, or the caller itself inside :meth:`help_until` (its
    ``wait()``), which saves two thread hand-offs per operation when the
    caller waits right away.  An operation is always executed start to finish
    by one thread, so no MPI request is ever polled by two threads.
    """

    def __init__(self, execute: Callable[[Any], Any], name: str):
        self._execute = execute
        self._name = name
        self._queue: collections.deque[Work] = collections.deque()
        self._cv = threading.Condition()
        self._run_lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        """No operation queued or running."""
        return self._pending == 0

    def submit(self, work: Work) -> Work:
        with self._cv:
            if self._closed:
                raise CommlibError(f"{self._name}: communicator is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._pending += 1
            self._queue.append(work)
            self._cv.notify()
        return work

    def _run_one(self) -> bool:
        """Execute the queue's head (the run lock is held); False if the queue was empty."""
        with self._cv:
            if not self._queue:
                return False
            work = self._queue.popleft()
        try:
            work._complete(self._execute(work.op))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            work._complete(error=exc)
        with self._cv:
            self._pending -= 1
            self._cv.notify_all()
        return True

    def help_until(self, work: Work, timeout: float | None = None) -> bool:
        """Run queued operations on this thread until ``work`` is done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = work._event.is_set
        while not done():
            if self._run_lock.acquire(blocking=False):
                try:
                    while not done() and self._run_one():
                        pass
                finally:
                    self._run_lock.release()
                continue
            left = 0.0005 if deadline is None else min(0.0005, deadline - time.monotonic())
            if left <= 0:
                return False
            work._event.wait(left)
        return True

    def drain(self) -> None:
        """Wait until every submitted operation has finished."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
            with self._run_lock:
                self._run_one()
