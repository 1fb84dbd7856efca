"""``hvd.SyncBatchNorm``: commlib's synchronized batch norm over the ranks Horovod runs on.

Horovod's layer reduces over Horovod's communicator: after ``hvd.init(comm=subset)`` (a job
that runs Horovod on part of its ranks) over that subset, not over every rank of the job.
"""

from __future__ import annotations

import commlib
from commlib.bindings.torch_norm import SyncBatchNorm as _SyncBatchNorm

from .basics import is_initialized, world


class SyncBatchNorm(_SyncBatchNorm):
    """:class:`commlib.bindings.torch_norm.SyncBatchNorm` whose communicator, unless one is given,
    is Horovod's (:func:`~commlib.horovod.torch.basics.world`): the ranks ``hvd.init()`` was
    given, as Horovod's layer reduces over them (commlib's own default is every rank of the job).

    Example:
        >>> hvd.init(comm=MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank % 2))
        >>> bn = hvd.SyncBatchNorm(16)      # statistics over this rank's half of the job
    """

    @property
    def comm(self) -> commlib.Communicator | None:
        """The communicator given, else Horovod's once ``hvd.init()`` ran (else commlib's)."""
        given = _SyncBatchNorm.comm.fget(self)
        return given if given is not None or not is_initialized() else world()

    @comm.setter
    def comm(self, comm: commlib.Communicator | None) -> None:
        _SyncBatchNorm.comm.fset(self, comm)
