"""Broken jobs, one per case, run by tests/test_comm_exit.py under ``mpiexec``.

Each case checks on every rank the error it must raise, writes ``DIR/ok.RANK``
and meets the others in a barrier of ``COMM_WORLD`` (not broken); the job must
then end on its own (commlib calls ``MPI_Abort`` at exit when an operation was
given up while posted) instead of hanging at finalize.

Usage: mpiexec -n 2 python tests/jobs/broken.py CASE DIR
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import commlib


def fresh(**settings) -> commlib.Communicator:
    return commlib.init(comm=MPI.COMM_WORLD, **settings)


def expect(exc_type: type, fn, match: str = "") -> BaseException:
    try:
        fn()
    except exc_type as exc:
        assert match in str(exc), f"{match!r} not in {exc}"
        return exc
    raise AssertionError(f"{exc_type.__name__} not raised")


def rejected() -> None:
    """Without COMMLIB_CHECK, peers already inside the op learn of a rejection at once."""
    c = fresh(check=False, timeout=60)
    x = np.ones(3, np.uint8 if c.rank == 1 else np.float32)
    t0 = time.monotonic()
    err = expect(commlib.ValidationError, lambda: c.allreduce(x), "uint8")
    assert time.monotonic() - t0 < 30, "peers must not wait for the timeout"
    if c.rank != 1:
        assert "rank 1 rejected its input" in str(err)
    # rank 1's next call: the verdict (its peers called the operation) aborts it
    expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(2)),
           "and not every rank did" if c.rank == 1 else "rank 1 rejected")


def rejected_broadcast_left_by_its_root() -> None:
    """A broadcast's root ends it without its peers, so it goes on while a peer rejected its input
    to it and stays away (writing a log, a checkpoint): the root's next operation raises within
    milliseconds (the board shows the rejection of an operation it called with valid input), not
    after the timeout."""
    c = fresh(check=False, timeout=60)
    c.barrier()
    if c.rank == 0:
        np.testing.assert_array_equal(c.broadcast(np.arange(4.0), root=0), np.arange(4.0))
        t0 = time.monotonic()
        expect(commlib.ValidationError, lambda: c.allreduce(np.ones(2)),
               "rank 1 rejected its input to broadcast #2, which this rank called with valid input")
        assert time.monotonic() - t0 < 10, "must not wait for the timeout"
    else:
        expect(commlib.ValidationError, lambda: c.broadcast(np.arange(4.0), root=c.size), "root")
        time.sleep(1.0 if c.rank == 1 else 0.0)
        expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(2)),
               "and not every rank did" if c.rank == 1 else "")


def jax_op_refused_on_one_rank() -> None:
    """Inside ``jax.jit`` a bad ``op`` on one rank raises there while tracing; the peers, whose
    step traced fine, raise when their step's all-reduce runs (it paired with that rank's next
    jitted call: wrong numbers, silently), and every rank's next jitted call finds the
    communicator of traced calls aborted."""
    import jax
    import jax.numpy as jnp

    from commlib.bindings.jax import allreduce

    c = fresh(check=False, timeout=60)
    x = jnp.arange(4.0) + c.rank
    bad = c.rank == 1
    t0 = time.monotonic()
    if bad:
        expect(commlib.ValidationError, lambda: jax.jit(lambda v: allreduce(v, "mean", comm=c))(x), "'mean'")
    else:
        expect(Exception, lambda: np.asarray(jax.jit(lambda v: allreduce(v, "sum", comm=c))(x)),
               "rank 1 rejected its input: allreduce: op 'mean'")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    expect(Exception, lambda: np.asarray(jax.jit(lambda v: allreduce(v, comm=c))(jnp.ones(3))), "aborted")


def jax_optimizer_tree_on_one_rank() -> None:
    """The JAX ``DistributedOptimizer`` given, a step after the first, a gradient tree that differs
    from init's on one rank: that rank raised alone and its peers waited in the step's collectives
    until their timeout (30 min by default); now its refusal reaches them at once (their all-reduce
    was posted: the job ends with MPI_Abort at exit)."""
    import jax.numpy as jnp
    import optax

    from commlib.bindings.jax import DistributedOptimizer
    from commlib.collectives import AllReduce, SelSync

    c = fresh(timeout=60)
    good = {"w": jnp.ones(4), "b": jnp.ones(2)}
    odd = {"w": jnp.ones(5), "b": jnp.ones(2)} if c.rank == 1 else good
    tx = DistributedOptimizer(optax.sgd(0.1), SelSync(inner=AllReduce(), delta=0.0), comm=c)
    state = tx.init(good)
    tx.update(good, state, good)
    t0 = time.monotonic()
    expect(commlib.ValidationError, lambda: tx.update(odd, state, odd),
           "differ from the parameters given to init")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"


def rejected_while_peers_are_late() -> None:
    """A rank that rejected its input waits, at its next call, for every rank to reach the operation
    (to learn whether all rejected it alike); past the timeout it aborts, and a late peer's valid
    call raises at once (the board shows the abort) instead of waiting for a partner."""
    c = fresh(check=False, timeout=1.0)
    t0 = time.monotonic()
    if c.rank == 0:
        expect(commlib.ValidationError, lambda: c.allreduce(np.ones(3, np.uint8)), "uint8")
        err = expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(2)),
                     "not every rank reached it in 1")
        assert "rank 1 has not called any operation" in str(err)
        assert 1.0 <= time.monotonic() - t0 < 30
    else:
        time.sleep(3)
        t0 = time.monotonic()
        expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(2)), "rank 0 aborted the communicator")
        assert time.monotonic() - t0 < 0.9, "must not wait for the timeout"


def deadlock() -> None:
    """Ranks wait on different communicators for each other: every rank raises."""
    a, b = fresh(timeout=1.0), fresh(timeout=1.0)
    last = a.size - 1
    a.barrier()  # a #1 completes everywhere
    mine = b if a.rank == last else a
    err = expect(commlib.CommTimeoutError, lambda: mine.allreduce(np.ones(8)))
    if a.rank == last:
        assert (err.op, err.seq, err.waiting, err.missing) == ("allreduce", 1, [last], list(range(last)))
        assert "rank 0 has not called any operation" in str(err)
    else:
        assert (err.op, err.seq, err.waiting, err.missing) == ("allreduce", 2, list(range(last)), [last])
        assert f"rank {last} idle after barrier #1" in str(err)
    expect(commlib.CommAbortedError, lambda: mine.allreduce(np.ones(2)), "timed out")


def never_arrives() -> None:
    """A rank never calls: the others' nonblocking work raises after the timeout."""
    c = fresh(timeout=0.5)
    if c.rank == 0:
        time.sleep(2.0)
        return
    work = c.iallreduce(np.ones(16))
    err = expect(commlib.CommTimeoutError, work.wait, "allreduce #1 timed out")
    assert 0 in err.missing and "rank 0 has not called any operation" in str(err)


