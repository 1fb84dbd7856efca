"""GPU paths: MPI with device buffers staged through host memory, and NCCL with one rank.

Skipped with a reason where no CUDA device with cupy is present; run them on
a GPU machine with ``pytest --with-mpi tests/test_gpu.py`` and under
``mpiexec -n 2`` (``.ci/gpu`` does both on a lent GPU machine).  NCCL refuses
two ranks on one GPU, so multi-rank NCCL needs a multi-GPU machine; ranks
sharing one GPU take the MPI backend (``backend="auto"``).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import commlib

from conftest import HAVE_GPU, NO_GPU_REASON, SIZES, SMALL, all_inputs, assert_close, rank_input, reference

pytestmark = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "complex64", "complex128"]


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
        rop = "sum" if dtype.startswith("complex") else "max"     # NCCL: complex as real pairs, summed
        full = reference(rop, all_inputs(comm.size, n, dtype))
        rs = comm.reduce_scatter(_to_device(x), op=rop)
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


def _slow_fill(x, value: float, rounds: int = 40) -> None:
    """Write ``value`` into ``x`` on the current stream, late: after ``rounds`` passes of busy work."""
    import cupy

    for _ in range(rounds):
        x *= cupy.float32(1.0000001)
    x[...] = value


@pytest.mark.mpi(min_size=1, max_size=1)
def test_nccl_orders_after_the_callers_stream_and_routes_host_arrays_over_mpi():
    import cupy

    c = commlib.init(comm=MPI.COMM_SELF, backend="nccl")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.zeros(1 << 22, cupy.float32)
        x += 3.0  # queued on s; the allreduce must see it
        got = c.allreduce(x, op="avg")
        assert float(got[-1]) == 3.0
    host = c.allreduce(np.arange(3, dtype=np.float32))      # numpy on NCCL: over MPI, as torch's gloo
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, np.arange(3, dtype=np.float32))
    c.barrier()
    c.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_queued_operations_follow_the_callers_stream(backend):
    """Nonblocking operations queued behind each other start on the engine thread, whose
    current stream is not the caller's: each must still read what the caller's (non-default)
    stream wrote before the call, and hand its result back in that stream's order."""
    import cupy

    if backend == "nccl" and MPI.COMM_WORLD.size > 1:
        pytest.skip("NCCL refuses two ranks on one GPU")
    world = MPI.COMM_WORLD if backend == "mpi" else MPI.COMM_SELF
    c = commlib.init(comm=world, backend=backend, cuda_aware=False, timeout=120)
    s = cupy.cuda.Stream(non_blocking=True)
    n = 1 << 20
    with s:
        xs = [cupy.zeros(n, cupy.float32) for _ in range(6)]
        works = []
        for i, x in enumerate(xs):
            _slow_fill(x, float(i + c.rank))      # still running on s when the call is made
            works.append(c.iallreduce(x, op="sum", out=x))
        outs = [w.wait() for w in works]
        for x in outs:
            x += 1.0                               # on s: must come after the result landed
        s.synchronize()
    for i, x in enumerate(outs):
        want = sum(float(i + r) for r in range(c.size)) + 1.0
        assert float(x[0]) == want and float(x[-1]) == want, (i, float(x[0]), float(x[-1]), want)
    c.close()


@pytest.mark.mpi(min_size=1, max_size=1)
def test_nccl_uneven_reduce_scatter_and_broadcast_from_a_stream():
    import cupy

    c = commlib.init(comm=MPI.COMM_SELF, backend="nccl")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        for n in (7, 1009):
            x = cupy.zeros(n, cupy.float64)
            _slow_fill(x, 2.5)
            got = c.ireduce_scatter(x, op="sum").wait()
            np.testing.assert_array_equal(cupy.asnumpy(got), np.full(n, 2.5))
            y = cupy.zeros(n, cupy.float32)
            _slow_fill(y, 4.0)
            b = c.broadcast(y, root=0, out=cupy.empty_like(y))
            np.testing.assert_array_equal(cupy.asnumpy(b), np.full(n, 4.0, np.float32))
    c.close()


