"""commlib: collectives for data-parallel training over MPI and NCCL.

Example (run under ``mpiexec -n 4 python train.py``):

    >>> import numpy as np, commlib
    >>> comm = commlib.init()                       # backend="auto": NCCL on GPUs, else MPI
    >>> grad = np.random.rand(1 << 20).astype(np.float32)
    >>> work = comm.iallreduce(grad, op="avg", out=grad, tag="bucket0")
    >>> ...                                         # compute meanwhile
    >>> work.wait()

Settings come from ``COMMLIB_*`` variables or keywords (see :mod:`commlib.config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .arrays import DTYPES
from .backends.base import REDUCE_OPS, split_counts
from .config import Config
from .errors import CommAbortedError, CommlibError, CommTimeoutError, MismatchError, ValidationError
from .ops import OPS
from .work import Work

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = [
    "init", "world", "Communicator", "Work", "Config", "split_counts", "DTYPES", "OPS",
    "REDUCE_OPS", "CommlibError", "ValidationError", "MismatchError", "CommTimeoutError",
    "CommAbortedError",
]
__version__ = "0.1.0"

_world: Communicator | None = None


def __getattr__(name: str) -> Any:
    # importing mpi4py.MPI initializes MPI: ``import commlib`` must not, the first init() does
    if name == "Communicator":
        from .communicator import Communicator
        return Communicator
    raise AttributeError(f"module 'commlib' has no attribute {name!r}")


def _gpu_ranks_fit(mpi_comm: Any) -> bool:
    """True when cupy with NCCL sees at least one GPU per node-local rank."""
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401
        from mpi4py import MPI

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no cupy, no driver, no NCCL: not a GPU job
        return False
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    fits = n >= local.size
    local.Free()
    return bool(mpi_comm.allreduce(int(fits), op=MPI.MIN))


def init(backend: str | None = None, comm: Any = None, **settings: Any) -> Communicator:
    """Create (once) and return the communicator of all ranks.

    ``backend``: ``"auto"`` (NCCL when cupy with NCCL sees one GPU per local
    rank, else MPI), ``"mpi"`` or ``"nccl"``.  ``comm``: an mpi4py
    communicator to build on (default ``MPI.COMM_WORLD``; it is duplicated,
    never used directly).  ``settings``: keywords of :class:`Config`
    (``timeout``, ``check``, ``timeline``, ``nvtx``, ``cuda_aware``), each
    overriding its ``COMMLIB_*`` variable.  Calling ``init()`` again without
    arguments returns the same communicator.

    Example:
        >>> comm = commlib.init(timeout=60, check=True)
        >>> comm.rank, comm.size
        (0, 4)
    """
    global _world
    if _world is not None and backend is None and comm is None and not settings:
        return _world
    from mpi4py import MPI

    from .communicator import Communicator

    cfg = Config.from_env(backend=backend, **settings)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        levels = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                  MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise CommlibError(
            f"MPI was initialized with MPI_THREAD_{levels.get(MPI.Query_thread(), '?')}; commlib "
            "needs MPI_THREAD_MULTIPLE (its progress engine calls MPI from a thread of its own). "
            "Let commlib or mpi4py initialize MPI (mpi4py.rc.thread_level = 'multiple', the "
            "default), or call MPI_Init_thread with MPI_THREAD_MULTIPLE")
    base = MPI.COMM_WORLD if comm is None else comm
    name = cfg.backend
    if name == "auto":
        name = "nccl" if _gpu_ranks_fit(base) else "mpi"
    result = Communicator(base.Dup(), cfg, name)
    if comm is None:
        _world = result
    return result


def world() -> Communicator:
    """The communicator made by :func:`init` (calls ``init()`` if needed)."""
    return _world if _world is not None else init()
