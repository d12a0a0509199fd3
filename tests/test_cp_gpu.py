"""Context parallelism on one GPU: the whole path (shard plan, local decode with LSE, the NCCL all-gather, the merge)
with a world of one and a real nccl4py communicator, and the exchange logic with simulated ranks on one GPU (each
rank's shard decoded in turn, the states stacked as the all-gather would), both against the float64 reference on
the full table."""
import numpy as np
import pytest

import kvattn
from kvattn import _dtypes, reference
from kvattn.cp import ContextParallelDecode
from _gpu import assert_decode_rows, assert_lse, rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
HQ, HKV, D, PAGE = 8, 2, 128, 16


def _case(rng, lens):
    pt = kvattn.PageTable.from_kv_lens(np.asarray(lens), PAGE, rng=rng)
    bf16 = _dtypes.to_numpy("bfloat16")
    k = rng.standard_normal((pt.num_pages_used, PAGE, HKV, D)).astype(bf16)
    v = rng.standard_normal((pt.num_pages_used, PAGE, HKV, D)).astype(bf16)
    q = rng.standard_normal((len(lens), HQ, D)).astype(bf16)
    ro, rl = reference.batch_attention_paged(q, k, v, np.arange(len(lens) + 1, dtype=np.int32), pt, return_lse=True)
    return pt, q, k, v, ro, rl


def test_world_of_one_with_a_real_nccl_communicator():
    nccl = pytest.importorskip("nccl.core", reason="nccl4py is not installed (pip install 'kvattn[multigpu]')")
    from kvattn.cp import communicator_from_env
    comm = communicator_from_env()
    assert isinstance(comm, nccl.Communicator) and comm.nranks == 1
    rng = np.random.default_rng(3)
    pt, q, k, v, ro, rl = _case(rng, [3000, 17, 900])
    cp = ContextParallelDecode(comm)
    shards = cp.plan(pt, HQ, HKV, D)
    kd = kvattn.from_numpy(k[shards.pages[0]])
    vd = kvattn.from_numpy(v[shards.pages[0]])
    timings = {}
    o, lse = cp.run(kvattn.from_numpy(q), kd, vd, timings=timings)
    got = o.numpy()
    assert max(rel_l2(got[i], ro[i]) for i in range(3)) <= 1e-2
    assert_lse(lse.numpy(), rl, 1e-2)
    assert timings["attention_us"] > 0 and timings["exchange_merge_us"] > 0
    # the gather buffers are reused: a second run on a created stream gives the same bits
    s2 = kvattn.Stream()
    o2, lse2 = cp.run(kvattn.from_numpy(q), kd, vd, stream=s2)
    assert np.array_equal(o2.numpy(s2), got) and np.array_equal(lse2.numpy(s2), lse.numpy())
    comm.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_states_merged_in_rank_order_equal_the_whole_attention(world):
    """Each simulated rank decodes its shard (its own pool, page ids of shards.pages[r]); the states stacked in
    rank order and merged with kvattn.merge_states equal the attention over the whole table."""
    rng = np.random.default_rng(world)
    lens = [5000, 0, 33, 2048, 700]
    pt, q, k, v, ro, rl = _case(rng, lens)
    shards = kvattn.cp.shard_page_table(pt, world)
    qd = kvattn.from_numpy(q)
    os_, ls = [], []
    for r in range(world):
        w = kvattn.BatchDecodeWithPagedKVCache()
        w.plan(shards.tables[r], HQ, HKV, D)
        o, lse = w.run(qd, kvattn.from_numpy(k[shards.pages[r]]), kvattn.from_numpy(v[shards.pages[r]]),
                       return_lse=True)
        os_.append(o.numpy())
        ls.append(lse.numpy())
    o_all = np.stack(os_, 1)   # [batch, rank, Hq, D], what the all-gather gives after the stride swap
    l_all = np.stack(ls, 1)
    mo, ml = kvattn.merge_states(o_all, l_all)
    got = mo.numpy()
    assert_decode_rows(got, ro, lens, 1e-2)
    assert_lse(ml.numpy(), rl, 1e-2)