def stall_made_an_error() -> None:
    """``warnings.simplefilter("error", CommStallWarning)``: the stall gives up as a timeout would."""
    import warnings

    c = fresh(timeout=60, stall_warning=0.3)
    warnings.simplefilter("error", commlib.CommStallWarning)
    if c.rank == 0:       # never arrives
        time.sleep(2.0)
        return
    err = expect(commlib.CommTimeoutError, lambda: c.allreduce(np.ones(4)),
                 "allreduce #1 timed out after 0.3 s")
    assert err.missing == [0], err.missing
    assert "made the CommStallWarning an error" in str(err) and "COMMLIB_TIMEOUT sets" not in str(err), err


def only_rank0() -> None:
    """The issue's job: COMMLIB_TIMEOUT from the environment, rank 0 alone calls."""
    c = commlib.init()
    if c.rank == 0:
        expect(commlib.CommTimeoutError, lambda: c.allreduce(np.ones(4)), "timed out")


def unwaited() -> None:
    """Nobody waits for the stuck operation: closing at exit gives up after the timeout."""
    c = fresh(timeout=1.0)
    if c.rank == 0:
        c.iallreduce(np.ones(4))


def report_and_end() -> None:
    """This rank's checks passed: report, and end without the closing barrier (a peer is stuck;
    commlib ends the job with MPI_Abort at exit, as an operation was given up).  The first rank
    to end takes the others with it: wait (10 s at most) until every rank has reported, so that
    a peer still noticing the failure is not ended before it could."""
    with open(os.path.join(sys.argv[2], f"ok.{MPI.COMM_WORLD.rank}"), "w") as f:
        f.write(sys.argv[1])
    until = time.monotonic() + 10
    while time.monotonic() < until and not all(
            os.path.exists(os.path.join(sys.argv[2], f"ok.{r}")) for r in range(MPI.COMM_WORLD.size)):
        time.sleep(0.01)
    sys.exit(0)


