"""kvattn.device: the device= argument (validated without a GPU), the current context's device as the default,
and plan() / run() in the op's context with the caller's context restored (GPU part on the machine's device 0)."""
import numpy as np
import pytest

import kvattn
from kvattn import _driver, device, reference
from _gpu import rel_l2, requires_gpu


def test_device_argument_is_validated_without_a_gpu():
    with pytest.raises(TypeError, match="device: expected None, a device ordinal"):
        kvattn.BatchDecodeWithPagedKVCache(device="cuda:0")
    with pytest.raises(ValueError, match="device: expected an ordinal >= 0, got -1"):
        kvattn.BatchPrefillWithRaggedKVCache(device=-1)
    w = kvattn.BatchDecodeWithPagedKVCache(device=3)   # constructing touches no GPU
    assert w.device is None


@pytest.mark.gpu
@requires_gpu
def test_get_and_its_errors():
    d = device.get()
    assert d is device.get(0) is device.get(d) and d.ordinal == 0 and d.sm_count > 0 and d.arch.startswith("sm_")
    assert d.is_current()
    n = device.count()
    with pytest.raises(ValueError, match=rf"device: ordinal {n} out of range; the driver sees {n} GPU"):
        device.get(n)
    with pytest.raises(TypeError, match="device: expected None"):
        device.get(1.0)
    a = kvattn.empty((4,), "float32")
    assert a.device is d


def _case(rng):
    pt = kvattn.PageTable.from_kv_lens(np.array([300, 40]), 16, rng=rng)
    bf = kvattn._dtypes.to_numpy("bfloat16")
    k = rng.standard_normal((pt.num_pages_used, 16, 2, 64)).astype(bf)
    v = rng.standard_normal((pt.num_pages_used, 16, 2, 64)).astype(bf)
    q = rng.standard_normal((2, 8, 64)).astype(bf)
    return pt, q, k, v


@pytest.mark.gpu
@requires_gpu
def test_plan_and_run_in_the_ops_context_with_none_current():
    """With no context current on the thread (a framework popped it), plan() and run() push the op's device's
    context and pop it again: the result is right and the thread is left as it was."""
    rng = np.random.default_rng()
    pt, q, k, v = _case(rng)
    qd, kd, vd = kvattn.from_numpy(q), kvattn.from_numpy(k), kvattn.from_numpy(v)
    w = kvattn.BatchDecodeWithPagedKVCache(device=0)
    ctx = _driver.call_init("cuCtxPopCurrent")
    try:
        assert _driver.current_context_id() == 0
        w.plan(pt, 8, 2, 64)
        assert _driver.current_context_id() == 0
        out = w.run(qd, kd, vd)
        assert _driver.current_context_id() == 0
    finally:
        _driver.call_init("cuCtxPushCurrent", ctx)
    assert w.device is device.get(0)
    ref = reference.batch_attention_paged(q, k, v, np.arange(3), pt)
    assert rel_l2(out.numpy(), ref) <= 1e-2


@pytest.mark.gpu
@requires_gpu
def test_default_device_is_the_current_contexts():
    w = kvattn.BatchPrefillWithRaggedKVCache()
    w.plan([0, 5], [0, 9], 8, 2, 64)
    assert w.device is device.get() and w.device.ordinal == int(_driver.call_init("cuCtxGetDevice"))
