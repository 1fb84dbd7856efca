"""Horovod's process state (``hvd.init``, ``hvd.rank``, ``hvd.local_rank``...) over commlib.

``init()`` takes commlib's world communicator (:func:`commlib.init`), splits off one for
the Horovod engine (:mod:`.engine`), and reads the node-local layout from an MPI
shared-memory split: ``local_*`` counts the ranks of this node, ``cross_*`` the ranks
of equal local rank.

Example (``mpiexec -n 2 python train.py``):
    >>> import commlib.horovod.torch as hvd
    >>> hvd.init(); hvd.rank(), hvd.size(), hvd.local_rank()
    (0, 2, 0)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import commlib
from commlib.shutdown import at_exit

from .engine import Engine

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set", "init",
    "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "add_process_set", "remove_process_set",
]

#: Horovod's reduce ops (the same values as ``horovod.torch``)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
#: the engine's name of each reduce op
OP_NAMES = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}


class ProcessSet:
    """Horovod's process sets: only the global one (all ranks) exists here."""

    def __init__(self, ranks: Any = None):
        if ranks is not None:
            raise NotImplementedError("commlib.horovod supports only the global process set")
        self.process_set_id = 0

    def included(self) -> bool:
        """True: every rank belongs to the global process set."""
        return True

    def size(self) -> int:
        """The number of ranks (:func:`size`)."""
        return size()

    def rank(self) -> int:
        """This process's rank (:func:`rank`)."""
        return rank()


global_process_set = ProcessSet()


class _State:
    def __init__(self, world: commlib.Communicator):
        from mpi4py import MPI

        self.world = world
        self.engine = Engine(world.split(0))
        mc = world.mpi_comm
        local = mc.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
        self.local_rank, self.local_size = local.rank, local.size
        cross = mc.Split(self.local_rank, world.rank)
        self.cross_rank, self.cross_size = cross.rank, cross.size
        self.homogeneous = len(set(mc.allgather(self.local_size))) == 1
        local.Free()
        cross.Free()


_state: _State | None = None
#: guards the handle table and the names of handles not yet synchronized (:mod:`.handles`)
lock = threading.Lock()
handles: dict[int, Any] = {}     # a Request, or a grouped operation's (handles.Group)
names: set[str] = set()         # the names of handles not yet synchronized


def state() -> _State:
    if _state is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state


# ---------------------------------------------------------------------- basics
def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start Horovod on every rank (collective; again after :func:`shutdown`, a no-op otherwise).

    ``comm``: an mpi4py communicator to run on (default ``MPI.COMM_WORLD``);
    ``process_sets`` other than the global one are not supported.

    Example:
        >>> hvd.init()
        >>> hvd.rank(), hvd.size()
        (0, 2)
    """
    global _state
    if process_sets not in (None, [], "dynamic") and process_sets != [global_process_set]:
        raise NotImplementedError("commlib.horovod supports only the global process set")
    if _state is not None:
        return
    if comm is not None and isinstance(comm, (list, tuple)):
        raise NotImplementedError("hvd.init(comm=[ranks...]): pass an mpi4py communicator instead")
    world = commlib.init() if comm is None else commlib.init(comm=comm)
    _state = _State(world)
    at_exit(_at_exit)   # after commlib's own exit hook, so it runs before it


def _at_exit() -> None:
    """At interpreter exit: stop the engine and give up its communicator without freeing it.

    Freeing a communicator is collective; a rank that exits while a peer still waits in
    an engine operation with it (a rank that never called ``join()``, an unmatched
    operation) would block in the free forever.  With every operation complete here the
    rank leaves the communicator (:meth:`commlib.Communicator.leave`): a peer still
    polling the last of them completes it, one waiting for a later one fails at once.
    Otherwise it is aborted, and commlib ends the job (``MPI_Abort``) if an operation was
    left unfinished, so a broken job exits instead of hanging.  Neither frees anything.
    """
    st = _state
    if st is None:
        return
    comm = st.engine.comm
    if not (st.engine.close(timeout=5.0) and comm.leave("process exiting (commlib.horovod)")):
        comm.abort("process exiting (commlib.horovod)")


def shutdown() -> None:
    """Finish queued operations and stop Horovod (collective); :func:`init` starts it again.

    Example:
        >>> hvd.shutdown(); hvd.is_initialized()
        False
    """
    global _state
    if _state is None:
        return
    st, _state = _state, None
    st.engine.close()
    st.engine.comm.close()
    with lock:
        handles.clear()
        names.clear()


def is_initialized() -> bool:
    """Whether :func:`init` ran (and no :func:`shutdown` since).

    Example:
        >>> hvd.is_initialized()
        True
    """
    return _state is not None


def rank() -> int:
    """This process's rank among all ranks.  Example: ``hvd.rank()`` -> ``0``."""
    return state().world.rank


