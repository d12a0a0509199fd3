"""GPU tests of user variants (written through kvattn.Variant.from_cuda only) in decode and prefill (both backends),
against the float64 reference: HalfLogits is the reference with sm_scale / 2, EvenKeys the reference with a
custom mask of the even kv positions."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvattn
from kvattn import _dtypes, reference
from _gpu import assert_lse, poisoned, rel_l2, requires_gpu
from _prefill_ref import allowed
from _user_variants import EVEN_KEYS, HALF_LOGITS, HEAD_SCALE, SIGMOID, sigmoid_reference

pytestmark = [pytest.mark.gpu, requires_gpu]
GPU = settings(max_examples=50, deadline=None)
BF = _dtypes.to_numpy("bfloat16")


def _even(qo, kv):
    return np.broadcast_to((np.arange(kv) % 2 == 0)[None, :], (qo, kv))


def _decode_case(rng, lens, hq, hkv, d, page=16):
    """A paged batch of kv lengths `lens`: (page table, q [B, Hq, D], k / v caches [pages, page, Hkv, D]), bf16."""
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), page, rng=rng)
    shape = (pt.num_pages_used, page, hkv, d)
    k, v = rng.standard_normal(shape).astype(BF), rng.standard_normal(shape).astype(BF)
    return pt, rng.standard_normal((len(lens), hq, d)).astype(BF), k, v


def _request_kv(pt, k, v, i):
    """Request i's keys and values [kv_len, Hkv, D] gathered from the paged caches."""
    n = int(pt.kv_lens[i])
    return (k[pt.pages(i)].reshape(-1, *k.shape[2:])[:n], v[pt.pages(i)].reshape(-1, *v.shape[2:])[:n])


def _check_decode(out, lse, ro, rl):
    got = out.numpy()
    for i in range(ro.shape[0]):
        assert rel_l2(got[i], ro[i]) <= 1e-2, f"request {i}"
    assert_lse(lse.numpy(), rl, 1e-2)


def _draw_decode_shape(data, max_len, max_batch, groups, hkvs, dims):
    """(kv lengths, group size, kv heads, head dim) of a random decode batch."""
    lens = data.draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_batch), "kv_lens")
    group = data.draw(st.sampled_from(groups), "group")
    return lens, group, data.draw(st.sampled_from(hkvs), "hkv"), data.draw(st.sampled_from(dims), "d")


def _decode_builtin_matches_reference(rng, lens, hq, hkv, d, **kw):
    """A random paged batch planned with the built-in variant keywords kw (named as the reference's) against
    reference.batch_attention_paged with the same keywords."""
    pt, q, k, v = _decode_case(rng, lens, hq, hkv, d)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, hq, hkv, d, **kw)
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(q, k, v, out=out, lse=lse)
    ro, rl = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1), pt, return_lse=True, **kw)
    _check_decode(out, lse, ro, rl)


def _prefill_case(data, rng, d, group, **plan_kw):
    """A random ragged batch (2 KV heads) run on a drawn backend with plan_kw: (qo, kv, qo_indptr, kv_indptr, q, k,
    v, causal, out, lse) with out / lse as numpy arrays."""
    b = data.draw(st.integers(1, 4), "batch")
    qo = data.draw(st.lists(st.integers(1, 300), min_size=b, max_size=b), "qo")
    extra = data.draw(st.lists(st.integers(0, 700), min_size=b, max_size=b), "prefix")
    kv = [a + e for a, e in zip(qo, extra)]
    backend = data.draw(st.sampled_from(["sm80", "sm90", "auto"]), "backend")
    causal = data.draw(st.booleans(), "causal")
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = rng.standard_normal((qo_indptr[-1], 2 * group, d)).astype(BF)
    k = rng.standard_normal((kv_indptr[-1], 2, d)).astype(BF)
    v = rng.standard_normal((kv_indptr[-1], 2, d)).astype(BF)
    w = kvattn.BatchPrefillWithRaggedKVCache(backend=backend)
    w.plan(qo_indptr, kv_indptr, 2 * group, 2, d, causal=causal, cta_rows=128 if backend == "sm90" else None,
           **plan_kw)
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(q, k, v, out=out, lse=lse)
    return qo, kv, qo_indptr, kv_indptr, q, k, v, causal, out.numpy(), lse.numpy()



