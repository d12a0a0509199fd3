"""The plan/run machinery every attention op shares (decode, paged and ragged prefill; later cascade, block-sparse).

An op supplies its schedule (plan(): host arrays -> one packed int32 buffer and a parameter struct) and how its
arrays are checked; this module owns everything else:
- `AttentionOp`: the workspace, the pinned staging ring, the one host-to-device copy per plan and its event, the
  graph-mode bounds and the baked-value check, and run()'s generic path (`_execute`).
- `AttentionPlan`: the frozen, typed result of plan(): its launches, the bound parameter setters, the array rows
  and dtypes run() accepts, the KV accessor, the stream of the plan's copy; `info` holds read-only facts (the
  scheduler's plan, the kernel's backend and tile) for scripts and tests.
- `PagedKV` / `RaggedKV`: how run() checks k / v against the plan and reads their strides as the kernels' (page,
  token, head) element strides.

The kernels of every op take the same array fields (q, k, v, o, lse pointers, then q / o / lse / kv strides, in
that order: DECODE_PARAMS and PREFILL_PARAMS) and the same merge parameters, so run() binds them in one place.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np

from . import _driver, _dtypes, _interop, device as _device
from ._errors import CudaUnavailableError
from ._binding import import_array, misaligned16, output
from .contract import NUM_MERGE
from .kernels import Launch, Memset32, ParamBuffer, get_kernel
from .memory import DeviceArray, StagingRing, fit_workspace
from .merge import MERGE_PARAMS, THREADS as MERGE_THREADS, merge_spec, set_lanes
from .stream import LEGACY, as_stream

F32 = np.dtype(np.float32)


# -- KV accessors -------------------------------------------------------------------------------------------
def _accepted_dtype(a: DeviceArray, dtype: np.dtype) -> np.dtype:
    """The dtype a cache array is checked against: the plan's, or uint8 for an fp8 cache held as raw bytes (e.g. a
    torch uint8 view)."""
    return a.dtype if dtype.itemsize == 1 and a.dtype == np.uint8 else dtype


@dataclasses.dataclass(frozen=True, slots=True)
class PagedKV:
    """A paged cache: k / v [pages, page_size, Hkv, D] ("NHD") or [pages, Hkv, page_size, D] ("HND"), or k_cache
    [pages, 2, ...] with v_cache None; at least pages_needed pages."""
    layout: str
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype
    pages_needed: int
    tail: tuple = dataclasses.field(init=False, repr=False, compare=False)   # a cache's shape past its pages

    def __post_init__(self):
        object.__setattr__(self, "tail", (self.page_size, self.num_kv_heads, self.head_dim) if self.layout == "NHD"
                           else (self.num_kv_heads, self.page_size, self.head_dim))

    def bind(self, k_cache, v_cache, s, capturing):
        """(k, v DeviceArrays, (page, token, head) element strides)."""
        k = import_array(k_cache, s, capturing)
        if v_cache is None:
            if k.ndim != 5 or k.shape[1] != 2:
                raise ValueError(f"k_cache: with v_cache=None expected [pages, 2, ...] (5 dims), got {k.shape}")
            v = k[:, 1]
            k = k[:, 0]
        else:
            v = import_array(v_cache, s, capturing)
        ks, shape, dtype = k.strides, k.shape, self.dtype
        if (len(ks) == 4 and ks == v.strides and shape == v.shape and shape[1:] == self.tail and k.dtype is dtype
                and v.dtype is dtype and shape[0] >= self.pages_needed and ks[3] == dtype.itemsize
                and not (k.ptr | v.ptr | ks[0] | ks[1] | ks[2]) & 15):   # run()'s common case in one expression
            it = ks[3]
            if self.layout == "NHD":
                return k, v, (ks[0] // it, ks[1] // it, ks[2] // it)
            return k, v, (ks[0] // it, ks[2] // it, ks[1] // it)
        if k.strides != v.strides or k.shape != v.shape:
            self._check("k_cache", k)
            self._check("v_cache", v)
            raise ValueError("k_cache, v_cache: must have the same shape and strides")
        self._check("k_cache", k)
        if (v.ptr - k.ptr) & 15:
            raise ValueError("v_cache: rows must be 16-byte aligned (pointer and strides)")
        if v.dtype is not k.dtype:
            self._check("v_cache", v)
        ks, it = k.strides, self.dtype.itemsize
        if self.layout == "NHD":
            return k, v, (ks[0] // it, ks[1] // it, ks[2] // it)
        return k, v, (ks[0] // it, ks[2] // it, ks[1] // it)

    def _check(self, name, a):
        want = self.tail
        shape = a.shape
        if len(shape) != 4 or shape[1:] != want:
            raise ValueError(f"{name}: expected shape [num_pages, {', '.join(map(str, want))}] ({self.layout}), "
                             f"got {shape}")
        check_array(a, name, shape, _accepted_dtype(a, self.dtype))
        if shape[0] < self.pages_needed:
            raise ValueError(f"{name}: the page table uses page id {self.pages_needed - 1} but the cache holds "
                             f"{shape[0]} pages")


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedKV:
    """Contiguous K / V: [total_kv, Hkv, D] ("NHD") or [Hkv, total_kv, D] ("HND"), seen by the kernels as pages of
    tokens_per_page tokens (page stride = tokens_per_page * token stride). Ragged prefill: 1 (a request's "page" id
    is its first token); block-sparse: the block's C columns."""
    layout: str
    total_kv: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype
    tokens_per_page: int = 1

    def bind(self, k, v, s, capturing):
        k, v = import_array(k, s, capturing), import_array(v, s, capturing)
        n, hkv, d = self.total_kv, self.num_kv_heads, self.head_dim
        nhd = self.layout == "NHD"
        want = (n, hkv, d) if nhd else (hkv, n, d)
        ks, dtype = k.strides, self.dtype
        if (k.shape == want and v.shape == want and ks == v.strides and k.dtype is dtype and v.dtype is dtype
                and ks[2] == dtype.itemsize and not (k.ptr | v.ptr | ks[0] | ks[1]) & 15):   # run()'s common case
            it = ks[2]
            tok, head = (ks[0] // it, ks[1] // it) if nhd else (ks[1] // it, ks[0] // it)
            return k, v, (tok * self.tokens_per_page, tok, head)
        for name, a in (("k", k), ("v", v)):
            if a.shape != want:
                raise ValueError(f"{name}: expected shape {list(want)} ({self.layout}), got {a.shape}")
            check_array(a, name, want, _accepted_dtype(a, self.dtype))
        if k.strides != v.strides:
            raise ValueError("k, v: must have the same strides")
        ks, it = k.strides, self.dtype.itemsize
        tok, head = (ks[0] // it, ks[1] // it) if self.layout == "NHD" else (ks[1] // it, ks[0] // it)
        return k, v, (tok * self.tokens_per_page, tok, head)


def _kv_scale(x, name: str, num_kv_heads: int, s, capturing):
    """(device pointer or 0, factor, the array to keep alive) of one cache scale: None, a float or [Hkv] float32."""
    if x is None:
        return 0, 1.0, None
    if isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool):
        f = float(x)
        if not (np.isfinite(f) and f > 0):
            raise ValueError(f"{name}: expected a positive finite scale, got {f}")
        return 0, f, None
    if isinstance(x, np.ndarray):   # host values are checked (a device array's are the caller's)
        if x.dtype != F32:
            raise TypeError(f"{name}: expected a float32 array [{num_kv_heads}], got dtype {x.dtype}")
        if x.shape == (num_kv_heads,) and not (np.isfinite(x).all() and (x > 0).all()):
            raise ValueError(f"{name}: every per-head scale must be positive and finite, got {x}")
    a = import_array(x, s, capturing)
    check_array(a, name, (num_kv_heads,), F32, rows16=False)
    return a.ptr, 1.0, a


def bind_kv_scales(p: "AttentionPlan", k_scale, v_scale, s, capturing):
    """Pack run()'s k_scale / v_scale into the plan's parameters (fp8 cache), or check they are absent / 1 (a
    16-bit cache takes no scales). Returns the arrays the launch reads (kept alive until it is issued)."""
    if p.set_scales is None:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None and not (isinstance(x, (int, float)) and float(x) == 1.0):
                raise TypeError(f"{name}: scales apply to an fp8 cache; this plan's cache is "
                                f"{_dtypes.dtype_name(p.kv.dtype)}")
        return None
    hkv = p.kv.num_kv_heads
    kp, kf, ka = _kv_scale(k_scale, "k_scale", hkv, s, capturing)
    vp, vf, va = _kv_scale(v_scale, "v_scale", hkv, s, capturing)
    p.set_scales(kp, vp, kf, vf)
    return ka, va


def check_array(a: DeviceArray, name: str, shape: tuple, dtype: np.dtype, rows16: bool = True):
    """Shape, dtype (numpy dtype) and layout of an argument (cheap: it runs in every run()). rows16: the pointer
    and every stride but the last's are multiples of 16 bytes; else only a 4-byte aligned pointer."""
    st = a.strides
    if (rows16 and len(st) == 3 and a.shape == shape and a.dtype is dtype and st[2] == dtype.itemsize
            and not (a.ptr | st[0] | st[1]) & 15):
        return   # run()'s common case, decided in one expression (each call here costs run() time)
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")
    if a.dtype is not dtype and a.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {_dtypes.dtype_name(dtype)}, got {a.dtype_name}")
    if a.strides[-1] != dtype.itemsize:
        raise ValueError(f"{name}: the last axis must be contiguous")
    if rows16:
        if misaligned16(a.ptr, a.strides):
            raise ValueError(f"{name}: rows must be 16-byte aligned (pointer and strides)")
    elif a.ptr & 3:
        raise ValueError(f"{name}: the pointer must be 4-byte aligned")


# -- the plan ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class AttentionPlan:
    rows: int                    # query rows (q / out / lse first axis)
    max_rows: int                # graph mode: the arrays may also keep this many rows (else == rows)
    num_qo_heads: int
    head_dim: int
    dtype: np.dtype              # q / out element type
    kv: object                   # PagedKV or RaggedKV
    launches: tuple              # the attention kernels, in order (cascade: one per level; empty: nothing to do)
    merge: Launch | None         # the merge of partial states
    set_ptrs: object             # (q, k, v, o, lse) -> packs every attention launch's pointer fields
    set_strides: object          # (q_n, q_h, o_n, o_h, lse_n, kv_page, kv_token, kv_head) -> packs their strides
    set_scales: object           # fp8 cache: (k_scale_ptr, v_scale_ptr, k_scale, v_scale); None for a 16-bit cache
    bind_tma: object             # (q, k, v, out) -> writes their tensor maps into the TMA launches (kvattn.tma); or None
    merge_set_ptrs: object       # (o, lse)
    merge_set_strides: object    # (o_n, o_h, lse_n, lse_h)
    plan_stream: int             # the stream of the plan's copy
    copy_done: object            # its event
    wait_copy: bool              # run() on another stream waits for copy_done (not in graph mode)
    info: types.MappingProxyType  # read-only facts for inspection (schedule, grid, backend, ...)


def _setter(params: list, *names):
    """One setter of the named fields over every launch's ParamBuffer (the single-launch ops keep the plain one)."""
    setters = [p.setter(*names) for p in params]
    if len(setters) == 1:
        return setters[0]

    def set_all(*values):
        for f in setters:
            f(*values)
    return set_all


def on_device(method):
    """Run an op's plan() / run() in its device's context: the first plan() binds the op to its device (the
    `device=` argument, else the current context's); when another context is current, the device's is pushed
    for the call and the caller's restored after (kvattn.device)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        dev = self.device
        if dev is None:
            try:
                dev = self.device = _device.get(self._device_arg)
            except CudaUnavailableError:   # no GPU: the arguments are still checked, the first driver call raises
                return method(self, *args, **kwargs)
        active = _interop.active
        outer = getattr(active, "ordinal", None)
        active.ordinal = dev.ordinal
        try:
            if _driver.current_context_id() == dev.context_id:
                return method(self, *args, **kwargs)
            with dev.activate():
                return method(self, *args, **kwargs)
        finally:
            active.ordinal = outer
    return wrapper


def fill_steps(dev: dict, fills) -> list:
    """The Memset32 steps of fills = [(region name, byte offset, pitch, 32-bit value, width, height)] over the
    workspace regions dev ({name: DeviceArray}): issued once by _upload, or before every run()'s launches."""
    return [Memset32(dev[name].ptr + offset, *rows) for name, offset, *rows in fills]


def checked_outputs(q: DeviceArray, shape: tuple, dtype, out, lse, return_lse: bool, s, capturing: bool, dev: int):
    """run()'s arrays: q checked against shape [rows, Hq, D] and dtype; (out, what run() returns for it, lse or
    None, its return): the caller's arrays checked, or new pool arrays on stream s (lse only if given or asked)."""
    check_array(q, "q", shape, dtype)
    if out is None:
        out, out_ret = output(out, shape, dtype, s, capturing, "out", dev)
    else:
        out_ret, out = out, import_array(out, s, capturing)
        check_array(out, "out", shape, dtype)
    lse_ret = lse
    if lse is not None or return_lse:
        lse, lse_ret = output(lse, shape[:2], F32, s, capturing, "lse", dev)
        check_array(lse, "lse", shape[:2], F32, rows16=False)
    return out, out_ret, lse, lse_ret


class AttentionOp:
    """Base of the attention wrappers. Subclasses implement plan() (ending in `_finish_plan`) and run() (ending in
    `_execute`)."""

    DEFAULT_WORKSPACE = 256 << 20

    def __init__(self, kv_layout, use_cuda_graph, bounds: dict, required: tuple, workspace_bytes, num_sms,
                 device=None):
        from ._validate import as_int, check_layout
        self.kv_layout = check_layout(kv_layout)
        self._device_arg = _device.check_device_arg(device)
        self.device = None   # the kvattn Device, bound by the first plan(): `device`, or the current context's
        self.use_cuda_graph = bool(use_cuda_graph)
        if self.use_cuda_graph:
            missing = [n for n in required if bounds.get(n) is None]
            if missing:
                raise ValueError(f"use_cuda_graph=True needs {', '.join(missing)} (they fix the buffers)")
            for n in required:
                as_int(bounds[n], n, min_value=1)
        for name, value in bounds.items():
            setattr(self, name, value)
        self._num_sms = num_sms
        self._workspace_bytes = workspace_bytes or (self.DEFAULT_WORKSPACE if self.use_cuda_graph else None)
        self.workspace = None   # allocated by the first plan(): constructing a wrapper touches no GPU
        self._staging = StagingRing()   # pinned host buffers for plan()'s one copy
        self._baked = None          # graph mode: the values the first successful plan() baked in
        self._pending_bake = None
        self._plan: AttentionPlan | None = None

    @property
    def num_sms(self) -> int:
        if self._num_sms is None:
            self._num_sms = (self.device or _device.get(self._device_arg)).sm_count
        return self._num_sms

    @property
    def last_plan(self) -> AttentionPlan | None:
        """The plan run() uses (read-only)."""
        return self._plan

    # -- plan ----------------------------------------------------------------------------------------------
    def _bake(self, **values):
        """Graph mode: everything a captured graph holds (heads, head dims, dtypes, page size, scale, variants,
        kernel choice) must stay as the first plan() set it; raise naming the first value that changed."""
        if not self.use_cuda_graph:
            return
        self._pending_bake = values   # committed by _finish_plan: a plan that fails bakes nothing
        if self._baked is None:
            return
        for name, value in values.items():
            if self._baked.get(name) != value:
                raise ValueError(f"plan: in graph mode {name} is baked into the captured graph; it was "
                                 f"{self._baked.get(name)!r}, got {value!r} (only the batch and its lengths may change)")

    def _stage(self, nbytes: int) -> np.ndarray:
        """This plan's pinned staging bytes (uint8, at least nbytes), free of any copy still in flight."""
        return self._staging.acquire(nbytes)

    def _upload(self, host: np.ndarray, copies, regions: dict, stream, fills=()):
        """Fit the workspace to regions ({name: (shape, dtype)}), then issue the plan's host-to-device copies on
        stream: copies = [(region name, byte offset in host, bytes)], and its memsets: fills = [(region name, byte
        offset, pitch, 32-bit value, width, height)] (kernels.Memset32's rows). Returns (regions as DeviceArrays,
        stream, the event recorded after both, which a run() on another stream waits for)."""
        self._plan = None   # the workspace is about to be rewritten: the previous plan is gone, even if this one fails
        self.workspace, dev = fit_workspace(self.workspace, regions, self._workspace_bytes)
        s = as_stream(stream)
        for name, offset, nbytes in copies:
            if nbytes:
                _driver.call("cuMemcpyHtoDAsync", dev[name].ptr, host.ctypes.data + offset, nbytes, s.handle)
        for m in fill_steps(dev, fills):
            m.launch(s.handle)
        return dev, s, self._staging.release(s)

    @staticmethod
    def _merge_launch(rows: int, tmp_o: DeviceArray, tmp_lse: DeviceArray, base: int, indptr_off: int,
                      rows_off: int, hq: int, d: int, dtype: str, variant, variant_data: int,
                      merge_indptr=None, one_lane: bool = False, programmatic: bool = True):
        """(merge Launch or None, its ParamBuffer): the merge of float32 partial states into out / lse, its row
        list at base + 4 * indptr_off / rows_off (int32 offsets), its row count read from the plan header (so a
        graph replays a later plan's count: no parameter of the launch depends on the batch in graph mode);
        the variant's output hook finishes the merged rows. rows: the rows the grid covers (graph mode: the
        bound). merge_indptr: the plan's (host) merge row pointers, whose longest row sizes the lanes per unit
        (None in graph mode: the grid's size alone); one_lane: one lane per unit (deterministic mode: bits that do
        not depend on the batch). programmatic: the grid starts while the attention kernel ends (decode lets
        it)."""
        mp = ParamBuffer(MERGE_PARAMS)
        mp.set(o_in=tmp_o.ptr, lse_in=tmp_lse.ptr, indptr=base + indptr_off * 4, out_rows=base + rows_off * 4,
               num_rows_dev=base + NUM_MERGE * 4, s_row=hq * d, s_n=hq * d, s_h=d, l_row=hq, l_n=hq, l_h=1,
               num_rows=0, n=0, num_heads=hq, head_dim=d, variant_data=variant_data)
        if not rows:
            return None, mp
        most = int(np.diff(merge_indptr).max(initial=0)) if merge_indptr is not None else None
        grid = set_lanes(mp, rows * hq * (d // 8), most, one_lane)
        kernel = get_kernel(merge_spec("float32", dtype, variant))
        return Launch(kernel, grid, MERGE_THREADS, 0, mp, programmatic=programmatic), mp

    def _finish_plan(self, *, rows, max_rows, hq, d, dtype, kv, launch, params, merge, merge_params, s, copy_done,
                     bind_tma=None, **info):
        """launch / params: the attention Launch (or None) and its ParamBuffer, or lists of them (one per
        launch, issued in order; every one takes run()'s arrays). bind_tma: kvattn.tma's binder, or None."""
        if self.use_cuda_graph and self._baked is None:
            self._baked = self._pending_bake
        launches = launch if isinstance(launch, (list, tuple)) else [launch]
        params = params if isinstance(params, (list, tuple)) else [params]
        self._plan = AttentionPlan(
            rows=rows, max_rows=max_rows, num_qo_heads=hq, head_dim=d, dtype=_dtypes.to_numpy(dtype), kv=kv,
            launches=tuple(x for x in launches if x is not None), merge=merge,
            set_ptrs=_setter(params, "q", "k", "v", "o", "lse"),
            set_strides=_setter(params, "q_stride_n", "q_stride_h", "o_stride_n", "o_stride_h", "lse_stride_n",
                                "kv_stride_page", "kv_stride_token", "kv_stride_head"),
            set_scales=(_setter(params, "k_scale_ptr", "v_scale_ptr", "k_scale", "v_scale")
                        if kv.dtype.itemsize == 1 else None),
            bind_tma=bind_tma,
            merge_set_ptrs=merge_params.setter("o_out", "lse_out"),
            merge_set_strides=merge_params.setter("so_row", "so_h", "lo_row", "lo_h"),
            plan_stream=s.ptr, copy_done=copy_done, wait_copy=not self.use_cuda_graph,
            info=types.MappingProxyType(dict(info, params=params[0] if len(params) == 1 else tuple(params),
                                             merge_params=merge_params)))
        return self

    # -- run -----------------------------------------------------------------------------------------------
    def _begin_run(self, stream):
        """(plan, stream, capturing): the plan run() uses, or RuntimeError before the first plan()."""
        p = self._plan
        if p is None:
            raise RuntimeError("run() called before plan() (or after a plan() that failed)")
        s = as_stream(stream)
        return p, s, s.ptr != LEGACY and s.is_capturing()   # (begin(), inlined: the legacy stream never captures)

    def _execute(self, p: AttentionPlan, s, capturing, q: DeviceArray, k: DeviceArray, v: DeviceArray,
                 kv_strides, out, lse, return_lse, k_scale=None, v_scale=None, before=None):
        """run()'s generic tail: check q, provide out / lse, bind pointers, strides and (fp8) the cache scales,
        launch the plan. before: a launch of the op's own (an fp8 cache's expansion) issued once every argument is
        checked, ahead of the plan's."""
        # scale arrays copied from the host stay referenced here until the launch is issued
        keep = (bind_kv_scales(p, k_scale, v_scale, s, capturing)
                if p.set_scales is not None or k_scale is not None or v_scale is not None else None)
        rows = p.rows
        if q.shape[0] != rows and q.shape[0] == p.max_rows:
            rows = p.max_rows   # graph mode: the arrays keep their maximum rows; rows past the batch are not touched
        out, out_ret, lse, lse_ret = checked_outputs(q, (rows, p.num_qo_heads, p.head_dim), p.dtype, out, lse,
                                                     return_lse, s, capturing, self.device.ordinal)
        self._bind(p, s, capturing, q, k, v, kv_strides, out, lse)
        if before is not None:
            before()
        self._issue(p, s.handle, out, lse)
        del keep
        out.written_on(s)
        if lse is not None:
            lse.written_on(s)
        return (out_ret, lse_ret) if return_lse else out_ret

    @staticmethod
    def _bind(p: AttentionPlan, s, capturing, q: DeviceArray, k: DeviceArray, v: DeviceArray, kv_strides,
              out: DeviceArray, lse):
        """Order run() after the plan's copy and write the checked arrays' pointers, strides and tensor maps into
        the plan's parameters (nothing launched: the mixed op launches two plans' parameters as one kernel)."""
        if p.wait_copy and s.ptr != p.plan_stream and not capturing:
            s.wait(p.copy_done)   # run() on another stream than plan(): order it after the plan's copy
        it = p.dtype.itemsize
        qs, os_ = q.strides, out.strides
        lse_ptr, lse_row = (lse.ptr, lse.strides[0] // 4) if lse is not None else (0, 0)
        p.set_ptrs(q.ptr, k.ptr, v.ptr, out.ptr, lse_ptr)
        p.set_strides(qs[0] // it, qs[1] // it, os_[0] // it, os_[1] // it, lse_row, *kv_strides)
        if p.bind_tma is not None:
            p.bind_tma(q, k, v, out)

    @staticmethod
    def _issue(p: AttentionPlan, handle, out: DeviceArray, lse, attention: bool = True):
        """Launch the bound plan on stream handle: its attention kernels (unless attention is False), then its
        merge into out / lse."""
        if attention:
            for launch in p.launches:
                launch.launch(handle)
        merge = p.merge
        if merge is not None:
            it = p.dtype.itemsize
            os_ = out.strides
            p.merge_set_ptrs(out.ptr, lse.ptr if lse is not None else 0)
            p.merge_set_strides(os_[0] // it, os_[1] // it, lse.strides[0] // 4 if lse is not None else 0, 1)
            merge.launch(handle)
