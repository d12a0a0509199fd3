"""Stream-ordered device memory for the arrays run() allocates (`out=None`, `return_lse`).

One memory pool of kvattn's own (cuMemPoolCreate on device 0, release threshold at its maximum, so freed memory
stays in the pool and is handed out again without a call to the OS or a device synchronisation), allocated with
cuMemAllocFromPoolAsync on the run's stream and freed with cuMemFreeAsync on the same stream when the last array
viewing the block is gone. A consumer that read the block on another stream (through `__dlpack__(stream=S)`) is
waited for before the free, so the memory is never handed out while a queued read of it remains.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from . import _driver

if TYPE_CHECKING:
    from .memory import DeviceArray

_state: dict = {}
_deferred: list = []   # blocks whose free failed (e.g. inside another stream's graph capture): retried later


def _pool():
    pool = _state.get("pool")
    if pool is None:
        drv = _driver.driver()
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        pool = _driver.call("cuMemPoolCreate", props)
        _driver.call("cuMemPoolSetAttribute", pool, drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                     drv.cuuint64_t(2 ** 64 - 1))
        _state["pool"] = pool
        _state["alloc"] = drv.cuMemAllocFromPoolAsync
        _state["free"] = drv.cuMemFreeAsync
    return pool


class PoolBlock:
    """One stream-ordered allocation; freed on its stream when garbage."""

    __slots__ = ("ptr", "stream", "used_on")

    def __init__(self, nbytes: int, stream: int):
        pool = _pool()
        if _deferred:
            _retry_deferred()
        err, ptr = _state["alloc"](max(nbytes, 1), pool, stream)
        if err:
            _driver.call("cuMemAllocFromPoolAsync", max(nbytes, 1), pool, stream)   # raises, naming the error
        self.ptr = int(ptr)
        self.stream = stream
        self.used_on = None

    def __del__(self):
        try:
            if not _free(self.ptr, self.stream, self.used_on):
                _deferred.append((self.ptr, self.stream, self.used_on))
        except Exception:   # interpreter shutdown: the context goes with the process
            pass


def _free(ptr, stream, used_on) -> bool:
    from .stream import as_stream, order_after
    s = as_stream(stream)
    if used_on:
        for other in used_on:
            order_after(other, s)
    err, = _state["free"](ptr, stream)
    return not err


def _retry_deferred():
    pending = _deferred[:]
    _deferred.clear()
    for item in pending:
        if not _free(*item):
            _deferred.append(item)


def pool_empty(shape: tuple, dtype: np.dtype, stream) -> "DeviceArray":
    """A contiguous uninitialised array from the pool, ordered on `stream` (a kvattn Stream). shape: a tuple of
    ints; dtype: a numpy dtype. The returned array's `stream` is that stream."""
    from .memory import DeviceArray, _contiguous_strides
    itemsize = dtype.itemsize
    block = PoolBlock(math.prod(shape) * itemsize, stream.ptr)
    return DeviceArray._make(block.ptr, shape, dtype, _contiguous_strides(shape, itemsize), block, stream.ptr)


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


def pool_usage() -> tuple[int, int]:
    """(bytes in use, bytes reserved) of kvattn's pool: what a memory-flatness check reads."""
    drv = _driver.driver()
    a = drv.CUmemPool_attribute
    used = _driver.call("cuMemPoolGetAttribute", _pool(), a.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    reserved = _driver.call("cuMemPoolGetAttribute", _pool(), a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    return int(used), int(reserved)
