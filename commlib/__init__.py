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

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .arrays import DTYPES
from .backends.base import REDUCE_OPS, split_counts
from .config import Config
from .errors import (
    CommAbortedError,
    CommlibError,
    CommStallWarning,
    CommTimeoutError,
    MismatchError,
    ValidationError,
)
from .ops import OPS
from .tracing import timeline_problem
from .work import Work

#: set by MPI launchers in every rank's environment (MPICH/Intel MPI, PMIx, Open MPI, MVAPICH)
_LAUNCHER_VARS = ("PMI_RANK", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def _child_of_rank() -> bool:
    """This process was started by multiprocessing from an MPI rank: a DataLoader worker, a Pool.

    Importing commlib there (the user's script is imported again under spawn or forkserver, or a
    pickled object's module) imports mpi4py.MPI, whose default initialization joined the job as
    the rank's twin through the inherited launcher variables and aborted it.  While a spawned
    child imports and unpickles it has no parent process yet, only ``_inheriting`` (set by
    CPython's spawn and forkserver for that time)."""
    started = (multiprocessing.parent_process() is not None
               or getattr(multiprocessing.current_process(), "_inheriting", False))
    return bool(started) and any(v in os.environ for v in _LAUNCHER_VARS)


if _child_of_rank():     # MPI is left alone there (none of the imports above imports mpi4py.MPI)
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = [
    "init", "world", "as_communicator", "Communicator", "Work", "Config", "split_counts", "DTYPES", "OPS",
    "REDUCE_OPS", "CommlibError", "ValidationError", "MismatchError", "CommTimeoutError",
    "CommAbortedError", "CommStallWarning",
]
__version__ = "0.1.0"

_world: Communicator | None = None


def __getattr__(name: str) -> Any:
    # importing mpi4py.MPI initializes MPI: ``import commlib`` must not, the first init() does
    if name == "Communicator":
        from .communicator import Communicator
        return Communicator
    raise AttributeError(f"module 'commlib' has no attribute {name!r}")


def _nccl_plan(mpi_comm: Any, backend: str, requested: int | None, gpus: int | None = None,
               current: Callable[[], int] | None = None) -> tuple[str, int | None]:
    """The backend (``auto`` resolved, the same on every rank) and this rank's GPU for NCCL.

    Every rank takes part in the same collectives whatever its cupy does (a
    rank without cupy, a driver or NCCL counts 0 GPUs), so no rank can skip
    what its peers enter.  NCCL fits when every rank sees at least as many
    GPUs as its node runs ranks and its GPU (:func:`commlib.device.choose_device`)
    exists.  ``auto`` then picks NCCL, else MPI; ``nccl`` asked for where it
    does not fit raises :class:`ValidationError` on every rank, before any
    NCCL call.  ``mpi`` needs no collective here.  ``gpus`` (default: what
    cupy sees, :func:`commlib.device.local_gpus`) and ``current`` (default:
    :func:`commlib.device.current_device`) are this rank's facts.

    Example:
        >>> _nccl_plan(MPI.COMM_WORLD, "auto", None, gpus=0)     # no cupy here
        ('mpi', None)
    """
    from mpi4py import MPI

    from .device import choose_device, current_device, local_gpus

    if backend == "mpi":
        return "mpi", None
    gpus = local_gpus() if gpus is None else gpus
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.rank, local.size
    local.Free()
    device, problem = None, None
    if gpus < local_size:
        problem = f"{gpus} GPU(s) with cupy and NCCL for {local_size} rank(s) on its node"
    else:
        device = choose_device(local_rank, gpus, requested, (current or current_device)())
        if not 0 <= device < gpus:
            problem = f"device {device} asked for, but {gpus} GPU(s) seen"
    problems = mpi_comm.allgather(problem)
    if backend == "auto":
        return ("mpi", None) if any(problems) else ("nccl", device)
    bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if bad:
        raise ValidationError("backend 'nccl' needs cupy with NCCL and one GPU per rank of a node ("
                              + "; ".join(bad) + "); use backend='mpi' (device arrays are then "
                              "staged through host memory)")
    return "nccl", device


#: settings every rank must share: each rank acts on them in ways its peers must match
_SHARED_SETTINGS = {"backend": "COMMLIB_BACKEND", "check": "COMMLIB_CHECK"}


def _agree_on_settings(base: Any, cfg: Config | None, mistake: Exception | None,
                       over: Communicator | None = None) -> None:
    """Raise on every rank (one all-gather, before any other collective) where a rank's settings
    were refused (``mistake``), its timeline cannot be written, or the shared settings differ: a
    setting wrong on one node alone would leave its peers waiting in ``init()`` or in the first
    operation.  ``over``: the open communicator of the same ranks (a new world while one is open),
    whose labeled all-gather shows this rank in ``commlib.init()``: a peer in another operation
    raises at once, naming it, where mpi4py's all-gather waited with no timeout."""
    rank = base.rank
    if cfg is None:
        mine = (f"{type(mistake).__name__}: {mistake}", None, None)
    else:
        from mpi4py import MPI
        mine = (timeline_problem(cfg.timeline_path(MPI.COMM_WORLD.rank)), cfg.backend, cfg.check)
    every = base.allgather(mine) if over is None else over.allgather_object(mine, label="commlib.init()")
    refused = [f"rank {r}: {p}" for r, (p, b, _) in enumerate(every) if p and b is None]
    if refused:
        if mistake is not None:
            raise mistake
        raise ValidationError("commlib.init(): settings refused on other ranks (" + "; ".join(refused) + ")")
    timeline = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(every) if p]
    if timeline:
        raise ValidationError("COMMLIB_TIMELINE: " + "; ".join(timeline))
    for i, (name, var) in enumerate(_SHARED_SETTINGS.items(), start=1):
        values = [v[i] for v in every]
        if any(v != values[rank] for v in values):
            raise ValidationError(f"commlib.init(): {var} (keyword {name}) differs across ranks ("
                                  + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                                  + "): set it alike on every rank")


