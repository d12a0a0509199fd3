"""Block-sparse attention: query rows attend only to the KV columns of their block row's blocks (BSR).

    bsr = kvattn.BlockSparse(indptr, indices, block_shape=(R, C), shape=(M, N))
    w = kvattn.BlockSparseAttentionWrapper()
    w.plan(bsr, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    o = w.run(q, k, v)                   # q [M, Hq, D]; k, v [N, Hkv, D] ("NHD") or [Hkv, N, D] ("HND")

A BSR matrix is a paged KV cache (DESIGN.md 3): block row i is a request of R query rows whose "pages" are its
block columns, each a page of C tokens of k / v (page stride C * token stride), so block-sparse attention runs
the prefill kernels (sm90 / sm80, every tile size, split-KV) with no kernel of its own (k / v: opcore.RaggedKV with
C tokens per page). mask: bool [nnz, R, C]
(True = keep) refines every stored block (the custom-mask variant). No positional mask: a row's columns are a set.

VariableBlockSparseAttentionWrapper takes one BlockSparse per KV head (each its own block shape and pattern): one
prefill launch per KV head, on that head's slice of q / k / v / out.
"""
from __future__ import annotations

import numpy as np

from . import _validate as _v, device as _device
from ._binding import begin, import_array, output
from .formats import BlockSparse
from .opcore import F32, RaggedKV, check_array, on_device
from .contract import page_size_shift
from .prefill import _BatchPrefill


def _block_mask(bsr: BlockSparse, mask) -> np.ndarray | None:
    """The custom mask of the block rows as requests (flat bool, row-major [R, blocks * C] per block row) from
    mask bool [nnz, R, C], or None."""
    if mask is None:
        return None
    r, c = bsr.block_shape
    m = _v.as_bool_array(mask, "mask")
    if m.shape != (bsr.nnz_blocks, r, c):
        raise ValueError(f"mask: expected bool [nnz_blocks, R, C] = [{bsr.nnz_blocks}, {r}, {c}], got {m.shape}")
    parts = [m[a:b].transpose(1, 0, 2).reshape(-1) for a, b in zip(bsr.indptr[:-1], bsr.indptr[1:])]
    return np.concatenate(parts) if parts else np.zeros(0, bool)


class BlockSparseAttentionWrapper(_BatchPrefill):
    """Attention over a block-sparse (BSR) pattern (see the module docstring).

    kv_layout: "NHD" (k, v [N, Hkv, D]) or "HND" ([Hkv, N, D]). use_cuda_graph: fix the buffers from
    max_batch_size (block rows), max_num_pages (stored blocks) and max_total_qo (query rows M).
    backend / device / deterministic: as BatchPrefillWithPagedKVCache.
    """

    _paged = True
    _own_kv = False   # every block row reads the one k / v

    @on_device
    def plan(self, bsr: BlockSparse, num_qo_heads, num_kv_heads, head_dim, *, mask=None, sm_scale=None,
             logits_soft_cap=0.0, q_dtype="bfloat16", kv_dtype=None, cta_rows=None, stream=None):
        """bsr: a kvattn.BlockSparse of shape (M, N) (q rows, kv rows), block shape (R, C), any R, C >= 1.
        mask: bool [nnz_blocks, R, C] (True = keep) or None. kv_dtype: q's dtype or an fp8 type (run() then takes
        k_scale / v_scale)."""
        if not isinstance(bsr, BlockSparse):
            raise TypeError(f"bsr: expected a kvattn.BlockSparse, got {type(bsr).__name__}")
        r, c = bsr.block_shape
        m, n = bsr.shape
        nb = bsr.num_block_rows
        qo_indptr = (np.arange(nb + 1, dtype=np.int64) * r).astype(np.int32)
        kv_lens = np.diff(bsr.indptr).astype(np.int64) * c
        self._plan_common(qo_indptr, kv_lens, bsr.indptr, bsr.indices, c, page_size_shift(c), num_qo_heads,
                          num_kv_heads, head_dim, False, _block_mask(bsr, mask), None, sm_scale, -1,
                          logits_soft_cap, q_dtype, kv_dtype, cta_rows, stream,
                          make_kv=lambda hkv, d, dtype: RaggedKV(self.kv_layout, n, hkv, d, dtype, tokens_per_page=c))
        return self

    @on_device
    def run(self, q, k, v, out=None, lse=None, return_lse=False, stream=None, k_scale=None, v_scale=None):
        """q: [M, Hq, D]; k, v: [N, Hkv, D] ("NHD") or [Hkv, N, D] ("HND"). Returns out [M, Hq, D] (and lse [M, Hq]
        float32, natural log) as the prefill wrappers; a row with no blocks gets 0 and lse -inf."""
        p, s, capturing = self._begin_run(stream)
        q = import_array(q, s, capturing)
        k, v, kv_strides = p.kv.bind(k, v, s, capturing)
        return self._execute(p, s, capturing, q, k, v, kv_strides, out, lse, return_lse, k_scale, v_scale)


