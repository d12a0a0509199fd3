"""Bad arguments to run() (and to the functions that launch at once: merges, page append) raise an error that
names the argument and says what was expected, before anything reaches the GPU: with the driver faked
(tests/_fake_driver.py), the failing call issues no launch, copy, memset or allocation. The GPU files check the
same errors on a GPU for a few cases; these run in CI on every op."""
import numpy as np
import pytest

from _fake_driver import fake_driver

import kvattn
from kvattn import _dtypes

HQ, HKV, D, PAGE = 8, 2, 64, 16
BF16 = _dtypes.to_numpy("bfloat16")
WORK = ("cuLaunchKernel", "cuLaunchKernelEx", "cuMemcpyHtoDAsync", "cuMemcpyDtoDAsync", "cuMemsetD8Async",
        "cuMemsetD32Async", "cuMemsetD2D32Async", "cuMemAllocFromPoolAsync", "cuMemcpyHtoD")
# (cuMemAlloc is not work here: the cases' own arrays, kvattn.empty, allocate inside the calls; run() never calls it,
# tests/test_host_path_cpu.py)


def empty(shape, dtype="bfloat16"):
    return kvattn.empty(shape, dtype)


def refused(calls, fn, exc, match):
    """fn() raises exc matching `match`, and no work reached the (fake) driver during the call."""
    n = len(calls)
    with pytest.raises(exc, match=match):
        fn()
    issued = [c for c in calls.names(n) if c in WORK]
    assert not issued, f"work issued before the error: {issued}"


@pytest.fixture
def calls():
    with fake_driver() as c:
        yield c


def _page_table(lens):
    return kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=np.random.default_rng(1))


def test_decode_run_errors(calls):
    pt = _page_table([100, 50])
    w = kvattn.BatchDecodeWithPagedKVCache()
    q, k = empty((2, HQ, D)), empty((pt.num_pages_used, PAGE, HKV, D))
    refused(calls, lambda: w.run(q, k, k), RuntimeError, "before plan")
    w.plan(pt, HQ, HKV, D)
    w.run(q, k, k)   # (the good call works)
    cases = [
        (lambda: w.run(empty((1, HQ, D)), k, k), ValueError, r"^q: expected shape \(2, 8, 64\)"),
        (lambda: w.run(empty((2, HQ, D), "float16"), k, k), TypeError, "^q: expected dtype bfloat16"),
        (lambda: w.run(q, k[:, :8], k[:, :8]), ValueError, r"^k_cache: expected shape \[num_pages, 16, 2, 64\]"),
        (lambda: w.run(q, k[:1], k[:1]), ValueError, "^k_cache: the page table uses page id .* cache holds 1 pages"),
        (lambda: w.run(q, k, empty(k.shape, "float16")), TypeError, "^v_cache: expected dtype bfloat16"),
        (lambda: w.run(q, k, k[:, :, :, :32]), ValueError, "^v_cache: expected shape"),
        (lambda: w.run(q, k, k, out=empty((2, HQ, D), "float16")), TypeError, "^out: expected dtype bfloat16"),
        (lambda: w.run(q, k, k, out=empty((3, HQ, D))), ValueError, r"^out: expected shape \(2, 8, 64\)"),
        (lambda: w.run(q, k, k, lse=empty((2, HQ), "float16")), TypeError, "^lse: expected dtype float32"),
        (lambda: w.run(q, k, k, k_scale=0.5), TypeError, "^k_scale: scales apply to an fp8 cache"),
        (lambda: w.run(q, k, k, stream="s"), TypeError, "^stream: expected None"),
        (lambda: w.run(q, k, k, stream=-3), ValueError, "^stream: a stream handle cannot be negative"),
        (lambda: w.run(q[:, :, 1:], k, k), ValueError, "^q: expected shape"),
        (lambda: w.run(object(), k, k), TypeError, "^array: expected a numpy array"),
    ]
    for fn, exc, match in cases:
        refused(calls, fn, exc, match)


def test_decode_run_alignment_and_layout_errors(calls):
    pt = _page_table([40])
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    base = empty((pt.num_pages_used * PAGE * HKV * D + 8,))
    k = base[1:1 + pt.num_pages_used * PAGE * HKV * D].reshape(pt.num_pages_used, PAGE, HKV, D)   # 2-byte offset
    good = empty((pt.num_pages_used, PAGE, HKV, D))
    q = empty((1, HQ, D))
    refused(calls, lambda: w.run(q, k, good), ValueError, "^k_cache: rows must be 16-byte aligned")
    strided = kvattn.DeviceArray(q.ptr, (1, HQ, D), "bfloat16", (HQ * D * 4, D * 4, 4))   # every other element
    refused(calls, lambda: w.run(strided, good, good), ValueError, "^q: the last axis must be contiguous")


