"""Event timing for benchmarks: warm-up, then the median of per-call CUDA event intervals."""
from __future__ import annotations

import numpy as np

from .stream import Event, as_stream


def per_call_us(fn, *, stream=None, warmup: int = 5, reps: int = 30) -> np.ndarray:
    """[reps] microseconds of fn() on `stream`, in call order, each call bracketed by its own pair of events."""
    s = as_stream(stream)
    for _ in range(warmup):
        fn()
    starts = [Event() for _ in range(reps)]
    ends = [Event() for _ in range(reps)]
    for a, b in zip(starts, ends):
        a.record(s)
        fn()
        b.record(s)
    ends[-1].synchronize()
    return np.array([a.elapsed_ms(b) * 1e3 for a, b in zip(starts, ends)])


def time_us(fn, *, stream=None, warmup: int = 5, reps: int = 30) -> float:
    """Median microseconds of fn() on `stream` (per_call_us)."""
    return float(np.median(per_call_us(fn, stream=stream, warmup=warmup, reps=reps)))


def copy_bandwidth_tbs(nbytes: int = 2 << 30, reps: int = 30) -> float:
    """The copy ceiling: a device-to-device copy of nbytes, counted as bytes read + written, in TB/s."""
    from . import _driver
    from .memory import empty
    src, dst = empty((nbytes,), "uint8"), empty((nbytes,), "uint8")
    src.fill_bytes(0x5A)
    s = as_stream(None)
    us = time_us(lambda: _driver.call("cuMemcpyDtoDAsync", dst.ptr, src.ptr, nbytes, s.handle), reps=reps)
    return 2 * nbytes / us / 1e6