def _check_prefill(case, expected):
    """Each request of a _prefill_case against expected(q, k, v, mask) -> (o, lse): float64 q [qo, Hq, D], k / v
    [kv, Hkv, D] and mask, the request's causal (or full) mask bool [qo, kv]."""
    qo, kv, qo_indptr, kv_indptr, q, k, v, causal, got, got_lse = case
    for i in range(len(qo)):
        qs, ks = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
        mask = allowed(qo[i], kv[i], np.arange(qo[i]), causal, -1)
        ro, rl = expected(q[qs].astype(np.float64), k[ks].astype(np.float64), v[ks].astype(np.float64), mask)
        assert rel_l2(got[qs], ro) <= 1e-2, f"request {i}"
        assert_lse(got_lse[qs], rl, 1e-2)

@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_decode_user_variants_match_reference(data, seed):
    rng = np.random.default_rng(seed)
    lens, group, hkv, d = _draw_decode_shape(data, 3000, 24, [1, 4, 8], [1, 2, 4], [64, 128])
    which = data.draw(st.sampled_from(["half_logits", "even_keys"]), "variant")
    hq = hkv * group
    pt, q, k, v = _decode_case(rng, lens, hq, hkv, d)
    variant = HALF_LOGITS if which == "half_logits" else EVEN_KEYS
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, hq, hkv, d, variant=variant)
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(q, k, v, out=out, lse=lse)
    ind = np.arange(len(lens) + 1)
    if which == "half_logits":
        ro, rl = reference.batch_attention_paged(q, k, v, ind, pt, sm_scale=0.5 / np.sqrt(d), return_lse=True)
    else:
        masks = [_even(1, n) for n in lens]
        ro, rl = reference.batch_attention_paged(q, k, v, ind, pt, custom_mask=masks, return_lse=True)
    _check_decode(out, lse, ro, rl)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_prefill_user_variants_match_reference(data, seed):
    rng = np.random.default_rng(seed)
    d, group = 128, 4
    which = data.draw(st.sampled_from(["half_logits", "even_keys"]), "variant")
    variant = HALF_LOGITS if which == "half_logits" else EVEN_KEYS
    scale = (0.5 if which == "half_logits" else 1.0) / np.sqrt(d)

    def expected(q, k, v, mask):
        if which == "even_keys":
            mask = mask & _even(*mask.shape)
        return reference.attention(q, k, v, sm_scale=scale, custom_mask=mask, return_lse=True)
    _check_prefill(_prefill_case(data, rng, d, group, variant=variant), expected)


def _slopes(hq):
    """ALiBi's geometric slopes 2^(-8 (h + 1) / Hq)."""
    return 2.0 ** (-8.0 * (np.arange(hq) + 1) / hq)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_decode_alibi_matches_reference(data, seed):
    rng = np.random.default_rng(seed)
    lens, group, hkv, d = _draw_decode_shape(data, 3000, 24, [1, 4, 8, 32], [1, 2], [64, 128, 256])
    window = data.draw(st.sampled_from([-1, 100]), "window_left")
    _decode_builtin_matches_reference(rng, lens, hkv * group, hkv, d, alibi_slopes=_slopes(hkv * group),
                                      window_left=window)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_prefill_alibi_matches_reference(data, seed):
    rng = np.random.default_rng(seed)
    d = data.draw(st.sampled_from([64, 128]), "d")
    group = data.draw(st.sampled_from([1, 4, 8]), "group")
    slopes = _slopes(2 * group)
    _check_prefill(_prefill_case(data, rng, d, group, alibi_slopes=slopes),
                   lambda q, k, v, mask: reference.attention(q, k, v, custom_mask=mask, alibi_slopes=slopes,
                                                             return_lse=True))


# -- attention sinks (built in) -------------------------------------------------------------------------------
@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_decode_sinks_match_reference(data, seed):
    """Long and short requests (split-KV rows take the sink in the merge kernel, the others in the epilogue)."""
    rng = np.random.default_rng(seed)
    lens, group, hkv, d = _draw_decode_shape(data, 6000, 12, [1, 4, 8], [1, 2], [64, 128, 256])
    alibi = data.draw(st.booleans(), "alibi")
    hq = hkv * group
    _decode_builtin_matches_reference(rng, lens, hq, hkv, d, sinks=rng.standard_normal(hq) * 3,
                                      alibi_slopes=_slopes(hq) if alibi else None)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_prefill_sinks_match_reference(data, seed):
    rng = np.random.default_rng(seed)
    d = data.draw(st.sampled_from([64, 128]), "d")
    group = data.draw(st.sampled_from([1, 4, 8]), "group")
    window = data.draw(st.sampled_from([-1, 50]), "window_left")
    sinks = rng.standard_normal(2 * group) * 3
    _check_prefill(_prefill_case(data, rng, d, group, sinks=sinks, window_left=window),
                   lambda q, k, v, mask: reference.attention(q, k, v, custom_mask=mask, window_left=window,
                                                             sinks=sinks, return_lse=True))


