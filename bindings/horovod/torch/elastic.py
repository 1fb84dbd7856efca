"""Horovod's ``hvd.elastic`` (elastic training: ranks joining and leaving a running job): not
supported; every name of it raises :class:`NotImplementedError` where it is used, so that a script
written for it stops at once with the reason, not at an attribute lookup.

Example:
    >>> import commlib.horovod.torch as hvd
    >>> hvd.elastic.run          # doctest: +SKIP
    NotImplementedError: hvd.elastic.run: elastic training is not supported by commlib ...
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):           # the import machinery's probes (__path__, __spec__, ...)
        raise AttributeError(name)
    raise NotImplementedError(f"hvd.elastic.{name}: elastic training is not supported by commlib "
                              "(a job keeps its ranks from init() to the end; restart it from a "
                              "checkpoint to change them)")
