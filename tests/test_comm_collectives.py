"""Every collective against a float64 numpy reference: dtypes x sizes x modes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import commlib

from conftest import NUMPY_DTYPES, SIZES, all_inputs, assert_close, rank_input, reference, wide

DTYPES = list(commlib.DTYPES)
FLOATS = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]     # avg takes these
UNORDERED = ["complex64", "complex128"]       # no max, no min: test_complex_numbers_have_no_max_or_min


def defined(ops: list[str]) -> list[tuple[str, str]]:
    """(dtype, op) pairs where the reduction is defined: avg on floats and complex numbers, max and
    min on ordered values (the refusals: test_comm_errors, test_complex_numbers_have_no_max_or_min)."""
    return [(d, op) for d in DTYPES for op in ops
            if (op != "avg" or d in FLOATS) and (op not in ("max", "min") or d not in UNORDERED)]


def _mode_call(comm, mode, name, x, **kw):
    """Call operation ``name`` blocking or nonblocking."""
    if mode == "blocking":
        return getattr(comm, name)(x, **kw)
    work = getattr(comm, "i" + name)(x, **kw)
    assert isinstance(work, commlib.Work)
    return work.wait()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", defined(["sum", "avg", "max", "min"]))
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_allreduce_matches_reference(comm, dtype, op, mode):
    for n in SIZES:
        x = rank_input(comm.rank, n, dtype)
        expected = reference(op, all_inputs(comm.size, n, dtype))
        got = _mode_call(comm, mode, "allreduce", x, op=op)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert_close(got, expected, dtype)
        assert_close(x, all_inputs(comm.size, n, dtype)[comm.rank], dtype)  # input untouched


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_allreduce_in_place_and_into_out(comm, dtype, mode):
    n = 37
    expected = reference("sum", all_inputs(comm.size, n, dtype))
    x = rank_input(comm.rank, n, dtype).reshape(37, 1)
    got = _mode_call(comm, mode, "allreduce", x, out=x)
    assert got is x
    assert_close(x.ravel(), expected, dtype)
    x = rank_input(comm.rank, n, dtype)
    out = np.zeros_like(x)
    assert _mode_call(comm, mode, "allreduce", x, out=out) is out
    assert_close(out, expected, dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", defined(["sum", "avg", "max"]))
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_reduce_scatter_any_size(comm, dtype, op, mode):
    for n in SIZES:
        x = rank_input(comm.rank, n, dtype, salt=1)
        full = reference(op, all_inputs(comm.size, n, dtype, salt=1))
        chunks = np.array_split(full, comm.size)
        assert [len(c) for c in chunks] == commlib.split_counts(n, comm.size)
        got = _mode_call(comm, mode, "reduce_scatter", x, op=op)
        assert got.shape == chunks[comm.rank].shape
        assert_close(got, chunks[comm.rank], dtype)
        out = np.empty(len(chunks[comm.rank]), x.dtype)
        assert _mode_call(comm, mode, "reduce_scatter", x, op=op, out=out) is out
        assert_close(out, chunks[comm.rank], dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_max_and_min_with_a_nan_agree_on_every_rank(comm, dtype, mode):
    """A NaN on one rank's element is NaN in that element of every rank's max and min (numpy's
    max), the other elements exact, in place too.  MPI's own gave NaN on some ranks and a number
    on others (nonblocking MPICH compares in the order its algorithm meets the ranks)."""
    n = 7
    every = all_inputs(comm.size, n, dtype, salt=8)
    for bad in range(comm.size):
        every[bad % comm.size, bad % n] = np.nan
        every[(bad + 1) % comm.size, (bad + 3) % n] = -np.nan if comm.size > 1 else np.nan
        x = every[comm.rank].astype(NUMPY_DTYPES[dtype])
        for op in ("max", "min"):
            want = reference(op, every)
            assert_close(_mode_call(comm, mode, "allreduce", x, op=op), want, dtype)
            assert_close(_mode_call(comm, mode, "reduce_scatter", x, op=op),
                         np.array_split(want, comm.size)[comm.rank], dtype)
            y = x.copy()
            _mode_call(comm, mode, "allreduce", y, op=op, out=y)
            assert_close(y, want, dtype)
            table = comm.allgather(np.isnan(_mode_call(comm, mode, "allreduce", x, op=op)).astype(np.int32))
            assert (table == table[0]).all()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_large_bfloat16_reductions_match_reference(comm, mode, op):
    """bfloat16 reduces through a float32 copy of the input, held until the operation is done:
    from 131072 elements (a 512 KiB copy) reduce_scatter's was freed as the call returned and rank
    0's chunk came back wrong (errors of 1.3 at 2 ranks, 3.5e37 at 4)."""
    n = 300_001
    x = rank_input(comm.rank, n, "bfloat16", salt=7)
    every = all_inputs(comm.size, n, "bfloat16", salt=7)
    full = reference(op, every)
    got = _mode_call(comm, mode, "reduce_scatter", x, op=op)
    assert_close(got, np.array_split(full, comm.size)[comm.rank], "bfloat16")
    assert_close(_mode_call(comm, mode, "allreduce", x, op=op), full, "bfloat16")
    assert_close(x, every[comm.rank], "bfloat16")          # input untouched


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_allgather(comm, dtype, mode):
    for n in SIZES:
        x = rank_input(comm.rank, n, dtype, salt=2).reshape(n, 1)
        got = _mode_call(comm, mode, "allgather", x)
        assert got.shape == (comm.size, n, 1)
        assert_close(got.reshape(comm.size, n), all_inputs(comm.size, n, dtype, salt=2), dtype)
    # in place: x is out's own slice
    n = 11
    out = np.zeros(comm.size * n, rank_input(0, 1, dtype).dtype)
    out[comm.rank * n:(comm.rank + 1) * n] = rank_input(comm.rank, n, dtype, salt=3)
    mine = out[comm.rank * n:(comm.rank + 1) * n]
    assert _mode_call(comm, mode, "allgather", mine, out=out) is out
    assert_close(out, all_inputs(comm.size, n, dtype, salt=3).ravel(), dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
@pytest.mark.parametrize("give_counts", [True, False])
def test_allgatherv_variable_counts(comm, dtype, mode, give_counts):
    counts = [(3 * r + 1) % 5 for r in range(comm.size)]  # includes zero for some ranks
    x = rank_input(comm.rank, counts[comm.rank], dtype, salt=4)
    expected = np.concatenate([rank_input(r, counts[r], dtype, salt=4).astype(wide(dtype))
                               for r in range(comm.size)])
    got = _mode_call(comm, mode, "allgatherv", x, counts=counts if give_counts else None)
    assert got.shape == (sum(counts),)
    assert_close(got, expected, dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_broadcast_from_every_root(comm, dtype, mode):
    for root in range(comm.size):
        for n in (0, 1, 13):
            x = rank_input(comm.rank, n, dtype, salt=5)
            expected = all_inputs(comm.size, n, dtype, salt=5)[root]
            got = _mode_call(comm, mode, "broadcast", x, root=root)
            assert got is x  # in place by default
            assert_close(x, expected, dtype)
            src = rank_input(comm.rank, n, dtype, salt=5)
            out = np.zeros_like(src)
            assert _mode_call(comm, mode, "broadcast", src, root=root, out=out) is out
            assert_close(out, expected, dtype)
            assert_close(src, all_inputs(comm.size, n, dtype, salt=5)[comm.rank], dtype)
            same = rank_input(comm.rank, n, dtype, salt=5)           # out=x: in place too
            assert _mode_call(comm, mode, "broadcast", same, root=root, out=same) is same
            assert_close(same, expected, dtype)


@pytest.mark.mpi(min_size=1)
def test_nonblocking_keeps_submission_order_with_blocking_calls(comm):
    """Queued nonblocking ops finish before a later blocking op; results stay right."""
    xs = [np.full(1 << 14, comm.rank + i, np.float64) for i in range(8)]
    works = [comm.iallreduce(x, out=x, tag=f"b{i}") for i, x in enumerate(xs)]
    total = comm.allreduce(np.ones(3))  # blocking, queued behind the eight
    assert all(w.test() for w in works)
    for i, (w, x) in enumerate(zip(works, xs)):
        assert w.wait() is x
        assert np.all(x == sum(r + i for r in range(comm.size)))
    np.testing.assert_array_equal(total, np.full(3, comm.size))
    comm.barrier()
    w = comm.ibarrier()
    assert w.wait() is None
    comm.synchronize()


@pytest.mark.mpi(min_size=2)
def test_split_communicators(comm):
    sub = comm.split(color=comm.rank % 2)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert sub.size == len(members) and sub.rank == members.index(comm.rank)
    got = sub.allreduce(np.array([comm.rank], np.int64))
    assert int(got[0]) == sum(members)
    rest = comm.split(color=-1 if comm.rank == 0 else 0)  # rank 0 opts out (MPI_UNDEFINED)
    if comm.rank == 0:
        assert rest is None
    else:
        assert rest.size == comm.size - 1
        rest.close()
    sub.close()


@pytest.mark.mpi(min_size=1)
def test_host_path_edges_match_the_reference(comm):
    """Blocking calls on plain numpy arrays skip the Op layer (``Runner.call_host``): views,
    0-d arrays, an ``out`` that aliases ``x`` without being ``x``, read-only inputs, broadcast's
    roots; input it passes on (a wrong-sized ``out``, ``avg`` on integers, a root out of range)
    still gets the general path's error.
    Non-contiguous inputs: test_non_contiguous_inputs_are_read_through_a_copy; bfloat16: the dtype
    sweeps."""
    n = 12
    expected = reference("sum", all_inputs(comm.size, n, "float32"))
    x = rank_input(comm.rank, n, "float32")
    view = x.reshape(3, 4)
    assert comm.allreduce(view, out=view[:]) is not None      # aliases x: in place
    assert_close(x, expected, "float32")
    ro = rank_input(comm.rank, n, "float32")
    ro.setflags(write=False)
    assert_close(comm.allreduce(ro), expected, "float32")
    assert_close(comm.allreduce(ro, op="avg"), expected / comm.size, "float32")
    scalar = np.array(comm.rank + 1.0)
    got = comm.allreduce(scalar)
    assert got.shape == () and float(got) == comm.size * (comm.size + 1) / 2
    for dtype in ("float16", "float32", "float64"):   # a 0-d max/min (a metric): the NaN-aware path
        for op, want in (("max", comm.size), ("min", 1)):       # aborted the communicator before
            got = comm.allreduce(np.array(comm.rank + 1.0, NUMPY_DTYPES[dtype]), op=op)
            assert got.shape == () and float(got) == want, (dtype, op, got)
    buf = np.zeros(2 * n, np.float32)                           # out a view into a larger buffer
    counts = commlib.split_counts(n, comm.size)
    chunks = np.array_split(expected, comm.size)
    comm.reduce_scatter(ro, out=buf[:counts[comm.rank]])
    comm.reduce_scatter(ro, out=buf[:counts[comm.rank]])        # the second call: counts cached
    assert_close(buf[:counts[comm.rank]], chunks[comm.rank], "float32")
    gathered = comm.allgather(ro[:3])
    assert gathered.shape == (comm.size, 3)
    assert_close(gathered, all_inputs(comm.size, n, "float32")[:, :3], "float32")
    inputs = all_inputs(comm.size, n, "float32")
    for root in range(comm.size):                                # broadcast: a read-only x gets a new
        got = comm.broadcast(ro, root=np.int64(root))            # array; a view is written in place
        assert got is not ro and got.shape == ro.shape
        assert_close(got, inputs[root], "float32")
        view = rank_input(comm.rank, n, "float32").reshape(3, 4)[1:]
        assert comm.broadcast(view, root=root) is view
        assert_close(view, inputs[root].reshape(3, 4)[1:], "float32")
        for form in (ro.reshape(3, 4).T, ro.astype(">f4")):     # read through a copy: refused before
            form.flags.writeable = False
            got = comm.broadcast(form, root=root)
            assert got is not form and got.shape == form.shape
            assert_close(got.reshape(-1) if form.ndim == 1 else got.T.reshape(-1), inputs[root], "float32")
    comm.barrier()
    for bad, match in [(lambda c: c.allreduce(x, out=np.empty(5, np.float32)), "out has 5 elements"),
                       (lambda c: c.allreduce(np.ones(3, np.int32), op="avg"), "needs a floating"),
                       (lambda c: c.broadcast(x, root=c.size), "is not a rank")]:
        spare = comm.split(0)            # a rejected input aborts the communicator it was given to
        with pytest.raises(commlib.ValidationError, match=match):
            bad(spare)
        spare.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_non_contiguous_inputs_are_read_through_a_copy(comm, mode):
    """An input the operation only reads may be non-contiguous (a transpose, a column slice, a
    stride): it is read through a contiguous copy, as numpy reads one (it was refused, and the
    refusal aborted the communicator); the result has the input's shape.  In place it is still
    refused (tests/test_comm_errors.py)."""
    n = comm.size

    def call(name, *args, **kw):
        return getattr(comm, name)(*args, **kw) if mode == "blocking" else getattr(comm, "i" + name)(
            *args, **kw).wait()

    stacked = np.stack([rank_input(r, 24, "float64").reshape(4, 6) for r in range(n)])
    mine = stacked[comm.rank]
    got = call("allreduce", mine.T)
    assert got.shape == (6, 4)
    assert_close(got, stacked.sum(0).T, "float64")
    assert_close(call("allreduce", mine[:, 1], op="max"), stacked[:, :, 1].max(0), "float64")
    whole = stacked[:, ::2, 1:].reshape(n, -1)          # a strided block, flattened as reduce_scatter does
    chunks = np.array_split(whole.sum(0), n)
    assert_close(call("reduce_scatter", mine[::2, 1:]), chunks[comm.rank], "float64")
    assert_close(call("allgather", mine[:, 2]), stacked[:, :, 2], "float64")
    assert_close(call("allgatherv", mine[: comm.rank + 1, 0]),
                 np.concatenate([stacked[r, : r + 1, 0] for r in range(n)]), "float64")


@pytest.mark.mpi(min_size=1)
def test_allgather_object_beside_operations_in_flight(comm):
    """Python objects of every size from every rank, in rank order, while a nonblocking all-reduce
    is in flight (a call outside the operations' order never pairs with it); different labels
    raise on every rank, and the communicator stays usable."""
    x = np.full(1 << 12, comm.rank, np.float64)
    work = comm.iallreduce(x, out=x)
    mine = {"rank": comm.rank, "blob": bytes(range(comm.rank % 7)) * (1000 * comm.rank), "t": (1.5, None)}
    got = comm.allgather_object(mine, label="config")
    assert got == [{"rank": r, "blob": bytes(range(r % 7)) * (1000 * r), "t": (1.5, None)}
                   for r in range(comm.size)]
    work.wait()
    np.testing.assert_array_equal(x, np.full(1 << 12, sum(range(comm.size)), np.float64))
    if comm.size > 1:
        with pytest.raises(commlib.MismatchError, match="another label"):
            comm.allgather_object(comm.rank, label="odd" if comm.rank == 1 else "even")
    # an object that does not pickle on the last rank: every rank raises, naming it (they waited)
    last = comm.size - 1
    with pytest.raises(commlib.ValidationError, match=f"cfg: rank {last} could not pickle its object "
                                                      r"\(TypeError: cannot pickle '_thread.lock'"):
        comm.allgather_object(threading.Lock() if comm.rank == last else comm.rank, label="cfg")
    assert comm.allgather_object(comm.rank) == list(range(comm.size))
    np.testing.assert_array_equal(comm.allreduce(np.ones(2)), np.full(2, comm.size))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_results_without_out_stay_yours_while_you_hold_them(comm, mode):
    """Results made without ``out`` come from a pool of host arrays (no page faults for a fresh
    megabyte each call); one you hold, or a view of it, is never handed out again: seven held
    results (more than the pool keeps per shape), then each checked against its reference."""
    n = 1 << 16                                          # 256 KiB of float32: pooled
    base = np.arange(n, dtype=np.float32) % 7
    total = sum(base * (r + 1) for r in range(comm.size))
    held = [_mode_call(comm, mode, "allreduce", base * (comm.rank + 1) * k) for k in range(1, 8)]
    views = [r[::2] for r in held[:3]]
    gathered = [_mode_call(comm, mode, "allgather", base * k) for k in range(1, 4)]
    for k, r in enumerate(held, 1):
        np.testing.assert_array_equal(r, total * k)
    for k, v in enumerate(views, 1):
        np.testing.assert_array_equal(v, (total * k)[::2])
    for k, g in enumerate(gathered, 1):
        np.testing.assert_array_equal(g, np.broadcast_to(base * k, (comm.size, n)))
    assert len({r.ctypes.data for r in held + gathered}) == len(held) + len(gathered)
    del held, views, gathered
    again = _mode_call(comm, mode, "allreduce", base * (comm.rank + 1))     # reused: the right values
    np.testing.assert_array_equal(again, total)


@pytest.mark.mpi(min_size=1)
def test_complex_numbers_have_no_max_or_min(comm):
    """Complex numbers are summed and averaged (MPI's complex types) but not ordered: ``max`` and
    ``min`` raise on every rank, saying so.  A torch tensor's lazy conjugate (``t.conj()``) is read
    as the values it stands for."""
    x = rank_input(comm.rank, 5, "complex64")
    spare = comm.split(0)            # a rejected input may abort the communicator it was given to
    try:
        for op in ("max", "min"):
            with pytest.raises(commlib.ValidationError, match=f"'{op}' needs ordered values, got complex64"):
                spare.allreduce(x, op=op)
    finally:
        spare.close()
    expected = reference("sum", all_inputs(comm.size, 5, "complex64"))
    try:
        import torch
    except ImportError:
        return
    got = comm.allreduce(torch.from_numpy(x).conj())
    assert got.dtype == torch.complex64 and not got.is_conj()
    assert_close(got.numpy(), expected.conj(), "complex64")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("n", [10, 200_003])
def test_an_out_overlapping_x_receives_the_result(comm, mode, kind, n):
    """``out`` and ``x`` may share memory without being one array (MPI forbids aliased buffers:
    a raw error on one rank and a hang on the others, or MPICH's abort of the job): this rank's
    chunk of ``x`` as reduce_scatter's ``out`` (ZeRO's in-place shard), an ``out`` shifted over
    ``x``, an allgather(v) input inside its output but not at its own block.  ``x`` is sent from
    a copy, held until the operation is done: 1.6 MB copies were freed as the call returned (the
    memory given back to the system, or reused) and reduce_scatter's result was wrong."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
    size, rank = comm.size, comm.rank
    k = min(n, 3) if n < 100 else n // 4        # allgather's block, allgatherv's unit
    every = all_inputs(size, n, "float64")
    counts = commlib.split_counts(n, size)
    lo = sum(counts[:rank])

    def arr(a: np.ndarray):
        return torch.from_numpy(a) if kind == "torch" else a

    def call(name, x, **kw):
        return _mode_call(comm, mode, name, x, **kw)

    x = every[rank].copy()
    call("reduce_scatter", arr(x), out=arr(x[lo:lo + counts[rank]]))       # its own chunk of x
    assert_close(x[lo:lo + counts[rank]], np.array_split(every.sum(0), size)[rank], "float64")
    x = every[rank].copy()
    call("reduce_scatter", arr(x), out=arr(x[:counts[rank]]))               # the start of x
    assert_close(x[:counts[rank]], np.array_split(every.sum(0), size)[rank], "float64")
    buf = np.zeros(n + 1)
    buf[:n] = every[rank]
    call("allreduce", arr(buf[:n]), out=arr(buf[1:]))                       # shifted by one element
    assert_close(buf[1:], every.sum(0), "float64")
    for root in range(size):                    # broadcast into an out shifted over x
        buf = np.zeros(n + 1)
        buf[:n] = every[rank]
        assert call("broadcast", arr(buf[:n]), root=root, out=arr(buf[1:])) is not None
        assert_close(buf[1:], every[root], "float64")
    out = np.zeros(size * k + 1)
    out[1:k + 1] = every[rank, :k]              # inside the output, not at this rank's block
    call("allgather", arr(out[1:k + 1]), out=arr(out[:size * k]))
    assert_close(out[:size * k], every[:, :k].reshape(-1), "float64")
    unit = 1 if n < 100 else k // size
    mine = every[rank, :(rank + 1) * unit]
    total = unit * size * (size + 1) // 2
    gathered = np.concatenate([every[r, :(r + 1) * unit] for r in range(size)])
    out = np.zeros(total)
    start = unit * rank * (rank + 1) // 2       # at its own displacement: the in-place form
    out[start:start + mine.size] = mine
    call("allgatherv", arr(out[start:start + mine.size]), out=arr(out))
    assert_close(out, gathered, "float64")
    out = np.zeros(total + 1)
    out[-mine.size:] = mine                     # at the end: elsewhere
    call("allgatherv", arr(out[len(out) - mine.size:]), out=arr(out[:-1]))
    assert_close(out[:-1], gathered, "float64")


@pytest.mark.mpi(min_size=1)
def test_the_other_byte_order_is_read_through_a_copy_and_refused_in_place(comm):
    """A big-endian array on this (little-endian) machine: read, it is converted (MPI would read
    its bytes as native numbers: 2 << 56 for 2); written (in place, or as ``out``), refused alike
    on every rank, before any rank enters the operation."""
    n = 6
    every = all_inputs(comm.size, n, "int64")
    for dt in (">i8", ">f4"):
        x = every[comm.rank].astype(dt)
        for op in ("sum", "max"):
            got = comm.allreduce(x, op=op)
            assert got.dtype.isnative
            assert_close(got, reference(op, every), "float64")
        assert_close(comm.allgather(x), every, "float64")
        spare = comm.split(0)
        with pytest.raises(commlib.ValidationError, match="byte order"):
            spare.allreduce(x, out=x)
        np.testing.assert_array_equal(spare.allreduce(np.ones(2)), np.full(2, comm.size))   # alike: usable
        spare.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dt", ["float64", "int32", "complex64"])
def test_an_unaligned_array_is_read_through_a_copy_and_refused_in_place(comm, dt):
    """A contiguous array whose memory is not aligned to its dtype (``np.frombuffer`` at an odd
    offset: a field of a packed message), which numpy computes with: read through an aligned copy,
    refused (alike on every rank) as ``out``.  MPI maps no datatype to it: the post failed and
    aborted the communicator."""
    n = 5
    every = all_inputs(comm.size, n, dt)
    raw = bytearray(every[comm.rank].nbytes + 1)
    x = np.frombuffer(raw, dtype=dt, count=n, offset=1)
    x[:] = every[comm.rank]
    assert not x.flags.aligned and x.flags.c_contiguous
    for call in (lambda: comm.allreduce(x), lambda: comm.iallreduce(x).wait()):
        assert_close(call(), reference("sum", every), dt)
    assert_close(comm.allgather(x), every, dt)
    spare = comm.split(0)
    with pytest.raises(commlib.ValidationError, match="not aligned"):
        spare.allreduce(np.ones(n, dt), out=x)
    np.testing.assert_array_equal(spare.allreduce(np.ones(2)), np.full(2, comm.size))   # alike: usable
    spare.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_broadcast_reads_a_non_contiguous_x_into_out(comm, mode):
    """With ``out``, broadcast only reads ``x`` (on the root): a transpose is read through a copy,
    as the other operations read theirs."""
    inputs = np.stack([rank_input(r, 12, "float32").reshape(3, 4) for r in range(comm.size)])
    for root in range(comm.size):
        out = np.zeros((4, 3), np.float32)
        got = _mode_call(comm, mode, "broadcast", inputs[comm.rank].T, root=root, out=out)
        assert got is out
        assert_close(out, inputs[root].T, "float32")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_ndarray_subclasses_are_numpy_arrays(comm, mode, tmp_path):
    """A memory-mapped array (a data set on disk), an ``np.matrix`` or any ndarray subclass is
    reduced, gathered and written in place as the ndarray of its memory (each aborted the
    communicator: the engine took it for a device array); a masked array is refused alike on
    every rank (its data alone would be reduced), the communicator stays usable."""
    n = 8
    every = all_inputs(comm.size, n, "float32").astype(np.float32)
    mine = np.memmap(tmp_path / f"x{comm.rank}.bin", np.float32, "w+", shape=(n,))
    mine[:] = every[comm.rank]
    assert_close(_mode_call(comm, mode, "allreduce", mine), every.sum(0), "float32")
    assert_close(_mode_call(comm, mode, "allgather", mine), every, "float32")
    got = _mode_call(comm, mode, "allreduce", mine, op="max", out=mine)
    assert got is mine
    assert_close(np.fromfile(tmp_path / f"x{comm.rank}.bin", np.float32), every.max(0), "float32")
    matrix = np.matrix(every[comm.rank].reshape(2, 4))
    got = _mode_call(comm, mode, "allreduce", matrix)
    assert_close(np.asarray(got), every.sum(0).reshape(2, 4), "float32")

    class Tagged(np.ndarray):
        pass

    out = np.zeros(n, np.float32).view(Tagged)
    assert _mode_call(comm, mode, "broadcast", every[comm.rank].view(Tagged), root=0, out=out) is out
    assert_close(np.asarray(out), every[0], "float32")
    with pytest.raises(commlib.ValidationError, match="masked array"):
        comm.allreduce(np.ma.masked_array(every[comm.rank], np.arange(n) % 2))
    np.testing.assert_array_equal(comm.allreduce(np.ones(2)), np.full(2, comm.size))
