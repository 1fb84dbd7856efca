"""Errors raised by commlib.

Every error that concerns a collective names the operation, its sequence
number on the communicator, and the ranks involved, so that a failure in a
job of many ranks can be traced to its cause from any one rank's log.
"""

from __future__ import annotations

from collections.abc import Sequence


class CommlibError(RuntimeError):
    """Base class of every error commlib raises on its own account."""


class ValidationError(CommlibError, ValueError):
    """An input was rejected before any rank entered the collective.

    Example:
        >>> raise ValidationError("allreduce: dtype complex64 is not supported")
        Traceback (most recent call last):
        ...
        commlib.errors.ValidationError: allreduce: dtype complex64 is not supported
    """

    #: raised alike on every rank by check mode's agreement on a call (nothing left to tell the peers)
    agreed: bool = False


class MismatchError(CommlibError):
    """Ranks called different operations, shapes or dtypes at the same step.

    Raised on every rank when ``COMMLIB_CHECK=1``; ``ranks`` lists the ranks
    whose call differs from rank 0's (or the ranks whose input failed local
    validation).  Also raised, at once, by a rank waiting for an operation
    that the peers in ``ranks`` will call only after a blocking call that
    every rank must make (``Communicator.allgather_object``, e.g. inside
    ``DistributedOptimizer.state_dict()``), and by ranks calling
    ``allgather_object`` with different labels.
    """

    def __init__(self, message: str, op: str, seq: int, ranks: Sequence[int]):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.ranks = list(ranks)


class CommTimeoutError(CommlibError, TimeoutError):
    """A collective did not complete within the communicator's timeout.

    ``waiting`` holds the ranks known to be inside this operation and
    ``missing`` the ranks known not to have entered it (``None`` where
    commlib could not observe them, e.g. ranks on other nodes).  After a
    timeout the communicator is unusable: it may hold an unfinished
    operation, so every later call raises :class:`CommAbortedError`.
    """

    def __init__(self, message: str, op: str, seq: int,
                 waiting: Sequence[int] | None, missing: Sequence[int] | None):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.waiting = None if waiting is None else list(waiting)
        self.missing = None if missing is None else list(missing)


class CommStallWarning(UserWarning):
    """An operation has waited ``stall_warning`` seconds (``COMMLIB_STALL_WARNING``) for its
    peers: it names who waits and what the missing ranks are doing, once per operation, and
    the operation goes on until it completes or the timeout ends it.

    Example:
        >>> import warnings
        >>> warnings.simplefilter("error", CommStallWarning)    # give up there, as on a timeout
    """


class CommAbortedError(CommlibError):
    """The communicator was aborted (after a timeout, a peer's failure or abort())."""