# -- causal prefill, zigzag (ContextParallelPrefill) ---------------------------------------------------------------
class _SimComm:
    """Rank `rank` of a simulated world on one GPU: allgather() places this rank's buffer and the other ranks'
    pre-loaded shards (padded to the gather's rows; k on even calls, v on odd ones, as run() calls it)."""

    def __init__(self, rank, world, shards):
        self.rank, self.nranks, self.shards, self.calls = rank, world, shards, 0

    def allgather(self, send, recv, stream):
        from kvattn import _driver
        from kvattn.stream import as_stream
        n = send.nbytes
        for x in range(self.nranks):
            src = send if x == self.rank else self.shards[self.calls % 2][x]
            _driver.call("cuMemcpyDtoDAsync", recv.ptr + x * n, src.ptr, n, as_stream(stream).handle)
        self.calls += 1


def _prompt(rng, n):
    bf16 = _dtypes.to_numpy("bfloat16")
    q, k, v = (rng.standard_normal((n, h, D)).astype(bf16) for h in (HQ, HKV, HKV))
    return q, k, v, reference.attention(q, k, v, causal=True)


@pytest.mark.parametrize("n, world", [(3001, 2), (4096, 3), (5, 4)])
def test_zigzag_prefill_equals_the_whole_prompts_attention(n, world):
    """Every simulated rank runs ContextParallelPrefill on its shard (its rows of zz.positions[rank], poisoned
    output); scattered back by position, the outputs equal the causal float64 reference over the whole prompt."""
    from kvattn.cp import ContextParallelPrefill, zigzag_plan
    rng = np.random.default_rng(n)
    q, k, v, want = _prompt(rng, n)
    zz = zigzag_plan(n, world)
    shard = max(p.size for p in zz.positions)

    def padded(a, rows):
        out = np.zeros((shard,) + a.shape[1:], a.dtype)
        out[:rows.size] = a[rows]
        return kvattn.from_numpy(out)

    shards = ([padded(k, p) for p in zz.positions], [padded(v, p) for p in zz.positions])
    got = np.full(want.shape, np.nan)
    for r in range(world):
        cp = ContextParallelPrefill(_SimComm(r, world, shards))
        assert cp.plan(n, HQ, HKV, D).positions[r].size == zz.positions[r].size
        rows = zz.positions[r]
        timings = {}
        o = cp.run(kvattn.from_numpy(q[rows]), kvattn.from_numpy(k[rows]), kvattn.from_numpy(v[rows]), timings=timings)
        got[rows] = o.numpy().astype(np.float64)
        assert timings["exchange_us"] > 0 and timings["attention_us"] > 0
    assert not np.isnan(got).any()
    assert rel_l2(got, want) <= 1e-2


def test_zigzag_prefill_world_of_one_with_a_real_nccl_communicator():
    pytest.importorskip("nccl.core", reason="nccl4py is not installed (pip install 'kvattn[multigpu]')")
    from kvattn.cp import ContextParallelPrefill, communicator_from_env
    comm = communicator_from_env()
    rng = np.random.default_rng(7)
    q, k, v, want = _prompt(rng, 2500)
    cp = ContextParallelPrefill(comm)
    zz = cp.plan(2500, HQ, HKV, D)
    rows = zz.positions[0]
    o = cp.run(kvattn.from_numpy(q[rows]), kvattn.from_numpy(k[rows]), kvattn.from_numpy(v[rows]))
    got = np.empty(want.shape)
    got[rows] = o.numpy()
    assert rel_l2(got, want) <= 1e-2
    s2 = kvattn.Stream()   # the kept buffers: a second run on another stream, the same bits
    o2 = cp.run(kvattn.from_numpy(q[rows]), kvattn.from_numpy(k[rows]), kvattn.from_numpy(v[rows]), stream=s2)
    assert np.array_equal(o2.numpy(s2), o.numpy())
    comm.destroy()


def test_zigzag_prefill_rejects_a_wrong_shard():
    from kvattn.cp import ContextParallelPrefill
    cp = ContextParallelPrefill(_SimComm(0, 2, None))
    cp.plan(100, HQ, HKV, D)
    bad = kvattn.from_numpy(np.ones((49, HQ, D), _dtypes.to_numpy("bfloat16")))
    with pytest.raises(ValueError, match="q: expected this rank's shard of shape"):
        cp.run(bad, bad, bad)
    with pytest.raises(ValueError, match="causal"):
        cp.plan(100, HQ, HKV, D, causal=False)
