"""Every malformed input raises ValueError / TypeError naming the argument (one case per test)."""
import numpy as np
import pytest

from kvattn import reference as ref
from kvattn.formats import BlockSparse, CascadeLevels, PagedKVLayout, PageTable, Ragged, pack_mask, unpack_mask

R = np.random.default_rng(0)
Q = R.standard_normal((3, 4, 8))  # [qo, Hq, D]
K = R.standard_normal((5, 2, 8))  # [kv, Hkv, D]
V = R.standard_normal((5, 2, 8))
PT = PageTable([0, 2, 3], [4, 1, 0], [3, 2], page_size=4)  # kv_lens [7, 2]
KC = R.standard_normal((5, 4, 2, 8))  # NHD cache, 5 pages
QP = R.standard_normal((3, 4, 8))  # qo_indptr [0, 2, 3]
NAN = float("nan")

CASES = {
    # indptr
    "indptr_not_starting_at_0": (lambda: Ragged([3, 4, 5]), ValueError, r"indptr: must start at 0, got 3"),
    "indptr_decreasing": (lambda: Ragged([0, 4, 2]), ValueError, r"indptr: must be non-decreasing"),
    "indptr_empty": (lambda: Ragged([]), ValueError, r"indptr: must have at least one entry"),
    "indptr_2d": (lambda: Ragged([[0, 1]]), ValueError, r"indptr: expected a 1-D array"),
    "page_indptr_not_starting_at_0": (lambda: PageTable([1, 2], [0], [1], 4), ValueError, r"indptr: must start at 0"),
    "page_indices_length_vs_indptr": (lambda: PageTable([0, 2], [0], [1], 4), ValueError,
                                      r"indices: expected indptr\[-1\] = 2 page ids, got 1"),
    "last_page_len_length_vs_indptr": (lambda: PageTable([0, 1], [0], [1, 1], 4), ValueError,
                                       r"last_page_len: expected 1 entries"),
    "qo_indptr_length_vs_page_table": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 3], PT), ValueError,
                                       r"qo_indptr: expected 3 entries"),
    "qo_indptr_total_vs_q": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 1, 2], PT), ValueError,
                             r"qo_indptr: last entry must equal 3, got 2"),
    "qo_indptr_decreasing_batch": (lambda: ref.batch_attention_ragged(Q, K, V, [0, 3, 2, 3], [0, 1, 2, 5]),
                                   ValueError, r"qo_indptr: must be non-decreasing"),
    "kv_indptr_total_vs_k": (lambda: ref.batch_attention_ragged(Q, K, V, [0, 3], [0, 4]), ValueError,
                             r"kv_indptr: last entry must equal 5, got 4"),
    "kv_indptr_length_vs_qo_indptr": (lambda: ref.batch_attention_ragged(Q, K, V, [0, 3], [0, 1, 5]), ValueError,
                                      r"kv_indptr: expected 2 entries"),
    # page ids
    "page_id_negative": (lambda: PageTable([0, 2], [0, -1], [1], 4), ValueError, r"indices: page ids must be >= 0, got -1"),
    "page_id_too_large_validate": (lambda: PT.validate(4), ValueError, r"indices: page ids must be < num_pages = 4, got 4"),
    "page_id_too_large_for_cache": (lambda: ref.batch_attention_paged(QP, KC[:4], KC[:4], [0, 2, 3], PT), ValueError,
                                    r"indices: page ids must be < num_pages = 4"),
    # last_page_len
    "last_page_len_zero_with_pages": (lambda: PageTable([0, 1], [0], [0], 4), ValueError,
                                      r"last_page_len: must be in \[1, page_size\] = 4, got 0 for request 0"),
    "last_page_len_above_page_size": (lambda: PageTable([0, 1], [0], [5], 4), ValueError,
                                      r"last_page_len: must be in \[1, page_size\] = 4, got 5"),
    "last_page_len_bad_for_empty_request": (lambda: PageTable([0, 0], [], [9], 4), ValueError,
                                            r"last_page_len: must be in \[0, page_size\]"),
    # page_size
    "page_size_zero": (lambda: PageTable([0, 1], [0], [1], 0), ValueError, r"page_size: must be >= 1, got 0"),
    "page_size_not_int": (lambda: PageTable([0, 1], [0], [1], 4.0), TypeError, r"page_size: expected an int"),
    "page_size_mismatch_cache": (lambda: ref.batch_attention_paged(QP, KC[:, :2], KC[:, :2], [0, 2, 3], PT),
                                 ValueError, r"page_table: page_size 4 does not match the cache's 2"),
    "from_kv_lens_page_size_zero": (lambda: PageTable.from_kv_lens([3], 0), ValueError, r"page_size: must be >= 1"),
    "from_kv_lens_pool_too_small": (lambda: PageTable.from_kv_lens([9], 4, num_pages=2), ValueError,
                                    r"num_pages: the pool needs at least 3 pages"),
    "from_kv_lens_negative_len": (lambda: PageTable.from_kv_lens([3, -1], 4), ValueError, r"kv_lens: values must be >= 0"),
    # index kinds and widths
    "index_float_array": (lambda: PageTable([0.0, 1.0], [0], [1], 4), TypeError,
                          r"indptr: expected an integer array, got dtype float64"),
    "index_bool_array": (lambda: Ragged(np.array([False, True])), TypeError, r"indptr: expected an integer array"),
    "index_nan": (lambda: PageTable([0, 1], np.array([NAN]), [1], 4), TypeError, r"indices: .*NaN/Inf"),
    "index_inf": (lambda: Ragged(np.array([0, np.inf])), TypeError, r"indptr: .*NaN/Inf"),
    "index_exceeds_int32": (lambda: PageTable([0, 1], np.array([2**31], dtype=np.int64), [1], 4), ValueError,
                            r"indices: values must fit int32"),
    "index_uint64_exceeds_int32": (lambda: Ragged(np.array([0, 2**40], dtype=np.uint64)), ValueError,
                                   r"indptr: values must fit int32"),
    "index_strings": (lambda: Ragged(["0", "1"]), TypeError, r"indptr: expected an integer array"),
    # heads and dims
    "hq_not_multiple_of_hkv": (lambda: ref.attention(Q[:, :3], K, V), ValueError,
                               r"q: num_qo_heads 3 must be a multiple of num_kv_heads 2"),
    "hq_not_multiple_of_hkv_paged": (lambda: ref.batch_attention_paged(QP[:, :3], KC, KC, [0, 2, 3], PT), ValueError,
                                     r"q: num_qo_heads 3 must be a multiple of num_kv_heads 2 \(k_cache\)"),
    "head_dim_q_vs_k": (lambda: ref.attention(Q, K[..., :4], V), ValueError, r"k: head dim must equal q's 8, got 4"),
    "head_dim_q_vs_k_cache": (lambda: ref.batch_attention_paged(QP[..., :4], KC, KC, [0, 2, 3], PT), ValueError,
                              r"k_cache: head dim must equal q's 4, got 8"),
    "v_heads_vs_k": (lambda: ref.attention(Q, K, V[:, :1]), ValueError, r"v: num_kv_heads must equal k's 2, got 1"),
    "v_rows_vs_k": (lambda: ref.attention(Q, K, V[:4]), ValueError, r"v: expected 5 kv rows like k, got 4"),
    "q_not_3d": (lambda: ref.attention(Q[0], K, V), ValueError, r"q: expected a 3-D array"),
    "q_integer_data": (lambda: ref.attention(np.ones((3, 4, 8), int), K, V), TypeError,
                       r"q: expected a floating-point array"),
    # causal and masks
    "causal_kv_shorter_than_qo": (lambda: ref.attention(Q, K[:2], V[:2], causal=True), ValueError,
                                  r"causal: requires kv_len >= qo_len, got qo_len 3 > kv_len 2"),
    "causal_kv_shorter_than_qo_batch": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 0, 3], PT, causal=True),
                                        ValueError, r"causal: .*request 1 has qo_len 3 > kv_len 2"),
    "mask_length_single": (lambda: ref.attention(Q, K, V, custom_mask=np.ones(14, bool)), ValueError,
                           r"custom_mask: expected qo_len \* kv_len = 15 entries, got 14"),
    "mask_length_batch": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 2, 3], PT, custom_mask=np.ones(15, bool)),
                          ValueError, r"custom_mask: expected sum\(qo_len \* kv_len\) = 16 entries, got 15"),
    "mask_not_bool": (lambda: ref.attention(Q, K, V, custom_mask=np.ones((3, 5), np.uint8)), TypeError,
                      r"custom_mask: expected a bool array"),
    "mask_packed_passed_as_mask": (lambda: ref.attention(Q, K, V, custom_mask=np.zeros(2, np.uint8)), TypeError,
                                   r"custom_mask: expected a bool array \(unpack a bit-packed mask"),
    "mask_2d_wrong_shape": (lambda: ref.attention(Q, K, V, custom_mask=np.ones((5, 3), bool)), ValueError,
                            r"custom_mask: expected shape \(qo_len, kv_len\) = \(3, 5\), got \(5, 3\)"),
    "mask_list_wrong_total": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 2, 3], PT,
                                                                custom_mask=[np.ones((2, 7), bool)]), ValueError,
                              r"custom_mask: expected sum\(qo_len \* kv_len\) = 16 entries, got 14"),
    # options
    "window_left_below_minus_1": (lambda: ref.attention(Q, K, V, window_left=-2), ValueError, r"window_left: must be >= -1"),
    "soft_cap_negative": (lambda: ref.attention(Q, K, V, logits_soft_cap=-1.0), ValueError, r"logits_soft_cap: must be >= 0"),
    "sm_scale_not_number": (lambda: ref.attention(Q, K, V, sm_scale="x"), TypeError, r"sm_scale: expected a float"),
    "alibi_wrong_length": (lambda: ref.attention(Q, K, V, alibi_slopes=np.ones(3)), ValueError,
                           r"alibi_slopes: expected 4 slopes"),
    "kv_layout_unknown": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 2, 3], PT, kv_layout="NDH"), ValueError,
                          r"kv_layout: expected 'NHD' or 'HND', got 'NDH'"),
    "combined_cache_bad_shape": (lambda: ref.batch_attention_paged(QP, KC, None, [0, 2, 3], PT), ValueError,
                                 r"k_cache: with v_cache=None expected a combined"),
    "page_table_wrong_type": (lambda: ref.batch_attention_paged(QP, KC, KC, [0, 2, 3], "pt"), TypeError,
                              r"page_table: expected a kvattn PageTable"),
    # block sparse
    "bsr_shape_not_multiple": (lambda: BlockSparse([0, 0], [], (2, 2), (2, 3)), ValueError,
                               r"shape: N = 3 must be a multiple of C = 2"),
    "bsr_indptr_length": (lambda: BlockSparse([0, 0], [], (1, 1), (2, 2)), ValueError, r"indptr: expected 3 entries"),
    "bsr_column_out_of_range": (lambda: BlockSparse([0, 1], [2], (1, 2), (1, 4)), ValueError,
                                r"indices: block columns must be in \[0, 2\), got 2"),
    "bsr_duplicate_column": (lambda: BlockSparse([0, 2], [1, 1], (1, 1), (1, 2)), ValueError, r"indices: duplicate"),
    "bsr_shape_vs_q": (lambda: ref.block_sparse_attention(Q, K, V, BlockSparse([0, 0, 0], [], (1, 5), (2, 5))),
                       ValueError, r"bsr: shape \(2, 5\) must be"),
    # cascade
    "cascade_no_levels": (lambda: CascadeLevels([]), ValueError, r"levels: expected at least one"),
    "cascade_group_sizes_sum": (lambda: CascadeLevels.from_shared_prefixes([[0], [0]], [1, 1], [1, 1], 4, group_sizes=[1]),
                                ValueError, r"group_sizes: must sum to the batch size 2, got 1"),
    "cascade_page_list_vs_kv_len": (lambda: CascadeLevels.from_shared_prefixes([[0]], [9], [1], 4), ValueError,
                                    r"page_lists\[0\]: kv_len 9 needs 3 pages of 4, got 1"),
    # masks packing
    "pack_mask_indptr_total": (lambda: pack_mask(np.ones(10, bool), [0, 4, 9]), ValueError,
                               r"indptr: last entry must equal 10, got 9"),
    "pack_mask_flat_without_indptr": (lambda: pack_mask(np.ones(10, bool)), ValueError, r"indptr: required"),
    "pack_mask_not_bool": (lambda: pack_mask([np.ones((2, 2), int)]), TypeError, r"masks\[0\]: expected a bool array"),
    "unpack_mask_not_uint8": (lambda: unpack_mask(np.zeros(2, np.int8), [0, 2], [0, 9]), TypeError,
                              r"packed: expected a uint8 array"),
    "unpack_mask_bad_segments": (lambda: unpack_mask(np.zeros(2, np.uint8), [0, 2], [0, 3]), ValueError,
                                 r"mask_indptr: byte segments"),
    # merge, rope, append
    "merge_state_shape_mismatch": (lambda: ref.merge_state(np.zeros((2, 1, 3)), np.zeros((2, 1)), np.zeros((2, 1, 4)),
                                                           np.zeros((2, 1))), ValueError, r"o_b: shape must equal o_a's"),
    "merge_state_lse_shape": (lambda: ref.merge_state(np.zeros((2, 1, 3)), np.zeros((2, 2)), np.zeros((2, 1, 3)),
                                                      np.zeros((2, 1))), ValueError, r"lse_a: expected shape \(2, 1\)"),
    "merge_states_lse_shape": (lambda: ref.merge_states(np.zeros((2, 3, 1, 4)), np.zeros((2, 2, 1))), ValueError,
                               r"lse: expected shape \(2, 3, 1\)"),
    "rope_odd_rotary_dim": (lambda: ref.apply_rope(Q, [0, 1, 2], rotary_dim=3), ValueError, r"rotary_dim: must be even"),
    "rope_positions_length": (lambda: ref.apply_rope(Q, [0, 1]), ValueError, r"positions: expected 3 entries"),
    "rope_float_positions": (lambda: ref.apply_rope(Q, [0.5, 1, 2]), TypeError, r"positions: expected an integer array"),
    "append_position_beyond_kv_len": (lambda: ref.append_paged_kv_cache(K[:1], V[:1], [1], [2], KC, KC, PT), ValueError,
                                      r"positions: token 0 has position 2 >= kv_len 2 of request 1"),
    "append_batch_index_out_of_range": (lambda: ref.append_paged_kv_cache(K[:1], V[:1], [2], [0], KC, KC, PT),
                                        ValueError, r"batch_indices: must be < batch_size 2"),
    "append_indptr_longer_than_kv": (lambda: ref.batch_indices_positions([0, 3], [2]), ValueError,
                                     r"kv_lens: request 0 appends 3 tokens but its kv_len is only 2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_raises(case):
    fn, exc, match = CASES[case]
    with pytest.raises(exc, match=match):
        fn()


def test_other_integer_widths_are_converted():
    for dt in (np.int8, np.uint16, np.int64, np.uint64):
        pt = PageTable(np.array([0, 1], dt), np.array([3], dt), np.array([2], dt), np.int64(4))
        assert pt.indptr.dtype == pt.indices.dtype == pt.last_page_len.dtype == np.int32
        assert isinstance(pt.page_size, int) and pt.kv_lens.tolist() == [2]


def test_zero_page_request_accepts_any_last_page_len_in_range():
    for lpl in range(5):
        assert PageTable([0, 0, 1], [0], [lpl, 1], 4).kv_lens.tolist() == [0, 1]


def test_nan_and_inf_allowed_in_data():
    q = Q.copy()
    q[0, 0, 0] = np.inf
    ref.attention(q, K, V)  # no error: data are not checked for finiteness
    ref.batch_attention_paged(np.full_like(QP, NAN), KC, KC, [0, 2, 3], PT)


def test_layout_object_accepted_everywhere():
    hnd = PagedKVLayout("HND")
    o = ref.batch_attention_paged(QP, KC.transpose(0, 2, 1, 3), KC.transpose(0, 2, 1, 3), [0, 2, 3], PT, kv_layout=hnd)
    np.testing.assert_array_equal(o, ref.batch_attention_paged(QP, KC, KC, [0, 2, 3], PT))
