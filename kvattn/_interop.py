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
- cupy.ndarray: read through its compiled attributes (data.ptr, shape, strides, dtype), ordered as its CAI v3 export
  orders it (CuPy's current stream is waited for when it is not the consumer): its `__cuda_array_interface__`
  builds a dict on every access.
- JAX arrays that are computed (`is_ready()`): read through unsafe_buffer_pointer / shape / dtype (JAX arrays
  are immutable, so a computed one needs no ordering); not yet computed: DLPack, which orders them.
- CAI arrays whose typestr is raw bytes ('<V2', CuPy's bfloat16) take their own numpy `dtype` when it has that
  size; otherwise DLPack names the element type.
While the consumer stream is capturing a graph no cross-stream wait is added (DLPack producers get -1): the
caller has ordered its producers before the capture, as every framework's graph capture requires.
"""
from __future__ import annotations

import sys

import numpy as np

from . import _dlpack, _dtypes, device as _device
from ._errors import KvattnError
from .memory import DeviceArray, contiguous_strides, from_numpy
from .stream import Stream, order_after

_strategy: dict = {}   # type -> "torch" | "cai" | "dlpack": how arrays of that type were read last time
# The device whose op is running on this thread (kvattn.device.active): a torch tensor, which names its device, must
# be on it.
active = _device.active


def import_array(x, stream: Stream, capturing: bool) -> DeviceArray:
    """A DeviceArray viewing x's device memory, ordered before `stream`'s next work (see the module docstring)."""
    if type(x) is DeviceArray or isinstance(x, DeviceArray):
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
    if how == "cupy":
        return _from_cupy(x, stream, capturing)
    if how == "jax":
        a = _from_jax(x)
        if a is not None:
            return a
        how = "dlpack"   # not computed yet (or not one buffer): DLPack orders it on the consumer stream
    if how == "cai":
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is not None:
            dtype = _cai_dtype(x, cai["typestr"])
            if dtype is not None:
                return _from_cai(x, cai, dtype, stream, capturing)
        _strategy[t] = "dlpack"   # e.g. bfloat16 reported as raw bytes: DLPack names the element type
    if how in ("cai", "dlpack") and hasattr(x, "__dlpack__"):
        return _from_dlpack(x, stream, capturing)
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
    if isinstance(x, np.ndarray):
        return "other"
    root = t.__module__.split(".", 1)[0]
    if root == "torch" and hasattr(x, "data_ptr") and hasattr(x, "stride"):
        how = "torch"
    elif root == "cupy" and hasattr(t, "__cuda_array_interface__") and hasattr(x, "data") and hasattr(x, "strides"):
        how = "cupy"
    elif root in ("jax", "jaxlib") and hasattr(x, "unsafe_buffer_pointer") and hasattr(x, "is_ready"):
        how = "jax"
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
_typestrs: dict = {}


def _cai_dtype(x, typestr: str):
    """The numpy dtype of a CAI typestr; raw bytes ('<V2': bfloat16 from CuPy) take the array's own numpy dtype
    when it has one of that size (CuPy holds bfloat16 as ml_dtypes' type). None: DLPack must name it."""
    dtype = _typestrs.get(typestr)
    if dtype is None:
        if typestr[1] == "V":
            own = getattr(x, "dtype", None)
            if isinstance(own, np.dtype) and own.itemsize == int(typestr[2:]):
                try:
                    return _dtypes.to_numpy(own)
                except TypeError:
                    return None
            return None
        dtype = _typestrs[typestr] = _dtypes.from_typestr(typestr)
    return dtype


def _from_cai(x, cai, dtype, stream: Stream, capturing: bool) -> DeviceArray:
    producer = cai.get("stream")
    if producer is not None and not capturing:
        producer = int(producer)
        if producer != stream.ptr:
            order_after(producer, stream)
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    strides = contiguous_strides(shape, dtype.itemsize) if strides is None else tuple(strides)
    return DeviceArray._make(cai["data"][0] or 0, shape, dtype, strides, x)


_numpy_dtypes: dict = {}


# -- JAX -----------------------------------------------------------------------------------------------
def _from_jax(x):
    """A computed single-buffer JAX array through its public attributes (unsafe_buffer_pointer, shape, dtype;
    JAX arrays are dense and row-major and never written again); None when it is not computed yet: the DLPack
    path then orders it on the consumer stream. JAX's own __dlpack__(stream=) plus reading the capsule costs
    about 10 us an array."""
    try:
        if not x.is_ready():
            return None
        ptr = x.unsafe_buffer_pointer()
    except Exception:   # a sharded or deleted array: DLPack says what is wrong
        return None
    dtype = _numpy_dtypes.get(x.dtype)
    if dtype is None:
        if not isinstance(x.dtype, np.dtype):
            return None
        dtype = _numpy_dtypes[x.dtype] = _dtypes.to_numpy(x.dtype)   # raises for an unsupported type
    shape = tuple(x.shape)
    return DeviceArray._make(ptr, shape, dtype, contiguous_strides(shape, dtype.itemsize), x)


# -- DLPack --------------------------------------------------------------------------------------------
def _from_dlpack(x, stream: Stream, capturing: bool) -> DeviceArray:
    value = -1 if capturing else stream.dlpack
    try:
        capsule = x.__dlpack__(stream=value)
    except TypeError:   # producers without the stream keyword
        capsule = x.__dlpack__()
    ptr, shape, strides, (code, bits, lanes), dev_type, dev_id = _dlpack.read(capsule)
    if dev_type != _dlpack.K_DL_CUDA:
        raise TypeError(f"array: DLPack device type {dev_type} is not CUDA ({_dlpack.K_DL_CUDA})")
    want = getattr(active, "ordinal", None)
    if want is not None and dev_id != want:
        raise ValueError(f"array: a DLPack array on CUDA device {dev_id}, but this op runs on device {want} (pass "
                         f"arrays on device {want}, or build the op with device={dev_id})")
    if lanes != 1:
        raise TypeError(f"array: DLPack vector lanes ({lanes}) are not supported")
    dtype = _dtypes.from_dlpack(code, bits)
    it = dtype.itemsize
    strides = contiguous_strides(shape, it) if strides is None else tuple(s * it for s in strides)
    return DeviceArray._make(ptr, shape, dtype, strides, (x, capsule))


# -- cupy.ndarray ----------------------------------------------------------------------------------------
_cupy: dict = {}


def _from_cupy(x, stream: Stream, capturing: bool) -> DeviceArray:
    """A cupy.ndarray read through its compiled attributes (pointer, shape, byte strides, dtype), not the dict its
    __cuda_array_interface__ builds on every access, with CAI v3's ordering: CuPy's current stream, which its CAI
    reports as the producer, is waited for (its 0 is the legacy stream)."""
    if not _cupy:
        _cupy.update(current_stream=sys.modules["cupy"].cuda.get_current_stream, dtypes={})
    dtype = _cupy["dtypes"].get(x.dtype)
    if dtype is None:   # (numpy's dtypes, ml_dtypes' bfloat16 / float8; others raise naming the type)
        dtype = _cupy["dtypes"][x.dtype] = _dtypes.to_numpy(x.dtype)
    if not capturing:
        _after_current(_cupy["current_stream"]().ptr, stream)
    return DeviceArray._make(x.data.ptr, x.shape, dtype, x.strides, x)


def _after_current(producer: int, stream: Stream):
    """Order `stream` after a framework's current stream (handle `producer`; torch's and CuPy's 0 is the legacy
    stream, 1), unless they are the same stream."""
    if producer != stream.ptr and (producer or stream.ptr != 1):
        order_after(producer, stream)


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


def _check_torch_device(x, dev: int):
    """A torch tensor must be a CUDA tensor, on the device of the op importing it when one is (outside the ops,
    e.g. merge_state or append_paged_kv_cache on the current context, the device is not checked: as for arrays
    of the other frameworks)."""
    if not x.is_cuda:
        raise TypeError(f"array: a torch tensor on {x.device} (expected a CUDA tensor; move it with .cuda())")
    want = getattr(active, "ordinal", None)
    if want is not None and dev != want:
        raise ValueError(f"array: a torch tensor on cuda:{dev}, but this op runs on device {want} (pass tensors on "
                         f"cuda:{want}, or build the op with device={dev})")


def _from_torch(x, stream: Stream, capturing: bool) -> DeviceArray:
    tables = _torch or _torch_tables()
    dev = x.get_device()   # -1 for a CPU tensor
    if dev != getattr(active, "ordinal", None):
        _check_torch_device(x, dev)
    dtype = tables["dtypes"].get(x.dtype)
    if dtype is None:
        raise TypeError(f"array: torch dtype {x.dtype} is not supported by kvattn")
    if not capturing:
        _after_current(tables["current_stream"](dev), stream)
    it, st = dtype.itemsize, x.stride()
    if len(st) == 3:   # (element strides to bytes: unpacked, a third of a map()'s time; run()'s q / k / v / out)
        a, b, c = st
        strides = (a * it, b * it, c * it)
    elif len(st) == 4:
        a, b, c, d = st
        strides = (a * it, b * it, c * it, d * it)
    else:
        strides = tuple([n * it for n in st])
    return DeviceArray._make(x.data_ptr(), tuple(x.shape), dtype, strides, x)
