"""Context-parallel decode and causal prefill across GPUs (issue 14's targets), one process per GPU:

    PYTHONPATH=. python3 scripts/launch_cp.py --nproc 2 scripts/bench_cp.py [--context 1048576] [--batch 1,8]
                                                                             [--prefill 131072]
    PYTHONPATH=. python3 scripts/bench_cp.py ...          (a world of one: the one-GPU baseline alone)

Every rank builds the same full page table (bf16 Hq32/Hkv8/D128, page 16, pages scattered), keeps its shard
(kvattn.cp.shard_page_table) and fills it with values that are a function of the full table's page id and the
element (CuPy on the GPU), so rank 0 can also build the whole cache and time the one-GPU decode on it. Rank 0
prints, per batch: the one-GPU time, the context-parallel time (median of 30, CUDA events on the stream; every
rank's local attention and exchange + merge apart), the speedup (target >= 1.8x on 2 GPUs) and the largest
relative L2 difference to the one-GPU output (target: within the bf16 bound, 1e-2), with PASS / FAIL.
--prefill N (0: none): a causal prompt of N tokens split in zigzag chunks (kvattn.cp.ContextParallelPrefill); each
rank fills its shard's q / k / v from the positions it holds, rank 0 also the whole prompt for the one-GPU ragged
prefill; printed: both times, the exchange (all-gather + reorder) and attention apart, the parallel efficiency
(one GPU / (world x context-parallel); target >= 0.85) and rank 0's rows against the one-GPU output.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvattn  # noqa: E402
from kvattn.cp import ContextParallelDecode, ContextParallelPrefill, communicator_from_env  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def fill_pages(pages: np.ndarray, salt: int):
    """A [len(pages), PAGE, HKV, D] bf16 device array whose values depend only on (page id, element, salt)."""
    return hashed(pages, (PAGE, HKV, D), salt)


def hashed(ids: np.ndarray, row: tuple, salt: int):
    """A [len(ids), *row] bf16 device array whose values depend only on (id, element, salt): every rank builds its
    part of a tensor that rank 0 can build whole."""
    import cupy as cp
    per = int(np.prod(row))
    pid = cp.asarray(ids.astype(np.uint64))
    idx = cp.arange(per, dtype=cp.uint64)
    h = (pid[:, None] * cp.uint64(per) + idx[None, :] + cp.uint64(salt << 40)) * cp.uint64(0x9E3779B97F4A7C15)
    h ^= h >> cp.uint64(29)
    x = ((h >> cp.uint64(40)).astype(cp.float32) / cp.float32(1 << 24) - cp.float32(0.5)) * cp.float32(4.0)
    out = kvattn.empty((len(ids),) + tuple(row), "bfloat16")
    bits = x.view(cp.uint32) + cp.uint32(0x7FFF) + ((x.view(cp.uint32) >> cp.uint32(16)) & cp.uint32(1))
    cp.cuda.runtime.memcpy(out.ptr, (bits >> cp.uint32(16)).astype(cp.uint16).data.ptr, out.nbytes, 3)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1 << 20)
    ap.add_argument("--batch", default="1,8", help="decode batch sizes (empty: no decode)")
    ap.add_argument("--prefill", type=int, default=0, help="causal prefill prompt length (0: none)")
    a = ap.parse_args()
    comm = communicator_from_env()
    rank, world = comm.rank, comm.nranks
    ok = True
    for b in (int(x) for x in a.batch.split(",") if x):
        pt = kvattn.PageTable.from_kv_lens(np.full(b, a.context), PAGE, rng=np.random.default_rng(b))
        qh = np.random.default_rng(100 + b).standard_normal((b, HQ, D)).astype(kvattn._dtypes.to_numpy("bfloat16"))
        q = kvattn.from_numpy(qh)
        cp_dec = ContextParallelDecode(comm)
        shards = cp_dec.plan(pt, HQ, HKV, D)
        k, v = fill_pages(shards.pages[rank], 1), fill_pages(shards.pages[rank], 2)
        o, _ = cp_dec.run(q, k, v)
        t = {}
        cp_dec.run(q, k, v, timings=t)
        us = time_us(lambda: cp_dec.run(q, k, v))
        if rank != 0:
            continue
        one = kvattn.BatchDecodeWithPagedKVCache()
        one.plan(pt, HQ, HKV, D)
        pool = pt.num_pages_used
        kf, vf = fill_pages(np.arange(pool), 1), fill_pages(np.arange(pool), 2)
        ref = one.run(q, kf, vf)
        one_us = time_us(lambda: one.run(q, kf, vf))
        r, g = ref.numpy().astype(np.float64), o.numpy().astype(np.float64)
        diff = max(float(np.linalg.norm(g[i] - r[i]) / np.linalg.norm(r[i])) for i in range(b))
        speed = one_us / us
        good = diff <= 1e-2 and (world == 1 or speed >= 0.9 * world)
        ok &= good
        print(f"decode b{b} context {a.context} world {world}: one GPU {one_us:.1f} us, context-parallel {us:.1f} us "
              f"(attention {t['attention_us']:.1f}, exchange + merge {t['exchange_merge_us']:.1f}), speedup "
              f"{speed:.2f}x (target >= {0.9 * world:.1f}x), max rel diff {diff:.1e}: {'PASS' if good else 'FAIL'}",
              flush=True)
    if a.prefill:
        ok &= prefill(comm, a.prefill)
    comm.destroy()
    sys.exit(0 if ok else 1)


def prefill(comm, n: int) -> bool:
    rank, world = comm.rank, comm.nranks
    cpp = ContextParallelPrefill(comm)
    zz = cpp.plan(n, HQ, HKV, D)
    rows = zz.positions[rank]
    q, k, v = hashed(rows, (HQ, D), 3), hashed(rows, (HKV, D), 4), hashed(rows, (HKV, D), 5)
    o = cpp.run(q, k, v)
    t = {}
    cpp.run(q, k, v, timings=t)
    us = time_us(lambda: cpp.run(q, k, v), warmup=2, reps=10)
    if rank != 0:
        return True
    allpos = np.arange(n)
    qf, kf, vf = hashed(allpos, (HQ, D), 3), hashed(allpos, (HKV, D), 4), hashed(allpos, (HKV, D), 5)
    one = kvattn.BatchPrefillWithRaggedKVCache()
    ip = np.array([0, n], np.int32)
    one.plan(ip, ip, HQ, HKV, D, causal=True)
    ref = one.run(qf, kf, vf)
    one_us = time_us(lambda: one.run(qf, kf, vf), warmup=2, reps=10)
    r, g = ref.numpy()[rows].astype(np.float64), o.numpy().astype(np.float64)
    diff = float(np.linalg.norm(g - r) / np.linalg.norm(r))
    eff = one_us / (world * us)
    good = diff <= 1e-2 and (world == 1 or eff >= 0.85)
    print(f"causal prefill {n} tokens world {world}: one GPU {one_us:.1f} us, context-parallel {us:.1f} us (exchange "
          f"{t['exchange_us']:.1f}, attention {t['attention_us']:.1f}), parallel efficiency {eff:.2f} (target >= 0.85), "
          f"rank 0's rows rel diff {diff:.1e}: {'PASS' if good else 'FAIL'}", flush=True)
    return good


if __name__ == "__main__":
    main()
