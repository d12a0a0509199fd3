"""An fp8 KV cache expanded once per prefill call into 16-bit K / V rows (cuda_src/fp8_expand.cuh), which the 16-bit
prefill kernels then read as ragged K / V.

Why: a prefill reads every K/V tile once per 128-row query tile that attends to it (a causal 8192-token prompt: up to
64 times). Expanding the tile inside the attention kernel on every read is work that grows with the square of the
length, issued beside the kernel's own softmax: it ran the sm90 kernel at 0.47-0.64 of its 16-bit rate (H200,
BENCHMARKS.md, session 24), where one expansion per call costs a pass over the call's K / V (read 1 byte, write 2
bytes a value). A plan expands once where its requests' query tiles re-read the cache enough (`wanted`); short
appends and decode keep the in-kernel expansion. Not in graph mode (the workspace is sized by the plan).

The workspace: two [total_kv, Hkv, D] arrays of the queries' 16-bit type, allocated by plan() and reused by later
plans that fit. Each value is the fp8 value times its head's scale, rounded once (as the in-kernel expansion).
"""
from __future__ import annotations

import numpy as np

from . import _dtypes, memory
from .kernels import KernelSpec, Launch, ParamBuffer, get_kernel, register
from .opcore import _kv_scale

EXPAND_PARAMS = np.dtype([
    ("k", "u8"), ("v", "u8"), ("k_out", "u8"), ("v_out", "u8"), ("page_indptr", "u8"), ("page_indices", "u8"),
    ("ws_indptr", "u8"), ("k_scale_ptr", "u8"), ("v_scale_ptr", "u8"), ("c_page", "i8"), ("c_token", "i8"),
    ("c_head", "i8"), ("k_scale", "f4"), ("v_scale", "f4"), ("num_kv_heads", "i4"), ("page_size", "i4"),
    ("page_shift", "i4"),
], align=True)   # mirrors ExpandParams (a static_assert of its size)
THREADS = 256
#: Head dims the expansion is built for (the 16-bit kernels take the rows; others keep the in-kernel expansion).
HEAD_DIMS = (64, 128, 256)
#: "auto": expand once where the requests' packed query rows make at least this many 128-row tiles on average (the
#: number of times each K/V tile is read); fewer (appends, decode-like batches) keep the in-kernel expansion.
MIN_QUERY_TILES = 4
MODES = ("auto", "once", "kernel")
_MAX_BLOCKS_X = 4096   # grid-stride beyond this many blocks per request
MAX_BATCH = 65535      # requests a plan may expand once (the grid's y dimension)


def expand_spec(kv_dtype: str, dtype: str, head_dim: int) -> KernelSpec:
    return KernelSpec("fp8_expand.cuh", f"kvattn::expand_kv8_kernel<{_dtypes.to_ctype(kv_dtype)}, "
                                        f"{_dtypes.to_ctype(dtype)}, {head_dim}>",
                      checks=(("sizeof(kvattn::ExpandParams)", EXPAND_PARAMS.itemsize),))


register("fp8_expand", [expand_spec(kv, t, 128) for kv in _dtypes.FP8 for t in ("bfloat16", "float16")])


