"""GPU tests of the runtime: device arrays, interop, streams, merge kernels, graphs, param layouts."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvattn
from kvattn import _dtypes, compiler, contract, decode, kernels, merge, page, reference
from _gpu import assert_lse, poisoned, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
GPU = settings(max_examples=50, deadline=None)


@pytest.mark.parametrize("dtype", _dtypes.SUPPORTED)
def test_device_array_round_trip(dtype):
    rng = np.random.default_rng()
    host = (rng.standard_normal((5, 7, 8)) * 4).astype(_dtypes.to_numpy(dtype))
    a = kvattn.from_numpy(host)
    assert a.shape == host.shape and a.dtype == host.dtype
    np.testing.assert_array_equal(a.numpy().view(np.uint8), host.view(np.uint8))
    sub = a[1:4, 2]
    np.testing.assert_array_equal(sub.numpy().view(np.uint8), host[1:4, 2].view(np.uint8))


def test_workspace_too_small_says_bytes_needed():
    ws = kvattn.Workspace(1024)
    with pytest.raises(kvattn.WorkspaceTooSmall, match=r"4096 bytes needed"):
        ws.regions({"x": ((1024,), "float32")})
    r = ws.regions({"a": ((10,), "int32"), "b": ((4,), "float32")})
    assert r["b"].ptr - r["a"].ptr == 256


def test_event_timing_and_streams():
    s = kvattn.Stream()
    a, b = kvattn.Event(), kvattn.Event()
    x = kvattn.empty((1 << 20,), "uint8")
    a.record(s)
    x.fill_bytes(7, s)
    b.record(s)
    b.synchronize()
    assert a.elapsed_ms(b) >= 0
    assert (x.numpy(s) == 7).all()


def test_cupy_interop_zero_copy():
    cp = pytest.importorskip("cupy")
    c = cp.arange(24, dtype=cp.float32).reshape(4, 6)
    a = kvattn.asarray(c)
    assert a.ptr == c.data.ptr and a.shape == (4, 6)
    np.testing.assert_array_equal(a.numpy(), cp.asnumpy(c))
    back = cp.asarray(a)          # through __cuda_array_interface__
    assert back.data.ptr == a.ptr
    via_dlpack = cp.from_dlpack(a)
    assert via_dlpack.data.ptr == a.ptr


def test_torch_interop_zero_copy_bfloat16():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    t = torch.randn(3, 4, 8, device="cuda", dtype=torch.bfloat16)
    a = kvattn.asarray(t)         # '<V2' through CAI: kvattn reads the dtype from DLPack
    assert a.ptr == t.data_ptr() and a.dtype_name == "bfloat16"
    np.testing.assert_array_equal(a.numpy().astype(np.float32), t.float().cpu().numpy())
    back = torch.from_dlpack(a)
    assert back.data_ptr() == a.ptr and back.dtype == torch.bfloat16


@pytest.mark.parametrize("struct,dtype,header", [("kvattn::MergeParams", merge.MERGE_PARAMS, "merge.cuh"),
                                                 ("kvattn::DecodeParams", decode.DECODE_PARAMS, "decode.cuh"),
                                                 ("kvattn::PlanHeader", contract.PLAN_HEADER, "common.cuh"),
                                                 ("kvattn::AppendParams", page.APPEND_PARAMS, "page.cuh")])
def test_param_struct_offsets_match_on_device(struct, dtype, header):
    src = f'#include "{header}"\n' + kernels.layout_probe(struct, dtype)
    spec = kernels.KernelSpec(header, "kvattn_layout_probe", (), ())
    c = compiler.compile_cubin(src, "probe.cu", [], ["kvattn_layout_probe"], "sm_90a")
    k = kernels.Kernel(spec, c)
    out = kvattn.zeros((128,), "int64")
    p = np.zeros(1, np.dtype([("out", "u8")]))
    p["out"] = out.ptr
    k.launch(1, 1, 0, p)
    got = out.numpy()
    assert got[0] == dtype.itemsize
    assert list(got[1:1 + len(dtype.names)]) == [dtype.fields[n][1] for n in dtype.names]


def _states(rng, shape, dtype):
    o = rng.standard_normal(shape).astype(_dtypes.to_numpy(dtype))
    lse = rng.uniform(-8, 8, shape[:-1]).astype(np.float32)
    lse[rng.random(lse.shape) < 0.1] = -np.inf
    return o, lse


@GPU
@given(rows=st.integers(1, 300), heads=st.integers(1, 9), dim=st.sampled_from([8, 64, 128, 256]),
       dtype=st.sampled_from(merge.STATE_DTYPES), seed=st.integers(0, 2**31))
def test_merge_state_matches_reference(rows, heads, dim, dtype, seed):
    rng = np.random.default_rng(seed)
    oa, la = _states(rng, (rows, heads, dim), dtype)
    ob, lb = _states(rng, (rows, heads, dim), dtype)
    out, lse_out = poisoned((rows, heads, dim), dtype), poisoned((rows, heads), "float32")
    kvattn.merge_state(oa, la, ob, lb, out=out, lse_out=lse_out)
    ro, rl = reference.merge_state(oa.astype(np.float64), la, ob.astype(np.float64), lb)
    assert rel_l2(out.numpy(), ro) <= (1e-2 if dtype == "bfloat16" else 2e-3)
    assert_lse(lse_out.numpy(), rl, 1e-4)


@GPU
@given(rows=st.integers(1, 200), n=st.integers(1, 70), heads=st.integers(1, 5), dim=st.sampled_from([64, 128]),
       dtype=st.sampled_from(merge.STATE_DTYPES), seed=st.integers(0, 2**31))
def test_merge_states_matches_reference(rows, n, heads, dim, dtype, seed):
    """n up to 70: up to 16 lanes share a (row, head, 8 columns), their runs combined through shuffles."""
    rng = np.random.default_rng(seed)
    o, lse = _states(rng, (rows, n, heads, dim), dtype)
    lse[0] = -np.inf  # one row fully empty
    out, lse_out = kvattn.merge_states(o, lse)
    ro, rl = reference.merge_states(o.astype(np.float64), lse)
    got = out.numpy()
    assert np.all(got[0] == 0)
    assert rel_l2(got, ro) <= (1e-2 if dtype == "bfloat16" else 2e-3)
    assert_lse(lse_out.numpy(), rl, 1e-4)


def test_outputs_outlive_the_created_stream_they_were_written_on():
    """Run 50a's segfault: a test's own kvattn.Stream was collected before the `out=None` output written on it, and
    the output's free went to the destroyed stream. The output keeps its stream alive: read after the stream's last
    user reference is gone (ordered after its writer) and freed on a live stream, 50 times on fresh data."""
    import gc
    rng = np.random.default_rng()
    for _ in range(50):
        oa, la = _states(rng, (64, 4, 128), "bfloat16")
        ob, lb = _states(rng, (64, 4, 128), "bfloat16")
        s = kvattn.Stream()
        out, lse_out = kvattn.merge_state(oa, la, ob, lb, stream=s)
        del s
        gc.collect()
        ro, rl = reference.merge_state(oa.astype(np.float64), la, ob.astype(np.float64), lb)
        assert rel_l2(out.numpy(), ro) <= 1e-2
        assert_lse(lse_out.numpy(), rl, 1e-4)
        del out, lse_out
        gc.collect()


def test_merge_state_in_place_with_mask():
    rng = np.random.default_rng()
    o, lse = _states(rng, (64, 4, 128), "float32")
    o2, lse2 = _states(rng, (64, 4, 128), "float32")
    mask = rng.random(64) < 0.5
    od, ld = kvattn.from_numpy(o), kvattn.from_numpy(lse)
    kvattn.merge_state_in_place(od, ld, o2, lse2, mask=mask)
    ro, rl = reference.merge_state(o.astype(np.float64), lse, o2.astype(np.float64), lse2)
    got_o, got_l = od.numpy(), ld.numpy()
    np.testing.assert_array_equal(got_o[~mask], o[~mask])
    assert rel_l2(got_o[mask], ro[mask]) <= 1e-5
    assert_lse(got_l[mask], rl[mask], 1e-4)


def test_merge_input_errors():
    o = kvattn.empty((4, 2, 64), "float32")
    with pytest.raises(ValueError, match="lse_a: expected shape"):
        kvattn.merge_state(o, kvattn.empty((4, 3), "float32"), o, kvattn.empty((4, 2), "float32"))
    with pytest.raises(TypeError, match="lse_a: dtype must be float32"):
        kvattn.merge_state(o, kvattn.empty((4, 2), "float16"), o, kvattn.empty((4, 2), "float32"))
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 8"):
        x = kvattn.empty((4, 2, 12), "float32")
        kvattn.merge_state(x, kvattn.empty((4, 2), "float32"), x, kvattn.empty((4, 2), "float32"))


def test_graph_capture_replays_merges_with_new_inputs():
    """Capture three merge launches into one graph; replay 100 times with fresh inputs in the same buffers."""
    rng = np.random.default_rng()
    shape = (256, 4, 128)
    bufs = [kvattn.empty(shape, "bfloat16") for _ in range(3)]
    lses = [kvattn.empty(shape[:-1], "float32") for _ in range(3)]
    out, lse_out = kvattn.empty(shape, "bfloat16"), kvattn.empty(shape[:-1], "float32")
    tmp, tmp_lse = kvattn.empty(shape, "bfloat16"), kvattn.empty(shape[:-1], "float32")
    s = kvattn.Stream()
    kvattn.merge_state(bufs[0], lses[0], bufs[1], lses[1], out=tmp, lse_out=tmp_lse, stream=s)  # warm (compile)
    with kvattn.graphs.capture(s) as cap:
        kvattn.merge_state(bufs[0], lses[0], bufs[1], lses[1], out=tmp, lse_out=tmp_lse, stream=s)
        kvattn.merge_state(tmp, tmp_lse, bufs[2], lses[2], out=out, lse_out=lse_out, stream=s)
    g = cap.graph
    assert len(g.kernel_nodes()) == 2
    for _ in range(100):
        states = [_states(rng, shape, "bfloat16") for _ in range(3)]
        for (o, l), bo, bl in zip(states, bufs, lses):
            bo.copy_from_host(o, s)
            bl.copy_from_host(l, s)
        g.replay(s)
        o = np.stack([x[0].astype(np.float64) for x in states], 1)
        l = np.stack([x[1] for x in states], 1)
        ro, rl = reference.merge_states(o, l)
        assert rel_l2(out.numpy(s), ro) <= 1e-2
        assert_lse(lse_out.numpy(s), rl, 1e-3)


def test_graph_kernel_node_params_update():
    rng = np.random.default_rng()
    shape = (32, 2, 64)
    a, b = (_states(rng, shape, "float32") for _ in range(2))
    c = _states(rng, shape, "float32")
    da, db, dc = ([kvattn.from_numpy(x) for x in s] for s in (a, b, c))
    out, lo = kvattn.empty(shape, "float32"), kvattn.empty(shape[:-1], "float32")
    s = kvattn.Stream()
    kvattn.merge_state(*da, *db, out=out, lse_out=lo, stream=s)
    with kvattn.graphs.capture(s) as cap:
        kvattn.merge_state(*da, *db, out=out, lse_out=lo, stream=s)
    p = merge._pair_params(da[0], da[1], dc[0], dc[1])   # same kernel, now a (+) c
    merge._set_out(p, out, lo)
    cap.graph.update_kernel_params(0, p)
    cap.graph.replay(s)
    ro, _ = reference.merge_state(a[0].astype(np.float64), a[1], c[0].astype(np.float64), c[1])
    assert rel_l2(out.numpy(s), ro) <= 1e-5
