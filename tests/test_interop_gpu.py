"""GPU tests of the real-client boundary: torch / CuPy arrays in, the caller's streams, ordered outputs, graph capture
with framework arrays, the stream-ordered pool. Each check compares with the float64 reference."""
import os

import numpy as np
import pytest

import kvattn
from kvattn import _dtypes, pool, reference
from _gpu import POISON, rel_l2, requires_gpu
from _prefill_ref import request_ref

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch interop tests need it")
if kvattn.gpu_available() and not torch.cuda.is_available():
    pytest.skip("PyTorch cannot see the GPU", allow_module_level=True)
BF = _dtypes.to_numpy("bfloat16")
HQ, HKV, D, PAGE = 8, 2, 128, 16


def _torch(a: np.ndarray):
    """A CUDA torch tensor holding the numpy array a (bfloat16 through a uint16 view)."""
    if a.dtype == BF:
        return torch.from_numpy(a.view(np.uint16).astype(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def _numpy(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16).view(BF)
    return t.cpu().numpy()


def _decode_case(rng, lens, hq=HQ, hkv=HKV):
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=rng)
    shape = (pt.num_pages_used, PAGE, hkv, D)
    k = rng.standard_normal(shape).astype(BF)
    v = rng.standard_normal(shape).astype(BF)
    q = rng.standard_normal((len(lens), hq, D)).astype(BF)
    ref = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1), pt)
    return pt, q, k, v, ref


def _rel_rows(got, ref):
    return max(rel_l2(got[i], ref[i]) for i in range(ref.shape[0]))


@pytest.mark.parametrize("which", ["none", "legacy_handle", "per_thread", "torch_current_default", "created"])
def test_decode_torch_inputs_on_each_stream(which):
    rng = np.random.default_rng()
    pt, q, k, v, ref = _decode_case(rng, [300, 1000, 17])
    w = kvattn.BatchDecodeWithPagedKVCache()
    tq, tk, tv = _torch(q), _torch(k), _torch(v)
    side = torch.cuda.Stream()
    if which == "created":
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            w.plan(pt, HQ, HKV, D, stream=torch.cuda.current_stream())
            o = w.run(tq, tk, tv, stream=torch.cuda.current_stream())
            got = torch.from_dlpack(o).clone()   # on the side stream: ordered by __dlpack__(stream=side)
        torch.cuda.current_stream().wait_stream(side)
    else:
        stream = {"none": None, "legacy_handle": 0, "per_thread": 2,
                  "torch_current_default": torch.cuda.current_stream()}[which]
        w.plan(pt, HQ, HKV, D, stream=stream)
        o = w.run(tq, tk, tv, stream=stream)
        got = torch.from_dlpack(o).clone()
    assert _rel_rows(_numpy(got), ref) <= 1e-2