def closed_early() -> None:
    """Uneven loops: rank 0 ends (closes) after two operations; the last rank's third one fails at
    once, naming it, instead of waiting for the timeout; rank 0 stays in the collective free."""
    c = fresh(timeout=60)
    for _ in range(2):
        c.allreduce(np.ones(4))
    if c.rank == 0:
        with open(os.path.join(sys.argv[2], "ok.0"), "w") as f:
            f.write(sys.argv[1])
        c.close()       # ended by the others' MPI_Abort
    elif c.rank == c.size - 1:
        t0 = time.monotonic()
        expect(commlib.MismatchError, lambda: c.allreduce(np.ones(4)),
               "allreduce #3 on rank 2 waits for ranks that will not call it: rank 0 closed the "
               "communicator after #2")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def raised_uncaught() -> None:
    """Rank 1's program ends with an uncaught exception: its peers' next call fails at once, and
    names the exception (it said only "its program ended or called close()")."""
    c = fresh(timeout=60)
    c.allreduce(np.ones(4))
    if c.rank == 1:
        with open(os.path.join(sys.argv[2], "ok.1"), "w") as f:
            f.write(sys.argv[1])
        raise ZeroDivisionError("a bad batch")
    expect(commlib.MismatchError, lambda: c.allreduce(np.ones(4)),
           "rank 1 closed the communicator after #1 (its program ended with ZeroDivisionError: a bad batch)")
    report_and_end()


def allgatherv_counts_on_some_ranks() -> None:
    """Rank 0 gives allgatherv its counts, the others let commlib exchange them: every rank fails
    at once, rank 0 naming the exchange (both sides waited for the timeout, and the exchanging
    ranks' message said they had called nothing)."""
    c = fresh(timeout=60)
    counts = [r + 1 for r in range(c.size)]
    t0 = time.monotonic()
    expect(commlib.MismatchError if c.rank == 0 else commlib.CommlibError,
           lambda: c.allgatherv(np.full(c.rank + 1, 1.0), counts=counts if c.rank == 0 else None),
           "rank 1 is in allgatherv's counts exchange" if c.rank == 0 else "")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def side_and_parent_crossed() -> None:
    """Rank 0 in an all-reduce on a split of the world (same ranks), rank 1 in one on the world:
    rank 0's timeout says where rank 1 is (it read "has not called any operation", the split's
    board alone).  Rank 1 gives up later (6 s): it is still in its all-reduce when rank 0 looks."""
    c = fresh(timeout=6.0)
    side = c.split(0)
    side.timeout = 2.0
    if c.rank == 0:
        expect(commlib.CommTimeoutError, lambda: side.allreduce(np.ones(3)),
               "rank 1 has not called any operation (on the communicator this one was split from: "
               "rank 1 in allreduce #1)")
    else:
        expect(commlib.CommlibError, lambda: c.allreduce(np.ones(3)))
    report_and_end()


def synchronize_with_a_peer_gone() -> None:
    """``synchronize()`` watches the operation in progress as ``Work.wait`` does: rank 0's
    all-reduce, which rank 1 (its program ended: closed) never calls, fails at once, naming it (it
    waited without end, past the timeout too)."""
    c = fresh(timeout=60)
    if c.rank == 0:
        c.iallreduce(np.ones(1 << 18))       # 2 MiB: the engine thread's
        t0 = time.monotonic()
        expect(commlib.MismatchError, c.synchronize, "rank 1 closed the communicator after #0")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    else:
        with open(os.path.join(sys.argv[2], f"ok.{c.rank}"), "w") as f:
            f.write(sys.argv[1])
        c.close()       # ended by rank 0's MPI_Abort
    report_and_end()


