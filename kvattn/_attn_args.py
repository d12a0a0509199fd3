"""Validation of the plan() arguments that decode and prefill share (raised before any GPU call)."""
from __future__ import annotations

from . import _dtypes, _validate as _v

HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")


def check_plan_args(num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, window_left, logits_soft_cap,
                    fp8_kv=False):
    """(hq, hkv, head_dim, q_dtype name, kv_dtype name, window_left, soft cap), or ValueError / TypeError naming the
    argument. fp8_kv: the op takes an fp8 cache (float8_e4m3fn / float8_e5m2) as well as one of q's dtype."""
    q_dtype = _dtypes.dtype_name(q_dtype)
    kv_dtype = q_dtype if kv_dtype is None else _dtypes.dtype_name(kv_dtype)
    if q_dtype not in DTYPES:
        raise TypeError(f"q_dtype: expected float16 or bfloat16, got {q_dtype}")
    if kv_dtype != q_dtype and not (fp8_kv and kv_dtype in _dtypes.FP8):
        also = f" or an fp8 type ({', '.join(_dtypes.FP8)})" if fp8_kv else ""
        raise TypeError(f"kv_dtype: expected q_dtype ({q_dtype}){also}, got {kv_dtype}")
    hq = _v.as_int(num_qo_heads, "num_qo_heads", min_value=1)
    hkv = _v.as_int(num_kv_heads, "num_kv_heads", min_value=1)
    head_dim = _v.as_int(head_dim, "head_dim")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {head_dim}")
    if hq % hkv:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    window_left = _v.as_int(window_left, "window_left")
    if window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or >= 0, got {window_left}")
    cap = _v.as_float(logits_soft_cap, "logits_soft_cap")   # finite, else ValueError
    if cap < 0:
        raise ValueError(f"logits_soft_cap: expected a finite value >= 0, got {cap}")
    return hq, hkv, head_dim, q_dtype, kv_dtype, window_left, cap
