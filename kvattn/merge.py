"""merge_state / merge_state_in_place / merge_states: the (o, lse) reduction of split-KV and cascade.

lse is float32 natural log; a state with lse = -inf is empty (its o is never read) and merging only empty
states gives o = 0, lse = -inf. Outputs: the caller's arrays as given, or new kvattn arrays from the stream-ordered
pool (call .numpy() to copy them back). stream: None is the legacy default stream (kvattn.stream).
"""
from __future__ import annotations

import numpy as np

from . import _dtypes
from .kernels import KernelSpec, ParamBuffer, get_kernel, memo_spec, register
from ._binding import begin, import_array, output
from .memory import DeviceArray

MERGE_PARAMS = np.dtype([
    ("o_in", "u8"), ("lse_in", "u8"), ("o_out", "u8"), ("lse_out", "u8"),
    ("indptr", "u8"), ("out_rows", "u8"), ("mask", "u8"), ("num_rows_dev", "u8"),
    ("s_row", "i8"), ("s_n", "i8"), ("s_h", "i8"),
    ("l_row", "i8"), ("l_n", "i8"), ("l_h", "i8"),
    ("so_row", "i8"), ("so_h", "i8"), ("lo_row", "i8"), ("lo_h", "i8"),
    ("num_rows", "i4"), ("n", "i4"), ("num_heads", "i4"), ("head_dim", "i4"), ("lane_shift", "i4"),
    ("variant_data", "u8"),
], align=True)

THREADS = 256
#: Lanes per (row, head, 8 columns) grow (up to 16) while the grid stays within this many threads (about one
#: resident wave of 256-thread CTAs on an H200), so a merge of few rows with many states each is spread over the
#: GPU instead of one chain of loads per thread (merge_states_kernel).
LANE_THREAD_BUDGET = 1 << 17


def lane_shift(units: int, max_states: int | None = None) -> int:
    """log2 of the lanes that share one merge unit ((row, head, 8 columns); units of them): the most, up to 16,
    that keep units * lanes within LANE_THREAD_BUDGET, and, where the most states of a row is known, no more
    than give each lane a run of 4 (one round of loads). The bits of a merge depend on it: a batch-invariant
    caller passes a constant."""
    shift = 0
    while shift < 4 and units << (shift + 1) <= LANE_THREAD_BUDGET and (max_states is None
                                                                      or 4 << shift < max_states):
        shift += 1
    return shift


