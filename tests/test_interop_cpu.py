"""CPU tests of the boundary rules (no driver needed): the stream argument, the DLPack stream convention given to
producers, CAI v3 stream fields honoured and exported, torch tensors read directly, capture refusals."""
import sys
import types

import numpy as np
import pytest

import kvattn
from kvattn import _binding, _dlpack, _interop, memory, stream as st
from kvattn.kernels import ParamBuffer
from kvattn.decode import DECODE_PARAMS


class FakeDLPack:
    """A DLPack producer on CUDA that records the stream it is given."""

    def __init__(self, shape=(3, 4), code=2, bits=16):
        self.got = []
        self.shape, self.code, self.bits = shape, code, bits

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        self.got.append(stream)
        strides = [int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape))]
        return _dlpack.export(0x10000, self.shape, strides, self.code, self.bits, self)


class FakeCAI:
    def __init__(self, stream_field, typestr="<f2"):
        self.cai = {"shape": (2, 8), "typestr": typestr, "data": (0x20000, False), "version": 3,
                    "strides": None, "stream": stream_field}

    @property
    def __cuda_array_interface__(self):
        return self.cai


@pytest.fixture
def waits(monkeypatch):
    """Record order_after(producer, consumer) calls instead of calling the driver."""
    calls = []

    def fake(producer, consumer):
        calls.append((producer, consumer.ptr))
    monkeypatch.setattr(_interop, "order_after", fake)
    monkeypatch.setattr(memory, "order_after", fake)
    return calls


# -- the stream argument ------------------------------------------------------------------------------------
def test_stream_argument_forms():
    legacy = st.as_stream(None)
    assert legacy.ptr == st.LEGACY and legacy.is_legacy and legacy.dlpack == 1
    assert st.as_stream(0) is legacy and st.as_stream(1) is legacy
    pt = st.as_stream(2)
    assert pt.ptr == st.PER_THREAD and pt.dlpack == 2 and not pt.is_legacy
    h = st.as_stream(0x7F00AB)
    assert h.ptr == 0x7F00AB and h.dlpack == 0x7F00AB and st.as_stream(0x7F00AB) is h
    assert st.as_stream(h) is h
    assert st.as_stream(np.int64(0x7F00AB)) is h

    class CuPyLike:
        def __cuda_stream__(self):
            return (0, 0x7F00AB)

    class TorchLike:   # torch.cuda.Stream: a cuda_stream attribute, no torch import
        cuda_stream = 0

    assert st.as_stream(CuPyLike()) is h
    assert st.as_stream(TorchLike()) is legacy
    from cuda.bindings import driver
    assert st.as_stream(driver.CUstream(0x7F00AB)) is h
    with pytest.raises(TypeError, match="stream: expected None, 0/1"):
        st.as_stream("default")
    with pytest.raises(ValueError, match="stream: a stream handle cannot be negative"):
        st.as_stream(-5)
    assert not legacy.is_capturing()   # answered without a driver call


def test_capture_on_legacy_stream_is_refused_with_the_reason():
    with pytest.raises(kvattn.KvattnError, match="legacy default stream .* cannot be captured; pass an explicit"):
        with kvattn.graphs.capture(None):
            pass
    with pytest.raises(kvattn.KvattnError, match="cannot be captured"):
        st.require_capturable(st.as_stream(0))


def test_implicit_output_refused_while_capturing():
    with pytest.raises(kvattn.KvattnError, match="out: run.. is being captured .* pass out"):
        _binding.output(None, (2, 8), np.dtype(np.float16), st.as_stream(0x1234), True, "out")


# -- DLPack: the consumer stream in DLPack's convention ----------------------------------------------------------
def test_dlpack_producer_gets_the_consumer_stream_in_its_convention(waits):
    x = FakeDLPack()
    a = kvattn.asarray(x)                      # stream=None: legacy default -> 1, never 0
    _interop.import_array(x, st.as_stream(0), False)
    _interop.import_array(x, st.as_stream(2), False)
    _interop.import_array(x, st.as_stream(0xABC0), False)
    _interop.import_array(x, st.as_stream(0xABC0), True)   # capturing: no cross-stream wait
    assert x.got == [1, 1, 2, 0xABC0, -1]
    assert a.shape == (3, 4) and a.strides == (8, 2) and a.dtype == np.float16 and a.ptr == 0x10000
    assert waits == []                         # DLPack producers order themselves


