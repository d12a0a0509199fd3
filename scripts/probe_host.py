"""Where run()'s host time goes on the framework path (issue 9): each piece of a decode run() timed alone.

    PYTHONPATH=. python3 scripts/probe_host.py

b1_L2048 decode (bf16 Hq32/Hkv8/D128, page 16) with torch tensors: the median host time (us) of 1600 calls of
each piece, the pieces taking turns (bench_interop.host_us_interleaved: the machine's drift hits them alike, the
device synchronised between turns so the launch queue never fills). Pieces: whole run() in each call style, the
launch alone, the stream lookup, one tensor's import, the pool allocation, and torch's own accessors that the
import reads.
"""
from __future__ import annotations

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
    us = host_us_interleaved(pieces, rounds=8, per_round=200)
    print(f"{'piece':40s} {'us':>7s}")
    for name, t in us.items():
        print(f"{name:40s} {t:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
