"""Host cost of launches: a bare cuLaunchKernel, Kernel.launch with prepared params, and decode run().

    PYTHONPATH=. python scripts/bench_launch.py
"""
import ctypes
import time

import numpy as np

from _bench import kvattn, table
from kvattn import _driver, merge
from kvattn.kernels import get_kernel


def host_us(fn, n=2000, sync=None):
    for _ in range(50):
        fn()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if sync is not None and i % 200 == 199:
            sync()
    return float(np.median(ts) * 1e6)


def main():
    s = kvattn.default_stream()
    o = kvattn.zeros((1, 1, 8), "float32")
    lse = kvattn.zeros((1, 1), "float32")
    k = get_kernel(merge.merge_spec("float32", "float32"))
    p = merge._pair_params(o, lse, o, lse)
    merge._set_out(p, o, lse)
    drv = _driver.driver()
    raw = (ctypes.c_void_p * 1)(p.array.ctypes.data)
    addr = ctypes.addressof(raw)
    rows = [dict(what="bare cuLaunchKernel (prebuilt void**)",
                 us=round(host_us(lambda: drv.cuLaunchKernel(k.function, 1, 1, 1, 32, 1, 1, 0, s.handle, addr, 0),
                                  sync=s.synchronize), 2)),
            dict(what="Kernel.launch (ParamBuffer)",
                 us=round(host_us(lambda: k.launch(1, 32, 0, p, s), sync=s.synchronize), 2))]
    rng = np.random.default_rng(0)
    pt = kvattn.PageTable.from_kv_lens(np.array([64, 100]), 16, rng=rng)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, 32, 8, 128)
    q = kvattn.zeros((2, 32, 128), "bfloat16")
    kc = kvattn.zeros((pt.num_pages_used, 16, 8, 128), "bfloat16")
    out = kvattn.empty((2, 32, 128), "bfloat16")
    rows.append(dict(what="BatchDecode run() (device arrays, out given)",
                     us=round(host_us(lambda: w.run(q, kc, kc, out=out), sync=s.synchronize), 2)))
    t = time.perf_counter()
    for _ in range(200):
        w.plan(pt, 32, 8, 128)
    rows.append(dict(what="BatchDecode plan() incl. H2D copy, batch 2", us=round((time.perf_counter() - t) / 200 * 1e6, 1)))
    s.synchronize()
    table(rows, ["what", "us"])


if __name__ == "__main__":
    main()