def wanted(mode: str, kv_dtype, head_dim: int, qo_lens: np.ndarray, group: int, graph: bool) -> bool:
    """Whether a prefill plan expands its fp8 cache once per call (mode: the wrapper's fp8_expand, MODES)."""
    if mode not in MODES:
        raise ValueError(f"fp8_expand: expected one of {MODES}, got {mode!r}")
    if not _dtypes.is_fp8(kv_dtype) or mode == "kernel" or head_dim not in HEAD_DIMS or graph:
        return False
    if qo_lens.size > MAX_BATCH:   # (one grid row per request)
        return False
    if mode == "once":
        return True
    tiles = -(-qo_lens * group // 128)
    return qo_lens.size > 0 and float(tiles.mean()) >= MIN_QUERY_TILES


class Fp8Expansion:
    """A plan's expansion: its index arrays (`index`, copied to the device with the plan's own buffer, whose address
    bind_index() takes), the 16-bit workspace and the launch. kv8: the fp8 cache's
    accessor (PagedKV / RaggedKV: run() binds and checks the caller's cache with it); page_indptr [B + 1],
    page_indices [P] (the plan's pages: a ragged cache's are the requests' first tokens, in pages of page_size);
    kv_lens [B]; dtype: the queries' 16-bit type; reuse: an earlier plan's Fp8Expansion whose workspace may be
    reused."""

    def __init__(self, kv8, page_indptr, page_indices, page_size: int, page_shift: int, kv_lens, dtype: str,
                 reuse: "Fp8Expansion | None" = None):
        self.kv8 = kv8
        hkv, d = kv8.num_kv_heads, kv8.head_dim
        self.ws_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        total = int(self.ws_indptr[-1])
        self.dtype = _dtypes.to_numpy(dtype)
        if reuse is not None and reuse.rows >= total and reuse.ws_k.dtype == self.dtype and reuse.ws_k.shape[1:] == (hkv, d):
            self._kbuf, self._vbuf = reuse._kbuf, reuse._vbuf
        else:
            self._kbuf, self._vbuf = (memory.empty((max(total, 1), hkv, d), self.dtype) for _ in range(2))
        self.rows = self._kbuf.shape[0]
        self.ws_k, self.ws_v = self._kbuf[:total], self._vbuf[:total]
        b = kv_lens.size
        #: int32 [page_indptr | page_indices | ws_indptr]: the plan copies it with its own buffer (bind_index)
        self.index = np.concatenate([page_indptr, page_indices, self.ws_indptr]).astype(np.int32)
        self._ends = (b + 1, b + 1 + page_indices.size)
        p = self._params = ParamBuffer(EXPAND_PARAMS)
        p.set(k_out=self.ws_k.ptr, v_out=self.ws_v.ptr, num_kv_heads=hkv, page_size=page_size, page_shift=page_shift)
        self._set_cache = p.setter("k", "v")
        self._set_scales = p.setter("k_scale_ptr", "v_scale_ptr", "c_page", "c_token", "c_head", "k_scale", "v_scale")
        chunks = int(kv_lens.max(initial=0)) * hkv * (d // 16)
        grid = (max(1, min(-(-chunks // THREADS), _MAX_BLOCKS_X)), max(b, 1), 1)
        self._launch = Launch(get_kernel(expand_spec(_dtypes.dtype_name(kv8.dtype), dtype, d)), grid, THREADS, 0, p)
        self._empty = total == 0

    def bind_index(self, ptr: int):
        """The device address the plan copied `index` to."""
        a, b = self._ends
        self._params.set(page_indptr=ptr, page_indices=ptr + 4 * a, ws_indptr=ptr + 4 * b)

    def expand(self, k_cache, v_cache, s, capturing, k_scale, v_scale):
        """Bind and check the caller's fp8 cache and scales for an expansion on stream s: (the workspace's k, v rows
        [total_kv, Hkv, D], written on s, and issue(): the expansion's launch, which run() calls once every other
        argument is checked too, before the attention launches)."""
        k, v, (c_page, c_token, c_head) = self.kv8.bind(k_cache, v_cache, s, capturing)
        hkv = self.kv8.num_kv_heads
        kp, kf, ka = _kv_scale(k_scale, "k_scale", hkv, s, capturing)
        vp, vf, va = _kv_scale(v_scale, "v_scale", hkv, s, capturing)
        self._set_cache(k.ptr, v.ptr)
        self._set_scales(kp, vp, c_page, c_token, c_head, kf, vf)

        def issue(keep=(k, v, ka, va)):   # (the caches and scale arrays stay referenced until the launch is issued)
            if not self._empty:
                self._launch.launch(s.handle)
        self.ws_k.written_on(s)
        self.ws_v.written_on(s)
        return self.ws_k, self.ws_v, issue
