"""Horovod's PyTorch API over commlib: change one import line.

    import horovod.torch as hvd          ->    import commlib.horovod.torch as hvd

Everything a Horovod training script calls is here: ``init``, ``rank``/``size``/
``local_rank``..., the collectives (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter``, their ``_async`` and in-place forms, ``poll``,
``synchronize``, ``join``, ``barrier``), ``broadcast_parameters``,
``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object``,
``Compression``, ``SyncBatchNorm`` and ``DistributedOptimizer`` (plus ``strategy=``/``model=``
for commlib's DeAR, ExDyna, SelSync and Sync-Switch).  Not supported: process sets
other than the global one, Adasum, elastic training, the timeline
API (use ``COMMLIB_TIMELINE``).  Operations run in the order each rank submits them.

Example (``mpiexec -n 2 python train.py``):
    >>> import torch, commlib.horovod.torch as hvd
    >>> hvd.init()
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size()),
    ...                                named_parameters=model.named_parameters())
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
"""

from . import elastic
from .basics import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .compression import Compression
from .engine import HorovodInternalError
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .handles import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    reducescatter_async,
    synchronize,
)
from .mpi_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allreduce,
    grouped_allreduce_,
    join,
    reducescatter,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "elastic",
    "Adasum", "Average", "Max", "Min", "Product", "ProcessSet", "Sum", "Compression", "HorovodInternalError",
    "DistributedOptimizer", "SyncBatchNorm", "add_process_set", "remove_process_set", "global_process_set",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
    "stop_timeline", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "poll", "synchronize", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
]
