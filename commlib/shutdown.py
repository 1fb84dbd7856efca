"""At interpreter exit: close every communicator, or end the job when an operation is left dangling.

Importing this module registers the hook; mpi4py is imported first, so the
hook runs before mpi4py's ``MPI_Finalize`` (exit hooks run in reverse order).
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpi4py import MPI  # before our exit hook is registered, so that MPI finalizes after it

if TYPE_CHECKING:
    from .runner import Runner

#: every communicator made, oldest first, with its runner (which outlives a communicator
#: dropped unclosed while its engine thread still waits): closed in reverse order at exit
_OPEN: list[tuple[weakref.ref, Runner]] = []


def _close_all() -> None:
    """At exit: close every communicator; end the job if an operation is left dangling.

    An operation given up after a timeout or a peer's failure stays posted in
    MPI (collectives cannot be cancelled), and finalizing over it hangs: the
    job is ended with ``MPI_Abort`` instead, so every rank exits (non-zero).
    """
    if MPI.Is_finalized():       # the program called MPI.Finalize() itself: nothing can be freed now
        _OPEN.clear()
        return
    # an operation already given up: a peer may be stuck in it, and the collective frees of
    # the other communicators could wait for that peer forever, so end the job first
    dangling = [label for _, run in _OPEN for label in run.unfinished()]
    for ref, run in _OPEN if not dangling else []:      # every one shown closing, then each closed
        comm = ref()
        if comm is not None:
            run.ending(comm.seq)
    for ref, run in reversed(_OPEN if not dangling else []):
        comm = ref()
        try:
            if comm is not None:
                comm.close()
            else:   # dropped without close(): only its engine can still hold an operation
                run.close_engine()
                run.left("dropped without close() on this rank")
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        dangling += run.unfinished()
        if dangling:
            break
    _OPEN.clear()
    if dangling:
        print(f"commlib: rank {MPI.COMM_WORLD.rank}: ending the job (MPI_Abort): operations left "
              f"unfinished after an error: {', '.join(dangling)}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


#: the exception that ends the program, as :func:`ended_by` tells it (recorded by the excepthook)
_UNCAUGHT: list[str] = []


def _record_uncaught(hook: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(kind: type, value: BaseException, tb: Any) -> Any:
        _UNCAUGHT[:] = [f"{kind.__name__}: {value}"[:150]]
        return hook(kind, value, tb)
    return excepthook


def ended_by() -> str:
    """Why this program ends, for the peers that wait for it (the board's closing reason): the
    uncaught exception that ends it, else its plain end.

    Example:
        >>> ended_by()          # after an uncaught ZeroDivisionError
        'its program ended with ZeroDivisionError: division by zero'
    """
    if _UNCAUGHT:
        return f"its program ended with {_UNCAUGHT[0]}"
    return "its program ended or called close()"


sys.excepthook = _record_uncaught(sys.excepthook)


def at_exit(fn: Callable[[], Any]) -> None:
    """Run ``fn`` at interpreter exit, in this process only: not in a child that ``os.fork()``
    made of it, whose exit (``sys.exit``, the end of its code) runs the inherited exit hooks
    too, and would otherwise close, leave or write what belongs to the parent (its
    communicators shown closed to their peers on the node's board: the job failed).
    ``multiprocessing``'s workers leave through ``os._exit`` and run no hook either way.

    Example:
        >>> at_exit(tracer.write)
    """
    pid = os.getpid()

    def hook() -> None:
        if os.getpid() == pid:
            fn()

    atexit.register(hook)


# registered after mpi4py's own exit hook (imported above us), so it runs before MPI_Finalize
at_exit(_close_all)


def track(comm: Any, run: Runner) -> None:
    """Close ``comm`` (with its :class:`~commlib.runner.Runner` ``run``) at exit, newest first.

    Example (what :class:`~commlib.communicator.Communicator` does when it is made):
        >>> track(self, self._run)
    """
    if not _OPEN:
        _watch_finalize()
    _OPEN.append((weakref.ref(comm), run))


_FINALIZE_KEYVAL: list[int] = []


def _watch_finalize() -> None:
    """Once: an attribute on ``MPI_COMM_SELF``, whose deletion MPI runs first thing in
    ``MPI_Finalize``: a program that calls ``MPI.Finalize()`` itself with communicators open
    (legal in mpi4py) gets them refused, each later call raising ``CommAbortedError``, where its
    next call (or the exit's close) made MPICH end the process ("used after finalizing")."""
    if _FINALIZE_KEYVAL:
        return

    def finalizing(*_: Any) -> int:
        for _ref, run in _OPEN:
            run.finalized()
        return MPI.SUCCESS

    keyval = MPI.Comm.Create_keyval(delete_fn=finalizing)
    MPI.COMM_SELF.Set_attr(keyval, True)
    _FINALIZE_KEYVAL.append(keyval)
