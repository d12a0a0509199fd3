"""CPU tests of ops on a second GPU, with the driver faked as two GPUs (tests/_fake_driver.py: device d's primary
context is its own, pushed and popped on one context stack): an op built with device=1, called from a thread whose
current context is GPU 0's, loads its kernels, allocates its workspace and pool outputs, copies its plan and
launches with GPU 1's context current, and leaves GPU 0's current after every call; an op on GPU 0 in the same
process keeps its own kernels. On the one-GPU machines the GPU files could only test device 0."""
import numpy as np

from _fake_driver import CONTEXT, fake_driver

import kvattn
from kvattn import pool

HQ, HKV, D, PAGE = 8, 2, 64, 16


def _arrays(pt, batch):
    k = kvattn.empty((pt.num_pages_used, PAGE, HKV, D), "bfloat16")
    return kvattn.empty((batch, HQ, D), "bfloat16"), k, kvattn.empty(k.shape, "bfloat16")


def test_an_op_on_gpu_1_works_in_gpu_1s_context_and_restores_the_callers():
    with fake_driver() as calls:
        drv = kvattn._driver.driver()
        drv.device_count = 2
        kvattn._driver.ensure_context()                    # the thread: GPU 0's primary context
        ctx0, ctx1 = CONTEXT, CONTEXT + 1
        assert drv._current_ctx() == ctx0
        pt = kvattn.PageTable.from_kv_lens(np.array([700, 5000]), PAGE, rng=np.random.default_rng(0))
        q, k, v = _arrays(pt, 2)
        w1 = kvattn.BatchDecodeWithPagedKVCache(device=1)
        n = len(calls)
        w1.plan(pt, HQ, HKV, D)
        out = w1.run(q, k, v)                              # out=None: GPU 1's pool
        names, where = calls.names(n), calls.contexts[n:]
        assert drv._current_ctx() == ctx0 and drv.ctx_stack == [ctx0]
        work = {"cuModuleLoadData", "cuMemAlloc", "cuMemcpyHtoDAsync", "cuLaunchKernel", "cuLaunchKernelEx",
                "cuMemPoolCreate", "cuMemAllocFromPoolAsync", "cuEventRecord", "cuStreamWaitEvent"}
        done = [(name, ctx) for name, ctx in zip(names, where) if name in work]
        assert {"cuModuleLoadData", "cuMemAlloc", "cuMemcpyHtoDAsync", "cuMemPoolCreate"} <= {x for x, _ in done}
        assert any(x.startswith("cuLaunchKernel") for x, _ in done)
        assert all(ctx == ctx1 for _, ctx in done), done
        assert names.count("cuCtxPushCurrent") == names.count("cuCtxPopCurrent") >= 2   # plan() and run()
        props = next(args[0] for name, args in calls[n:] if name == "cuMemPoolCreate")
        assert props.location.id == 1 and 1 in pool._pools and out.owner.device == 1
        assert w1.device.ordinal == 1 and w1.num_sms == 132

        w0 = kvattn.BatchDecodeWithPagedKVCache()          # the current context's GPU: 0, no push
        n = len(calls)
        w0.plan(pt, HQ, HKV, D)
        w0.run(q, k, v, out=kvattn.empty(q.shape, "bfloat16"))
        names, where = calls.names(n), calls.contexts[n:]
        assert "cuCtxPushCurrent" not in names and w0.device.ordinal == 0
        loads = [ctx for name, ctx in zip(names, where) if name == "cuModuleLoadData"]
        assert loads and set(loads) == {ctx0}              # GPU 0 loads its own copy of the kernels
        assert all(ctx == ctx0 for name, ctx in zip(names, where) if name.startswith("cuLaunchKernel"))


def test_prefill_on_gpu_1_from_a_thread_with_no_context():
    """A thread with no current context: kvattn's first driver call gives it GPU 0's primary context (the CUDA
    runtime's lazy default); the op on GPU 1 pushes GPU 1's context around its calls and leaves GPU 0's current."""
    with fake_driver() as calls:
        drv = kvattn._driver.driver()
        drv.device_count = 2
        w = kvattn.BatchPrefillWithRaggedKVCache(device=1)
        indptr = np.array([0, 300, 500], np.int32)
        n = len(calls)
        w.plan(indptr, indptr, HQ, HKV, D, causal=True)
        q = kvattn.empty((500, HQ, D), "bfloat16")
        kk = kvattn.empty((500, HKV, D), "bfloat16")
        w.run(q, kk, kk, out=kvattn.empty(q.shape, "bfloat16"))
        launches = [ctx for name, ctx in zip(calls.names(n), calls.contexts[n:]) if name.startswith("cuLaunch")]
        assert launches and set(launches) == {CONTEXT + 1}
        assert drv._current_ctx() == CONTEXT               # the thread's own context again (GPU 0's default)


