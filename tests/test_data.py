"""Data partitioning: DefDP, SelDP, the non-IID partitioner, data injection (real point-to-point) and
loaders of uneven length cut by stop_together."""

from __future__ import annotations

import numpy as np
import pytest

import commlib
from commlib.collectives.data import (
    DataInjector,
    DefDP,
    SelDP,
    injected_batch_size,
    label_shards,
    stop_together,
)

from conftest import HAVE_TORCH, ranks_at_most

NS = [1, 7, 10, 64, 101]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", NS)
def test_seldp_covers_the_whole_dataset_on_every_rank(comm, n):
    if n < comm.size:
        pytest.skip("fewer samples than ranks")
    plan = SelDP(n, comm.rank, comm.size, seed=3)
    counts = commlib.split_counts(n, comm.size)
    for epoch in range(3):
        idx = plan.indices(epoch)
        assert np.array_equal(np.sort(idx), np.arange(n))               # the whole data set, once
        # all ranks share the epoch's order and start at their own chunk of it
        order = np.roll(idx, plan.start())
        everyone = comm.allgather(order)
        assert all(np.array_equal(everyone[0], o) for o in everyone)
        start = sum(counts[:comm.rank])
        assert np.array_equal(idx[:counts[comm.rank]], order[start:start + counts[comm.rank]])
        assert len(plan) == n
    if n >= 10:
        assert not np.array_equal(plan.indices(0), plan.indices(1))      # reshuffled per epoch
    firsts = comm.allgather(plan.indices(0)[:1])
    assert len({int(f[0]) for f in firsts}) == comm.size                # different starts


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("seed", [1, -1])
def test_defdp_disjoint_shards(comm, n, drop_last, seed):
    """Disjoint shards covering the data; a negative seed too, as torch's ``DistributedSampler``
    takes one (it failed in numpy at the first iteration)."""
    plan = DefDP(n, comm.rank, comm.size, seed=seed, drop_last=drop_last)
    if drop_last and n < comm.size:
        assert len(plan.indices(0)) == 0
        return
    for epoch in range(2):
        shards = comm.allgather(plan.indices(epoch))
        assert len({len(s) for s in shards}) == 1                        # same number of steps
        allidx = np.concatenate(shards)
        if drop_last:
            assert len(np.unique(allidx)) == len(allidx) == (n // comm.size) * comm.size
        else:
            assert np.array_equal(np.unique(allidx), np.arange(n))
            assert len(allidx) == -(-n // comm.size) * comm.size


def test_a_seed_orders_as_it_did():
    """The entropy words of a non-negative seed are as they were: recorded orders hold."""
    old = np.random.default_rng([7, 3, 0x5E15]).permutation(50)
    np.testing.assert_array_equal(DefDP(50, 0, 1, seed=7).indices(3), old)
    assert not np.array_equal(DefDP(50, 0, 1, seed=-7).indices(3), old)


def test_label_shards_and_partition():
    labels = np.repeat(np.arange(10), 17)
    parts = label_shards(labels, size=4, shards_per_rank=2, seed=0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    for p in parts:
        assert len(np.unique(labels[p])) <= 6                            # few of the 10 labels per rank
    plans = [DefDP(len(labels), r, 4, partition=parts, seed=2) for r in range(4)]
    longest = max(len(p) for p in parts)
    for r, plan in enumerate(plans):
        idx = plan.indices(0)
        assert len(idx) == longest and set(idx.tolist()) == set(parts[r].tolist())
    with pytest.raises(ValueError):
        DefDP(len(labels), 0, 3, partition=parts)


def test_batches_and_bad_arguments():
    plan = SelDP(10, 0, 2, shuffle=False)
    assert [b.tolist() for b in plan.batches(4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(b) for b in plan.batches(4, drop_last=False)] == [4, 4, 2]
    assert injected_batch_size(64, 0.75, 0.75, 4) == 20          # 64 / 3.25
    assert injected_batch_size(64, 0.0, 0.75, 4) == 64
    for bad in [dict(n=-1, rank=0, size=1), dict(n=5, rank=2, size=2), dict(n=5, rank=0, size=0)]:
        with pytest.raises(ValueError):
            SelDP(**bad)
    assert SelDP(0, 0, 1).batches(4, drop_last=False) == []           # an empty data set: no batch
    with pytest.raises(ValueError):
        plan.batches(0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("alpha,beta", [(0.75, 0.75), (0.5, 0.25), (1.0, 1.0), (0.0, 0.5)])
def test_injection_moves_the_right_samples(comm, alpha, beta):
    n, feat, b = 200, 3, 16
    X = np.arange(n * feat, dtype=np.float32).reshape(n, feat)
    Y = np.arange(n, dtype=np.int64) % 10
    local_b = injected_batch_size(b, alpha, beta, comm.size)
    inj = DataInjector(comm, alpha, beta, seed=4)
    plans = [DefDP(n, r, comm.size, seed=5) for r in range(comm.size)]   # every rank's batches, known here
    try:
        for step in range(4):
            lens = [local_b - (r % 2 if step == 3 else 0) for r in range(comm.size)]   # last: short batches
            batch = [plans[r].indices(0)[step * local_b:step * local_b + lens[r]] for r in range(comm.size)]
            mine = batch[comm.rank]
            x, y = inj.exchange(step, X[mine], Y[mine])
            sharers = inj.sharers(step)
            assert len(sharers) == round(alpha * comm.size)
            want = [mine] + [batch[s][:round(beta * lens[s])] for s in sharers if s != comm.rank]
            ref = np.concatenate(want)
            np.testing.assert_array_equal(x, X[ref])
            np.testing.assert_array_equal(y, Y[ref])
        assert comm.mpi_comm.allgather(inj.sharers(7)) == [inj.sharers(7)] * comm.size
    finally:
        inj.close()


@pytest.mark.mpi(min_size=2)
def test_injection_checks_its_calls_and_never_hangs(comm):
    """DataInjector ran raw MPI point-to-point messages: a rank with one batch fewer left its peers
    in ``Probe`` for good (past any timeout), another dtype on one rank was read as garbage rows, a
    sample of zero bytes lost the count.  Now: the same ``ValidationError`` on every rank, and a
    rank that does not come is named at once."""
    inj = DataInjector(comm, 1.0, 0.5, seed=1)
    x = np.ones((4, 2), np.float32 if comm.rank else np.float64)
    with pytest.raises(commlib.ValidationError, match="rank 1 exchanges step 0 with arrays"):
        inj.exchange(0, x)
    with pytest.raises(commlib.ValidationError, match="rank 1 exchanges step 1 with arrays"):
        inj.exchange(1 - (comm.rank == 0), np.ones(3))
    empty, labels = inj.exchange(2, np.ones((6, 0)), np.arange(6))
    assert empty.shape == (6 + 3 * (comm.size - 1), 0) and labels.shape == (6 + 3 * (comm.size - 1),)
    assert comm.allreduce(np.ones(1))[0] == comm.size      # (a rank that does not come: broken.py)


@pytest.mark.mpi(min_size=2)
def test_injection_refuses_a_scalar_and_settings_that_differ(comm):
    """A 0-d array on one rank was sent as a one-sample batch (``ascontiguousarray`` makes it 1-d
    before the check); ranks given other seeds or fractions drew other sharers and exchanged
    a mix of their private draws, without a word."""
    last = comm.rank == comm.size - 1
    inj = DataInjector(comm, 1.0, 1.0, seed=1)
    with pytest.raises(commlib.ValidationError, match=rf"rank {comm.size - 1}: give at least one array"):
        inj.exchange(0, np.float32(7.0) if last else np.zeros(4, np.float32))
    other = DataInjector(comm, 0.5, 1.0, seed=comm.rank if last else 0)
    with pytest.raises(commlib.ValidationError, match=rf"rank {comm.size - 1} has \(alpha, beta, seed\)"):
        other.exchange(0, np.zeros(4))
    assert comm.allreduce(np.ones(1))[0] == comm.size


@pytest.mark.parametrize("args, error, says", [
    ((64, -1, 1, 4), ValueError, r"alpha=-1\): expected a fraction"),
    ((64, 2.0, 0.5, 4), ValueError, r"alpha=2.0\)"),
    ((0, 0.5, 0.5, 4), ValueError, r"batch_size=0\): expected an integer >= 1"),
    ((64, 0.5, 0.5, 0), ValueError, r"size=0\)"),
    ((64, -0.25, 1.0, 4), ValueError, r"alpha=-0.25\)"),
    ((64, "0.5", 0.5, 4), TypeError, r"alpha='0.5'\)"),
])
def test_injected_batch_size_checks_its_arguments(args, error, says):
    """It returned 1, 13, 1, 64 and raised ZeroDivisionError for these."""
    with pytest.raises(error, match=says):
        injected_batch_size(*args)


def test_a_plans_seed_and_epoch_are_integers():
    """A float seed or epoch was truncated silently (1.5 and 1.7 gave 1's shuffle)."""
    from commlib.collectives.data import DefDP

    with pytest.raises(TypeError, match=r"DefDP\(seed=1.5\): expected an integer, got float"):
        DefDP(10, 0, 2, seed=1.5)
    plan = DefDP(10, 0, 2, seed=3)
    with pytest.raises(TypeError, match=r"DefDP.set_epoch\(epoch=1.7\)"):
        plan.set_epoch(1.7)
    plan.set_epoch(np.int64(2))
    assert plan.epoch == 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shortest", [0, 1, 3])
def test_stop_together_stops_every_rank_at_the_shortest(comm, shortest):
    """Rank r has ``shortest + r`` batches (the last rank fewest when rotated); every rank gets the
    first ``shortest`` of its own, in order, with its own collectives in the loop, and the
    communicator is usable after the loop."""
    mine = shortest + (comm.rank + 1) % comm.size
    got = []
    for b in stop_together(iter(range(100 * comm.rank, 100 * comm.rank + mine)), comm):
        got.append(b)
        assert comm.allreduce(np.array([b], np.int64), "max")[0] == 100 * (comm.size - 1) + len(got) - 1
    want = min(shortest + (r + 1) % comm.size for r in range(comm.size))
    assert got == list(range(100 * comm.rank, 100 * comm.rank + want))
    assert comm.allreduce(np.ones(1))[0] == comm.size


@pytest.mark.mpi(min_size=1)
def test_stop_together_break_and_bad_input(comm):
    for i, _ in enumerate(stop_together([1, 2, 3, 4], comm)):     # every rank breaks at the same step
        if i == 1:
            break
    assert comm.allreduce(np.ones(1))[0] == comm.size
    before = comm.seq
    with pytest.raises(TypeError, match="not iterable"):
        stop_together(5, comm)  # type: ignore[arg-type]
    assert comm.seq == before


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_samplers_match_the_plans():
    import torch

    from commlib.bindings.torch_data import DefDPSampler, SelDPSampler

    data = torch.utils.data.TensorDataset(torch.arange(23))
    s = SelDPSampler(data, rank=1, size=3, seed=2)
    s.set_epoch(4)
    assert list(s) == SelDP(23, 1, 3, seed=2).indices(4).tolist() and len(s) == 23
    d = DefDPSampler(23, rank=2, size=3, seed=2)
    assert list(d) == DefDP(23, 2, 3, seed=2).indices(0).tolist() and len(d) == 8
    loader = torch.utils.data.DataLoader(data, batch_size=5, sampler=s)
    got = torch.cat([x for (x,) in loader]).tolist()
    assert sorted(got) == list(range(23))
    d.load_state_dict(s.state_dict())
    assert d.plan.epoch == 4


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("strategy", ["allreduce", "dear"])
def test_uneven_loaders_stop_together_and_train_as_one_process(comm, strategy):
    """Each rank's loader has its own length (the last rank's is shortest); ``stop_together`` ends
    every rank's epoch at the shortest, and training equals one process's on those steps."""
    import torch

    from commlib.bindings.torch import DistributedOptimizer
    from commlib.collectives import AllReduce, DeAR

    rank, size, local, steps = comm.rank, comm.size, 4, 4

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(500 + step)
        return torch.randn(local * size, 6, generator=g), torch.randn(local * size, 3, generator=g)

    def loader(n: int):
        for step in range(n):
            x, y = batch(step)
            yield x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, base = make(rank)
    cls = AllReduce if strategy == "allreduce" else DeAR
    opt = DistributedOptimizer(base, model, strategy=cls(cap_mb=0.0002, first_cap_mb=0.0001), comm=comm)
    for x, y in stop_together(loader(steps - 1 if rank == size - 1 else steps + rank), comm):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ref, ref_opt = make(0)
    for step in range(steps - 1):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(batch(step)[0]), batch(step)[1]).backward()
        ref_opt.step()
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values()):
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=2e-5, atol=2e-6, err_msg=k)


class Squares:
    """A map-style dataset a spawned DataLoader worker unpickles, importing this module (and with it
    commlib.collectives) again."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i * i


def init_commlib_in_worker(worker_id: int) -> None:
    commlib.init()


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@ranks_at_most(2, "each rank spawns its own workers, alike at any rank count; at 4 ranks the "
                  "spawns took 14 s of CI's suite")
def test_spawned_loader_workers_leave_mpi_alone(comm):
    """DataLoader workers started with spawn (forkserver: Python 3.14's default on Linux) import
    commlib again; mpi4py's import initialized MPI there, joining the job through the inherited
    launcher variables (MPICH: "PMI_Init failed", the worker aborted).  Now the workers load, the
    ranks still agree, and a worker that calls commlib.init() gets commlib's error (checked before
    the rank's own communicator, which a forked worker would have inherited)."""
    import os

    import torch

    def loader(context: str, **kw):
        return torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=1,
                                           multiprocessing_context=context, **kw)

    assert torch.cat(list(loader("spawn"))).tolist() == [i * i for i in range(8)]
    assert float(comm.allreduce(np.ones(1))[0]) == comm.size
    if "PMI_RANK" in os.environ:          # under mpiexec: the worker is a rank's child
        with pytest.raises(commlib.CommlibError, match="only the rank's own process communicates"):
            list(loader("spawn", worker_init_fn=init_commlib_in_worker))


def distributed_sampler_shares(n: int, size: int, drop_last: bool) -> tuple[list[list[int]], list[int]]:
    """torch's ``DistributedSampler`` over positions ``0..n-1`` of an epoch's order (unshuffled):
    every rank's share, and its padded (repeated from the start) or cut list put back together
    (rank r's share is that list's ``[r::size]``)."""
    from torch.utils.data import DistributedSampler

    shares = [list(DistributedSampler(range(n), num_replicas=size, rank=r, shuffle=False,
                                      drop_last=drop_last)) for r in range(size)]
    whole = [0] * sum(len(s) for s in shares)
    for r, share in enumerate(shares):
        whole[r::size] = share
    return shares, whole


def defdp_reference(plan: DefDP, epoch: int, rank: int, size: int) -> list[int]:
    """Rank ``rank``'s indices by ``DistributedSampler``'s padding/cutting of ``plan``'s shared order,
    each rank reading a contiguous chunk of it (DefDP's rule) rather than every size-th index."""
    shares, whole = distributed_sampler_shares(plan.n, size, plan.drop_last)
    per = len(shares[rank])
    return plan.order(epoch)[whole[rank * per:(rank + 1) * per]].tolist()


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_defdp_matches_distributed_sampler_on_every_small_case():
    """n 0..9 (0: an empty data set, DistributedSampler yields nothing), 1..4 ranks, drop_last
    (the tail dropped, no index twice) or not (padded from the start), shuffled or not, 3 epochs:
    the same counts per rank as DistributedSampler, the same indices once unshuffled, and its
    padding/cutting of the shared order when shuffled."""
    from torch.utils.data import DistributedSampler

    from commlib.bindings.torch_data import DefDPSampler

    for n in range(10):
        for size in range(1, 5):
            for drop_last in (False, True):
                for shuffle in (False, True):
                    for epoch in (0, 1, 3):
                        case = f"n={n} size={size} drop_last={drop_last} shuffle={shuffle} epoch={epoch}"
                        ours = [DefDPSampler(list(range(n)), rank=r, size=size, seed=7, shuffle=shuffle,
                                             drop_last=drop_last) for r in range(size)]
                        theirs = [DistributedSampler(range(n), num_replicas=size, rank=r, shuffle=shuffle,
                                                     seed=7, drop_last=drop_last) for r in range(size)]
                        for sampler in ours + theirs:
                            sampler.set_epoch(epoch)
                        got, want = [list(o) for o in ours], [list(t) for t in theirs]
                        assert [len(g) for g in got] == [len(o) for o in ours] == [len(w) for w in want], case
                        ref = [defdp_reference(o.plan, epoch, r, size) for r, o in enumerate(ours)]
                        assert got == ref, case
                        flat = sorted(sum(got, []))
                        if not shuffle:
                            assert flat == sorted(sum(want, [])), case
                        if drop_last:
                            assert len(set(flat)) == len(flat) == (n // size) * size, case
                        else:
                            assert set(flat) == set(range(n)) and len(flat) == -(-n // size) * size, case


@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("n", [0, 1, 3, 10, np.int64(10), np.uint8(7)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_defdp_sampler_across_ranks_matches_distributed_sampler(comm, n, drop_last):
    """The sampler on this run's ranks (rank and size from ``comm``), its length given as a number
    (numpy's integers too) or as a data set, 0 included: DistributedSampler's counts on every rank,
    its indices once unshuffled."""
    from torch.utils.data import DistributedSampler

    from commlib.bindings.torch_data import DefDPSampler

    for shuffle in (False, True):
        by_length = DefDPSampler(n, seed=3, shuffle=shuffle, drop_last=drop_last, comm=comm)
        by_data = DefDPSampler(list(range(n)), seed=3, shuffle=shuffle, drop_last=drop_last, comm=comm)
        theirs = DistributedSampler(range(n), num_replicas=comm.size, rank=comm.rank, shuffle=shuffle,
                                    seed=3, drop_last=drop_last)
        for epoch in (0, 2):
            for sampler in (by_length, by_data, theirs):
                sampler.set_epoch(epoch)
            got = list(by_length)
            assert got == list(by_data) and len(by_length) == len(got) == len(theirs)
            assert got == defdp_reference(by_length.plan, epoch, comm.rank, comm.size)
            everyone = comm.mpi_comm.allgather(got)
            if not shuffle:
                assert sorted(sum(everyone, [])) == sorted(sum(comm.mpi_comm.allgather(list(theirs)), []))
            if drop_last:
                flat = sum(everyone, [])
                assert len(set(flat)) == len(flat)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shuffle", [False, True])
def test_defdp_partition_drop_last_cuts_every_set_to_the_shortest(comm, shuffle):
    """With ``partition``, drop_last cuts each rank's walk of its own set to the shortest set's
    length (no index twice, the same count everywhere) instead of padding to the longest."""
    parts = [[0, 1, 2, 3, 4], [5, 6]]
    want = {False: [[0, 1, 2, 3, 4], [5, 6, 5, 6, 5]], True: [[0, 1], [5, 6]]}
    for drop_last in (False, True):
        got = [DefDP(7, r, 2, shuffle=shuffle, drop_last=drop_last, partition=parts).indices(e).tolist()
               for r in range(2) for e in range(3)]
        if not shuffle:
            assert got == [w for w in want[drop_last] for _ in range(3)]
        for r in range(2):
            for e in range(3):
                mine = got[3 * r + e]
                assert len(mine) == len(want[drop_last][r]) and set(mine) <= set(parts[r])
                if drop_last:
                    assert len(set(mine)) == len(mine)
                    padded = DefDP(7, r, 2, shuffle=shuffle, partition=parts).indices(e).tolist()
                    assert mine == padded[:2]            # the same walk, its tail dropped
    # this run's ranks: rank r owns r + 2 indices
    size = comm.size
    uneven = [list(range(10 * r, 10 * r + r + 2)) for r in range(size)]
    n = uneven[-1][-1] + 1
    for drop_last, count in ((False, size + 1), (True, 2)):
        plan = DefDP(n, comm.rank, size, seed=4, shuffle=shuffle, drop_last=drop_last, partition=uneven)
        for epoch in range(2):
            mine = plan.indices(epoch).tolist()
            assert comm.mpi_comm.allgather(len(mine)) == [count] * size
            if drop_last:
                assert len(set(mine)) == count and set(mine) <= set(uneven[comm.rank])
            else:
                assert set(mine) == set(uneven[comm.rank])
    # an empty set: drop_last gives every rank nothing; padding it is refused unless every set is empty
    assert [DefDP(3, r, 2, partition=[[0, 1, 2], []], drop_last=True).indices(0).tolist()
            for r in range(2)] == [[], []]
    assert [DefDP(0, r, 2, partition=[[], []]).indices(0).tolist() for r in range(2)] == [[], []]
    with pytest.raises(ValueError, match="empty"):
        DefDP(3, 0, 2, partition=[[0, 1, 2], []])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [0, 1, 5, 7])
def test_seldp_on_small_and_empty_data_sets(comm, n):
    """Every rank walks the whole data set (``len`` n, as DistributedSampler on one rank; an empty
    data set: nothing, on every rank), each from its own chunk of the shared order."""
    want = {(5, 2): [[0, 1, 2, 3, 4], [3, 4, 0, 1, 2]],
            (7, 3): [[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 0, 1, 2], [5, 6, 0, 1, 2, 3, 4]]}
    for key, lists in want.items():
        assert [SelDP(key[0], r, key[1], shuffle=False).indices(0).tolist() for r in range(key[1])] == lists
    for shuffle in (False, True):
        plan = SelDP(n, comm.rank, comm.size, seed=2, shuffle=shuffle)
        counts = commlib.split_counts(n, comm.size)
        for epoch in range(2):
            mine = plan.indices(epoch).tolist()
            assert len(plan) == len(mine) == n and sorted(mine) == list(range(n))
            firsts = comm.mpi_comm.allgather(mine[:counts[comm.rank]])     # each rank's own chunk first
            assert sorted(sum(firsts, [])) == list(range(n))


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_lengths_and_ranks_take_any_integer_but_bool():
    """A length, rank, size, batch size or partition index: any integer (numpy's too), never a
    bool or a float (which the plans took as ints before, ``2.5`` refused but ``2.0`` and ``True``
    not)."""
    from commlib.bindings.torch_data import DefDPSampler, SelDPSampler

    for n in (np.int64(10), np.int32(10), np.uint16(10)):
        assert list(DefDPSampler(n, rank=1, size=2, seed=1)) == list(DefDPSampler(10, rank=1, size=2, seed=1))
        assert list(SelDPSampler(n, rank=1, size=2, seed=1)) == list(SelDPSampler(range(10), rank=1, size=2,
                                                                                  seed=1))
        assert len(DefDPSampler(n, rank=np.int64(1), size=np.int8(2), drop_last=True)) == 5
    plan = DefDP(np.int64(10), np.int64(0), np.int64(2), shuffle=False)
    assert [b.tolist() for b in plan.batches(np.int64(2))] == [[0, 1], [2, 3]]
    for bad in [dict(n=True), dict(n=10.0), dict(rank=True), dict(rank=1.0), dict(size=2.0), dict(size=True)]:
        args = {"n": 10, "rank": 0, "size": 2, **bad}
        with pytest.raises(ValueError):
            DefDP(**args)
        with pytest.raises(ValueError):
            SelDP(**args)
    for bad in [True, 2.0]:
        with pytest.raises(ValueError):
            plan.batches(bad)
    with pytest.raises(ValueError):
        DefDPSampler(True, rank=0, size=2)
    with pytest.raises(TypeError, match="dataset .* or its length"):
        DefDPSampler(10.0, rank=0, size=2)
    for bad_part in ([[0, 1.5], [2]], [[0.0, 1.0], [2.0]], [[True, False], [2]], [[0, 1], [[2]]]):
        with pytest.raises(ValueError, match="partition"):
            DefDP(3, 0, 2, partition=bad_part)
    parts = [np.array([0, 1], np.int32), (np.uint8(2),)]
    assert DefDP(3, 1, 2, shuffle=False, partition=parts).indices(0).tolist() == [2, 2]