def synchronize_times_out() -> None:
    """``synchronize()`` ends at the timeout with the wait's error, as ``Work.wait`` does."""
    c = fresh(timeout=1.0)
    if c.rank == 0:
        c.iallreduce(np.ones(1 << 18))
        expect(commlib.CommTimeoutError, c.synchronize, "allreduce #1 timed out after 1 s")
    report_and_end()       # rank 1 never calls it


def closed_with_an_operation_in_flight() -> None:
    """Rank 1's program ends (close at exit) with an all-reduce in flight that rank 0, waiting in a
    call every rank must make, cannot join: the close gives it up at once (the board shows rank 0
    in a call rank 1 has not made), not after the timeout, and rank 0's call fails, naming rank 1."""
    c = fresh(timeout=60)
    t0 = time.monotonic()
    if c.rank == 1:
        c.iallreduce(np.ones(1 << 18))
        time.sleep(0.3)
        c.close()
        assert c.dangling() == ["allreduce #1 (rank 1 of 2)"], c.dangling()
    else:
        expect(commlib.CommAbortedError, lambda: c.allgather_object(0, label="rank 0's call"),
               "rank 1 aborted the communicator after #1: allreduce #1 on rank 1 waits for ranks that "
               "will not call it: rank 0 is in rank 0's call")
        # at once: rank 1 never made the call, so its abort after a later operation is no sign
        # that it passed the call (verdicts.PASSED_ABORT_GRACE_S does not apply)
        assert time.monotonic() - t0 < 1.5, f"{time.monotonic() - t0:.2f} s"
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def split_alone() -> None:
    """Rank 0 splits the communicator alone (it traces a jitted collective alone: ``make_jaxpr`` on
    rank 0, which makes the jitted path's communicator) while its peers all-reduce: MPI's split
    waited without limit and the peers until their timeout, told that rank 0 had called nothing.
    The peers fail at once, naming the split; rank 0's split fails on their abort."""
    c = fresh(timeout=60)
    _called_on_rank0_alone(c, lambda: c.split(0), lambda: c.allreduce(np.ones(2)),
                           "aborted the communicator",
                           "waits for ranks that will not call it: rank 0 is in split")


def _called_on_rank0_alone(c: commlib.Communicator, call, others, rank0_says: str, others_say: str) -> None:
    """Rank 0 makes ``call``, a call every rank must make, alone while its peers make ``others``:
    the peers fail at once (``MismatchError``) naming it, rank 0's call on their abort
    (``CommAbortedError``), none after the timeout."""
    t0 = time.monotonic()
    if c.rank == 0:
        expect(commlib.CommAbortedError, call, rank0_says)
    else:
        expect(commlib.MismatchError, others, others_say)
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def init_alone() -> None:
    """Rank 0 calls ``commlib.init(timeout=60)`` alone (a new world, with settings) while its peers
    all-reduce on the first: rank 0 waited in mpi4py's all-gather without limit, and its peers until
    their timeout, told that rank 0 had called nothing.  The peers fail at once, naming the init;
    rank 0's init fails on their abort."""
    c = commlib.init(timeout=60)
    _called_on_rank0_alone(c, lambda: commlib.init(timeout=60), lambda: c.allreduce(np.ones(2)),
                           "aborted the communicator",
                           "waits for ranks that will not call it: rank 0 is in commlib.init()")


