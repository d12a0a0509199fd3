"""CPU tests of block-sparse attention's host side: the per-block mask becomes the block rows' custom mask, and
plan() argument errors are raised before any GPU call."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import kvattn
from kvattn.block_sparse import _block_mask
from kvattn.formats import BlockSparse


@given(st.sampled_from([(1, 1), (2, 3), (4, 16)]), st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31))
def test_block_mask_is_the_dense_mask_of_each_block_row(block, mb, nb, seed):
    rng = np.random.default_rng(seed)
    r, c = block
    dense_blocks = rng.random((mb, nb)) < 0.5
    bsr = BlockSparse.from_dense_mask(np.repeat(np.repeat(dense_blocks, r, 0), c, 1), (r, c))
    mask = rng.random((bsr.nnz_blocks, r, c)) < 0.6
    flat = _block_mask(bsr, mask)
    # the dense [M, N] mask the blocks and their masks describe
    dense = np.zeros(bsr.shape, bool)
    for i in range(bsr.num_block_rows):
        for j, col in enumerate(bsr.indices[bsr.indptr[i]:bsr.indptr[i + 1]]):
            dense[i * r:(i + 1) * r, col * c:(col + 1) * c] = mask[bsr.indptr[i] + j]
    pos = 0
    for i in range(bsr.num_block_rows):
        cols = bsr.columns(i)
        want = dense[i * r:(i + 1) * r][:, cols]
        assert np.array_equal(flat[pos:pos + want.size].reshape(want.shape), want)
        pos += want.size
    assert pos == flat.size


def test_block_sparse_plan_errors():
    bsr = BlockSparse([0, 1, 2], [0, 1], (2, 4), (4, 8))
    w = kvattn.BlockSparseAttentionWrapper()
    with pytest.raises(TypeError, match="bsr: expected a kvattn.BlockSparse"):
        w.plan(np.zeros((4, 8), bool), 8, 2, 64)
    with pytest.raises(ValueError, match=r"mask: expected bool \[nnz_blocks, R, C\] = \[2, 2, 4\]"):
        w.plan(bsr, 8, 2, 64, mask=np.ones((2, 4, 2), bool))
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(bsr, 8, 2, 80)
    v = kvattn.VariableBlockSparseAttentionWrapper()
    with pytest.raises(ValueError, match="one BlockSparse per KV head"):
        v.plan([bsr], 8, 2, 64)
    with pytest.raises(ValueError, match=r"bsrs\[1\]: shape \(4, 16\) differs"):
        v.plan([bsr, BlockSparse([0, 0, 0], [], (2, 4), (4, 16))], 8, 2, 64)
