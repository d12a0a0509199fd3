"""Every op's self-check for `python -m kvattn`; importing this registers every op's kernels."""
from __future__ import annotations

import numpy as np

from . import prefill, reference  # noqa: F401  (importing registers every op's kernels)
from .decode import BatchDecodeWithPagedKVCache
from .formats import PageTable
from .merge import merge_state, merge_states
from .memory import from_numpy
from .timing import time_us

BF16 = "bfloat16"


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def random_states(rng, shape, dtype):
    """(o, lse) with some -inf lse entries: o normal in dtype, lse uniform in [-5, 5]."""
    from ._dtypes import to_numpy
    o = rng.standard_normal(shape).astype(to_numpy(dtype))
    lse = rng.uniform(-5, 5, shape[:-1]).astype(np.float32)
    lse[rng.random(lse.shape) < 0.05] = -np.inf
    return o, lse


def merge_check(rng, rows=4096, n=4, heads=32, dim=128, dtype=BF16):
    o, lse = random_states(rng, (rows, n, heads, dim), dtype)
    od, ld = from_numpy(o), from_numpy(lse)
    out, lse_out = merge_states(od, ld)
    ref_o, ref_lse = reference.merge_states(o.astype(np.float64), lse.astype(np.float64))
    us = time_us(lambda: merge_states(od, ld, out=out, lse_out=lse_out))
    got = lse_out.numpy()
    fin = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(got[fin] - ref_lse[fin]), initial=0.0))
    if not np.array_equal(np.isneginf(got), ~fin):
        lse_err = float("inf")
    return [(f"merge_states {rows}x{n}x{heads}x{dim} {dtype}", rel_err(out.numpy(), ref_o), 1e-2, us),
            ("merge_states lse abs err", lse_err, 1e-3, None)]


def merge_pair_check(rng, rows=1000, heads=8, dim=64, dtype="float16"):
    oa, la = random_states(rng, (rows, heads, dim), dtype)
    ob, lb = random_states(rng, (rows, heads, dim), dtype)
    out, _ = merge_state(oa, la, ob, lb)
    ref, _ = reference.merge_state(oa.astype(np.float64), la, ob.astype(np.float64), lb)
    return [(f"merge_state {rows}x{heads}x{dim} {dtype}", rel_err(out.numpy(), ref), 2e-3, None)]


def decode_check(rng, lens=(4096,) * 16 + (300, 0, 9000), hq=32, hkv=8, dim=128, page=16, dtype=BF16):
    from ._dtypes import to_numpy
    lens = np.asarray(lens)
    pt = PageTable.from_kv_lens(lens, page, rng=rng)
    shape = (pt.num_pages_used, page, hkv, dim)
    k = rng.standard_normal(shape).astype(to_numpy(dtype))
    v = rng.standard_normal(shape).astype(to_numpy(dtype))
    q = rng.standard_normal((len(lens), hq, dim)).astype(to_numpy(dtype))
    kd, vd, qd = from_numpy(k), from_numpy(v), from_numpy(q)
    w = BatchDecodeWithPagedKVCache()
    w.plan(pt, hq, hkv, dim, q_dtype=dtype)
    out = w.run(qd, kd, vd)
    us = time_us(lambda: w.run(qd, kd, vd, out=out))
    ref = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1), pt)
    got = out.numpy()
    err = max(rel_err(got[i], ref[i]) if n else float(np.abs(got[i]).max()) for i, n in enumerate(lens))
    gbs = int(lens.sum()) * hkv * dim * 2 * k.itemsize / us / 1e3
    return [(f"decode b{len(lens)} Hq{hq} Hkv{hkv} D{dim} page{page} {dtype} ({gbs:.0f} GB/s)", err, 1e-2, us)]


