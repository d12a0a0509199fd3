"""GPU tests of block-sparse attention against reference.block_sparse_attention: block shapes R, C in {1, 16, 64,
128} and odd ones, empty block rows, per-block masks, NHD / HND, per-KV-head patterns, poisoned outputs."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvattn
from kvattn import _dtypes, reference
from kvattn.formats import BlockSparse

from _gpu import assert_lse, poisoned, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
TOL = {"bfloat16": 1e-2, "float16": 2e-3}


def _bsr(rng, mb, nb, r, c, density):
    blocks = rng.random((mb, nb)) < density
    rows, cols = np.nonzero(blocks)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=mb))])
    return BlockSparse(indptr, cols, (r, c), (mb * r, nb * c))


def _ref_masked(q, k, v, bsr, mask):
    """float64 reference with per-block masks: a dense custom mask over each block row's columns."""
    r, c = bsr.block_shape
    outs, lses = [], []
    for i in range(bsr.num_block_rows):
        cols = bsr.columns(i)
        s, e = bsr.indptr[i], bsr.indptr[i + 1]
        m = mask[s:e].transpose(1, 0, 2).reshape(r, -1) if e > s else np.zeros((r, 0), bool)
        o, l = reference.attention(q[i * r:(i + 1) * r], k[cols], v[cols], custom_mask=m, return_lse=True)
        outs.append(o)
        lses.append(l)
    return np.concatenate(outs), np.concatenate(lses)


@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from([1, 16, 64, 128, 3]), st.sampled_from([1, 16, 64, 128, 5]), st.integers(1, 6),
       st.integers(1, 8), st.floats(0.0, 1.0), st.sampled_from([(2, 4, 128), (1, 8, 64), (4, 1, 128)]),
       st.sampled_from(["bfloat16", "float16"]), st.sampled_from(["NHD", "HND"]), st.booleans(),
       st.integers(0, 2**31))
def test_block_sparse_matches_reference(r, c, mb, nb, density, heads, dtype, layout, masked, seed):
    rng = np.random.default_rng(seed)
    hkv, group, d = heads
    hq = hkv * group
    bsr = _bsr(rng, mb, nb, r, c, density)
    m, n = bsr.shape
    npd = _dtypes.to_numpy(dtype)
    q = rng.standard_normal((m, hq, d)).astype(npd)
    k = rng.standard_normal((n, hkv, d)).astype(npd)
    v = rng.standard_normal((n, hkv, d)).astype(npd)
    mask = rng.random((bsr.nnz_blocks, r, c)) < 0.7 if masked else None
    w = kvattn.BlockSparseAttentionWrapper(kv_layout=layout)
    w.plan(bsr, hq, hkv, d, mask=mask, q_dtype=dtype)
    out, lse = poisoned((m, hq, d), dtype), poisoned((m, hq), "float32")
    kk, vv = (k, v) if layout == "NHD" else (np.ascontiguousarray(k.transpose(1, 0, 2)),
                                             np.ascontiguousarray(v.transpose(1, 0, 2)))
    w.run(kvattn.from_numpy(q), kvattn.from_numpy(kk), kvattn.from_numpy(vv), out=out, lse=lse)
    if masked:
        ro, rl = _ref_masked(q, k, v, bsr, mask)
    else:
        ro, rl = reference.block_sparse_attention(q, k, v, bsr, return_lse=True)
    assert rel_l2(out.numpy(), ro) <= TOL[dtype]
    assert_lse(lse.numpy(), rl, TOL[dtype])


def test_variable_block_sparse_per_head_patterns():
    rng = np.random.default_rng(9)
    hkv, group, d = 4, 2, 128
    hq = hkv * group
    shapes = [(64, 64), (16, 128), (1, 16), (128, 1)]
    m, n = 256, 512
    bsrs = [_bsr(rng, m // r, n // c, r, c, p) for (r, c), p in zip(shapes, (0.5, 0.2, 0.1, 0.05))]
    bf = _dtypes.to_numpy("bfloat16")
    q = rng.standard_normal((m, hq, d)).astype(bf)
    k = rng.standard_normal((n, hkv, d)).astype(bf)
    v = rng.standard_normal((n, hkv, d)).astype(bf)
    w = kvattn.VariableBlockSparseAttentionWrapper()
    w.plan(bsrs, hq, hkv, d)
    out, lse = poisoned((m, hq, d), "bfloat16"), poisoned((m, hq), "float32")
    w.run(q, k, v, out=out, lse=lse)
    for h in range(hkv):
        sl = slice(h * group, (h + 1) * group)
        ro, rl = reference.block_sparse_attention(q[:, sl], k[:, h:h + 1], v[:, h:h + 1], bsrs[h], return_lse=True)
        assert rel_l2(out.numpy()[:, sl], ro) <= 1e-2
        assert_lse(lse.numpy()[:, sl], rl, 1e-2)


def test_block_sparse_large_blocks_take_sm90():
    """The benchmark's shape, smaller: (64, 64) blocks at 50% density, 2048 x 2048."""
    rng = np.random.default_rng(2)
    bsr = _bsr(rng, 32, 32, 64, 64, 0.5)
    bf = _dtypes.to_numpy("bfloat16")
    q = rng.standard_normal((2048, 32, 128)).astype(bf)
    k = rng.standard_normal((2048, 8, 128)).astype(bf)
    v = rng.standard_normal((2048, 8, 128)).astype(bf)
    w = kvattn.BlockSparseAttentionWrapper()
    w.plan(bsr, 32, 8, 128)
    if kvattn._driver.arch() == "sm_90a":
        assert w.last_plan.info["backend"] == "sm90"
    o = w.run(q, k, v)
    assert rel_l2(o.numpy(), reference.block_sparse_attention(q, k, v, bsr)) <= 1e-2
