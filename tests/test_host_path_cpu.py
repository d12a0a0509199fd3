"""CPU tests of what one run() asks of the driver (the driver faked: tests/_fake_driver.py): the plan's launches
and one context query, nothing that allocates, copies or synchronises; out=None takes a block from the pool's free
list once one has been freed on that stream; a torch-free run() on kvattn arrays never reads the device's
attributes again. A slower host path shows up here as a new call before it shows up as microseconds."""
import numpy as np
import pytest

from _fake_driver import fake_driver

import kvattn

HQ, HKV, D, PAGE = 32, 8, 128, 16
SYNCING = {"cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemAlloc", "cuMemFree",
           "cuMemcpyHtoD", "cuMemcpyDtoH", "cuMemcpyHtoDAsync", "cuMemHostAlloc", "cuDeviceGetAttribute",
           "cuModuleLoadData", "cuStreamCreate", "cuEventCreate"}


def _decode(lens):
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=np.random.default_rng(0))
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    k = kvattn.empty((pt.num_pages_used, PAGE, HKV, D), "bfloat16")
    return w, kvattn.empty((len(lens), HQ, D), "bfloat16"), k, kvattn.empty(k.shape, "bfloat16")


def _ragged_prefill(qo, kv, causal=True):
    w = kvattn.BatchPrefillWithRaggedKVCache()
    w.plan(np.cumsum([0] + qo), np.cumsum([0] + kv), HQ, HKV, D, causal=causal)
    q = kvattn.empty((sum(qo), HQ, D), "bfloat16")
    k = kvattn.empty((sum(kv), HKV, D), "bfloat16")
    return w, q, k, kvattn.empty(k.shape, "bfloat16")


@pytest.mark.parametrize("make", [lambda: _decode([2048]), lambda: _decode([300, 5000, 17, 4096]),
                                  lambda: _ragged_prefill([2048] * 8, [2048] * 8),
                                  lambda: _ragged_prefill([1, 700], [9000, 700], causal=False)],
                         ids=["decode_b1", "decode_split", "prefill_b8", "prefill_split"])
def test_run_issues_only_its_launches(make):
    with fake_driver() as calls:
        w, q, k, v = make()
        out = kvattn.empty(q.shape, "bfloat16")
        w.run(q, k, v, out=out)   # first run: tensor maps encoded for these pointers
        p = w.last_plan
        launches = ["cuLaunchKernelEx" if launch._config is not None else "cuLaunchKernel"
                    for launch in p.launches + ((p.merge,) if p.merge is not None else ())]
        for _ in range(3):
            n = len(calls)
            w.run(q, k, v, out=out)
            assert calls.names(n) == ["cuCtxGetCurrent"] + launches
        n = len(calls)
        w.run(q, k, v)   # out=None: one pool allocation ...
        first = calls.names(n)
        assert [c for c in first if c.startswith("cuMemAlloc")] == ["cuMemAllocFromPoolAsync"]
        later = []
        for _ in range(3):   # ... then the freed block again, with no driver call
            n = len(calls)
            w.run(q, k, v)
            later.append(calls.names(n))
        assert all(c == ["cuCtxGetCurrent"] + launches for c in later), later
        assert not SYNCING & set(first)


def test_run_on_another_stream_waits_for_the_plan_copy_once_per_call():
    with fake_driver() as calls:
        w, q, k, v = _decode([2048])
        out = kvattn.empty(q.shape, "bfloat16")
        s = kvattn.Stream()
        n = len(calls)
        w.run(q, k, v, out=out, stream=s)
        names = calls.names(n)
        assert names.count("cuStreamWaitEvent") == 1 and "cuStreamIsCapturing" in names
        assert not SYNCING & set(names)


def test_run_inside_a_capture_adds_no_cross_stream_wait_and_refuses_implicit_outputs():
    """While the stream captures, run() records only its launches (no wait for the plan's copy, which is ordered
    before the capture), and out=None / return_lse without lse raise naming the argument before any launch."""
    with fake_driver() as calls:
        w, q, k, v = _decode([300, 5000])
        out, lse = kvattn.empty(q.shape, "bfloat16"), kvattn.empty(q.shape[:2], "float32")
        s = kvattn.Stream()
        driver = kvattn._driver.driver()
        driver.capturing.add(s.ptr)
        p = w.last_plan
        launches = ["cuLaunchKernelEx" if launch._config is not None else "cuLaunchKernel"
                    for launch in p.launches + ((p.merge,) if p.merge is not None else ())]
        n = len(calls)
        w.run(q, k, v, out=out, lse=lse, stream=s)
        assert calls.names(n) == ["cuCtxGetCurrent", "cuStreamIsCapturing"] + launches
        for kwargs, name in ((dict(), "out"), (dict(out=out, return_lse=True), "lse")):
            n = len(calls)
            with pytest.raises(kvattn.KvattnError, match=f"^{name}: run\\(\\) is being captured"):
                w.run(q, k, v, stream=s, **kwargs)
            assert not [c for c in calls.names(n) if c.startswith("cuLaunch") or c.startswith("cuMem")]