def init(backend: str | None = None, comm: Any = None, **settings: Any) -> Communicator:
    """Create (once) and return the communicator of all ranks.

    ``backend``: ``"auto"`` (NCCL when cupy with NCCL sees one GPU per local
    rank, else MPI), ``"mpi"`` or ``"nccl"``.  With NCCL each rank's GPU is
    ``device`` if given, else the current CUDA device if the user chose one
    (not 0), else the node-local rank; it becomes the current device.  Host
    arrays on an NCCL communicator travel over MPI.  ``comm``: an mpi4py
    communicator to build on (default ``MPI.COMM_WORLD``; it is duplicated,
    never used directly).  ``settings``: keywords of :class:`Config`
    (``timeout``, ``stall_warning``, ``check``, ``timeline``, ``nvtx``, ``cuda_aware``,
    ``poll_spin``, ``device``), each overriding its ``COMMLIB_*`` variable.  Calling ``init()`` again without
    arguments returns the same communicator (a new one once it is closed).

    Example:
        >>> comm = commlib.init(timeout=60, check=True)
        >>> comm.rank, comm.size          # rank 0 of: mpiexec -n 4 python train.py
        (0, 4)
    """
    global _world
    if _child_of_rank():
        raise CommlibError("commlib.init() in a process that multiprocessing started from an MPI rank "
                           "(a DataLoader worker, a Pool): only the rank's own process communicates; "
                           "call commlib.init() under `if __name__ == '__main__':`")
    from mpi4py import MPI

    if (_world is not None and backend is None and comm is None and not settings and not _world.closed
            and not MPI.Is_finalized()):        # (finalized: refused below, as a new world is)
        return _world

    from .communicator import Communicator

    if MPI.Is_finalized():
        raise CommlibError("commlib.init(): MPI is finalized (MPI.Finalize() ran): no communicator can be "
                           "made after it")
    if not MPI.Is_initialized():
        raise CommlibError("commlib.init(): MPI is not initialized (mpi4py.rc.initialize is False): "
                           "call MPI.Init_thread(MPI.THREAD_MULTIPLE) first")
    try:
        cfg, mistake = Config.from_env(backend=backend, **settings), None
    except (TypeError, ValidationError) as e:      # raised after the ranks have heard of it
        cfg, mistake = None, e
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        levels = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                  MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise CommlibError(
            f"MPI was initialized with MPI_THREAD_{levels.get(MPI.Query_thread(), '?')}; commlib "
            "needs MPI_THREAD_MULTIPLE (its progress engine calls MPI from a thread of its own). "
            "Let commlib or mpi4py initialize MPI (mpi4py.rc.thread_level = 'multiple', the "
            "default), or call MPI_Init_thread with MPI_THREAD_MULTIPLE")
    base = MPI.COMM_WORLD if comm is None else comm
    _agree_on_settings(base, cfg, mistake, _world if comm is None and _world is not None
                       and not _world.closed else None)
    name, device = _nccl_plan(base, cfg.backend, cfg.device)
    if name == "nccl":
        import cupy

        cupy.cuda.Device(device).use()   # the caller's CUDA work goes there too (hvd users do it by hand)
        cfg = replace(cfg, device=device)
    result = Communicator(base.Dup(), cfg, name)
    if comm is None:
        _world = result
    return result


def world() -> Communicator:
    """The communicator made by :func:`init` (calls ``init()`` if needed)."""
    return _world if _world is not None else init()


def as_communicator(comm: Any, where: str) -> Communicator:
    """``comm`` as the :class:`Communicator` an API's ``comm=`` takes: ``None`` is :func:`init`'s;
    anything else but a ``Communicator`` raises ``TypeError`` naming ``where``, before any rank
    communicates (an mpi4py communicator, mpi4jax's and Horovod's ``comm=``, was taken for one:
    its pickle-based ``allreduce`` ran, raising on one rank and waiting without limit on others).

    Example:
        >>> comm = commlib.as_communicator(None, "my_op")        # the world
        >>> commlib.as_communicator(MPI.COMM_WORLD, "my_op")     # TypeError: ... commlib.init(comm=...)
    """
    if comm is None:
        return init()
    from .communicator import Communicator

    if isinstance(comm, Communicator):
        return comm
    kind = f"{type(comm).__module__}.{type(comm).__qualname__}"
    hint = (": make one of it with commlib.init(comm=that_communicator) (collective), once, and pass "
            "that" if kind.startswith("mpi4py.") else "")
    raise TypeError(f"{where}: comm= expects a commlib.Communicator, got {kind}{hint}")
