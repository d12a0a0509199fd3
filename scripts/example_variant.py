"""User-written attention variants through the public API: a CUDA struct in a Python string, compiled into kvattn's
decode and prefill kernels by NVRTC on first use (cached on disk), checked against the float64 reference.

    PYTHONPATH=. python3 scripts/example_variant.py

Four variants: `Temperature` (a logits hook: scores divided by a temperature of 2, the same as sm_scale / 2),
`Dilated` (a keep hook: every query attends to every other key, the keys at even positions), `SigmoidAttention`
(no softmax: o = sum_j sigmoid(s_j * sm_scale + bias) v_j, with a scalar parameter `bias`) and `HeadScale` (the
logits of head h scaled by head_scale[h], a per-head parameter array). Runs where a GPU is found; says so and
exits 0 otherwise (the variants still compile: tests/test_variants_cpu.py builds them).
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


# Sigmoid attention: no softmax, o = sum_j sigmoid(s_j * sm_scale + bias) v_j (weights through the prob hook, a
# declared scalar parameter, and an output hook that undoes the kernels' normalisation by the weights' sum).
SIGMOID = kvattn.Variant.from_cuda("SigmoidAttention", """
struct SigmoidAttention : kvattn::VariantBase {
  static constexpr bool kSoftmax = false;
  static constexpr bool kOutput = true;
  // x: the scaled score in log2 units (s * sm_scale * log2 e)
  template <class P> __device__ __forceinline__ static float prob(const P& p, float x) {
    return 1.f / (1.f + exp2f(-(x + SigmoidAttentionParams::bias(p) * kvattn::kLog2e)));
  }
  // the kernels hand over o / sum_j w_j and lse = log(sum_j w_j): the raw sum is o * exp(lse)
  template <class P> __device__ __forceinline__ static float output(const P&, int, float& lse) {
    return lse == KVATTN_NEG_INF ? 0.f : expf(lse);
  }
};
""", params={"bias": "scalar"})

# A per-head logits scale read from a declared per-head parameter array (a positional hook: one constant per row).
HEAD_SCALE = kvattn.Variant.from_cuda("HeadScale", """
struct HeadScale : kvattn::VariantBase {
  static constexpr bool kPositional = true;
  template <class P> __device__ __forceinline__ static float row_init(const P& p, int head, int) {
    return HeadScaleParams::head_scale(p)[head];
  }
  template <class P> __device__ __forceinline__ static float logits_at(const P&, float x, int, int, float rc) {
    return x * rc;
  }
};
""", params={"head_scale": "per_head"})


def sigmoid_reference(q, k, v, scale, bias, mask):
    """float64 (o, lse): o = sum_j sigmoid(s_j * scale + bias) v_j over the kept j, lse = log(sum_j w_j) (the
    state the kernels return). q [qo, Hq, D], k / v [kv, Hkv, D], mask bool [qo, kv]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = np.einsum("qhd,khd->hqk", q, np.repeat(k, g, axis=1)) * scale + bias
    w = np.where(mask[None], 1.0 / (1.0 + np.exp(-s)), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(w.sum(-1)).T
    return np.einsum("hqk,khd->qhd", w, np.repeat(v, g, axis=1)), lse


BIAS = -1.5   # SigmoidAttention's bias


def expected(name, q, k, v, mask, head_scale):
    """The float64 reference of variant `name` for one request: q [qo, Hq, D], k / v [kv, Hkv, D], mask bool
    [qo, kv] (the kernel's own mask: causal or none)."""
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1])
    if name == "Temperature":
        return reference.attention(q64, k64, v64, sm_scale=scale * 0.5, custom_mask=mask)
    if name == "Dilated":
        return reference.attention(q64, k64, v64, custom_mask=mask & (np.arange(k.shape[0])[None, :] % 2 == 0))
    if name == "SigmoidAttention":
        return sigmoid_reference(q64, k64, v64, scale, BIAS, mask)[0]
    return reference.attention(q64 * head_scale[None, :, None], k64, v64, custom_mask=mask)   # HeadScale


def main():
    if not kvattn.gpu_available():
        print("example_variant: no CUDA GPU found; nothing to run")
        return 0
    rng = np.random.default_rng(0)
    bf = kvattn._dtypes.to_numpy("bfloat16")
    hq, hkv, d, page = 32, 8, 128, 16
    head_scale = rng.uniform(0.25, 2.0, hq)
    plan_kw = {"Temperature": {}, "Dilated": {}, "SigmoidAttention": dict(variant_params={"bias": BIAS}),
               "HeadScale": dict(variant_params={"head_scale": head_scale})}
    worst = 0.0

    # decode: 4 requests on a paged cache
    lens = np.array([900, 17, 4096, 300])
    pt = kvattn.PageTable.from_kv_lens(lens, page, rng=rng)
    k = rng.standard_normal((pt.num_pages_used, page, hkv, d)).astype(bf)
    v = rng.standard_normal((pt.num_pages_used, page, hkv, d)).astype(bf)
    q = rng.standard_normal((len(lens), hq, d)).astype(bf)
    for variant in (TEMPERATURE, DILATED, SIGMOID, HEAD_SCALE):
        w = kvattn.BatchDecodeWithPagedKVCache()
        w.plan(pt, hq, hkv, d, variant=variant, **plan_kw[variant.name])
        got = w.run(q, k, v).numpy()
        err = 0.0
        for i, n in enumerate(lens):
            ki = k[pt.pages(i)].reshape(-1, hkv, d)[:n]
            vi = v[pt.pages(i)].reshape(-1, hkv, d)[:n]
            ref = expected(variant.name, q[i:i + 1], ki, vi, np.ones((1, n), bool), head_scale)
            err = max(err, np.linalg.norm(got[i] - ref[0]) / np.linalg.norm(ref[0]))
        worst = max(worst, err)
        print(f"decode  {variant.name:16s} relative L2 error {err:.2e}")

    # causal prefill: 2 ragged requests
    qo, kv = [200, 64], [1000, 64]
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    qp = rng.standard_normal((qo_indptr[-1], hq, d)).astype(bf)
    kp = rng.standard_normal((kv_indptr[-1], hkv, d)).astype(bf)
    vp = rng.standard_normal((kv_indptr[-1], hkv, d)).astype(bf)
    for variant in (TEMPERATURE, DILATED, SIGMOID, HEAD_SCALE):
        w = kvattn.BatchPrefillWithRaggedKVCache()
        w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, variant=variant, **plan_kw[variant.name])
        got = w.run(qp, kp, vp).numpy()
        err = 0.0
        for i in range(2):
            qs, ks = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
            causal = np.arange(kv[i])[None, :] <= (kv[i] - qo[i] + np.arange(qo[i]))[:, None]
            ref = expected(variant.name, qp[qs], kp[ks], vp[ks], causal, head_scale)
            err = max(err, np.linalg.norm(got[qs] - ref) / np.linalg.norm(ref))
        worst = max(worst, err)
        print(f"prefill {variant.name:16s} relative L2 error {err:.2e} ({w.last_plan.info['backend']} kernel)")
    ok = worst <= 1e-2
    print(f"worst relative L2 error {worst:.2e} (bf16 bound 1e-2): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
