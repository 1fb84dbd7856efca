"""The engine behind :mod:`commlib.horovod.torch`: one thread that runs Horovod requests over commlib.

Horovod matches operations across ranks by name in a background thread; commlib's rule
is that every rank calls the same collectives in the same order.  This engine keeps
commlib's rule and Horovod's surface:

* every asynchronous call queues a :class:`Request` and returns at once (``poll`` is
  False until the engine has run it);
* a *round*: the engine thread takes up to :data:`MAX_BATCH` queued requests and all
  ranks all-gather one row describing them (kind, dtype, device, shape, reduce op,
  root, scale factors, name); position ``j`` of every rank's batch is the same
  operation, checked before any data moves, so a mismatch (shape, dtype, root,
  operation, explicit name) fails that request on every rank instead of hanging;
* agreed all-reduces of one dtype, op and scaling are fused into one flat buffer
  (Horovod's tensor fusion, up to :data:`FUSION_BYTES`);
* ``join()``: a joined rank keeps taking part in rounds, contributing zeros to the
  other ranks' all-reduces (other collectives fail on the ranks that called them),
  until every rank has joined.

The thread sleeps on a condition variable when nothing is queued; it runs only
collectives its caller asked for.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from commlib.backends.base import split_counts

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
REDUCE_OPS = ("average", "sum", "min", "max", "product")
#: the torch dtypes Horovod carries, by code; commlib carries the narrow integers as int32
DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool)
_NATIVE = {torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64}
_FLOAT = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
MAX_BATCH = 16
FUSION_BYTES = 64 << 20
_SHAPE_SLOTS = 8
_FIELDS = 10 + _SHAPE_SLOTS      # kind dtype device root op pre post name valid ndim shape...
_HEADER = 2                      # count, joined


class HorovodInternalError(RuntimeError):
    """An operation failed on every rank (mismatched inputs across ranks, or the job broke)."""


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def carrier(dtype: torch.dtype) -> torch.dtype:
    """The dtype commlib moves ``dtype`` as (narrow integers and bool widen to int32)."""
    return dtype if dtype in _NATIVE else torch.int32


def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` as Horovod scales: integers in float64 (truncated back),
    half precision in float32, float32/float64 in their own precision."""
    if factor == 1.0:
        return t
    if t.dtype in (torch.float32, torch.float64):
        return t * torch.tensor(factor, dtype=t.dtype, device=t.device)
    if t.dtype in _FLOAT:
        return (t.float() * torch.tensor(factor, dtype=torch.float32, device=t.device)).to(t.dtype)
    return (t.double() * factor).to(t.dtype)


def to_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s elements as bytes (uint8, on the host).  An empty tensor has none (torch cannot view
    an empty tensor of stride 0, as an expanded gradient's, as bytes).

    Example:
        >>> to_bytes(torch.ones(2, dtype=torch.int16))
        array([1, 0, 1, 0], dtype=uint8)
    """
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def from_bytes(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes ``raw`` (uint8) as a ``dtype`` tensor of ``shape``.  No bytes make an empty tensor
    (torch cannot view an empty byte array, whose stride is 0, as a wider dtype).

    Example:
        >>> from_bytes(np.empty(0, np.uint8), torch.float32, (0, 3)).shape
        torch.Size([0, 3])
    """
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).view(shape)


@dataclass(eq=False)
class Request:
    """One queued operation; ``done`` is set when its result or error is in."""

    kind: str
    tensor: torch.Tensor | None = None
    inplace: bool = False
    name: str | None = None
    op: str = "sum"
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: list[int] | None = None
    problem: str | None = None          # rejected on this rank (raised as ValueError)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def row(self) -> list[int]:
        t = self.tensor
        shape = list(t.shape) if t is not None else []
        if len(shape) > _SHAPE_SLOTS:
            shape = shape[:_SHAPE_SLOTS - 1] + [_hash63(str(shape[_SHAPE_SLOTS - 1:]))]
        shape += [-1] * (_SHAPE_SLOTS - len(shape))
        return [KINDS.index(self.kind),
                DTYPES.index(t.dtype) if t is not None and t.dtype in DTYPES else -1,
                0 if t is None or t.device.type == "cpu" else 1,
                self.root, REDUCE_OPS.index(self.op), _bits(self.prescale), _bits(self.postscale),
                _hash63(self.name) if self.name else 0, int(self.problem is None),
                t.dim() if t is not None else 0, *shape]

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def _describe(row: np.ndarray) -> str:
    nd = int(row[9])
    shape = [int(v) for v in row[10:10 + min(nd, _SHAPE_SLOTS)]]
    dt = str(DTYPES[int(row[1])]).removeprefix("torch.") if row[1] >= 0 else "?"
    return f"{KINDS[int(row[0])]} {dt}{shape}"


