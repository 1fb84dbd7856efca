"""GPU paths: MPI with device buffers staged through host memory, and NCCL with one rank.

Skipped with a reason where no CUDA device with cupy is present; run them on
a GPU machine with ``pytest --with-mpi tests/test_gpu.py`` (NCCL refuses two
ranks on one GPU, so multi-rank NCCL needs a multi-GPU machine).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import commlib

from conftest import HAVE_GPU, NO_GPU_REASON, SIZES, all_inputs, assert_close, rank_input, reference

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]


def _to_device(x: np.ndarray):
    import cupy

    if x.dtype.name == "bfloat16":
        return cupy.asarray(x.view(np.uint16))  # cupy has no bfloat16: callers pass torch for it
    return cupy.asarray(x)


def _run_all_ops(comm, dtype):
    import cupy

    for n in SIZES:
        x = rank_input(comm.rank, n, dtype)
        got = comm.allreduce(_to_device(x))
        assert isinstance(got, cupy.ndarray)
        assert_close(cupy.asnumpy(got), reference("sum", all_inputs(comm.size, n, dtype)), dtype)
        full = reference("max", all_inputs(comm.size, n, dtype))
        rs = comm.reduce_scatter(_to_device(x), op="max")
        assert_close(cupy.asnumpy(rs), np.array_split(full, comm.size)[comm.rank], dtype)
        ag = comm.iallgather(_to_device(x)).wait()
        assert_close(cupy.asnumpy(ag).reshape(comm.size, n), all_inputs(comm.size, n, dtype), dtype)
        agv = comm.allgatherv(_to_device(x))
        assert_close(cupy.asnumpy(agv), all_inputs(comm.size, n, dtype).ravel(), dtype)
        b = _to_device(x)
        comm.broadcast(b, root=0)
        assert_close(cupy.asnumpy(b), all_inputs(comm.size, n, dtype)[0], dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bfloat16"])
def test_mpi_backend_stages_device_buffers(dtype):
    c = commlib.init(comm=MPI.COMM_WORLD, backend="mpi", cuda_aware=False)
    _run_all_ops(c, dtype)
    c.close()


@pytest.mark.mpi(min_size=1, max_size=1)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "bfloat16"])
def test_nccl_backend_single_rank(dtype):
    c = commlib.init(comm=MPI.COMM_SELF, backend="nccl")
    assert c.backend == "nccl"
    _run_all_ops(c, dtype)
    c.close()


@pytest.mark.mpi(min_size=1, max_size=1)
def test_nccl_orders_after_the_callers_stream_and_rejects_host_arrays():
    import cupy

    c = commlib.init(comm=MPI.COMM_SELF, backend="nccl")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.zeros(1 << 22, cupy.float32)
        x += 3.0  # queued on s; the allreduce must see it
        got = c.allreduce(x, op="avg")
        assert float(got[-1]) == 3.0
    with pytest.raises(commlib.ValidationError, match="on the GPU"):
        c.allreduce(np.ones(3, np.float32))
    c.close()


@pytest.mark.mpi(min_size=1, max_size=1)
def test_torch_cuda_bfloat16_through_nccl():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch was built without CUDA here")
    c = commlib.init(comm=MPI.COMM_SELF, backend="nccl")
    x = torch.arange(10, dtype=torch.bfloat16, device="cuda")
    got = c.allreduce(x)
    assert got.dtype == torch.bfloat16 and got.device.type == "cuda"
    assert torch.equal(got.cpu(), x.cpu())
    c.close()
