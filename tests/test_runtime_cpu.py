"""CPU tests of the runtime pieces that need no GPU: errors, dtypes, DLPack structures, workspace sizing."""
import pytest

import kvattn
from kvattn import _dlpack, _dtypes, memory


@pytest.mark.skipif(kvattn.gpu_available(), reason="this machine has a GPU: the no-GPU error path cannot be seen")
def test_no_gpu_raises_one_clear_error():
    with pytest.raises(kvattn.CudaUnavailableError, match="no CUDA driver/GPU found"):
        kvattn.empty((4,), "float32")
    assert kvattn.gpu_available() is False


def test_cuda_error_names_call_and_symbol():
    from cuda.bindings import driver
    e = kvattn.CudaError("cuMemAlloc", driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, "out of memory")
    assert "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY" in str(e)
    assert e.call == "cuMemAlloc"


@pytest.mark.parametrize("name", _dtypes.SUPPORTED)
def test_dtype_tables_round_trip(name):
    npd = _dtypes.to_numpy(name)
    assert _dtypes.dtype_name(npd) == name
    assert _dtypes.from_dlpack(*_dtypes.to_dlpack(name)) == npd


def test_dtype_errors_name_the_argument():
    with pytest.raises(TypeError, match="dtype: expected one of"):
        _dtypes.dtype_name("complex64")
    with pytest.raises(TypeError, match="raw bytes"):
        _dtypes.from_typestr("<V2")


def test_dlpack_capsule_round_trip_and_lifetime():
    owner = object()
    cap = _dlpack.export(0x1000, (3, 4), (4, 1), 4, 16, owner)
    assert len(_dlpack._live) >= 1
    ptr, shape, strides, dt, dev, _ = _dlpack.read(cap)
    assert (ptr, shape, strides, dt, dev) == (0x1000, (3, 4), (4, 1), (4, 16, 1), _dlpack.K_DL_CUDA)
    n = len(_dlpack._live)
    del cap  # unconsumed capsule frees its tensor
    assert len(_dlpack._live) == n - 1


def test_device_array_metadata_without_gpu():
    a = memory.DeviceArray(0x10000, (2, 3, 8), "bfloat16")
    assert a.strides == (48, 16, 2) and a.nbytes == 96 and a.is_contiguous()
    cai = a.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (0x10000, False) and cai["strides"] is None
    b = a[1, 1:3]
    assert b.shape == (2, 8) and b.ptr == 0x10000 + 48 + 16 and b.strides == (16, 2)
    assert a.reshape(6, -1).shape == (6, 8)
    with pytest.raises(ValueError, match="shape"):
        a.reshape(5, 5)


def test_workspace_sizing_is_aligned():
    spec = {"a": ((3,), "int32"), "b": ((100, 4), "float32")}
    assert memory.Workspace.bytes_needed(spec) == 256 + 1792


def test_asarray_rejects_unknown_objects():
    with pytest.raises(TypeError, match="array: expected"):
        kvattn.asarray([1, 2, 3])


@pytest.mark.skipif(kvattn.gpu_available(), reason="this machine has a GPU: the no-GPU main job cannot be seen")
def test_main_job_without_gpu_compiles_checks_reference_and_says_so(tmp_path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "KVATTN_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "kvattn"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no CUDA GPU found" in r.stdout
    assert "0 failure(s)" in r.stdout and "0 failed)" in r.stdout
    assert "NVRTC 13.0" in r.stdout
