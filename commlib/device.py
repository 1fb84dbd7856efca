"""CUDA devices and streams: the caller's stream at submission, and each rank's GPU.

An operation on device arrays may start and finish on the progress engine's
thread, whose current device and stream are not the caller's.  So the caller's
side is captured when the operation is called, on the caller's thread, as a
:class:`CallerStream`: the array's device, the caller's current cupy stream on
it, and an event recorded there (the point in the caller's stream the
operation must come after).  Backends order their work after that event and
hand results back on that stream, wherever they run.

:func:`local_gpus` and :func:`choose_device` decide, at :func:`commlib.init`,
whether NCCL fits and which GPU a rank's NCCL communicator uses.
"""

from __future__ import annotations

from typing import Any


class CallerStream:
    """The caller's device, current stream and an event recorded on it, captured at submission.

    Must be created on the caller's thread (it reads that thread's current
    cupy stream).  ``ready`` is recorded on ``stream`` at creation: work that
    reads the operation's inputs waits for it (a device stream with
    ``stream.wait_event``, the host with ``ready.synchronize()``).

    Example:
        >>> cs = CallerStream(x.device.id)          # on the thread that calls the operation
        >>> nccl_stream.wait_event(cs.ready)         # later, on any thread
        >>> with cs:                                 # copies back on the caller's stream
        ...     dev.set(host)
    """

    __slots__ = ("device", "stream", "ready")

    def __init__(self, device_id: int):
        import cupy

        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.get_current_stream()
            self.ready = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
            self.ready.record(self.stream)

    def after(self, event: Any) -> None:
        """Make the caller's stream wait for ``event`` (an operation's completion)."""
        with self.device:
            self.stream.wait_event(event)

    def __enter__(self) -> "CallerStream":
        """Make the caller's device and stream current on this thread (for copies and wraps)."""
        self.device.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def local_gpus() -> int:
    """GPUs cupy sees on this rank with NCCL importable (0 when cupy, a driver or NCCL is missing).

    Never raises: every rank must reach the collectives of auto-detection
    whatever its cupy does.
    """
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no cupy, no driver, no NCCL: no GPU for commlib
        return 0


def current_device() -> int:
    """The calling thread's current CUDA device (``cudaGetDevice``; creates no context)."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def choose_device(local_rank: int, gpus: int, requested: int | None, current: int) -> int:
    """The GPU of a rank's NCCL communicator.

    ``requested`` (the ``device`` setting) wins.  Otherwise ``current`` (the
    current CUDA device, :func:`current_device`) when it is not 0: the user
    chose it (``torch.cuda.set_device``, ``cupy.cuda.Device(i).use()``).
    Otherwise the node-local rank, modulo ``gpus``.

    Example:
        >>> choose_device(local_rank=3, gpus=8, requested=None, current=0)
        3
        >>> choose_device(local_rank=3, gpus=8, requested=None, current=5), choose_device(3, 8, 1, 5)
        (5, 1)
    """
    if requested is not None:
        return int(requested)
    if current != 0:
        return current
    return local_rank % max(gpus, 1)
