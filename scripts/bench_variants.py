"""What a variant costs: decode and prefill anchors with each variant against the plain kernel, in one process.

    PYTHONPATH=. python3 scripts/bench_variants.py [--decode]

Decode: bf16 Hq32/Hkv8/D128, page 16, scattered pages (us, fraction of the plain kernel's time). Prefill: causal
ragged b1 x 8192 (TFLOP/s). Variants: ALiBi (built-in, per-head slopes), attention sinks (built-in, per-head
logits), fused RoPE (built-in, NeoX and GPT-J, theta 5e5) and a user variant through
kvattn.Variant.from_cuda (HalfLogits, a logits hook). Every case is checked against the float64 reference on a
sample of requests / rows in the same run.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _bench import kvattn, random_device, table, time_rounds  # noqa: E402
from _user_variants import HALF_LOGITS  # noqa: E402
from kvattn import reference  # noqa: E402
from kvattn.timing import time_us  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SLOPES = 2.0 ** (-8.0 * (np.arange(HQ) + 1) / HQ)
SINKS = np.linspace(-2.0, 4.0, HQ)
ROPE = kvattn.RoPE(theta=5e5)
ROPE_GPTJ = kvattn.RoPE(theta=5e5, interleave=True)
VARIANTS = {"plain": {}, "alibi": dict(alibi_slopes=SLOPES), "sinks": dict(sinks=SINKS), "rope": dict(rope=ROPE),
            "rope GPT-J": dict(rope=ROPE_GPTJ), "user HalfLogits": dict(variant=HALF_LOGITS)}


def expected(name, q, k, v, causal=False):
    """float64 reference of variant `name` for one request: q [qo, Hq, D], k / v [kv, Hkv, D] (host arrays)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    kw = {"plain": {}, "alibi": dict(alibi_slopes=SLOPES), "sinks": dict(sinks=SINKS), "rope": {}, "rope GPT-J": {},
          "user HalfLogits": dict(sm_scale=0.5 / np.sqrt(D))}[name]
    if name.startswith("rope"):   # rotated at their positions: keys at j, query row r at kv - qo + r
        kv, qo = k.shape[0], q.shape[0]
        gptj = name == "rope GPT-J"
        q = reference.apply_rope(q, kv - qo + np.arange(qo), rope_theta=ROPE.theta, interleave=gptj)
        k = reference.apply_rope(k, np.arange(kv), rope_theta=ROPE.theta, interleave=gptj)
    return reference.attention(q, k, v, causal=causal, **kw)


def decode_rows(rng):
    rows = []
    for case, lens in (("b64_L4096", [4096] * 64), ("b16_L32768", [32768] * 16), ("b1_L65536", [65536])):
        pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=rng)
        shape = (pt.num_pages_used, PAGE, HKV, D)
        k, v = random_device(shape, "bfloat16", rng), random_device(shape, "bfloat16", rng)
        q = random_device((len(lens), HQ, D), "bfloat16", rng)
        out = kvattn.empty(q.shape, "bfloat16")
        row = dict(case=case)
        wrappers = {}
        for name, kw in VARIANTS.items():
            w = wrappers[name] = kvattn.BatchDecodeWithPagedKVCache()
            w.plan(pt, HQ, HKV, D, **kw)
        times = time_rounds({name: lambda w=w: w.run(q, k, v, out=out) for name, w in wrappers.items()})
        base = times["plain"]
        for name, w in wrappers.items():
            us = times[name]
            w.run(q, k, v, out=out)
            i = int(rng.integers(len(lens)))   # one request against the reference (its pages copied back)
            pages = pt.pages(i)
            kk = np.concatenate([k[int(pg)].numpy() for pg in pages])[:lens[i]]
            vv = np.concatenate([v[int(pg)].numpy() for pg in pages])[:lens[i]]
            ro = expected(name, q[i:i + 1].numpy(), kk, vv)
            err = float(np.linalg.norm(out[i:i + 1].numpy() - ro) / np.linalg.norm(ro))
            row[name] = f"{us:.1f}us {base / us:.3f} err {err:.0e}"
        rows.append(row)
    return rows


def prefill_rows(rng):
    s = 8192
    indptr = np.array([0, s], np.int32)
    qh = rng.standard_normal((s, HQ, D)).astype(kvattn._dtypes.to_numpy("bfloat16"))
    kh = rng.standard_normal((s, HKV, D)).astype(qh.dtype)
    vh = rng.standard_normal((s, HKV, D)).astype(qh.dtype)
    q, k, v = kvattn.from_numpy(qh), kvattn.from_numpy(kh), kvattn.from_numpy(vh)
    out = kvattn.empty(q.shape, "bfloat16")
    flops = 2 * HQ * s * s * D
    row = dict(case="prefill causal b1_S8192")
    base = None
    for name, kw in VARIANTS.items():
        w = kvattn.BatchPrefillWithRaggedKVCache()
        w.plan(indptr, indptr, HQ, HKV, D, causal=True, **kw)
        us = time_us(lambda: w.run(q, k, v, out=out), reps=20)
        base = base or us
        # the last 64 query rows against the whole prefix: bottom-right causal alignment and ALiBi's (j - diag)
        # are those of the full request
        ro = expected(name, qh[-64:], kh, vh, causal=True)
        err = float(np.linalg.norm(out.numpy()[-64:] - ro) / np.linalg.norm(ro))
        row[name] = f"{flops / us / 1e6:.0f} TFLOP/s {base / us:.3f} err {err:.0e} {w.last_plan.info['backend']}"
    return [row]


def main():
    rng = np.random.default_rng(0)
    print(f"GPU {kvattn._driver.device_name()}")
    rows = decode_rows(rng) + ([] if "--decode" in sys.argv[1:] else prefill_rows(rng))
    print("\nvariant cost (time, plain / variant: 1.0 = free, err = relative L2 against the float64 reference)")
    table(rows, ["case", *VARIANTS])


if __name__ == "__main__":
    main()