def test_dlpack_bfloat16_and_unsupported_types():
    a = _interop.import_array(FakeDLPack((5,), code=4, bits=16), st.as_stream(None), False)
    assert a.dtype_name == "bfloat16" and a.strides == (2,)
    with pytest.raises(TypeError, match="DLPack dtype"):
        _interop.import_array(FakeDLPack((5,), code=5, bits=16), st.as_stream(None), False)


# -- CUDA Array Interface v3 ---------------------------------------------------------------------------------
def test_cai_stream_field_is_honoured(waits):
    s = st.as_stream(0x5000)
    _interop.import_array(FakeCAI(None), s, False)      # ready: nothing to wait for
    _interop.import_array(FakeCAI(0x5000), s, False)    # same stream
    _interop.import_array(FakeCAI(1), s, False)         # legacy producer, other consumer
    _interop.import_array(FakeCAI(0x6000), s, True)     # capturing: no cross-stream wait
    a = _interop.import_array(FakeCAI(2), st.as_stream(None), False)
    assert waits == [(1, 0x5000), (2, 1)]
    assert a.shape == (2, 8) and a.strides == (16, 2)


def test_cai_raw_bytes_falls_back_to_a_clear_error():
    with pytest.raises(TypeError, match="raw bytes; pass the array through DLPack"):
        _interop.import_array(FakeCAI(None, "<V2"), st.as_stream(None), False)


# -- export ----------------------------------------------------------------------------------------------------
def test_export_reports_and_orders_the_writer_stream(waits):
    a = kvattn.DeviceArray(0x30000, (4, 8), "bfloat16")
    assert a.__cuda_array_interface__["stream"] is None   # nothing kvattn queued writes it
    a.__dlpack__(stream=1)
    assert waits == []
    a.stream = 0x7000                                     # written by a kvattn kernel on that stream
    assert a.__cuda_array_interface__["stream"] == 0x7000
    for consumer in (None, 1, 2, 0x8000, -1, 0x7000):
        a.__dlpack__(stream=consumer)
    assert waits == [(0x7000, 1), (0x7000, 1), (0x7000, 2), (0x7000, 0x8000)]
    assert a[1:].stream == 0x7000 and a.reshape(32).stream == 0x7000   # views inherit it
    cap = a.__dlpack__(stream=-1)
    ptr, shape, strides, dt, dev, _ = _dlpack.read(cap)
    assert (ptr, shape, strides, dt, dev) == (0x30000, (4, 8), (8, 1), (4, 16, 1), 2)


def test_device_array_import_orders_after_its_writer(waits):
    a = kvattn.DeviceArray(0x30000, (4, 8), "float16")
    a.stream = 0x7000
    assert _interop.import_array(a, st.as_stream(0x7000), False) is a
    assert _interop.import_array(a, st.as_stream(None), False) is a
    assert _interop.import_array(a, st.as_stream(2), True) is a
    assert waits == [(0x7000, 1)]