def ddp_hook_timed_out() -> None:
    """DDP with ``register_comm_hook``; rank 1 is late to its backward, past the timeout: rank 0's
    backward raised torch's "Unable to cast <commlib's error> to Tensor" (the reducer casts a Python
    future's result in C++, where ``set_exception`` leaves the error). It now names the error."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks._common import init_gloo
    from commlib.bindings.torch import register_comm_hook

    c = fresh(timeout=1)
    dist, why = init_gloo(MPI.COMM_WORLD, True)
    assert dist is not None, why
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    register_comm_hook(ddp, c)
    if c.rank == 0:
        err = expect(RuntimeError, lambda: ddp(torch.ones(3, 4)).sum().backward(), "CommTimeoutError")
        assert "timed out after 1 s" in str(err) and "Unable to cast" not in str(err), err
    else:
        time.sleep(3)
    report_and_end()


def pass_after_the_average_on_one_rank() -> None:
    """The last rank alone runs ``backward()`` twice before ``step()`` under a strategy that cannot
    add a pass (SelSync, the sparse ones): it raised there alone, and its peers learnt of it only
    when its program ended ("rank 1 closed the communicator").  It is that rank's refusal of its
    next operation now: its peers' next operation raises the same reason at once."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.sparsify import ExDyna, SparseAllReduce

    c = fresh(timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               strategy=SparseAllReduce(selector=ExDyna(0.5)), comm=c)
    odd, x = c.rank == c.size - 1, torch.ones(4, 5)
    t0 = time.monotonic()

    def steps() -> None:
        for step in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            if odd and step == 1:
                model(x).square().mean().backward()
            opt.step()

    err = expect(commlib.ValidationError, steps, "sparse cannot add another pass to them")
    assert odd or f"rank {c.size - 1} rejected its input" in str(err), err
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def horovod_exit_before_a_peers_call() -> None:
    """A Horovod script whose ranks end unevenly: rank 1's program ends (it leaves the engine's
    communicator, its every operation complete); rank 0's extra all-reduce fails at once, naming
    rank 1, instead of waiting for the timeout."""
    import torch

    import commlib.horovod.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(3), name="both")
    if hvd.rank() == 0:
        t0 = time.monotonic()
        expect(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(3), name="alone"),
               "rank 1 left the communicator after #2: process exiting")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    else:
        with open(os.path.join(sys.argv[2], f"ok.{hvd.rank()}"), "w") as f:
            f.write(sys.argv[1])
        sys.exit(0)        # the end of rank 1's program (the job is ended by rank 0's MPI_Abort)
    report_and_end()


def _dear(c: commlib.Communicator, syncbn: bool = False, strategy=None):
    """A small model trained by Adam under ``strategy`` (default DeAR): the optimizer and one step."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer, SyncBatchNorm
    from commlib.collectives import DeAR

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)]
    if syncbn:      # statistics on a side communicator, in the forward
        layers.insert(2, SyncBatchNorm(16, comm=c))
    model = torch.nn.Sequential(*layers)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), model, strategy=strategy or DeAR(),
                               comm=c)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    return opt, step


def _alone_on_rank0(call, rank0_says: str, others_say: str, syncbn: bool = False) -> None:
    """After a DeAR step, rank 0 alone makes ``call(opt)``, a call every rank must make, while
    the others go on stepping: every rank fails at once, naming it, instead of at the timeout."""
    c = fresh(timeout=60)
    opt, step = _dear(c, syncbn=syncbn)
    step()
    _called_on_rank0_alone(c, lambda: call(opt), lambda: [step() for _ in range(3)], rank0_says, others_say)


def _state_on_rank0(syncbn: bool, rank0_says: str) -> None:
    _alone_on_rank0(lambda opt: opt.state_dict(), rank0_says,
                    "rank 0 is in DistributedOptimizer.state_dict() (after #", syncbn)


def state_on_rank0() -> None:
    """Horovod's checkpoint, ``if rank == 0: torch.save(opt.state_dict())``, with DeAR, whose
    state is sharded: rank 0 waits in the state's gather while the others go on to the next
    step; every rank fails at once, naming the call, instead of waiting for the timeout."""
    _state_on_rank0(False, "waits for ranks that will not call it: "
                           "rank 0 is in DistributedOptimizer.state_dict()")


def state_on_rank0_with_syncbn() -> None:
    """The same with SyncBatchNorm: the others wait in the next forward's statistics, on a side
    communicator (its board showed nothing of rank 0's call: they waited for the timeout)."""
    _state_on_rank0(True, "rank 0 is in DistributedOptimizer.state_dict()")


def state_on_rank0_at_the_end() -> None:
    """The same after the last step: the others close the communicator (their program ends)."""
    c = fresh(timeout=60)
    opt, step = _dear(c)
    step()
    if c.rank == 0:
        t0 = time.monotonic()
        expect(commlib.MismatchError, opt.state_dict, "DistributedOptimizer.state_dict() #")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
        report_and_end()
    with open(os.path.join(sys.argv[2], f"ok.{c.rank}"), "w") as f:
        f.write(sys.argv[1])
    c.close()       # ended by rank 0's MPI_Abort


def norm_on_rank0() -> None:
    """A gradient norm logged on rank 0 alone under DeAR, of an order not held with the reduction
    (inf): a call the other ranks never make.  Every rank fails at once, naming it (it met the
    others' collectives inside MPI, which ended the job with an internal assertion)."""
    import torch

    def inf_norm(opt) -> None:
        torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]], float("inf"))
    _alone_on_rank0(inf_norm, "a norm of DeAR's sharded .grad", "rank 0 is in a norm of DeAR's sharded .grad")


