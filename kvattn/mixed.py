"""A continuous-batching step in one launch: prefills, chunked-prefill appends and single-token decodes together.

    w = kvattn.BatchMixedWithPagedKVCache()
    w.plan(qo_indptr, page_table, num_qo_heads=32, num_kv_heads=8, head_dim=128, causal=True)
    o = w.run(q, k_cache, v_cache)       # q [qo_indptr[-1], Hq, D]; caches as BatchPrefillWithPagedKVCache

The batch splits into a decode part, the single-token requests at its end (or, if longer, at its start: servers
put their decodes together), and a prefill part, every other request (a single-token request elsewhere in the
batch is a prefill of one row: correct, on the tensor cores). Each part is planned by its own op on its share of
the SMs (a BatchPrefillWithPagedKVCache on the persistent wgmma kernel, a BatchDecodeWithPagedKVCache), and
run() launches ONE kernel (cuda_src/mixed.cuh): its first CTAs walk the prefill units, the others each hold three
decode CTAs, so the memory-bound decodes stream their KV while the prefill keeps the tensor cores busy. The SMs
are split by the parts' estimated times (split_sms); the split-KV merges of either part follow the launch.

Where the one launch does not apply (no sm_90 GPU or no persistent wgmma instance for the head dim / variant / cache
type, an fp8 cache, one part empty, or a mixed instance that would spill), or where the two parts one after the
other on the whole GPU are predicted faster (fused_pays: a decode part too large for its share of the SMs), run()
launches the two parts one after the other: the same plan and results. Causal masks are bottom-right aligned, as in the prefill op; a decode row
sees its whole KV (window / soft cap apply to both parts). Graph mode is not built for this op yet.
"""
from __future__ import annotations

import numpy as np

from . import _dtypes, _validate as _v, device as _device
from ._errors import CudaUnavailableError
from ._binding import begin, import_array
from .decode import BatchDecodeWithPagedKVCache, decode_spec, default_stages, smem_bytes as decode_smem_bytes
from .formats import PageTable
from .kernels import KernelSpec, Launch, ParamBuffer, ParamPack, get_kernel, register
from .opcore import PagedKV, bind_kv_scales, checked_outputs, on_device
from .prefill import SM90_PERSIST_DEFINE, SM90_THREADS, BatchPrefillWithPagedKVCache, sm90_spec
from .variants import Variant

MIXED_PARAMS = np.dtype([("prefill_ctas", "i4"), ("decode_ctas", "i4"), ("decode_grid_x", "i4")])
#: Shared memory one CTA may take on sm_90 (227 KB): the mixed kernel's CTA is the larger of the prefill CTA and
#: SUBS decode CTAs.
MAX_SMEM = 227 * 1024
#: Decode CTAs (warpgroups) per mixed CTA at most: the decode kernel's own 3 per SM at head dim 128.
MAX_SUBS = 3
#: The split's rates per SM, measured in the mixed kernel on the H200 (run 22a, BENCHMARKS.md: 2 causal prefills of
#: 4096 + 126 decodes of 4096): the prefill part ~3.5 TFLOP/s per SM (causal FLOPs), a decode SM ~38 GB/s of KV
#: (three 2-stage decode warpgroups; the whole GPU's decode is HBM-bound at ~33 GB/s per SM).
PREFILL_FLOPS_PER_SM = 3.5e12
DECODE_BYTES_PER_SM = 38e9
#: The parts launched one after the other, each on the whole GPU (run 29e, the same batch): the prefill ~4.2 TFLOP/s
#: per SM, the decode ~4.3 TB/s (HBM-bound; DECODE_BYTES_ALONE where the device is not known), which is ~0.89 of
#: the H200's peak memory rate, as the H100's ~3.0 TB/s is of its 3.35 (the copy ceilings measured beside them):
#: on another GPU the decode alone is taken as DECODE_PEAK_FRACTION of its peak. fused_pays compares the two ways.
PREFILL_FLOPS_PER_SM_ALONE = 4.2e12
DECODE_BYTES_ALONE = 4.3e12
DECODE_PEAK_FRACTION = 0.89


