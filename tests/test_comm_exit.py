"""How jobs end: a broken job raises on every rank, then exits non-zero in bounded time; a job
that leaves its collective objects open exits 0, cleanly.

Each case of ``tests/jobs/broken.py`` and ``tests/jobs/unclosed.py`` runs as its own
``mpiexec`` job (a job left with an operation given up while posted is ended with
``MPI_Abort``, which would end a pytest run too).  Single-process tests: they launch the
jobs themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def run_job(case: str, ranks: int, timeout: float, tmp_path, job: str = "broken.py",
            launcher: tuple[str, ...] = (),
            **env: str) -> tuple[subprocess.CompletedProcess, float, list[int]]:
    """Run the case of ``tests/jobs/JOB`` (``launcher``: more options of ``mpiexec``); return the job,
    its seconds, and the ranks whose checks passed."""
    t0 = time.monotonic()
    proc = subprocess.run([MPIEXEC, *launcher, "-n", str(ranks), sys.executable,
                           os.path.join(HERE, "jobs", job), case, str(tmp_path)],
                          capture_output=True, text=True, timeout=timeout + 60, env={**os.environ, **env})
    ok = sorted(int(name.split(".")[1]) for name in os.listdir(tmp_path) if name.startswith("ok."))
    return proc, time.monotonic() - t0, ok


@pytest.mark.parametrize("case,ranks,timeout", [
    ("rejected", 2, 60), ("refused_at_post", 2, 60), ("rejected_broadcast_left_by_its_root", 2, 60),
    ("jax_op_refused_on_one_rank", 2, 60), ("jax_optimizer_tree_on_one_rank", 2, 60),
    ("rejected_while_peers_are_late", 2, 1),
    ("deadlock", 3, 1),
    ("synchronize_with_a_peer_gone", 2, 60), ("synchronize_times_out", 2, 1),
    ("closed_with_an_operation_in_flight", 2, 60),
    ("raised_uncaught", 2, 60),
    ("never_arrives", 2, 0.5), ("unwaited", 2, 1), ("stall_made_an_error", 3, 2.3), ("closed_early", 3, 60),
    ("state_on_rank0", 2, 60), ("state_on_rank0_at_the_end", 2, 60), ("state_on_rank0_with_syncbn", 2, 60),
    ("norm_on_rank0", 2, 60), ("values_on_rank0", 2, 60), ("close_on_rank0", 2, 60),
    ("call_while_ops_in_flight", 2, 60),
    ("syncswitch_load_on_rank0", 2, 60), ("syncswitch_load_on_rank0_unbroadcast", 2, 60),
    ("horovod_exit_before_a_peers_call", 2, 60), ("split_alone", 2, 60), ("init_alone", 2, 60),
    ("ddp_hook_timed_out", 2, 20), ("pass_after_the_average_on_one_rank", 2, 60),
    ("interrupted_in_a_wait", 2, 60), ("interrupted_in_a_work_wait", 2, 60),
    ("interrupted_in_allgather_object", 2, 60),
    ("injector_with_a_batch_fewer", 2, 60), ("allgatherv_counts_on_some_ranks", 3, 1),
    ("side_and_parent_crossed", 2, 2),
])
def test_broken_job_raises_everywhere_then_exits(case, ranks, timeout, tmp_path):
    proc, took, ok = run_job(case, ranks, timeout, tmp_path)
    out = proc.stdout + proc.stderr
    assert ok == list(range(ranks)), out
    assert proc.returncode != 0, out
    assert took < timeout + 10 + 5, f"{case}: {took:.1f} s\n{out}"   # + job start-up


def test_a_peer_process_that_ends_without_closing_is_named_at_once(tmp_path):
    """Rank 1's process ends with ``os._exit(1)`` under a launcher that leaves its peers running
    (hydra's ``-disable-auto-cleanup``, as Slurm's ``srun`` without ``--kill-on-bad-exit``): rank 0
    waited its whole timeout (60 s here, 30 minutes by default), told that rank 1 was "idle".  It
    sees the process gone (a zombie, not yet reaped) and fails within a second, naming it."""
    proc, took, ok = run_job("peer_process_ends", 2, 60, tmp_path, launcher=("-disable-auto-cleanup",))
    out = proc.stdout + proc.stderr
    assert ok == [0], out
    assert proc.returncode != 0, out
    assert took < 30, f"{took:.1f} s\n{out}"


def test_timed_out_job_exits_within_timeout_plus_10s(tmp_path):
    """The issue's reproducer: COMMLIB_TIMEOUT=5, only rank 0 calls allreduce."""
    proc, took, ok = run_job("only_rank0", 2, 5, tmp_path, COMMLIB_TIMEOUT="5")
    assert ok == [0, 1], proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert took < 5 + 10, f"{took:.1f} s"


@pytest.mark.parametrize("case,ranks,code", [("raised_with_a_split", 2, 1), ("raised_with_a_split", 3, 1),
                                             ("closed_after_the_timeout", 2, 0),
                                             ("closed_after_the_timeout", 3, 0)])
def test_a_rank_ending_apart_from_its_peers(case, ranks, code, tmp_path):
    """One rank raises with a split open: the others fail at once, not after the timeout (60 s in
    the job); one rank closes after its peers' close gave up: nobody hangs (``tests/jobs/ends.py``)."""
    proc, took, ok = run_job(case, ranks, 20, tmp_path, job="ends.py")
    out = proc.stdout + proc.stderr
    assert ok == list(range(ranks)), out
    assert (proc.returncode != 0) == bool(code), out
    assert took < 20, f"{case}: {took:.1f} s\n{out}"


@pytest.mark.parametrize("case,ranks", [("store", 2), ("syncswitch_asp", 2), ("jax_results_held", 2),
                                        ("horovod_ends_with_a_collective", 3),
                                        ("rejected_broadcast_at_the_end", 2), ("forked_child_exits", 2),
                                        ("dropped_on_one_rank", 2), ("closed_after_alike_rejections", 2),
                                        ("finalized_by_the_program", 2)])
def test_what_a_job_leaves_open_is_freed_at_exit(case, ranks, tmp_path):
    """One-sided windows left open (a SyncSwitch job never closes its strategy) are freed
    before MPI_Finalize, and jax results that alias commlib's host memory, held to the end, let
    the process exit: the job ends with 0 and MPI warns of no leaked object.  So does a job whose
    ranks end at once after a Horovod collective, or after a broadcast a peer rejected."""
    proc, _, ok = run_job(case, ranks, 60, tmp_path, job="unclosed.py")
    out = proc.stdout + proc.stderr
    assert ok == list(range(ranks)), out
    assert proc.returncode == 0, out
    assert "WARN" not in out and "leak" not in out.lower(), out
