"""Streams and events, and the one stream rule of kvattn (as CuPy, PyTorch and numba have it).

`stream=None` means the legacy default stream, so a caller who names no stream is ordered with their framework's
default stream. `stream=` also takes 0 or 1 (legacy), 2 (per-thread default), a raw CUstream handle (int or
CUstream), a kvattn Stream, any object with `__cuda_stream__` (CuPy, cuda.core, newer PyTorch) and any object
with a `cuda_stream` attribute (torch.cuda.Stream; torch is never imported). Graph capture needs an explicit
created stream: the legacy stream cannot capture.

Cross-stream ordering (`order_after`) records one reusable event on the producer stream and makes the consumer
wait on it: a wait takes the event's state at the time of the call, so the event can be re-recorded at once.
"""
from __future__ import annotations

import threading
import weakref

from . import _driver, device as _device
from ._errors import KvattnError

LEGACY = 1        # CU_STREAM_LEGACY: also what DLPack and CAI v3 call the legacy default stream
PER_THREAD = 2    # CU_STREAM_PER_THREAD


class Stream:
    """A CUDA stream. `Stream()` creates a non-blocking stream owned by kvattn (capturable); special and
    borrowed handles (see `as_stream`) are wrapped, never destroyed."""

    __slots__ = ("handle", "ptr", "_finalizer", "__weakref__")

    def __init__(self, *, _handle=None):
        drv = _driver.driver()
        if _handle is None:
            self.handle = _driver.call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._finalizer = weakref.finalize(self, _destroy, self.handle)
        else:  # a borrowed handle: not ours to destroy
            self.handle = drv.CUstream(int(_handle))
            self._finalizer = None
        self.ptr = int(self.handle)

    @property
    def dlpack(self) -> int:
        """The value a DLPack producer is given for this stream: 1 legacy, 2 per-thread, else the handle (the
        driver's special handles are DLPack's numbers, and handle 0 is normalised to 1 by as_stream)."""
        return self.ptr

    @property
    def is_legacy(self) -> bool:
        return self.ptr == LEGACY

    def is_capturing(self) -> bool:
        """True while a graph capture is recording this stream. The legacy stream never captures (and is
        not asked: asking needs no driver call then, and calling it while another stream captures in global
        mode would be an error)."""
        if self.ptr == LEGACY:
            return False
        status = _driver.call("cuStreamIsCapturing", self.handle)
        return int(status) != 0

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

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self):
        return hash(self.ptr)

    def __repr__(self):
        name = {LEGACY: "legacy default", PER_THREAD: "per-thread default"}.get(self.ptr)
        return f"kvattn.Stream({name or f'0x{self.ptr:x}'})"


