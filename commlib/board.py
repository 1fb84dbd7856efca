"""A status board in node-local shared memory: who is in which operation.

Each rank of a communicator owns one slot in an MPI shared-memory window
(``MPI.Win.Allocate_shared`` on the ranks of its node) and writes to it with
plain stores, no MPI call: the sequence number and code of the operation it
is in, its state, and a short reason when it rejected its input.  When an
operation times out, or while a rank waits, it reads its node-local peers'
slots to say which ranks are waiting and which never arrived, and to fail
at once when a peer rejected its input instead of waiting for the timeout.
Ranks on other nodes are not observable: they are reported as unknown.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .errors import CommTimeoutError

IDLE, IN_OP, REJECTED, TIMED_OUT, ABORTED = 0, 1, 2, 3, 4
#: in a blocking call outside the operations' order (``Communicator.allgather_object``); the
#: reason text holds the call's label, the sequence number the last operation called before it
IN_CALL = 5
#: closing the communicator (its program ended, or close()): after the last operation it called
CLOSING = 6
#: left the communicator without freeing it, every operation it called complete (its program ended:
#: :meth:`commlib.Communicator.leave`): as closing for its peers' waits, as aborted for their frees
LEFT = 7
_STATE_NAMES = {IDLE: "idle after", IN_OP: "in", REJECTED: "rejected", TIMED_OUT: "timed out in",
                ABORTED: "aborted after"}
_WITH_TEXT = (REJECTED, ABORTED, IN_CALL, LEFT, CLOSING)
#: the states a completed operation's idle replaces (not a later call's rejection, an abort, a close)
_OVERWRITTEN_BY_IDLE = frozenset((IDLE, IN_OP, IN_CALL))
#: seq, op code, state, calls made (:meth:`Board.calling`), last rejected (:meth:`reject`), process id
_INTS = 6
#: how often a waiting rank asks whether its node-local peers' processes still run (:meth:`Board.ended`)
ALIVE_EVERY_S = 0.5
_TEXT = 192          # bytes of reason text per slot
_SLOT = _INTS * 8 + _TEXT


@dataclass
class PeerState:
    """One peer's slot as read from the board."""

    rank: int
    seq: int
    op: str
    state: int
    reason: str
    calls: int = 0      # calls outside the operations' order made so far (:meth:`Board.calling`)
    rejected: int = 0   # the last operation it rejected with nothing in flight (:meth:`Board.reject`)

    def describe(self) -> str:
        if self.state == IN_CALL:
            return f"rank {self.rank} is in {self.reason} (after #{self.seq}), a call every rank must make"
        if self.state == CLOSING:
            return (f"rank {self.rank} closed the communicator after #{self.seq} "
                    f"({self.reason or 'its program ended or called close()'})")
        if self.state == LEFT:
            return f"rank {self.rank} left the communicator after #{self.seq}: {self.reason}"
        if self.seq == 0:
            return f"rank {self.rank} has not called any operation"
        return f"rank {self.rank} {_STATE_NAMES.get(self.state, '?')} {self.op} #{self.seq}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists (signal 0: nothing is sent) and, where ``/proc`` tells,
    it is not a zombie (ended, not yet reaped by its launcher)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


