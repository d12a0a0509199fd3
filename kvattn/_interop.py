"""Importing a caller's array for use on a stream: DeviceArray, numpy, torch.Tensor, CUDA Array Interface, DLPack.

Ordering rules (the producer's pending writes come before the consumer stream's work):
- DeviceArray: the stream that wrote it is waited for.
- CUDA Array Interface v3: its "stream" field is waited for (absent or None: ready).
- DLPack: the producer is given the consumer stream in DLPack's convention (1 legacy, 2 per-thread, else the
  handle) and orders itself.
- torch.Tensor: read through its public attributes (data_ptr, shape, stride, dtype), ordered as torch's own
  `__dlpack__` orders it (torch's current stream is waited for when it is not the consumer). Torch's
  `__dlpack__(stream=S)` costs about 12 us per tensor in Python, this about 2 us; torch is never imported (the
  tensor's own module is looked up in sys.modules).
While the consumer stream is capturing a graph no cross-stream wait is added (DLPack producers get -1): the
caller has ordered its producers before the capture, as every framework's graph capture requires.
"""
from __future__ import annotations

import struct
import sys

import numpy as np

from . import _dlpack, _dtypes
from ._errors import KvattnError
from .memory import DeviceArray, from_numpy
from .stream import Stream, order_after

_strategy: dict = {}   # type -> "torch" | "cai" | "dlpack": how arrays of that type were read last time


def import_array(x, stream: Stream, capturing: bool) -> DeviceArray:
    """A DeviceArray viewing x's device memory, ordered before `stream`'s next work (see the module docstring)."""
    if type(x) is DeviceArray:
        w = x.stream
        if w is not None and w != stream.ptr and not capturing:
            order_after(w, stream)
        return x
    t = type(x)
    how = _strategy.get(t)
    if how is None:
        how = _choose(x)
    if how == "torch":
        return _from_torch(x, stream, capturing)
    if how == "cai":
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is not None and cai["typestr"][1] != "V":
            return _from_cai(x, cai, stream, capturing)
        _strategy[t] = "dlpack"   # e.g. bfloat16 reported as raw bytes: DLPack names the element type
    if how in ("cai", "dlpack") and hasattr(x, "__dlpack__"):
        return _from_dlpack(x, stream, capturing)
    if isinstance(x, DeviceArray):   # a subclass
        if x.stream is not None and x.stream != stream.ptr and not capturing:
            order_after(x.stream, stream)
        return x
    if isinstance(x, np.ndarray):
        if capturing:
            raise KvattnError("array: a numpy array is copied to the device, which a graph capture cannot record; "
                              "pass a device array")
        return from_numpy(x, stream)
    cai = getattr(x, "__cuda_array_interface__", None) if how != "torch" else None
    if cai is not None:   # raw-bytes typestr and no DLPack: cannot tell the element type
        _dtypes.from_typestr(cai["typestr"])
    raise TypeError(
        f"array: expected a numpy array, a kvattn.DeviceArray or a CUDA array exposing __cuda_array_interface__ "
        f"or __dlpack__ (CuPy, PyTorch, JAX, numba), got {type(x).__module__}.{type(x).__name__}")


def _choose(x) -> str:
    t = type(x)
    how = None
    if isinstance(x, (DeviceArray, np.ndarray)):
        return "other"
    if t.__module__.split(".", 1)[0] == "torch" and hasattr(x, "data_ptr") and hasattr(x, "stride"):
        how = "torch"
    elif hasattr(t, "__cuda_array_interface__"):
        how = "cai"
    elif hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            dev_type = int(x.__dlpack_device__()[0])
        except Exception:
            dev_type = -1
        how = "dlpack" if dev_type == _dlpack.K_DL_CUDA else "other"
    else:
        try:   # some producers raise from the attribute for arrays they cannot describe (JAX bfloat16)
            how = "cai" if hasattr(x, "__cuda_array_interface__") else "other"
        except Exception:
            how = "dlpack" if hasattr(x, "__dlpack__") else "other"
    if how != "other":
        _strategy[t] = how
    return how


