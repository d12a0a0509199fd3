"""Shared input-validation helpers (numpy only, no GPU).

Every helper takes the user-facing argument ``name`` so that error messages
say which argument was wrong and what was expected, e.g.
``ValueError("indptr: must start at 0, got 3")``.  Wrong *kinds* (a float
array where indices are expected, a string where an int is expected) raise
``TypeError``; wrong *values* raise ``ValueError``.
"""
from __future__ import annotations

import numbers

import numpy as np

try:  # ml_dtypes registers bfloat16 / float8 host dtypes with numpy
    import ml_dtypes as _ml

    _EXTRA_FLOATS = frozenset(
        np.dtype(getattr(_ml, n))
        for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(_ml, n)
    )
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    _EXTRA_FLOATS = frozenset()

INT32_MIN = int(np.iinfo(np.int32).min)
INT32_MAX = int(np.iinfo(np.int32).max)


def _fmt(a: np.ndarray, limit: int = 8) -> str:
    flat = np.asarray(a).ravel()
    body = ", ".join(str(x) for x in flat[:limit].tolist())
    return "[" + body + (", ..." if flat.size > limit else "") + "]"


def as_index_array(x, name: str, *, ndim: int = 1, min_value: int | None = None) -> np.ndarray:
    """Return ``x`` as a fresh, read-only, C-contiguous int32 array.

    Integer arrays of any width are converted; values must fit int32.
    Raises TypeError for non-integer data (floats, bools, objects) - NaN/Inf
    can therefore never reach an index array - and ValueError for a wrong
    number of dimensions, out-of-range values or values below ``min_value``.
    """
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except (ValueError, TypeError) as e:  # ragged nested lists etc.
            raise TypeError(f"{name}: expected an integer array, could not convert ({e})") from None
        if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64
            a = a.astype(np.int32)
    if a.dtype.kind not in "iu":
        extra = ""
        if a.dtype.kind in "fc" and a.size and not np.all(np.isfinite(a)):
            extra = " (it contains NaN/Inf, which are never valid indices)"
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}{extra}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {a.shape}")
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            raise ValueError(f"{name}: values must fit int32, got range [{lo}, {hi}]")
        if min_value is not None and lo < min_value:
            bad = int(np.argmax(a.ravel() < min_value))
            raise ValueError(f"{name}: values must be >= {min_value}, got {lo} at position {bad}")
    out = np.array(a, dtype=np.int32, order="C", copy=True)
    out.setflags(write=False)
    return out


def as_indptr(x, name: str, *, length: int | None = None, total: int | None = None) -> np.ndarray:
    """Validate a CSR-style offsets array: 1-D, starts at 0, non-decreasing.

    ``length`` is the expected number of entries (batch + 1); ``total`` the
    expected last entry (length of the array it indexes).
    """
    a = as_index_array(x, name)
    if a.size == 0:
        raise ValueError(f"{name}: must have at least one entry (batch_size + 1), got an empty array")
    if a[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(a[0])}")
    d = np.diff(a)
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0))
        raise ValueError(
            f"{name}: must be non-decreasing, got {name}[{i}]={int(a[i])} > {name}[{i + 1}]={int(a[i + 1])}"
        )
    if length is not None and a.size != length:
        raise ValueError(f"{name}: expected {length} entries (batch_size + 1), got {a.size}")
    if total is not None and int(a[-1]) != total:
        raise ValueError(f"{name}: last entry must equal {total}, got {int(a[-1])}")
    return a


def as_int(x, name: str, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """A Python int from an integral scalar (bools rejected)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    v = int(x)
    if min_value is not None and v < min_value:
        raise ValueError(f"{name}: must be >= {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ValueError(f"{name}: must be <= {max_value}, got {v}")
    return v


def as_float(x, name: str, *, min_value: float | None = None, allow_none: bool = False):
    """A Python float from a real scalar (finite)."""
    if x is None and allow_none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    v = float(x)
    if not np.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {v}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name}: must be >= {min_value}, got {v}")
    return v


def is_float_dtype(dt) -> bool:
    dt = np.dtype(dt)
    return dt.kind == "f" or dt in _EXTRA_FLOATS


def as_float64(x, name: str, *, ndim: int | None = None) -> np.ndarray:
    """Convert a floating array (float16/bfloat16/float8/float32/float64) to float64.

    NaN/Inf in data are allowed and propagate.  Non-float arrays raise TypeError.
    """
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if not is_float_dtype(a.dtype):
        raise TypeError(f"{name}: expected a floating-point array (float16/bfloat16/float32/float64), got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {a.shape}")
    return a.astype(np.float64, copy=False)


def as_bool_array(x, name: str) -> np.ndarray:
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype != np.bool_:
        raise TypeError(f"{name}: expected a bool array, got dtype {a.dtype}")
    return a


def check_layout(kv_layout) -> str:
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout: expected 'NHD' or 'HND', got {type(kv_layout).__name__}")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "as_bool_array",
    "as_float",
    "as_float64",
    "as_index_array",
    "as_indptr",
    "as_int",
    "check_layout",
    "is_float_dtype",
]
