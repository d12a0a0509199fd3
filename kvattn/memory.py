"""Device memory: DeviceArray (shape, dtype, strides, pointer, owner), host<->device copies, Workspace.

DeviceArray speaks both interchange protocols: `__cuda_array_interface__` (v3) and `__dlpack__`, and
`asarray` takes numpy arrays (copied) or any CUDA array (CuPy, PyTorch, JAX, numba) without a copy.
"""
from __future__ import annotations

import ctypes
import math
import weakref

import numpy as np

from . import _dlpack, _driver, _dtypes, device as _device
from .pool import note_use
from .stream import Event, Stream, as_stream, order_after

ALIGN = 256  # bytes: every allocation and Workspace region starts on this boundary
_dlpack_types: dict = {}   # numpy dtype -> DLPack (code, bits)


class _Allocation:
    """Owns one cuMemAlloc block; frees it when the last DeviceArray that views it is gone."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(_driver.call("cuMemAlloc", max(nbytes, 1)))
        self._finalizer = weakref.finalize(self, _driver.release, "cuMemFree", self.ptr)


class DeviceArray:
    """A strided view of device memory.

    shape, strides (bytes), dtype (numpy dtype; bfloat16 / float8 through ml_dtypes), ptr (int), owner
    (the object that keeps the memory alive: an allocation, a foreign array or a DLPack capsule), stream (the
    handle of the stream whose queued work last wrote it, or None when no queued kvattn work writes it; set by
    written_on(), which also keeps that kvattn Stream alive as long as the array, so the handle an export waits on
    is never a destroyed stream's).
    Exports through `__cuda_array_interface__` (v3, its "stream" field) and `__dlpack__(stream=S)` (S is made
    to wait for that stream) never claim a readiness that was not established.
    """

    # (writer: the kvattn Stream of `stream`, set by written_on only and never read: it keeps that stream alive)
    __slots__ = ("shape", "dtype", "strides", "ptr", "owner", "stream", "writer", "__weakref__")

    def __init__(self, ptr: int, shape, dtype, strides=None, owner=None, stream=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = _dtypes.to_numpy(dtype)
        if strides is None:
            strides = _contiguous_strides(self.shape, self.dtype.itemsize)
        self.strides = tuple(int(s) for s in strides)
        self.ptr = int(ptr)
        self.owner = owner
        self.stream = stream

    @classmethod
    def _make(cls, ptr: int, shape: tuple, dtype: np.dtype, strides: tuple, owner, stream=None) -> "DeviceArray":
        """The hot-path constructor: arguments already normalised (ints, tuples, a numpy dtype, byte strides)."""
        a = object.__new__(cls)
        a.ptr, a.shape, a.dtype, a.strides, a.owner, a.stream = ptr, shape, dtype, strides, owner, stream
        return a

    def written_on(self, s: Stream):
        """Record that work queued on kvattn Stream s writes this array (exports order their consumers after s)."""
        self.stream = s.ptr
        self.writer = s

    # -- properties ----------------------------------------------------------------------------
    @property
    def device(self):
        """The kvattn.device.Device that holds the memory (asked of the driver where it sees several GPUs)."""
        return _device.get(_device.ordinal_of(self.ptr))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def dtype_name(self) -> str:
        return _dtypes.dtype_name(self.dtype)

    def is_contiguous(self) -> bool:
        return self.strides == _contiguous_strides(self.shape, self.itemsize) or self.size <= 1

    def __repr__(self):
        return f"kvattn.DeviceArray(shape={self.shape}, dtype={self.dtype_name}, ptr=0x{self.ptr:x})"

    def __len__(self):
        return self.shape[0]

    # -- views ---------------------------------------------------------------------------------
    def reshape(self, *shape) -> "DeviceArray":
        """A view with a new shape (contiguous arrays only)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"shape: cannot reshape {self.shape} to {shape}")
        if not self.is_contiguous():
            raise ValueError("reshape: the array is not contiguous")
        return DeviceArray(self.ptr, shape, self.dtype, None, self, self.stream)

    def __getitem__(self, key) -> "DeviceArray":
        """Basic indexing (integers and slices with step 1 along leading axes), as a view."""
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > self.ndim:
            raise IndexError(f"too many indices for an array of {self.ndim} dimensions")
        ptr, shape, strides = self.ptr, [], []
        for axis, k in enumerate(key):
            n, st = self.shape[axis], self.strides[axis]
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step != 1:
                    raise IndexError("DeviceArray slices must have step 1")
                ptr += start * st
                shape.append(max(stop - start, 0))
                strides.append(st)
            else:
                i = int(k)
                if not -n <= i < n:
                    raise IndexError(f"index {i} out of range for axis {axis} of size {n}")
                ptr += (i % n) * st
        shape += self.shape[len(key):]
        strides += self.strides[len(key):]
        return DeviceArray(ptr, shape, self.dtype, strides, self, self.stream)

    # -- interchange ---------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self):
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None if self.is_contiguous() else self.strides,
            "version": 3,
            "stream": self.stream,   # the writer's stream (1 = legacy), None when no queued kvattn work writes it
        }

    def __dlpack_device__(self):
        """(CUDA, the ordinal of the GPU holding the memory): a consumer builds its tensor on that device."""
        return (_dlpack.K_DL_CUDA, _device.ordinal_of(self.ptr))

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule. stream (DLPack's convention): None or 1 the legacy default stream, 2 the per-thread
        default stream, -1 no ordering, else a stream handle; it is made to wait for the stream that wrote this
        array (no device-wide synchronisation)."""
        if copy:
            raise BufferError("kvattn.DeviceArray.__dlpack__: copy=True is not supported")
        ordinal = _device.ordinal_of(self.ptr)
        if dl_device is not None and tuple(dl_device) != (_dlpack.K_DL_CUDA, ordinal):
            raise BufferError(f"kvattn.DeviceArray.__dlpack__: cannot export to device {dl_device} (the array is "
                              f"on CUDA device {ordinal})")
        if self.stream is not None and stream != -1:
            consumer = as_stream(stream)
            if consumer.ptr != self.stream:
                if (self.stream < 3 or consumer.ptr < 3) and _device.several():
                    # the legacy / per-thread handles name the current context's streams, and the consumer (torch)
                    # need not have made the array's GPU current: order in that GPU's context
                    with _device.get(ordinal).activate():
                        order_after(self.stream, consumer)
                else:
                    order_after(self.stream, consumer)
                note_use(self, consumer.ptr)
        code_bits = _dlpack_types.get(self.dtype)
        if code_bits is None:
            code_bits = _dlpack_types[self.dtype] = _dtypes.to_dlpack(self.dtype)
        itemsize = self.dtype.itemsize
        return _dlpack.export(self.ptr, self.shape, tuple(map(itemsize.__rfloordiv__, self.strides)), *code_bits, self,
                              ordinal)

    # -- copies --------------------------------------------------------------------------------
    def numpy(self, stream=None) -> np.ndarray:
        """Copy to a new host array (waits for the copy)."""
        s = as_stream(stream)
        out = np.empty(self.shape, self.dtype)
        if self.size == 0:
            return out
        if self.stream is not None:
            order_after(self.stream, s)
        if self.is_contiguous():
            _driver.call("cuMemcpyDtoHAsync", out.ctypes.data, self.ptr, self.nbytes, s.handle)
            s.synchronize()
            return out
        # Strided: copy the spanned bytes, then gather on the host.
        lo = sum(min(0, (n - 1) * st) for n, st in zip(self.shape, self.strides))
        hi = sum(max(0, (n - 1) * st) for n, st in zip(self.shape, self.strides)) + self.itemsize
        span = np.empty(hi - lo, np.uint8)
        _driver.call("cuMemcpyDtoHAsync", span.ctypes.data, self.ptr + lo, hi - lo, s.handle)
        s.synchronize()
        # as_strided on a plain integer view: numpy cannot stride every ml_dtypes type (float8_e5m2 is '<f1').
        raw = np.dtype(f"u{self.itemsize}")
        view = np.lib.stride_tricks.as_strided(span[-lo:].view(raw), self.shape, self.strides)
        out.view(raw)[...] = view
        return out

    def copy_from_host(self, host: np.ndarray, stream=None):
        """Asynchronously copy a host array of the same shape and dtype into this (contiguous) array."""
        host = np.ascontiguousarray(host)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError(f"host: expected shape {self.shape} and dtype {self.dtype}, got {host.shape} {host.dtype}")
        if not self.is_contiguous():
            raise ValueError("copy_from_host: the destination is not contiguous")
        if self.nbytes:
            s = as_stream(stream)
            if self.stream is not None:
                order_after(self.stream, s)   # earlier queued writes first
            _driver.call("cuMemcpyHtoDAsync", self.ptr, host.ctypes.data, self.nbytes, s.handle)
            self.written_on(s)

    def fill_bytes(self, value: int, stream=None):
        """Set every byte of this contiguous array to value (used to poison outputs in tests)."""
        if not self.is_contiguous():
            raise ValueError("fill_bytes: the array is not contiguous")
        if self.nbytes:
            s = as_stream(stream)
            if self.stream is not None:
                order_after(self.stream, s)
            _driver.call("cuMemsetD8Async", self.ptr, value & 0xFF, self.nbytes, s.handle)
            self.written_on(s)


def _contiguous_strides(shape, itemsize):
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


_strides_memo: dict = {}


def contiguous_strides(shape: tuple, itemsize: int) -> tuple:
    """Row-major byte strides of shape (memoised: run() asks for the same few shapes on every call)."""
    key = (shape, itemsize)
    st = _strides_memo.get(key)
    if st is None:
        if len(_strides_memo) > 4096:
            _strides_memo.clear()
        st = _strides_memo[key] = _contiguous_strides(shape, itemsize)
    return st


def empty(shape, dtype) -> DeviceArray:
    """A new uninitialised contiguous device array."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    npd = _dtypes.to_numpy(dtype)
    alloc = _Allocation(math.prod(shape) * npd.itemsize)
    return DeviceArray(alloc.ptr, shape, npd, None, alloc)


def zeros(shape, dtype, stream=None) -> DeviceArray:
    a = empty(shape, dtype)
    a.fill_bytes(0, stream)
    return a


def from_numpy(host: np.ndarray, stream=None) -> DeviceArray:
    """A new device array holding a copy of host (waits until the copy is done, so host may change)."""
    host = np.ascontiguousarray(host)
    a = empty(host.shape, host.dtype)
    a.copy_from_host(host, stream)
    as_stream(stream).synchronize()
    a.stream = None   # the copy is done: ready on every stream
    return a


def asarray(x, stream=None) -> DeviceArray:
    """A DeviceArray for x without copying device memory.

    x: a DeviceArray (returned as is), a numpy array (copied to the device), or any CUDA array: a torch.Tensor,
    or any object exposing `__cuda_array_interface__` or a CUDA `__dlpack__` (CuPy, JAX, numba): same pointer.
    stream: the stream that will use the array (see kvattn.stream); the producer's pending work is ordered
    before it (no cross-stream wait is added while that stream is capturing a graph).
    """
    s = as_stream(stream)
    return _import_array(x, s, s.is_capturing())


class PinnedBuffer:
    """Page-locked host memory viewed as a numpy array (staging for one async host-to-device copy)."""

    def __init__(self, nbytes: int):
        self.nbytes = max(int(nbytes), 1)
        self.ptr = int(_driver.call("cuMemHostAlloc", self.nbytes, 0))
        self._finalizer = weakref.finalize(self, _driver.release, "cuMemFreeHost", self.ptr)
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        self.bytes = np.frombuffer(raw, np.uint8)

    def view(self, dtype) -> np.ndarray:
        return self.bytes.view(dtype)


class StagingRing:
    """Two pinned host buffers used in turn for plan()'s host-to-device copies: a buffer is reused only after
    the copy issued from it two plans ago has finished (waits on that copy's event), so it is never overwritten
    while in flight."""

    def __init__(self):
        self._buffers = [None, None]
        self._events = [None, None]
        self._turn = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """This turn's buffer (uint8 view of at least nbytes), once its previous copy is done."""
        t = self._turn
        if self._events[t] is None:
            self._events[t] = Event(disable_timing=True)
        else:
            self._events[t].synchronize()
        buf = self._buffers[t]
        if buf is None or buf.nbytes < nbytes:
            buf = self._buffers[t] = PinnedBuffer(max(nbytes, 4096, 2 * (buf.nbytes if buf else 0)))
        return buf.bytes

    def release(self, stream) -> "object":
        """Record the end of the copies just issued from this turn's buffer on `stream`; returns that event."""
        ev = self._events[self._turn]
        ev.record(stream)
        self._turn ^= 1
        return ev


class WorkspaceTooSmall(ValueError):
    """The workspace cannot hold the requested regions; the message says how many bytes are needed."""


class Workspace:
    """One device allocation handing out aligned, named sub-buffers.

    `regions(spec)` takes {name: (shape, dtype)} and returns {name: DeviceArray}; it raises
    WorkspaceTooSmall naming the bytes needed when the allocation cannot hold them.
    """

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.buffer = empty((self.nbytes,), "uint8")

    @staticmethod
    def bytes_needed(spec) -> int:
        total = 0
        for shape, dtype in spec.values():
            total = _align(total) + math.prod(shape) * _dtypes.to_numpy(dtype).itemsize
        return _align(total)

    def regions(self, spec) -> dict:
        out, offset, base = {}, 0, self.buffer.ptr
        for name, (shape, dtype) in spec.items():
            offset = _align(offset)
            npd = _dtypes.to_numpy(dtype)
            shape = tuple(map(int, shape))
            out[name] = DeviceArray._make(base + offset, shape, npd, contiguous_strides(shape, npd.itemsize),
                                          self.buffer)
            offset += math.prod(shape) * npd.itemsize
        need = _align(offset)   # (= bytes_needed(spec))
        if need > self.nbytes:
            raise WorkspaceTooSmall(
                f"workspace: {need} bytes needed for regions {list(spec)}, but the workspace has {self.nbytes}; "
                f"pass workspace_bytes >= {need}")
        return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def fit_workspace(ws: "Workspace | None", spec, fixed_bytes: "int | None"):
    """(workspace, {name: DeviceArray}) for the regions of spec, for a wrapper's plan().

    fixed_bytes set (graph mode or a user-sized workspace): one allocation of that size for the wrapper's life, so
    pointers captured in a graph stay valid; too small raises WorkspaceTooSmall naming the bytes needed.
    fixed_bytes None: grown on demand (never shrunk). Allocation happens in plan(), never in run().
    """
    if fixed_bytes is not None:
        ws = ws or Workspace(fixed_bytes)
        return ws, ws.regions(spec)
    if ws is not None:
        try:
            return ws, ws.regions(spec)
        except WorkspaceTooSmall:
            _driver.call("cuCtxSynchronize")  # queued work on any stream may still read the old buffer
    ws = Workspace(max(Workspace.bytes_needed(spec), 1 << 20))
    return ws, ws.regions(spec)


from ._interop import import_array as _import_array  # noqa: E402  (imports this module)
