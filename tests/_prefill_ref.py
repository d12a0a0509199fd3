"""Reference for sampled query rows of one prefill request (tests and scripts/bench_prefill.py)."""
import numpy as np

from kvattn import reference


def allowed(qo, kv, rows, causal, window_left, mask=None):
    """bool [len(rows), kv]: which kv positions query row r of a request (qo, kv) sees."""
    rows = np.asarray(rows)
    diag = kv - qo + rows[:, None]
    j = np.arange(kv)[None, :]
    a = np.ones((rows.size, kv), bool)
    if causal:
        a &= j <= diag
    if window_left >= 0:
        a &= j >= diag - window_left
    if mask is not None:
        a &= mask[rows]
    return a


def sample_rows(qo, n, rng):
    if qo <= n:
        return np.arange(qo)
    return np.unique(np.concatenate([[0, qo - 1], rng.choice(qo, n - 2, replace=False)]))


def request_ref(q, k, v, rows, causal, window_left, cap, sm_scale, mask=None):
    """(o, lse) float64 of rows `rows` of one request; q [qo, Hq, D], k/v [kv, Hkv, D] (any float dtype)."""
    qo, kv = q.shape[0], k.shape[0]
    m = allowed(qo, kv, rows, causal, window_left, mask)
    return reference.attention(q[rows].astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                               sm_scale=sm_scale, logits_soft_cap=cap, custom_mask=m, return_lse=True)
