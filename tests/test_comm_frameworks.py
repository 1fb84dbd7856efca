"""torch tensors and jax arrays in and out, through DLPack, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import HAVE_JAX, HAVE_TORCH, all_inputs, assert_close, rank_input, reference

torch_only = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
jax_only = pytest.mark.skipif(not HAVE_JAX, reason="jax is not installed")


@torch_only
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
def test_torch_tensors_in_and_out(comm, dtype):
    import torch

    tdt = getattr(torch, dtype)
    n = 13
    src = "int64" if dtype.startswith("int") else "float64"
    x = torch.from_numpy(rank_input(comm.rank, n, src)).to(tdt)
    expected = reference("sum", all_inputs(comm.size, n, src))
    got = comm.allreduce(x)
    assert isinstance(got, torch.Tensor) and got.dtype == tdt and got.shape == x.shape
    assert_close(got.double().numpy(), expected, dtype)
    # in place on a tensor that requires grad's .grad-like buffer
    y = x.clone()
    assert comm.allreduce(y, out=y) is y
    assert_close(y.double().numpy(), expected, dtype)
    # reduce_scatter / allgather / broadcast hand back tensors too
    rs = comm.reduce_scatter(x)
    assert isinstance(rs, torch.Tensor) and rs.dtype == tdt
    assert_close(rs.double().numpy(), np.array_split(expected, comm.size)[comm.rank], dtype)
    ag = comm.allgather(x)
    assert isinstance(ag, torch.Tensor) and tuple(ag.shape) == (comm.size, n)
    assert_close(ag.double().numpy(), all_inputs(comm.size, n, src), dtype)
    b = x.clone()
    assert comm.broadcast(b, root=comm.size - 1) is b          # in place: the tensor itself
    assert_close(b.double().numpy(), all_inputs(comm.size, n, src)[-1], dtype)


@torch_only
@pytest.mark.mpi(min_size=1)
def test_torch_parameter_with_grad_and_noncontiguous(comm):
    import torch

    import commlib

    p = torch.nn.Parameter(torch.ones(4, 3))
    got = comm.allreduce(p, op="avg")
    assert torch.equal(got, torch.ones(4, 3))
    t = torch.arange(12.0).reshape(4, 3).t()
    got = comm.allreduce(t)                          # read through a contiguous copy
    assert torch.equal(got, t * comm.size) and got.shape == (3, 4)
    with pytest.raises(commlib.ValidationError, match=r"x.contiguous\(\)"):
        commlib.init(comm=__import__("mpi4py.MPI").MPI.COMM_SELF).allreduce(t, out=t)   # in place


@torch_only
@pytest.mark.mpi(min_size=1)
def test_torch_host_path_edges_match_the_reference(comm, monkeypatch):
    """Blocking calls on plain contiguous CPU tensors take numpy's host path through aliases
    (``host_alias``; ``Runner.call_host`` once per call, one sequence number): results
    are tensors (the caller's ``out`` itself when given), in place through an alias of ``x``,
    0-d, needing grad, and lazy views (``conj()``, a conjugate's ``imag``) read as their values;
    what the path passes on (an ``out`` of another dtype, a lazy view as ``out``) keeps the
    general path's error."""
    import torch

    import commlib

    hosted = []
    real_call_host = comm._run.call_host
    monkeypatch.setattr(comm._run, "call_host",
                        lambda *a, **kw: hosted.append(a[0]) or real_call_host(*a, **kw))
    n = 12
    xs = all_inputs(comm.size, n, "float64")
    x = torch.from_numpy(rank_input(comm.rank, n, "float64"))
    seq = comm.seq
    out = torch.empty(n, dtype=torch.float64)
    assert comm.allreduce(x, out=out) is out
    np.testing.assert_allclose(out.numpy(), xs.sum(0))
    rs_out = torch.empty(commlib.split_counts(n, comm.size)[comm.rank], dtype=torch.float64)
    comm.reduce_scatter(x, out=rs_out)           # the first call of a size: the general path, on numpy
    assert comm.reduce_scatter(x, out=rs_out) is rs_out
    np.testing.assert_allclose(rs_out.numpy(), np.array_split(xs.sum(0), comm.size)[comm.rank])
    got = comm.allgather(x.view(3, 4))
    assert isinstance(got, torch.Tensor) and got.shape == (comm.size, 3, 4)
    np.testing.assert_array_equal(got.numpy(), xs.reshape(comm.size, 3, 4))
    assert comm.seq == seq + 4
    assert hosted in (["allreduce", "reduce_scatter", "allgather"],       # 12 elements split before: twice
                      ["allreduce", "reduce_scatter", "reduce_scatter", "allgather"])
    y = x.clone()
    comm.allreduce(y, op="avg", out=y.view(3, 4))                 # aliases y without being y
    np.testing.assert_allclose(y.numpy(), xs.mean(0))
    scalar = comm.allreduce(torch.tensor(comm.rank + 1.0, requires_grad=True))
    assert scalar.shape == () and not scalar.requires_grad
    assert float(scalar) == comm.size * (comm.size + 1) / 2
    top = comm.allreduce(torch.tensor(comm.rank + 1.0), op="max")      # a 0-d metric's max
    assert top.shape == () and float(top) == comm.size
    z = torch.from_numpy(rank_input(comm.rank, n, "complex128"))
    zs = all_inputs(comm.size, n, "complex128")
    np.testing.assert_allclose(comm.allreduce(z.conj()).numpy(), zs.conj().sum(0))
    np.testing.assert_allclose(comm.allreduce(z.conj().imag).numpy(), -zs.imag.sum(0))
    int32, f32 = torch.ones(3, dtype=torch.int32), torch.empty(n, dtype=torch.float32)
    for bad, match in [(lambda c: c.allreduce(x, out=f32), "out has dtype float32"),
                       (lambda c: c.allreduce(z.imag, out=z.conj().imag), "out: array is not contiguous"),
                       (lambda c: c.allreduce(z, out=z.conj()), "out: a lazy conjugate"),
                       (lambda c: c.allreduce(int32, op="avg"), "needs a floating")]:
        spare = comm.split(0)            # a rejected input aborts the communicator it was given to
        with pytest.raises(commlib.ValidationError, match=match):
            bad(spare)
        spare.close()


@torch_only
@pytest.mark.mpi(min_size=1)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_dtypes_numpy_lacks_are_refused_on_every_rank(comm):
    """float8 and complex32 tensors (numpy has neither) raise ValidationError naming the dtype,
    before any collective: numpy's conversion raised TypeError (RuntimeError through DLPack), which
    the rank did not report as a rejection, so a peer with a valid input waited until the timeout."""
    import torch

    import commlib

    for bad in (torch.float8_e4m3fn, torch.complex32):
        spare = comm.split(0)
        try:
            with pytest.raises(commlib.ValidationError, match=f"dtype {str(bad)[6:]} is not supported"):
                spare.allreduce(torch.zeros(3, dtype=bad))
        finally:
            spare.close()


@jax_only
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32"])
def test_jax_arrays_in_and_out(comm, dtype):
    import jax.numpy as jnp

    n = 11
    src = "int64" if dtype.startswith("int") else "float64"
    x = jnp.asarray(rank_input(comm.rank, n, src)).astype(dtype)
    expected = reference("sum", all_inputs(comm.size, n, src))
    got = comm.allreduce(x)
    assert type(got).__module__.startswith("jax") and got.dtype == x.dtype
    assert_close(np.asarray(got, dtype=np.float64), expected, dtype)
    w = comm.iallgather(x).wait()
    assert w.shape == (comm.size, n)
    b = comm.broadcast(x, root=0)  # immutable: a new array comes back
    assert_close(np.asarray(b, dtype=np.float64), all_inputs(comm.size, n, src)[0], dtype)
    assert_close(np.asarray(x, dtype=np.float64), all_inputs(comm.size, n, src)[comm.rank], dtype)


@pytest.fixture
def jax_on_the_cpu():
    """New jax arrays on the CPU for the test (on a GPU machine jax's default device is the GPU)."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield


@jax_only
@pytest.mark.mpi(min_size=1)
def test_jax_host_path_matches_the_reference(comm, monkeypatch, jax_on_the_cpu):
    """Blocking calls on jax arrays on the CPU take numpy's host path through their read-only
    aliases (``host_alias``; ``Runner.call_host`` once per call, one sequence number) once a call
    has met the class of jax's arrays: results are new jax arrays of ``x``'s dtype and shape
    (0-d too), ``x`` unchanged; bfloat16 and a numpy ``out`` keep the general path."""
    import jax.numpy as jnp

    hosted = []
    real_call_host = comm._run.call_host
    monkeypatch.setattr(comm._run, "call_host",
                        lambda *a, **kw: hosted.append(a[0]) or real_call_host(*a, **kw))
    n = 12
    xs = all_inputs(comm.size, n, "float64").astype(np.float32)
    x = jnp.asarray(xs[comm.rank]).reshape(3, 4)
    comm.allreduce(jnp.zeros(1))                # the general path first: it learns jax's array class
    comm.reduce_scatter(x)                      # the first call of a size splits it (general path,
    hosted.clear()                              # unless an earlier test on this comm had that size)
    seq = comm.seq
    got = comm.allreduce(x, op="avg")
    assert type(got) is type(x) and got.dtype == x.dtype and got.shape == (3, 4)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), xs.mean(0), rtol=1e-6)
    rs = comm.reduce_scatter(x)
    np.testing.assert_allclose(np.asarray(rs), np.array_split(xs.sum(0), comm.size)[comm.rank], rtol=1e-6)
    ag = comm.allgather(x)
    assert type(ag) is type(x) and ag.shape == (comm.size, 3, 4)
    np.testing.assert_array_equal(np.asarray(ag).reshape(comm.size, n), xs)
    z = comm.allreduce(jnp.asarray(1 + 2j, jnp.complex64))
    assert z.shape == () and z.dtype == jnp.complex64 and complex(z) == comm.size * (1 + 2j)
    assert comm.seq == seq + 4 and hosted == ["allreduce", "reduce_scatter", "allgather", "allreduce"]
    np.testing.assert_array_equal(np.asarray(x).reshape(-1), xs[comm.rank])
    out = np.empty((3, 4), np.float32)
    assert comm.allreduce(x, out=out) is out and comm.allreduce(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    np.testing.assert_allclose(out.reshape(-1), xs.sum(0), rtol=1e-6)
    assert len(hosted) == 4


@jax_only
@pytest.mark.mpi(min_size=2)
def test_an_array_that_cannot_be_read_is_a_rejection_its_peers_hear_of():
    """A jax array donated to a jitted step (deleted) is a ValidationError saying why, a rejection
    like any invalid input: every rank raises it at once (numpy's RuntimeError escaped before the
    check, so the peers waited in it until the timeout) and the communicator goes on; alone,
    without check mode, its rank raises it too."""
    import jax.numpy as jnp
    from mpi4py import MPI

    import commlib

    c = commlib.init(comm=MPI.COMM_WORLD, check=True, timeout=30)
    x = jnp.ones(4)
    c.allreduce(x)                   # jax's array class known: the host path is tried first
    if c.rank == 0:
        x.delete()
    with pytest.raises(commlib.ValidationError, match=r"rank 0 rejected its input: .*Array has been deleted"):
        c.allreduce(x)
    np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.full(2, c.size))
    c.close()
    alone, y = commlib.init(comm=MPI.COMM_SELF), jnp.ones(3)
    y.delete()
    with pytest.raises(commlib.ValidationError, match="allreduce: RuntimeError.*deleted"):
        alone.allreduce(y)
    alone.close()


@jax_only
@pytest.mark.mpi(min_size=1)
def test_jax_array_is_never_an_output():
    import jax.numpy as jnp
    from mpi4py import MPI

    import commlib

    c = commlib.init(comm=MPI.COMM_SELF)
    x = jnp.ones(3)
    with pytest.raises(commlib.ValidationError, match="immutable"):
        c.allreduce(x, out=x)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["torch", "torch-bfloat16", "jax"])
def test_framework_results_stay_theirs_while_held(comm, kind):
    """A torch or jax result of 256 KiB (its host memory from the pool of results) holds that
    memory: seven held results, then each against its reference."""
    n = 1 << 16
    if kind.startswith("torch"):
        torch = pytest.importorskip("torch")
        tdt = torch.bfloat16 if kind == "torch-bfloat16" else torch.float32
        held = [comm.allreduce(torch.full((n,), float(k), dtype=tdt)) for k in range(1, 8)]
        values = [h.float().numpy() for h in held]
    else:
        jnp = pytest.importorskip("jax.numpy")
        held = [comm.allreduce(jnp.full((n,), float(k), jnp.float32)) for k in range(1, 8)]
        values = [np.asarray(h) for h in held]
    for k, v in enumerate(values, 1):
        np.testing.assert_array_equal(v, np.full(n, k * comm.size, np.float32))


@torch_only
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])      # the host path, the general one
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_a_tensor_an_operation_writes_is_marked_for_autograd(comm, dtype, mode):
    """An operation that writes a torch tensor (in place, or as ``out``) moves its version counter
    as torch's in-place operations do: a backward through a graph that saved the tensor raises
    (it used the overwritten values: ``a.grad`` was ``size * exp(a)``, silently).  A result
    allocated for the caller leaves the graph alone."""
    import torch

    dt = getattr(torch, dtype)

    def call(name, *args, **kw):
        return getattr(comm, name)(*args, **kw) if mode == "blocking" else getattr(comm, "i" + name)(
            *args, **kw).wait()

    writes = {
        "allreduce in place": lambda c: call("allreduce", c, out=c),
        "allreduce into out": lambda c: call("allreduce", torch.ones(2, dtype=dt), out=c),
        "broadcast in place": lambda c: call("broadcast", c, root=0),
        "allgather into out": lambda c: call("allgather", torch.ones(2 // comm.size or 1, dtype=dt),
                                             out=c) if comm.size <= 2 else call("allreduce", c, out=c),
    }
    for what, write in writes.items():
        a = torch.tensor([1.0, 2.0], dtype=dt, requires_grad=True)
        c = a.exp()                                 # exp's backward reads its output
        before = c._version
        write(c)
        assert c._version > before, what
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            c.sum().backward()
    a = torch.tensor([1.0, 2.0], dtype=dt, requires_grad=True)
    c = a.exp()
    call("allreduce", c)                            # out of place: c stays as it was
    c.sum().backward()
    torch.testing.assert_close(a.grad, a.detach().exp())


@pytest.mark.skipif(not (HAVE_TORCH and HAVE_JAX), reason="needs torch and jax")
@pytest.mark.mpi(min_size=1)
def test_an_mpi4py_communicator_as_comm_is_refused_before_anything_runs(comm):
    """mpi4jax's and Horovod's ``comm=MPI.COMM_WORLD`` given to commlib's calls: its pickle-based
    ``allreduce`` ran (``'str' object is not callable`` on rank 0, rank 1 waiting without limit),
    or, inside jit, ``unhashable type: 'mpi4py.MPI.Intracomm'``.  Every API taking ``comm=``
    refuses it alike on every rank, naming the way to make one, and the communicator goes on."""
    import jax
    import jax.numpy as jnp
    import torch
    from mpi4py import MPI

    from commlib.bindings import jax as cj
    from commlib.bindings import torch as ct

    model = torch.nn.Linear(2, 1)
    calls = {
        "allreduce": lambda c: cj.allreduce(jnp.ones(2), "sum", comm=c),
        "allgather": lambda c: jax.jit(lambda x: cj.allgather(x, comm=c))(jnp.ones(2)),
        "broadcast_params": lambda c: cj.broadcast_params({"a": jnp.ones(2)}, comm=c),
        "GradientSync": lambda c: cj.average_gradients(comm=c),
        "DistributedOptimizer": lambda c: cj.DistributedOptimizer(__import__("optax").sgd(0.1), comm=c),
        "broadcast_parameters": lambda c: ct.broadcast_parameters(model.state_dict(), comm=c),
        "DistributedOptimizer ": lambda c: ct.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, comm=c),
    }
    before = comm.seq
    for where, call in calls.items():
        for bad in (MPI.COMM_WORLD, "world"):
            with pytest.raises(TypeError, match=f"{where.strip()}: comm= expects a commlib.Communicator, got "
                               + ("mpi4py.MPI.Intracomm: make one of it with commlib.init"
                                  if bad is MPI.COMM_WORLD else "builtins.str")):
                call(bad)
    assert comm.seq == before
    np.testing.assert_array_equal(np.asarray(comm.allreduce(np.ones(2))), np.full(2, comm.size))
