"""Bad input and mismatched calls end in a clear error on every rank.

Hangs and rejected inputs without check mode leave operations posted, which
ends the job: those cases run as jobs of their own (``test_comm_exit.py``).

Each test that leaves a communicator aborted builds its own (``fresh``), so
the session communicator stays usable.  The pytest-timeout of setup.cfg
guarantees that a regression ends the run instead of hanging it.
"""

from __future__ import annotations

import re
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import commlib


def fresh(**settings) -> commlib.Communicator:
    return commlib.init(comm=MPI.COMM_WORLD, **settings)


@pytest.mark.mpi(min_size=1)
def test_local_validation_messages():
    comm = fresh(check=True, timeout=30)  # check mode: all ranks agree, comm stays usable
    with pytest.raises(commlib.ValidationError, match="not supported"):
        comm.allreduce(np.ones(3, np.uint8))
    column = np.ones((4, 4), np.float32)[:, 0]
    with pytest.raises(commlib.ValidationError, match="not contiguous"):
        comm.allreduce(column, out=column)     # in place: read through a copy, it could not be written
    with pytest.raises(commlib.ValidationError, match="op 'prod'"):
        comm.allreduce(np.ones(3), op="prod")
    with pytest.raises(commlib.ValidationError, match="needs a floating"):
        comm.allreduce(np.ones(3, np.int32), op="avg")
    with pytest.raises(commlib.ValidationError, match="out has 2 elements"):
        comm.allreduce(np.ones(3), out=np.ones(2))
    with pytest.raises(commlib.ValidationError, match="out has dtype"):
        comm.allreduce(np.ones(3), out=np.ones(3, np.float32))
    with pytest.raises(commlib.ValidationError, match="root"):
        comm.broadcast(np.ones(3), root=comm.size)
    with pytest.raises(commlib.ValidationError, match="counts"):
        comm.allgatherv(np.ones(3), counts=[3] * (comm.size + 1))
    with pytest.raises(commlib.ValidationError, match="expected a numpy"):
        comm.allreduce([1.0, 2.0])
    np.testing.assert_array_equal(comm.allreduce(np.ones(2)), np.full(2, comm.size))
    comm.close()