def test_prefill_torch_inputs_out_none_and_torch_out_returned():
    rng = np.random.default_rng()
    qo, kv = [37, 5, 130], [200, 5, 400]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = rng.standard_normal((qo_indptr[-1], HQ, D)).astype(BF)
    k = rng.standard_normal((kv_indptr[-1], HKV, D)).astype(BF)
    v = rng.standard_normal((kv_indptr[-1], HKV, D)).astype(BF)
    w = kvattn.BatchPrefillWithRaggedKVCache()
    w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True)
    tq, tk, tv = _torch(q), _torch(k), _torch(v)
    o, lse = w.run(tq, tk, tv, return_lse=True)            # kvattn arrays from the pool
    tout = torch.full((qo_indptr[-1], HQ, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    same = w.run(tq, tk, tv, out=tout)                     # the caller's tensor comes back as given
    assert same is tout
    for got in (_numpy(torch.from_dlpack(o)), _numpy(tout)):
        for i in range(3):
            rows = np.arange(qo[i])
            ro, _ = request_ref(q[qo_indptr[i]:qo_indptr[i + 1]], k[kv_indptr[i]:kv_indptr[i + 1]],
                                v[kv_indptr[i]:kv_indptr[i + 1]], rows, True, -1, 0.0, 1 / np.sqrt(D))
            assert rel_l2(got[qo_indptr[i]:qo_indptr[i + 1]], ro) <= 1e-2
    assert np.isfinite(_numpy(torch.from_dlpack(lse))).all()


def _long_decode(rng):
    """A decode of ~0.3-0.5 ms on the H200 (16 x 32768 tokens, 8 KV heads): long enough that an unordered read
    issued right after run() sees the poisoned output."""
    lens = [32768] * 16
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=rng)
    shape = (pt.num_pages_used, PAGE, 8, D)
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    q = torch.randn((16, 32, D), dtype=torch.bfloat16, device="cuda")
    w = kvattn.BatchDecodeWithPagedKVCache()
    s = kvattn.Stream()   # non-blocking: nothing but kvattn's export orders the consumer after it
    w.plan(pt, 32, 8, D, stream=s)
    torch.cuda.synchronize()
    return w, q, k, v, s


def _stale_reads(w, q, k, v, s, read, trials, honest=True):
    stale = 0
    for _ in range(trials):
        out = kvattn.empty((16, 32, D), "bfloat16")
        out.fill_bytes(POISON, s)
        w.run(q, k, v, out=out, stream=s)
        if not honest:
            out.stream = None   # claim readiness that was not established (the old bug)
        got = read(out)
        s.synchronize()
        torch.cuda.synchronize()
        stale += int(not np.isfinite(got).all())
    return stale


def test_poisoned_output_read_at_once_by_torch_and_cupy_is_never_stale():
    rng = np.random.default_rng()
    w, q, k, v, s = _long_decode(rng)

    def torch_read(out):   # torch's default stream, through DLPack
        return _numpy(torch.from_dlpack(out).clone())

    assert _stale_reads(w, q, k, v, s, torch_read, 100) == 0
    # The same test with the readiness claim of the old code must see stale reads: the test can fail.
    assert _stale_reads(w, q, k, v, s, torch_read, 10, honest=False) > 0, "the kernel is too short to show a race"
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")

    def cupy_read(out):    # CuPy's default stream, through __cuda_array_interface__ (v3 stream field)
        return cp.asarray(_U16View(out)).copy().get().view(BF)

    assert _stale_reads(w, q, k, v, s, cupy_read, 100) == 0


class _U16View:
    """A kvattn bf16 array seen as uint16 through CAI (CuPy has no bfloat16), keeping its stream field."""

    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        cai = dict(self.a.__cuda_array_interface__)
        cai["typestr"] = "<u2"
        return cai


def _capture(kind, fn):
    """Capture fn(stream) (after a warm-up) inside torch.cuda.graph or kvattn.graphs.capture on a created stream;
    returns replay(), which runs the graph and waits for it."""
    if kind == "torch":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up on a side stream, as torch asks
            fn(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(torch.cuda.current_stream())
        return lambda: (g.replay(), torch.cuda.synchronize())
    s = kvattn.Stream()
    fn(s)
    s.synchronize()
    with kvattn.graphs.capture(s) as cap:
        fn(s)
    return lambda: (cap.graph.replay(s), s.synchronize())


@pytest.mark.parametrize("kind", ["torch", "kvattn"])
def test_decode_capture_with_torch_tensors_replays_new_batches(kind):
    rng = np.random.default_rng()
    max_b, max_pages = 16, 2100
    k = rng.standard_normal((max_pages, PAGE, HKV, D)).astype(BF)
    v = rng.standard_normal((max_pages, PAGE, HKV, D)).astype(BF)
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=max_b, max_num_pages=max_pages)
    tk, tv = _torch(k), _torch(v)
    tq = torch.empty((max_b, HQ, D), dtype=torch.bfloat16, device="cuda")
    tout = torch.empty((max_b, HQ, D), dtype=torch.bfloat16, device="cuda")
    replay = None
    for batch in (9, 16, 3):
        lens = rng.integers(1, 2000, batch)
        pt = kvattn.PageTable.from_kv_lens(lens, PAGE, num_pages=max_pages, rng=rng)
        w.plan(pt, HQ, HKV, D)
        q = rng.standard_normal((max_b, HQ, D)).astype(BF)
        tq.copy_(_torch(q))
        torch.cuda.synchronize()
        if replay is None:
            replay = _capture(kind, lambda st: w.run(tq, tk, tv, out=tout, stream=st))
        tout.fill_(float("nan"))
        torch.cuda.synchronize()
        replay()
        ref = reference.batch_attention_paged(q[:batch], k, v, np.arange(batch + 1), pt)
        assert _rel_rows(_numpy(tout)[:batch], ref) <= 1e-2


@pytest.mark.parametrize("kind", ["torch", "kvattn"])
def test_prefill_capture_with_torch_tensors_replays_new_batches(kind):
    rng = np.random.default_rng()
    max_b, max_qo, kvmax = 4, 512, 3000
    k = rng.standard_normal((kvmax, HKV, D)).astype(BF)
    v = rng.standard_normal((kvmax, HKV, D)).astype(BF)
    tk, tv = _torch(k), _torch(v)
    tq = torch.empty((max_qo, HQ, D), dtype=torch.bfloat16, device="cuda")
    tout = torch.empty((max_qo, HQ, D), dtype=torch.bfloat16, device="cuda")
    w = kvattn.BatchPrefillWithRaggedKVCache(use_cuda_graph=True, max_batch_size=max_b, max_total_qo=max_qo)
    replay = None
    for qo, kvl in (([100, 30], [700, 30]), ([64, 64, 1, 200], [64, 900, 1, 1200]), ([7], [2000])):
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        kv_indptr = np.concatenate([[0], np.cumsum(kvl)]).astype(np.int32)
        total, n = int(qo_indptr[-1]), int(kv_indptr[-1])
        w.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True)
        q = rng.standard_normal((total, HQ, D)).astype(BF)
        tq[:total].copy_(_torch(q))
        torch.cuda.synchronize()
        if replay is None:   # captured once: later batches replay it (same pointers, new plan in device memory);
            # q / out keep max_total_qo rows (graph mode), the ragged K / V are this batch's rows of one buffer
            replay = _capture(kind, lambda st: w.run(tq, tk[:n], tv[:n], out=tout, stream=st))
        tout.fill_(float("nan"))
        torch.cuda.synchronize()
        replay()
        got = _numpy(tout)[:total]
        for i in range(len(qo)):
            rows = np.arange(qo[i])
            ro, _ = request_ref(q[qo_indptr[i]:qo_indptr[i + 1]], k[kv_indptr[i]:kv_indptr[i + 1]],
                                v[kv_indptr[i]:kv_indptr[i + 1]], rows, True, -1, 0.0, 1 / np.sqrt(D))
            assert rel_l2(got[qo_indptr[i]:qo_indptr[i + 1]], ro) <= 1e-2


