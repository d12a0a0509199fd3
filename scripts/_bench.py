"""Shared pieces of the benchmark scripts: random device data, peers' timing, table printing."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvattn  # noqa: E402
from kvattn import _dtypes  # noqa: E402


def random_device(shape, dtype, rng):
    """Random values in +-[0.5, 4) (never zeros) in a new device array: generated on the GPU through CuPy
    when it is installed (fast for GB-sized caches), else on the host."""
    n = int(np.prod(shape))
    try:
        import cupy as cp
    except ImportError:
        host = (rng.standard_normal(shape) + 0.1).astype(_dtypes.to_numpy(dtype))
        return kvattn.from_numpy(host)
    a = kvattn.empty(shape, dtype)
    g = cp.random.default_rng(int(rng.integers(1 << 31)))
    if a.itemsize == 2:
        bits = g.integers(0, 1 << 16, n, dtype=cp.uint32).astype(cp.uint16)
        if dtype == "bfloat16":   # sign | exponent 126..129 | 7 random mantissa bits
            bits = (bits & cp.uint16(0x807F)) | ((cp.uint16(126) + ((bits >> 7) & 3)) << 7).astype(cp.uint16)
        else:                     # float16: sign | exponent 14..17 | 10 random mantissa bits
            bits = (bits & cp.uint16(0x83FF)) | ((cp.uint16(14) + ((bits >> 10) & 3)) << 10).astype(cp.uint16)
        view = cp.ndarray((n,), cp.uint16, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(a.ptr, a.nbytes, a), 0))
        view[...] = bits
    else:
        view = cp.ndarray((n,), cp.float32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(a.ptr, a.nbytes, a), 0))
        view[...] = g.standard_normal(n, dtype=cp.float32)
    cp.cuda.runtime.deviceSynchronize()
    return a


def request_kv(pt, k, v, i: int):
    """Request i's keys and values [kv_len, Hkv, D] (float64 host copies) from NHD paged device caches k / v,
    its pages copied back one by one: for a reference check of one request."""
    pages = pt.pages(i)
    n = int(pt.kv_lens[i])
    kk = np.concatenate([k[int(p)].numpy() for p in pages])[:n]
    vv = np.concatenate([v[int(p)].numpy() for p in pages])[:n]
    return kk.astype(np.float64), vv.astype(np.float64)


def paged_decode_inputs(lens, page: int, hq: int, hkv: int, d: int, rng, dtype="bfloat16"):
    """(page table of scattered pages, q [batch, hq, d], k, v [pages, page, hkv, d]) for a decode batch of these
    KV lengths: fresh random values on the device."""
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), page, rng=rng)
    shape = (pt.num_pages_used, page, hkv, d)
    k, v = random_device(shape, dtype, rng), random_device(shape, dtype, rng)
    return pt, random_device((len(lens), hq, d), dtype, rng), k, v


def decode_cases(names, cases: dict, page: int, hq: int, hkv: int, d: int):
    """Per name: (name, its KV lengths cases[name], page table, q, k, v, a new kvattn Stream), fresh random inputs
    from one generator (seed 0), as paged_decode_inputs makes them."""
    rng = np.random.default_rng(0)
    for name in names:
        lens = cases[name]
        yield (name, lens, *paged_decode_inputs(lens, page, hq, hkv, d, rng), kvattn.Stream())


def last_request_error(pt, q, k, v, out, stream) -> float:
    """Relative L2 error of a decode batch's last request in out against the float64 reference."""
    from kvattn import reference
    i = q.shape[0] - 1
    got = out.numpy(stream)[i:]
    kk, vv = request_kv(pt, k, v, i)
    ro = reference.attention(q[i:].numpy().astype(np.float64), kk, vv)
    return float(np.linalg.norm(got - ro) / np.linalg.norm(ro))


def read_device_global(module, name: bytes) -> np.ndarray:
    """A kernel module's global array `name` (uint64 words, after the device's pending work), zeroed after the
    read so the next launch's stamps start clean (the trace builds' timer stamps)."""
    from kvattn import _driver
    dptr, nbytes = _driver.call("cuModuleGetGlobal", module, name)
    host = np.zeros(nbytes // 8, np.uint64)
    _driver.call("cuCtxSynchronize")
    _driver.call("cuMemcpyDtoH", host.ctypes.data, dptr, nbytes)
    _driver.call("cuMemsetD8", dptr, 0, nbytes)
    return host.astype(np.int64)


def torch_time_us(fn, warmup=5, reps=30):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return float(np.median(ts))


#: seconds of idle before each timing where compute-bound kernels are compared (rest_s): run 45e (BENCHMARKS.md)
#: saw every engine's prefill throttled to ~0.85 of the clock (SW power cap) after 30-80 ms of back-to-back calls
#: and back at full clock after a 3 s pause; so each engine starts from the same power state.
PREFILL_REST_S = 2.0


def rest(seconds: float):
    """Synchronise the device and leave it idle `seconds`, so a compute-bound kernel starts at the full clock."""
    import time
    from kvattn import _driver
    _driver.call("cuCtxSynchronize")
    time.sleep(seconds)


def series_us(fn, n: int, pause: float) -> np.ndarray:
    """[n] microseconds of n back-to-back calls of fn on the legacy stream, after `pause` seconds idle (rest)."""
    from kvattn.timing import per_call_us
    rest(pause)
    return per_call_us(fn, warmup=0, reps=n)


def time_rounds(fns: dict, rounds: int = 3, per_round: dict = None, rest_s: float = 0.0, **time_kw) -> dict:
    """{name: us}: each fn timed by kvattn.timing.time_us in `rounds` rounds, every other round in reverse order,
    and the median of its rounds kept. The GPU's clocks drift under sustained load (BENCHMARKS.md, run 15d; run
    16a timed the same decode kernel 5% faster in its third style than in its first), so one pass in a fixed order
    would favour whichever ran last. rest_s: the device synchronised and left idle that long before each timing
    (keep the timed calls under ~30 ms so they end before the power cap engages: run 45e). per_round (a dict, when
    given) receives each name's round figures in order."""
    from kvattn.timing import time_us
    names = list(fns)
    got = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            if rest_s:
                rest(rest_s)
            got[n].append(time_us(fns[n], **time_kw))
    if per_round is not None:
        per_round.update(got)
    return {n: float(np.median(v)) for n, v in got.items()}


def try_flashinfer():
    try:
        import torch
        import flashinfer
        return torch, flashinfer
    except Exception as exc:  # peers are optional
        print(f"# FlashInfer not measured: {exc.__class__.__name__}: {exc}")
        return None, None


def record(path, **row):
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def table(rows, cols):
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))