def _two_gpus(calls):
    drv = kvattn._driver.driver()
    drv.device_count = 2
    kvattn._driver.ensure_context()   # the thread: GPU 0's primary context
    return drv


def _assert_work_on_gpu_1(calls, n):
    """Since call n: some launch, and every module load, allocation, copy and launch under GPU 1's context."""
    work = ("cuModuleLoadData", "cuMemAlloc", "cuMemcpyHtoDAsync", "cuLaunchKernel", "cuMemPoolCreate",
            "cuMemAllocFromPoolAsync")
    done = [(name, ctx) for name, ctx in zip(calls.names(n), calls.contexts[n:]) if name.startswith(work)]
    assert any(name.startswith("cuLaunchKernel") for name, _ in done)
    assert all(ctx == CONTEXT + 1 for _, ctx in done), done


def test_mixed_batch_on_gpu_1():
    """The mixed op's one launch (its own kernel, loaded at plan()) is GPU 1's."""
    with fake_driver() as calls:
        drv = _two_gpus(calls)
        pt = kvattn.PageTable.from_kv_lens(np.array([3000, 3000, 900, 900, 900]), PAGE, rng=np.random.default_rng(0))
        qo = np.array([0, 1500, 3000, 3001, 3002, 3003], np.int32)
        w = kvattn.BatchMixedWithPagedKVCache(device=1)
        k = kvattn.empty((pt.num_pages_used, PAGE, HKV, D), "bfloat16")   # (the test's arrays: allocated first)
        q = kvattn.empty((3003, HQ, D), "bfloat16")
        n = len(calls)
        w.plan(qo, pt, HQ, HKV, D, causal=True, prefill_sms=66)   # (a forced split: the one launch is built)
        assert w.last_plan["fused"]
        w.run(q, k, k)
        _assert_work_on_gpu_1(calls, n)
        assert drv._current_ctx() == CONTEXT


def test_variable_block_sparse_on_gpu_1():
    """The per-head wrapper's implicit output comes from GPU 1's pool, and every head's launch is GPU 1's."""
    with fake_driver() as calls:
        drv = _two_gpus(calls)
        bsrs = [kvattn.BlockSparse(np.array([0, 1, 2], np.int32), np.array([h % 2, 1], np.int32), (16, 16), (32, 32))
                for h in range(HKV)]
        w = kvattn.VariableBlockSparseAttentionWrapper(device=1)
        kk = kvattn.empty((32, HKV, D), "bfloat16")   # (the test's arrays: allocated first)
        q = kvattn.empty((32, HQ, D), "bfloat16")
        n = len(calls)
        w.plan(bsrs, HQ, HKV, D)
        out = w.run(q, kk, kk)
        _assert_work_on_gpu_1(calls, n)
        assert out.owner.device == 1 and drv._current_ctx() == CONTEXT


def test_cascade_on_gpu_1():
    with fake_driver() as calls:
        drv = _two_gpus(calls)
        shared = kvattn.PageTable.from_kv_lens(np.array([4096]), PAGE, rng=np.random.default_rng(0))
        unique = kvattn.PageTable.from_kv_lens(np.array([100, 300, 50]), PAGE, rng=np.random.default_rng(1))
        c = kvattn.MultiLevelCascadeAttentionWrapper(2, device=1)
        kc = kvattn.empty((max(shared.num_pages_used, unique.num_pages_used), PAGE, HKV, D), "bfloat16")
        q = kvattn.empty((3, HQ, D), "bfloat16")
        n = len(calls)
        c.plan([np.array([0, 3], np.int32), np.array([0, 1, 2, 3], np.int32)], [shared, unique], HQ, HKV, D)
        out = c.run(q, kc, kc)
        _assert_work_on_gpu_1(calls, n)
        assert out.owner.device == 1 and drv._current_ctx() == CONTEXT


