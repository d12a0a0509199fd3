"""Streams and events. kvattn's default stream is a created non-blocking stream, so it can be captured."""
from __future__ import annotations

import weakref

from . import _driver


class Stream:
    """A CUDA stream owned by kvattn (non-blocking, capturable)."""

    def __init__(self, *, _handle=None):
        drv = _driver.driver()
        if _handle is None:
            self.handle = _driver.call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._finalizer = weakref.finalize(self, _destroy_stream, self.handle)
        else:  # a borrowed handle: not ours to destroy
            self.handle = drv.CUstream(int(_handle))
            self._finalizer = None
        self.ptr = int(self.handle)

    def synchronize(self):
        _driver.call("cuStreamSynchronize", self.handle)

    def wait(self, event: "Event"):
        _driver.call("cuStreamWaitEvent", self.handle, event.handle, 0)

    def record(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def __cuda_stream__(self):
        return (0, self.ptr)

    def __int__(self):
        return self.ptr

    def __repr__(self):
        return f"kvattn.Stream(0x{self.ptr:x})"


def _destroy_stream(handle):
    try:
        _driver.driver().cuStreamDestroy(handle)
    except Exception:
        pass


class Event:
    """A CUDA event; timing is on unless disable_timing=True."""

    def __init__(self, disable_timing: bool = False):
        drv = _driver.driver()
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING if disable_timing else drv.CUevent_flags.CU_EVENT_DEFAULT
        self.handle = _driver.call("cuEventCreate", flags)
        self._finalizer = weakref.finalize(self, _destroy_event, self.handle)

    def record(self, stream=None):
        _driver.call("cuEventRecord", self.handle, as_stream(stream).handle)

    def synchronize(self):
        _driver.call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds between this event and a later one."""
        return float(_driver.call("cuEventElapsedTime", self.handle, end.handle))


def _destroy_event(handle):
    try:
        _driver.driver().cuEventDestroy(handle)
    except Exception:
        pass


_default: list[Stream] = []


def default_stream() -> Stream:
    """kvattn's default stream (created once; not the legacy NULL stream, so it can be captured)."""
    if not _default:
        _default.append(Stream())
    return _default[0]


_borrowed: dict[int, Stream] = {}


def as_stream(stream) -> Stream:
    """A Stream from None (kvattn's default), a Stream, a raw CUstream handle (int or CUstream) or any
    object exposing __cuda_stream__ (CuPy, cuda.core, ...)."""
    if stream is None:
        return default_stream()
    if isinstance(stream, Stream):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        _, ptr = stream.__cuda_stream__()
    else:
        try:
            ptr = int(stream)
        except (TypeError, ValueError):
            raise TypeError(
                f"stream: expected None, a kvattn.Stream, a CUstream handle or an object with __cuda_stream__, "
                f"got {type(stream).__name__}") from None
    s = _borrowed.get(ptr)
    if s is None:
        s = _borrowed[ptr] = Stream(_handle=ptr)
    return s
