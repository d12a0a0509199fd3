"""Appending new tokens to a paged KV cache (the step after every forward pass of a serving engine).

    b, pos = kvattn.get_batch_indices_positions(append_indptr, page_table)     # host, int32 [nnz] each
    kvattn.append_paged_kv_cache(k_new, v_new, None, k_cache, v_cache, page_table,
                                 batch_indices=b, positions=pos)            # or append_indptr=...

k_new, v_new: [nnz, Hkv, D] in the cache's dtype; token t goes to request batch_indices[t] at position
positions[t] (< that request's kv_len in page_table, the table *after* the append): page
indices[indptr[b] + pos // page_size], slot pos % page_size. rope=kvattn.RoPE(...) rotates K at its position
before storing (fused; V is copied as is).

Two ways in, by where the index arrays live:
- host (numpy, a kvattn.PageTable): every index is checked before anything is written (a token beyond its
  request's pages, a position out of range, a page id outside the cache: ValueError naming the argument), then
  the indices go to the device in one copy (the call waits for it: not capturable).
- device (batch_indices, positions and page_table = (indptr, indices, last_page_len) as device arrays: torch,
  CuPy, kvattn, ...): shapes and dtypes are checked on the host, values in the kernel, which writes no token whose
  request, position or page is out of range. No host work beyond the launch: capturable.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from . import _driver, _dtypes, _validate as _v
from ._binding import begin, import_array
from .pool import pool_empty
from .formats import PageTable
from .kernels import KernelSpec, ParamBuffer, get_kernel, register
from .opcore import PagedKV, _kv_scale, check_array
from .variants import RoPE

APPEND_PARAMS = np.dtype([
    ("k_new", "u8"), ("v_new", "u8"), ("k_cache", "u8"), ("v_cache", "u8"),
    ("batch_indices", "u8"), ("positions", "u8"), ("page_indptr", "u8"), ("page_indices", "u8"),
    ("last_page_len", "u8"), ("k_scale_ptr", "u8"), ("v_scale_ptr", "u8"),
    ("new_stride_n", "i8"), ("new_stride_h", "i8"), ("c_page", "i8"), ("c_token", "i8"), ("c_head", "i8"),
    ("nnz", "i4"), ("num_kv_heads", "i4"), ("batch_size", "i4"), ("page_size", "i4"), ("num_pages", "i4"),
    ("rope_log2_theta", "f4"), ("rope_rcp_scale", "f4"), ("k_scale", "f4"), ("v_scale", "f4"),
], align=True)   # fields back to back (no padding): _launcher packs them all with one setter
THREADS = 256
HEADS_PER_THREAD = 4   # append_paged_kernel's HPT: the KV heads one thread moves (16 dims of each)
#: page.cuh's KVATTN_APPEND_HINTS (cache hints of the new rows' loads and the cache's stores): 1, no-L1 loads and
#: streaming stores (H200, run 22a, bench_append.py --hints in alternating rounds: 8 x 4096 tokens 74.2 us, 0.852 of
#: copy, against 74.7-74.8 us, 0.846, plain; the same bits); 0 plain and 2 loads only are the A/B's other sides.
HINTS = 1
#: page.cuh's KVATTN_APPEND_LOADS_FIRST: 1 issues a thread's new-row loads before its page lookup (H100, run 53a,
#: bench_append.py --loads-first in 3 alternating rounds: 8 x 4096 tokens 96.6-96.9 us, 0.911-0.913 of copy, against
#: 97.2-97.5 us, 0.905-0.908, with 0; graph replay ahead in all 6 pairs, 256 x 1 token included); 0 is the A/B's
#: other side, the kernel run 22a measured.
LOADS_FIRST = 1
I32 = np.dtype(np.int32)


def append_spec(dtype: str, head_dim: int, rope: int = 0, kv_dtype: str | None = None) -> KernelSpec:
    """rope: 0 none, 1 NeoX halves, 2 GPT-J interleaved pairs; kv_dtype: the cache's type when it is not dtype (an
    fp8 cache: the kernel quantises)."""
    kv = f", {_dtypes.to_ctype(kv_dtype)}" if kv_dtype and kv_dtype != dtype else ""
    return KernelSpec("page.cuh", f"kvattn::append_paged_kernel<{_dtypes.to_ctype(dtype)}, {head_dim}, {rope}, "
                                  f"{HEADS_PER_THREAD}{kv}>",
                      defines=tuple((name, v) for name, v in (("KVATTN_APPEND_HINTS", HINTS),
                                                              ("KVATTN_APPEND_LOADS_FIRST", LOADS_FIRST)) if v))


register("page", [append_spec(t, 128) for t in ("bfloat16", "float16")] + [append_spec("bfloat16", 64),
                                                                          append_spec("bfloat16", 128, 1),
                                                                          append_spec("bfloat16", 128, 0, "float8_e4m3fn")])


def get_batch_indices_positions(append_indptr, page_table) -> tuple[np.ndarray, np.ndarray]:
    """(batch_indices int32 [nnz], positions int32 [nnz]) of tokens appended ragged by append_indptr (int
    [B + 1]) to requests whose lengths after the append are page_table's (a PageTable, or kv_lens int [B]):
    token j of request i's new tokens is at position kv_len[i] - appended[i] + j."""
    from .reference import batch_indices_positions
    kv = page_table.kv_lens if isinstance(page_table, PageTable) else page_table
    return batch_indices_positions(append_indptr, kv)