@pytest.mark.mpi(min_size=1)
def test_local_validation_keeps_a_single_rank_world_usable():
    c = commlib.init(comm=MPI.COMM_SELF)
    with pytest.raises(commlib.ValidationError):
        c.allreduce(np.ones(3, np.uint8))
    np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.ones(2))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_check_mode_names_mismatched_op_on_every_rank():
    c = fresh(check=True, timeout=30)
    last = c.size - 1
    x = np.ones(4, np.float32)
    with pytest.raises(commlib.MismatchError) as info:
        if c.rank == last:
            c.broadcast(x, root=0)
        else:
            c.allreduce(x)
    assert info.value.ranks == [last] and info.value.seq == 1
    assert f"rank {last} called (broadcast" in str(info.value)
    # nobody entered: the communicator is still usable
    np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.full(2, c.size))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_check_mode_names_mismatched_shape_and_dtype():
    c = fresh(check=True, timeout=30)
    n = 5 if c.rank == 1 else 4
    with pytest.raises(commlib.MismatchError, match="count=5") as info:
        c.allreduce(np.ones(n, np.float32))
    assert info.value.ranks == [1]
    dt = np.float64 if c.rank == 0 else np.float32
    with pytest.raises(commlib.MismatchError) as info:
        c.allgather(np.ones(3, dt))
    assert info.value.ranks == list(range(1, c.size))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_check_mode_names_a_mismatch_with_allgatherv_on_every_rank():
    """allgatherv agrees on its call before its counts travel: a mismatch there is the
    MismatchError of any call, on every rank (it was wrapped into a ValidationError that blamed
    rank 0, and the extra round it then made left the control channel a round off: the next
    call raised the stale error on one rank and timed out on the other)."""
    c = fresh(check=True, timeout=30)
    last = c.size - 1
    dt = np.float32 if c.rank == last else np.float64
    with pytest.raises(commlib.MismatchError, match=rf"rank {last} called \(allgatherv, float32") as info:
        c.allgatherv(np.ones(3, dt))
    assert info.value.ranks == [last]
    with pytest.raises(commlib.MismatchError, match=rf"rank {last} called \(allreduce") as info:
        if c.rank == last:
            c.allreduce(np.ones(3))
        else:
            c.allgatherv(np.ones(3))
    assert info.value.ranks == [last]
    for _ in range(2):      # the communicator goes on, its rounds aligned
        np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.full(2, c.size))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_check_mode_reports_a_peers_bad_input_on_every_rank():
    """Named once, whichever the operation: allgatherv's agreement (made before its counts travel)
    said every rank rejected it, rank 1's reason nested in each."""
    c = fresh(check=True, timeout=30)
    x = np.ones(3, np.uint8 if c.rank == 1 else np.float32)
    for call in (c.allreduce, c.allgatherv):
        with pytest.raises(commlib.ValidationError, match="rank 1 rejected its input: .*uint8") as got:
            call(x)
        assert str(got.value).count("rejected its input") == 1, got.value
    np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.full(2, c.size))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_an_input_every_rank_rejects_keeps_the_communicator_without_check_mode():
    """Without check mode a call that every rank rejects (each for its own reason, some arriving
    late) raises on every rank and the communicator goes on, as under check mode: it was aborted
    (no rank could tell that no peer had entered the operation).  Also after a rejected
    ``allgatherv`` (whose counts travel first), then an ``allgather_object``, a split, and a close
    right after one."""
    c = fresh(check=False, timeout=60)
    r, n = c.rank, c.size
    bad = {0: lambda: c.allreduce(np.ones(3, np.int32), op="avg"),
           1: lambda: c.allreduce(np.ones(3, np.uint8)),
           2: lambda: c.reduce_scatter(np.ones(3), out=np.empty(7)),
           3: lambda: c.allgatherv(np.ones(3, bool))}
    for k in range(6):
        time.sleep(0.03 * ((r + k) % n))         # each rank in turn arrives last
        with pytest.raises(commlib.ValidationError, match="if a peer called .* with valid input"):
            bad[(r + k) % 3 if k < 4 else 3]()     # allgatherv: on every rank (its counts travel)
        np.testing.assert_array_equal(c.allreduce(np.full(2, r + 1.0)), np.full(2, n * (n + 1) / 2))
    np.testing.assert_array_equal(c.allgatherv(np.arange(r + 1.0)),
                                  np.concatenate([np.arange(q + 1.0) for q in range(n)]))
    with pytest.raises(commlib.ValidationError):
        bad[1]()
    assert c.allgather_object(r, label="after a rejection") == list(range(n))
    with pytest.raises(commlib.ValidationError):
        bad[1]()
    half = c.split(r % 2)
    np.testing.assert_array_equal(half.allreduce(np.ones(1)), [len(range(r % 2, n, 2))])
    with pytest.raises(commlib.ValidationError):
        bad[0]()
    c.close()
    assert c.dangling() == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("color,key,says", [(None, None, "color None is not an integer"),
                                            (1.5, None, "color 1.5 is not an integer"),
                                            (2**40, None, "color 1099511627776 does not fit a C int"),
                                            (0, "k", "key 'k' is not an integer")])
def test_a_bad_split_on_one_rank_raises_on_every_rank(comm, color, key, says):
    """A split's color or key that is not a C int on the last rank alone: every rank raises,
    naming it, and the communicator goes on (the bad rank raised alone, its peers waited in MPI's
    split for good; a float color was truncated).  A numpy integer is an integer."""
    last = comm.rank == comm.size - 1
    with pytest.raises(commlib.ValidationError, match=f"split: rank {comm.size - 1}'s {says}"):
        comm.split(color if last else 0, key if last else None)
    half = comm.split(np.int64(comm.rank % 2), np.int32(-comm.rank))
    assert half.size == len(range(comm.rank % 2, comm.size, 2))
    np.testing.assert_array_equal(half.allgather_object(comm.rank, label="order"),
                                  sorted(range(comm.rank % 2, comm.size, 2), reverse=True))
    half.close()


@pytest.mark.mpi(min_size=2)
def test_an_input_every_rank_rejects_with_operations_in_flight():
    """The same bad call on every rank while a nonblocking all-reduce is in flight on some of them
    (rank 1 waited for it first): every rank raises the rejection, the all-reduce completes, and
    the communicator goes on (the ranks with it in flight aborted, and the others' verdict hung:
    the all-reduce's completion showed them idle over their rejection)."""
    c = fresh(check=False, timeout=60)
    for size in (1024, 1 << 16):
        work = c.iallreduce(np.ones(size))
        if c.rank == 1:
            work.wait()
        with pytest.raises(commlib.ValidationError, match="if a peer called .* with valid input"):
            c.allreduce(np.ones(4, np.int8))
        np.testing.assert_array_equal(work.wait(), np.full(size, c.size))
        np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.full(2, c.size))
    c.close()
    assert c.dangling() == []