def size() -> int:
    """The number of ranks.  Example: ``hvd.size()`` -> ``2``."""
    return state().world.size


def local_rank() -> int:
    """This process's rank on its node (shared-memory ranks).

    Example: ``torch.cuda.set_device(hvd.local_rank())``.
    """
    return state().local_rank


def local_size() -> int:
    """The number of ranks on this node.  Example: ``hvd.local_size()`` -> ``2``."""
    return state().local_size


def cross_rank() -> int:
    """The rank among the ranks of equal local rank (the node's index).

    Example: ``hvd.cross_rank()`` -> ``0``.
    """
    return state().cross_rank


def cross_size() -> int:
    """The number of ranks of this local rank (the number of nodes).

    Example: ``hvd.cross_size()`` -> ``1``.
    """
    return state().cross_size


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks.  Example: ``hvd.is_homogeneous()`` -> ``True``."""
    return state().homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (commlib requires it).  Example: ``True``."""
    from mpi4py import MPI

    state()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True: collectives run over MPI (or NCCL through commlib).

    Example: ``hvd.mpi_enabled()`` -> ``True``.
    """
    return True


def mpi_built() -> bool:
    """True: commlib is built on MPI (mpi4py).  Example: ``hvd.mpi_built()`` -> ``True``."""
    return True


def gloo_enabled() -> bool:
    """False: there is no Gloo controller.  Example: ``hvd.gloo_enabled()`` -> ``False``."""
    return False


def gloo_built() -> bool:
    """False: there is no Gloo controller.  Example: ``hvd.gloo_built()`` -> ``False``."""
    return False


def nccl_built() -> int:
    """The NCCL version code cupy provides (e.g. ``21805``), or 0 without it.

    Example: ``hvd.nccl_built()``.
    """
    try:
        from cupy.cuda import nccl
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - no cupy, no NCCL
        return 0


def ddl_built() -> bool:
    """False (IBM DDL is not supported).  Example: ``hvd.ddl_built()`` -> ``False``."""
    return False


def ccl_built() -> bool:
    """False (oneCCL is not supported).  Example: ``hvd.ccl_built()`` -> ``False``."""
    return False


def cuda_built() -> bool:
    """Whether this torch has CUDA.  Example: ``hvd.cuda_built()`` -> ``False`` on a CPU build."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """False (ROCm is not supported).  Example: ``hvd.rocm_built()`` -> ``False``."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Not supported: set ``COMMLIB_TIMELINE=path`` before the job starts (a Chrome trace per rank)."""
    raise NotImplementedError("hvd.start_timeline: use COMMLIB_TIMELINE=path (commlib's timeline) instead")


def stop_timeline() -> None:
    """Not supported: see :func:`start_timeline`."""
    raise NotImplementedError("hvd.stop_timeline: use COMMLIB_TIMELINE=path (commlib's timeline) instead")


def add_process_set(process_set: Any) -> ProcessSet:
    """Not supported: only the global process set exists."""
    raise NotImplementedError("commlib.horovod supports only the global process set")


def remove_process_set(process_set: Any) -> bool:
    """Not supported: only the global process set exists."""
    raise NotImplementedError("commlib.horovod supports only the global process set")




def world() -> commlib.Communicator:
    """The commlib communicator of all ranks that Horovod runs on (for commlib calls beside Horovod's).

    Example:
        >>> comm = hvd.basics.world(); comm.allreduce(x, op="avg")
    """
    return state().world


def engine() -> Engine:
    """The engine that runs this process's Horovod operations."""
    return state().engine
