"""A stand-in for cuda.bindings.driver on a machine without a GPU: every `cu*` call is recorded and answered as
an H200-like device would answer it (device 0, 132 SMs, sm_90; device pointers from a counter; pinned host memory
from numpy), so plan() and run() execute their whole host path on the CPU. Types and enums are the real module's.

Used by the CPU tests of run()'s driver calls (what one run() issues: exactly its launches, no allocation, no
synchronisation) and by scripts/probe_host_cpu.py (run()'s Python time without the driver's).

    with fake_driver() as calls:     # kvattn's driver state is swapped in and restored after
        ... plan(), run() ...
        calls.names()                # the cu* calls issued so far, in order
"""
from __future__ import annotations

import contextlib

import numpy as np
from cuda.bindings import driver as _real

from kvattn import _driver, device as _device, kernels, pool, stream as _stream

OK = _real.CUresult.CUDA_SUCCESS
_A = _real.CUdevice_attribute
ATTRIBUTES = {
    _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
    _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
    _A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
    _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
    _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 233472,
    _A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 60 << 20,
    _A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: 3_201_000,
    _A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: 6144,
    _A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: 2048,
}
CONTEXT = 0xC0DE000


class Calls(list):
    """(name, args) of every faked driver call, in order; `contexts[i]`: the context current at call i (0: none)."""

    def __init__(self):
        super().__init__()
        self.contexts = []

    def names(self, since: int = 0) -> list:
        return [n for n, _ in self[since:]]


