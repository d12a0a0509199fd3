"""Kernel-level profile of kvattn's (and FlashInfer's, when it imports) batch decode, to run under Nsight Compute:

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \\
        --csv --log-file decode.csv -k regex:'decode|merge|Merge|Batch' \\
        python3 scripts/ncu_decode.py [case ...] [--apart]

Each case issues kvattn's run() twice, then FlashInfer's two decode paths (CUDA cores, tensor cores) twice each;
stdout names the order, so the CSV's kernels (the decode launch and, where a request was split, the merge
kernel) read in the same order. bf16 Hq32/Hkv8/D128, page 16, pages scattered. --apart forces kvattn's merge
kernel (tuning fused_merge=False) where the plan would merge inside the launch. Session 8 found the split-KV
merge's cost this way (BENCHMARKS.md).
"""
import sys

import numpy as np

import kvattn

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = {"b64_L4096": [4096] * 64, "b16_L32768": [32768] * 16, "b1_L65536": [65536], "b1_L2048": [2048],
         "b1_L8192": [8192], "b4_L1024": [1024] * 4}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tuning = dict(fused_merge=False) if "--apart" in sys.argv else None
    try:
        import torch
        import flashinfer
    except Exception as exc:   # peers are optional
        print(f"# FlashInfer not profiled: {exc.__class__.__name__}: {exc}")
        torch = flashinfer = None
    for name in args or CASES:
        lens = np.asarray(CASES[name])
        pt = kvattn.PageTable.from_kv_lens(lens, PAGE, rng=np.random.default_rng(0))
        rng = np.random.default_rng(1)
        bf16 = kvattn._dtypes.to_numpy("bfloat16")
        k = kvattn.from_numpy(rng.standard_normal((pt.num_pages_used, PAGE, HKV, D), np.float32).astype(bf16))
        v = kvattn.from_numpy(rng.standard_normal((pt.num_pages_used, PAGE, HKV, D), np.float32).astype(bf16))
        q = kvattn.from_numpy(rng.standard_normal((len(lens), HQ, D), np.float32).astype(bf16))
        w = kvattn.BatchDecodeWithPagedKVCache(tuning=tuning)
        w.plan(pt, HQ, HKV, D)
        out = kvattn.empty(q.shape, "bfloat16")
        print(f"CASE {name} kvattn x2 (grid {w.last_plan.info['grid']}, merge kernel "
              f"{'yes' if w.last_plan.merge is not None else 'no'})", flush=True)
        for _ in range(2):
            w.run(q, k, v, out=out)
        kvattn._driver.driver().cuCtxSynchronize()
        if flashinfer is None:
            continue
        tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
        ind, idx, last = (torch.from_numpy(np.array(a)).cuda() for a in (pt.indptr, pt.indices, pt.last_page_len))
        for tc in (False, True):
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            fw.plan(ind, idx, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            print(f"CASE {name} FlashInfer use_tensor_cores={tc} x2", flush=True)
            for _ in range(2):
                fw.run(tq, (tk, tv))
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
