"""Test fixture: ``import horovod.torch`` resolves to :mod:`commlib.horovod.torch`.

Lets Horovod's own test suite and examples run unmodified against commlib (nothing
of Horovod is kept in this repository; fetch its files elsewhere).  Horovod
v0.28.1's ``test/parallel/test_torch.py`` in /tmp/hvdcheck with a small
``common.py`` beside it (``mpi_env_rank_and_size``, ``skip_or_fail_gpu_test``,
``temppath``), run from that folder::

    cd /tmp/hvdcheck && PYTHONPATH=/work/main/tests/horovod_shim:/tmp/hvdcheck \\
        /work/main/.venv/bin/mpiexec -n 2 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider \\
        --timeout 300 test_torch.py

and ``examples/pytorch/pytorch_synthetic_benchmark.py`` the same way
(``mpiexec -n 2 python pytorch_synthetic_benchmark.py --num-iters 2 ...``).
"""

import sys

import commlib.horovod.torch as torch  # noqa: F401 - ``horovod.torch`` is commlib's

sys.modules[__name__ + ".torch"] = torch