def values_on_rank0() -> None:
    """A gradient's values logged on rank 0 alone under DeAR (``p.grad.abs().max()``), a read that
    gathers the whole average: every rank fails at once, naming it (it read rank 0's own pass)."""

    def grad_max(opt) -> None:
        opt.param_groups[0]["params"][0].grad.abs().max()
    _alone_on_rank0(grad_max, "a read of DeAR's sharded .grad's values",
                    "rank 0 is in a read of DeAR's sharded .grad's values")


def close_on_rank0() -> None:
    """``opt.close()`` on rank 0 alone under DeAR (``if rank == 0``: close, then script the model
    and save it): every rank fails at once naming the close, which rank 0's message and its peers'
    read as a read of DeAR's sharded .grad's values (the close gathers them)."""
    _alone_on_rank0(lambda opt: opt.close(), "DistributedOptimizer.close()",
                    "rank 0 is in DistributedOptimizer.close()")


def call_while_ops_in_flight() -> None:
    """Rank 0 enters a call every rank must make (``allgather_object``) alone while its
    nonblocking operation is still in flight; that operation completes during the call (its
    engine thread settles it). Rank 1's next operation must still see rank 0 in the call and fail
    at once, naming it (the settle showed rank 0 idle instead: rank 1 waited for the timeout)."""
    c = fresh(timeout=60)
    t0 = time.monotonic()
    if c.rank == 0:
        work = c.iallreduce(np.ones(4))
        expect(commlib.CommAbortedError, lambda: c.allgather_object(0, label="rank 0's own call"),
               "rank 0's own call")
        # it completed meanwhile; its engine thread may settle it just after the abort reached
        # this thread (seen once with the suite's other tests on the two cores)
        deadline = time.monotonic() + 10
        while not work.test():
            assert time.monotonic() < deadline, "the operation in flight never finished"
            time.sleep(0.01)
    else:
        time.sleep(0.5)             # rank 0 is in its call when this operation completes there
        c.allreduce(np.ones(4))
        expect(commlib.MismatchError, lambda: c.allreduce(np.ones(4)), "rank 0 is in rank 0's own call")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def syncswitch_load_on_rank0() -> None:
    """Horovod's resume (rank 0 alone loads, then broadcasts) of a Sync-Switch checkpoint taken in
    ASP: the load re-enters the phase, a collective (barriers on the store's windows, where rank 0
    waited for good); every rank fails at once, naming it."""
    from commlib.collectives import SchedulePolicy, SyncSwitch, TensorSpec, plan_buckets

    c = fresh(timeout=60)
    buckets = plan_buckets([TensorSpec(0, 64, "float32", 4)], c.size, 1 << 20, None)

    def job() -> SyncSwitch:
        ss = SyncSwitch(policy=SchedulePolicy([(0, "bsp"), (1, "asp")]))
        ss.setup(c, buckets, [np.zeros(b.padded, np.float32) for b in buckets],
                 [np.ones(b.padded, np.float32) for b in buckets])
        return ss
    ss = job()
    ss.step(0.1)
    ss.step(0.1)
    state = ss.state_dict()
    assert state["phase"] == "asp"
    ss.close()
    again = job()
    t0 = time.monotonic()
    if c.rank == 0:
        expect(commlib.CommAbortedError, lambda: again.load_state_dict(state), "SyncSwitch.load_state_dict")
    else:           # broadcast_parameters, the next call of Horovod's resume
        expect(commlib.MismatchError, lambda: c.broadcast(np.ones(4), 0),
               "rank 0 is in SyncSwitch.load_state_dict, re-entering the checkpoint's phase")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def syncswitch_load_on_rank0_unbroadcast() -> None:
    """Through DistributedOptimizer, Horovod's resume of a Sync-Switch ASP checkpoint works (rank 0
    loads, then broadcast_optimizer_state); with that broadcast forgotten, rank 0 re-enters the
    phase alone at its next forward: every rank fails at once, naming the load and its mend."""
    from commlib.bindings.torch import broadcast_parameters
    from commlib.collectives import AllReduce, SchedulePolicy, SyncSwitch
    from commlib.collectives.syncswitch import LOADING

    c = fresh(timeout=60)

    def job():
        policy = SchedulePolicy([(0, "bsp"), (1, "asp")])
        opt, step = _dear(c, strategy=SyncSwitch(bsp=AllReduce(), policy=policy))
        return opt.model, opt.strategy, opt, step
    model, ss, opt, step = job()
    step()
    step()
    assert ss.phase == "asp"
    saved = (model.state_dict(), opt.state_dict())
    opt.close()
    model, ss, opt, step = job()
    if c.rank == 0:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    broadcast_parameters(model.state_dict(), root_rank=0, comm=c)
    t0 = time.monotonic()
    if c.rank == 0:
        expect(commlib.CommAbortedError, step, "SyncSwitch.load_state_dict")
    else:
        expect(commlib.MismatchError, lambda: [step() for _ in range(3)], f"rank 0 is in {LOADING} (after #")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def refused_at_post() -> None:
    """MPI refuses to post an operation on rank 0 (the backend raises: aliased buffers, say): rank 0
    raises ``CommAbortedError`` (the cause attached) and its peers, already inside the operation,
    fail at once, naming rank 0, instead of waiting for the timeout."""
    c = fresh(timeout=60)
    if c.rank == 0:
        def refuse(*args, **kwargs):
            raise RuntimeError("buffers must not be aliased")
        c._host_backend.allreduce = refuse
    t0 = time.monotonic()
    err = expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(4)),
                 "could not post it" if c.rank == 0 else "rank 0 aborted")
    assert c.rank != 0 or isinstance(err.__cause__, RuntimeError)
    assert time.monotonic() - t0 < 30, "peers must not wait for the timeout"
    report_and_end()