def decode_variant_check(rng, lens=(3000, 17, 700), hq=32, hkv=4, dim=64, page=16):
    """Decode with built-in variants a GPT-OSS-like model uses: attention sinks and fused RoPE (theta 1.5e5),
    against the reference on pre-rotated q and k."""
    from ._dtypes import to_numpy
    from .variants import RoPE
    bf = to_numpy(BF16)
    pt = PageTable.from_kv_lens(np.asarray(lens), page, rng=rng)
    shape = (pt.num_pages_used, page, hkv, dim)
    k, v = rng.standard_normal(shape).astype(bf), rng.standard_normal(shape).astype(bf)
    q = rng.standard_normal((len(lens), hq, dim)).astype(bf)
    sinks, rope = rng.standard_normal(hq), RoPE(theta=1.5e5)
    qd, kd, vd = from_numpy(q), from_numpy(k), from_numpy(v)
    w = BatchDecodeWithPagedKVCache()
    w.plan(pt, hq, hkv, dim, sinks=sinks, rope=rope)
    out = w.run(qd, kd, vd)
    us = time_us(lambda: w.run(qd, kd, vd, out=out))
    got, err = out.numpy(), 0.0
    for i, n in enumerate(lens):
        ki = k[pt.pages(i)].reshape(-1, hkv, dim)[:n]
        vi = v[pt.pages(i)].reshape(-1, hkv, dim)[:n]
        qr = reference.apply_rope(q[i:i + 1], [n - 1], rope_theta=rope.theta)
        kr = reference.apply_rope(ki, np.arange(n), rope_theta=rope.theta)
        err = max(err, rel_err(got[i], reference.attention(qr, kr, vi, sinks=sinks)[0]))
    return [(f"decode b{len(lens)} Hq{hq} Hkv{hkv} D{dim} sinks + RoPE", err, 1e-2, us)]


