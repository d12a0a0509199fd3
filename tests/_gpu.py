"""GPU test helpers: the skip marker (with its reason) and the checks every kernel test shares."""
import numpy as np
import pytest

import kvattn

requires_gpu = pytest.mark.skipif(not kvattn.gpu_available(), reason="no CUDA GPU found (kvattn.gpu_available() is False)")

POISON = 0xFF  # every byte 0xFF: NaN in float16 / bfloat16 / float32, so an unwritten element fails


def poisoned(shape, dtype):
    a = kvattn.empty(shape, dtype)
    a.fill_bytes(POISON)
    return a


def rel_l2(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "output has NaN/Inf (unwritten or wrong)"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def assert_decode_rows(got, ref, kv_lens, tol):
    """One decode row a request (got, ref: [batch, Hq, D]): an empty request gives exactly 0, every other is within
    tol (relative L2) of the reference."""
    for i, n in enumerate(kv_lens):
        if n == 0:
            assert np.all(got[i] == 0), f"request {i}: an empty request gives 0"
        else:
            assert rel_l2(got[i], ref[i]) <= tol, f"request {i} (kv_len {n})"


def assert_lse(got, ref, tol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert not np.any(np.isnan(got)), "LSE has NaN"
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), "LSE is -inf in different places than the reference"
    fin = np.isfinite(ref)
    if fin.any():
        assert np.max(np.abs(got[fin] - ref[fin])) <= tol
