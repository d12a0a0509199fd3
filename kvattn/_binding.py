"""What every op's run() does at its boundary: resolve the stream, import the caller's arrays, provide outputs.

    s, capturing = begin(stream)
    q = import_array(q, s, capturing)            # see kvattn._interop
    out, out_ret = output(out, shape, dtype, s, capturing, "out")
    ... launches on s ...
    out.written_on(s)                            # exports now order their consumers after s

An implicit output (`out=None`) comes from kvattn's stream-ordered pool (kvattn.pool); it is refused while the
stream captures a graph (the pool block would not be the same at each replay).
"""
from __future__ import annotations

from ._errors import KvattnError
from ._interop import import_array
from .pool import pool_empty
from .stream import as_stream


def begin(stream):
    """(the kvattn Stream that `stream` names, whether it is capturing a graph now)."""
    s = as_stream(stream)
    return s, s.is_capturing()


def output(arr, shape: tuple, dtype, s, capturing: bool, name: str, device: int | None = None):
    """(DeviceArray to write, the object run() returns for it): the caller's array as given, or a new pool
    array of shape / dtype (numpy dtype) on stream s, on `device` (an ordinal; None: the current one)."""
    if arr is None:
        if capturing:
            raise KvattnError(
                f"{name}: run() is being captured into a graph with {name}=None; an implicit allocation cannot be "
                f"replayed: pass {name} (a preallocated array, the same one at capture and at every replay)")
        a = pool_empty(shape, dtype, s, device)
        return a, a
    return import_array(arr, s, capturing), arr


def misaligned16(ptr: int, strides: tuple) -> bool:
    """True when the pointer or a stride of any but the last axis is not a multiple of 16 bytes."""
    n = len(strides)
    if n == 3:
        return bool((ptr | strides[0] | strides[1]) & 15)
    if n == 4:
        return bool((ptr | strides[0] | strides[1] | strides[2]) & 15)
    bad = ptr
    for x in strides[:-1]:
        bad |= x
    return bool(bad & 15)


__all__ = ["begin", "output", "import_array", "misaligned16"]
