"""Block-sparse attention on the GPU: kvattn.BlockSparseAttentionWrapper vs kvattn's dense non-causal prefill and
FlashInfer's BlockSparseAttentionWrapper, same process.

    PYTHONPATH=. python scripts/bench_block_sparse.py [--no-peers] [--json out.jsonl] [--warm-peers]

8192 x 8192, bf16, Hq 32 / Hkv 8 / D 128, random block patterns. TFLOP/s count the stored blocks only
(4 * nnz_blocks * R * C * Hq * D); vs_dense: that rate over kvattn's dense non-causal prefill (ragged, the same
q / k / v) in the same process; kv_TBps: the K / V bytes the block rows read (each block row its own blocks) per
second (at R = 1 the rate is bound by these reads: each byte serves one query row of each of the group's heads);
by_windows_us: the walk ordered by L2 windows of each block row's own K/V bytes, as
before session 37 (one window now: every row reads the one k / v). sm80_us: the same pattern forced onto the mma.sync kernel. torch_us: torch tensors in, out=None. err: relative L2 error of 8 sampled block
rows against the float64 reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, record, table, try_flashinfer  # noqa: E402
from kvattn import reference  # noqa: E402
from kvattn.formats import BlockSparse  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D, S = 32, 8, 128, 8192
CASES = {"R64_C64_10%": (64, 64, 0.10), "R64_C64_50%": (64, 64, 0.50), "R1_C16_10%": (1, 16, 0.10)}


def pattern(rng, r, c, density):
    mb, nb = S // r, S // c
    blocks = rng.random((mb, nb)) < density
    rows, cols = np.nonzero(blocks)
    return BlockSparse(np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=mb))]), cols, (r, c), (S, S))


def sample_error(rng, bsr, q, k, v, out):
    r, _ = bsr.block_shape
    worst = 0.0
    for i in rng.choice(bsr.num_block_rows, 8, replace=False):
        rows = slice(i * r, (i + 1) * r)
        cols = bsr.columns(int(i))
        ref = reference.attention(q[rows], k[cols], v[cols])
        worst = max(worst, float(np.linalg.norm(out[rows] - ref) / max(np.linalg.norm(ref), 1e-30)))
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm-peers", action="store_true")
    args = ap.parse_args()
    import torch
    rng = np.random.default_rng(0)
    _, fi = (None, None) if args.no_peers else try_flashinfer()
    if args.warm_peers:
        bsr = pattern(rng, 64, 64, 0.1)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        fw = fi.BlockSparseAttentionWrapper(ws)
        dev = lambda a: torch.from_numpy(np.array(a, np.int32)).cuda()
        fw.plan(dev(bsr.indptr), dev(bsr.indices), S, S, 64, 64, HQ, HKV, D, q_data_type=torch.bfloat16)
        print("warm: block-sparse", flush=True)
        return
    tq = torch.randn((S, HQ, D), dtype=torch.bfloat16, device="cuda")
    tk = torch.randn((S, HKV, D), dtype=torch.bfloat16, device="cuda")
    tv = torch.randn((S, HKV, D), dtype=torch.bfloat16, device="cuda")
    qa, ka, va = kvattn.asarray(tq), kvattn.asarray(tk), kvattn.asarray(tv)
    out = kvattn.empty((S, HQ, D), "bfloat16")
    dense = kvattn.BatchPrefillWithRaggedKVCache()
    dense.plan([0, S], [0, S], HQ, HKV, D)
    dense_us = time_us(lambda: dense.run(qa, ka, va, out=out))
    dense_tf = 4 * S * S * HQ * D / dense_us / 1e6
    print(f"dense non-causal S{S}: {dense_us:.0f} us, {dense_tf:.0f} TFLOP/s ({dense.last_plan.info['backend']}); "
          f"GPU {kvattn._driver.device_name()}")
    qh, kh, vh = (x.float().cpu().numpy() for x in (tq, tk, tv))
    rows = []
    for name, (r, c, density) in CASES.items():
        bsr = pattern(rng, r, c, density)
        flops = 4 * bsr.nnz_blocks * r * c * HQ * D
        w = kvattn.BlockSparseAttentionWrapper()
        w.plan(bsr, HQ, HKV, D)
        us = time_us(lambda: w.run(qa, ka, va, out=out))
        row = dict(case=name, blocks=bsr.nnz_blocks, us=round(us, 1), TFLOPs=round(flops / us / 1e6, 1),
                   vs_dense=round(flops / us / 1e6 / dense_tf, 2), backend=w.last_plan.info["backend"],
                   tile=w.last_plan.info["cta_rows"])
        row["kv_TBps"] = round(bsr.nnz_blocks * c * HKV * D * 2 * 2 / us / 1e6, 2)   # K and V bytes each row block reads
        if r > 1:   # the walk as before session 37: block rows ordered by L2 windows of their own K/V bytes
            wb = kvattn.BlockSparseAttentionWrapper()
            wb._own_kv = True
            wb.plan(bsr, HQ, HKV, D)
            row["by_windows_us"] = round(time_us(lambda: wb.run(qa, ka, va, out=out)), 1)
        w80 = kvattn.BlockSparseAttentionWrapper(backend="sm80")
        w80.plan(bsr, HQ, HKV, D)
        row["sm80_us"] = round(time_us(lambda: w80.run(qa, ka, va, out=out)), 1)
        row["torch_us"] = round(time_us(lambda: w.run(tq, tk, tv)), 1)
        o = torch.from_dlpack(w.run(tq, tk, tv)).float().cpu().numpy()
        row["err"] = f"{sample_error(rng, bsr, qh, kh, vh, o):.1e}"
        if fi is not None:
            try:
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                fw = fi.BlockSparseAttentionWrapper(ws)
                dev = lambda a: torch.from_numpy(np.array(a, np.int32)).cuda()
                fw.plan(dev(bsr.indptr), dev(bsr.indices), S, S, r, c, HQ, HKV, D, q_data_type=torch.bfloat16)
                fus = time_us(lambda: fw.run(tq, tk, tv))
                row.update(fi_us=round(fus, 1), fi_TFLOPs=round(flops / fus / 1e6, 1), vs_fi=round(fus / us, 2))
            except Exception as exc:
                row["fi_us"] = f"error {exc.__class__.__name__}: {str(exc)[:60]}"
        torch.cuda.synchronize()
        record(args.json, **row)
        print(row, flush=True)
        rows.append(row)
    print(f"\nblock-sparse {S}x{S}, bf16 Hq32/Hkv8/D128; TFLOP/s on stored blocks; dense non-causal {dense_tf:.0f}")
    table(rows, ["case", "blocks", "us", "TFLOPs", "vs_dense", "by_windows_us", "kv_TBps", "sm80_us", "torch_us", "fi_us", "fi_TFLOPs",
                 "vs_fi", "err", "backend", "tile"])


if __name__ == "__main__":
    main()
