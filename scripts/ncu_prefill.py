"""Kernel-level profile of kvattn's sm90 prefill (and FlashInfer's fa3 on the same tensors, when it imports), to run
under Nsight Compute, e.g. with source-level counters:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section SourceCounters \\
        -k regex:'prefill_sm90_kernel|PrefillWithKVCacheKernel' -o pf \\
        python3 scripts/ncu_prefill.py [case ...]
    ncu --import pf.ncu-rep --page source --csv --print-source sass > pf_sass.csv

Cases: b1_S8192, b8_S2048, b32_S1024 (causal), nc_b1_S8192, nc_b32_S1024 (non-causal; nc_b32_S1024 is the shape
whose units pay 3.4 us beyond their tiles in BENCHMARKS.md, run 26f), d64_b1_S8192 (causal, head dim 64: whether
the MUFU unit (the XU pipe), the tensor cores or the issue slots bound it, BENCHMARKS.md session 46). Each case runs
kvattn twice, then fa3 twice, on torch normal data (bf16, Hq32/Hkv8, head dim 128 unless named, ragged); stdout
names the order of the kernels in the report.
"""
import sys

import numpy as np

import kvattn

HQ, HKV = 32, 8
CASES = {"b1_S8192": (1, 8192, True, 128), "b8_S2048": (8, 2048, True, 128), "b32_S1024": (32, 1024, True, 128),
         "nc_b1_S8192": (1, 8192, False, 128), "nc_b32_S1024": (32, 1024, False, 128),
         "d64_b1_S8192": (1, 8192, True, 64)}


def main():
    import torch
    for name in sys.argv[1:] or ["b1_S8192"]:
        b, s, causal, d = CASES[name]
        q = torch.randn(b * s, HQ, d, dtype=torch.bfloat16, device="cuda")   # [tokens, Hq, D]
        k = torch.randn(b * s, HKV, d, dtype=torch.bfloat16, device="cuda")  # [tokens, Hkv, D]
        v = torch.randn_like(k)
        ip = np.arange(0, (b + 1) * s, s, dtype=np.int32)
        w = kvattn.BatchPrefillWithRaggedKVCache(backend="sm90")
        w.plan(ip, ip, HQ, HKV, d, causal=causal)
        torch.cuda.synchronize()
        print("CASE", name, "kvattn x2", flush=True)
        for _ in range(2):
            w.run(q, k, v)
        torch.cuda.synchronize()
        try:
            import flashinfer
        except ImportError:
            continue
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
        ti = torch.from_numpy(ip).cuda()
        fw.plan(ti, ti, HQ, HKV, d, causal=causal, q_data_type=torch.bfloat16)
        print("CASE", name, "fa3 x2", flush=True)
        for _ in range(2):
            fw.run(q, k, v)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
