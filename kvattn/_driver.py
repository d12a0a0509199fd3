"""The one place that talks to cuda.bindings.driver: lazy init, primary context, checked calls.

Every driver call goes through `call(name, *args)`, which raises CudaError naming the call and the
symbolic CUresult. Without a driver or a GPU the first call raises CudaUnavailableError.
"""
from __future__ import annotations

import functools
import threading

from ._errors import CudaError, CudaUnavailableError

_lock = threading.Lock()
_state: dict = {}


def _driver_module():
    try:
        from cuda.bindings import driver
    except Exception as exc:  # pragma: no cover - cuda-bindings is a hard dependency
        raise CudaUnavailableError(f"no CUDA driver/GPU found: cuda.bindings cannot be imported ({exc})") from exc
    return driver


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


def _error_string(err) -> str:
    drv = _driver_module()
    try:
        e, s = drv.cuGetErrorString(err)
        return s.decode() if e == drv.CUresult.CUDA_SUCCESS and s else ""
    except Exception:
        return ""


def ensure_context():
    """Initialise the driver once and make the primary context of device 0 current on this thread."""
    ctx = _state.get("ctx")
    if ctx is not None:
        if _state.get("thread_ctx") != threading.get_ident():
            _call_unchecked_init("cuCtxSetCurrent", ctx)
            _state["thread_ctx"] = threading.get_ident()
        return ctx
    with _lock:
        if "ctx" not in _state:
            drv = _driver_module()
            try:
                err, = drv.cuInit(0)
            except Exception as exc:  # library not found: RuntimeError / DynamicLibNotFoundError
                raise CudaUnavailableError(
                    f"no CUDA driver/GPU found: the CUDA driver library could not be loaded ({exc.__class__.__name__})"
                ) from exc
            if err != drv.CUresult.CUDA_SUCCESS:
                raise CudaUnavailableError(f"no CUDA driver/GPU found: cuInit returned {err.name}")
            count = _call_unchecked_init("cuDeviceGetCount")
            if count < 1:
                raise CudaUnavailableError("no CUDA driver/GPU found: the driver reports 0 devices")
            dev = _call_unchecked_init("cuDeviceGet", 0)
            ctx = _call_unchecked_init("cuDevicePrimaryCtxRetain", dev)
            _call_unchecked_init("cuCtxSetCurrent", ctx)
            _state["dev"] = dev
            _state["ctx"] = ctx
            _state["thread_ctx"] = threading.get_ident()
    return _state["ctx"]


def gpu_available() -> bool:
    """True when a CUDA driver and at least one GPU are usable."""
    try:
        ensure_context()
        return True
    except CudaUnavailableError:
        return False


def device():
    ensure_context()
    return _state["dev"]


@functools.lru_cache(maxsize=None)
def attribute(name: str) -> int:
    """A device attribute of device 0 by its CU_DEVICE_ATTRIBUTE_ suffix, e.g. 'MULTIPROCESSOR_COUNT'."""
    drv = _driver_module()
    attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
    return int(call("cuDeviceGetAttribute", attr, device()))


def device_name() -> str:
    raw = call("cuDeviceGetName", 256, device())
    return raw.split(b"\0", 1)[0].decode()


def compute_capability() -> tuple[int, int]:
    return attribute("COMPUTE_CAPABILITY_MAJOR"), attribute("COMPUTE_CAPABILITY_MINOR")


def sm_count() -> int:
    return attribute("MULTIPROCESSOR_COUNT")


def max_shared_per_block_optin() -> int:
    return attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


def arch() -> str:
    """The NVRTC arch for this device: sm_90a on Hopper (wgmma needs the 'a' target)."""
    major, minor = compute_capability()
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def driver():
    """The raw cuda.bindings.driver module, for hot paths that check results themselves."""
    return _driver_module()