class Board:
    """Node-local shared-memory slots of a communicator's ranks.

    ``ops`` maps op codes to names (the communicator's operation table).
    """

    def __init__(self, mpi_comm, ops: tuple[str, ...]):
        from mpi4py import MPI

        self._ops = ops
        self._codes = {name: i for i, name in enumerate(ops)}
        self.node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.rank)
        nbytes = _SLOT * self.node.size if self.node.rank == 0 else 0
        self.win = MPI.Win.Allocate_shared(nbytes, 1, comm=self.node)
        buf, _ = self.win.Shared_query(0)
        mem = np.frombuffer(buf, dtype=np.uint8, count=_SLOT * self.node.size)
        self._slots = mem.reshape(self.node.size, _SLOT)
        self._ints = [self._slots[i, :_INTS * 8].view(np.int64) for i in range(self.node.size)]
        # this rank's integers as a memoryview: a store costs a quarter of a numpy item store
        self._mine_mv = memoryview(self._ints[self.node.rank]).cast("B").cast("q")
        # comm ranks of the node's members, in node-rank order
        self.members = MPI.Group.Translate_ranks(
            self.node.Get_group(), list(range(self.node.size)), mpi_comm.Get_group())
        self._mine = self._ints[self.node.rank]
        # every slot's state in one strided view: quiet() asks all of them in one numpy call
        self._states = mem.view(np.int64).reshape(self.node.size, _SLOT // 8)[:, 2]
        self._mine[:] = 0
        self._mine[5] = os.getpid()
        #: calls outside the operations' order this rank has made (:meth:`calling`)
        self.calls = 0
        #: inside a call: (its seq, the operations' state to show after it)
        self._call: tuple[int, tuple[int, int, int]] | None = None
        self.node.Barrier()
        # the peers' processes can be watched where their ids are this process's to see (one PID
        # namespace: not so across containers sharing the node's memory)
        self._pids = [int(self._ints[i][5]) for i in range(self.node.size)]
        self._watch = all(_running(pid) for pid in self._pids)
        self._alive_checked = time.monotonic()

    def set(self, seq: int, op: str, state: int, reason: str = "") -> None:
        """Publish this rank's current operation (plain stores, no MPI call)."""
        if state > IN_OP:   # REJECTED, TIMED_OUT, ABORTED, ...: the reason (may be empty) replaces the last
            self._text(reason)
        mine = self._mine_mv
        mine[0] = seq       # the state last: a peer reading meanwhile sees the old state beside the
        mine[1] = self._codes.get(op, -1)      # new operation, never the new state beside an old one
        mine[2] = state

    def idle_after(self, seq: int, op: str) -> None:
        """Operation ``seq`` completed, nothing posted since: show this rank idle after it (over a
        call it is in too: :meth:`keep_call_shown`), unless the slot shows a rejection of a later
        call (whose verdict its peers read there: overwritten, a peer waited for it for good), an
        abort or a close."""
        mine = self._mine_mv
        if mine[2] in _OVERWRITTEN_BY_IDLE:      # (set()'s stores inline: once per operation)
            mine[0] = seq
            mine[1] = self._codes.get(op, -1)
            mine[2] = IDLE

    def reject(self, seq: int, op: str, reason: str, alone: bool) -> None:
        """Show that this rank rejected its input to operation ``seq``; ``alone``: with nothing in
        flight here, so that it cannot have called an earlier operation that is still pending
        (:meth:`rejected_alike` reads that from the slot's last rejected seq, written first)."""
        if alone:
            self._mine_mv[4] = seq
        self.set(seq, op, REJECTED, reason)

    def quiet(self) -> bool:
        """No node-local rank (this one included) is past plain waiting: none rejected its input,
        aborted, is in a call outside the operations' order, or is closing (a waiter's fast check)."""
        return bool(self._states.max() <= IN_OP)

    def peers(self) -> list[PeerState]:
        """Every node-local rank's slot (including this rank's)."""
        out = []
        for i, comm_rank in enumerate(self.members):
            seq, code, state, calls, rejected, _pid = (int(v) for v in self._ints[i])
            reason = ""
            if state in _WITH_TEXT:
                reason = bytes(self._slots[i, _INTS * 8:]).split(b"\0", 1)[0].decode(
                    "utf-8", "replace")
            op = self._ops[code] if 0 <= code < len(self._ops) else "?"
            out.append(PeerState(comm_rank, seq, op, state, reason, calls, rejected))
        return out

    def _text(self, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:_TEXT - 1]
        text = self._slots[self.node.rank, _INTS * 8:]
        text[:] = 0
        text[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    @contextmanager
    def calling(self, seq: int, label: str) -> Iterator[None]:
        """Show this rank in the call ``label`` (after operation ``seq``) while inside; as before after,
        unless the communicator was aborted meanwhile."""
        mine = self._mine_mv
        self._call = (seq, (mine[0], mine[1], mine[2]))
        self.calls += 1
        mine[3] = self.calls
        self.set(seq, "?", IN_CALL, label)
        try:
            yield
        finally:
            saved, self._call = self._call[1], None
            if mine[2] == IN_CALL:
                mine[0], mine[1], mine[2] = saved

    def keep_call_shown(self) -> None:
        """From the wait of the call this rank is in (each poll): operations in flight that
        progressed meanwhile (the engine thread publishes them with :meth:`set`) wrote over the
        call; show it again, and their state after it.  The operations' path stays as it was."""
        call, mine = self._call, self._mine_mv
        if call is not None and mine[2] <= IN_OP:
            self._call = (call[0], (mine[0], mine[1], mine[2]))
            mine[0] = call[0]
            mine[1] = -1
            mine[2] = IN_CALL

    def not_coming(self, seq: int, call: bool) -> list[PeerState]:
        """Node-local ranks that cannot join this rank's wait for operation ``seq`` (with ``call``:
        for the call it is in, made after operation ``seq``) while it waits: inside a call that
        this rank has not made, made before that operation (they call it only after the call
        returns, which needs this rank), or closing the communicator without having called it."""
        calls = self.calls
        return [p for p in self.peers()
                if (p.state == IN_CALL and not call and p.seq < seq and p.calls > calls)
                or (p.state in (CLOSING, LEFT) and (p.calls < calls if call else p.seq < seq))]

    def in_calls_not_made(self) -> list[PeerState]:
        """Node-local ranks inside a blocking call every rank must make that this rank has not made."""
        return [p for p in self.peers() if p.state == IN_CALL and p.calls > self.calls]

    def rejected(self, seq: int) -> list[PeerState]:
        """Peers that rejected their input to operation ``seq``, or to an earlier one that this rank
        did not reject: this rank called it with valid input and went on (a root's broadcast ends
        without its peers), so their verdict on it is an abort and they will not call ``seq``."""
        mine = self._mine_mv[4]
        return [p for p in self.peers() if p.state == REJECTED and (
            p.seq == seq or (p.seq < seq and self._rejected_apart(p, mine)))]

    @staticmethod
    def _rejected_apart(p: PeerState, mine: int) -> bool:
        """``p`` shows a rejection (REJECTED) of an operation this rank did not reject (its last
        rejected with nothing in flight is ``mine``).  Not a slot caught mid-write of the rejection
        this rank made too: :meth:`reject` writes the rejected seq first, the slot's seq and state
        after, so a peer descheduled between the writes shows its earlier rejection's seq for a
        moment (an alike rejection read as apart: a close freed nothing while a peer freed)."""
        return p.seq != mine and not (mine and p.rejected == mine)

    def rejected_alike(self, seq: int) -> tuple[bool | None, PeerState | None]:
        """After this rank rejected its input to operation ``seq`` with nothing in flight: whether
        every node-local peer rejected it too (``True``); not (``False``, with a peer that called it
        with valid input, aborted, or will not call it); or not known yet (``None``, with a peer
        that has not reached it).  Both answers rest on what cannot change back, so ranks that
        answer answer alike.

        A peer whose last rejection with nothing in flight (:meth:`reject`) is ``seq`` or later
        rejected ``seq``: had it called ``seq``, that operation would still be pending.  A peer
        that has reached ``seq`` otherwise called it (its board shows the seq, even with the
        operation still queued, once it posts or is in a call)."""
        me, later = self.members[self.node.rank], None
        for p in self.peers():
            if p.rank == me or (p.rejected >= seq and p.state != ABORTED):
                continue
            if p.state == ABORTED or p.seq >= seq or p.state in (CLOSING, LEFT) or (
                    p.state == IN_CALL and p.calls > self.calls):
                return False, p
            later = p
        return (None, later) if later is not None else (True, None)

    def ended(self) -> list[tuple[PeerState, int]]:
        """Node-local peers whose process ended without closing the communicator (killed, crashed,
        ``os._exit``), with their process ids; asked at most every :data:`ALIVE_EVERY_S` (else
        none), and only where the peers' process ids were seen running when the board was made."""
        now = time.monotonic()
        if not self._watch or now - self._alive_checked < ALIVE_EVERY_S:
            return []
        self._alive_checked = now
        dead = [i for i, pid in enumerate(self._pids) if i != self.node.rank and not _running(pid)]
        if not dead:
            return []
        peers = self.peers()
        return [(peers[i], self._pids[i]) for i in dead if peers[i].state not in (CLOSING, LEFT)]

    def aborted(self) -> list[PeerState]:
        """Peers whose communicator was aborted (they will not call again)."""
        return [p for p in self.peers() if p.state == ABORTED]

    def gone(self) -> list[PeerState]:
        """Peers that will free nothing of the communicator (aborted, or left it)."""
        return [p for p in self.peers() if p.state in (ABORTED, LEFT)]

    def wait_to_free(self, timeout: float = 0.0) -> list[PeerState]:
        """This rank closes (its slot shows it): wait until every node-local peer closes too, and
        return none, or return those that will free nothing (the frees are collective): aborted,
        left, or showing a rejection of an operation this rank did not reject (a root's broadcast
        ends without its peers: the rejecting rank's verdict at its close is an abort, and its
        slot keeps the rejection).  Waits as the collective frees would (peers close in turn), for
        ``timeout`` seconds at most (0: no limit): then the peers not closing are returned too."""
        me, mine, nap = self.members[self.node.rank], self._mine_mv[4], 2e-5
        until = time.monotonic() + timeout if timeout > 0 else math.inf
        while True:
            peers = [p for p in self.peers() if p.rank != me]
            gone = [p for p in peers if p.state in (ABORTED, LEFT)
                    or (p.state == REJECTED and self._rejected_apart(p, mine))]
            if gone or all(p.state == CLOSING for p in peers):
                return gone
            if time.monotonic() > until:
                return [p for p in peers if p.state != CLOSING]
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def who_waits(self, name: str, seq: int, size: int, parent: Board | None = None
                  ) -> tuple[list[int], list[int], list[int], str]:
        """For operation ``seq``: the ranks waiting in it, the node-local ranks not in it, the
        ranks on other nodes, and a sentence saying so (what each missing rank is doing; with
        ``parent``, the board of the communicator this one was split from with the same ranks,
        what a missing one does there too: it read "has not called any operation" here when it
        waited in the parent)."""
        peers = {p.rank: p for p in self.peers()}
        waiting = sorted(r for r, p in peers.items()
                         if (p.seq == seq and p.op == name and p.state in (IN_OP, ABORTED))
                         or (p.state == IN_CALL and p.reason == name))
        missing = [r for r in range(size) if r in peers and r not in waiting]
        unknown = [r for r in range(size) if r not in peers]
        text = f"ranks {waiting} are waiting in it"
        if missing:
            text += "; not arrived: " + ", ".join(peers[r].describe() for r in missing)
            there = {p.rank: p for p in parent.peers()} if parent is not None else {}
            busy = [there[r].describe() for r in missing if r in there and there[r].state != IDLE]
            if busy:
                text += " (on the communicator this one was split from: " + ", ".join(busy) + ")"
        if unknown:
            text += f"; ranks {unknown} are on other nodes (state unknown)"
        return waiting, missing, unknown, text

    def timeout_error(self, name: str, seq: int, timeout: float, rank: int, size: int,
                      limit: str = "COMMLIB_TIMEOUT sets the limit", parent: Board | None = None
                      ) -> CommTimeoutError:
        """The error for operation ``seq`` timing out on ``rank``: who waits, who is elsewhere
        (``limit``: what set the time it gave up at; ``parent``: see :meth:`who_waits`)."""
        waiting, missing, unknown, text = self.who_waits(name, seq, size, parent)
        msg = (f"{name} #{seq} timed out after {timeout:g} s on rank {rank}: {text} "
               f"({limit}; COMMLIB_CHECK=1 catches mismatched calls)")
        return CommTimeoutError(msg, name, seq, waiting, missing if not unknown else None)

    def free(self) -> None:
        try:
            self.win.Free()
            self.node.Free()
        except Exception:  # noqa: BLE001 - freeing at shutdown must not raise
            pass