def merge_grid(units: int, shift: int) -> int:
    """CTAs (of THREADS) covering units << shift threads."""
    return -(-(units << shift) // THREADS)


def set_lanes(params: ParamBuffer, units: int, max_states: int | None, one_lane: bool = False) -> int:
    """Set params' lane_shift for `units` merge units (lane_shift's rule, or one lane) and return the grid that
    covers them."""
    shift = 0 if one_lane else lane_shift(units, max_states)
    params.set(lane_shift=shift)
    return merge_grid(units, shift)


STATE_DTYPES = ("float16", "bfloat16", "float32")


@memo_spec
def merge_spec(in_dtype: str, out_dtype: str, variant=None) -> KernelSpec:
    """The merge of (o, lse) states; variant: an attention Variant whose output hook finishes each merged row
    (split-KV merges of a plan), or None."""
    vt = variant.merge_type() if variant is not None else None
    args = f"{_dtypes.to_ctype(in_dtype)}, {_dtypes.to_ctype(out_dtype)}" + (f", {vt}" if vt else "")
    return KernelSpec("merge.cuh", f"kvattn::merge_states_kernel<{args}>",
                      prelude=variant.prelude() if vt else ("", "", ""))


register("merge", [merge_spec(t, t) for t in STATE_DTYPES]
         + [merge_spec("float32", t) for t in ("float16", "bfloat16")])


def _elem_strides(a: DeviceArray):
    return [s // a.itemsize for s in a.strides]


def _check_state(name_o, o: DeviceArray, name_lse, lse: DeviceArray, lead: int):
    """o: [lead dims..., H, D] in fp16/bf16/fp32, lse: [lead dims..., H] float32."""
    if o.dtype_name not in STATE_DTYPES:
        raise TypeError(f"{name_o}: dtype must be one of {STATE_DTYPES}, got {o.dtype_name}")
    if lse.dtype_name != "float32":
        raise TypeError(f"{name_lse}: dtype must be float32, got {lse.dtype_name}")
    if o.ndim != lead + 2:
        raise ValueError(f"{name_o}: expected {lead + 2} dimensions, got shape {o.shape}")
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"{name_lse}: expected shape {o.shape[:-1]} (o's shape without head_dim), got {lse.shape}")
    d = o.shape[-1]
    if d % 8 or d == 0:
        raise ValueError(f"{name_o}: head_dim must be a positive multiple of 8, got {d}")
    vec = 8 * o.itemsize
    if o.strides[-1] != o.itemsize or o.ptr % 16 or any(s % vec for s in o.strides[:-1]):
        raise ValueError(f"{name_o}: the last axis must be contiguous and rows 16-byte aligned")
    if lse.ptr % 4:
        raise ValueError(f"{name_lse}: must be 4-byte aligned")


def _out_pair(o_shape, dtype, out, lse_out, s, capturing):
    """((out, lse_out) DeviceArrays to write, the objects returned for them)."""
    out, out_ret = output(out, tuple(o_shape), _dtypes.to_numpy(dtype), s, capturing, "out")
    lse_out, lse_ret = output(lse_out, tuple(o_shape[:-1]), np.dtype(np.float32), s, capturing, "lse_out")
    _check_state("out", out, "lse_out", lse_out, len(o_shape) - 2)
    if out.shape != tuple(o_shape):
        raise ValueError(f"out: expected shape {tuple(o_shape)}, got {out.shape}")
    return out, lse_out, (out_ret, lse_ret)


def _launch(in_dtype, out: DeviceArray, params: ParamBuffer, rows: int, heads: int, head_dim: int, s,
            lse_out: DeviceArray):
    kernel = get_kernel(merge_spec(in_dtype, out.dtype_name))
    units = rows * heads * (head_dim // 8)
    if units:
        kernel.launch(set_lanes(params, units, params["n"] or None), THREADS, 0, params, s)
    out.written_on(s)
    lse_out.written_on(s)


def _set_out(p: ParamBuffer, out: DeviceArray, lse_out: DeviceArray | None):
    so = _elem_strides(out)
    p.set(o_out=out.ptr, so_row=so[0], so_h=so[1])
    if lse_out is not None:
        lo = _elem_strides(lse_out)
        p.set(lse_out=lse_out.ptr, lo_row=lo[0], lo_h=lo[1])


def _pair_params(o_a, lse_a, o_b, lse_b) -> ParamBuffer:
    """Two same-shaped states as a stack of n=2 whose 'n' stride is the pointer distance a -> b."""
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_b: expected the shape of o_a {o_a.shape}, got {o_b.shape}")
    if o_a.dtype != o_b.dtype:
        raise TypeError(f"o_b: expected the dtype of o_a ({o_a.dtype_name}), got {o_b.dtype_name}")
    if o_a.strides != o_b.strides or lse_a.strides != lse_b.strides:
        raise ValueError("o_b, lse_b: must have the same strides as o_a, lse_a")
    s, ls = _elem_strides(o_a), _elem_strides(lse_a)
    p = ParamBuffer(MERGE_PARAMS)
    rows, heads, d = o_a.shape
    p.set(o_in=o_a.ptr, lse_in=lse_a.ptr, s_row=s[0], s_n=(o_b.ptr - o_a.ptr) // o_a.itemsize, s_h=s[1],
          l_row=ls[0], l_n=(lse_b.ptr - lse_a.ptr) // 4, l_h=ls[1], num_rows=rows, n=2, num_heads=heads, head_dim=d)
    return p


def merge_state(o_a, lse_a, o_b, lse_b, *, out=None, lse_out=None, stream=None):
    """Merge two attention states.

    o_a, o_b: [rows, H, D] float16 / bfloat16 / float32 (same dtype); lse_a, lse_b: [rows, H] float32
    (natural log). Returns (o [rows, H, D] in o_a's dtype, lse [rows, H] float32) as DeviceArrays.
    """
    s, capturing = begin(stream)
    o_a, lse_a, o_b, lse_b = (import_array(x, s, capturing) for x in (o_a, lse_a, o_b, lse_b))
    _check_state("o_a", o_a, "lse_a", lse_a, 1)
    _check_state("o_b", o_b, "lse_b", lse_b, 1)
    p = _pair_params(o_a, lse_a, o_b, lse_b)
    out, lse_out, ret = _out_pair(o_a.shape, o_a.dtype_name, out, lse_out, s, capturing)
    _set_out(p, out, lse_out)
    _launch(o_a.dtype_name, out, p, *o_a.shape, s, lse_out)
    return ret


def merge_state_in_place(o, lse, o_other, lse_other, mask=None, *, stream=None):
    """o, lse <- merge((o, lse), (o_other, lse_other)), only on rows where mask (bool [rows]) is true.

    o, o_other: [rows, H, D]; lse, lse_other: [rows, H] float32 natural log. Returns (o, lse).
    """
    s, capturing = begin(stream)
    o_ret, lse_ret = o, lse
    o, lse, o_other, lse_other = (import_array(x, s, capturing) for x in (o, lse, o_other, lse_other))
    _check_state("o", o, "lse", lse, 1)
    _check_state("o_other", o_other, "lse_other", lse_other, 1)
    p = _pair_params(o, lse, o_other, lse_other)
    _set_out(p, o, lse)
    if mask is not None:
        if isinstance(mask, np.ndarray):
            mask = np.ascontiguousarray(mask, dtype=np.uint8)
        m = import_array(mask, s, capturing)
        if m.shape != (o.shape[0],) or m.itemsize != 1:
            raise ValueError(f"mask: expected a bool/uint8 array of shape ({o.shape[0]},), got {m.shape} {m.dtype}")
        p.set(mask=m.ptr)
    _launch(o.dtype_name, o, p, *o.shape, s, lse)
    return o_ret, lse_ret


def merge_states(o, lse, *, out=None, lse_out=None, stream=None):
    """Merge n states per row.

    o: [rows, n, H, D] float16 / bfloat16 / float32; lse: [rows, n, H] float32 natural log.
    Returns (o [rows, H, D] in o's dtype, lse [rows, H] float32).
    """
    cs, capturing = begin(stream)
    o, lse = import_array(o, cs, capturing), import_array(lse, cs, capturing)
    _check_state("o", o, "lse", lse, 2)
    rows, n, heads, d = o.shape
    s, ls = _elem_strides(o), _elem_strides(lse)
    p = ParamBuffer(MERGE_PARAMS)
    p.set(o_in=o.ptr, lse_in=lse.ptr, s_row=s[0], s_n=s[1], s_h=s[2], l_row=ls[0], l_n=ls[1], l_h=ls[2],
          num_rows=rows, n=n, num_heads=heads, head_dim=d)
    out, lse_out, ret = _out_pair((rows, heads, d), o.dtype_name, out, lse_out, cs, capturing)
    _set_out(p, out, lse_out)
    _launch(o.dtype_name, out, p, rows, heads, d, cs, lse_out)
    return ret
