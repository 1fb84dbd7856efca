"""Running one communicator's operations: post, wait, give up, finish.

A :class:`Runner` is the half of a :class:`~commlib.communicator.Communicator`
that deals with operations already validated and numbered (an
:class:`~commlib.ops.Op`): it posts them in call order and shows them on the
status board, waits for them (on the caller's thread, or on the progress
engine's thread for nonblocking ones), gives up on a timeout or a peer's
failure (:mod:`commlib.verdicts` judges) with an error naming the operation,
its sequence number and the ranks, and remembers what it gave up while MPI
still holds it (the job then ends with ``MPI_Abort`` at exit instead of hanging
in ``MPI_Finalize``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from . import board as _board
from . import shutdown
from .backends.base import Pending
from .config import Config
from .errors import CommAbortedError, CommlibError
from .ops import Op
from .poll import CHECK_EVERY_S, MAX_NAP_S, poll_until
from .tracing import Tracer
from .verdicts import WaitVerdicts
from .work import ProgressEngine, Work


class Runner(WaitVerdicts):
    """Posts, waits for and finishes the operations of one communicator (see module docs).

    Example (what :meth:`Communicator.allreduce` does once its ``Op`` is built):
        >>> result = runner.call(op, blocking=True)      # or a Work when blocking=False
    """

    def __init__(self, rank: int, size: int, config: Config, backend: Any, board: _board.Board,
                 tracer: Tracer, name: str):
        self.rank, self.size = rank, size
        self.config = config
        #: seconds an operation may take (0: no limit); the communicator's ``timeout``
        self.timeout = config.timeout
        #: seconds a wait may take before a :class:`CommStallWarning` (0: none)
        self.stall_warning = config.stall_warning
        self.backend = backend
        self.board = board
        # the last operation posted (what the board shows).  start() and finish() need no
        # lock: the engine runs one operation at a time, and whoever completes it (the engine
        # thread, a caller that claimed it, a blocking call on an idle engine) settles it
        # before the next one can start
        self.posted = 0
        self.tracer = tracer
        self.engine = ProgressEngine(self.complete_work, name)
        self.running: Op | None = None      # the operation the engine thread is in
        self.aborted: BaseException | None = None
        #: an operation whose input this rank rejected, its verdict left to the next call
        #: (:meth:`reject`): (name, seq, the reason)
        self.rejection: tuple[str, int, str] | None = None
        self.closed = False
        #: operations given up while posted: (label, whether it has completed since)
        self.dangling: list[tuple[str, Callable[[], bool]]] = []
        #: the runner of the communicator this one was split from with the same ranks in the same
        #: order (a side communicator: SyncBatchNorm's, stop_together's): its board is watched while
        #: waiting, and it is aborted with this one when a wait here finds their calls diverged
        self.parent: Runner | None = None

    def check_alive(self) -> None:
        """Raise :class:`CommAbortedError` if the communicator is closed or aborted (after a
        rejected input's verdict, :meth:`settle_rejection`, which this waits for)."""
        if self.closed:
            raise CommAbortedError("communicator is closed")
        if self.rejection is not None and self.aborted is None:
            self.settle_rejection()
        if self.aborted is not None:
            raise CommAbortedError(f"communicator aborted: {self.aborted}") from self.aborted

    def reject(self, err: BaseException, name: str, seq: int) -> None:
        """This rank rejected its input to operation ``seq`` (without check mode).  Peers may already
        be inside it: the board shows the rejection, so they raise it at once, and their posted
        operation could pair with this rank's next one.  Where the board shows every rank (one
        node) and nothing is in flight here, the verdict waits for this rank's next call on the
        communicator (:meth:`settle_rejection`): it goes on if every rank rejected the operation
        alike.  Operations in flight here are waited for first (valid where they were posted, they
        complete: they were aborted, or a peer that waited for them first waited for this rank's
        verdict for good).  Elsewhere the communicator is aborted now.  ``err``'s message says which."""
        one_node = len(self.board.members) == self.size
        if one_node and not self.engine.idle and self.aborted is None:
            try:
                self.drain()
            except CommlibError:        # their wait failed and aborted the communicator: say so
                err.args = (f"{err} (communicator aborted before: {self.aborted})",)
                return
        alone = self.engine.idle
        self.board.reject(seq, name, str(err), alone)
        if one_node and alone:
            self.rejection = (name, seq, str(err))
            err.args = (f"{err} (if a peer called {name} #{seq} with valid input, the communicator is "
                        "aborted and its next call here raises CommAbortedError; COMMLIB_CHECK=1 agrees "
                        "on inputs first)",)
        else:
            self.aborted = err
            err.args = (f"{err} (communicator aborted: peers may already be inside {name} #{seq}; "
                        "COMMLIB_CHECK=1 agrees on inputs first and keeps it usable)",)

    def settle_rejection(self) -> None:
        """The verdict on :meth:`reject`'s operation, once every peer has reached it: every rank
        rejected it alike (the communicator goes on, as under check mode), or a peer called it
        with valid input or will not call it (aborted: that peer raised, or raises, at once).  A
        wait past the timeout aborts too; it warns after ``stall_warning`` seconds."""
        name, seq, reason = self.rejection
        since = time.monotonic()
        nap = 2e-5
        while True:
            alike, peer = self.board.rejected_alike(seq)
            waited = time.monotonic() - since
            if alike is not None or self.aborted is not None or 0 < self.timeout <= waited:
                break
            if not self.warn_stall(seq, waited, lambda waited=waited, peer=peer: (
                    f"rank {self.rank} rejected its input to {name} #{seq} and has waited {waited:.3g} s "
                    f"for every rank to reach it: {peer.describe()}")):
                break
            time.sleep(nap)
            nap = min(2 * nap, MAX_NAP_S)
        self.rejection = None
        if alike or self.aborted is not None:
            return
        why = "did" if alike is False else f"reached it in {waited:.3g} s"
        self.aborted = CommAbortedError(f"rank {self.rank} rejected its input to {name} #{seq} ({reason}) "
                                        f"and not every rank {why}: {peer.describe()}")
        if alike is None:    # peers that come later must not read the rejection as a verdict
            self.board.set(seq, "?", _board.ABORTED, str(self.aborted))

    def drain(self) -> None:
        """Wait until every operation submitted so far has finished (``synchronize()``), giving up
        as a :class:`Work`'s wait does (:meth:`verdict`: the timeout, counted from when the
        operation became the one in progress, or a peer's failure or state that says it cannot end;
        the communicator is then aborted and the operation left dangling).  The operations' own
        errors stay with their :class:`Work`."""
        engine = self.engine
        watched, since = None, 0.0
        while not engine.settled(CHECK_EVERY_S):
            op = self.running or engine.head()
            if op is None:      # a caller completes it (a claim, a start): that caller watches it
                continue
            now = time.monotonic()
            if op is not watched:
                watched, since = op, now
            err = self.verdict(op.seq, op.name, now - since)
            if err is not None:
                self.dangling.append((f"{op.name} #{op.seq}", lambda: engine.idle))
                self.fail(err, op.name, op.seq)

    def close_engine(self) -> None:
        """Take no more submissions, let the engine finish what is queued (:meth:`drain`: given up,
        the communicator aborted, on the timeout or a peer's failure) and stop its thread."""
        self.engine.close()
        try:
            self.drain()
        except CommlibError:    # aborted, the operation dangling: the thread stays in it
            return
        self.engine.join()

    def unfinished(self) -> list[str]:
        """Operations given up (timeout, a peer's failure) that MPI still holds (an NCCL operation
        of an aborted NCCL communicator holds nothing: its test raises)."""
        left = []
        for label, done in self.dangling:
            try:
                finished = done()
            except CommAbortedError:
                finished = True
            if not finished:
                left.append(f"{label} (rank {self.rank} of {self.size})")
        return left

    def call(self, op: Op, blocking: bool) -> Any:
        """Run ``op``: its result (``blocking``), else its :class:`Work`."""
        engine = self.engine
        if blocking and engine.enter_if_idle():
            try:
                return self.run_here(op)
            finally:
                engine.leave()
        if self.tracer.path:
            op.submitted_us = self.tracer.now_us()
        work = engine.submit(Work(op, self.wait_work), self.start_work)
        return work.wait() if blocking else work

    def wait(self, p: Pending, name: str, seq: int, rejections: bool = True) -> None:
        """Drive ``p`` to completion on this thread; raise (and abort) when it must be given up.

        MPI advances a nonblocking collective only inside MPI calls, so the
        loop tests the request back to back, yielding the core between tests
        (ranks may share cores): measured as fast as MPI's own blocking call
        (``benchmarks/results/collectives-cpu-4ranks.md``).  It never sleeps;
        every :data:`~commlib.poll.CHECK_EVERY_S` it asks :meth:`verdict`.
        Device-stream operations (NCCL) may back off after ``poll_spin``.  Without
        ``rejections``, a peer that rejected its input to ``seq`` does not end the wait
        (an exchange that every rank joins before it raises: ``allgatherv``'s counts).
        """
        poll_until(p.test, math.inf if p.request is not None else self.config.poll_spin,
                   self._give_up_if, (p, name, seq, time.monotonic(), rejections))

    def _give_up_if(self, now: float, p: Pending, name: str, seq: int, since: float,
                    rejections: bool) -> None:
        """:meth:`wait`'s periodic check: fail (and remember ``p`` as dangling) if it must be given up."""
        err = self.verdict(seq, name, now - since, rejections)
        if err is not None:
            self.dangling.append((f"{name} #{seq}", p.test))
            self.fail(err, name, seq)

    def fail(self, err: CommlibError, name: str, seq: int) -> None:
        """An operation in flight failed: abort this communicator and raise ``err``.

        The operation may still be posted inside the backend, so no later
        operation can be trusted; peers on this node see the abort on the board.
        """
        self.mark_aborted(err, name, seq)
        raise err

    def interrupted(self, p: Pending | None, exc: BaseException, name: str, seq: int,
                    shown: int | None = None) -> None:
        """Operation ``seq`` was left running by ``exc`` raised in its wait (Ctrl-C's
        ``KeyboardInterrupt``, a signal handler's exception): MPI still reads and writes its
        buffers, which ``p`` keeps alive (a result buffer back in the pool would be handed to
        the next operation while MPI writes it; ``None``: the engine's thread runs it, and keeps
        them), and peers may wait in it for this rank: the communicator is aborted, so that peers
        fail at once and the exit ends the job.  ``shown``: the operation the board shows the
        abort after (default ``seq - 1``: peers in ``seq`` do not wait for this rank as for a
        fellow waiter; a call outside the order, ``allgather_object``, is after ``seq``)."""
        if p is not None:
            self.dangling.append((f"{name} #{seq}", p.test))
        self.mark_aborted(CommAbortedError(f"{name} #{seq}: rank {self.rank} was interrupted while "
                                           f"it ran ({type(exc).__name__}); the communicator is "
                                           "aborted"), "?", seq - 1 if shown is None else shown)

    def finalized(self) -> None:
        """``MPI_Finalize`` is running (the program called it with this communicator open): no
        operation can run from now on; each call raises, naming why."""
        if self.aborted is None:
            self.aborted = CommAbortedError("MPI.Finalize() ran with this communicator open: no "
                                            "operation can run after it (close communicators with "
                                            "comm.close() before MPI.Finalize(), or leave finalizing "
                                            "to the exit)")

    def left(self, reason: str, seq: int | None = None) -> None:
        """This rank gives the communicator up without freeing it after its operation ``seq`` (the
        last posted), with nothing in flight: later calls raise; peers' waits for what it called
        complete, for a later call fail at once, and their close frees nothing
        (:meth:`Board.wait_to_free`), as it will not."""
        if self.aborted is None and not self.unfinished():
            self.aborted = CommAbortedError(f"this rank left the communicator: {reason}")
            self.board.set(self.posted if seq is None else seq, "?", _board.LEFT, reason)

    def ending(self, seq: int) -> None:
        """This rank's program ends after its operation ``seq`` (the last called): shown closing at
        once, before the exit closes the communicators one by one, newest first, each waiting for
        its peers' close.  A peer waiting in this one for an operation this rank never called fails
        at once, not when the close of a newer one, which it would reach only after, gave up (a
        split's close kept it the whole timeout after one rank raised).  Not over a rejection whose
        verdict is pending: its close settles it, and peers read the rejection meanwhile."""
        if self.aborted is None and not self.closed and self.rejection is None:
            self.board.set(seq, "?", _board.CLOSING, shutdown.ended_by())

    def mark_aborted(self, err: CommlibError, name: str, seq: int) -> None:
        """Abort this communicator for ``err`` (raised in operation ``seq``, or in a side
        communicator's wait): no later operation runs; peers on this node see it on the board."""
        self.tracer.instant("error", op=name, seq=seq, error=str(err))
        self.aborted = err
        self.backend.abort(str(err))    # NCCL: unblock the kernels still waiting
        self.board.set(seq, name, _board.ABORTED, str(err))

    def post(self, name: str, seq: int, start: Callable[..., Pending], args: tuple) -> Pending:
        """Post operation ``seq`` (``start(*args)``; operations are posted in call order) and
        show it on the board."""
        if self.aborted is not None or self.closed:
            self.check_alive()
        self.posted = seq
        self.board.set(seq, name, _board.IN_OP)
        try:
            return start(*args)
        except CommAbortedError as err:   # the backend failed at launch (NCCL): abort everywhere
            self.fail(err, name, seq)
        except Exception as exc:    # MPI refused to post it: peers may be inside it already
            err = CommAbortedError(f"{name} #{seq}: rank {self.rank} could not post it: {exc!r}")
            err.__cause__ = exc
            self.fail(err, "?", seq - 1)    # shown aborted before it: peers in it are not fellow waiters

    def settle(self, p: Pending, name: str, seq: int) -> None:
        """Wait for the posted operation ``seq`` on this thread and run its finish step.

        A backend that finds the operation failed while testing it (an NCCL
        asynchronous error) raises :class:`CommAbortedError`: the communicator
        is then aborted here as after a timeout."""
        try:
            if not p.test():
                self.wait(p, name, seq)
        except CommAbortedError as err:
            if self.aborted is None:
                self.fail(err, name, seq)
            raise
        except BaseException as exc:
            if self.aborted is None:    # not given up by wait(), which aborts first: interrupted
                self.interrupted(p, exc, name, seq)
            raise
        if p.finish is not None:
            p.finish()
        if self.posted == seq:   # nothing posted since: the board shows this rank idle (unless it
            self.board.idle_after(seq, name)    # shows a later call's rejection or an abort)

    def start(self, op: Op) -> Pending:
        """:meth:`post` ``op``, traced."""
        tr = self.tracer
        if tr.active:
            if self.aborted is not None or self.closed:
                self.check_alive()   # before a trace phase opens
            if op.submitted_us:
                tr.add_overlapping("queued", op.name, "engine", op.seq, op.submitted_us, tr.now_us(),
                                   seq=op.seq, nbytes=op.nbytes, **({"tag": op.tag} if op.tag else {}))
            op.token = tr.begin("running", op.name, "engine", op.tag, seq=op.seq, nbytes=op.nbytes)
        return self.post(op.name, op.seq, op.start, op.args)

    def run_here(self, op: Op) -> Any:
        """Post ``op`` and wait for it on this thread; its result."""
        return self.finish(op, self.start(op))

    def finish(self, op: Op, p: Pending) -> Any:
        """:meth:`settle` the posted ``op``, close its trace and return its result."""
        try:
            self.settle(p, op.name, op.seq)
        finally:
            if op.token is not None:
                self.tracer.end(op.token)
                op.token = None
        return op.value if op.result is None else op.result()

    def call_host(self, name: str, seq: int, start: Callable[..., Pending], args: tuple,
                  out: Any, nbytes: int, tag: str | None = None) -> Any:
        """A blocking operation on plain host arrays whose result is the caller's ``out``
        (untraced): posted and waited for on this thread without an :class:`Op` when the
        engine is idle (about a third less Python per call than the general path:
        ``benchmarks.engine_figures.overhead``), else queued behind the operations in flight.

        Example (what :meth:`Communicator.allreduce` does for numpy ``x`` and ``out``):
            >>> runner.call_host("allreduce", 7, backend.allreduce, (x, out, "float32", "sum"), out, x.nbytes)
        """
        engine = self.engine
        if not engine.enter_if_idle():
            return self.call(Op(name, start, args, None, out, nbytes, tag, (), seq), True)
        try:
            self.settle(self.post(name, seq, start, args), name, seq)
        finally:
            engine.leave()
        return out

    def complete_work(self, work: Work) -> Any:
        """The engine thread's job: start ``work`` if still queued, wait for it, finish it.

        MPI requests are waited on inside ``MPI_Wait`` (the GIL released, MPI
        progressing at its own speed); the caller's :meth:`wait_work` watches
        for timeouts and peers' failures meanwhile.
        """
        op = work.op
        self.running = op
        try:
            if work.started is None:
                work.started = self.start(op)
            if work.started.request is not None:
                work.started.request.Wait()
            return self.finish(op, work.started)
        finally:
            self.running = None
            self.tracer.end(op.token)   # still open only if the wait failed before finish()

    def start_work(self, work: Work) -> bool:
        """Start ``work`` now, on the caller's thread (the engine is idle); True if it completed."""
        p = work.started = self.start(work.op)
        try:
            done = p.test()
        except CommAbortedError:
            done = True     # failed: finish() raises it again and settle() aborts the communicator
        if not done:
            return False
        try:
            work.complete(self.finish(work.op, p))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            work.complete(error=exc)
        return True

    def wait_work(self, work: Work, timeout: float | None) -> None:
        """``Work.wait``: yield the core for ``poll_spin``, then sleep on the work's event;
        every :data:`~commlib.poll.CHECK_EVERY_S` give up if :meth:`verdict` says so.

        Without ``timeout``, a work still queued and next in line is claimed and
        completed on this thread instead (it then runs to completion, bounded by the
        communicator's timeout); with one, the engine's thread completes it, so that
        this wait can end at ``timeout`` while the operation goes on."""
        op = work.op
        tr = self.tracer
        token = tr.begin("waiting", op.name, "caller", op.tag, seq=op.seq) if tr.active else None
        try:
            if timeout is None and self.engine.claim(work):     # queued, next in line: complete it here
                try:
                    work.complete(self.finish(op, work.started or self.start(op)))
                except BaseException as exc:  # noqa: BLE001 - Work.wait raises it
                    work.complete(error=exc)
                finally:
                    self.engine.done(claimed=True)
                return
            done = work.test
            now = time.monotonic()
            until = now + (math.inf if timeout is None else timeout)
            spin_end = min(now + self.config.poll_spin, until)
            while not done() and time.monotonic() < spin_end:
                os.sched_yield()
            while not done():
                now = time.monotonic()
                if now >= until:
                    raise TimeoutError(f"{op} still running after wait(timeout={timeout})")
                stuck = self.running or op
                err = self.verdict(stuck.seq, stuck.name, now - work.submitted)
                if err is not None:
                    self.dangling.append((str(stuck), done))
                    self.fail(err, stuck.name, stuck.seq)
                work.sleep(min(CHECK_EVERY_S, until - now))
        except (CommlibError, TimeoutError):      # given up (aborted), or this wait's own timeout
            raise
        except BaseException as exc:     # Ctrl-C while the engine's thread runs it: as in a blocking call
            if self.aborted is None:
                stuck = self.running or op
                self.interrupted(None, exc, stuck.name, stuck.seq)
            raise
        finally:
            tr.end(token)
