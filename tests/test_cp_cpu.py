"""Context parallelism without a GPU: the shard plan (every page on exactly one rank, in position order, balanced
bytes) and the merge of the ranks' states against the float64 reference on the whole table (simulated ranks)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvattn import reference
from kvattn.cp import shard_page_table, zigzag_plan
from kvattn.formats import PageTable


def random_table(rng, lens, page_size, spare=3):
    n = [-(-int(x) // page_size) for x in lens]
    ids = rng.permutation(sum(n) + spare).astype(np.int32)[:sum(n)]
    last = [int(x) - (p - 1) * page_size if p else 0 for x, p in zip(lens, n)]
    return PageTable(np.concatenate([[0], np.cumsum(n)]).astype(np.int32), ids, np.array(last, np.int32), page_size)


tables = st.builds(lambda seed, lens, ps: random_table(np.random.default_rng(seed), lens, ps),
                   st.integers(0, 2**31 - 1), st.lists(st.one_of(st.integers(0, 40), st.integers(0, 3000)),
                                                       min_size=1, max_size=9), st.sampled_from([1, 5, 16]))


@settings(max_examples=200, deadline=None)
@given(pt=tables, world=st.integers(1, 5))
def test_every_page_on_exactly_one_rank_in_position_order(pt, world):
    plan = shard_page_table(pt, world)
    assert plan.world_size == world and len(plan.tables) == world
    held = np.concatenate(plan.pages)
    assert np.array_equal(np.sort(held), np.sort(pt.indices))            # each page once
    counts = np.array([p.size for p in plan.pages])
    assert counts.max() - counts.min() <= 1                               # balanced bytes
    for i in range(pt.batch_size):
        # the ranks' runs of request i, in rank order, are its pages in position order
        runs = [plan.pages[r][plan.tables[r].indptr[i]:plan.tables[r].indptr[i + 1]] for r in range(world)]
        assert np.array_equal(np.concatenate(runs), pt.pages(i))
        lens = np.array([int(plan.tables[r].kv_lens[i]) for r in range(world)])
        assert lens.sum() == pt.kv_lens[i]
        firsts = [int(plan.first_token[r][i]) for r in range(world)]
        assert firsts == list(np.concatenate([[0], np.cumsum(lens)[:-1]]))
    for r in range(world):   # each rank's table addresses its own pool, page j = full page pages[r][j]
        assert np.array_equal(plan.tables[r].indices, np.arange(plan.pages[r].size))


@settings(max_examples=40, deadline=None)
@given(pt=tables, world=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), layout=st.sampled_from(["NHD", "HND"]))
def test_merged_shards_equal_attention_over_the_whole_table(pt, world, seed, layout):
    """Decode: each simulated rank attends to its shard (its own pool) and returns (o, lse); the ranks' states
    merged in rank order equal the float64 reference over the whole table."""
    rng = np.random.default_rng(seed)
    hq, hkv, d = 4, 2, 16
    pool = int(pt.indices.max(initial=-1)) + 4
    shape = (pool, pt.page_size, hkv, d) if layout == "NHD" else (pool, hkv, pt.page_size, d)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    q = rng.standard_normal((pt.batch_size, hq, d))
    qi = np.arange(pt.batch_size + 1)
    want_o, want_lse = reference.batch_attention_paged(q, k, v, qi, pt, kv_layout=layout, return_lse=True)
    plan = shard_page_table(pt, world)
    states = [reference.batch_attention_paged(q, k[plan.pages[r]], v[plan.pages[r]], qi, plan.tables[r],
                                              kv_layout=layout, return_lse=True) for r in range(world)]
    o, lse = reference.merge_states(np.stack([s[0] for s in states], 1), np.stack([s[1] for s in states], 1))
    empty = pt.kv_lens == 0
    assert np.allclose(o[~empty], want_o[~empty], rtol=1e-10, atol=1e-12)
    assert np.allclose(lse[~empty], want_lse[~empty], rtol=1e-10, atol=1e-12)
    assert np.isneginf(lse[empty]).all() and not o[empty].any()


def test_world_size_is_checked():
    pt = random_table(np.random.default_rng(0), [10], 4)
    with pytest.raises(ValueError, match="world_size"):
        shard_page_table(pt, 0)


# -- causal prefill: the zigzag split ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(n=st.one_of(st.integers(0, 40), st.integers(0, 200000)), world=st.integers(1, 8))
def test_zigzag_every_position_on_exactly_one_rank_with_balanced_work(n, world):
    zz = zigzag_plan(n, world)
    assert zz.world_size == world and zz.num_tokens == n
    sizes = np.diff(zz.starts)
    assert sizes.size == 2 * world and sizes.sum() == n and sizes.max() - sizes.min() <= 1
    held = np.concatenate(zz.positions)
    assert np.array_equal(np.sort(held), np.arange(n))                    # each position once
    for r in range(world):
        lo, hi = zz.chunks(r)
        assert np.array_equal(zz.positions[r], np.concatenate([np.arange(zz.starts[lo], zz.starts[lo + 1]),
                                                               np.arange(zz.starts[hi], zz.starts[hi + 1])]))
    work = np.array([zz.causal_work(r) for r in range(world)])
    assert work.sum() == n * (n + 1) // 2                                  # every causal pair computed once
    # balanced: equal chunks give every rank the same work exactly; the n % (2 world) longer chunks move a rank's
    # work by at most a couple of key rows (n each), against n^2 / (2 world) per rank
    assert work.max() - work.min() <= 2 * n + 2


def test_zigzag_work_is_balanced_on_the_issue_shape():
    zz = zigzag_plan(131072, 2)
    work = [zz.causal_work(r) for r in range(2)]
    assert work[0] == work[1]   # 131072 = 4 chunks of 32768: exactly equal


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_zigzag_ranks_attention_equals_the_whole_prompts(n, world, seed):
    """Each simulated rank attends its two query chunks to the keys up to each chunk's end (the gathered K/V in
    position order), as ContextParallelPrefill runs it; scattered back by position, the ranks' outputs equal the
    causal float64 reference over the whole prompt."""
    rng = np.random.default_rng(seed)
    hq, hkv, d = 4, 2, 16
    q, k, v = (rng.standard_normal((n, h, d)) for h in (hq, hkv, hkv))
    want = reference.attention(q, k, v, causal=True)
    zz = zigzag_plan(n, world)
    got = np.full_like(want, np.nan)
    for r in range(world):
        rows = zz.positions[r]
        q_shard = q[rows]                 # what rank r is given ...
        k_full = np.concatenate([k[zz.positions[x]] for x in range(world)])   # ... and what the all-gather gives,
        v_full = np.concatenate([v[zz.positions[x]] for x in range(world)])   # put back in position order:
        order = np.argsort(np.concatenate(zz.positions), kind="stable")
        k_pos, v_pos = k_full[order], v_full[order]
        lo = 0
        for c in zz.chunks(r):
            a, b = int(zz.starts[c]), int(zz.starts[c + 1])
            if b > a:
                o = reference.batch_attention_ragged(q_shard[lo:lo + b - a], k_pos[:b], v_pos[:b], [0, b - a], [0, b],
                                                     causal=True)
                got[rows[lo:lo + b - a]] = o
            lo += b - a
    assert np.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_zigzag_arguments_are_checked():
    with pytest.raises(ValueError, match="world_size"):
        zigzag_plan(10, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        zigzag_plan(-1, 2)