def test_capture_refuses_implicit_output_and_legacy_stream():
    rng = np.random.default_rng()
    pt, q, k, v, _ = _decode_case(rng, [100])
    w = kvattn.BatchDecodeWithPagedKVCache()
    s = kvattn.Stream()
    w.plan(pt, HQ, HKV, D, stream=s)
    dq, dk, dv = kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v)
    with pytest.raises(kvattn.KvattnError, match="legacy default stream"):
        with kvattn.graphs.capture(None):
            pass
    with pytest.raises(kvattn.KvattnError, match="out: run.. is being captured"):
        with kvattn.graphs.capture(s):
            w.run(dq, dk, dv, stream=s)


def test_pool_memory_stays_flat_over_10000_runs():
    rng = np.random.default_rng()
    pt, q, k, v, ref = _decode_case(rng, [64, 200])
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    tq, tk, tv = _torch(q), _torch(k), _torch(v)
    for _ in range(100):
        o = w.run(tq, tk, tv, return_lse=True)
    torch.cuda.synchronize()
    _, reserved0 = pool.pool_usage()
    free0 = kvattn._driver.call("cuMemGetInfo")[0]
    for i in range(10_000):
        o, lse = w.run(tq, tk, tv, return_lse=True)
    torch.cuda.synchronize()
    _, reserved1 = pool.pool_usage()
    free1 = kvattn._driver.call("cuMemGetInfo")[0]
    assert reserved1 <= reserved0, f"kvattn's pool grew from {reserved0} to {reserved1} bytes"
    assert free0 - free1 <= 64 << 20, f"device free memory fell by {(free0 - free1) >> 20} MiB"
    assert _rel_rows(o.numpy(), ref) <= 1e-2