def check_position(rows: dict[int, np.ndarray], joined: list[int], size: int) -> str | None:
    """Why the ranks' requests at one position cannot run together (``None``: they can)."""
    ranks = sorted(rows)
    r0 = rows[ranks[0]]
    bad = [r for r in ranks if rows[r][8] == 0]
    if bad:
        return f"ranks {bad} rejected their input"
    if KINDS[int(r0[0])] == "broadcast" and not 0 <= int(r0[3]) < size:
        return f"broadcast root rank {int(r0[3])} is not a rank of 0..{size - 1}"
    for r in ranks[1:]:
        row = rows[r]
        if row[0] != r0[0]:
            return (f"mismatched operations: rank {ranks[0]} called {_describe(r0)}, "
                    f"rank {r} called {_describe(row)} (commlib.horovod matches operations in "
                    "the order each rank submits them)")
        if row[7] and r0[7] and row[7] != r0[7]:
            return (f"mismatched names at the same position: ranks {ranks[0]} and {r} submitted "
                    "differently named operations (operations run in submission order on every rank)")
    kind = KINDS[int(r0[0])]
    if joined and (kind not in ("allreduce", "barrier") or REDUCE_OPS[int(r0[4])] == "product"):
        return (f"{kind} cannot run after ranks {joined} called join() "
                "(only sum/average/min/max allreduce can)")
    for r in ranks[1:]:
        row = rows[r]
        a, b = _describe(r0), _describe(row)
        if row[1] != r0[1]:
            return f"mismatched data types: rank {ranks[0]} sent {a}, rank {r} sent {b}"
        if row[2] != r0[2]:
            return f"mismatched devices: ranks {ranks[0]} and {r} (one CPU, one GPU)"
        same = (row[9:] == r0[9:]).all() if kind in ("allreduce", "broadcast", "reducescatter") else \
            row[9] == r0[9] and (row[11:] == r0[11:]).all()
        if not same:
            what = "tensor shapes" if kind != "allgather" and kind != "alltoall" else \
                "tensor shapes (all dimensions but the first must agree)"
            return f"mismatched {kind} {what}: rank {ranks[0]} sent {a}, rank {r} sent {b}"
        if kind == "broadcast" and row[3] != r0[3]:
            return (f"mismatched broadcast root ranks: rank {ranks[0]} gave {int(r0[3])}, "
                    f"rank {r} gave {int(row[3])}")
        if kind in ("allreduce", "reducescatter") and (row[4:7] != r0[4:7]).any():
            return f"mismatched {kind} reduce op or scale factors: ranks {ranks[0]} and {r}"
    return None


