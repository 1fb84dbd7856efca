"""Jobs that end without closing what they made, run by tests/test_comm_exit.py under ``mpiexec``.

Each case makes collective objects and leaves them open, as a training script
does; commlib must free them at exit (before ``MPI_Finalize``), so the job ends
with status 0 and MPI prints no leak warnings.  Every rank writes ``DIR/ok.RANK``
when its case ran.

Usage: mpiexec -n 2 python tests/jobs/unclosed.py CASE DIR
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import commlib
from commlib.collectives.paramstore import ParamStore


def store() -> None:
    """A parameter store over the world communicator, pushed to and pulled, never closed."""
    comm = commlib.init()
    s = ParamStore(comm, 1000, "float32", init=np.zeros(1000, np.float32))
    s.activate()
    s.push(np.ones(1000, np.float32))
    comm.barrier()
    out = np.empty(1000, np.float32)
    s.pull(out)
    assert np.all(out == comm.size), out[:4]


def syncswitch_asp() -> None:
    """The offline policy's usual job: BSP, then ASP to the end; the strategy is never closed."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import OfflinePolicy, SyncSwitch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=SyncSwitch(policy=OfflinePolicy(0.5, total_steps=6)))
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    assert opt.strategy.phase == "asp", opt.strategy.phase


def jax_results_held() -> None:
    """Eager collectives on jax arrays of every dtype (x64 on), results of 256 KiB (which jax
    takes without a copy, aliasing the pool of host results) held to the end: the process exits
    cleanly (``jax.dlpack.from_dlpack`` of a 64-bit array it had to convert aborted at exit)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    comm = commlib.init()
    held = []
    for dt in ("float16", "float32", "float64", "int32", "int64", "complex64", "complex128", "bfloat16"):
        x = jnp.ones(1 << 16, dt)
        held += [comm.allreduce(x), comm.allgather(x[: 1 << 15])]
    assert [h.dtype for h in held[::2]] == [jnp.dtype(dt) for dt in ("float16", "float32", "float64", "int32",
                                            "int64", "complex64", "complex128", "bfloat16")]
    assert all(bool((h == (comm.size if h.shape == (1 << 16,) else 1)).all()) for h in held)


def horovod_ends_with_a_collective() -> None:
    """A Horovod script ending with a collective (a last step's all-reduce, a barrier): a rank that
    has not yet seen it complete when a peer's program ends completes it (the peer's abort at exit
    failed it: 2 runs in 6 at 3 ranks exited 1)."""
    import torch

    import commlib.horovod.torch as hvd

    hvd.init()
    for i in range(20):
        hvd.allreduce(torch.ones(1000), op=hvd.Sum, name=f"x{i}")
    hvd.barrier()


def rejected_broadcast_at_the_end() -> None:
    """The last operation a broadcast whose root went on while a peer rejected its input (a root it
    does not have): the root's close waited in the collective frees for good, the rejecting rank
    (aborted) freeing nothing, so the job never ended.  Each rank ends its program; the job ends."""
    comm = commlib.init(timeout=30)
    comm.barrier()
    if comm.rank == 0:
        np.testing.assert_array_equal(comm.broadcast(np.arange(4.0), root=0), np.arange(4.0))
    else:
        try:
            comm.broadcast(np.arange(4.0), root=comm.size)
        except commlib.ValidationError as e:
            assert "root" in str(e), e
        else:
            raise AssertionError("a root out of range was taken")


def forked_child_exits() -> None:
    """A rank forks a child (``os.fork()``, not multiprocessing) that runs the exit hooks it
    inherited, as its ``sys.exit()`` would, then leaves with ``os._exit`` (MPI's own finalize waits
    for good in a forked child, commlib or not): the rank's communicators, the Horovod shim's and a
    timeline stay the rank's. The child's hooks closed them (the peers' next operation failed:
    "rank 0 closed the communicator"), the shim's left them, its timeline write replaced the
    rank's file."""
    import atexit

    import torch

    import commlib.horovod.torch as hvd

    timeline = os.path.join(sys.argv[2], "timeline.json")
    comm = commlib.init(timeout=30, timeline=timeline)
    hvd.init()
    comm.allreduce(np.ones(3))
    if comm.rank == 0:
        pid = os.fork()
        if pid == 0:
            atexit._run_exitfuncs()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert not [n for n in os.listdir(sys.argv[2]) if n.startswith("timeline")], "the child wrote it"
    for i in range(3):
        np.testing.assert_array_equal(comm.allreduce(np.full(4, float(comm.rank + i))),
                                      np.full(4, float(sum(range(comm.size)) + comm.size * i)))
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [comm.size] * 2


