"""Progress for passive-target one-sided traffic: who makes MPI move bytes when the target computes.

MPICH over ofi/tcp completes a passive-target accumulate only when the
target calls into MPI; :class:`Pump` is a daemon thread that pokes MPI
(``Iprobe``) every ``interval_s`` while a store is asynchronous, and
:func:`resolve_progress` picks the mechanism (``auto``: MPICH's own
progress thread when ``MPIR_CVAR_ASYNC_PROGRESS`` is set, none when all ranks
share memory, else the pump).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from mpi4py import MPI

from commlib import ValidationError

PROGRESS_MODES = ("auto", "thread", "mpich", "none")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def resolve_progress(progress: str, mpi_comm: Any) -> str:
    if progress not in PROGRESS_MODES:
        raise ValidationError(f"progress {progress!r}: expected one of {PROGRESS_MODES}")
    if progress != "auto":
        return progress
    if _truthy("MPIR_CVAR_ASYNC_PROGRESS"):
        return "mpich"
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    all_local = local.size == mpi_comm.size
    local.Free()
    # the same answer on every rank: a collective decision
    all_local = bool(mpi_comm.allreduce(int(all_local and not _truthy("MPIR_CVAR_NOLOCAL")), op=MPI.MIN))
    return "none" if all_local else "thread"


class Pump(threading.Thread):
    """Calls ``MPI_Iprobe`` every ``interval`` seconds so that this rank serves one-sided traffic."""

    def __init__(self, mpi_comm: Any, interval: float, name: str):
        super().__init__(name=name, daemon=True)
        self._comm = mpi_comm
        self._interval = interval
        self._halt = threading.Event()
        self.polls = 0

    def run(self) -> None:
        iprobe, src, tag = self._comm.Iprobe, MPI.ANY_SOURCE, MPI.ANY_TAG
        wait = self._halt.wait
        while not self._halt.is_set():
            iprobe(src, tag)
            self.polls += 1
            wait(self._interval)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()