class Engine:
    """Runs requests on its own thread over ``comm`` (a commlib Communicator used by nothing else)."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self._queue: deque[Request] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._stopped_by: HorovodInternalError | None = None      # the error that stopped the loop
        self._joined_before: set[int] = set()
        self._thread = threading.Thread(target=self._loop, name=f"commlib-horovod-r{self.rank}", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> Request:
        with self._cv:
            if self._stopped_by is not None:       # as Horovod: the job broke, this process cannot go on
                raise HorovodInternalError(f"commlib.horovod: no operation can run after the engine "
                                           f"stopped ({self._stopped_by})")
            if self._closed:
                raise ValueError("Horovod has been shut down; call hvd.init() first")
            self._queue.append(req)
            self._cv.notify()
        return req

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the thread; False if it is still busy after ``timeout`` s."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ rounds
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch: list[Request] = []
                for req in list(self._queue)[:MAX_BATCH]:
                    if req.kind == "join":
                        break
                    batch.append(req)
                joining = not batch
            try:
                with torch.no_grad():
                    self._round(batch, joining)
            except BaseException as exc:  # noqa: BLE001 - the communicator broke: fail everything queued
                with self._cv:
                    pending, self._queue = list(self._queue), deque()
                    self._closed = True
                err = exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                    f"commlib.horovod: the engine stopped: {type(exc).__name__}: {exc}")
                self._stopped_by = err
                for req in pending:
                    req.finish(error=err)
                return

    def _round(self, batch: list[Request], joining: bool) -> None:
        row = np.full(_HEADER + MAX_BATCH * _FIELDS, -1, np.int64)
        row[0], row[1] = len(batch), int(joining)
        for j, req in enumerate(batch):
            row[_HEADER + j * _FIELDS:_HEADER + (j + 1) * _FIELDS] = req.row()
        table = np.asarray(self.comm.allgather(row, tag="horovod-negotiate")).reshape(self.size, -1)
        joined = [r for r in range(self.size) if table[r, 1] == 1]
        if len(joined) == self.size:
            new = set(joined) - self._joined_before
            last = max(new) if new else max(joined)
            self._joined_before = set()
            with self._cv:
                req = self._queue.popleft()
            req.finish(torch.tensor(last, dtype=torch.int32))
            return
        self._joined_before = set(joined)
        active = [r for r in range(self.size) if r not in joined]
        m = int(min(table[r, 0] for r in active))
        if m == 0:
            return
        positions = []
        for j in range(m):
            sl = slice(_HEADER + j * _FIELDS, _HEADER + (j + 1) * _FIELDS)
            rows = {r: table[r, sl] for r in active}
            positions.append((rows[active[0]], check_position(rows, joined, self.size), rows))
        mine = batch[:m] if not joining else [None] * m
        self._execute(mine, positions, table, joined)
        if not joining:
            with self._cv:
                for _ in range(m):
                    self._queue.popleft()

    def _fail(self, req: Request | None, why: str) -> None:
        if req is None:
            return
        if req.problem is not None:
            req.finish(error=ValueError(req.problem))
        else:
            req.finish(error=HorovodInternalError(why))

    def _execute(self, mine: list[Request | None], positions: list, table: np.ndarray,
                 joined: list[int]) -> None:
        j = 0
        while j < len(positions):
            row, why, rows = positions[j]
            if why is not None:
                self._fail(mine[j], why)
                j += 1
                continue
            kind = KINDS[int(row[0])]
            if kind == "allreduce" and REDUCE_OPS[int(row[4])] != "product":
                k = j + 1
                nbytes = self._numel(row) * DTYPES[int(row[1])].itemsize
                while k < len(positions) and positions[k][1] is None and \
                        (positions[k][0][:7] == row[:7]).all() and \
                        nbytes + self._numel(positions[k][0]) * DTYPES[int(row[1])].itemsize <= FUSION_BYTES:
                    nbytes += self._numel(positions[k][0]) * DTYPES[int(row[1])].itemsize
                    k += 1
                self._allreduce(mine[j:k], [p[0] for p in positions[j:k]])
                j = k
                continue
            req = mine[j]
            try:
                if kind == "allreduce":
                    self._product(req, row)
                elif kind == "allgather":
                    self._allgather(req, rows)
                elif kind == "broadcast":
                    self._broadcast(req, int(row[3]))
                elif kind == "alltoall":
                    self._alltoall(req)
                elif kind == "reducescatter":
                    self._reducescatter(req, row)
                else:
                    self.comm.barrier(tag="horovod-barrier")
                    if req is not None:
                        req.finish()
            except Exception as exc:  # noqa: BLE001 - handed to the caller's synchronize()
                if req is not None and not req.done.is_set():
                    req.finish(error=exc)
            j += 1

    @staticmethod
    def _numel(row: np.ndarray) -> int:
        nd = int(row[9])
        return int(np.prod([int(v) for v in row[10:10 + nd]], dtype=np.int64)) if nd else 1

    # ------------------------------------------------------------------ operations
    def _flat(self, req: Request, prescale: float = 1.0) -> torch.Tensor:
        """``req``'s tensor times ``prescale``, 1-D and dense (a strided 1-D view, a matrix's column,
        is copied: ``reshape`` leaves it strided), in the dtype it travels in."""
        t = scale(req.tensor, prescale).reshape(-1).contiguous()
        return t.to(carrier(t.dtype))

    def _allreduce(self, reqs: list[Request | None], rows: list[np.ndarray]) -> None:
        row = rows[0]
        dtype = DTYPES[int(row[1])]
        op = REDUCE_OPS[int(row[4])]
        pre, post = struct.unpack("<dd", struct.pack("<qq", int(row[5]), int(row[6])))
        device = reqs[0].tensor.device if reqs[0] is not None else torch.device("cpu")
        pieces = []
        for req, r in zip(reqs, rows):
            if req is None:      # joined: zeros of the agreed size
                pieces.append(torch.zeros(self._numel(r), dtype=carrier(dtype), device=device))
            else:
                pieces.append(self._flat(req, pre))
        if len(pieces) == 1:
            p, req0 = pieces[0], reqs[0]
            buf = p if req0 is None or req0.inplace or p.data_ptr() != req0.tensor.data_ptr() else p.clone()
        else:
            buf = torch.cat(pieces)
        self.comm.allreduce(buf, "sum" if op == "average" else op, out=buf, tag="horovod-allreduce")
        offset = 0
        for req, p in zip(reqs, pieces):
            n = p.numel()
            if req is not None:
                out = self._finish_reduce(buf[offset:offset + n].to(dtype), op, post).view(req.tensor.shape)
                if req.inplace:
                    if out.data_ptr() != req.tensor.data_ptr():
                        req.tensor.copy_(out)
                    out = req.tensor
                req.finish(out)
            offset += n

    def _finish_reduce(self, t: torch.Tensor, op: str, post: float) -> torch.Tensor:
        """Average: times ``post / size`` (one scale, as Horovod's; integers in float64, truncated
        toward zero); the other ops: times ``post``."""
        return scale(t, post / self.size if op == "average" else post)

    def _product(self, req: Request | None, row: np.ndarray) -> None:
        if req is None:
            raise HorovodInternalError("product all-reduce after join()")
        pre, post = struct.unpack("<dd", struct.pack("<qq", int(row[5]), int(row[6])))
        flat = self._flat(req, pre)
        gathered = self.comm.allgather(flat, tag="horovod-product")
        out = scale(gathered.prod(0).to(req.tensor.dtype), post).view(req.tensor.shape)
        if req.inplace:
            req.tensor.copy_(out)
            out = req.tensor
        req.finish(out)

    def _allgather(self, req: Request, rows: dict[int, np.ndarray]) -> None:
        t = req.tensor if req.tensor.dim() else req.tensor.reshape(1)
        tail = list(t.shape[1:])
        tail_numel = int(np.prod(tail, dtype=np.int64)) if tail else 1
        firsts = [int(rows[r][10]) if rows[r][9] > 0 else 1 for r in range(self.size)]
        flat = self._flat(req)
        out = self.comm.allgatherv(flat, [f * tail_numel for f in firsts], tag="horovod-allgather")
        req.finish(out.to(t.dtype).view(sum(firsts), *tail))

    def _broadcast(self, req: Request, root: int) -> None:
        t = req.tensor
        if req.inplace and t.dtype in _NATIVE and t.is_contiguous():
            self.comm.broadcast(t.view(-1), root, out=t.view(-1), tag="horovod-broadcast")
            req.finish(t)
            return
        buf = t.reshape(-1).to(carrier(t.dtype), copy=True)
        self.comm.broadcast(buf, root, out=buf, tag="horovod-broadcast")
        out = buf.to(t.dtype).view(t.shape)
        if req.inplace:
            t.copy_(out)
            out = t
        req.finish(out)

    def _alltoall(self, req: Request) -> None:
        from mpi4py import MPI

        t = req.tensor
        tail = list(t.shape[1:])
        row_bytes = (int(np.prod(tail, dtype=np.int64)) if tail else 1) * t.element_size()
        splits = req.splits if req.splits is not None else [t.shape[0] // self.size] * self.size
        try:    # read before the splits travel: a rank that cannot says so there, and every rank raises
            send, problem = to_bytes(t), None
        except Exception as exc:  # noqa: BLE001 - raised below, after the peers have heard of it
            send, problem = None, exc
        mine = np.asarray([*splits, int(problem is not None)], np.int64)
        table = np.asarray(self.comm.allgather(mine, tag="horovod-splits")).reshape(self.size, -1)
        failed = np.flatnonzero(table[:, -1]).tolist()
        if failed:
            raise problem if problem is not None else HorovodInternalError(
                f"alltoall: ranks {failed} could not read their tensor")
        recv_rows = [int(table[r, self.rank]) for r in range(self.size)]
        recv = np.empty(sum(recv_rows) * row_bytes, np.uint8)
        scounts = [s * row_bytes for s in splits]
        rcounts = [s * row_bytes for s in recv_rows]
        sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(np.int64).tolist()
        rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(np.int64).tolist()
        self.comm.mpi_comm.Alltoallv([send, (scounts, sdispl), MPI.BYTE], [recv, (rcounts, rdispl), MPI.BYTE])
        out = from_bytes(recv, t.dtype, (sum(recv_rows), *tail)).to(t.device)
        req.finish((out, torch.tensor(recv_rows, dtype=torch.int32)))

    def _reducescatter(self, req: Request, row: np.ndarray) -> None:
        t = req.tensor if req.tensor.dim() else req.tensor.reshape(1)
        op = REDUCE_OPS[int(row[4])]
        pre, post = struct.unpack("<dd", struct.pack("<qq", int(row[5]), int(row[6])))
        flat = self._flat(req, pre).clone()
        self.comm.allreduce(flat, "sum" if op == "average" else op, out=flat, tag="horovod-reducescatter")
        rows = split_counts(t.shape[0], self.size)
        start = sum(rows[:self.rank])
        full = flat.to(t.dtype).view(t.shape)
        out = self._finish_reduce(full[start:start + rows[self.rank]], op, post)
        req.finish(out.clone())
