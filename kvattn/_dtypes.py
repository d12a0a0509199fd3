"""The element types kvattn moves between host and device, and their names in CUDA C and DLPack."""
from __future__ import annotations

import ml_dtypes
import numpy as np

# name -> (numpy dtype, CUDA C type, DLPack (code, bits))
_TABLE = {
    "float16": (np.dtype(np.float16), "half", (2, 16)),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", (4, 16)),
    "float8_e4m3fn": (np.dtype(ml_dtypes.float8_e4m3fn), "__nv_fp8_e4m3", (10, 8)),
    "float8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), "__nv_fp8_e5m2", (12, 8)),
    "float32": (np.dtype(np.float32), "float", (2, 32)),
    "int32": (np.dtype(np.int32), "int", (0, 32)),
    "int64": (np.dtype(np.int64), "long long", (0, 64)),
    "uint8": (np.dtype(np.uint8), "unsigned char", (1, 8)),
}
_BY_NUMPY = {v[0]: k for k, v in _TABLE.items()}
_BY_DLPACK = {v[2]: k for k, v in _TABLE.items()}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
            "e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}

SUPPORTED = tuple(_TABLE)


def dtype_name(dtype) -> str:
    """Canonical kvattn name of a dtype given as a name, a numpy dtype or a numpy scalar type."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name in _TABLE:
            return name
        raise TypeError(f"dtype: expected one of {', '.join(SUPPORTED)}, got {dtype!r}")
    try:
        npd = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected one of {', '.join(SUPPORTED)}, got {dtype!r}") from None
    if npd in _BY_NUMPY:
        return _BY_NUMPY[npd]
    raise TypeError(f"dtype: expected one of {', '.join(SUPPORTED)}, got {npd}")


FP8 = ("float8_e4m3fn", "float8_e5m2")


def is_fp8(dtype) -> bool:
    """None (no cache dtype given: the queries' 16-bit type) is not."""
    return dtype is not None and dtype_name(dtype) in FP8


def to_numpy(dtype) -> np.dtype:
    return _TABLE[dtype_name(dtype)][0]


def to_ctype(dtype) -> str:
    return _TABLE[dtype_name(dtype)][1]


def to_dlpack(dtype) -> tuple[int, int]:
    return _TABLE[dtype_name(dtype)][2]


def from_dlpack(code: int, bits: int) -> np.dtype:
    name = _BY_DLPACK.get((code, bits))
    if name is None:
        raise TypeError(f"array: DLPack dtype (code {code}, bits {bits}) is not supported by kvattn")
    return _TABLE[name][0]


def from_typestr(typestr: str) -> np.dtype:
    """numpy dtype of a __cuda_array_interface__ typestr; raw '<V2' (bfloat16 from PyTorch) is ambiguous."""
    npd = np.dtype(typestr)
    if npd.kind == "V":
        raise TypeError(f"array: typestr {typestr!r} is raw bytes; pass the array through DLPack to give its dtype")
    if npd not in _BY_NUMPY:
        raise TypeError(f"array: dtype {npd} is not supported by kvattn")
    return npd