def test_graph_replay_with_new_sinks_and_batch():
    """Sinks are plan data: a replayed graph uses the latest plan()'s values and batch."""
    rng = np.random.default_rng()
    hq, hkv, d, page, max_b, max_pages = 16, 2, 128, 16, 8, 1024
    k = kvattn.from_numpy(rng.standard_normal((max_pages, page, hkv, d)).astype(BF))
    v = kvattn.from_numpy(rng.standard_normal((max_pages, page, hkv, d)).astype(BF))
    q, out = kvattn.empty((max_b, hq, d), "bfloat16"), kvattn.empty((max_b, hq, d), "bfloat16")
    lse = kvattn.empty((max_b, hq), "float32")
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=max_b, max_num_pages=max_pages)
    s, graph = kvattn.Stream(), None
    for step, batch in enumerate([8, 3, 5]):
        lens = rng.integers(1, 1500, batch)
        lens[0] = 6000
        pt = kvattn.PageTable.from_kv_lens(lens, page, num_pages=max_pages, rng=rng)
        sinks = rng.standard_normal(hq) * 3
        w.plan(pt, hq, hkv, d, sinks=sinks, stream=s)
        qh = rng.standard_normal((max_b, hq, d)).astype(BF)
        q.copy_from_host(qh, s)
        out.fill_bytes(0xFF, s)
        if graph is None:
            with kvattn.graphs.capture(s) as cap:
                w.run(q, k, v, out=out, lse=lse, stream=s)
            graph = cap.graph
        graph.replay(s)
        ro, rl = reference.batch_attention_paged(qh[:batch], k.numpy(), v.numpy(), np.arange(batch + 1), pt,
                                                 sinks=sinks, return_lse=True)
        assert rel_l2(out.numpy(s)[:batch], ro) <= 1e-2, f"step {step}"
        assert_lse(lse.numpy(s)[:batch], rl, 1e-2)


# -- the two user variants with parameters (scripts/example_variant.py): sigmoid attention, a per-head logits scale
@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_decode_sigmoid_and_head_scale_match_reference(data, seed):
    rng = np.random.default_rng(seed)
    lens, group, hkv, d = _draw_decode_shape(data, 5000, 12, [1, 4, 8], [1, 2], [64, 128])
    which = data.draw(st.sampled_from(["sigmoid", "head_scale"]), "variant")
    hq = hkv * group
    pt, q, k, v = _decode_case(rng, lens, hq, hkv, d)
    w = kvattn.BatchDecodeWithPagedKVCache()
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    scale = 1 / np.sqrt(d)
    if which == "sigmoid":
        bias = float(rng.uniform(-3, 1))
        w.plan(pt, hq, hkv, d, variant=SIGMOID, variant_params={"bias": bias})
        w.run(q, k, v, out=out, lse=lse)
        got, got_lse = out.numpy(), lse.numpy()
        for i, n in enumerate(lens):
            kk, vv = _request_kv(pt, k, v, i)
            ro, rl = sigmoid_reference(q[i:i + 1], kk, vv, scale, bias, np.ones((1, n), bool))
            assert rel_l2(got[i], ro[0]) <= 1e-2, f"request {i}"
            assert_lse(got_lse[i:i + 1], rl, 1e-2)
    else:
        hs = rng.uniform(0.2, 2.0, hq)
        w.plan(pt, hq, hkv, d, variant=HEAD_SCALE, variant_params={"head_scale": hs})
        w.run(q, k, v, out=out, lse=lse)
        qs = q.astype(np.float64) * hs[None, :, None]   # the same scores: (q * hs[h]) . k * scale
        ro, rl = reference.batch_attention_paged(qs, k, v, np.arange(len(lens) + 1), pt, sm_scale=scale,
                                                 return_lse=True)
        _check_decode(out, lse, ro, rl)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_prefill_sigmoid_and_head_scale_match_reference(data, seed):
    rng = np.random.default_rng(seed)
    d, group = 128, 4
    which = data.draw(st.sampled_from(["sigmoid", "head_scale"]), "variant")
    bias = float(rng.uniform(-3, 1))
    hs = rng.uniform(0.2, 2.0, 2 * group)
    kw = (dict(variant=SIGMOID, variant_params={"bias": bias}) if which == "sigmoid" else
          dict(variant=HEAD_SCALE, variant_params={"head_scale": hs}))
    scale = 1 / np.sqrt(d)

    def expected(q, k, v, mask):
        if which == "sigmoid":
            return sigmoid_reference(q, k, v, scale, bias, mask)
        return reference.attention(q * hs[None, :, None], k, v, sm_scale=scale, custom_mask=mask, return_lse=True)
    _check_prefill(_prefill_case(data, rng, d, group, **kw), expected)


