"""run()'s array checks (opcore.check_array, PagedKV.bind, RaggedKV.bind) each decide their common case in one
expression before the full checks; these properties hold them to the specification: an array is accepted exactly
when its shape, dtype, contiguous last axis, 16-byte aligned pointer and outer strides (and, for a cache, enough
pages) are right, and then the element strides returned are the layout's. No GPU: the arrays are DeviceArray views
of made-up addresses (nothing is read)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvattn import _dtypes, stream as _stream
from kvattn.memory import DeviceArray
from kvattn.opcore import PagedKV, RaggedKV, check_array

BF16 = _dtypes.to_numpy("bfloat16")
F16 = np.dtype(np.float16)
DTYPES = [BF16, F16, np.dtype(np.float32), np.dtype(np.uint8)]


def _array(draw, shape, dtype, want_dtype):
    """A DeviceArray of `shape`, mostly of want_dtype, mostly dense, sometimes padded, permuted or misaligned."""
    it = dtype.itemsize
    strides = [0] * len(shape)
    step = it * draw(st.sampled_from([1, 1, 1, 2]))   # the last axis: contiguous, or every other element
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = step
        step *= shape[i]
        step += draw(st.sampled_from([0, 0, 0, it, 16]))   # padding between rows
    if len(shape) > 2 and draw(st.integers(0, 5)) == 0:   # two outer axes swapped (an HND view of NHD memory)
        strides[0], strides[1] = strides[1], strides[0]
    ptr = 0x7F0000000000 + draw(st.sampled_from([0, 0, 0, 256, 4, 8, 2]))
    return DeviceArray._make(ptr, tuple(shape), dtype, tuple(strides), None)


def _aligned(a, ndim_rows):
    """The accepted layout: last axis contiguous, pointer and the outer strides multiples of 16 bytes."""
    bad = a.ptr
    for s in a.strides[:ndim_rows]:
        bad |= s
    return a.strides[-1] == a.dtype.itemsize and not bad & 15


@given(st.data())
def test_check_array_accepts_exactly_the_specified_arrays(data):
    draw = data.draw
    want = (draw(st.integers(1, 9)), draw(st.integers(1, 8)), draw(st.sampled_from([8, 64, 128])))
    dtype = draw(st.sampled_from(DTYPES[:2]))
    shape = list(want)
    if draw(st.integers(0, 4)) == 0:
        shape[draw(st.integers(0, 2))] += 1
    a = _array(draw, shape, draw(st.sampled_from([dtype, dtype, dtype, F16 if dtype is BF16 else BF16])), dtype)
    ok = a.shape == want and a.dtype == dtype and _aligned(a, 2)
    if ok:
        check_array(a, "q", want, dtype)
    else:
        with pytest.raises((ValueError, TypeError), match="^q: "):
            check_array(a, "q", want, dtype)


@given(st.data())
def test_paged_bind_accepts_exactly_the_specified_caches(data):
    draw = data.draw
    layout = draw(st.sampled_from(["NHD", "HND"]))
    ps, hkv, d = draw(st.sampled_from([1, 5, 16])), draw(st.integers(1, 8)), draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from(DTYPES[:2]))
    needed = draw(st.integers(1, 40))
    kv = PagedKV(layout, ps, hkv, d, dtype, needed)
    tail = (ps, hkv, d) if layout == "NHD" else (hkv, ps, d)
    pages = needed + draw(st.sampled_from([0, 0, 3, -1]))
    shape = [max(pages, 0), *tail]
    if draw(st.integers(0, 5)) == 0:
        shape[draw(st.integers(1, 3))] += 1
    k = _array(draw, shape, draw(st.sampled_from([dtype, dtype, dtype, np.dtype(np.float32)])), dtype)
    v = (k if draw(st.booleans()) else
         DeviceArray._make(k.ptr + draw(st.sampled_from([1 << 30, (1 << 30) + 8])), k.shape, k.dtype, k.strides, None))
    s = _stream.as_stream(None)
    ok = (k.shape[1:] == tail and k.shape[0] >= needed and k.dtype == dtype and _aligned(k, 3)
          and not (v.ptr - k.ptr) & 15)
    if ok:
        _, _, strides = kv.bind(k, v, s, False)
        ks = [x // dtype.itemsize for x in k.strides]
        assert strides == ((ks[0], ks[1], ks[2]) if layout == "NHD" else (ks[0], ks[2], ks[1]))
    else:
        with pytest.raises((ValueError, TypeError), match="^(k_cache|v_cache): "):
            kv.bind(k, v, s, False)


@given(st.data())
def test_ragged_bind_accepts_exactly_the_specified_arrays(data):
    draw = data.draw
    layout = draw(st.sampled_from(["NHD", "HND"]))
    n, hkv, d = draw(st.integers(1, 50)), draw(st.integers(1, 8)), draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from(DTYPES[:2]))
    per_page = draw(st.sampled_from([1, 16]))
    kv = RaggedKV(layout, n, hkv, d, dtype, per_page)
    want = [n, hkv, d] if layout == "NHD" else [hkv, n, d]
    shape = list(want)
    if draw(st.integers(0, 5)) == 0:
        shape[draw(st.integers(0, 2))] += 1
    k = _array(draw, shape, draw(st.sampled_from([dtype, dtype, dtype, np.dtype(np.float32)])), dtype)
    v = DeviceArray._make(k.ptr + (1 << 30), k.shape, k.dtype, k.strides, None)
    s = _stream.as_stream(None)
    ok = list(k.shape) == want and k.dtype == dtype and _aligned(k, 2)
    if ok:
        _, _, strides = kv.bind(k, v, s, False)
        ks = [x // dtype.itemsize for x in k.strides]
        tok, head = (ks[0], ks[1]) if layout == "NHD" else (ks[1], ks[0])
        assert strides == (tok * per_page, tok, head)
    else:
        with pytest.raises((ValueError, TypeError), match="^(k|v): "):
            kv.bind(k, v, s, False)
