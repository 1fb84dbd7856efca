"""The operations of a :class:`~commlib.communicator.Communicator`: each validates its input,
builds an :class:`~commlib.ops.Op` and runs it in order (``_call``); a blocking call on plain
host arrays goes straight to :meth:`~commlib.runner.Runner.call_host` instead."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .arrays import View, as_view, host_alias, host_alias_result, host_pair, mark_written
from .backends.base import Backend, Pending, split_counts
from .config import Config
from .control import Control
from .device import CallerStream
from .errors import ValidationError
from .host_results import HOST_RESULTS
from .ops import Op, check_reduce_op, fingerprint, out_buffer, reduce_op_ok
from .runner import Runner
from .work import Work


class CommunicatorOps:
    """The collective operations of :class:`~commlib.communicator.Communicator` (its base: the
    communicator's state and lifecycle live there; the full doc and example too)."""

    rank: int
    size: int
    config: Config
    _run: Runner
    _control: Control
    _host_backend: Backend
    _backend: Backend
    _device: int | None
    _host: bool
    _seq: int
    _split: dict[int, list[int]]

    def _number(self) -> int:
        """The next operation's sequence number (``Communicator._number``)."""
        raise NotImplementedError

    def _call(self, name: str, build: Callable[..., Op], args: tuple, blocking: bool) -> Any:
        """Number, validate, check and run one operation (``Communicator._call``)."""
        raise NotImplementedError

    def _route(self, v: View, what: str) -> tuple[Backend, CallerStream | None]:
        """The backend for ``v`` and, for a device array, the caller's stream captured now
        (on the caller's thread; raises :class:`ValidationError` for a GPU that is not the
        NCCL communicator's)."""
        if v.device == "cpu":
            return self._host_backend, None
        if self._device is not None and v.device_id != self._device:
            raise ValidationError(
                f"{what}: the array is on GPU {v.device_id}, this NCCL communicator on GPU "
                f"{self._device} (commlib.init(device=...) or COMMLIB_DEVICE chooses it)")
        return self._backend, CallerStream(v.device_id)

    @staticmethod
    def _result(v: View, data: Any, shape: tuple, ctx: CallerStream | None) -> Callable[[], Any]:
        """The result of an allocated output: ``data`` as the caller's kind of array, handed
        over on the caller's stream (DLPack orders the framework's stream after it)."""
        if ctx is None:
            return lambda: v.wrap(data, shape)

        def wrap() -> Any:
            with ctx:
                return v.wrap(data, shape)

        return wrap

    def _allreduce(self, x: Any, op: str, out: Any, tag: str | None) -> Op:
        v = as_view(x, "allreduce: x", read_only=out is not x)
        check_reduce_op(op, v.dtype, "allreduce")
        recv, value = out_buffer(v, out, v.count, "allreduce")
        be, ctx = self._route(v, "allreduce")
        return Op("allreduce", be.allreduce, (v.data, recv, v.dtype, op, ctx),
                  None if value is not None else self._result(v, recv, v.shape, ctx), value,
                  v.data.nbytes, tag, ("allreduce", v, v.count, -1, op))

    def allreduce(self, x: Any, op: str = "sum", *, out: Any = None,
                  tag: str | None = None) -> Any:
        """Reduce ``x`` over all ranks (``sum``, ``avg``, ``max``, ``min``); every rank gets the result.

        Example:
            >>> comm.allreduce(np.ones(3, np.float32), op="avg")
            array([1., 1., 1.], dtype=float32)
        """
        if self._host:
            dt = host_pair(x, out)
            if dt is not None and reduce_op_ok(op, dt):
                if out is None:
                    out = HOST_RESULTS.like(x)
                if out.size == x.size:
                    return self._run.call_host("allreduce", self._number(), self._host_backend.allreduce,
                                               (x, out, dt, op), out, x.nbytes, tag)
            elif dt is None and (pair := host_alias(x, out)) is not None:
                return host_alias_result(self.allreduce(pair[0], op, out=pair[1], tag=tag), out, pair[2])
        return self._call("allreduce", self._allreduce, (x, op, out, tag), True)

    def iallreduce(self, x: Any, op: str = "sum", *, out: Any = None,
                   tag: str | None = None) -> Work:
        """Nonblocking :meth:`allreduce`; ``wait()`` returns the result."""
        return self._call("allreduce", self._allreduce, (x, op, out, tag), False)

    def _reduce_scatter(self, x: Any, op: str, out: Any, tag: str | None) -> Op:
        v = as_view(x, "reduce_scatter: x", read_only=out is not x)
        check_reduce_op(op, v.dtype, "reduce_scatter")
        counts = self._split.get(v.count)
        if counts is None:
            counts = self._split[v.count] = split_counts(v.count, self.size)
        mine = counts[self.rank]
        recv, value = out_buffer(v, out, mine, "reduce_scatter")
        be, ctx = self._route(v, "reduce_scatter")
        return Op("reduce_scatter", be.reduce_scatter, (v.data, recv, v.dtype, op, counts, ctx),
                  None if value is not None else self._result(v, recv, (mine,), ctx), value,
                  v.data.nbytes, tag, ("reduce_scatter", v, v.count, -1, op))

    def reduce_scatter(self, x: Any, op: str = "sum", *, out: Any = None,
                       tag: str | None = None) -> Any:
        """Reduce ``x`` (flattened) over ranks and give rank r the r-th chunk of the result.

        The chunks are those of :func:`commlib.split_counts`: for n elements
        and ``size`` ranks, the first ``n % size`` ranks get ``n // size + 1``
        elements and the others ``n // size``, in rank order (as
        ``numpy.array_split``), so any n works, zero and n < size included.

        Example:
            >>> comm.reduce_scatter(np.arange(10.0))   # 4 ranks: rank 0 gets 4*[0, 1, 2]
        """
        if self._host:
            dt = host_pair(x, out)
            counts = self._split.get(x.size) if dt is not None else None
            if counts is not None and reduce_op_ok(op, dt):
                if out is None:
                    out = HOST_RESULTS.empty((counts[self.rank],), x.dtype)
                if out.size == counts[self.rank]:
                    return self._run.call_host("reduce_scatter", self._number(),
                                               self._host_backend.reduce_scatter,
                                               (x, out, dt, op, counts), out, x.nbytes, tag)
            elif dt is None and (pair := host_alias(x, out)) is not None:
                return host_alias_result(self.reduce_scatter(pair[0], op, out=pair[1], tag=tag), out, pair[2])
        return self._call("reduce_scatter", self._reduce_scatter, (x, op, out, tag), True)

    def ireduce_scatter(self, x: Any, op: str = "sum", *, out: Any = None,
                        tag: str | None = None) -> Work:
        """Nonblocking :meth:`reduce_scatter`."""
        return self._call("reduce_scatter", self._reduce_scatter, (x, op, out, tag), False)

    def _allgather(self, x: Any, out: Any, tag: str | None) -> Op:
        v = as_view(x, "allgather: x", read_only=True)
        recv, value = out_buffer(v, out, v.count * self.size, "allgather")
        be, ctx = self._route(v, "allgather")
        return Op("allgather", be.allgather, (v.data, recv, v.dtype, ctx),
                  None if value is not None else self._result(v, recv, (self.size, *v.shape), ctx), value,
                  v.data.nbytes * self.size, tag, ("allgather", v, v.count))

    def allgather(self, x: Any, *, out: Any = None, tag: str | None = None) -> Any:
        """Gather equal-sized ``x`` from every rank; the result has shape ``(size, *x.shape)``.

        In place: pass ``out`` (``size * x.size`` elements) with ``x`` being
        ``out``'s rank-th slice.

        Example:
            >>> comm.allgather(np.array([comm.rank]))   # [[0], [1], ...]
        """
        if self._host:
            dt = host_pair(x, out)
            if dt is not None:
                if out is None:
                    out = HOST_RESULTS.empty((self.size, *x.shape), x.dtype)
                if out.size == x.size * self.size:
                    return self._run.call_host("allgather", self._number(), self._host_backend.allgather,
                                               (x, out, dt), out, out.nbytes, tag)
            elif (pair := host_alias(x, out)) is not None:
                return host_alias_result(self.allgather(pair[0], out=pair[1], tag=tag), out, pair[2])
        return self._call("allgather", self._allgather, (x, out, tag), True)

    def iallgather(self, x: Any, *, out: Any = None, tag: str | None = None) -> Work:
        """Nonblocking :meth:`allgather`."""
        return self._call("allgather", self._allgather, (x, out, tag), False)

    def _allgatherv(self, x: Any, counts: Sequence[int] | None, out: Any,
                    tag: str | None) -> Op:
        check = self.config.check       # check mode: the counts travel, given or not, and are compared
        try:
            v = as_view(x, "allgatherv: x", read_only=True)
        except ValidationError as exc:
            if counts is None or check:
                if check:
                    self._control.agree("allgatherv", self._seq, [], exc)
                self._control.exchange_counts(-1, self._seq)
            raise
        if counts is None or check:
            if check:   # the same call everywhere before the counts travel
                self._control.agree("allgatherv", self._seq, fingerprint("allgatherv", v), None)
            actual = self._control.exchange_counts(v.count, self._seq)
            if min(actual) < 0:
                bad = [r for r, c in enumerate(actual) if c < 0]
                raise ValidationError(f"allgatherv: ranks {bad} rejected their input")
            if counts is not None and _integers(counts, self.size) != actual:
                raise ValidationError(f"allgatherv: counts {_integers(counts, self.size)} were given, but "
                                      f"the ranks' inputs have {actual} elements")
            counts = actual if counts is None else counts
        counts = _integers(counts, self.size)
        if len(counts) != self.size or min(counts, default=0) < 0:
            raise ValidationError(
                f"allgatherv: counts must be {self.size} non-negative integers, got {counts}")
        if counts[self.rank] != v.count:
            raise ValidationError(
                f"allgatherv: counts[{self.rank}] = {counts[self.rank]} but x has {v.count} elements")
        total = sum(counts)
        recv, value = out_buffer(v, out, total, "allgatherv")
        be, ctx = self._route(v, "allgatherv")
        return Op("allgatherv", be.allgatherv, (v.data, recv, v.dtype, counts, ctx),
                  None if value is not None else self._result(v, recv, (total,), ctx), value,
                  total * v.data.itemsize, tag, ("allgatherv", v, total))

    def allgatherv(self, x: Any, counts: Sequence[int] | None = None, *, out: Any = None,
                   tag: str | None = None) -> Any:
        """Gather ``x`` of a different length on each rank into one flat array, in rank order.

        ``counts`` (every rank's element count) saves an exchange when known;
        without it the counts are all-gathered first.

        Example:
            >>> comm.allgatherv(np.arange(comm.rank + 1.0))   # 2 ranks: [0., 0., 1.]
        """
        return self._call("allgatherv", self._allgatherv, (x, counts, out, tag), True)

    def allgather_object(self, obj: Any, *, label: str = "allgather_object") -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking, as mpi4py's ``comm.allgather``).

        Outside the operations' order, on a communicator of its own: it never pairs with an
        operation in flight, which goes on.  While this rank waits in it, the status board
        shows it in ``label``: a peer waiting for an operation this rank has not called yet
        raises :class:`MismatchError` at once, naming ``label``, instead of waiting for the
        timeout; ranks calling it with different labels raise it too.

        Example:
            >>> comm.allgather_object({"rank": comm.rank}, label="config")    # [{'rank': 0}, {'rank': 1}]
        """
        self._run.check_alive()
        return self._control.allgather_object(obj, label, self._seq)

    def iallgatherv(self, x: Any, counts: Sequence[int] | None = None, *, out: Any = None,
                    tag: str | None = None) -> Work:
        """Nonblocking :meth:`allgatherv` (the counts exchange, if any, happens now)."""
        return self._call("allgatherv", self._allgatherv, (x, counts, out, tag), False)

    def _broadcast(self, x: Any, root: int, out: Any, tag: str | None) -> Op:
        # x is only read where the result goes to out, or to a new array (x immutable: not in place)
        immutable = isinstance(x, np.ndarray) and not x.flags.writeable
        v = as_view(x, "broadcast: x", read_only=(out is not None and out is not x) or immutable)
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValidationError(f"broadcast: root {root!r} is not a rank of 0..{self.size - 1}")
        root = int(root)
        if (out is None or out is x) and v.writable and not immutable:
            buf, value = v.data, x
            if v.kind == "torch":
                mark_written(x)
        else:
            buf, value = out_buffer(v, None if out is x else out, v.count, "broadcast")
        copy = self.rank == root and buf is not v.data
        if copy and v.device != "cpu":
            with v.data.device:       # on the caller's current stream, before the event _route records
                buf[...] = v.data
            copy = False
        be, ctx = self._route(v, "broadcast")

        def start() -> Pending:
            if copy:
                buf[...] = v.data
            return be.broadcast(buf, v.dtype, root, ctx)

        return Op("broadcast", start, (), None if value is not None else self._result(v, buf, v.shape, ctx),
                  value, v.data.nbytes, tag, ("broadcast", v, v.count, root))

    def broadcast(self, x: Any, root: int = 0, *, out: Any = None, tag: str | None = None) -> Any:
        """Give every rank root's ``x``: in place where ``x`` is writable, else a new array.

        Example:
            >>> w = comm.broadcast(np.random.rand(4), root=0)   # same on all ranks
        """
        if self._host and isinstance(root, (int, np.integer)) and 0 <= root < self.size:
            if out is None or out is x:
                dt = host_pair(x, None)
                if dt is not None and x.flags.writeable:      # in place, as below
                    return self._run.call_host("broadcast", self._number(), self._host_backend.broadcast,
                                               (x, dt, int(root)), x, x.nbytes, tag)
                pair = host_alias(x, None) if type(x) is not np.ndarray else None
                if pair is not None and pair[0].flags.writeable:        # a CPU tensor: in place, itself
                    mark_written(x)
                    self.broadcast(pair[0], root, tag=tag)
                    return x
            else:       # into out: the root's x copied there first, then out in place (as _broadcast)
                dt = host_pair(x, out)
                if dt is not None and out.size == x.size:
                    if self.rank == root:
                        out.reshape(-1)[...] = x.reshape(-1)
                    return self._run.call_host("broadcast", self._number(), self._host_backend.broadcast,
                                               (out, dt, int(root)), out, out.nbytes, tag)
                pair = host_alias(x, out) if dt is None else None
                if pair is not None and pair[1] is not None:      # CPU tensors: their numpy aliases
                    self.broadcast(pair[0], root, out=pair[1], tag=tag)
                    return out
        return self._call("broadcast", self._broadcast, (x, root, out, tag), True)

    def ibroadcast(self, x: Any, root: int = 0, *, out: Any = None,
                   tag: str | None = None) -> Work:
        """Nonblocking :meth:`broadcast`."""
        return self._call("broadcast", self._broadcast, (x, root, out, tag), False)

    def _barrier(self, tag: str | None) -> Op:
        ctx = None if self._device is None else CallerStream(self._device)
        return Op("barrier", self._backend.barrier, (ctx,), None, None, 0, tag, ("barrier",))

    def barrier(self, *, tag: str | None = None) -> None:
        """Block until every rank has called ``barrier``.

        Example:
            >>> comm.barrier()       # every rank got here
        """
        if self._host and self._device is None:     # an NCCL communicator's orders the GPU streams too
            return self._run.call_host("barrier", self._number(), self._host_backend.barrier, (), None, 0,
                                       tag)
        return self._call("barrier", self._barrier, (tag,), True)

    def ibarrier(self, *, tag: str | None = None) -> Work:
        """Nonblocking :meth:`barrier`."""
        return self._call("barrier", self._barrier, (tag,), False)


def _integers(counts: Sequence[Any], size: int) -> list[int]:
    """``allgatherv``'s given counts as ints (numpy integers too); a float, even 2.0, is refused, as
    ``int()`` would cut 1.5 to 1 silently."""
    try:
        return [operator.index(c) for c in counts]
    except TypeError:
        raise ValidationError(f"allgatherv: counts must be {size} non-negative integers, got "
                              f"{list(counts)!r}") from None