def _host_indices(nnz, append_indptr, batch_indices, positions, pt: PageTable, num_pages: int):
    """One int32 host array [batch_indices | positions | indptr | indices | last_page_len], every value checked.
    append_indptr: int [B + 1] or None (then batch_indices, positions: int [nnz])."""
    if append_indptr is not None:
        if batch_indices is not None or positions is not None:
            raise ValueError("append_indptr: give append_indptr or batch_indices and positions, not both")
        b, pos = _from_append_indptr(nnz, append_indptr, pt)   # valid by construction
    else:
        if batch_indices is None or positions is None:
            raise ValueError("batch_indices, positions: both required without append_indptr")
        b = _v.as_index_array(batch_indices, "batch_indices")
        pos = _v.as_index_array(positions, "positions")
        for name, a in (("batch_indices", b), ("positions", pos)):
            if a.size != nnz:
                raise ValueError(f"{name}: expected {nnz} entries (one per new token of k_new), got {a.size}")
        if b.size and (b.min() < 0 or b.max() >= pt.batch_size):
            t = int(np.argmax((b < 0) | (b >= pt.batch_size)))
            raise ValueError(f"batch_indices: token {t} names request {int(b[t])}, expected 0 <= b < batch_size "
                             f"{pt.batch_size}")
        kvl = pt.kv_lens
        bad = (pos < 0) | (pos >= kvl[b]) if b.size else np.zeros(0, bool)
        if bad.any():
            t = int(np.argmax(bad))
            raise ValueError(f"positions: token {t} has position {int(pos[t])}, outside [0, kv_len "
                             f"{int(kvl[b[t]])}) of request {int(b[t])} (the page table is the one after the append)")
    pt.validate(num_pages, "num_pages (the pages k_cache holds)")
    return np.concatenate([b, pos, pt.indptr, pt.indices, pt.last_page_len], dtype=np.int32)


def _from_append_indptr(nnz: int, append_indptr, pt: PageTable):
    """(batch_indices, positions) int32 [nnz] of tokens appended ragged by append_indptr to pt's requests (their
    lengths after the append), as get_batch_indices_positions (the float64 reference's formula) computes them,
    in int32 without its intermediate copies: token t of request i is at position t - (indptr[i] - kv_len[i] +
    appended[i]). The one check: no request appends more tokens than it holds."""
    ind = _v.as_indptr(append_indptr, "append_indptr", length=pt.batch_size + 1)
    if int(ind[-1]) != nnz:
        raise ValueError(f"append_indptr: its last entry ({int(ind[-1])}) must equal the number of new tokens "
                         f"in k_new ({nnz})")
    n = np.diff(ind)
    kv = pt.kv_lens
    if (n > kv).any():
        i = int(np.argmax(n > kv))
        raise ValueError(f"kv_lens: request {i} appends {n[i]} tokens but its kv_len is only {kv[i]} (append_indptr "
                         f"against the page table after the append)")
    b = np.repeat(np.arange(n.size, dtype=np.int32), n)
    pos = np.arange(nnz, dtype=np.int32)
    pos -= np.repeat((ind[:-1] - kv + n).astype(np.int32), n)
    return b, pos


def _device_index(x, name: str, n: int | None, s, capturing):
    """x: an int32 array [n] (any length when n is None) as a DeviceArray; shape and dtype checked."""
    a = import_array(x, s, capturing)
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = f"[{n}]" if n is not None else "1-D"
        raise ValueError(f"{name}: expected an int32 array {want}, got shape {a.shape}")
    check_array(a, name, a.shape, I32, rows16=False)
    return a