@pytest.mark.mpi(min_size=1)
def test_work_wait_timeout_does_not_abort(comm):
    w = comm.iallreduce(np.ones(4))
    assert np.all(w.wait(timeout=60) == comm.size)
    assert w.test()


@pytest.mark.mpi(min_size=2)
def test_work_wait_timeout_ends_the_wait_of_a_lone_operation(comm):
    """``wait(timeout)`` on the only operation in flight, a peer late: ``TimeoutError`` at the
    timeout, and the operation goes on.  Before, the wait took the queued operation over and ran
    it to the peer's arrival (0.8 s), past its timeout."""
    comm.barrier()
    if comm.rank == 0:
        w = comm.iallreduce(np.ones(4))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still running after wait"):
            w.wait(timeout=0.1)
        assert time.monotonic() - t0 < 0.5
        np.testing.assert_array_equal(w.wait(), np.full(4, comm.size))
    else:
        time.sleep(0.8)
        np.testing.assert_array_equal(comm.iallreduce(np.ones(4)).wait(), np.full(4, comm.size))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["blocking", "nonblocking"])
@pytest.mark.parametrize("check", [False, True])
def test_a_stall_warns_once_naming_the_missing_rank_and_the_operation_goes_on(form, check):
    """Under check mode too, where the wait is in the agreement on the call: the message named no
    rank waiting and this rank among those not arrived."""
    c = fresh(timeout=60, stall_warning=0.2, check=check)
    late = c.size - 1
    c.barrier()                                    # #1: everybody; then the last rank dawdles

    def allreduce() -> np.ndarray:
        return c.allreduce(np.ones(4)) if form == "blocking" else c.iallreduce(np.ones(4)).wait()

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        if c.rank == late:
            time.sleep(1.0)
        out = allreduce()
        quiet = allreduce()                       # #3: nobody waits long
    stalls = [str(w.message) for w in got if issubclass(w.category, commlib.CommStallWarning)]
    if c.rank == late:
        assert stalls == []
    else:
        assert len(stalls) == 1, stalls
        assert re.match(rf"allreduce #2 has waited 0\.[2-9]\d* s on rank {c.rank}: ", stalls[0]), stalls[0]
        assert f"not arrived: rank {late} idle after barrier #1" in stalls[0], stalls[0]
        waiting = re.search(r"ranks \[([\d, ]*)\] are waiting in it", stalls[0])
        assert waiting and str(c.rank) in waiting.group(1).split(", "), stalls[0]
        assert "it goes on (CommTimeoutError after 60 s" in stalls[0], stalls[0]
    assert np.all(out == c.size) and np.all(quiet == c.size)
    c.close()


@pytest.mark.mpi(min_size=2)
def test_a_call_stalled_before_any_operation_warns_every_time():
    """``allgather_object`` as the first call (no operation before it) and again after one that
    warned: each stalled wait warns once (the first was taken for operation #0, already warned)."""
    c = fresh(timeout=60, stall_warning=0.2)
    late = c.size - 1
    for round_ in range(2):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            if c.rank == late:
                time.sleep(0.8)
            assert c.allgather_object(round_) == [round_] * c.size
        stalls = [str(w.message) for w in got if issubclass(w.category, commlib.CommStallWarning)]
        assert len(stalls) == (0 if c.rank == late else 1), (round_, stalls)
    c.close()


@pytest.mark.mpi(min_size=2)
def test_an_infinite_timeout_waits_forever_and_closes():
    """``timeout=inf`` (as ``0``: no limit) was accepted, then ``close()`` raised OverflowError
    (the engine thread's join got it) and a job ending with an operation in flight hung."""
    c = fresh(timeout=float("inf"))
    if c.rank == c.size - 1:
        time.sleep(0.3)                         # the others' all-reduce goes to the engine thread
    work = c.iallreduce(np.ones(1 << 18))
    c.timeout = float("inf")
    c.close()                                   # finishes it
    assert work.test() and work.wait()[0] == c.size