def dropped_on_one_rank() -> None:
    """A split communicator dropped unclosed and collected on one rank, alive on the other (a
    jitted JAX DistributedOptimizer going out of scope: each rank's GC runs when it does): the
    other rank's close at exit waited for good for a peer that no longer had it to close."""
    import gc

    world = commlib.init()
    sub = world.split(0)
    sub.allreduce(np.ones(2))
    if world.rank != 1:
        _KEPT.append(sub)   # alive to the end here
    del sub
    gc.collect()


def closed_after_alike_rejections() -> None:
    """Every rank rejects two operations alike, then closes (the communicator stays usable: it is
    freed). A rank's board slot is written in two steps (the rejected seq, then seq and state),
    and a peer descheduled between them (4 ranks on 2 cores) showed its first rejection for a
    moment: a closing rank read it as a rejection apart, freed nothing, and the others' frees
    waited for it for good. Rank 1 is made slow between the writes."""
    import time

    world = commlib.init()
    spare = world.split(0)
    if world.rank == 1:
        board = spare._run.board
        fast = board.reject

        def slow(seq, op, reason, alone):
            if alone:
                board._mine_mv[4] = seq
                time.sleep(0.3)
            fast(seq, op, reason, alone)

        board.reject = slow
    x = np.ones(3, np.complex64)
    for op in ("max", "min"):
        try:
            spare.allreduce(x, op=op)
        except commlib.ValidationError:
            pass
        else:
            raise AssertionError(f"{op} of complex numbers was taken")
    spare.close()
    assert float(world.allreduce(np.ones(1))[0]) == world.size


def finalized_by_the_program() -> None:
    """The program calls ``MPI.Finalize()`` itself with communicators open (legal in mpi4py): its
    next call, and the exit's close, made MPICH end the process ("Attempting to use an MPI routine
    ... after finalizing MPICH", exit 1 on every rank).  Each call raises ``CommAbortedError`` naming
    it now, ``init()`` refuses (its world too), and the job ends with 0."""
    world = commlib.init()
    sub = world.split(0)
    sub.allreduce(np.ones(2))
    MPI.Finalize()
    for comm, call in ((world, lambda: world.allreduce(np.ones(2))), (sub, lambda: sub.barrier())):
        try:
            call()
        except commlib.CommAbortedError as exc:
            assert "MPI.Finalize() ran with this communicator open" in str(exc), exc
        else:
            raise AssertionError(f"{comm} ran an operation after MPI.Finalize()")
    for again in (commlib.init, lambda: commlib.init(timeout=30)):   # the world as it is, or a new one
        try:
            again()
        except commlib.CommlibError as exc:
            assert "MPI is finalized" in str(exc), exc
        else:
            raise AssertionError("init() returned a world after MPI.Finalize()")


#: what a case keeps alive until the interpreter exits
_KEPT: list = []


CASES = {f.__name__: f for f in (store, syncswitch_asp, jax_results_held, horovod_ends_with_a_collective,
                                  rejected_broadcast_at_the_end, forked_child_exits, dropped_on_one_rank,
                                  closed_after_alike_rejections, finalized_by_the_program)}

if __name__ == "__main__":
    rank = MPI.COMM_WORLD.rank      # (before a case that finalizes MPI)
    CASES[sys.argv[1]]()
    with open(os.path.join(sys.argv[2], f"ok.{rank}"), "w") as f:
        f.write(sys.argv[1])
