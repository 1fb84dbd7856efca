"""Whether a wait must be given up: the verdicts a :class:`~commlib.runner.Runner`'s watchdog asks
for while it waits for an operation (or a call) of its communicator.

A wait ends early when this rank's communicator was aborted, when a node-local
peer rejected its input to the operation, aborted the communicator, or will not
come to the operation (it sits in another one; on a side communicator, in a call
on the parent that this rank has not made); else when it has waited the
communicator's ``timeout``.  It warns once (:class:`CommStallWarning`) when it
has waited ``stall_warning`` seconds.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import board as _board
from .errors import CommAbortedError, CommlibError, CommStallWarning, MismatchError, ValidationError
from .ops import OPS

if TYPE_CHECKING:
    from .runner import Runner

#: how long a wait goes on once every aborted peer aborted after a later operation (it passed this
#: one: its part is done); a peer that aborts by hand may leave earlier operations posted
PASSED_ABORT_GRACE_S = 2.0


class WaitVerdicts:
    """The verdicts half of a :class:`~commlib.runner.Runner` (see module docs): it reads the
    runner's rank, size, board, parent, abort, timeout and stall warning.

    Example (the watchdog of a wait, every ``CHECK_EVERY_S``):
        >>> err = runner.verdict(seq, "allreduce", waited)     # None: wait on
    """

    rank: int
    size: int
    board: _board.Board
    parent: Runner | None
    aborted: BaseException | None
    timeout: float
    stall_warning: float
    #: the last wait warned about: an operation's sequence number, or a call's (seq, calls made)
    _stall_warned: int | tuple[int, int] | None = None
    #: (seq, when) this rank's wait for operation seq first saw peers aborted after later ones
    _passed_abort: tuple[int, float] | None = None

    def verdict(self, seq: int, name: str, waited: float, rejections: bool = True) -> CommlibError | None:
        """Whether a wait for operation ``seq``, ``waited`` seconds so far, must be given up
        (the watchdog asks); warns once when it has waited ``stall_warning`` seconds."""
        if self.aborted is not None:
            return CommAbortedError(f"{name} #{seq}: communicator aborted: {self.aborted}")
        if not self.board.quiet():
            err = self._peer_verdict(seq, name, rejections)
            if err is not None:
                return err
        parent = self.parent
        if parent is not None and not parent.board.quiet():
            err = self._parent_verdict(parent, seq, name)
            if err is not None:
                return err
        ended = self.board.ended()
        if ended:
            return CommAbortedError(f"{name} #{seq}: " + "; ".join(
                f"rank {p.rank}'s process (pid {pid}) ended without closing the communicator (killed, "
                "crashed or os._exit()); it will not call again" for p, pid in ended))
        related = parent.board if parent is not None else None
        if self.timeout > 0 and waited >= self.timeout:
            return self.board.timeout_error(name, seq, self.timeout, self.rank, self.size, parent=related)
        if not self.warn_stall(seq if name in OPS else (seq, self.board.calls), waited, lambda: (
                f"{name} #{seq} has waited {waited:.3g} s on rank {self.rank}: "
                f"{self.board.who_waits(name, seq, self.size, related)[3]}; it goes on ("
                + (f"CommTimeoutError after {self.timeout:g} s" if self.timeout > 0 else "no timeout")
                + "; COMMLIB_STALL_WARNING sets this warning)")):
            return self.board.timeout_error(
                name, seq, self.stall_warning, self.rank, self.size,
                "a warnings filter made the CommStallWarning an error, so the wait ends at "
                f"COMMLIB_STALL_WARNING's {self.stall_warning:g} s; COMMLIB_TIMEOUT is {self.timeout:g} s",
                parent=related)
        return None

    def warn_stall(self, key: int | tuple[int, int], waited: float, message: Callable[[], str]) -> bool:
        """Warn once for the wait ``key`` (an operation's sequence number, or a call's: the last
        operation's and the calls made, :attr:`Board.calls`) when it has waited ``stall_warning``
        seconds (``message()`` is built only then); False when a warnings filter made the warning an
        error: the wait is then given up as on a timeout."""
        if not 0 < self.stall_warning <= waited or self._stall_warned == key:
            return True
        self._stall_warned = key
        try:    # explicit: no commlib source line under the message
            warnings.warn_explicit(message(), CommStallWarning, "commlib", 0, module="commlib")
        except CommStallWarning:
            return False
        return True

    def _peer_verdict(self, seq: int, name: str, rejections: bool) -> CommlibError | None:
        """:meth:`verdict` where a node-local rank is past plain waiting (the board is not quiet)."""
        rejected = self.board.rejected(seq) if rejections else []
        if rejected:
            return ValidationError(f"{name} #{seq}: " + "; ".join(
                f"rank {r.rank} rejected its input: {r.reason}" if r.seq == seq else
                f"rank {r.rank} rejected its input to {r.op} #{r.seq}, which this rank called with valid "
                f"input and left (it ended here without that rank), so that rank will not call {name} "
                f"#{seq}: {r.reason}" for r in rejected))
        # a peer that gave up on this same operation (its own timeout) is a
        # fellow waiter: this rank's own timeout will follow
        aborted = [r for r in self.board.aborted() if (r.seq, r.op) != (seq, name)]
        if aborted and all(r.seq > seq and (name in OPS or r.calls >= self.board.calls) for r in aborted) \
                and self._passed_abort_grace(seq):
            aborted = []
        if aborted:
            return CommAbortedError(f"{name} #{seq}: " + "; ".join(
                f"rank {r.rank} aborted the communicator after #{r.seq}: {r.reason}"
                for r in aborted))
        absent = self.board.not_coming(seq, call=name not in OPS)
        return self._not_coming_error(name, seq, absent, "") if absent else None

    def _passed_abort_grace(self, seq: int) -> bool:
        """Whether the wait for operation ``seq`` goes on though peers aborted, all after later
        operations (and, waiting in a call, after making it): they passed this one, so their part
        of it is done and it completes here
        (seen at 4 ranks on 2 cores: the root of a broadcast still polling barrier #1, which its
        peers had left, when one of them aborted in broadcast #2); given up after
        :data:`PASSED_ABORT_GRACE_S` (a peer aborted by hand may have left it posted)."""
        now = time.monotonic()
        if self._passed_abort is None or self._passed_abort[0] != seq:
            self._passed_abort = (seq, now)
        return now - self._passed_abort[1] < PASSED_ABORT_GRACE_S

    def _not_coming_error(self, name: str, seq: int, absent: list[_board.PeerState],
                          where: str) -> MismatchError:
        """The wait for operation ``seq`` cannot end: ``absent`` will not call it (``where``: on
        which communicator they sit, when not this one)."""
        return MismatchError(f"{name} #{seq} on rank {self.rank} waits for ranks that will not call it: "
                             + "; ".join(p.describe() for p in absent) + where + " (every rank must make "
                             "the same calls in the same order)", name, seq, [p.rank for p in absent])

    def _parent_verdict(self, parent: Runner, seq: int, name: str) -> CommlibError | None:
        """A side communicator's wait: peers that have not come to operation ``seq`` and sit in a
        blocking call on the parent that this rank has not made (the Horovod checkpoint with
        SyncBatchNorm: rank 0 in ``opt.state_dict()``, the others in the next forward's
        statistics) will not come before this rank makes that call, which it cannot while here.
        The parent is aborted too, so that those peers' wait there ends at once as well."""
        late = {p.rank for p in self.board.peers() if p.seq < seq}
        absent = [p for p in parent.board.in_calls_not_made() if p.rank in late]
        if not absent:
            return None
        err = self._not_coming_error(name, seq, absent, " on the communicator this one was split from")
        if parent.aborted is None:
            parent.mark_aborted(err, "?", parent.posted)
        return err