def test_cross_stream_ordering_records_its_event_in_the_producer_streams_context():
    """order_after records an event on the producer stream, which the driver allows only for an event of the
    stream's context: with two GPUs, the ordering of an op on GPU 1 after a stream of GPU 1 must not reuse an event
    made under GPU 0's context (one process-wide event did)."""
    from kvattn import stream as st
    with fake_driver() as calls:
        drv = _two_gpus(calls)
        pt = kvattn.PageTable.from_kv_lens(np.array([700]), PAGE, rng=np.random.default_rng(0))
        q0, k0, v0 = _arrays(pt, 1)
        s0 = kvattn.Stream()                       # GPU 0's
        q0.stream = s0.ptr                         # written on s0: the legacy stream must wait for it
        w0 = kvattn.BatchDecodeWithPagedKVCache()
        w0.plan(pt, HQ, HKV, D)
        w0.run(q0, k0, v0)
        drv.cuCtxPushCurrent(CONTEXT + 1)
        s1 = kvattn.Stream()                       # GPU 1's
        q1, k1, v1 = _arrays(pt, 1)
        drv.cuCtxPopCurrent()
        q1.stream = s1.ptr
        w1 = kvattn.BatchDecodeWithPagedKVCache(device=1)
        w1.plan(pt, HQ, HKV, D)
        n = len(calls)
        w1.run(q1, k1, v1)                         # legacy stream of GPU 1 waits for s1
        waits = [ctx for name, ctx in zip(calls.names(n), calls.contexts[n:]) if name == "cuEventRecord"]
        assert waits and set(waits) == {CONTEXT + 1}
        st.order_after(s0.ptr, st.as_stream(None))  # and GPU 0 again, from GPU 0's context


def test_a_gpu_1_output_freed_under_gpu_0s_context_is_freed_on_gpu_1s_stream(monkeypatch):
    """An out=None block of GPU 1 on the legacy stream, dropped while GPU 0's context is current with the free
    lists full, is freed with GPU 1's context current (the legacy handle names the current context's stream)."""
    with fake_driver() as calls:
        drv = _two_gpus(calls)
        monkeypatch.setattr(pool, "FREE_LIST_BLOCKS", 0)
        pt = kvattn.PageTable.from_kv_lens(np.array([700]), PAGE, rng=np.random.default_rng(0))
        q, k, v = _arrays(pt, 1)
        w = kvattn.BatchDecodeWithPagedKVCache(device=1)
        w.plan(pt, HQ, HKV, D)
        out = w.run(q, k, v)
        assert drv._current_ctx() == CONTEXT
        n = len(calls)
        del out
        frees = [ctx for name, ctx in zip(calls.names(n), calls.contexts[n:]) if name == "cuMemFreeAsync"]
        assert frees == [CONTEXT + 1] and drv._current_ctx() == CONTEXT


def test_dlpack_export_of_a_gpu_1_output_orders_in_gpu_1s_context():
    """torch.from_dlpack(out) of an output an op on GPU 1 wrote on the legacy stream calls __dlpack__(stream=torch's
    stream) without making GPU 1 current: the ordering must still record on GPU 1's legacy stream (the legacy
    handle names the current context's), so the event is recorded with GPU 1's context current."""
    with fake_driver() as calls:
        drv = _two_gpus(calls)
        pt = kvattn.PageTable.from_kv_lens(np.array([700]), PAGE, rng=np.random.default_rng(0))
        q, k, v = _arrays(pt, 1)
        w = kvattn.BatchDecodeWithPagedKVCache(device=1)
        w.plan(pt, HQ, HKV, D)
        out = w.run(q, k, v)
        drv.pointer_devices[out.ptr] = 1
        drv.cuCtxPushCurrent(CONTEXT + 1)
        torch_stream = kvattn.Stream()            # a created stream of GPU 1 (torch's current stream there)
        drv.cuCtxPopCurrent()
        n = len(calls)
        out.__dlpack__(stream=torch_stream.ptr)   # GPU 0's context current, as in torch.from_dlpack
        records = [ctx for name, ctx in zip(calls.names(n), calls.contexts[n:]) if name == "cuEventRecord"]
        assert records == [CONTEXT + 1] and drv._current_ctx() == CONTEXT
