"""Where run()'s host time goes on the framework path (issue 9): each piece of a decode run() timed alone.

    PYTHONPATH=. python3 scripts/probe_host.py

b1_L2048 decode (bf16 Hq32/Hkv8/D128, page 16) with torch tensors: the median host time (us) of 1600 calls of
each piece, the pieces taking turns (bench_interop.host_us_interleaved: the machine's drift hits them alike, the
device synchronised between turns so the launch queue never fills). Pieces: whole run() in each call style, the
launch alone, the stream lookup, one tensor's import, the pool allocation, and torch's own accessors that the
import reads; then causal ragged prefill run() and its launch alone (b8_S2048 and b1_S256, kvattn arrays); then
the kvattn-array runs again, each on an idle GPU (the device synchronised before every call).
"""
from __future__ import annotations

import time

import numpy as np

import kvattn
from kvattn import _interop, pool
from kvattn._binding import begin
from bench_interop import host_us_interleaved

HQ, HKV, D, PAGE = 32, 8, 128, 16


def main():
    try:
        import torch
    except ImportError:
        print("probe_host needs PyTorch")
        return 0
    rng = np.random.default_rng(0)
    pt = kvattn.PageTable.from_kv_lens(np.array([2048]), PAGE, rng=rng)
    tk = torch.randn((pt.num_pages_used, PAGE, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn_like(tk)
    tq = torch.randn((1, HQ, D), dtype=torch.bfloat16, device="cuda")
    tout = torch.empty_like(tq)
    torch.cuda.synchronize()
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    q, k, v = kvattn.asarray(tq), kvattn.asarray(tk), kvattn.asarray(tv)
    out = kvattn.empty(q.shape, "bfloat16")
    w.run(q, k, v, out=out)
    p = w.last_plan
    s, capturing = begin(None)
    launch = p.launches[0]
    raw = torch._C._cuda_getCurrentRawStream
    bf = np.dtype(out.dtype)
    pieces = {
        "run: kvattn arrays, out given": lambda: w.run(q, k, v, out=out),
        "run: kvattn arrays, out=None": lambda: w.run(q, k, v),
        "run: torch tensors, out=None": lambda: w.run(tq, tk, tv),
        "run: torch tensors, torch out": lambda: w.run(tq, tk, tv, out=tout),
        "the attention launch alone": lambda: launch.launch(s.handle),
        "begin(None) (stream lookup)": lambda: begin(None),
        "import one torch tensor": lambda: _interop.import_array(tk, s, False),
        "import one kvattn array": lambda: _interop.import_array(k, s, False),
        "pool_empty (free list hit)": lambda: pool.pool_empty((1, HQ, D), bf, s, 0),
        "torch: x.get_device()": lambda: tk.get_device(),
        "torch: x.data_ptr()": lambda: tk.data_ptr(),
        "torch: tuple(x.shape)": lambda: tuple(tk.shape),
        "torch: x.stride()": lambda: tk.stride(),
        "torch: x.dtype": lambda: tk.dtype,
        "torch: current raw stream": lambda: raw(0),
        "empty lambda": lambda: None,
    }
    # prefill's run() took ~5 us more host time than decode's on the H200's host (run 45b: 15.4 against 10.1 us, kvattn
    # arrays, out given) while its Python is within 0.6 us of decode's (probe_host_cpu.py): its launch alone, for a
    # causal ragged b8_S2048 (a 0.5 ms kernel: the queue stays busy) and b1_S256 (a short one), beside decode's
    for name, b, sl in (("b8_S2048", 8, 2048), ("b1_S256", 1, 256)):
        ip = np.arange(0, (b + 1) * sl, sl, dtype=np.int32)
        pw = kvattn.BatchPrefillWithRaggedKVCache()
        pw.plan(ip, ip, HQ, HKV, D, causal=True)
        pq = kvattn.asarray(torch.randn((b * sl, HQ, D), dtype=torch.bfloat16, device="cuda"))
        pk, pv = (kvattn.asarray(torch.randn((b * sl, HKV, D), dtype=torch.bfloat16, device="cuda")) for _ in "kv")
        po = kvattn.empty(pq.shape, "bfloat16")
        pw.run(pq, pk, pv, out=po)
        pieces[f"prefill {name} run: kvattn arrays, out given"] = \
            lambda pw=pw, a=(pq, pk, pv), po=po: pw.run(*a, out=po)
        pieces[f"prefill {name}: the launch alone"] = lambda pl=pw.last_plan.launches[0]: pl.launch(s.handle)
    torch.cuda.synchronize()
    us = host_us_interleaved(pieces, rounds=8, per_round=200)
    print(f"{'piece':40s} {'us':>7s}")
    for name, t in us.items():
        print(f"{name:40s} {t:7.2f}")
    # The same runs each timed on an idle GPU (synchronised before every call, untimed): a launch behind a queue of
    # long kernels may cost the driver more than one on an idle GPU (prefill's run() read 12-15 us in run 51a's
    # bench_interop against decode's 8.7, its Python ~1.5 us more on that host)
    idle = {n: f for n, f in pieces.items() if n.startswith(("run: kvattn", "prefill"))}
    print(f"{'the same, on an idle GPU (median of 400)':40s} {'us':>7s}")
    for name, fn in idle.items():
        print(f"{name:40s} {host_us_idle(fn):7.2f}")
    return 0


def host_us_idle(fn, n=400) -> float:
    """Median host time (us) of one call of fn, the device synchronised (untimed) before each."""
    sync = kvattn._driver.driver().cuCtxSynchronize
    samples = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    sync()
    return float(np.median(samples) * 1e6)


if __name__ == "__main__":
    raise SystemExit(main())