def test_cupy_inputs_float16():
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    rng = np.random.default_rng()
    lens = [500, 33]
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=rng)
    shape = (pt.num_pages_used, PAGE, HKV, D)
    k, v = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((2, HQ, D)).astype(np.float16)
    ref = reference.batch_attention_paged(q, k, v, np.arange(3), pt)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D, q_dtype="float16")
    o = w.run(cp.asarray(q), cp.asarray(k), cp.asarray(v))
    got = cp.asarray(o).get()
    assert _rel_rows(got, ref) <= 2e-3


def test_cupy_inputs_written_on_cupy_stream_are_waited_for():
    """CuPy arrays whose last write is still queued on CuPy's current (created) stream behind a long kernel: run()
    on the legacy stream (stream=None) waits for that stream, 20 trials against the reference."""
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    rng = np.random.default_rng()
    pt = kvattn.PageTable.from_kv_lens(np.asarray([900, 2048]), PAGE, rng=rng)
    k, v = (rng.standard_normal((pt.num_pages_used, PAGE, HKV, D)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((2, HQ, D)).astype(np.float16)
    ref = reference.batch_attention_paged(q, k, v, np.arange(3), pt)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D, q_dtype="float16")
    ck, cv = cp.asarray(k), cp.asarray(v)
    cq_src, big = cp.asarray(q), cp.ones((4096, 4096), cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    for trial in range(20):
        cq = cp.zeros_like(cq_src)
        cp.cuda.Device().synchronize()
        with side:
            for _ in range(4):
                big = big @ big * np.float32(1e-4)   # ~ms of work queued before the copy
            cq[...] = cq_src
            o = w.run(cq, ck, cv)
        assert _rel_rows(o.numpy(), ref) <= 1e-2, f"trial {trial}: run() read q before CuPy's stream wrote it"


def _framework_inputs(kind, q, k, v):
    """(q, k, v) as CuPy or JAX bfloat16 arrays on the GPU (views of torch tensors holding the data)."""
    tq, tk, tv = _torch(q), _torch(k), _torch(v)
    torch.cuda.synchronize()
    if kind == "cupy":
        cp = pytest.importorskip("cupy", reason="CuPy is not installed")
        return tuple(cp.from_dlpack(t) for t in (tq, tk, tv)), (tq, tk, tv)
    jax_dlpack = pytest.importorskip("jax.dlpack", reason="JAX is not installed")
    try:
        arrays = tuple(jax_dlpack.from_dlpack(t) for t in (tq, tk, tv))
    except Exception as exc:   # a JAX without a GPU backend
        pytest.skip(f"JAX cannot view CUDA tensors here: {exc.__class__.__name__}: {exc}")
    return arrays, (tq, tk, tv)


@pytest.mark.parametrize("kind", ["cupy", "jax"])
def test_decode_and_prefill_with_bfloat16_framework_arrays(kind):
    """CuPy (bfloat16 through __cuda_array_interface__ and the array's numpy dtype) and JAX (computed arrays through
    their buffer pointer) in, out=None, against the reference."""
    rng = np.random.default_rng()
    pt, q, k, v, ref = _decode_case(rng, [700, 33, 2048])
    (fq, fk, fv), keep = _framework_inputs(kind, q, k, v)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    assert _rel_rows(w.run(fq, fk, fv).numpy(), ref) <= 1e-2
    qo = np.array([0, 40, 41], np.int32)
    kvp = np.array([0, 300, 301], np.int32)
    qp = rng.standard_normal((41, HQ, D)).astype(BF)
    kp, vp = (rng.standard_normal((301, HKV, D)).astype(BF) for _ in range(2))
    (fq, fk, fv), keep2 = _framework_inputs(kind, qp, kp, vp)
    p = kvattn.BatchPrefillWithRaggedKVCache()
    p.plan(qo, kvp, HQ, HKV, D, causal=True)
    got = p.run(fq, fk, fv).numpy()
    for i in range(2):
        ro, _ = request_ref(qp[qo[i]:qo[i + 1]], kp[kvp[i]:kvp[i + 1]], vp[kvp[i]:kvp[i + 1]], np.arange(qo[i + 1] - qo[i]),
                            True, -1, 0.0, 1 / np.sqrt(D))
        assert rel_l2(got[qo[i]:qo[i + 1]], ro) <= 1e-2
