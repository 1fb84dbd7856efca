"""``horovod.torch`` for the shim: commlib.horovod.torch (see ``__init__``)."""

from commlib.horovod.torch import *  # noqa: F401,F403