def split_requests(qo_lens: np.ndarray) -> tuple[slice, slice]:
    """(prefill requests, decode requests) as slices of the batch: the decodes are the longer of the trailing and
    the leading run of single-token requests (one of the two slices may be empty)."""
    b = qo_lens.size
    ones = qo_lens == 1
    tail = b - int(np.flatnonzero(~ones)[-1]) - 1 if (~ones).any() else b
    head = int(np.argmin(ones)) if (~ones).any() else b
    if tail >= head:
        return slice(0, b - tail), slice(b - tail, b)
    return slice(head, b), slice(0, head)


def split_sms(prefill_flops: float, decode_bytes: float, num_sms: int) -> int:
    """SMs for the prefill part (the rest stream the decodes): the split that would end both parts together at
    the per-SM rates above, at least one SM each."""
    tp, td = prefill_flops / PREFILL_FLOPS_PER_SM, decode_bytes / DECODE_BYTES_PER_SM
    if tp + td <= 0:
        return num_sms // 2
    return int(min(max(round(num_sms * tp / (tp + td)), 1), num_sms - 1))


def fused_pays(prefill_flops: float, decode_bytes: float, num_sms: int, prefill_sms: int,
               decode_alone: float = DECODE_BYTES_ALONE) -> bool:
    """Whether the one launch on this split is predicted at least 3% faster than the two parts one after the other
    (run 29e, H200: 2 causal prefills of 4096 + 126 decodes of 4096 took 1048.6 us fused against 983.6 apart, as
    these rates predict: the decode SMs of a split stream ~38 GB/s each, far from HBM's rate, so a large decode part
    is faster alone on every SM; on an H100, whose HBM is slower, the same batch is faster in one launch).
    decode_alone: the decode part's rate on the whole GPU (bytes/s)."""
    fused = max(prefill_flops / (prefill_sms * PREFILL_FLOPS_PER_SM),
                decode_bytes / ((num_sms - prefill_sms) * DECODE_BYTES_PER_SM))
    apart = prefill_flops / (num_sms * PREFILL_FLOPS_PER_SM_ALONE) + decode_bytes / decode_alone
    return fused < 0.97 * apart


def _decode_alone(device) -> float:
    """fused_pays' decode_alone on `device` (a Device, an ordinal or None: the current one); DECODE_BYTES_ALONE
    where no GPU is usable."""
    try:
        return DECODE_PEAK_FRACTION * _device.get(device).peak_memory_bandwidth
    except CudaUnavailableError:
        return DECODE_BYTES_ALONE


def sub_table(pt: PageTable, req: slice) -> PageTable:
    """The PageTable of requests req (a slice) of pt."""
    a, b = int(pt.indptr[req.start]), int(pt.indptr[req.stop])
    return PageTable(pt.indptr[req.start:req.stop + 1] - a, pt.indices[a:b], pt.last_page_len[req], pt.page_size)


def _template_args(kernel: str) -> str:
    """'A, B' of 'kvattn::name<A, B>'."""
    return kernel[kernel.index("<") + 1:kernel.rindex(">")]


def mixed_spec(pre: KernelSpec, dec: KernelSpec, subs: int) -> KernelSpec:
    """The mixed kernel of a persistent wgmma prefill instance and a decode instance (their KernelSpecs; built-in
    variants: a user variant's prelude is written for one kernel)."""
    if pre.prelude[1] or dec.prelude[1]:
        raise ValueError("mixed_spec: user variants are not built into the mixed kernel")
    defines = tuple(dict.fromkeys(pre.defines + dec.defines))
    return KernelSpec("mixed.cuh", f"kvattn::mixed_kernel<{_template_args(pre.kernel)}, "
                                   f"{_template_args(dec.kernel)}, {subs}>",
                      defines=defines, checks=pre.checks + dec.checks)