class VariableBlockSparseAttentionWrapper:
    """Block-sparse attention with a pattern per KV head: plan(bsrs) takes num_kv_heads BlockSparse matrices of
    one shape (M, N), each with its own block shape and blocks; KV head h's query heads [h * group, (h + 1) *
    group) attend through bsrs[h]. One BlockSparseAttentionWrapper per head (kv_layout "NHD")."""

    def __init__(self, workspace_bytes=None, num_sms=None, backend="auto", device=None):
        self._args = dict(workspace_bytes=workspace_bytes, num_sms=num_sms, backend=backend, device=device)
        self._heads: list[BlockSparseAttentionWrapper] = []
        self._shape = None
        self._device_arg = _device.check_device_arg(device)
        self.device = None   # the heads' kvattn Device, bound by the first plan() (opcore.on_device)

    @on_device
    def plan(self, bsrs, num_qo_heads, num_kv_heads, head_dim, *, sm_scale=None, logits_soft_cap=0.0,
             q_dtype="bfloat16", stream=None):
        bsrs = list(bsrs)
        hq = _v.as_int(num_qo_heads, "num_qo_heads", min_value=1)
        hkv = _v.as_int(num_kv_heads, "num_kv_heads", min_value=1)
        if len(bsrs) != hkv:
            raise ValueError(f"bsrs: expected one BlockSparse per KV head ({hkv}), got {len(bsrs)}")
        if hq % hkv:
            raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
        for i, b in enumerate(bsrs):
            if not isinstance(b, BlockSparse):
                raise TypeError(f"bsrs[{i}]: expected a kvattn.BlockSparse, got {type(b).__name__}")
            if b.shape != bsrs[0].shape:
                raise ValueError(f"bsrs[{i}]: shape {b.shape} differs from bsrs[0]'s {bsrs[0].shape}")
        while len(self._heads) < hkv:
            self._heads.append(BlockSparseAttentionWrapper(**self._args))
        for w, b in zip(self._heads, bsrs):
            w.plan(b, hq // hkv, 1, head_dim, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, q_dtype=q_dtype,
                   stream=stream)
        self._shape = (hq, hkv, head_dim, q_dtype)
        return self

    @on_device   # (the implicit out / lse come from the pool of the heads' device)
    def run(self, q, k, v, out=None, lse=None, return_lse=False, stream=None):
        """q: [M, Hq, D]; k, v: [N, Hkv, D]. Returns out (and lse) as BlockSparseAttentionWrapper.run."""
        if self._shape is None:
            raise RuntimeError("run() called before plan()")
        hq, hkv, d, _ = self._shape
        g = hq // hkv
        s, capturing = begin(stream)
        q, k, v = (import_array(x, s, capturing) for x in (q, k, v))
        dtype = self._heads[0].last_plan.dtype
        rows = self._heads[0].last_plan.rows
        check_array(q, "q", (rows, hq, d), dtype)
        dev = self.device.ordinal
        out, out_ret = output(out, (rows, hq, d), dtype, s, capturing, "out", dev)
        lse_ret = lse
        if lse is not None or return_lse:
            lse, lse_ret = output(lse, (rows, hq), F32, s, capturing, "lse", dev)
        for h, w in enumerate(self._heads[:hkv]):
            w.run(q[:, h * g:(h + 1) * g], k[:, h:h + 1], v[:, h:h + 1], out=out[:, h * g:(h + 1) * g],
                  lse=None if lse is None else lse[:, h * g:(h + 1) * g], stream=s)
        return (out_ret, lse_ret) if return_lse else out_ret
