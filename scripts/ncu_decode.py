"""Kernel-level profile of kvattn's (and FlashInfer's, when it imports) batch decode, to run under Nsight Compute:

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \\
        --csv --log-file decode.csv -k regex:'decode|merge|Merge|Batch' \\
        python3 scripts/ncu_decode.py [case ...] [--apart] [--rope]   (cases: bench_decode.py's, e.g. b64_L4096_GQA32)

Each case issues kvattn's run() twice, then FlashInfer's two decode paths (CUDA cores, tensor cores) twice each;
stdout names the order, so the CSV's kernels (the decode launch and, where a request was split, the merge
kernel) read in the same order. Shapes and data as bench_decode.py builds them. --apart forces kvattn's merge
kernel (tuning fused_merge=False) where the plan would merge inside the launch; --rope plans kvattn's fused RoPE
(NeoX, theta 5e5; FlashInfer then runs without it). Session 8 found the split-KV
merge's cost this way (BENCHMARKS.md).
"""
import sys

import numpy as np

from _bench import kvattn
from bench_decode import MAIN, build, extra_cases

BASE = dict(hq=32, hkv=8, d=128, dtype="bfloat16", layout="NHD", page=16)
CASES = {**{k: (v, BASE) for k, v in MAIN.items()}, **extra_cases()}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tuning = dict(fused_merge=False) if "--apart" in sys.argv else None
    rope = dict(rope=kvattn.RoPE(theta=5e5)) if "--rope" in sys.argv else {}
    try:
        import torch
        import flashinfer
    except Exception as exc:   # peers are optional
        print(f"# FlashInfer not profiled: {exc.__class__.__name__}: {exc}")
        torch = flashinfer = None
    for name in args or list(MAIN) + ["b1_L2048"]:
        lens, cfg = CASES[name]
        pt, q, k, v = build(lens, cfg, np.random.default_rng(0))
        hq, hkv, d, dtype, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"]
        w = kvattn.BatchDecodeWithPagedKVCache(kv_layout=cfg["layout"], tuning=tuning)
        w.plan(pt, hq, hkv, d, q_dtype=dtype, **rope)
        out = kvattn.empty(q.shape, dtype)
        print(f"CASE {name} kvattn x2 (grid {w.last_plan.info['grid']}, merge kernel "
              f"{'yes' if w.last_plan.merge is not None else 'no'})", flush=True)
        for _ in range(2):
            w.run(q, k, v, out=out)
        kvattn._driver.driver().cuCtxSynchronize()
        if flashinfer is None or cfg["layout"] != "NHD":
            continue
        dt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
        ind, idx, last = (torch.from_numpy(np.array(a)).cuda() for a in (pt.indptr, pt.indices, pt.last_page_len))
        for tc in (False, True):
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            try:
                fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                fw.plan(ind, idx, last, hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)
                print(f"CASE {name} FlashInfer use_tensor_cores={tc} x2", flush=True)
                for _ in range(2):
                    fw.run(tq, (tk, tv))
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"# FlashInfer {name} tc={tc}: {exc.__class__.__name__}: {str(exc)[:100]}")


if __name__ == "__main__":
    main()