def append_paged_kv_cache(k_new, v_new, append_indptr, k_cache, v_cache, page_table, kv_layout="NHD", *,
                          batch_indices=None, positions=None, rope: RoPE | None = None, stream=None,
                          k_scale=None, v_scale=None, kv_dtype=None):
    """Write k_new / v_new [nnz, Hkv, D] into the paged caches (see the module docstring).

    append_indptr: int [B + 1] (host; new tokens of request i are rows append_indptr[i]:append_indptr[i + 1]), or
    None with batch_indices and positions (int32 [nnz], host or device). k_cache / v_cache: [pages, page_size,
    Hkv, D] ("NHD") or [pages, Hkv, page_size, D] ("HND"), or k_cache [pages, 2, ...] with v_cache None.
    page_table: a kvattn.PageTable, or (indptr [B + 1], indices, last_page_len [B]) int32 arrays (device: the
    capturable path). rope: a kvattn.RoPE rotating K at its position (head_dim 64 / 128 / 256). stream: None (the
    legacy default stream) or any stream kvattn.stream accepts. Returns None; the caches are written on stream.
    An fp8 cache (float8_e4m3fn / float8_e5m2 arrays, or raw uint8 with kv_dtype=) stores k / k_scale and
    v / v_scale, rounded to nearest and saturated to the finite range (after RoPE); scales as the attention
    wrappers' run(): None (1), a positive float or float32 [num_kv_heads].
    """
    s, capturing = begin(stream)
    layout = _v.check_layout(kv_layout)
    kn = import_array(k_new, s, capturing)
    vn = import_array(v_new, s, capturing)
    if kn.ndim != 3:
        raise ValueError(f"k_new: expected [nnz, num_kv_heads, head_dim], got shape {kn.shape}")
    nnz, hkv, d = kn.shape
    if d not in (64, 128, 256):
        raise ValueError(f"k_new: head_dim must be 64, 128 or 256, got {d}")
    dtype = kn.dtype
    if kn.dtype_name not in ("float16", "bfloat16"):
        raise TypeError(f"k_new: expected float16 or bfloat16, got {kn.dtype_name}")
    check_array(kn, "k_new", (nnz, hkv, d), dtype)
    check_array(vn, "v_new", (nnz, hkv, d), dtype)
    if vn.strides != kn.strides:
        raise ValueError("v_new: must have k_new's strides")
    kc = import_array(k_cache, s, capturing)
    if v_cache is None and kc.ndim == 5:
        ps = kc.shape[2] if layout == "NHD" else kc.shape[3]
    elif kc.ndim == 4:
        ps = kc.shape[1] if layout == "NHD" else kc.shape[2]
    else:
        raise ValueError(f"k_cache: expected a 4-D cache ({layout}) or [pages, 2, ...] with v_cache None, "
                         f"got shape {kc.shape}")
    if rope is not None and not isinstance(rope, RoPE):
        raise TypeError(f"rope: expected a kvattn.RoPE(theta=..., scale=..., interleave=...), got "
                        f"{type(rope).__name__}")

    keep = None
    if isinstance(page_table, PageTable):
        if page_table.page_size != ps:
            raise ValueError(f"page_table: page_size {page_table.page_size} differs from the cache's {ps}")
        num_pages = kc.shape[0]
        host = _host_indices(nnz, append_indptr, batch_indices, positions, page_table, num_pages)
        if capturing:
            raise ValueError("page_table: a host PageTable is copied to the device, which a graph capture cannot "
                             "record; pass (indptr, indices, last_page_len) device arrays and device batch_indices "
                             "/ positions")
        batch = page_table.batch_size
        keep = pool_empty(host.shape, I32, s)   # stream-ordered: freed after the kernel that reads it
        _driver.call("cuMemcpyHtoDAsync", keep.ptr, host.ctypes.data, host.nbytes, s.handle)   # pageable: staged now
        base, n_ind = keep.ptr, page_table.indices.size
        ptrs = dict(batch_indices=base, positions=base + 4 * nnz, page_indptr=base + 8 * nnz,
                    page_indices=base + 4 * (2 * nnz + batch + 1),
                    last_page_len=base + 4 * (2 * nnz + batch + 1 + n_ind))
    else:
        if append_indptr is not None:
            raise ValueError("append_indptr: with device page-table arrays pass batch_indices and positions "
                             "(kvattn.get_batch_indices_positions computes them)")
        if not isinstance(page_table, (tuple, list)) or len(page_table) != 3:
            raise TypeError("page_table: expected a kvattn.PageTable or (indptr, indices, last_page_len) arrays")
        indptr = _device_index(page_table[0], "page_table indptr", None, s, capturing)
        batch = indptr.shape[0] - 1
        if batch < 0:
            raise ValueError("page_table indptr: expected [batch_size + 1] entries, got none")
        indices = _device_index(page_table[1], "page_table indices", None, s, capturing)
        lpl = _device_index(page_table[2], "page_table last_page_len", batch, s, capturing)
        if batch_indices is None or positions is None:
            raise ValueError("batch_indices, positions: required without append_indptr")
        bi = _device_index(batch_indices, "batch_indices", nnz, s, capturing)
        po = _device_index(positions, "positions", nnz, s, capturing)
        keep = (indptr, indices, lpl, bi, po)
        ptrs = dict(batch_indices=bi.ptr, positions=po.ptr, page_indptr=indptr.ptr, page_indices=indices.ptr,
                    last_page_len=lpl.ptr)
    cache_dtype = _cache_dtype(kc, kn, kv_dtype)
    kv = _accessor(layout, ps, hkv, d, cache_dtype)
    k, v, (c_page, c_token, c_head) = kv.bind(kc, v_cache, s, capturing)
    if cache_dtype.itemsize == 1:
        kp, kf, ka = _kv_scale(k_scale, "k_scale", hkv, s, capturing)
        vp, vf, va = _kv_scale(v_scale, "v_scale", hkv, s, capturing)
        scales = ((kp, vp), (kf, vf))
        keep = (keep, ka, va)
    else:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)) if k_scale is not None or v_scale is not None else ():
            if x is not None and not (isinstance(x, (int, float)) and float(x) == 1.0):
                raise TypeError(f"{name}: scales apply to an fp8 cache; this cache is {_dtypes.dtype_name(cache_dtype)}")
        scales = ((0, 0), (1.0, 1.0))
    if not nnz:
        return None
    mode = 0 if rope is None else (2 if rope.interleave else 1)
    kernel, params, set_all = _launcher(kn.dtype, d, mode, cache_dtype)
    it = dtype.itemsize
    set_all(kn.ptr, vn.ptr, k.ptr, v.ptr, ptrs["batch_indices"], ptrs["positions"], ptrs["page_indptr"],
            ptrs["page_indices"], ptrs["last_page_len"], *scales[0], kn.strides[0] // it, kn.strides[1] // it, c_page,
            c_token, c_head, nnz, hkv, batch, ps, k.shape[0], _LOG2_THETA(rope.theta) if rope else 0.0,
            1.0 / rope.scale if rope else 1.0, *scales[1])
    threads = nnz * -(-hkv // HEADS_PER_THREAD) * (d // 16)
    kernel.launch(-(-threads // THREADS), THREADS, 0, params, s)
    del keep
    k.written_on(s)
    v.written_on(s)
    return None


@functools.lru_cache(maxsize=None)
def _accessor(layout, page_size, hkv, d, dtype) -> PagedKV:
    return PagedKV(layout, page_size, hkv, d, dtype, 0)


_LOG2_THETA = functools.lru_cache(maxsize=None)(lambda theta: float(np.log2(theta)))
_launchers: dict = {}


def _cache_dtype(kc, kn, kv_dtype) -> np.dtype:
    """The cache's element type: k_new's, or an fp8 type (the cache's own, or kv_dtype for raw uint8 bytes)."""
    if kv_dtype is not None:
        name = _dtypes.dtype_name(kv_dtype)
        if name not in _dtypes.FP8:
            raise TypeError(f"kv_dtype: names an fp8 cache held as uint8 ({', '.join(_dtypes.FP8)}), got {name}")
        return _dtypes.to_numpy(name)
    if kc.dtype_name in _dtypes.FP8:
        return kc.dtype
    if kc.dtype == np.uint8:
        raise TypeError("k_cache: a uint8 cache needs kv_dtype= (float8_e4m3fn or float8_e5m2)")
    return kn.dtype


def _launcher(dtype: np.dtype, head_dim: int, rope: int, kv_dtype: np.dtype):
    """(Kernel, its ParamBuffer, a setter of every field): one per instance, device and thread, reused by every
    call (a launch copies the parameters, so the buffer is free again once cuLaunchKernel returns)."""
    key = (dtype, head_dim, rope, kv_dtype, _driver.current_context_id(), threading.get_ident())
    got = _launchers.get(key)
    if got is None:
        params = ParamBuffer(APPEND_PARAMS)
        spec = append_spec(_dtypes.dtype_name(dtype), head_dim, rope, _dtypes.dtype_name(kv_dtype))
        got = _launchers[key] = (get_kernel(spec), params,
                                 params.setter(*APPEND_PARAMS.names))
    return got
