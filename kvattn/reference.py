"""Float64 numpy reference for every kvattn op (the test oracle).

Semantics follow DESIGN.md section 3.  All functions accept float16 /
bfloat16 (ml_dtypes) / float32 / float64 inputs, compute in float64 and
return float64.  LSE is the *natural* log-sum-exp of the final (scaled,
capped, biased, masked) scores (FlashInfer returns base 2:
``lse_base2 = lse / ln 2``); an empty or fully masked row gives output 0 and
LSE -inf, never NaN.  NaN / Inf in data are accepted and propagate; index
arrays are validated (see kvattn._validate).
"""
from __future__ import annotations

import numpy as np

from . import _validate as _v

_NEG_INF = -np.inf


# ---------------------------------------------------------------------------
# merge_state / merge_states
# ---------------------------------------------------------------------------
def merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two partial attention states over disjoint KV sets.

    o_a, o_b: [rows, H, D] float; lse_a, lse_b: [rows, H] natural-log LSE.
    Returns (o [rows, H, D] float64, lse [rows, H] float64) with
    ``lse = logaddexp(lse_a, lse_b)`` and
    ``o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)``.
    A side with lse -inf contributes nothing; both -inf gives o = 0, lse = -inf.
    """
    o_a = _v.as_float64(o_a, "o_a", ndim=3)
    o_b = _v.as_float64(o_b, "o_b", ndim=3)
    lse_a = _v.as_float64(lse_a, "lse_a", ndim=2)
    lse_b = _v.as_float64(lse_b, "lse_b", ndim=2)
    if o_b.shape != o_a.shape:
        raise ValueError(f"o_b: shape must equal o_a's {o_a.shape}, got {o_b.shape}")
    if lse_a.shape != o_a.shape[:2]:
        raise ValueError(f"lse_a: expected shape {o_a.shape[:2]} (rows, H), got {lse_a.shape}")
    if lse_b.shape != o_a.shape[:2]:
        raise ValueError(f"lse_b: expected shape {o_a.shape[:2]} (rows, H), got {lse_b.shape}")
    o, lse = merge_states(np.stack([o_a, o_b], axis=1), np.stack([lse_a, lse_b], axis=1))
    return o, lse


def merge_states(o, lse):
    """Merge n partial states per row.

    o: [rows, n, H, D] float; lse: [rows, n, H].  Returns
    (o [rows, H, D] float64, lse [rows, H] float64).  n may be 0 (gives 0, -inf).
    """
    o = _v.as_float64(o, "o", ndim=4)
    lse = _v.as_float64(lse, "lse", ndim=3)
    if lse.shape != o.shape[:3]:
        raise ValueError(f"lse: expected shape {o.shape[:3]} (rows, n, H), got {lse.shape}")
    return _merge_axis1(o, lse)


def _merge_axis1(o, lse):
    """Unchecked merge over axis 1: o [rows, n, H, D], lse [rows, n, H]."""
    rows, n, h, d = o.shape
    if n == 0:
        return np.zeros((rows, h, d)), np.full((rows, h), _NEG_INF)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.max(lse, axis=1)  # [rows, H]
        m_safe = np.where(np.isneginf(m), 0.0, m)
        w = np.exp(lse - m_safe[:, None, :])  # exp(-inf) = 0
        s = np.sum(w, axis=1)
        out_lse = m_safe + np.log(s)  # log(0) = -inf for all -inf rows
        w = w / np.where(s == 0, 1.0, s)[:, None, :]
        # zero-weight partial states never contribute, even if they hold inf/NaN junk;
        # a NaN lse propagates
        contrib = np.where(w[..., None] == 0, 0.0, o * w[..., None])
    out = np.sum(contrib, axis=1)
    out_lse = np.where(np.isneginf(m), _NEG_INF, out_lse)
    return out, out_lse


# ---------------------------------------------------------------------------
# single-request core
# ---------------------------------------------------------------------------
def _check_qkv(q, k, v, qname="q", kname="k", vname="v"):
    q = _v.as_float64(q, qname, ndim=3)
    k = _v.as_float64(k, kname, ndim=3)
    v = _v.as_float64(v, vname, ndim=3)
    _check_heads(q.shape, k.shape, v.shape, qname, kname, vname)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{vname}: expected {k.shape[0]} kv rows like {kname}, got {v.shape[0]}")
    return q, k, v


def _check_heads(qs, ks, vs, qname="q", kname="k", vname="v"):
    """qs/ks/vs: shapes whose last two entries are (heads, head_dim)."""
    hq, d = qs[-2], qs[-1]
    hkv, dk = ks[-2], ks[-1]
    if dk != d:
        raise ValueError(f"{kname}: head dim must equal {qname}'s {d}, got {dk}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{qname}: num_qo_heads {hq} must be a multiple of num_kv_heads {hkv} ({kname})")
    if vs[-2] != hkv:
        raise ValueError(f"{vname}: num_kv_heads must equal {kname}'s {hkv}, got {vs[-2]}")


def _opts(hq, d, sm_scale, window_left, logits_soft_cap, alibi_slopes, sinks=None):
    sm_scale = _v.as_float(sm_scale, "sm_scale", allow_none=True)
    if sm_scale is None:
        sm_scale = 1.0 / np.sqrt(d) if d else 1.0
    window_left = _v.as_int(window_left, "window_left", min_value=-1)
    cap = _v.as_float(logits_soft_cap, "logits_soft_cap", min_value=0.0)
    if alibi_slopes is not None:
        alibi_slopes = _v.as_float64(alibi_slopes, "alibi_slopes", ndim=1)
        if alibi_slopes.shape[0] != hq:
            raise ValueError(f"alibi_slopes: expected {hq} slopes (one per query head), got {alibi_slopes.shape[0]}")
    if sinks is not None:
        sinks = _v.as_float64(sinks, "sinks", ndim=1)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks: expected {hq} sink logits (one per query head), got {sinks.shape[0]}")
    return dict(sm_scale=sm_scale, window_left=window_left, cap=cap, alibi=alibi_slopes, sinks=sinks)


def _attend(q, k, v, causal, mask, sm_scale, window_left, cap, alibi, sinks=None):
    """Unchecked core.  q [qo,Hq,D], k [kv,Hkv,D], v [kv,Hkv,Dv] float64;
    mask: bool [qo, kv] or None; sinks: [Hq] or None.  Returns (o [qo,Hq,Dv], lse [qo,Hq])."""
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    if qo == 0 or kv == 0:
        lse = np.full((qo, hq), _NEG_INF) if sinks is None else np.broadcast_to(sinks, (qo, hq)).copy()
        return np.zeros((qo, hq, dv)), lse
    g = hq // hkv
    qg = q.reshape(qo, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, qo * g, d)
    kh = np.ascontiguousarray(k.transpose(1, 0, 2))  # [Hkv, kv, D]: BLAS-friendly batches
    s = np.matmul(qg, kh.transpose(0, 2, 1)).reshape(hkv, qo, g, kv) * sm_scale
    if cap > 0:
        s = cap * np.tanh(s / cap)
    rel = np.arange(kv)[None, :] - (kv - qo + np.arange(qo)[:, None])  # [qo, kv]
    if alibi is not None:
        s = s + alibi.reshape(hkv, 1, g, 1) * rel[None, :, None, :]
    allowed = np.ones((qo, kv), dtype=bool) if mask is None else mask.copy()
    if causal:
        allowed &= rel <= 0
    if window_left >= 0:
        allowed &= rel >= -window_left
    s = np.where(allowed[None, :, None, :], s, _NEG_INF)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.max(s, axis=-1, keepdims=True)
        m_safe = np.where(np.isneginf(m), 0.0, m)
        p = np.exp(s - m_safe)
        den = np.sum(p, axis=-1, keepdims=True)
        if sinks is not None:   # one more logit per head in the denominator (it has no value row)
            den = den + np.exp(sinks.reshape(hkv, 1, g, 1) - m_safe)
        lse = (m_safe + np.log(den))[..., 0]
        o = np.matmul(p.reshape(hkv, qo * g, kv), np.ascontiguousarray(v.transpose(1, 0, 2)))
        o = o.reshape(hkv, qo, g, dv)
        o = np.where(den == 0, 0.0, o / np.where(den == 0, 1.0, den))  # NaN data propagates
    o = o.transpose(1, 0, 2, 3).reshape(qo, hq, dv)
    lse = lse.transpose(1, 0, 2).reshape(qo, hq)
    return o, lse


def _mask_array(m):
    m = m if isinstance(m, np.ndarray) else np.asarray(m)
    if m.dtype != np.bool_:
        hint = " (unpack a bit-packed mask with kvattn.unpack_mask)" if m.dtype == np.uint8 else ""
        raise TypeError(f"custom_mask: expected a bool array{hint}, got dtype {m.dtype}")
    return m


def _ret(o, lse, return_lse):
    return (o, lse) if return_lse else o


def attention(q, k, v, *, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=0.0,
              alibi_slopes=None, sinks=None, custom_mask=None, return_lse=False):
    """Attention for one request (GQA: query head h uses kv head h // (Hq // Hkv)).

    q: [qo, Hq, D]; k: [kv, Hkv, D]; v: [kv, Hkv, Dv]; alibi_slopes: [Hq];
    custom_mask: bool [qo, kv] or flat [qo * kv] (True = keep).
    Score s = (q . k) * sm_scale (default 1/sqrt(D)); soft cap
    cap * tanh(s / cap) when logits_soft_cap > 0; ALiBi s += slope[h] * (j - (kv - qo + r));
    then causal (bottom-right: j <= kv - qo + r), sliding window (j >= kv - qo + r - window_left
    when window_left >= 0) and custom masks.  sinks: [Hq] attention sinks, one logit per head
    added to the softmax's denominator (o = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j}); the lse
    includes it; a row with no kept key has o = 0, lse = sink).  Returns o float64 [qo, Hq, Dv]
    (and lse float64 [qo, Hq], natural log, when return_lse).
    """
    q, k, v = _check_qkv(q, k, v)
    opt = _opts(q.shape[1], q.shape[2], sm_scale, window_left, logits_soft_cap, alibi_slopes, sinks)
    qo, kv = q.shape[0], k.shape[0]
    if causal and kv < qo:
        raise ValueError(f"causal: requires kv_len >= qo_len, got qo_len {qo} > kv_len {kv}")
    mask = None
    if custom_mask is not None:
        mask = _mask_array(custom_mask)
        if mask.ndim == 2 and mask.shape != (qo, kv):
            raise ValueError(f"custom_mask: expected shape (qo_len, kv_len) = {(qo, kv)}, got {mask.shape}")
        if mask.size != qo * kv:
            raise ValueError(f"custom_mask: expected qo_len * kv_len = {qo * kv} entries, got {mask.size}")
        mask = mask.reshape(qo, kv)
    return _ret(*_attend(q, k, v, bool(causal), mask, **opt), return_lse)


# ---------------------------------------------------------------------------
# batched forms
# ---------------------------------------------------------------------------
def _batch(q, qo_indptr, kv_lens, fetch, dv, opt, causal, custom_mask, return_lse):
    """q [total_qo,Hq,D] f64; fetch(i) -> (k_i, v_i) float64; dv: value head dim."""
    qo_lens = np.diff(qo_indptr).astype(np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    if causal and (kv_lens < qo_lens).any():
        i = int(np.argmax(kv_lens < qo_lens))
        raise ValueError(
            f"causal: requires kv_len >= qo_len for every request, request {i} has qo_len {qo_lens[i]} > kv_len {kv_lens[i]}"
        )
    mask_indptr = np.concatenate([[0], np.cumsum(qo_lens * kv_lens)])
    if custom_mask is not None:
        if isinstance(custom_mask, (list, tuple)):  # per-request [qo_i, kv_i] masks
            custom_mask = [_mask_array(m).ravel() for m in custom_mask]
            custom_mask = np.concatenate(custom_mask) if custom_mask else np.zeros(0, bool)
        custom_mask = _mask_array(custom_mask).ravel()
        if custom_mask.size != mask_indptr[-1]:
            raise ValueError(
                f"custom_mask: expected sum(qo_len * kv_len) = {int(mask_indptr[-1])} entries, got {custom_mask.size}"
            )
    outs, lses = [], []
    for i in range(qo_lens.size):
        if qo_lens[i] == 0:
            continue
        k_i, v_i = fetch(i)
        m = None
        if custom_mask is not None:
            m = custom_mask[mask_indptr[i]:mask_indptr[i + 1]].reshape(int(qo_lens[i]), int(kv_lens[i]))
        oi, li = _attend(q[qo_indptr[i]:qo_indptr[i + 1]], k_i, v_i, causal, m, **opt)
        outs.append(oi)
        lses.append(li)
    o = np.concatenate(outs) if outs else np.zeros((0, q.shape[1], dv))
    lse = np.concatenate(lses) if lses else np.zeros((0, q.shape[1]))
    return _ret(o, lse, return_lse)


def batch_attention_ragged(q, k, v, qo_indptr, kv_indptr, *, causal=False, sm_scale=None, window_left=-1,
                           logits_soft_cap=0.0, alibi_slopes=None, sinks=None, custom_mask=None, return_lse=False):
    """Batched attention over ragged q / k / v.

    q: [qo_indptr[-1], Hq, D]; k: [kv_indptr[-1], Hkv, D]; v: [kv_indptr[-1], Hkv, Dv];
    qo_indptr, kv_indptr: int [B+1]; custom_mask: flat bool [sum(qo_i * kv_i)]
    (per request row-major [qo_i, kv_i], concatenated) or a list of B bool [qo_i, kv_i].  Other options as
    :func:`attention`, applied per request.  Returns o [total_qo, Hq, Dv] (, lse [total_qo, Hq]).
    """
    q, k, v = _check_qkv(q, k, v)
    qo_indptr = _v.as_indptr(qo_indptr, "qo_indptr", total=q.shape[0])
    kv_indptr = _v.as_indptr(kv_indptr, "kv_indptr", length=qo_indptr.size, total=k.shape[0])
    opt = _opts(q.shape[1], q.shape[2], sm_scale, window_left, logits_soft_cap, alibi_slopes, sinks)

    def fetch(i):
        s = slice(kv_indptr[i], kv_indptr[i + 1])
        return k[s], v[s]

    return _batch(q, qo_indptr, np.diff(kv_indptr), fetch, v.shape[2], opt, bool(causal), custom_mask, return_lse)


def _paged_kv(k_cache, v_cache, page_table, kv_layout):
    """-> (k_nhd, v_nhd, num_kv_heads) with page table validated against the cache."""
    from .formats import PageTable, PagedKVLayout

    if not isinstance(page_table, PageTable):
        raise TypeError(f"page_table: expected a kvattn PageTable, got {type(page_table).__name__}")
    lay = PagedKVLayout.of(kv_layout)
    k4, v4 = lay.split(k_cache, v_cache)
    for name, a in (("k_cache", k4), ("v_cache", v4)):
        if not _v.is_float_dtype(a.dtype):
            raise TypeError(f"{name}: expected a floating-point cache, got dtype {a.dtype}")
    k4, v4 = lay.to_nhd(k4), lay.to_nhd(v4)
    num_pages, ps = k4.shape[0], k4.shape[1]
    if ps != page_table.page_size:
        raise ValueError(
            f"page_table: page_size {page_table.page_size} does not match the cache's {ps} (layout {lay.kv_layout})"
        )
    page_table.validate(num_pages)
    return k4, v4


def _cache_scale(x, name, hkv):
    """A cache scale (None, a positive float or [Hkv] positive floats) as float64 [Hkv, 1] (broadcasts over a
    [kv, Hkv, D] request)."""
    if x is None:
        return np.ones((hkv, 1))
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 0:
        a = np.full(hkv, float(a))
    if a.shape != (hkv,):
        raise ValueError(f"{name}: expected a float or [{hkv}] (one per KV head), got shape {a.shape}")
    if not (np.isfinite(a).all() and (a > 0).all()):
        raise ValueError(f"{name}: scales must be positive and finite")
    return a[:, None]


def _fetch_paged(k4, v4, page_table, k_scale=None, v_scale=None):
    kv_lens = page_table.kv_lens
    ks, vs = _cache_scale(k_scale, "k_scale", k4.shape[2]), _cache_scale(v_scale, "v_scale", v4.shape[2])

    def fetch(i):
        pages = page_table.pages(i)
        n = int(kv_lens[i])
        kk = k4[pages].reshape((-1,) + k4.shape[2:])[:n]
        vv = v4[pages].reshape((-1,) + v4.shape[2:])[:n]
        return kk.astype(np.float64) * ks, vv.astype(np.float64) * vs

    return fetch


def batch_attention_paged(q, k_cache, v_cache, qo_indptr, page_table, *, kv_layout="NHD", causal=False,
                          sm_scale=None, window_left=-1, logits_soft_cap=0.0, alibi_slopes=None, sinks=None,
                          custom_mask=None, return_lse=False, k_scale=None, v_scale=None):
    """Batched attention with a paged KV cache (decode: every qo_len is 1).

    q: [qo_indptr[-1], Hq, D]; k_cache / v_cache: [num_pages, page_size, Hkv, D]
    ("NHD") or [num_pages, Hkv, page_size, D] ("HND"), any strides; v_cache=None
    means k_cache is [num_pages, 2, ...] (K then V).  qo_indptr: int [B+1];
    page_table: PageTable with B requests (page ids < num_pages);
    kv_layout: "NHD" / "HND" / PagedKVLayout.  custom_mask: flat bool
    [sum(qo_i * kv_i)] or a list of B bool [qo_i, kv_i].  Options as :func:`attention`.
    k_scale / v_scale: a quantised (e.g. fp8) cache holds k / k_scale and v / v_scale: None (1), a float or
    [Hkv] floats; the attention runs on the dequantised k_cache * k_scale, v_cache * v_scale.
    Returns o float64 [total_qo, Hq, Dv] (, lse float64 [total_qo, Hq]).
    """
    q = _v.as_float64(q, "q", ndim=3)
    k4, v4 = _paged_kv(k_cache, v_cache, page_table, kv_layout)
    _check_heads(q.shape, k4.shape, v4.shape, "q", "k_cache", "v_cache")
    qo_indptr = _v.as_indptr(qo_indptr, "qo_indptr", length=page_table.indptr.size, total=q.shape[0])
    opt = _opts(q.shape[1], q.shape[2], sm_scale, window_left, logits_soft_cap, alibi_slopes, sinks)
    return _batch(q, qo_indptr, page_table.kv_lens, _fetch_paged(k4, v4, page_table, k_scale, v_scale), v4.shape[3],
                  opt, bool(causal),
                  custom_mask, return_lse)


def block_sparse_attention(q, k, v, bsr, *, sm_scale=None, logits_soft_cap=0.0, return_lse=False):
    """Attention where query row r sees the columns of the blocks of its block row.

    q: [M, Hq, D]; k: [N, Hkv, D]; v: [N, Hkv, Dv]; bsr: BlockSparse of shape (M, N).
    No positional masks (a row's columns are a set).  Returns o [M, Hq, Dv] (, lse [M, Hq]).
    """
    from .formats import BlockSparse

    if not isinstance(bsr, BlockSparse):
        raise TypeError(f"bsr: expected a kvattn BlockSparse, got {type(bsr).__name__}")
    q, k, v = _check_qkv(q, k, v)
    if bsr.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"bsr: shape {bsr.shape} must be (q rows, kv rows) = {(q.shape[0], k.shape[0])}")
    opt = _opts(q.shape[1], q.shape[2], sm_scale, -1, logits_soft_cap, None)
    r = bsr.block_shape[0]
    outs, lses = [], []
    for br in range(bsr.num_block_rows):
        cols = bsr.columns(br)
        oi, li = _attend(q[br * r:(br + 1) * r], k[cols], v[cols], False, None, **opt)
        outs.append(oi)
        lses.append(li)
    o = np.concatenate(outs) if outs else np.zeros((0, q.shape[1], v.shape[2]))
    lse = np.concatenate(lses) if lses else np.zeros((0, q.shape[1]))
    return _ret(o, lse, return_lse)


def cascade_attention(q, k_cache, v_cache, levels, *, kv_layout="NHD", causal=False, sm_scale=None,
                      logits_soft_cap=0.0, return_lse=False):
    """Multi-level cascade attention: each level's groups attend to their pages,
    the per-level states are merged with merge_state.  Causal applies to the last level only.

    q: [total_qo, Hq, D]; caches as :func:`batch_attention_paged`; levels: CascadeLevels.
    Returns o [total_qo, Hq, Dv] (, lse [total_qo, Hq]).
    """
    from .formats import CascadeLevels

    if not isinstance(levels, CascadeLevels):
        raise TypeError(f"levels: expected a kvattn CascadeLevels, got {type(levels).__name__}")
    o = lse = None
    for li, (qo_indptr, pt) in enumerate(levels):
        last = li == len(levels) - 1
        oi, li_ = batch_attention_paged(q, k_cache, v_cache, qo_indptr, pt, kv_layout=kv_layout,
                                        causal=bool(causal) and last, sm_scale=sm_scale,
                                        logits_soft_cap=logits_soft_cap, return_lse=True)
        o, lse = (oi, li_) if o is None else _merge_axis1(np.stack([o, oi], 1), np.stack([lse, li_], 1))
    return _ret(o, lse, return_lse)


# ---------------------------------------------------------------------------
# cache append and RoPE
# ---------------------------------------------------------------------------
def batch_indices_positions(append_indptr, kv_lens):
    """For appended tokens ragged by append_indptr int [B+1] into requests whose new
    lengths are kv_lens int [B]: (batch_indices int32 [nnz], positions int32 [nnz]),
    position = kv_len - append_len + offset (FlashInfer get_batch_indices_positions)."""
    ind = _v.as_indptr(append_indptr, "append_indptr")
    kv = _v.as_index_array(kv_lens, "kv_lens", min_value=0).astype(np.int64)
    if kv.size != ind.size - 1:
        raise ValueError(f"kv_lens: expected {ind.size - 1} entries (batch_size), got {kv.size}")
    n = np.diff(ind).astype(np.int64)
    if (n > kv).any():
        i = int(np.argmax(n > kv))
        raise ValueError(f"kv_lens: request {i} appends {n[i]} tokens but its kv_len is only {kv[i]}")
    b = np.repeat(np.arange(n.size), n)
    pos = kv[b] - n[b] + (np.arange(int(ind[-1])) - ind[b])
    return b.astype(np.int32), pos.astype(np.int32)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache, page_table,
                          *, kv_layout="NHD"):
    """Write appended tokens into copies of the caches.

    append_key: [nnz, Hkv, D]; append_value: [nnz, Hkv, Dv]; batch_indices,
    positions: int [nnz] (token t goes to request batch_indices[t] at position
    positions[t] < kv_len, i.e. page indices[indptr[b] + pos // page_size], slot
    pos % page_size); caches as :func:`batch_attention_paged`; page_table is the
    table *after* the append.  Returns (k_cache_new, v_cache_new) in the caches'
    dtype; with v_cache=None returns (combined_new, None).
    """
    from .formats import PagedKVLayout

    ak = _v.as_float64(append_key, "append_key", ndim=3)
    av = _v.as_float64(append_value, "append_value", ndim=3)
    combined = v_cache is None
    lay = PagedKVLayout.of(kv_layout)
    out_k = np.array(k_cache, copy=True)
    out_v = None if combined else np.array(v_cache, copy=True)
    k4, v4 = _paged_kv(out_k, out_v, page_table, lay)  # NHD views into the copies
    if ak.shape[1:] != k4.shape[2:]:
        raise ValueError(f"append_key: expected [nnz, {k4.shape[2]}, {k4.shape[3]}], got {ak.shape}")
    if av.shape != ak.shape[:1] + v4.shape[2:]:
        raise ValueError(f"append_value: expected [{ak.shape[0]}, {v4.shape[2]}, {v4.shape[3]}], got {av.shape}")
    b = _v.as_index_array(batch_indices, "batch_indices", min_value=0)
    pos = _v.as_index_array(positions, "positions", min_value=0)
    for name, a in (("batch_indices", b), ("positions", pos)):
        if a.size != ak.shape[0]:
            raise ValueError(f"{name}: expected {ak.shape[0]} entries (one per appended token), got {a.size}")
    if b.size and b.max() >= page_table.batch_size:
        raise ValueError(f"batch_indices: must be < batch_size {page_table.batch_size}, got {int(b.max())}")
    kvl = page_table.kv_lens
    if (pos >= kvl[b]).any():
        t = int(np.argmax(pos >= kvl[b]))
        raise ValueError(f"positions: token {t} has position {int(pos[t])} >= kv_len {int(kvl[b[t]])} of request {int(b[t])}")
    ps = page_table.page_size
    page = page_table.indices[page_table.indptr[b] + pos // ps]
    slot = pos % ps
    k4[page, slot] = ak.astype(k4.dtype)
    v4[page, slot] = av.astype(v4.dtype)
    return out_k, out_v


def apply_rope(x, positions, *, rotary_dim=None, interleave=False, rope_scale=1.0, rope_theta=1e4):
    """Rotary embedding. x: [nnz, H, D]; positions: int [nnz].

    angle_i = (pos / rope_scale) * rope_theta ** (-2 i / rotary_dim), i < rotary_dim / 2.
    NeoX (default) rotates the halves (x[:r/2], x[r/2:r]); interleave=True
    rotates GPT-J pairs (x[2i], x[2i+1]).  Dims >= rotary_dim (default D) pass through.
    Returns float64 [nnz, H, D].
    """
    x = _v.as_float64(x, "x", ndim=3)
    pos = _v.as_index_array(positions, "positions")
    if pos.size != x.shape[0]:
        raise ValueError(f"positions: expected {x.shape[0]} entries (one per row of x), got {pos.size}")
    d = x.shape[2]
    rd = d if rotary_dim is None else _v.as_int(rotary_dim, "rotary_dim", min_value=0, max_value=d)
    if rd % 2:
        raise ValueError(f"rotary_dim: must be even, got {rd}")
    scale = _v.as_float(rope_scale, "rope_scale")
    theta = _v.as_float(rope_theta, "rope_theta")
    if scale <= 0 or theta <= 0:
        raise ValueError(f"rope_scale / rope_theta: must be > 0, got {scale} / {theta}")
    inv = theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd) if rd else np.zeros(0)
    ang = (pos.astype(np.float64) / scale)[:, None] * inv[None, :]  # [nnz, rd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if interleave:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = a * cos - b * sin
        out[..., 1:rd:2] = b * cos + a * sin
    else:
        h = rd // 2
        a, b = x[..., :h], x[..., h:rd]
        out[..., :h] = a * cos - b * sin
        out[..., h:rd] = b * cos + a * sin
    return out


__all__ = [
    "append_paged_kv_cache",
    "apply_rope",
    "attention",
    "batch_attention_paged",
    "batch_attention_ragged",
    "batch_indices_positions",
    "block_sparse_attention",
    "cascade_attention",
    "merge_state",
    "merge_states",
]
