"""DLPack (legacy 'dltensor' capsules) through ctypes: export a device buffer, read an imported one."""
from __future__ import annotations

import ctypes

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


@_DELETER
def _delete_managed(ptr):
    _live.pop(ctypes.addressof(ptr.contents), None)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule):
    # Only an unconsumed capsule (still named "dltensor") owns its tensor.
    if _raw_is_valid(capsule, b"dltensor"):
        addr = _raw_get_pointer(capsule, b"dltensor")
        _live.pop(addr, None)


def export(ptr: int, shape, strides_elems, code: int, bits: int, owner, device_id: int = 0):
    """A 'dltensor' capsule describing device memory at ptr; owner is kept alive until it is released."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides_elems)
    managed = DLManagedTensor()
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = DLDevice(K_DL_CUDA, device_id)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, 1)
    managed.dl_tensor.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _delete_managed
    addr = ctypes.addressof(managed)
    _live[addr] = (managed, shape_arr, strides_arr, owner)
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