# -- CUDA Array Interface ------------------------------------------------------------------------------
def _from_cai(x, cai, stream: Stream, capturing: bool) -> DeviceArray:
    dtype = _dtypes.from_typestr(cai["typestr"])
    producer = cai.get("stream")
    if producer is not None and not capturing:
        producer = int(producer)
        if producer != stream.ptr:
            order_after(producer, stream)
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    strides = _contiguous(shape, dtype.itemsize) if strides is None else tuple(strides)
    return DeviceArray._make(cai["data"][0] or 0, shape, dtype, strides, x)


def _contiguous(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


# -- DLPack --------------------------------------------------------------------------------------------
_DLTENSOR = struct.Struct("<QiiiBBHQQQ")   # data, device (type, id), ndim, dtype (code, bits, lanes), shape, strides, byte_offset
_I64 = [struct.Struct(f"<{n}q") for n in range(9)]


def _from_dlpack(x, stream: Stream, capturing: bool) -> DeviceArray:
    value = -1 if capturing else stream.dlpack
    try:
        capsule = x.__dlpack__(stream=value)
    except TypeError:   # producers without the stream keyword
        capsule = x.__dlpack__()
    addr = _dlpack.capsule_pointer(capsule)
    data, dev_type, _dev_id, ndim, code, bits, lanes, shape_p, strides_p, offset = _DLTENSOR.unpack(
        _dlpack.string_at(addr, _DLTENSOR.size))
    if dev_type != _dlpack.K_DL_CUDA:
        raise TypeError(f"array: DLPack device type {dev_type} is not CUDA ({_dlpack.K_DL_CUDA})")
    if lanes != 1:
        raise TypeError(f"array: DLPack vector lanes ({lanes}) are not supported")
    dtype = _dtypes.from_dlpack(code, bits)
    unpack = _I64[ndim] if ndim < len(_I64) else struct.Struct(f"<{ndim}q")
    shape = unpack.unpack(_dlpack.string_at(shape_p, 8 * ndim)) if ndim else ()
    if strides_p:
        it = dtype.itemsize
        strides = tuple(s * it for s in unpack.unpack(_dlpack.string_at(strides_p, 8 * ndim)))
    else:
        strides = _contiguous(shape, dtype.itemsize)
    return DeviceArray._make((data or 0) + offset, shape, dtype, strides, (x, capsule))


# -- torch.Tensor ----------------------------------------------------------------------------------------
_torch: dict = {}


def _torch_tables():
    torch = sys.modules["torch"]
    names = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int32", "int64", "uint8")
    dtypes = {getattr(torch, n): _dtypes.to_numpy(n) for n in names if hasattr(torch, n)}
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    if raw is None:   # the public (slower) spelling
        def raw(index):
            return torch.cuda.current_stream(index).cuda_stream
    _torch.update(dtypes=dtypes, current_stream=raw)
    return _torch


def _from_torch(x, stream: Stream, capturing: bool) -> DeviceArray:
    tables = _torch or _torch_tables()
    if not x.is_cuda:
        raise TypeError(f"array: a torch tensor on {x.device} (expected a CUDA tensor; move it with .cuda())")
    dev = x.get_device()
    if dev != 0:
        raise ValueError(f"array: a torch tensor on cuda:{dev}; kvattn runs on device 0")
    dtype = tables["dtypes"].get(x.dtype)
    if dtype is None:
        raise TypeError(f"array: torch dtype {x.dtype} is not supported by kvattn")
    if not capturing:
        producer = tables["current_stream"](dev)
        if producer != stream.ptr and not (producer == 0 and stream.ptr == 1):
            order_after(producer, stream)
    it = dtype.itemsize
    return DeviceArray._make(x.data_ptr(), tuple(x.shape), dtype, tuple(s * it for s in x.stride()), x)
