"""What installing and importing commlib does (and does not do)."""

from __future__ import annotations

import subprocess
import sys


def test_import_starts_neither_mpi_nor_threads():
    code = ("import sys, threading, commlib, commlib.ops, commlib.work; "
            "assert 'mpi4py.MPI' not in sys.modules, 'import commlib initialized MPI'; "
            "assert threading.active_count() == 1, threading.enumerate(); "
            "assert commlib.Communicator.__name__ == 'Communicator'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