# -- torch tensors, duck-typed (a fake torch module; torch itself is not needed) ---------------------------------
def test_torch_tensors_read_directly_and_ordered_like_torch(monkeypatch, waits):
    fake = types.ModuleType("torch")
    for n in ("float16", "bfloat16", "float32", "int32"):
        setattr(fake, n, object())
    current = {"stream": 0}
    calls = []
    fake._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda dev: calls.append(dev) or current["stream"])
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(_interop, "_torch", {})

    class Tensor:
        __module__ = "torch"
        is_cuda = True
        dtype = fake.bfloat16
        shape = (3, 2, 8)
        device = "cpu"

        def get_device(self):
            return 0 if self.is_cuda else -1

        def data_ptr(self):
            return 0x40000

        def stride(self):
            return (16, 8, 1)

    monkeypatch.setattr(_interop, "_strategy", {})
    t = Tensor()
    a = _interop.import_array(t, st.as_stream(None), False)   # torch's default stream (0) is the legacy stream
    assert (a.ptr, a.shape, a.strides, a.dtype_name, a.owner) == (0x40000, (3, 2, 8), (32, 16, 2), "bfloat16", t)
    current["stream"] = 0x9000                                 # inside torch.cuda.stream(side)
    _interop.import_array(t, st.as_stream(0x9000), False)      # same stream: nothing
    _interop.import_array(t, st.as_stream(None), False)        # legacy consumer waits for torch's side stream
    _interop.import_array(t, st.as_stream(None), True)         # capturing: no wait
    assert waits == [(0x9000, 1)]
    Tensor.get_device = lambda self: 1                         # outside an op: any CUDA device
    _interop.import_array(t, st.as_stream(None), False)
    assert calls == [0, 0, 0, 1]                               # torch's current stream of the tensor's device
    _interop.active.ordinal = 0                                # inside an op on device 0 (opcore.on_device)
    try:
        with pytest.raises(ValueError, match="a torch tensor on cuda:1, but this op runs on device 0"):
            _interop.import_array(t, st.as_stream(None), False)
        _interop.active.ordinal = 1
        _interop.import_array(t, st.as_stream(None), False)
    finally:
        _interop.active.ordinal = None
    Tensor.get_device = lambda self: 0 if self.is_cuda else -1
    Tensor.dtype = object()
    with pytest.raises(TypeError, match="torch dtype"):
        _interop.import_array(t, st.as_stream(None), False)
    Tensor.is_cuda = False
    with pytest.raises(TypeError, match="expected a CUDA tensor"):
        _interop.import_array(t, st.as_stream(None), False)


# -- cupy arrays, duck-typed (a fake cupy module) --------------------------------------------------------------
def test_cupy_arrays_read_directly_and_ordered_like_their_cai(monkeypatch, waits):
    import ml_dtypes
    fake = types.ModuleType("cupy")
    current = {"stream": 0}
    fake.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=current["stream"]))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_interop, "_cupy", {})
    monkeypatch.setattr(_interop, "_strategy", {})

    class ndarray:
        __module__ = "cupy._core.core"
        dtype = np.dtype(ml_dtypes.bfloat16)
        shape = (3, 2, 8)
        strides = (32, 16, 2)
        data = types.SimpleNamespace(ptr=0x50000)

        @property
        def __cuda_array_interface__(self):
            raise AssertionError("the dict is not built")

    x = ndarray()
    a = _interop.import_array(x, st.as_stream(None), False)   # CuPy's null stream (0) is the legacy stream
    assert (a.ptr, a.shape, a.strides, a.dtype_name, a.owner) == (0x50000, (3, 2, 8), (32, 16, 2), "bfloat16", x)
    current["stream"] = 0x9100                                 # inside `with cupy.cuda.Stream():`
    _interop.import_array(x, st.as_stream(0x9100), False)      # same stream: nothing
    _interop.import_array(x, st.as_stream(None), False)        # legacy consumer waits for CuPy's stream
    _interop.import_array(x, st.as_stream(None), True)         # capturing: no wait
    current["stream"] = 0
    _interop.import_array(x, st.as_stream(0x9200), False)      # a created consumer waits for the legacy stream
    assert waits == [(0x9100, 1), (0, 0x9200)]
    ndarray.dtype = np.dtype(np.int8)
    with pytest.raises(TypeError, match="expected one of"):
        _interop.import_array(x, st.as_stream(None), False)


def test_numpy_input_refused_while_capturing():
    with pytest.raises(kvattn.KvattnError, match="numpy array is copied"):
        _interop.import_array(np.zeros(4, np.float16), st.as_stream(0x1234), True)


def test_unknown_array_type_names_what_is_accepted():
    with pytest.raises(TypeError, match="expected a numpy array, a kvattn.DeviceArray or a CUDA array"):
        kvattn.asarray([1, 2, 3])


