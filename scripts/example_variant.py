"""User-written attention variants through the public API: a CUDA struct in a Python string, compiled into kvattn's
decode and prefill kernels by NVRTC on first use (cached on disk), checked against the float64 reference.

    PYTHONPATH=. python3 scripts/example_variant.py

Two variants: `Temperature` (a logits hook: scores divided by a temperature of 2, the same as sm_scale / 2) and
`Dilated` (a keep hook: every query attends to every other key, the keys at even positions). Runs where a GPU is
found; says so and exits 0 otherwise.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvattn  # noqa: E402
from kvattn import reference  # noqa: E402

TEMPERATURE = kvattn.Variant.from_cuda("Temperature", """
struct Temperature : kvattn::VariantBase {
  static constexpr bool kLogits = true;                   // turn the logits hook on
  template <class P> __device__ __forceinline__ static float logits(const P&, float x) { return x * 0.5f; }
};
""")

DILATED = kvattn.Variant.from_cuda("Dilated", """
struct Dilated : kvattn::VariantBase {
  static constexpr bool kKeep = true;                     // turn the keep hook on
  // j: the kv position in the request; diag: the row's causal diagonal (unused here)
  template <class P> __device__ __forceinline__ static bool keep(const P&, int j, int diag) { return (j & 1) == 0; }
};
""")


def main():
    if not kvattn.gpu_available():
        print("example_variant: no CUDA GPU found; nothing to run")
        return 0
    rng = np.random.default_rng(0)
    bf = kvattn._dtypes.to_numpy("bfloat16")
    hq, hkv, d, page = 32, 8, 128, 16
    worst = 0.0

    # decode: 4 requests on a paged cache
    lens = np.array([900, 17, 4096, 300])
    pt = kvattn.PageTable.from_kv_lens(lens, page, rng=rng)
    k = rng.standard_normal((pt.num_pages_used, page, hkv, d)).astype(bf)
    v = rng.standard_normal((pt.num_pages_used, page, hkv, d)).astype(bf)
    q = rng.standard_normal((len(lens), hq, d)).astype(bf)
    for variant in (TEMPERATURE, DILATED):
        w = kvattn.BatchDecodeWithPagedKVCache()
        w.plan(pt, hq, hkv, d, variant=variant)
        got = w.run(q, k, v).numpy()
        ind = np.arange(len(lens) + 1)
        if variant is TEMPERATURE:
            ref = reference.batch_attention_paged(q, k, v, ind, pt, sm_scale=0.5 / np.sqrt(d))
        else:
            masks = [np.arange(n)[None, :] % 2 == 0 for n in lens]
            ref = reference.batch_attention_paged(q, k, v, ind, pt, custom_mask=masks)
        err = max(np.linalg.norm(got[i] - ref[i]) / np.linalg.norm(ref[i]) for i in range(len(lens)))
        worst = max(worst, err)
        print(f"decode  {variant.name:12s} relative L2 error {err:.2e}")

    # causal prefill: 2 ragged requests
    qo, kv = [200, 64], [1000, 64]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    qp = rng.standard_normal((qo_indptr[-1], hq, d)).astype(bf)
    kp = rng.standard_normal((kv_indptr[-1], hkv, d)).astype(bf)
    vp = rng.standard_normal((kv_indptr[-1], hkv, d)).astype(bf)
    for variant in (TEMPERATURE, DILATED):
        w = kvattn.BatchPrefillWithRaggedKVCache()
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, variant=variant)
        got = w.run(qp, kp, vp).numpy()
        for i in range(2):
            qs, ks = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
            mask = np.arange(kv[i])[None, :] <= (kv[i] - qo[i] + np.arange(qo[i]))[:, None]
            scale = 1 / np.sqrt(d)
            if variant is TEMPERATURE:
                scale *= 0.5
            else:
                mask &= np.arange(kv[i])[None, :] % 2 == 0
            ref = reference.attention(qp[qs].astype(np.float64), kp[ks].astype(np.float64), vp[ks].astype(np.float64),
                                      sm_scale=scale, custom_mask=mask)
            err = np.linalg.norm(got[qs] - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
        print(f"prefill {variant.name:12s} relative L2 error {err:.2e} ({w.last_plan.info['backend']} kernel)")
    ok = worst <= 1e-2
    print(f"worst relative L2 error {worst:.2e} (bf16 bound 1e-2): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