class FakeDriver:
    """The module object kvattn._driver hands out: real types, faked `cu*` functions."""

    def __init__(self, calls: Calls):
        self.calls = calls
        self._next_ptr = 0x7F0000000000
        self._host = {}          # pinned host buffers, kept alive by address
        self._handles = 0x1000
        self.capturing = set()   # stream handles that report a capture in progress
        self.device_count = 1
        self.pointer_devices = {}   # device pointer -> the ordinal cuPointerGetAttribute reports (default 0)
        self.ctx_stack = []         # the (one) thread's context stack: device d's primary context is CONTEXT + d
        self.owner = {}             # stream / event handle -> the context current when it was created

    # -- answers -------------------------------------------------------------------------------------------
    def _handle(self, cls):
        self._handles += 0x10
        return cls(self._handles)

    def _device_ptr(self, nbytes):
        ptr = self._next_ptr
        self._next_ptr += (int(nbytes) + 0xFFFF) & ~0xFFFF
        return _real.CUdeviceptr(ptr)

    def cuInit(self, flags): return (OK,)
    def cuDeviceGetCount(self): return OK, self.device_count
    def cuPointerGetAttribute(self, attr, ptr): return OK, self.pointer_devices.get(int(ptr), 0)
    def cuDeviceGet(self, ordinal): return OK, _real.CUdevice(int(ordinal))
    def cuCtxGetDevice(self): return OK, _real.CUdevice(self._current_ctx() - CONTEXT)
    def cuDevicePrimaryCtxRetain(self, dev): return OK, _real.CUcontext(CONTEXT + int(dev))
    def cuCtxGetCurrent(self): return OK, _real.CUcontext(self._current_ctx())

    def _current_ctx(self) -> int:
        return self.ctx_stack[-1] if self.ctx_stack else 0

    def cuCtxSetCurrent(self, ctx):
        if self.ctx_stack:
            self.ctx_stack[-1] = int(ctx)
        else:
            self.ctx_stack.append(int(ctx))
        return (OK,)

    def cuCtxPushCurrent(self, ctx):
        self.ctx_stack.append(int(ctx))
        return (OK,)

    def cuCtxPopCurrent(self):
        return OK, _real.CUcontext(self.ctx_stack.pop())
    def cuDeviceGetName(self, n, dev): return OK, b"Fake H200\0"
    def cuDeviceGetAttribute(self, attr, dev): return OK, ATTRIBUTES.get(attr, 1)
    def cuModuleLoadData(self, image): return OK, self._handle(_real.CUmodule)
    def cuModuleGetFunction(self, module, name): return OK, self._handle(_real.CUfunction)
    def cuFuncSetAttribute(self, fn, attr, value): return (OK,)
    def cuMemAlloc(self, nbytes): return OK, self._device_ptr(nbytes)
    def cuMemFree(self, ptr): return (OK,)

    def cuMemHostAlloc(self, nbytes, flags):
        buf = np.zeros(max(int(nbytes), 1), np.uint8)
        self._host[buf.ctypes.data] = buf
        return OK, buf.ctypes.data

    def cuMemFreeHost(self, ptr):
        self._host.pop(int(ptr), None)
        return (OK,)

    def cuStreamCreate(self, flags):
        h = self._handle(_real.CUstream)
        self.owner[int(h)] = self._current_ctx()
        return OK, h

    def _stream_ctx(self, stream) -> int | None:
        """The context a stream belongs to: the current one for the special handles, its creator's for one
        created here, None (not checked) for a handle made elsewhere."""
        h = int(stream)
        return self._current_ctx() if h in (0, 1, 2) else self.owner.get(h)

    def cuStreamGetCtx(self, stream):
        ctx = self._stream_ctx(stream)
        return OK, _real.CUcontext(self._current_ctx() if ctx is None else ctx)

    def cuEventRecord(self, event, stream):   # the driver's rule: event and stream of the same context
        ctx = self._stream_ctx(stream)
        if ctx is not None and self.owner.get(int(event), ctx) != ctx:
            return (_real.CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (OK,)
    def cuStreamIsCapturing(self, s):
        status = _real.CUstreamCaptureStatus
        return OK, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if int(s) in self.capturing
                    else status.CU_STREAM_CAPTURE_STATUS_NONE)
    def cuEventCreate(self, flags):
        h = self._handle(_real.CUevent)
        self.owner[int(h)] = self._current_ctx()
        return OK, h
    def cuEventQuery(self, ev): return (OK,)
    def cuMemPoolCreate(self, props): return OK, self._handle(_real.CUmemoryPool)
    def cuMemAllocFromPoolAsync(self, nbytes, p, s): return OK, self._device_ptr(nbytes)
    def cuTensorMapEncodeTiled(self, *args): return OK, _real.CUtensorMap()

    def _default(self, name):
        real = getattr(_real, name)
        if isinstance(real, type):
            return real
        return lambda *args: (OK,)   # enqueue / record / wait / copy / free / destroy / set: nothing to answer

    def __getattribute__(self, name):
        if not name.startswith("cu"):
            return object.__getattribute__(self, name)
        try:
            attr = object.__getattribute__(self, name)
        except AttributeError:
            attr = object.__getattribute__(self, "_default")(name)
        if isinstance(attr, type):
            return attr
        calls = object.__getattribute__(self, "calls")

        def recorded(*args):
            calls.append((name, args))
            calls.contexts.append(object.__getattribute__(self, "_current_ctx")())
            return attr(*args)
        return recorded

    def __getattr__(self, name):   # types, enums and helpers of the real module (CUstream, CUresult, ...)
        return getattr(_real, name)


@contextlib.contextmanager
def fake_driver():
    """Swap kvattn's driver module, device table, streams and pool for the fake one's; restore them after."""
    calls = Calls()
    fake = FakeDriver(calls)
    saved = (list(_device._count), _driver._module, dict(_driver._state), dict(_device._devices), dict(kernels._loaded),
             dict(_stream._special), dict(_stream._borrowed), getattr(_stream._sync, "events", None),
             dict(pool._pools),
             list(pool._hot), dict(pool._free_lists), list(pool._free_bytes))
    _driver._module = fake
    _driver._state.clear()
    _device._count.clear()
    for table in (_device._devices, kernels._loaded, _stream._special, _stream._borrowed, pool._pools,
                  pool._free_lists):
        table.clear()
    _stream._sync.events = {}
    pool._free_bytes[0] = 0
    try:
        yield calls
    finally:
        (count, _driver._module, state, devices, loaded, special, borrowed, sync_events, pools, hot, free_lists,
         free_bytes) = saved
        _device._count[:] = count
        _driver._state.clear(); _driver._state.update(state)
        for table, old in ((_device._devices, devices), (kernels._loaded, loaded), (_stream._special, special),
                           (_stream._borrowed, borrowed), (pool._pools, pools), (pool._free_lists, free_lists)):
            table.clear()
            table.update(old)
        _stream._sync.events = sync_events
        pool._hot[:] = hot
        pool._free_bytes[:] = free_bytes