@pytest.mark.mpi(min_size=2)
def test_a_peer_aborted_after_a_later_operation_lets_this_one_complete():
    """Rank 1 aborted after #2, so it left #1, whose part it did: a wait for #1 (the root of a
    broadcast still polling barrier #1 at 4 ranks on 2 cores) goes on (it raised CommAbortedError for
    an operation that completes), then gives up after the grace; a wait for #2 or later gives up at once."""
    from commlib.verdicts import PASSED_ABORT_GRACE_S

    c = fresh(timeout=60)
    c.barrier()
    c.barrier()
    if c.rank == 1:
        c.abort("aborted by hand after #2")
    MPI.COMM_WORLD.Barrier()
    if c.rank != 1:
        run = c._run
        assert run.verdict(1, "barrier", 0.0) is None
        for seq in (2, 3):
            assert isinstance(run.verdict(seq, "barrier", 0.0), commlib.CommAbortedError)
        time.sleep(PASSED_ABORT_GRACE_S)
        err = run.verdict(1, "barrier", 0.0)
        assert isinstance(err, commlib.CommAbortedError)
        assert "rank 1 aborted the communicator after #2" in str(err)
    c.close()        # aborted here or on a peer: frees nothing, waits for nobody


@pytest.mark.mpi(min_size=1)
def test_init_after_close_makes_a_new_communicator():
    """As ``hvd.init()`` after ``hvd.shutdown()``: ``init()`` returned the closed one."""
    first = commlib.init(timeout=120)
    first.close()
    assert first.closed
    again = commlib.init()
    assert again is not first and not again.closed and commlib.init() is again
    assert again.allreduce(np.ones(2))[0] == again.size


@pytest.mark.mpi(min_size=2)
def test_settings_refused_or_differing_on_one_rank_fail_init_on_every_rank():
    """A setting refused on rank 1 alone (a bad ``COMMLIB_TIMEOUT`` exported on one node, a
    keyword's typo) raised there while its peers waited in ``init()`` for good; ``COMMLIB_CHECK``
    set on one rank alone left the first operation waiting its whole timeout.  ``init()`` raises on
    every rank, naming the rank and the setting, and the next ``init()`` works."""
    rank = MPI.COMM_WORLD.rank

    def init_raises(error, match, **settings):
        with pytest.raises(error, match=match):
            commlib.init(comm=MPI.COMM_WORLD, **settings)

    one = rank == 1
    init_raises(commlib.ValidationError, "timeout='abc'" if one else "rank 1: ValidationError: timeout='abc'",
                **({"timeout": "abc"} if one else {}))
    init_raises(TypeError if one else commlib.ValidationError, r"unknown commlib setting.*'timeuot'",
                **({"timeuot": 5} if one else {}))
    init_raises(commlib.ValidationError, r"COMMLIB_CHECK \(keyword check\) differs across ranks \(rank 0: "
                r"False, rank 1: True", check=one)
    init_raises(commlib.ValidationError, r"COMMLIB_BACKEND .* differs", backend="auto" if one else "mpi")
    c = commlib.init(comm=MPI.COMM_WORLD, check=True, timeout=60)
    assert c.allreduce(np.ones(2))[0] == c.size
    c.close()


@pytest.mark.mpi(min_size=1)
def test_default_timeout_is_torch_distributeds(monkeypatch):
    """Long enough for a rank-0-only evaluation or checkpoint that DDP survives."""
    torch_constants = pytest.importorskip("torch.distributed.constants")
    monkeypatch.delenv("COMMLIB_TIMEOUT", raising=False)
    assert commlib.Config.from_env().timeout == torch_constants.default_pg_timeout.total_seconds()
    assert commlib.Config().timeout == commlib.Config.from_env().timeout


