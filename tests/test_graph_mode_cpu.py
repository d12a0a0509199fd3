"""CPU tests of graph mode's invariant (the driver faked): a captured run() replays the launches' grids, shared
memory and parameter bytes as they were at capture, so in graph mode every later plan() within the bounds must
leave all of them unchanged (what a batch changes lives in the plan buffer on the device, which each plan()
rewrites in place) and must not move the workspace. A plan whose parameters drift would replay stale work lists;
the GPU replay tests catch it only for the batches they draw."""
import numpy as np
from hypothesis import given, settings, strategies as st

from _fake_driver import fake_driver

import kvattn

HQ, HKV, D, PAGE = 8, 2, 128, 16
MAX_B, MAX_PAGES, MAX_QO = 6, 600, 1024


def _snapshot(w):
    """Every launch of the op's plan as the graph captured it: (function, grid, block, smem, parameter bytes)."""
    p = w.last_plan
    launches = list(p.launches) + ([p.merge] if p.merge is not None else [])
    return [(int(x._args[0]), x._args[1:], bytes(x.params.raw)) for x in launches], w.workspace.buffer.ptr


def _lens(draw):
    b = draw(st.integers(1, MAX_B))
    kv = draw(st.lists(st.integers(1, (MAX_PAGES // MAX_B) * PAGE), min_size=b, max_size=b))
    return kv


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_decode_graph_plans_keep_every_launch(data):
    with fake_driver():
        for deterministic in (False, True):
            w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=MAX_B,
                                                   max_num_pages=MAX_PAGES, deterministic=deterministic)
            first = None
            for _ in range(3):
                kv = _lens(data.draw)
                pt = kvattn.PageTable.from_kv_lens(np.array(kv), PAGE, rng=np.random.default_rng(len(kv)))
                w.plan(pt, HQ, HKV, D)
                snap = _snapshot(w)
                assert first is None or snap == first, (deterministic, kv)
                first = snap


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_prefill_graph_plans_keep_every_launch(data):
    with fake_driver():
        for paged in (False, True):
            cls = kvattn.BatchPrefillWithPagedKVCache if paged else kvattn.BatchPrefillWithRaggedKVCache
            kw = dict(max_num_pages=MAX_PAGES) if paged else {}
            w = cls(use_cuda_graph=True, max_batch_size=MAX_B, max_total_qo=MAX_QO, **kw)
            first = None
            for _ in range(3):
                b = data.draw(st.integers(1, MAX_B))
                qo = data.draw(st.lists(st.integers(1, MAX_QO // MAX_B), min_size=b, max_size=b))
                extra = data.draw(st.lists(st.integers(0, 700), min_size=b, max_size=b))
                kv = [a + e for a, e in zip(qo, extra)]
                qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
                if paged:
                    pt = kvattn.PageTable.from_kv_lens(np.array(kv), PAGE, rng=np.random.default_rng(b))
                    w.plan(qo_indptr, pt, HQ, HKV, D, causal=True)
                else:
                    w.plan(qo_indptr, np.concatenate([[0], np.cumsum(kv)]).astype(np.int32), HQ, HKV, D,
                           causal=True)
                snap = _snapshot(w)
                assert first is None or snap == first, (paged, qo, kv)
                first = snap


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_cascade_graph_plans_keep_every_launch(data):
    """Two levels: a shared prefix for every request, then each request's own pages and queries."""
    with fake_driver():
        w = kvattn.MultiLevelCascadeAttentionWrapper(2, use_cuda_graph=True, max_batch_size=MAX_B, max_total_qo=64,
                                                     max_num_pages=MAX_PAGES)
        first = None
        for _ in range(3):
            b = data.draw(st.integers(1, MAX_B))
            shared = kvattn.PageTable.from_kv_lens(np.array([data.draw(st.integers(1, 2000))]), PAGE, rng=0)
            qo = data.draw(st.lists(st.integers(1, 64 // MAX_B), min_size=b, max_size=b))
            own = [q + data.draw(st.integers(0, 300)) for q in qo]
            unique = kvattn.PageTable.from_kv_lens(np.array(own), PAGE, rng=1)
            qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
            w.plan([np.array([0, qo_indptr[-1]], np.int32), qo_indptr], [shared, unique], HQ, HKV, D, causal=True)
            snap = _snapshot(w)
            assert first is None or snap == first, (qo, own)
            first = snap