def test_cross_stream_ordering_uses_an_event_per_thread():
    """order_after records an event and waits on it in two driver calls (the GIL is released between them): two
    threads sharing one event could each wait on the other's record. Each thread records its own."""
    import threading
    from kvattn import stream as st
    with fake_driver() as calls:
        a, b = kvattn.Stream(), kvattn.Stream()
        st.order_after(a.ptr, b)
        worker = threading.Thread(target=lambda: st.order_after(a.ptr, b))
        worker.start()
        worker.join()
        st.order_after(a.ptr, b)
        events = [int(args[0]) for name, args in calls if name == "cuEventRecord"]
        assert len(events) == 3 and events[0] == events[2] != events[1]


def test_a_plan_that_fails_after_rewriting_the_workspace_leaves_no_plan(monkeypatch):
    """plan() copies its work lists over the previous plan's before it finishes: if it then fails (a variant's merge
    kernel that does not compile, say), run() must refuse rather than launch the old plan over the new lists."""
    from kvattn import opcore
    with fake_driver() as calls:
        w, q, k, v = _decode([300, 5000])
        w.run(q, k, v)

        def broken(*args, **kwargs):
            raise RuntimeError("merge kernel: compile error")
        monkeypatch.setattr(opcore.AttentionOp, "_merge_launch", staticmethod(broken))
        pt = kvattn.PageTable.from_kv_lens(np.array([9000, 17]), PAGE, rng=np.random.default_rng(0))
        with pytest.raises(RuntimeError, match="compile error"):
            w.plan(pt, HQ, HKV, D)
        n = len(calls)
        with pytest.raises(RuntimeError, match="before plan"):
            w.run(q, k, v)
        assert not [c for c in calls.names(n) if c.startswith("cuLaunch")]


def test_fp8_expansion_launches_after_every_check_and_after_the_plan_copy():
    """A prefill plan that expands its fp8 cache once per call: a bad q raises before the expansion launches, and
    run() on another stream than plan()'s waits for the plan's copy (the expansion reads its page lists) before
    the expansion (it launched first, unordered, before)."""
    with fake_driver() as calls:
        w = kvattn.BatchPrefillWithRaggedKVCache()
        w.fp8_expand = "once"
        indptr = np.array([0, 2048, 4096], np.int32)
        w.plan(indptr, indptr, HQ, HKV, D, causal=True, kv_dtype="float8_e4m3fn")
        assert w._fp8 is not None
        q = kvattn.empty((4096, HQ, D), "bfloat16")
        k = kvattn.empty((4096, HKV, D), "float8_e4m3fn")
        n = len(calls)
        with pytest.raises(ValueError, match="^out: expected shape"):
            w.run(q, k, k, out=kvattn.empty((4095, HQ, D), "bfloat16"))
        assert not [c for c in calls.names(n) if c.startswith("cuLaunch")]
        s = kvattn.Stream()
        n = len(calls)
        w.run(q, k, k, stream=s)
        names = calls.names(n)
        first_launch = next(i for i, c in enumerate(names) if c.startswith("cuLaunch"))
        assert "cuStreamWaitEvent" in names[:first_launch]
        assert int(calls[n + first_launch][1][0]) == int(w._fp8._launch.kernel.function)


def test_context_parallel_decode_run_keeps_its_buffers():
    """ContextParallelDecode.run() (a fake two-rank communicator): the all-gather buffers are allocated once and
    kept (a cuMemAlloc / cuMemFree pair per run synchronised the device: run 20g), each run gathers o and lse on
    the caller's stream and merges, with no synchronising call."""
    from kvattn.cp import ContextParallelDecode

    class Comm:
        rank, nranks = 0, 2

        def __init__(self):
            self.gathers = []

        def allgather(self, send, recv, stream):
            self.gathers.append((send.shape, recv.shape, stream))

    with fake_driver() as calls:
        comm = Comm()
        cp = ContextParallelDecode(comm)
        pt = kvattn.PageTable.from_kv_lens(np.array([3000, 700]), PAGE, rng=np.random.default_rng(0))
        shards = cp.plan(pt, HQ, HKV, D)
        local = shards.tables[0]
        k = kvattn.empty((max(local.num_pages_used, 1), PAGE, HKV, D), "bfloat16")
        q = kvattn.empty((2, HQ, D), "bfloat16")
        s = kvattn.Stream()
        cp.run(q, k, k, stream=s)
        n = len(calls)
        for _ in range(3):
            o, lse = cp.run(q, k, k, stream=s)
        names = calls.names(n)
        assert not SYNCING & set(names) and "cuMemFree" not in names, names
        assert o.shape == (2, HQ, D) and lse.shape == (2, HQ) and len(comm.gathers) == 8
        assert all(g[2] == s.ptr and g[1][0] == 2 for g in comm.gathers)