class Event:
    """A CUDA event; timing is on unless disable_timing=True."""

    def __init__(self, disable_timing: bool = False):
        drv = _driver.driver()
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING if disable_timing else drv.CUevent_flags.CU_EVENT_DEFAULT
        self.handle = _driver.call("cuEventCreate", flags)
        self._finalizer = weakref.finalize(self, _driver.release, "cuEventDestroy", self.handle)

    def record(self, stream=None):
        _driver.call("cuEventRecord", self.handle, as_stream(stream).handle)

    def synchronize(self):
        _driver.call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds between this event and a later one."""
        return float(_driver.call("cuEventElapsedTime", self.handle, end.handle))


_special: dict[int, Stream] = {}
_borrowed: dict[int, Stream] = {}


def legacy_stream() -> Stream:
    """The legacy default stream (what `stream=None` means)."""
    s = _special.get(LEGACY)
    if s is None:
        s = _special[LEGACY] = Stream(_handle=LEGACY)
    return s


def per_thread_stream() -> Stream:
    """The per-thread default stream."""
    s = _special.get(PER_THREAD)
    if s is None:
        s = _special[PER_THREAD] = Stream(_handle=PER_THREAD)
    return s


default_stream = legacy_stream   # the name CuPy and PyTorch use for it


def _destroy(handle):
    """The end of a stream kvattn created: the pool blocks kept for it are freed on it first (they name its handle;
    live blocks keep their Stream alive), then it is destroyed."""
    from .pool import release_free_lists
    try:
        release_free_lists(int(handle))
    except Exception:   # interpreter shutdown: the context goes with the process
        pass
    _driver.release("cuStreamDestroy", handle)


def _from_handle(ptr: int) -> Stream:
    if ptr < 0:
        raise ValueError(f"stream: a stream handle cannot be negative, got {ptr}")
    if ptr == 0 or ptr == LEGACY:
        return legacy_stream()
    if ptr == PER_THREAD:
        return per_thread_stream()
    s = _borrowed.get(ptr)
    if s is None:
        if len(_borrowed) > 4096:   # handles of destroyed streams may pile up in a long-lived process
            _borrowed.clear()
        s = _borrowed[ptr] = Stream(_handle=ptr)
    return s


def as_stream(stream) -> Stream:
    """The Stream that `stream` names (see the module docstring for what is accepted)."""
    if stream is None:
        s = _special.get(LEGACY)
        return s if s is not None else legacy_stream()
    if type(stream) is Stream:
        return stream
    if type(stream) is int:
        return _from_handle(stream)
    if isinstance(stream, Stream):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return _from_handle(int(value[1]))
    raw = getattr(stream, "cuda_stream", None)   # torch.cuda.Stream (and ExternalStream)
    if raw is not None:
        return _from_handle(int(raw))
    try:
        ptr = int(stream)   # CUstream, numpy integers
    except (TypeError, ValueError):
        raise TypeError(
            f"stream: expected None, 0/1 (legacy default), 2 (per-thread default), a CUstream handle, a "
            f"kvattn.Stream, an object with __cuda_stream__ or a torch.cuda.Stream, got {type(stream).__name__}"
        ) from None
    return _from_handle(ptr)


def require_capturable(stream: Stream, what: str = "graph capture"):
    """Raise the error that says why the legacy default stream cannot be captured."""
    if stream.ptr == LEGACY:
        raise KvattnError(
            f"{what}: the legacy default stream (stream=None, 0 or 1) cannot be captured; pass an explicit "
            f"created stream (kvattn.Stream(), torch.cuda.Stream(), cupy.cuda.Stream(non_blocking=True))")


# The reusable events of order_after, per thread (a record and its wait are two driver calls, which release the
# GIL: another thread's record of a shared event between them would be waited for instead): {context id: Event},
# key 0 in a one-GPU process.
_sync = threading.local()


def _event_for(producer: int):
    """This thread's reusable event to record on stream `producer`: the driver records an event only on a stream
    of the context it was created in, so with several GPUs there is one per context (the producer stream's, asked
    of the driver; created there)."""
    events = getattr(_sync, "events", None)
    if events is None:
        events = _sync.events = {}
    if not _device.several():
        ev = events.get(0)
        if ev is None:
            ev = events[0] = Event(disable_timing=True)
        return ev.handle
    ctx = _driver.call("cuStreamGetCtx", producer)
    key = int(ctx)
    ev = events.get(key)
    if ev is None:
        if _driver.current_context_id() == key:
            ev = Event(disable_timing=True)
        else:
            _driver.call("cuCtxPushCurrent", ctx)
            try:
                ev = Event(disable_timing=True)
            finally:
                _driver.call("cuCtxPopCurrent")
        events[key] = ev
    return ev.handle


def order_after(producer: int, consumer: Stream):
    """Make `consumer` wait for the work queued so far on the stream with handle `producer` (0 = legacy)."""
    if producer == 0:
        producer = LEGACY
    if producer == consumer.ptr:
        return
    drv = _driver.driver()
    ev = _event_for(producer)
    err, = drv.cuEventRecord(ev, producer)
    if err:
        _driver.fail("cuEventRecord", err)
    err, = drv.cuStreamWaitEvent(consumer.handle, ev, 0)
    if err:
        _driver.fail("cuStreamWaitEvent", err)
