"""DLPack (legacy 'dltensor' capsules) through ctypes: export a device buffer, read an imported one."""
from __future__ import annotations

import ctypes
import struct

K_DL_CUDA = 2


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

# A DLManagedTensor is its DLTensor (data, device type and id, ndim, dtype code / bits / lanes, shape pointer,
# strides pointer, byte offset: 48 bytes), then manager_ctx and the deleter. Read and written with struct
# (ctypes Structure objects cost ~1 us each); one export is one ctypes buffer holding it, then the shape and
# strides arrays it points to.
_DLTENSOR = struct.Struct("<QiiiBBHQQQ")
_MANAGED = struct.Struct(_DLTENSOR.format + "QQ")   # + manager_ctx, deleter
_I64 = [struct.Struct(f"<{n}q") for n in range(17)]


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
    _int64s(2 * ndim).pack_into(buf, _MANAGED.size, *shape, *strides_elems)
    _live[addr] = (buf, owner)
    return _api.PyCapsule_New(addr, b"dltensor", _capsule_destructor)


def _int64s(n: int) -> struct.Struct:
    return _I64[n] if n < len(_I64) else struct.Struct(f"<{n}q")


def read(capsule):
    """(ptr, shape, strides_elems or None, (code, bits, lanes), device_type, device_id) of a 'dltensor' capsule.

    The capsule is left unconsumed: holding it keeps the producer's memory alive, and its own
    destructor frees it when the holder lets go.
    """
    if not _api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("array: __dlpack__ did not return a 'dltensor' capsule")
    addr = _api.PyCapsule_GetPointer(capsule, b"dltensor")
    data, dev_type, dev_id, ndim, code, bits, lanes, shape_p, strides_p, offset = _DLTENSOR.unpack(
        ctypes.string_at(addr, _DLTENSOR.size))
    unpack = _int64s(ndim).unpack
    shape = unpack(ctypes.string_at(shape_p, 8 * ndim)) if ndim else ()
    strides = (unpack(ctypes.string_at(strides_p, 8 * ndim)) if ndim else ()) if strides_p else None
    return (data or 0) + offset, shape, strides, (code, bits, lanes), dev_type, dev_id