def interrupted_in_a_wait() -> None:
    """Ctrl-C (``KeyboardInterrupt``) lands on rank 0 while it waits in an all-reduce its peer has
    not joined yet; the script catches it and goes on (``except KeyboardInterrupt: save()``).  The
    operation stays posted in MPI: rank 0's next call raises, its peer's call fails at once (it
    waited in the operation for good, or to the timeout: "rank 0 closed the communicator"), and
    no later result is silently wrong (the interrupted call's pooled result buffer went back to
    the pool and the next all-reduce was handed it while MPI still wrote it: 2.0 off everywhere)."""
    import signal
    import threading

    c = fresh(timeout=60)
    n = 1 << 20            # a pooled result (from 64 KiB)
    c.barrier()
    if c.rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        expect(KeyboardInterrupt, lambda: c.allreduce(np.full(n, 1.0)))
        expect(commlib.CommAbortedError, lambda: c.allreduce(np.arange(n, dtype=np.float64)),
               "allreduce #2: rank 0 was interrupted while it ran (KeyboardInterrupt)")
    else:
        time.sleep(2.0)
        t0 = time.monotonic()
        expect(commlib.CommAbortedError, lambda: (c.allreduce(np.full(n, 1.0)),
                                                  c.allreduce(np.arange(n, dtype=np.float64))),
               "rank 0 was interrupted")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def interrupted_in_a_work_wait() -> None:
    """Ctrl-C lands on rank 0 in ``Work.wait()`` while the engine's thread runs the all-reduce (its
    peer late): the wait raised ``KeyboardInterrupt`` and the operation went on behind it, so the
    communicator was not aborted and the next call ran (whether it was depended on the timing)."""
    import signal
    import threading

    c = fresh(timeout=60)
    n = 1 << 20            # 8 MiB: the engine's thread takes it at once
    c.barrier()
    if c.rank == 0:
        work = c.iallreduce(np.full(n, 1.0))
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(0.2)
        expect(KeyboardInterrupt, work.wait)
        expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(4)),
               "allreduce #2: rank 0 was interrupted while it ran (KeyboardInterrupt)")
    else:
        time.sleep(2.0)
        t0 = time.monotonic()
        expect(commlib.CommAbortedError, lambda: (c.allreduce(np.full(n, 1.0)), c.allreduce(np.ones(4))),
               "rank 0 was interrupted")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def interrupted_in_allgather_object() -> None:
    """Ctrl-C lands on rank 0 in ``allgather_object`` (its peer late): the communicator went on,
    rank 0's next call waited its whole timeout, and so did its peer."""
    import signal
    import threading

    c = fresh(timeout=60)
    c.barrier()
    if c.rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        expect(KeyboardInterrupt, lambda: c.allgather_object(0, label="config"))
        expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(4)),
               "config #1: rank 0 was interrupted while it ran (KeyboardInterrupt)")
    else:
        time.sleep(2.0)
        t0 = time.monotonic()
        expect(commlib.CommlibError, lambda: c.allgather_object(1, label="config"), "rank 0")
        assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


