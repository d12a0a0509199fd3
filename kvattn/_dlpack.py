"""DLPack (legacy 'dltensor' capsules) through ctypes: export a device buffer, read an imported one."""
from __future__ import annotations

import ctypes
import struct

K_DL_CUDA = 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

# The destructor gets a raw PyObject* (refcount already 0): never turn it back into a Python object.
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))

# Exported tensors stay alive here (with the Python owner of their memory) until the consumer calls the
# deleter, or the capsule dies unconsumed.
_live: dict[int, tuple] = {}

# One export is one ctypes buffer: the DLManagedTensor (DLTensor 48 bytes, manager_ctx, deleter), then the shape
# and strides arrays it points to, packed with one struct call (ctypes Structure objects cost ~1 us each).
_MANAGED = struct.Struct("<QiiiBBHQQQQQ")
_SHAPES = [struct.Struct(f"<{2 * n}q") for n in range(9)]


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _delete_managed(addr):
    _live.pop(addr, None)


_DELETER_ADDR = ctypes.cast(_delete_managed, ctypes.c_void_p).value


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule):
    # Only an unconsumed capsule (still named "dltensor") owns its tensor.
    if _raw_is_valid(capsule, b"dltensor"):
        addr = _raw_get_pointer(capsule, b"dltensor")
        _live.pop(addr, None)


def export(ptr: int, shape, strides_elems, code: int, bits: int, owner, device_id: int = 0):
    """A 'dltensor' capsule describing device memory at ptr; owner is kept alive until it is released."""
    ndim = len(shape)
    buf = ctypes.create_string_buffer(_MANAGED.size + 16 * ndim)
    addr = ctypes.addressof(buf)
    dims = addr + _MANAGED.size
    _MANAGED.pack_into(buf, 0, ptr, K_DL_CUDA, device_id, ndim, code, bits, 1, dims, dims + 8 * ndim, 0, 0,
                       _DELETER_ADDR)
    packer = _SHAPES[ndim] if ndim < len(_SHAPES) else struct.Struct(f"<{2 * ndim}q")
    packer.pack_into(buf, _MANAGED.size, *shape, *strides_elems)
    _live[addr] = (buf, owner)
    return _api.PyCapsule_New(addr, b"dltensor", _capsule_destructor)


_raw_string_at = ctypes.string_at


def capsule_pointer(capsule) -> int:
    """The DLManagedTensor address held by an unconsumed 'dltensor' capsule (the capsule stays unconsumed)."""
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("array: __dlpack__ did not return a 'dltensor' capsule")
    return _api.PyCapsule_GetPointer(capsule, b"dltensor")


def string_at(addr: int, nbytes: int) -> bytes:
    """nbytes of host memory at addr (the DLTensor struct, its shape and strides arrays)."""
    return _raw_string_at(addr, nbytes)


def read(capsule):
    """(ptr, shape, strides_elems or None, (code, bits, lanes), device_type, device_id) of a 'dltensor' capsule.

    The capsule is left unconsumed: holding it keeps the producer's memory alive, and its own
    destructor frees it when the holder lets go.
    """
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("array: __dlpack__ did not return a 'dltensor' capsule")
    addr = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    t = DLManagedTensor.from_address(addr).dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
    ptr = (t.data or 0) + t.byte_offset
    return ptr, shape, strides, (t.dtype.code, t.dtype.bits, t.dtype.lanes), t.device.device_type, t.device.device_id