def test_param_setter_packs_adjacent_fields_and_refuses_others():
    p = ParamBuffer(DECODE_PARAMS)
    p.setter("q", "k", "v", "o", "lse")(1, 2, 3, 4, 5)
    p.setter("q_stride_n", "q_stride_h")(-7, 9)
    assert [p[n] for n in ("q", "k", "v", "o", "lse", "q_stride_n", "q_stride_h")] == [1, 2, 3, 4, 5, -7, 9]
    with pytest.raises(ValueError, match="not adjacent"):
        p.setter("q", "v")


def test_cai_raw_bytes_take_the_arrays_own_numpy_dtype(waits):
    import ml_dtypes

    class CuPyBF16(FakeCAI):   # CuPy holds bfloat16 as ml_dtypes' numpy type and exports '<V2'
        dtype = np.dtype(ml_dtypes.bfloat16)

    a = _interop.import_array(CuPyBF16(1, "<V2"), st.as_stream(None), False)
    assert a.dtype_name == "bfloat16" and a.shape == (2, 8) and a.strides == (16, 2)


def test_jax_arrays_read_directly_when_computed_else_through_dlpack(monkeypatch, waits):
    import ml_dtypes

    class Array(FakeDLPack):
        __module__ = "jaxlib.xla_extension"
        dtype = np.dtype(ml_dtypes.bfloat16)
        ready = True

        def is_ready(self):
            return self.ready

        def unsafe_buffer_pointer(self):
            return 0x50000

    monkeypatch.setattr(_interop, "_strategy", {})
    x = Array((4, 6), code=4, bits=16)
    x.shape = (4, 6)
    a = _interop.import_array(x, st.as_stream(0xAB00), False)
    assert (a.ptr, a.shape, a.strides, a.dtype_name) == (0x50000, (4, 6), (12, 2), "bfloat16") and x.got == []
    x.ready = False   # not computed yet: the producer is given the consumer stream and orders itself
    b = _interop.import_array(x, st.as_stream(0xAB00), False)
    assert x.got == [0xAB00] and b.ptr == 0x10000 and waits == []


# -- DLPack device ids (the driver faked: two GPUs) ------------------------------------------------------------
def test_dlpack_exports_name_the_array_device_and_imports_check_the_op_device():
    """An array on GPU 1 exports DLPack device (CUDA, 1), so torch builds its tensor on cuda:1 (it said 0 before,
    whatever the GPU); with one GPU no driver query is made. Inside an op on device 0, a DLPack array that says
    device 1 is refused naming both."""
    from _fake_driver import fake_driver
    from kvattn import device as _device
    with fake_driver() as calls:
        drv = kvattn._driver.driver()
        a = kvattn.DeviceArray(0x7000_0000, (4, 8), "float16")
        assert a.__dlpack_device__() == (_dlpack.K_DL_CUDA, 0) and "cuPointerGetAttribute" not in calls.names()
        _device._count.clear()
        drv.device_count = 2
        drv.pointer_devices[a.ptr] = 1
        assert a.__dlpack_device__() == (_dlpack.K_DL_CUDA, 1)
        ptr, shape, _, _, dev_type, dev_id = _dlpack.read(a.__dlpack__(stream=-1))
        assert (ptr, shape, dev_type, dev_id) == (a.ptr, (4, 8), _dlpack.K_DL_CUDA, 1)
        with pytest.raises(BufferError, match="the array is on CUDA device 1"):
            a.__dlpack__(stream=-1, dl_device=(_dlpack.K_DL_CUDA, 0))

        class Producer:   # a DLPack-only producer handing out a's capsule
            def __dlpack__(self, stream=None):
                return a.__dlpack__(stream=-1)

            def __dlpack_device__(self):
                return a.__dlpack_device__()

        s = st.as_stream(None)
        assert _interop.import_array(Producer(), s, False).ptr == a.ptr   # outside an op: any device
        _interop.active.ordinal = 0
        try:
            with pytest.raises(ValueError, match="a DLPack array on CUDA device 1, but this op runs on device 0"):
                _interop.import_array(Producer(), s, False)
        finally:
            _interop.active.ordinal = None