@pytest.mark.mpi(min_size=1)
def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUT", "7.5")
    monkeypatch.setenv("COMMLIB_CHECK", "1")
    cfg = commlib.Config.from_env()
    assert cfg.timeout == 7.5 and cfg.check
    assert commlib.Config.from_env(timeout=3).timeout == 3  # keyword wins
    monkeypatch.setenv("COMMLIB_CHECK", "maybe")
    with pytest.raises(commlib.ValidationError, match="COMMLIB_CHECK"):
        commlib.Config.from_env()
    monkeypatch.delenv("COMMLIB_CHECK")
    with pytest.raises(commlib.ValidationError, match="backend"):
        commlib.Config.from_env(backend="gloo")
    with pytest.raises(TypeError, match="unknown"):
        commlib.Config.from_env(timeuot=3)
    for var, key, good, bad in [("COMMLIB_STALL_WARNING", "stall_warning", 0, "soon"),
                                ("COMMLIB_DEVICE", "device", 3, "gpu0")]:
        monkeypatch.setenv(var, str(good))
        assert getattr(commlib.Config.from_env(), key) == good
        assert getattr(commlib.Config.from_env(**{key: 1}), key) == 1     # keyword wins
        monkeypatch.setenv(var, bad)
        with pytest.raises(commlib.ValidationError, match=var):
            commlib.Config.from_env()
        monkeypatch.delenv(var)
        with pytest.raises(commlib.ValidationError, match=key):
            commlib.Config.from_env(**{key: -1})
    # out of range, from a variable: the variable is named (it said "poll_spin -1.0")
    for var, key in [("COMMLIB_POLL_SPIN", "poll_spin"), ("COMMLIB_TIMEOUT", "timeout"),
                     ("COMMLIB_STALL_WARNING", "stall_warning")]:
        monkeypatch.setenv(var, "-1")
        with pytest.raises(commlib.ValidationError, match=f"^{var}=-1.0: expected seconds >= 0"):
            commlib.Config.from_env()
        with pytest.raises(commlib.ValidationError, match=f"^{key}=-2.0: expected seconds >= 0"):
            commlib.Config.from_env(**{key: -2})
        monkeypatch.delenv(var)


@pytest.mark.mpi(min_size=1)
def test_config_keywords_are_read_as_their_variables():
    """A keyword of init() is parsed as its COMMLIB_* variable is (``cuda_aware="auto"`` stayed the
    string, a truthy one: device pointers would have gone to an MPI that is not CUDA-aware), and a
    bad one is refused naming the keyword."""
    cfg = commlib.Config.from_env
    assert cfg(cuda_aware="auto").cuda_aware is None
    assert cfg(cuda_aware="1").cuda_aware is True and cfg(cuda_aware=0).cuda_aware is False
    assert cfg(check="0").check is False and cfg(check="yes").check is True and cfg(check=1).check
    assert cfg(timeout="5").timeout == 5.0 and cfg(poll_spin="inf").poll_spin == float("inf")
    assert cfg(backend="MPI").backend == "mpi" and cfg(device="2").device == 2
    for kw, match in [({"timeout": "soon"}, "timeout='soon': expected seconds"),
                      ({"timeout": True}, "expected seconds"), ({"check": "maybe"}, "check='maybe'"),
                      ({"cuda_aware": "sometimes"}, "expected auto, 0 or 1"),
                      ({"device": True}, "device=True"), ({"backend": "gloo"}, "backend='gloo'"),
                      ({"timeline": 3}, "expected a file path")]:
        with pytest.raises(commlib.ValidationError, match=match):
            cfg(**kw)


@pytest.mark.mpi(min_size=1)
def test_device_choice():
    """The ``device`` setting wins, then a current device the user chose (not 0), then the local rank."""
    from commlib.device import choose_device

    assert [choose_device(r, 4, None, 0) for r in range(4)] == [0, 1, 2, 3]
    assert choose_device(5, 4, None, 0) == 1                   # more ranks than GPUs: wraps
    assert choose_device(2, 4, None, 3) == 3                   # torch.cuda.set_device(3) before init
    assert choose_device(2, 4, 0, 3) == 0                      # device=0 asked for


@pytest.mark.mpi(min_size=1)
def test_nccl_plan_agrees_on_every_rank_whatever_each_rank_sees():
    """The detection at init() is collective and its verdict the same everywhere, given each
    rank's own GPU count and current device (here stated, as a GPU node would report them)."""
    from commlib import _nccl_plan

    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    lrank, lsize = local.rank, local.size
    local.Free()
    assert _nccl_plan(world, "auto", None, gpus=lsize, current=lambda: 0) == ("nccl", lrank)
    assert _nccl_plan(world, "nccl", None, gpus=lsize, current=lambda: lsize - 1) == (
        "nccl", lsize - 1 if lsize > 1 else lrank)          # a device the user chose (not 0) is kept
    assert _nccl_plan(world, "mpi", None) == ("mpi", None)  # no collective
    # the last rank alone lacks cupy: every rank falls back to MPI, or refuses NCCL naming it
    short = lsize if world.rank != world.size - 1 else 0
    assert _nccl_plan(world, "auto", None, gpus=short, current=lambda: 0) == ("mpi", None)
    with pytest.raises(commlib.ValidationError, match=rf"rank {world.size - 1}: 0 GPU"):
        _nccl_plan(world, "nccl", None, gpus=short, current=lambda: 0)
    with pytest.raises(commlib.ValidationError, match=r"rank 0: device 9 asked for, but \d+ GPU"):
        _nccl_plan(world, "nccl", 9, gpus=lsize, current=lambda: 0)
    assert world.allreduce(1) == world.size                  # nobody was left inside a collective


