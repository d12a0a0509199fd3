"""The README's shared-prefix, block-sparse, mixed-batch and append examples with PyTorch tensors and CuPy arrays on
their default streams (no kvattn arrays, out=None), each checked against the float64 reference.

    PYTHONPATH=. python scripts/example_composable.py
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvattn  # noqa: E402
from kvattn import reference  # noqa: E402


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def shared_prefix(torch):
    """8 requests decoding one token each share a 1024-token prefix (64 pages of 16), then 32 tokens of their own."""
    prefix = np.arange(64)
    own = [np.arange(64 + 2 * i, 64 + 2 * (i + 1)) for i in range(8)]
    levels = kvattn.CascadeLevels.from_shared_prefixes([np.concatenate([prefix, o]) for o in own],
                                                      kv_lens=[1024 + 32] * 8, qo_lens=[1] * 8, page_size=16)
    k_cache = torch.randn(64 + 16, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(8, 32, 128, dtype=torch.bfloat16, device="cuda")
    w = kvattn.MultiLevelCascadeAttentionWrapper(num_levels=2)
    w.plan(levels, None, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    o = torch.from_dlpack(w.run(q, k_cache, v_cache))           # torch tensor, ordered on torch's stream
    ref = reference.cascade_attention(q.float().cpu().numpy(), k_cache.float().cpu().numpy(),
                                      v_cache.float().cpu().numpy(), levels)
    return rel(o.float().cpu().numpy(), ref)


def block_sparse(cp):
    rng = np.random.default_rng(0)
    blocks = rng.random((8, 16)) < 0.3                            # 8 x 16 blocks of 64 x 64, 30% stored
    bsr = kvattn.BlockSparse.from_dense_mask(np.repeat(np.repeat(blocks, 64, 0), 64, 1), (64, 64))
    q = cp.random.standard_normal((512, 32, 128), dtype=cp.float32).astype(cp.float16)
    k = cp.random.standard_normal((1024, 8, 128), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((1024, 8, 128), dtype=cp.float32).astype(cp.float16)
    w = kvattn.BlockSparseAttentionWrapper()
    w.plan(bsr, 32, 8, 128, q_dtype="float16")
    o = cp.asarray(w.run(q, k, v))                                # CuPy array, no copy
    ref = reference.block_sparse_attention(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), bsr)
    return rel(cp.asnumpy(o), ref)


def mixed_batch(cp):
    """A continuous-batching step: 2 prefills (one a chunked-prefill append) and 40 decodes, one launch."""
    rng = np.random.default_rng(2)
    qo = [300, 64] + [1] * 40
    pt = kvattn.PageTable.from_kv_lens([300, 500] + rng.integers(1, 2000, 40).tolist(), page_size=16, rng=3)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    k_cache = cp.random.standard_normal((pt.indices.size + 4, 16, 8, 128), dtype=cp.float32).astype(cp.float16)
    v_cache = cp.random.standard_normal(k_cache.shape, dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((int(qo_indptr[-1]), 32, 128), dtype=cp.float32).astype(cp.float16)
    w = kvattn.BatchMixedWithPagedKVCache()
    w.plan(qo_indptr, pt, 32, 8, 128, causal=True, q_dtype="float16")
    o = cp.asarray(w.run(q, k_cache, v_cache))                    # CuPy array on CuPy's stream
    ref = reference.batch_attention_paged(cp.asnumpy(q), cp.asnumpy(k_cache), cp.asnumpy(v_cache), qo_indptr, pt,
                                          causal=True)
    return rel(cp.asnumpy(o), ref), w.last_plan["fused"]


def append(torch):
    pt = kvattn.PageTable.from_kv_lens([40, 7, 300], page_size=16, num_pages=40, rng=1)
    append_indptr = np.array([0, 3, 4, 20], np.int32)             # 3, 1 and 16 new tokens (included in pt)
    k_cache = torch.randn(40, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(20, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_new = torch.randn_like(k_new)
    b, pos = kvattn.get_batch_indices_positions(append_indptr, pt)
    ref_k, ref_v = reference.append_paged_kv_cache(k_new.float().cpu().numpy(), v_new.float().cpu().numpy(), b, pos,
                                                   k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(), pt)
    dev = lambda a: torch.from_numpy(np.array(a, np.int32)).cuda()
    kvattn.append_paged_kv_cache(k_new, v_new, None, k_cache, v_cache, (dev(pt.indptr), dev(pt.indices),
                                 dev(pt.last_page_len)), batch_indices=dev(b), positions=dev(pos))
    same = np.array_equal(k_cache.float().cpu().numpy(), ref_k) and np.array_equal(v_cache.float().cpu().numpy(), ref_v)
    return 0.0 if same else 1.0


def main():
    import cupy as cp
    import torch
    mixed_err, fused = mixed_batch(cp)
    rows = [("cascade, torch tensors", shared_prefix(torch), 1e-2),
            ("block-sparse, CuPy arrays (float16)", block_sparse(cp), 2e-3),
            (f"mixed batch, CuPy arrays (float16, one launch: {fused})", mixed_err, 2e-3),
            ("append (device indices), torch tensors", append(torch), 0.0)]
    ok = True
    for name, err, tol in rows:
        ok &= err <= tol
        print(f"{name:42s} rel err {err:.1e} (bound {tol:g}) {'ok' if err <= tol else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