# -- fused RoPE (built in): q and k rotated inside the kernels ---------------------------------------------------
def _roped(x, pos, rope):
    return reference.apply_rope(x, pos, interleave=rope.interleave, rope_scale=rope.scale, rope_theta=rope.theta)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_decode_rope_matches_reference(data, seed):
    rng = np.random.default_rng(seed)
    lens, group, hkv, d = _draw_decode_shape(data, 4000, 12, [1, 4, 8], [1, 2], [64, 128, 256])
    rope = kvattn.RoPE(theta=data.draw(st.sampled_from([1e4, 5e5]), "theta"),
                       scale=data.draw(st.sampled_from([1.0, 4.0]), "scale"), interleave=data.draw(st.booleans()))
    offsets = rng.integers(0, 3000, len(lens)) if data.draw(st.booleans(), "offsets") else None
    hq = hkv * group
    pt, q, k, v = _decode_case(rng, lens, hq, hkv, d)
    w = kvattn.BatchDecodeWithPagedKVCache()
    w.plan(pt, hq, hkv, d, rope=rope, rope_offsets=offsets)
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(q, k, v, out=out, lse=lse)
    got, got_lse = out.numpy(), lse.numpy()
    for i, n in enumerate(lens):
        off = 0 if offsets is None else int(offsets[i])
        ki, vi = _request_kv(pt, k, v, i)
        qr = _roped(q[i:i + 1], [n - 1 + off], rope)
        kr = _roped(ki, np.arange(n) + off, rope)
        ro, rl = reference.attention(qr, kr, vi.astype(np.float64), return_lse=True)
        assert rel_l2(got[i], ro[0]) <= 1e-2, f"request {i}"
        assert_lse(got_lse[i:i + 1], rl, 1e-2)


@GPU
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_prefill_rope_matches_reference(data, seed):
    rng = np.random.default_rng(seed)
    d = data.draw(st.sampled_from([64, 128, 256]), "d")
    group = data.draw(st.sampled_from([1, 4]), "group")
    b = data.draw(st.integers(1, 3), "batch")
    qo = data.draw(st.lists(st.integers(1, 200), min_size=b, max_size=b), "qo")
    kv = [a + e for a, e in zip(qo, data.draw(st.lists(st.integers(0, 500), min_size=b, max_size=b), "prefix"))]
    causal = data.draw(st.booleans(), "causal")
    backend = data.draw(st.sampled_from(["sm80", "sm90", "auto"]), "backend")
    if backend == "sm90" and d == 256:
        backend = "sm80"
    rope = kvattn.RoPE(theta=1e4, scale=data.draw(st.sampled_from([1.0, 2.0]), "scale"),
                       interleave=data.draw(st.booleans(), "interleave"))
    offsets = rng.integers(0, 1000, b)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    q = rng.standard_normal((qo_indptr[-1], 2 * group, d)).astype(BF)
    k = rng.standard_normal((kv_indptr[-1], 2, d)).astype(BF)
    v = rng.standard_normal((kv_indptr[-1], 2, d)).astype(BF)
    w = kvattn.BatchPrefillWithRaggedKVCache(backend=backend)
    w.plan(qo_indptr, kv_indptr, 2 * group, 2, d, causal=causal, rope=rope, rope_offsets=offsets,
           cta_rows=128 if backend == "sm90" else None)
    out, lse = poisoned(q.shape, "bfloat16"), poisoned(q.shape[:2], "float32")
    w.run(q, k, v, out=out, lse=lse)
    got, got_lse = out.numpy(), lse.numpy()
    for i in range(b):
        qs, ks = slice(qo_indptr[i], qo_indptr[i + 1]), slice(kv_indptr[i], kv_indptr[i + 1])
        off = int(offsets[i])
        qr = _roped(q[qs], kv[i] - qo[i] + np.arange(qo[i]) + off, rope)
        kr = _roped(k[ks], np.arange(kv[i]) + off, rope)
        ro, rl = reference.attention(qr, kr, v[ks].astype(np.float64), causal=causal, return_lse=True)
        assert rel_l2(got[qs], ro) <= 1e-2, f"request {i}"
        assert_lse(got_lse[qs], rl, 1e-2)
