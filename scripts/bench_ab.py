"""A/B of this checkout's kernels against an older tree's, in one process: the decode and prefill anchors on both,
alternating, median of 30 per measurement, median of 3 rounds; and the default instances' registers and spills.

    git archive <commit> kvattn cuda_src | tar x -C /tmp/ab_old      # the older tree (kvattn/ and cuda_src/)
    PYTHONPATH=. python3 scripts/bench_ab.py --old /tmp/ab_old [--regs-only]

The older tree is imported as the package `kvattn_ab_old` (its cuda_src inside it), so its kernels have their own
cache keys and both sets live in one CUDA context. Each side runs on its own arrays, filled with the same bytes.
--regs-only compiles both default sets (no GPU needed) and prints the register / spill table.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import kvattn, random_device, table  # noqa: E402
from bench_decode import MAIN as DECODE_CASES  # noqa: E402
from kvattn import timing  # noqa: E402,F401  (kvattn.timing below)

HQ, HKV, D, PAGE = 32, 8, 128, 16
PREFILL_CASES = {"causal b1_S8192": (1, 8192, "auto"), "causal b8_S2048": (8, 2048, "auto"),
                 "causal b8_S2048 sm80": (8, 2048, "sm80"), "causal b64_S512": (64, 512, "auto")}


def load_old(tree: str):
    """The older tree as the package kvattn_ab_old."""
    root = tempfile.mkdtemp(prefix="kvattn_ab_")
    pkg = os.path.join(root, "kvattn_ab_old")
    shutil.copytree(os.path.join(tree, "kvattn"), pkg)
    shutil.copytree(os.path.join(tree, "cuda_src"), os.path.join(pkg, "cuda_src"))
    sys.path.insert(0, root)
    return importlib.import_module("kvattn_ab_old")


_TRAITS = re.compile(r"^(kvattn::\w+)<kvattn::AttnTypes<(\d+), (\d+), ([\w:]+), ([\w:]+), ([\w:]+)>, (.*)>$")


def _key(kernel: str) -> str:
    """A kernel name in one spelling across trees, so that their instances line up: the types and head dims
    (`kvattn::AttnTypes<D, D, T, KV, T>`, equal dims and q's output type) as the older trees' separate arguments
    (`<D, ..., T, KV>`; prefill spelled KV only where it differed from T), the variant as flags
    (`kvattn::Builtin<a, b, c>` -> `a, b, c`), decode's custom-mask flag (older trees spelled it) dropped."""
    m = _TRAITS.match(kernel)
    if m and m[2] == m[3] and m[4] == m[6]:
        name, d, q, kv, rest = m[1], m[2], m[4], m[5], m[7]
        kernel = f"{name}<{d}, {rest}, {q}" + (f", {kv}" if name.endswith("decode_kernel") or kv != q else "") + ">"
    k = re.sub(r"kvattn::Builtin<([^>]*)>", r"\1", kernel).replace("kvattn::", "")
    return re.sub(r"^(decode_kernel<\d+, \d+, \d+, \w+, \w+), false\b", r"\1", k)


def registers(mod):
    """{kernel name expression: (registers, spill bytes)} of a package's registered default instances."""
    importlib.import_module(mod.__name__ + ".timing")
    importlib.import_module(mod.__name__ + ".decode")
    importlib.import_module(mod.__name__ + ".prefill")
    out = {}
    for specs in mod.kernels.REGISTRY.values():
        for spec in specs:
            compiled, _ = spec.compile("sm_90a")
            for name, r in compiled.resources.items():
                out[_key(spec.kernel)] = (r.registers, r.spills)
    return out


def regs_table(old):
    a, b = registers(old), registers(kvattn)
    rows = []
    for k in sorted(set(a) & set(b)):
        rows.append(dict(kernel=k[:96], old=f"{a[k][0]}r {a[k][1]}B", new=f"{b[k][0]}r {b[k][1]}B",
                         same="yes" if a[k] == b[k] else ("better" if b[k] <= a[k] else "WORSE")))
    print(f"\ndefault instances: registers / spill bytes ({len(rows)} in both trees)")
    table(rows, ["kernel", "old", "new", "same"])
    return all(r["same"] != "WORSE" for r in rows)


def twin(mod, a):
    """A copy of kvattn DeviceArray a in package mod's own array type (device-to-device)."""
    b = mod.empty(a.shape, a.dtype_name)
    kvattn._driver.call("cuMemcpyDtoD", b.ptr, a.ptr, a.nbytes)
    return b


def decode_runner(mod, pt, arrays):
    q, k, v = (twin(mod, x) for x in arrays) if mod is not kvattn else arrays
    out = mod.empty(q.shape, "bfloat16")
    if mod is not kvattn:   # the package's own PageTable type
        pt = mod.PageTable(pt.indptr, pt.indices, pt.last_page_len, pt.page_size)
    w = mod.BatchDecodeWithPagedKVCache()
    w.plan(pt, HQ, HKV, D)
    return lambda: w.run(q, k, v, out=out)


def prefill_runner(mod, b, s, backend, arrays):
    q, k, v = (twin(mod, x) for x in arrays) if mod is not kvattn else arrays
    out = mod.empty(q.shape, "bfloat16")
    indptr = np.arange(b + 1, dtype=np.int32) * s
    w = mod.BatchPrefillWithRaggedKVCache(backend=backend)
    w.plan(indptr, indptr, HQ, HKV, D, causal=True)
    return lambda: w.run(q, k, v, out=out)


def ab(name, old, fa, fb, unit):
    """Each side timed by its own package on its own default stream (older trees run stream=None on a stream of
    their own), alternating, so clock and thermal drift hit both sides alike."""
    ta, tb = [], []
    for _ in range(3):
        ta.append(old.timing.time_us(fa, reps=30))
        tb.append(kvattn.timing.time_us(fb, reps=30))
    a, b = float(np.median(ta)), float(np.median(tb))
    return dict(case=name, old=unit(a), new=unit(b), **{"old/new": f"{a / b:.3f}"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="a tree with the older kvattn/ and cuda_src/")
    ap.add_argument("--regs-only", action="store_true")
    args = ap.parse_args()
    old = load_old(args.old)
    regs_ok = regs_table(old)
    if args.regs_only:
        return 0 if regs_ok else 1
    if not kvattn.gpu_available():
        print("bench_ab: no CUDA GPU found; registers compared only")
        return 0 if regs_ok else 1
    rng = np.random.default_rng(0)
    print(f"GPU {kvattn._driver.device_name()}")
    rows = []
    us = lambda t: f"{t:.1f} us"   # noqa: E731
    cases = {name: (lens, PAGE) for name, lens in DECODE_CASES.items()}
    cases.update({"b1_L2048": ([2048], PAGE), "b4_L1024": ([1024] * 4, PAGE),   # fewer CTAs than SMs
                  "b1_L8192": ([8192], PAGE), "b64_L4096 page 1": ([4096] * 64, 1)})
    for name, (lens, page) in cases.items():
        pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), page, rng=rng)
        shape = (pt.num_pages_used, page, HKV, D)
        arrays = (random_device((len(lens), HQ, D), "bfloat16", rng), random_device(shape, "bfloat16", rng),
                  random_device(shape, "bfloat16", rng))
        rows.append(ab(f"decode {name}", old, decode_runner(old, pt, arrays), decode_runner(kvattn, pt, arrays), us))
        del arrays
    for name, (b, s, backend) in PREFILL_CASES.items():
        arrays = (random_device((b * s, HQ, D), "bfloat16", rng), random_device((b * s, HKV, D), "bfloat16", rng),
                  random_device((b * s, HKV, D), "bfloat16", rng))
        flops = 2 * b * HQ * s * s * D   # causal: half of the full 4 b H s^2 D
        rows.append(ab(f"prefill {name}", old, prefill_runner(old, b, s, backend, arrays),
                       prefill_runner(kvattn, b, s, backend, arrays), lambda t: f"{flops / t / 1e6:.0f} TFLOP/s"))
    print("\nA/B: the older tree's kernels vs this checkout's (median of 3 rounds of median-of-30; old/new > 1: new "
          "is faster)")
    table(rows, ["case", "old", "new", "old/new"])
    worst = min(float(r["old/new"]) for r in rows)
    print(f"worst old/new {worst:.3f} (within 2%: {'yes' if worst >= 0.98 else 'NO'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
