"""The control plane: what a communicator's ranks exchange about their calls rather than their data.

On communicators of their own, never the one the engine's operations run on,
so that control traffic never pairs with a queued operation:

* ``COMMLIB_CHECK``'s agreement on each call and ``allgatherv``'s counts, on
  the caller's thread when the call is made;
* Python objects (:meth:`Control.allgather_object`): a blocking exchange
  outside the operations' order (a binding's consolidated optimizer state),
  during which the status board shows this rank in it, so that a peer
  waiting for an operation this rank has not called yet fails at once,
  naming the call (``Runner.verdict``), instead of waiting for the timeout.
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import numpy as np

from .backends.base import Pending
from .board import IN_OP
from .errors import CommlibError, MismatchError, ValidationError
from .ops import OPS, check_agreement
from .runner import Runner
from .tracing import Tracer


class Control:
    """Control traffic of one communicator: ``ctl`` carries checks and counts, ``objects`` objects.

    Example (what :class:`~commlib.communicator.Communicator` does when it is made):
        >>> self._control = Control(ctl, mpi_comm.Dup(), self._run, self._tracer)
    """

    def __init__(self, ctl: Any, objects: Any, runner: Runner, tracer: Tracer):
        self.ctl, self.objects = ctl, objects
        self.size = ctl.size
        self._run, self._tracer = runner, tracer

    def agree(self, name: str, seq: int, fp: list[int], err: BaseException | None) -> None:
        """COMMLIB_CHECK: all ranks compare their calls before any enters the operation."""
        mine = np.array(fp if err is None else [0, OPS.index(name), -1, -1, -1, -1], np.int64)
        table = np.empty((self.size, mine.size), np.int64)
        if self._run.engine.idle:       # the board shows this rank in the call while it agrees on it
            self._run.board.set(seq, name, IN_OP)   # (a timeout's message names who waits in it)
        with self._tracer.span("running", "check", "control", seq=seq):
            req = self.ctl.Iallgather(mine, table)
            self._wait(req, name, seq)
        invalid = [r for r in range(self.size) if table[r, 0] == 0]
        if invalid:
            reasons = self.ctl.allgather(None if err is None else str(err))
            agreed = ValidationError(f"{name} #{seq}: " + "; ".join(
                f"rank {r} rejected its input: {reasons[r]}" for r in invalid))
            agreed.agreed = True
            raise agreed
        check_agreement(table, name, seq)

    def exchange_counts(self, mine: int, seq: int) -> list[int]:
        """``allgatherv`` #``seq`` without counts: every rank's element count (``-1``: it rejected
        its input).  Without check mode a call before the operation, shown on the board as one: a
        peer that was given the counts and went into the operation fails at once, naming it, and
        this rank with it (both waited for the timeout, and its message said this rank had called
        nothing).  In check mode every rank exchanges them, after agreeing on the call: part of
        the operation (as a call, a peer still in the agreement would take it for one it never
        makes)."""
        table, send = np.empty(self.size, np.int64), np.array([mine], np.int64)
        if self._run.config.check:
            self._wait(self.ctl.Iallgather(send, table), "allgatherv", seq, rejections=False)
        else:
            label = "allgatherv's counts exchange"
            with self._run.board.calling(seq - 1, label):     # (a rejecting rank sends -1 first)
                self._wait(self.ctl.Iallgather(send, table), label, seq - 1, rejections=False)
        return [int(c) for c in table]

    def allgather_object(self, obj: Any, label: str, seq: int) -> list[Any]:
        """Every rank's ``obj`` (pickled), in rank order; ``seq``: the last operation this rank called.

        Ranks first exchange their pickle's size and their label's checksum: ranks in calls
        with different labels raise :class:`MismatchError` on every rank instead of exchanging
        each other's objects.  An object that does not pickle on some rank raises
        :class:`ValidationError` on every rank, naming it (its rank sends why instead)."""
        try:
            data, failed = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 0
        except Exception as exc:     # the exchange goes on with why: its peers raise too, not wait
            data, failed = pickle.dumps(f"{type(exc).__name__}: {exc}"), 1
        data = np.frombuffer(data, np.uint8)
        head = np.array([data.size, zlib.crc32(label.encode()), failed], np.int64)
        heads = np.empty((self.size, 3), np.int64)
        with self._run.board.calling(seq, label), self._tracer.span("running", label, "control", seq=seq):
            req = self.objects.Iallgather(head, heads)
            self._wait(req, label, seq, rejections=False)   # after operation seq, not in it
            if (heads[:, 1] != head[1]).any():
                others = [r for r in range(self.size) if heads[r, 1] != heads[0, 1]]
                raise MismatchError(f"{label}: ranks {others} called allgather_object with another label "
                                    f"than rank 0 (this rank: {label!r}): every rank must make the same call",
                                    label, seq, others)
            sizes = heads[:, 0]
            buf = np.empty(int(sizes.sum()), np.uint8)
            req = self.objects.Iallgatherv(data, (buf, sizes))
            self._wait(req, label, seq, rejections=False)
        ends = np.cumsum(sizes)
        objects = [pickle.loads(buf[end - n:end].tobytes()) for n, end in zip(sizes, ends)]
        if heads[:, 2].any():
            raise ValidationError(f"{label}: " + "; ".join(
                f"rank {r} could not pickle its object ({objects[r]})" for r in np.flatnonzero(heads[:, 2])))
        return objects

    def _wait(self, req: Any, name: str, seq: int, rejections: bool = True) -> None:
        """Wait for the MPI request ``req`` as for operation ``seq`` (timeout, peers' failures, and with
        ``rejections`` their rejected inputs: :meth:`Runner.wait`); inside a call, each poll keeps the
        call shown on the board (see :meth:`Board.keep_call_shown`)."""
        board = self._run.board

        def test() -> bool:
            board.keep_call_shown()
            return req.Test()
        p = Pending(test, None, req)
        try:
            self._run.wait(p, name, seq, rejections)
        except CommlibError:
            raise
        except BaseException as exc:      # Ctrl-C: aborted, as in an operation (shown after seq)
            if self._run.aborted is None:
                self._run.interrupted(p, exc, name, seq, shown=seq)
            raise

    def free(self) -> None:
        self.ctl.Free()
        self.objects.Free()