@pytest.mark.mpi(min_size=1, max_size=1)
def test_nccl_rejects_an_array_on_another_gpu_before_any_call():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU: no array can live on another GPU than the communicator's")
    c = commlib.init(comm=MPI.COMM_SELF, backend="nccl", device=0)
    with cupy.cuda.Device(1):
        x = cupy.ones(4, cupy.float32)
    with pytest.raises(commlib.ValidationError, match="GPU 1"):
        c.allreduce(x)
    c.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_torch_cuda_training_matches_single_process(strategy, dtype):
    """torch CUDA parameters through DistributedOptimizer (NCCL on one rank; MPI staging through
    the host when ranks share the GPU) against one process training on the concatenated batch.

    The updates are compared (parameters minus their start): float32 to 1e-4 of their norm,
    bfloat16 to 3 % (its rounding differs between a full batch and averaged shards)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch was built without CUDA here")
    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR

    c = commlib.init(comm=MPI.COMM_WORLD, timeout=120)
    dt = getattr(torch, dtype)
    local, steps = 4, 4

    def model_and_opt(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
        m = m.to(device="cuda", dtype=dt)
        return m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)

    def data(step):
        g = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(local * c.size, 16, generator=g), torch.randn(local * c.size, 8, generator=g)
        return x.to("cuda", dt), y.to("cuda", dt)

    ref, ref_opt = model_and_opt(0)
    start = [p.detach().float().clone() for p in ref.parameters()]
    for step in range(steps):
        x, y = data(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    model, base = model_and_opt(c.rank)          # rank 0's start is the reference's
    strat = AllReduce(**SMALL) if strategy == "allreduce" else DeAR(**SMALL)
    opt = DistributedOptimizer(base, model, strategy=strat, comm=c)
    assert len(opt.buckets) >= 2
    for step in range(steps):
        x, y = data(step)
        mine = slice(c.rank * local, (c.rank + 1) * local)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    opt.flush()
    tol = 1e-4 if dtype == "float32" else 3e-2
    for i, (p, q, p0) in enumerate(zip(model.parameters(), ref.parameters(), start)):
        assert p.device.type == "cuda" and p.dtype == dt
        d, r = p.detach().float() - p0, q.detach().float() - p0
        err = float(torch.linalg.vector_norm(d - r) / torch.linalg.vector_norm(r))
        assert err < tol, (i, err)
    vec = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu().numpy()
    table = c.allgather(vec)
    for r in range(c.size):
        np.testing.assert_array_equal(table[r], table[0])
    c.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_jax_gpu_arrays_in_and_out(ranks, tmp_path):
    """JAX arrays on the GPU (``tests/jobs/jax_gpu.py``, in fresh processes with jax on the GPU:
    the JAX binding's test modules pin it to the CPU): one rank over NCCL, two over MPI.  Not an
    ``mpi`` test: it launches its own jobs."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    job = os.path.join(here, "jobs", "jax_gpu.py")
    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, job, str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    ok = sorted(name for name in os.listdir(tmp_path) if name.startswith("ok."))
    assert proc.returncode == 0 and len(ok) == ranks, proc.stdout + proc.stderr


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


@pytest.mark.mpi(min_size=1, max_size=1)
def test_gpu_benchmark_quick_run():
    """``benchmarks.gpu --quick`` runs every part; its selection is the host rule's selection."""
    from benchmarks import gpu

    doc = gpu.run(gpu.parse_args(["--quick"]))      # on every rank (only rank 0 would write --json)
    assert "ExDyna choose + take" in gpu.report(doc)
    assert doc["copy"]["bytes_per_s"] > 0
    assert {r["op"] for r in doc["collectives"]} == set(gpu.OPS)
    assert all(r["commlib_us"] > 0 and r["raw_us"] > 0 for r in doc["collectives"])
    sel = doc["selection"]
    assert sel["matches_host"], sel
    assert 0 < sel["selected"] <= sel["k"], sel