@pytest.mark.mpi(min_size=1)
def test_nccl_without_a_gpu_per_rank_raises_on_every_rank_before_any_nccl_call():
    """Every rank takes part in the detection whatever its cupy does: without cupy and a GPU per
    rank, backend='nccl' raises the same error on every rank (no rank waits in NCCL's set-up),
    and the communicator built after it on the same ranks works."""
    from conftest import HAVE_GPU

    if HAVE_GPU:
        pytest.skip("this machine has a GPU per rank (tests/test_gpu.py covers NCCL there)")
    with pytest.raises(commlib.ValidationError, match=r"backend 'nccl' needs .*rank 0: 0 GPU"):
        commlib.init(comm=MPI.COMM_WORLD, backend="nccl")
    c = commlib.init(comm=MPI.COMM_WORLD, backend="auto")
    assert c.backend == "mpi"
    np.testing.assert_array_equal(c.allreduce(np.ones(2)), np.full(2, c.size))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_check_mode_compares_given_allgatherv_counts_on_every_rank():
    """``COMMLIB_CHECK=1``: ``allgatherv``'s counts travel even when given; counts that are not the
    ranks' (rank 0 wrong about rank 1's) raise ``ValidationError`` on every rank instead of each rank
    gathering its own idea of the layout; ranks that give counts and ranks that do not agree."""
    c = fresh(check=True, timeout=30)
    x = np.arange(c.rank + 1.0)
    right = list(range(1, c.size + 1))
    wrong = [1, 1, *right[2:]] if c.rank == 0 else right
    with pytest.raises(commlib.ValidationError, match=r"rank 0 rejected its input: .*counts \[1, 1"):
        c.allgatherv(x, counts=wrong)
    want = np.concatenate([np.arange(r + 1.0) for r in range(c.size)])
    np.testing.assert_array_equal(c.allgatherv(x, counts=right if c.rank % 2 else None), want)
    c.close()



@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("check", [False, True])
def test_allgatherv_counts_that_are_not_integers_are_refused_on_every_rank(check):
    """Counts of 1.5 and 0.5 were cut to 1 and 0 (the rank given 0 then refused its one element,
    alone); 1.0 passed: each is refused, alike on every rank, and the communicator goes on."""
    c = fresh(check=check, timeout=30)
    x = np.ones(1)
    for counts in ([1.5] + [0.5] * (c.size - 1), [1.0] * c.size):
        with pytest.raises(commlib.ValidationError, match="counts must be .* non-negative integers"):
            c.allgatherv(x, counts=counts)
    np.testing.assert_array_equal(c.allgatherv(x, counts=np.ones(c.size, np.int64)), np.ones(c.size))
    c.close()


@pytest.mark.mpi(min_size=2)
def test_a_peer_that_left_after_an_operation_lets_it_complete():
    """``leave()`` (the Horovod API at exit, every operation complete there): a peer still to
    poll the last operation completes it (an abort there failed it: 2 runs in 6 of a 3-rank
    Horovod script ending in a barrier exited 1); no rank frees the communicator.  A wait for a
    later operation fails at once: ``tests/jobs/broken.py`` ``horovod_exit_before_a_peers_call``."""
    c = fresh(timeout=30)
    x = np.full(3, c.rank + 1.0)
    work = c.iallreduce(x)
    if c.rank != 0:
        work.wait()
        assert c.leave("ended")
        assert not c.leave("again")
        with pytest.raises(commlib.CommAbortedError, match="left the communicator: ended"):
            c.allreduce(x)
    MPI.COMM_WORLD.Barrier()                    # rank 0 polls only once its peers have left
    if c.rank == 0:
        np.testing.assert_array_equal(work.wait(), np.full(3, c.size * (c.size + 1) / 2))
    c.close()                                   # frees nothing: the peers left
    MPI.COMM_WORLD.Barrier()