def peer_process_ends() -> None:
    """Rank 1's process ends without closing (``os._exit``) while rank 0 waits for it: rank 0
    fails at once naming the process (see test_comm_exit.py)."""
    c = fresh(timeout=60)
    c.barrier()
    if c.rank == 1:
        os._exit(1)
    t0 = time.monotonic()
    expect(commlib.CommAbortedError, lambda: c.allreduce(np.ones(4)),
           "rank 1's process (pid ")
    assert time.monotonic() - t0 < 10, "must not wait for the timeout"
    report_and_end()


def injector_with_a_batch_fewer() -> None:
    """DataInjector's exchange where rank 1 has one batch fewer and goes on to its next collective:
    its peers waited in raw MPI ``Probe`` for good, past any timeout; now they fail at once, naming
    rank 1."""
    from commlib.collectives.data import DataInjector

    c = fresh(timeout=60)
    inj = DataInjector(c, 1.0, 0.5)
    inj.exchange(0, np.ones((4, 2)))
    t0 = time.monotonic()
    if c.rank == 1:
        expect(commlib.CommlibError, lambda: c.allreduce(np.ones(1)))
    else:
        expect(commlib.CommlibError, lambda: inj.exchange(1, np.ones((4, 2))), "rank 1")
    assert time.monotonic() - t0 < 30, "must not wait for the timeout"
    report_and_end()


CASES = {f.__name__: f for f in (interrupted_in_a_wait, interrupted_in_a_work_wait,
                                  interrupted_in_allgather_object, injector_with_a_batch_fewer,
                                  peer_process_ends, raised_uncaught,
                                  refused_at_post,
                                  rejected,
                                  rejected_broadcast_left_by_its_root,
                                  jax_op_refused_on_one_rank, jax_optimizer_tree_on_one_rank,
                                  rejected_while_peers_are_late, deadlock,
                                  never_arrives, stall_made_an_error, only_rank0, unwaited, closed_early,
                                  synchronize_with_a_peer_gone, synchronize_times_out,
                                  closed_with_an_operation_in_flight,
                                  state_on_rank0, state_on_rank0_with_syncbn, state_on_rank0_at_the_end,
                                  norm_on_rank0, values_on_rank0, close_on_rank0, call_while_ops_in_flight,
                                  syncswitch_load_on_rank0, syncswitch_load_on_rank0_unbroadcast,
                                  horovod_exit_before_a_peers_call, split_alone, init_alone,
                                  ddp_hook_timed_out, pass_after_the_average_on_one_rank,
                                  allgatherv_counts_on_some_ranks, side_and_parent_crossed)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    # a file per rank: mpiexec may drop a rank's last output when the job is aborted
    with open(os.path.join(sys.argv[2], f"ok.{MPI.COMM_WORLD.rank}"), "w") as f:
        f.write(sys.argv[1])
    MPI.COMM_WORLD.Barrier()   # every rank reports before the first one ends the job
