"""GPUs as objects: `Device(ordinal)` holds the device's primary context, its attributes and its NVRTC arch.

kvattn works in the calling thread's current CUDA context, as the CUDA runtime (PyTorch, CuPy) does: a thread
that has none gets device 0's primary context, the runtime's own lazy default. So a process that PyTorch has put
on cuda:3 (`torch.cuda.set_device(3)`) runs kvattn on device 3 without saying so. An op given `device=N` makes its
device's context current for the duration of each plan() / run() and restores the caller's context after
(cuCtxPushCurrent / cuCtxPopCurrent), so it never changes the device a framework sees.
"""
from __future__ import annotations

import functools
import threading

from . import _driver

_lock = threading.Lock()
_devices: dict = {}
# active.ordinal: the ordinal of the device whose op is running on this thread (set by opcore.on_device around
# plan() / run(), whose context is then current), so code inside an op knows its device without a driver query.
active = threading.local()


class Device:
    """One GPU: its ordinal, CUdevice, primary context (retained for the process) and cached attributes. Get one
    with `kvattn.device.get(ordinal)` (or `get()`: the current context's device)."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.handle = _driver.call_init("cuDeviceGet", ordinal)
        self.context = _driver.call_init("cuDevicePrimaryCtxRetain", self.handle)
        self.context_id = int(self.context)
        self._attrs: dict = {}

    def __repr__(self):
        return f"Device({self.ordinal}: {self.name})"

    @functools.cached_property
    def name(self) -> str:
        raw = _driver.call_init("cuDeviceGetName", 256, self.handle)
        return raw.split(b"\0", 1)[0].decode()

    def attribute(self, name: str) -> int:
        """A device attribute by its CU_DEVICE_ATTRIBUTE_ suffix, e.g. 'MULTIPROCESSOR_COUNT' (cached)."""
        v = self._attrs.get(name)
        if v is None:
            attr = getattr(_driver.driver().CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
            v = self._attrs[name] = int(_driver.call_init("cuDeviceGetAttribute", attr, self.handle))
        return v

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR")

    @property
    def sm_count(self) -> int:
        return self.attribute("MULTIPROCESSOR_COUNT")

    @property
    def peak_memory_bandwidth(self) -> float:
        """The memory's peak rate in bytes/s (memory clock x 2 transfers x bus width), as the driver reports them."""
        return self.attribute("MEMORY_CLOCK_RATE") * 1e3 * 2 * self.attribute("GLOBAL_MEMORY_BUS_WIDTH") / 8

    @property
    def arch(self) -> str:
        """The NVRTC arch: sm_90a on Hopper (wgmma needs the 'a' target)."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if major == 9 else "")

    def is_current(self) -> bool:
        return _driver.current_context_id() == self.context_id

    def activate(self):
        """A context manager: this device's context is current inside, the caller's again after (no call when it
        already is current)."""
        return _Active(self)


class _Active:
    __slots__ = ("device", "pushed")

    def __init__(self, device: Device):
        self.device, self.pushed = device, False

    def __enter__(self):
        if _driver.current_context_id() != self.device.context_id:
            _driver.call_init("cuCtxPushCurrent", self.device.context)
            self.pushed = True
        return self.device

    def __exit__(self, *exc):
        if self.pushed:
            _driver.call_init("cuCtxPopCurrent")
            self.pushed = False
        return False


_count: list = []   # the driver's GPU count, once read (it does not change while the process runs)


def count() -> int:
    """The number of GPUs the driver sees (CudaUnavailableError without a driver or a GPU)."""
    if not _count:
        _driver.ensure_context()
        _count.append(int(_driver.call_init("cuDeviceGetCount")))
    return _count[0]


def several() -> bool:
    """Whether the driver sees more than one GPU (False without a driver: CPU tests): where contexts, events and the
    special stream handles need no care beyond the current context."""
    try:
        return count() > 1
    except Exception:   # CudaUnavailableError: no driver / no GPU
        return False


def ordinal_of(ptr: int) -> int:
    """The ordinal of the GPU whose memory holds device pointer ptr: asked of the driver only where it sees several
    GPUs (else 0)."""
    if not several():
        return 0
    attr = _driver.driver().CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(_driver.call("cuPointerGetAttribute", attr, ptr))


def get(ordinal=None) -> Device:
    """The Device of `ordinal` (an int, or a Device), or with None the device of the calling thread's current
    context (device 0 when the thread has none). Errors name the argument."""
    ordinal = check_device_arg(ordinal)
    if isinstance(ordinal, Device):
        return ordinal
    if ordinal is None:
        ordinal = getattr(active, "ordinal", None)   # inside an op: its device's context is the current one
        if ordinal is not None:
            d = _devices.get(ordinal)
            if d is not None:
                return d
        _driver.ensure_context()
        ordinal = int(_driver.call_init("cuCtxGetDevice"))
    d = _devices.get(ordinal)
    if d is not None:
        return d
    n = count()
    if not 0 <= ordinal < n:
        raise ValueError(f"device: ordinal {ordinal} out of range; the driver sees {n} GPU(s) (0..{n - 1})")
    with _lock:
        d = _devices.get(ordinal)
        if d is None:
            d = _devices[ordinal] = Device(ordinal)
    return d


def check_device_arg(device):
    """Validate a wrapper's `device=` argument without touching the GPU (None, an int >= 0 or a Device)."""
    if device is None or isinstance(device, Device):
        return device
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device: expected None, a device ordinal (int) or a kvattn Device, got {type(device).__name__}")
    if device < 0:
        raise ValueError(f"device: expected an ordinal >= 0, got {device}")
    return device