def test_prefill_run_errors(calls):
    pt = _page_table([30, 70])
    qo = np.array([0, 5, 12], np.int32)
    paged = kvattn.BatchPrefillWithPagedKVCache()
    paged.plan(qo, pt, HQ, HKV, D, causal=True)
    ragged = kvattn.BatchPrefillWithRaggedKVCache()
    ragged.plan(qo, np.array([0, 30, 100], np.int32), HQ, HKV, D, causal=True)
    q, kp, kr = empty((12, HQ, D)), empty((pt.num_pages_used, PAGE, HKV, D)), empty((100, HKV, D))
    paged.run(q, kp, kp)
    ragged.run(q, kr, kr)
    cases = [
        (lambda: paged.run(empty((11, HQ, D)), kp, kp), ValueError, r"^q: expected shape \(12, 8, 64\)"),
        (lambda: paged.run(q, kp[:, :, :1], kp[:, :, :1]), ValueError, "^k_cache: expected shape"),
        (lambda: paged.run(q, kp[:1], kp[:1]), ValueError, "^k_cache: the page table uses page id"),
        (lambda: paged.run(q, kp, kp, out=empty((12, HQ, D), "float16")), TypeError, "^out: expected dtype"),
        (lambda: ragged.run(q, kr[:99], kr[:99]), ValueError, r"^k: expected shape \[100, 2, 64\] \(NHD\)"),
        (lambda: ragged.run(q, kr, empty((100, HKV, D), "float16")), TypeError, "^v: expected dtype bfloat16"),
        (lambda: ragged.run(q, kr, kr, lse=empty((12, HQ + 1), "float32")), ValueError, "^lse: expected shape"),
        (lambda: ragged.run(empty((12, HQ, D), "float32"), kr, kr), TypeError, "^q: expected dtype bfloat16"),
    ]
    for fn, exc, match in cases:
        refused(calls, fn, exc, match)


def test_block_sparse_and_cascade_run_errors(calls):
    bsr = kvattn.BlockSparse(np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), (16, 16), (32, 32))
    w = kvattn.BlockSparseAttentionWrapper()
    w.plan(bsr, HQ, HKV, D)
    q, k = empty((32, HQ, D)), empty((32, HKV, D))
    w.run(q, k, k)
    refused(calls, lambda: w.run(q, empty((31, HKV, D)), k), ValueError, "^k: expected shape")
    refused(calls, lambda: w.run(empty((32, HQ, D), "float16"), k, k), TypeError, "^q: expected dtype")
    shared, unique = _page_table([64]), _page_table([10, 20])
    c = kvattn.MultiLevelCascadeAttentionWrapper(2)
    c.plan([np.array([0, 2], np.int32), np.array([0, 1, 2], np.int32)], [shared, unique], HQ, HKV, D)
    pages = max(shared.num_pages_used, unique.num_pages_used)
    kc = empty((pages, PAGE, HKV, D))
    c.run(empty((2, HQ, D)), kc, kc)
    refused(calls, lambda: c.run(empty((3, HQ, D)), kc, kc), ValueError, "^q: expected shape")
    refused(calls, lambda: c.run(empty((2, HQ, D)), kc[:, :4], kc[:, :4]), ValueError, "^k_cache: expected shape")


def test_merge_and_append_errors(calls):
    o, lse = empty((4, HQ, D)), empty((4, HQ), "float32")
    kvattn.merge_state(o, lse, o, lse)
    refused(calls, lambda: kvattn.merge_state(o, lse, empty((4, HQ, D + 8)), lse), ValueError, "o_b|o_a")
    refused(calls, lambda: kvattn.merge_state(o, empty((4, HQ), "bfloat16"), o, lse), TypeError, "lse_a")
    refused(calls, lambda: kvattn.merge_states(empty((4, 3, HQ, D)), empty((4, 2, HQ), "float32")), ValueError,
            "lse")
    pt = _page_table([20, 3])
    kc = empty((pt.num_pages_used, PAGE, HKV, D))
    kn = empty((5, HKV, D))
    indptr = np.array([0, 3, 5], np.int32)
    kvattn.append_paged_kv_cache(kn, kn, indptr, kc, kc, pt)
    refused(calls, lambda: kvattn.append_paged_kv_cache(empty((5, HKV, D + 8)), kn, indptr, kc, kc, pt), ValueError,
            "k_new")
    refused(calls, lambda: kvattn.append_paged_kv_cache(kn, kn, indptr, kc[:1], kc[:1], pt), ValueError,
            r"page ids must be < num_pages \(the pages k_cache holds\) = 1")
    refused(calls, lambda: kvattn.append_paged_kv_cache(kn, kn, np.array([0, 3, 6], np.int32), kc, kc, pt),
            ValueError, "append_indptr")
