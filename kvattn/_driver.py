"""The one place that talks to cuda.bindings.driver: lazy init, the thread's context, checked calls.

Every driver call goes through `call(name, *args)`, which raises CudaError naming the call and the
symbolic CUresult. Without a driver or a GPU the first call raises CudaUnavailableError.
"""
from __future__ import annotations

import threading

from ._errors import CudaError, CudaUnavailableError

_lock = threading.Lock()
_state: dict = {}


_module = None   # cuda.bindings.driver once imported (an import statement per call costs ~0.3 us on run()'s path)


def _driver_module():
    global _module
    if _module is None:
        try:
            from cuda.bindings import driver
        except Exception as exc:  # pragma: no cover - cuda-bindings is a hard dependency
            raise CudaUnavailableError(f"no CUDA driver/GPU found: cuda.bindings cannot be imported ({exc})") from exc
        _module = driver
    return _module


def call(name: str, *args):
    """Call driver.<name>(*args), check the CUresult, return the remaining outputs (None, one value or a tuple)."""
    ensure_context()
    return _call_unchecked_init(name, *args)


def _call_unchecked_init(name: str, *args):
    drv = _driver_module()
    out = getattr(drv, name)(*args)
    err = out[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(name, err, _error_string(err))
    rest = out[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def fail(name: str, err):
    """Raise the CudaError of a hot-path call that checked its own CUresult."""
    raise CudaError(name, err, _error_string(err))


def release(name: str, handle):
    """A finalizer's driver call (cuMemFree, cuStreamDestroy, ...): errors are ignored, as the context or the
    interpreter may already be gone when the owner is collected."""
    try:
        getattr(driver(), name)(handle)
    except Exception:
        pass


def _error_string(err) -> str:
    drv = _driver_module()
    try:
        e, s = drv.cuGetErrorString(err)
        return s.decode() if e == drv.CUresult.CUDA_SUCCESS and s else ""
    except Exception:
        return ""


def ensure_context():
    """Initialise the driver once; on a thread with no current context, make device 0's primary context current
    (the CUDA runtime's lazy default). A context the caller made current (PyTorch on cuda:N) is left as it is."""
    tid = threading.get_ident()
    if _state.get("thread") == tid:
        return
    with _lock:
        if "init" not in _state:
            drv = _driver_module()
            try:
                err, = drv.cuInit(0)
            except Exception as exc:  # library not found: RuntimeError / DynamicLibNotFoundError
                raise CudaUnavailableError(
                    f"no CUDA driver/GPU found: the CUDA driver library could not be loaded ({exc.__class__.__name__})"
                ) from exc
            if err != drv.CUresult.CUDA_SUCCESS:
                raise CudaUnavailableError(f"no CUDA driver/GPU found: cuInit returned {err.name}")
            if _call_unchecked_init("cuDeviceGetCount") < 1:
                raise CudaUnavailableError("no CUDA driver/GPU found: the driver reports 0 devices")
            _state["init"] = True
    if current_context_id() == 0:
        dev = _call_unchecked_init("cuDeviceGet", 0)
        _call_unchecked_init("cuCtxSetCurrent", _call_unchecked_init("cuDevicePrimaryCtxRetain", dev))
    _state["thread"] = tid


def current_context_id() -> int:
    """The calling thread's current context as an int (0: none)."""
    err, ctx = (_module or _driver_module()).cuCtxGetCurrent()   # (run()'s path: one call less)
    if err:
        fail("cuCtxGetCurrent", err)
    return int(ctx) if ctx is not None else 0


call_init = _call_unchecked_init   # a checked call that does not itself initialise (device.py, after init)


def gpu_available() -> bool:
    """True when a CUDA driver and at least one GPU are usable."""
    try:
        ensure_context()
        return True
    except CudaUnavailableError:
        return False


def current_device():
    """The kvattn.device.Device of the calling thread's current context."""
    from . import device
    return device.get()


def attribute(name: str) -> int:
    """A device attribute of the current device by its CU_DEVICE_ATTRIBUTE_ suffix, e.g. 'MULTIPROCESSOR_COUNT'."""
    return current_device().attribute(name)


def device_name() -> str:
    return current_device().name


def compute_capability() -> tuple[int, int]:
    return current_device().compute_capability


def sm_count() -> int:
    return current_device().sm_count


def max_shared_per_block_optin() -> int:
    return attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


def arch() -> str:
    """The NVRTC arch of the current device: sm_90a on Hopper (wgmma needs the 'a' target)."""
    return current_device().arch


def driver():
    """The raw cuda.bindings.driver module, for hot paths that check results themselves."""
    return _driver_module()
