"""Communicators split from another for one purpose, one per (communicator, purpose).

Traffic that must not queue behind a communicator's nonblocking operations
(DeAR's all-gathers in flight while the next forward runs) goes over a
communicator of its own: ``SyncBatchNorm``'s statistics, the per-batch census of
``stop_together`` and ``join``.  Each is split once, the first time it is asked for (a
collective: every rank asks at the same point), shared by every caller with the
same purpose, and closed with its parent.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["side_comm"]

_SIDES: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def side_comm(comm: Any, purpose: str) -> Any:
    """``comm``'s side communicator for ``purpose`` (collective the first time on every rank).

    Example:
        >>> stats = side_comm(comm, "syncbn")      # the same object on every later call
    """
    sides = _SIDES.setdefault(comm, {})
    side = sides.get(purpose)
    if side is None:
        side = sides[purpose] = comm.split(0)
        comm.close_with(side)
    return side
