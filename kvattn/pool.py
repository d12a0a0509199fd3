"""Stream-ordered device memory for the arrays run() allocates (`out=None`, `return_lse`).

One memory pool of kvattn's own per device (cuMemPoolCreate on that device, release threshold at its maximum, so freed memory
stays in the pool and is handed out again without a call to the OS or a device synchronisation), allocated with
cuMemAllocFromPoolAsync on the run's stream and freed with cuMemFreeAsync on the same stream when the last array
viewing the block is gone. In front of it, a small free list per (bytes, stream) keeps a few freed blocks for the
next request of that size on that stream: reusing a block on the stream it was freed on is stream-ordered by
construction (the new writer queues after every earlier use on that stream), and costs no driver call.
A consumer that read the block on another stream (through `__dlpack__(stream=S)`) is waited for before the block is
freed, and such a block never enters the free list. A consumer that reads through `__cuda_array_interface__` on
another stream must keep the array alive until its reads are queued behind a synchronisation (as with any
stream-ordered allocator: PyTorch's record_stream, CuPy's pool).
A block keeps its kvattn Stream alive, and a stream kvattn created frees the blocks its free list keeps before it
is destroyed (`release_free_lists(handle)`), so no free is ever queued on a destroyed stream's handle (run 50a: a segfault in
cuMemFreeAsync when a test's own stream was collected before its output). A stream kvattn did not create (a
framework's, a raw handle) must outlive the arrays allocated or written on it, as with the framework's own allocator
(PyTorch never destroys its streams); a caller about to destroy one calls `release_free_lists(handle)` first.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from . import _driver, device as _device

if TYPE_CHECKING:
    from .memory import DeviceArray

_deferred: list = []   # blocks whose free failed (e.g. inside another stream's graph capture): retried later
_hot: list = [None, None]   # [cuMemAllocFromPoolAsync, cuMemFreeAsync] once a pool exists
_pools: dict = {}            # device ordinal -> pool handle


def _pool(device: int):
    pool = _pools.get(device)
    if pool is None:
        drv = _driver.driver()
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device
        pool = _driver.call("cuMemPoolCreate", props)
        _driver.call("cuMemPoolSetAttribute", pool, drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                     drv.cuuint64_t(2 ** 64 - 1))
        _hot[:] = [drv.cuMemAllocFromPoolAsync, drv.cuMemFreeAsync]
        _pools[device] = pool
    return pool


FREE_LIST_BLOCKS = 4             # blocks kept per (bytes, stream)
FREE_LIST_BYTES = 256 << 20      # bytes kept in all free lists together
_free_lists: dict = {}           # (nbytes, stream handle, device) -> [ptr, ...]
_free_bytes = [0]


class PoolBlock:
    """One stream-ordered allocation (ptr, bytes, the handle of its stream, its device, the kvattn Stream of that
    handle, kept alive until the block is freed); back to its free list or freed on its stream when garbage."""

    __slots__ = ("ptr", "nbytes", "stream", "used_on", "device", "keep")

    def __del__(self):
        try:
            if self.used_on is None:
                key = (self.nbytes, self.stream, self.device)
                lst = _free_lists.get(key)
                if lst is None:
                    lst = _free_lists[key] = []
                if len(lst) < FREE_LIST_BLOCKS and _free_bytes[0] + self.nbytes <= FREE_LIST_BYTES:
                    lst.append(self.ptr)
                    _free_bytes[0] += self.nbytes
                    return
            if not _free(self.ptr, self.stream, self.used_on, self.device):
                _deferred.append((self.ptr, self.stream, self.used_on, self.device))
        except Exception:   # interpreter shutdown: the context goes with the process
            pass


def release_free_lists(stream: int | None = None):
    """Give the blocks kept in the free lists back to the pool (stream-ordered frees): those of the stream with
    handle `stream` (before that stream is destroyed), or of every stream (None). A free that fails (another stream
    capturing in global mode) leaves its block to the pool unfreed: rare, and a stream being destroyed cannot wait
    for a retry."""
    for key in [k for k in _free_lists if stream is None or k[1] == stream]:
        nbytes, handle, device = key
        lst = _free_lists.pop(key)
        _free_bytes[0] -= nbytes * len(lst)
        for ptr in lst:
            _free(ptr, handle, None, device)


def _free(ptr, stream, used_on, device) -> bool:
    """Free a block on its stream (after the streams in used_on). The legacy and per-thread handles name the
    current context's stream, so with several GPUs the block's device's context is made current for the free (a
    block of GPU 1 freed under GPU 0's context would be ordered after GPU 0's work, not its own)."""
    if (stream == 1 or stream == 2) and device is not None and _device.several():
        with _device.get(device).activate():
            return _free_here(ptr, stream, used_on)
    return _free_here(ptr, stream, used_on)


def _free_here(ptr, stream, used_on) -> bool:
    from .stream import as_stream, order_after
    if used_on:
        s = as_stream(stream)
        for other in used_on:
            order_after(other, s)
    err, = _hot[1](ptr, stream)
    return not err


def _retry_deferred():
    pending = _deferred[:]
    _deferred.clear()
    for item in pending:
        if not _free(*item):
            _deferred.append(item)


def pool_empty(shape: tuple, dtype: np.dtype, stream, device: int | None = None) -> "DeviceArray":
    """A contiguous uninitialised array from the pool of `device` (an ordinal; None: the current context's
    device, whose context must be current), ordered on `stream` (a kvattn Stream). shape: a tuple of ints; dtype:
    a numpy dtype. The returned array's `stream` is that stream's handle."""
    if device is None:
        device = _driver.current_device().ordinal
    itemsize = dtype.itemsize
    strides = _memory.contiguous_strides(shape, itemsize)
    h = stream.ptr
    nbytes = math.prod(shape) * itemsize or 1
    lst = _free_lists.get((nbytes, h, device))
    if lst:
        ptr = lst.pop()
        _free_bytes[0] -= nbytes
    else:
        pool = _pools.get(device)
        if pool is None:
            pool = _pool(device)
        alloc = _hot[0]
        if _deferred:
            _retry_deferred()
        err, ptr = alloc(nbytes, pool, h)
        if err:
            _driver.fail("cuMemAllocFromPoolAsync", err)
        ptr = int(ptr)
    block = PoolBlock.__new__(PoolBlock)
    block.ptr, block.nbytes, block.stream, block.used_on, block.device, block.keep = ptr, nbytes, h, None, device, stream
    return _memory.DeviceArray._make(ptr, shape, dtype, strides, block, h)


def note_use(array, consumer: int):
    """Record that a pool-backed array is read on the stream with handle `consumer` (see the module docstring)."""
    owner = array.owner
    while owner is not None and not isinstance(owner, PoolBlock):
        owner = getattr(owner, "owner", None)
    if owner is not None and consumer != owner.stream:
        if owner.used_on is None:
            owner.used_on = {consumer}
        else:
            owner.used_on.add(consumer)


def pool_usage(device: int | None = None) -> tuple[int, int]:
    """(bytes in use, bytes reserved) of kvattn's pool on `device` (None: the current one): what a
    memory-flatness check reads (blocks in the free lists count as in use)."""
    drv = _driver.driver()
    a = drv.CUmemPool_attribute
    pool = _pool(_driver.current_device().ordinal if device is None else device)
    used = _driver.call("cuMemPoolGetAttribute", pool, a.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    reserved = _driver.call("cuMemPoolGetAttribute", pool, a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    return int(used), int(reserved)


# kvattn.memory (DeviceArray, contiguous_strides), bound once here rather than by an import statement in pool_empty
# (1.1 us a call); last, so that either module may be imported first (memory imports note_use from this one).
from . import memory as _memory  # noqa: E402