def prefill_check(rng, qo=(512, 77, 300), kv=(512, 1200, 300), hq=32, hkv=8, dim=128, dtype=BF16):
    """Causal ragged prefill / append against the reference, every request in full."""
    from ._dtypes import to_numpy
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = rng.standard_normal((int(qo_indptr[-1]), hq, dim)).astype(to_numpy(dtype))
    k = rng.standard_normal((int(kv_indptr[-1]), hkv, dim)).astype(to_numpy(dtype))
    v = rng.standard_normal((int(kv_indptr[-1]), hkv, dim)).astype(to_numpy(dtype))
    qd, kd, vd = from_numpy(q), from_numpy(k), from_numpy(v)
    w = prefill.BatchPrefillWithRaggedKVCache()
    w.plan(qo_indptr, kv_indptr, hq, hkv, dim, causal=True, q_dtype=dtype)
    out = w.run(qd, kd, vd)
    us = time_us(lambda: w.run(qd, kd, vd, out=out))
    got = out.numpy()
    err = 0.0
    for i in range(len(qo)):
        qs, ks = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
        err = max(err, rel_err(got[qs], reference.attention(q[qs], k[ks], v[ks], causal=True)))
    pairs = sum(a * (b - a) + a * (a + 1) // 2 for a, b in zip(qo, kv))
    tf = 4 * hq * dim * pairs / us / 1e6
    kernel = f"{w.last_plan.info['backend']}/{w.last_plan.info['cta_rows']}"
    return [(f"prefill causal b{len(qo)} Hq{hq} Hkv{hkv} D{dim} {dtype} [{kernel}] ({tf:.1f} TFLOP/s)", err, 1e-2, us)]


def composable_checks(rng, hq=32, hkv=8, dim=128):
    """Cascade (a shared prefix + own suffixes), block-sparse and append against the reference."""
    from . import block_sparse, cascade, page
    from ._dtypes import to_numpy
    from .formats import BlockSparse, CascadeLevels
    bf = to_numpy(BF16)
    b, ps = 16, 16
    lists = [np.concatenate([np.arange(64), 64 + np.arange(2 * i, 2 * i + 2)]) for i in range(b)]
    levels = CascadeLevels.from_shared_prefixes(lists, kv_lens=[64 * ps + 20] * b, qo_lens=[1] * b, page_size=ps)
    kc = rng.standard_normal((64 + 2 * b, ps, hkv, dim)).astype(bf)
    vc = rng.standard_normal((64 + 2 * b, ps, hkv, dim)).astype(bf)
    q = rng.standard_normal((b, hq, dim)).astype(bf)
    qd, kd, vd = from_numpy(q), from_numpy(kc), from_numpy(vc)
    w = cascade.MultiLevelCascadeAttentionWrapper(2)
    w.plan(levels, None, hq, hkv, dim)
    out = w.run(qd, kd, vd)
    us = time_us(lambda: w.run(qd, kd, vd, out=out))
    rows = [(f"cascade b{b} prefix {64 * ps} + suffix 20, Hq{hq} Hkv{hkv} D{dim}",
             rel_err(out.numpy(), reference.cascade_attention(q, kc, vc, levels)), 1e-2, us)]
    blocks = rng.random((8, 8)) < 0.4
    bsr = BlockSparse.from_dense_mask(np.repeat(np.repeat(blocks, 64, 0), 64, 1), (64, 64))
    k = rng.standard_normal((512, hkv, dim)).astype(bf)
    v = rng.standard_normal((512, hkv, dim)).astype(bf)
    qb = rng.standard_normal((512, hq, dim)).astype(bf)
    bw = block_sparse.BlockSparseAttentionWrapper()
    bw.plan(bsr, hq, hkv, dim)
    qbd, kbd, vbd = from_numpy(qb), from_numpy(k), from_numpy(v)
    ob = bw.run(qbd, kbd, vbd)
    us = time_us(lambda: bw.run(qbd, kbd, vbd, out=ob))
    rows.append((f"block-sparse 512x512 (64, 64) blocks, {bsr.nnz_blocks} of 64",
                 rel_err(ob.numpy(), reference.block_sparse_attention(qb, k, v, bsr)), 1e-2, us))
    pt = levels[1][1]
    ind = np.concatenate([[0], np.cumsum(np.ones(b, np.int64))]).astype(np.int32)   # one new token each
    kn = rng.standard_normal((b, hkv, dim)).astype(bf)
    vn = rng.standard_normal((b, hkv, dim)).astype(bf)
    page.append_paged_kv_cache(kn, vn, ind, kd, vd, pt)
    bi, pos = reference.batch_indices_positions(ind, pt.kv_lens)
    rk, rv = reference.append_paged_kv_cache(kn, vn, bi, pos, kc, vc, pt)
    same = np.array_equal(kd.numpy().view(np.uint16), rk.view(np.uint16)) and \
        np.array_equal(vd.numpy().view(np.uint16), rv.view(np.uint16))
    rows.append((f"append_paged_kv_cache b{b} x 1 token (exact)", 0.0 if same else 1.0, 0.0, 0.0))
    return rows


def gpu_checks(rng):
    yield from merge_pair_check(rng)
    yield from merge_check(rng)
    yield from decode_check(rng)
    yield from decode_check(rng, lens=(700, 1, 33, 5000), hq=28, hkv=4, dim=64, page=1, dtype="float16")
    yield from decode_variant_check(rng)
    yield from prefill_check(rng)
    yield from prefill_check(rng, qo=(4, 4, 4, 1), kv=(500, 33, 4, 900), hq=16, hkv=4, dim=64, dtype="float16")
    yield from composable_checks(rng)


def reference_checks(rng):
    """Reference-only checks (no GPU): identities the float64 reference must satisfy on random data."""
    q = rng.standard_normal((3, 8, 64))
    k = rng.standard_normal((100, 2, 64))
    v = rng.standard_normal((100, 2, 64))
    o, lse = reference.attention(q, k, v, return_lse=True)
    o1, l1 = reference.attention(q, k[:37], v[:37], return_lse=True)
    o2, l2 = reference.attention(q, k[37:], v[37:], return_lse=True)
    om, lm = reference.merge_state(o1, l1, o2, l2)
    checks = [("split attention + merge_state == attention", float(max(np.abs(om - o).max(), np.abs(lm - lse).max())))]
    # causal == explicit bottom-right lower-triangular mask
    oc = reference.attention(q, k, v, causal=True)
    mask = np.arange(100)[None, :] <= (100 - 3 + np.arange(3))[:, None]
    checks.append(("causal == lower-triangular custom mask",
                   float(np.abs(oc - reference.attention(q, k, v, custom_mask=mask)).max())))
    # the same KV as a ragged tensor and as scattered pages
    lens = np.array([100, 0, 37])
    pt = PageTable.from_kv_lens(lens, 16, rng=rng)
    kc = rng.standard_normal((pt.num_pages_used, 16, 2, 64))
    vc = rng.standard_normal((pt.num_pages_used, 16, 2, 64))
    qd = rng.standard_normal((3, 8, 64))
    paged = reference.batch_attention_paged(qd, kc, vc, np.arange(4), pt)
    slots = [kc[pt.pages(i)].reshape(-1, 2, 64)[:n] for i, n in enumerate(lens)]
    vslots = [vc[pt.pages(i)].reshape(-1, 2, 64)[:n] for i, n in enumerate(lens)]
    ragged = reference.batch_attention_ragged(qd, np.concatenate(slots), np.concatenate(vslots), np.arange(4),
                                              np.concatenate([[0], np.cumsum(lens)]))
    checks.append(("paged == ragged (scattered pages)", float(np.abs(paged - ragged).max())))
    # attention sinks rescale each row by 1 / (1 + e^(sink - lse)), and move its lse to logaddexp(lse, sink)
    sinks = rng.standard_normal(8)
    os_, ls_ = reference.attention(q, k, v, sinks=sinks, return_lse=True)
    factor = 1.0 / (1.0 + np.exp(sinks[None, :] - lse))
    checks.append(("sinks == rescaled attention", float(max(np.abs(os_ - o * factor[..., None]).max(),
                                                            np.abs(ls_ - np.logaddexp(lse, sinks[None, :])).max()))))
    # RoPE is relative: shifting every position by the same offset leaves attention unchanged
    pq, pk = 97 + np.arange(3), np.arange(100)
    def roped(off):
        return reference.attention(reference.apply_rope(q, pq + off), reference.apply_rope(k, pk + off), v)
    checks.append(("RoPE attention is shift invariant", float(np.abs(roped(0) - roped(5000)).max())))
    # a cascade (shared prefix + own pages, merged) is the same attention as its flattened single level
    from .formats import BlockSparse, CascadeLevels
    lists = [np.concatenate([np.arange(6), 6 + np.arange(2 * i, 2 * i + 2)]) for i in range(4)]
    lv = CascadeLevels.from_shared_prefixes(lists, kv_lens=[123] * 4, qo_lens=[3] * 4, page_size=16)
    kc4 = rng.standard_normal((14, 16, 2, 64))
    vc4 = rng.standard_normal((14, 16, 2, 64))
    q4 = rng.standard_normal((12, 8, 64))
    qo_flat, flat = lv.flatten()
    checks.append(("cascade == its flattened page table (causal)", float(np.abs(
        reference.cascade_attention(q4, kc4, vc4, lv, causal=True) -
        reference.batch_attention_paged(q4, kc4, vc4, qo_flat, flat, causal=True)).max())))
    # block-sparse attention is attention under the dense mask of its blocks
    bsr = BlockSparse.from_dense_mask(np.repeat(np.repeat(rng.random((4, 5)) < 0.5, 3, 0), 20, 1), (3, 20))
    qb, kb, vb = rng.standard_normal((12, 8, 64)), rng.standard_normal((100, 2, 64)), rng.standard_normal((100, 2, 64))
    dense = np.concatenate([reference.attention(qb[i * 3:(i + 1) * 3], kb, vb, custom_mask=bsr.to_dense_mask()[i * 3:(i + 1) * 3])
                            for i in range(4)])
    checks.append(("block-sparse == attention under its dense block mask",
                   float(np.abs(reference.block_sparse_attention(qb, kb, vb, bsr) - dense).max())))
    return checks