def mixed_kernel(pre: KernelSpec, dec: KernelSpec, pre_smem: int, dec_smem: int, subs: int):
    """The loaded mixed kernel of these two instances (dynamic shared memory pre_smem / dec_smem each), or None
    where it does not apply: a user variant, subs decode CTAs beside the prefill CTA's shared memory past
    MAX_SMEM, or spills."""
    if pre.prelude[1] or dec.prelude[1] or max(pre_smem, subs * dec_smem) > MAX_SMEM:
        return None
    kernel = get_kernel(mixed_spec(pre, dec, subs))
    if kernel.resources is not None and kernel.resources.spills:
        return None
    return kernel


def mixed_launch(kernel, pre_params: ParamBuffer, pre_ctas: int, pre_smem: int, dec_params: ParamBuffer,
                 dec_grid: tuple, dec_smem: int, subs: int) -> Launch:
    """The one launch: pre_ctas prefill CTAs, then the decode grid dec_grid (x, y, 1) in CTAs of subs warpgroups."""
    gx, gy, _ = dec_grid
    mp = ParamBuffer(MIXED_PARAMS)
    mp.set(prefill_ctas=pre_ctas, decode_ctas=gx * gy, decode_grid_x=gx)
    return Launch(kernel, pre_ctas + -(-gx * gy // subs), SM90_THREADS, max(pre_smem, subs * dec_smem),
                  ParamPack(pre_params, dec_params, mp))


def _default_spec(head_dim: int, dtype: str, interleaved: bool) -> KernelSpec:
    d_smem = decode_smem_bytes(head_dim, 1, default_stages(head_dim))
    return mixed_spec(sm90_spec(head_dim, Variant(), dtype, persistent=True, interleaved=interleaved),
                      decode_spec(head_dim, 1, Variant(), dtype), min(MAX_SUBS, MAX_SMEM // d_smem))


register("mixed", [_default_spec(128, "bfloat16", il) for il in (False, True)])


class BatchMixedWithPagedKVCache:
    """Prefill + decode requests of one batch in one launch (see the module docstring).

    kv_layout: "NHD" or "HND" (as BatchPrefillWithPagedKVCache). num_sms: the SMs to split (None: the device's).
    """

    #: decode_stages: the decode part's cp.async ring (None: the decode op's default); decode_ctas_per_sm: its CTAs
    #: (warpgroups) per mixed CTA (None: as many as fit, at most MAX_SUBS). More stages, fewer warpgroups: more
    #: bytes in flight per decode SM (scripts/bench_mixed.py --sweep).
    DEFAULT_TUNING = dict(decode_stages=None, decode_ctas_per_sm=None)

    def __init__(self, kv_layout="NHD", workspace_bytes=None, num_sms=None, device=None, tuning=None):
        unknown = set(tuning or {}) - set(self.DEFAULT_TUNING)
        if unknown:
            raise ValueError(f"tuning: unknown keys {sorted(unknown)}; known: {sorted(self.DEFAULT_TUNING)}")
        self.tuning = {**self.DEFAULT_TUNING, **(tuning or {})}
        self._pre = BatchPrefillWithPagedKVCache(kv_layout, workspace_bytes=workspace_bytes, device=device)
        self._pre.tail_split = False   # its share of the SMs runs beside the decode part: not measured with it
        self._dec = BatchDecodeWithPagedKVCache(kv_layout, workspace_bytes=workspace_bytes, device=device)
        self.kv_layout = self._pre.kv_layout
        self._device_arg = self._pre._device_arg
        self.device = None   # the parts' kvattn Device, from the first plan()
        self._num_sms = num_sms
        self._state = None

    @property
    def num_sms(self) -> int:
        if self._num_sms is None:
            self._num_sms = self._pre.num_sms
        return self._num_sms

    @property
    def last_plan(self):
        """A dict: prefill / decode (the parts' requests as slices), prefill_sms, decode_ctas, fused (one launch),
        and the parts' own plans (prefill_plan / decode_plan)."""
        return self._state

    @on_device   # (the one launch's kernel is loaded here: on the parts' device)
    def plan(self, qo_indptr, page_table: PageTable, num_qo_heads, num_kv_heads, head_dim, *, causal=False,
             sm_scale=None, window_left=-1, logits_soft_cap=0.0, q_dtype="bfloat16", kv_dtype=None,
             prefill_sms=None, stream=None):
        """Schedule the batch (host arrays are read now). qo_indptr: int [B + 1]; page_table: a kvattn.PageTable of B
        requests; causal: bottom-right causal mask on the prefill part. prefill_sms: SMs for the prefill part
        (None: split_sms' estimate; for tuning)."""
        if not isinstance(page_table, PageTable):
            raise TypeError(f"page_table: expected a kvattn.PageTable, got {type(page_table).__name__}")
        qo_indptr = _v.as_indptr(qo_indptr, "qo_indptr", length=page_table.indptr.size)
        self._state = None   # (a plan that fails part-way leaves no plan: the parts' buffers may be rewritten)
        qo = np.diff(qo_indptr).astype(np.int64)
        kv = page_table.kv_lens.astype(np.int64)
        pre, dec = split_requests(qo)
        hq = _v.as_int(num_qo_heads, "num_qo_heads", min_value=1)
        hkv = _v.as_int(num_kv_heads, "num_kv_heads", min_value=1)
        d = _v.as_int(head_dim, "head_dim", min_value=1)
        kv_dtype = q_dtype if kv_dtype is None else kv_dtype
        itemsize = _dtypes.to_numpy(kv_dtype).itemsize
        qp, kp = qo[pre], kv[pre]
        pairs = (qp * kp - (qp * (qp - 1)) // 2 if causal else qp * kp).sum()
        n = self.num_sms
        flops, nbytes = 4.0 * pairs * hq * d, float(kv[dec].sum()) * hkv * d * 2 * itemsize
        auto = prefill_sms is None
        if auto:
            prefill_sms = split_sms(flops, nbytes, n)
        prefill_sms = _v.as_int(prefill_sms, "prefill_sms", min_value=1)
        if prefill_sms >= n:
            raise ValueError(f"prefill_sms: expected 1..{n - 1} (the rest run the decodes), got {prefill_sms}")
        args = dict(sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, q_dtype=q_dtype,
                    kv_dtype=kv_dtype, stream=stream)
        # one launch where both parts exist and (the split not forced) it is predicted to pay
        alone = _decode_alone(self.device or self._device_arg)
        both = (pre.stop > pre.start and dec.stop > dec.start
                and (not auto or fused_pays(flops, nbytes, n, prefill_sms, alone)))
        self._pre._num_sms = prefill_sms if both else n
        self._dec._num_sms = n - prefill_sms if both else n
        stages = self.tuning["decode_stages"] or default_stages(d, kv_dtype)
        subs = self.tuning["decode_ctas_per_sm"] or min(MAX_SUBS,
                                                        MAX_SMEM // decode_smem_bytes(d, 1, stages, kv_dtype))
        # the decode kernel's instance of one lane's state a round in the one launch (the fused merge's batch of 4
        # makes the mixed kernel spill 172 bytes: mixed_kernel would refuse it); never the sm90 route (the mixed
        # launch holds the decode kernel)
        self._dec.tuning = {**self._dec.tuning, "ctas_per_sm": subs if both else None,
                            "stages": stages if both else None, "fused_merge_batch": 1 if both else None,
                            "sm90_route": False}
        p_plan = d_plan = None
        if pre.stop > pre.start:
            a = int(qo_indptr[pre.start])
            self._pre.plan(qo_indptr[pre.start:pre.stop + 1] - a, sub_table(page_table, pre), hq, hkv, d,
                           causal=causal, **args)
            p_plan = self._pre.last_plan
        if dec.stop > dec.start:
            self._dec.plan(sub_table(page_table, dec), hq, hkv, d, **args)
            d_plan = self._dec.last_plan
        mixed = self._mixed_launch(p_plan, d_plan, subs) if both else None
        self.device = self._pre.device or self._dec.device
        pages = int(page_table.indices.max(initial=-1)) + 1
        self._state = dict(prefill=pre, decode=dec, rows=(slice(int(qo_indptr[pre.start]), int(qo_indptr[pre.stop])),
                                                          slice(int(qo_indptr[dec.start]), int(qo_indptr[dec.stop]))),
                           total_rows=int(qo_indptr[-1]), hq=hq, d=d, dtype=_dtypes.to_numpy(q_dtype),
                           kv=PagedKV(self.kv_layout, page_table.page_size, hkv, d, _dtypes.to_numpy(kv_dtype), pages),
                           prefill_plan=p_plan, decode_plan=d_plan, launch=mixed, fused=mixed is not None,
                           prefill_sms=prefill_sms if both else None,
                           decode_ctas=int(np.prod(d_plan.info["grid"])) if d_plan is not None else 0)
        return self

    def _mixed_launch(self, p_plan, d_plan, subs: int) -> Launch | None:
        """The one launch of both parts' kernels, or None where it does not apply (see the module docstring)."""
        if p_plan.kv.dtype.itemsize != 2 or p_plan.info["backend"] != "sm90" or len(p_plan.launches) != 1:
            return None
        pre, dec = p_plan.info, d_plan.info
        if SM90_PERSIST_DEFINE not in pre["kernel"].spec.defines:
            return None
        kernel = mixed_kernel(pre["kernel"].spec, dec["kernel"].spec, pre["smem"], dec["smem"], subs)
        if kernel is None:
            return None
        # the persistent grid: min(units, its SMs)
        return mixed_launch(kernel, pre["params"], pre["grid"][0], pre["smem"], dec["params"], dec["grid"],
                            dec["smem"], subs)

    @on_device
    def run(self, q, k_cache, v_cache=None, out=None, lse=None, return_lse=False, stream=None, k_scale=None,
            v_scale=None):
        """q: [qo_indptr[-1], Hq, D]; caches [pages, page_size, Hkv, D] ("NHD") / [pages, Hkv, page_size, D] ("HND"),
        or k_cache [pages, 2, ...] with v_cache None. Returns out [total_qo, Hq, D] (and lse [total_qo, Hq] float32,
        natural log, with return_lse) as the prefill op; stream, k_scale / v_scale (an fp8 cache) as there."""
        st = self._state
        if st is None:
            raise RuntimeError("run() called before plan()")
        s, capturing = begin(stream)
        q = import_array(q, s, capturing)
        k, v, kv_strides = st["kv"].bind(k_cache, v_cache, s, capturing)
        out, out_ret, lse, lse_ret = checked_outputs(q, (st["total_rows"], st["hq"], st["d"]), st["dtype"], out, lse,
                                                     return_lse, s, capturing, self.device.ordinal)
        parts, expansions, keep = [], [], []
        for op, plan, r in ((self._pre, st["prefill_plan"], st["rows"][0]), (self._dec, st["decode_plan"], st["rows"][1])):
            if plan is not None:
                o_r, l_r = out[r], (lse[r] if lse is not None else None)
                pk, pv, pstrides = k, v, kv_strides
                if getattr(op, "_fp8", None) is not None:
                    # the prefill part expands an fp8 cache once: its plan reads the expansion's 16-bit rows
                    pk, pv, pstrides, _, _, issue = op._bind_kv(plan, k, v, s, capturing, k_scale, v_scale)
                    expansions.append(issue)
                else:
                    keep.append(bind_kv_scales(plan, k_scale, v_scale, s, capturing))
                op._bind(plan, s, capturing, q[r], pk, pv, pstrides, o_r, l_r)
                parts.append((op, plan, o_r, l_r))
        for issue in expansions:   # (every argument checked: now the launches)
            issue()
        handle = s.handle
        if st["launch"] is not None:
            st["launch"].launch(handle)
        for op, plan, o_r, l_r in parts:
            op._issue(plan, handle, o_r, l_r, attention=st["launch"] is None)
        del keep   # (scale arrays copied from the host: referenced until the launches are issued)
        out.written_on(s)
        if lse is not None:
            lse.written_on(s)
        return (out_ret, lse_ret) if return_lse else out_ret
