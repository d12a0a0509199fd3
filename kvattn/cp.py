"""Context parallelism: decode with each request's KV pages split across ranks by position, balanced by bytes
(shard_page_table, ContextParallelDecode), and causal prefill of one prompt split in zigzag chunks (zigzag_plan,
ContextParallelPrefill).

A context-parallel decode gives every rank a shard of each request's KV cache; each rank attends its query rows to
its shard and returns (o, lse); the ranks' states are gathered and merged (kvattn.merge_states, in rank order). Every page of the full table lands on exactly one rank, in position order (rank 0 holds each
request's first pages), so the shards of a request are contiguous runs of its tokens.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from . import _validate as _v
from .formats import PageTable


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """tables[r]: rank r's page table over its own pool (page ids 0..len(pages[r]) - 1, in the order given);
    pages[r]: int32 [n_r], the page ids of the full table that rank r holds, in that order (the engine keeps full
    page pages[r][j] at rank r's page j); first_token[r]: int64 [B], the position of each request's first token on
    rank r (the request's kv_len where rank r holds none of it): the offset causal prefill and RoPE need."""
    tables: tuple
    pages: tuple
    first_token: tuple

    @property
    def world_size(self) -> int:
        return len(self.tables)


def shard_page_table(pt: PageTable, world_size: int) -> ShardPlan:
    """Split each request's pages into world_size contiguous runs by position. Each request gives every rank
    floor(n / world) pages, and its n % world remaining pages go to ranks in one round robin over the whole
    batch, so the ranks' page counts differ by at most one. A partial last page stays with the rank that holds the
    request's last run; a rank with no page of a request has kv_len 0 for it (state o = 0, lse = -inf)."""
    world = _v.as_int(world_size, "world_size", min_value=1)
    n = pt.num_pages_per_request.astype(np.int64)
    b = n.size
    base, rem = n // world, n % world
    # extra pages: request i's rem[i] extras go to ranks start[i], start[i] + 1, ... (mod world)
    start = (np.concatenate([[0], np.cumsum(rem)[:-1]]) % world) if b else np.zeros(0, np.int64)
    counts = np.repeat(base[:, None], world, axis=1)                      # [B, world]
    ranks = np.arange(world)
    counts += ((ranks[None, :] - start[:, None]) % world) < rem[:, None]
    # position order: rank r's run of request i starts after ranks < r
    offsets = np.concatenate([np.zeros((b, 1), np.int64), np.cumsum(counts, axis=1)], axis=1)   # [B, world + 1]
    lpl = pt.last_page_len.astype(np.int64)
    kv_lens = pt.kv_lens.astype(np.int64)
    last_rank = np.where(n > 0, world - 1 - np.argmax((counts[:, ::-1] > 0), axis=1), -1)
    tables, pages, firsts = [], [], []
    for r in range(world):
        c = counts[:, r]
        indptr = np.concatenate([[0], np.cumsum(c)]).astype(np.int32)
        # positions in pt.indices of rank r's runs: request i's run starts at indptr_i + offsets[i, r]
        start = pt.indptr[:-1].astype(np.int64) + offsets[:, r] - indptr[:-1]
        held = pt.indices[np.repeat(start, c) + np.arange(int(indptr[-1]))].astype(np.int32)
        last = np.where(c == 0, 0, np.where(last_rank == r, lpl, pt.page_size)).astype(np.int32)
        tables.append(PageTable(indptr, np.arange(held.size, dtype=np.int32), last, pt.page_size))
        pages.append(held)
        firsts.append(np.minimum(offsets[:, r] * pt.page_size, kv_lens))
    return ShardPlan(tuple(tables), tuple(pages), tuple(firsts))


class ContextParallelDecode:
    """Batch decode with the KV cache split across ranks by position: each rank attends every query to its shard
    (kvattn.BatchDecodeWithPagedKVCache over its own pool, with LSE), the ranks' states are all-gathered over NCCL
    and merged in rank order (kvattn.merge_states), so every rank returns the whole attention.

    comm: an NCCL communicator of NVIDIA's nccl4py (``nccl.core.Communicator``), or any object with ``rank``,
    ``nranks`` and ``allgather(sendbuf, recvbuf, stream=handle)`` on CUDA-array-interface buffers. decode_kwargs go
    to the local decode wrapper (kv_layout, use_cuda_graph, ...).

        cp = ContextParallelDecode(comm)
        shards = cp.plan(page_table, 32, 8, 128)      # the full table; rank r keeps pages shards.pages[r]
        o, lse = cp.run(q, k_shard, v_shard)          # q [batch, Hq, D] on every rank; the shard's caches

    ``timings`` (a dict) receives the GPU time of the local attention and of the exchange + merge (us, CUDA
    events on the stream) when given: the communication reported apart from compute.
    """

    def __init__(self, comm, **decode_kwargs):
        from .decode import BatchDecodeWithPagedKVCache
        self.comm = comm
        self.rank, self.world = int(comm.rank), int(comm.nranks)
        self.decode = BatchDecodeWithPagedKVCache(**decode_kwargs)
        self.shards = None
        # The all-gather's buffers, kept across runs (a cuMemAlloc / cuMemFree pair per run synchronised the
        # device: b1 context 131072 took 390 us for 135 us of decode, run 20g), and the event after their last
        # reader (the merge), which a run on another stream waits for before overwriting them.
        self._gather = None
        self._gather_key = None
        self._gather_read = None   # an Event, once a run has recorded it

    def plan(self, page_table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int, **plan_kwargs):
        """Shard the full page table (shard_page_table) and plan this rank's decode over its shard. Returns the
        ShardPlan (every rank computes the same one)."""
        if not isinstance(page_table, PageTable):
            raise TypeError(f"page_table: expected a kvattn.PageTable, got {type(page_table).__name__}")
        self.shards = shard_page_table(page_table, self.world)
        self.decode.plan(self.shards.tables[self.rank], num_qo_heads, num_kv_heads, head_dim, **plan_kwargs)
        return self.shards

    def run(self, q, k_cache, v_cache=None, *, stream=None, timings=None):
        """q: [batch, Hq, D] (the same on every rank); k_cache / v_cache: this rank's pool, page j holding the full
        table's page shards.pages[rank][j]. Returns (o [batch, Hq, D] in q's dtype, lse [batch, Hq] float32)."""
        from .memory import DeviceArray, empty
        from .merge import merge_states
        from .stream import Event, as_stream
        if self.shards is None:
            raise RuntimeError("ContextParallelDecode.run: call plan() first")
        s = as_stream(stream)
        marks = [Event(), Event(), Event()] if timings is not None else None
        if marks:
            marks[0].record(s)
        o, lse = self.decode.run(q, k_cache, v_cache, return_lse=True, stream=s)
        if marks:
            marks[1].record(s)
        b, h, d = o.shape
        w, it = self.world, o.itemsize
        if self._gather_key != (b, h, d, o.dtype_name):
            self._gather = empty((w, b, h, d), o.dtype_name), empty((w, b, h), "float32")
            self._gather_key = (b, h, d, o.dtype_name)
        if self._gather_read is not None:
            s.wait(self._gather_read)   # (the previous run's merge, maybe on another stream, has read them)
        go, gl = self._gather
        self.comm.allgather(o, go, stream=s.ptr)
        self.comm.allgather(lse, gl, stream=s.ptr)
        # [rank, batch, ...] gathered; merge_states reads [batch, rank, ...]: the same memory, strides swapped
        ov = DeviceArray(go.ptr, (b, w, h, d), go.dtype, strides=(h * d * it, b * h * d * it, d * it, it), owner=go)
        lv = DeviceArray(gl.ptr, (b, w, h), gl.dtype, strides=(h * 4, b * h * 4, 4), owner=gl)
        out = merge_states(ov, lv, stream=s)
        self._gather_read = s.record(self._gather_read or Event(disable_timing=True))
        if marks:
            _phase_times(marks, s, timings, "attention_us", "exchange_merge_us")
        return out


@dataclasses.dataclass(frozen=True)
class ZigzagPlan:
    """A causal prompt of num_tokens split for context-parallel prefill: 2 * world chunks in position order
    (sizes differ by at most one token, the longer first); rank r holds chunks r and 2 * world - 1 - r, so every
    rank's causal work (a chunk's queries attend to all keys before its end) is the same to within a chunk's
    rounding. starts: int64 [2 world + 1], the chunks' first positions; positions[r]: int64 [n_r], the prompt
    positions rank r's shard holds (q, k and v rows of its shard, in this order: its low chunk, then its high one)."""
    num_tokens: int
    starts: np.ndarray
    positions: tuple

    @property
    def world_size(self) -> int:
        return len(self.positions)

    def chunks(self, rank: int) -> tuple:
        """Rank `rank`'s two chunk numbers (low, high)."""
        return rank, 2 * self.world_size - 1 - rank

    def causal_work(self, rank: int) -> int:
        """Query-key pairs rank `rank` computes: each of its chunks' queries against every key up to it."""
        total = 0
        for c in self.chunks(rank):   # queries a .. b - 1 see a + 1 .. b keys
            a, b = int(self.starts[c]), int(self.starts[c + 1])
            total += (a + 1 + b) * (b - a) // 2
        return total


def zigzag_plan(num_tokens: int, world_size: int) -> ZigzagPlan:
    """The zigzag split of a causal prompt over world_size ranks (see ZigzagPlan)."""
    n = _v.as_int(num_tokens, "num_tokens", min_value=0)
    world = _v.as_int(world_size, "world_size", min_value=1)
    c = 2 * world
    sizes = np.full(c, n // c, np.int64)
    sizes[:n % c] += 1
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    positions = tuple(np.concatenate([np.arange(starts[lo], starts[lo + 1]), np.arange(starts[hi], starts[hi + 1])])
                      for lo, hi in ((r, c - 1 - r) for r in range(world)))
    return ZigzagPlan(n, starts, positions)


class ContextParallelPrefill:
    """Causal prefill of one long prompt with its tokens split across ranks (zigzag_plan: two chunks each, so the
    causal work is balanced). Each rank holds q, k and v of its shard's tokens; the ranks' K/V are all-gathered
    over NCCL and put back in position order (one device-to-device copy per chunk), and each rank attends its two
    query chunks to the keys up to their ends (two ragged causal prefills over prefixes of the gathered K/V).
    Every query sees all its keys on its own rank, so there is no partial state to merge; each rank returns the
    outputs of its own tokens. (Chosen over a ring exchange of K/V blocks: at 131,072 tokens the gathered K/V is
    537 MB, about 1% of the prefill's time over NVLink; the all-gather is one NCCL call and needs no overlap
    schedule. It needs the whole K/V on every rank: 2 x 4 MB per 1,000 tokens at Hkv 8, D 128, bf16.)

    comm: as for ContextParallelDecode (``rank``, ``nranks``, ``allgather(sendbuf, recvbuf, stream=handle)``).

        cp = ContextParallelPrefill(comm)
        zz = cp.plan(num_tokens, 32, 8, 128)          # rank r feeds the rows of positions zz.positions[r]
        o = cp.run(q_shard, k_shard, v_shard)         # [n_r, Hq, D]: the attention of this rank's tokens

    ``timings`` (a dict) receives the GPU time of the exchange (all-gather and reorder) and of the attention (us).
    """

    def __init__(self, comm, **prefill_kwargs):
        from .prefill import BatchPrefillWithRaggedKVCache
        self.comm = comm
        self.rank, self.world = int(comm.rank), int(comm.nranks)
        self.parts = (BatchPrefillWithRaggedKVCache(**prefill_kwargs), BatchPrefillWithRaggedKVCache(**prefill_kwargs))
        self.zz = None
        self._queries = ()       # (part, first row in the shard, rows, keys before the chunk's end) per chunk
        self._reorder = ()       # (row in position order, row in the gathered buffer, rows) per chunk
        self._bufs = None        # (send k, send v or None, gathered k, gathered v, k and v in position order), kept
        self._bufs_key = None
        self._bufs_read = None   # an Event after the last run's attention, the buffers' last reader

    def plan(self, num_tokens: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, **plan_kwargs):
        """Split the prompt (zigzag_plan) and plan this rank's two causal prefills. Returns the ZigzagPlan (every
        rank computes the same one). plan_kwargs go to both prefill plans (causal is always on)."""
        if "causal" in plan_kwargs and not plan_kwargs.pop("causal"):
            raise ValueError("causal: context-parallel prefill is causal (a non-causal prompt needs no zigzag)")
        self.zz = zz = zigzag_plan(num_tokens, self.world)
        self.heads = (_v.as_int(num_qo_heads, "num_qo_heads", min_value=1),
                      _v.as_int(num_kv_heads, "num_kv_heads", min_value=1), _v.as_int(head_dim, "head_dim", min_value=1))
        shard = max(p.size for p in zz.positions)   # the all-gather's rows per rank (shorter shards padded)
        queries, reorder = [], []
        for rank in range(self.world):
            lo = 0
            for part, c in zip(self.parts, zz.chunks(rank)):
                a, b = int(zz.starts[c]), int(zz.starts[c + 1])
                if b == a:   # (a prompt shorter than 2 * world tokens: an empty chunk)
                    continue
                reorder.append((a, rank * shard + lo, b - a))
                if rank == self.rank:
                    part.plan(np.array([0, b - a], np.int32), np.array([0, b], np.int32), num_qo_heads, num_kv_heads,
                              head_dim, causal=True, **plan_kwargs)
                    queries.append((part, lo, b - a, b))
                lo += b - a
        self._queries, self._reorder, self._shard = tuple(queries), tuple(reorder), shard
        return zz

    def run(self, q, k, v, *, stream=None, timings=None):
        """q: [n_r, Hq, D], k / v: [n_r, Hkv, D], this rank's shard (rows in zz.positions[rank] order). Returns
        o [n_r, Hq, D] in q's dtype."""
        from .memory import asarray, empty
        from .pool import pool_empty
        from .stream import Event, as_stream
        from . import _driver
        if self.zz is None:
            raise RuntimeError("ContextParallelPrefill.run: call plan() first")
        zz, w, r = self.zz, self.world, self.rank
        hq, hkv, d = self.heads
        s = as_stream(stream)
        q, k, v = asarray(q, s), asarray(k, s), asarray(v, s)
        n_r = zz.positions[r].size
        for name, a, h in (("q", q, hq), ("k", k, hkv), ("v", v, hkv)):
            if a.shape != (n_r, h, d):
                raise ValueError(f"{name}: expected this rank's shard of shape {(n_r, h, d)}, got {a.shape}")
            if not a.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous array")
        if k.dtype != v.dtype:
            raise ValueError(f"v: expected k's dtype {k.dtype_name}, got {v.dtype_name}")
        shard = self._shard
        key = (shard, n_r, hkv, d, k.dtype_name)
        if self._bufs_key != key:
            dt = k.dtype_name
            pad = n_r < shard   # this rank's shard is copied into a padded send buffer
            self._bufs = (empty((shard, hkv, d), dt) if pad else None, empty((shard, hkv, d), dt) if pad else None,
                          empty((w, shard, hkv, d), dt), empty((w, shard, hkv, d), dt),
                          empty((zz.num_tokens, hkv, d), dt), empty((zz.num_tokens, hkv, d), dt))
            self._bufs_key = key
        if self._bufs_read is not None:
            s.wait(self._bufs_read)   # the previous run's attention (maybe on another stream) has read them
        sk, sv, gk, gv, pk, pv = self._bufs
        marks = [Event(), Event(), Event()] if timings is not None else None
        if marks:
            marks[0].record(s)
        row = hkv * d * k.itemsize
        for src, send, gathered, ordered in ((k, sk, gk, pk), (v, sv, gv, pv)):
            if n_r < shard:   # pad this rank's shard to the gather's row count (the pad rows are never read)
                if n_r:
                    _driver.call("cuMemcpyDtoDAsync", send.ptr, src.ptr, n_r * row, s.handle)
                src = send
            self.comm.allgather(src, gathered, stream=s.ptr)
            for dst, at, rows in self._reorder:   # every rank's chunks back to their positions
                _driver.call("cuMemcpyDtoDAsync", ordered.ptr + dst * row, gathered.ptr + at * row, rows * row,
                             s.handle)
        if marks:
            marks[1].record(s)
        out = pool_empty((n_r, hq, d), q.dtype, s)   # stream-ordered: no allocation call that synchronises
        for part, lo, n, end in self._queries:
            part.run(q[lo:lo + n], pk[:end], pv[:end], out=out[lo:lo + n], stream=s)
        self._bufs_read = s.record(self._bufs_read or Event(disable_timing=True))
        if marks:
            _phase_times(marks, s, timings, "exchange_us", "attention_us")
        return out


def _phase_times(marks, stream, timings: dict, first: str, second: str):
    """Records the last of three events on `stream`, waits for it, and stores the GPU time (us) between the first
    two as timings[first] and between the last two as timings[second]."""
    marks[2].record(stream)
    marks[2].synchronize()
    timings[first] = marks[0].elapsed_ms(marks[1]) * 1e3
    timings[second] = marks[1].elapsed_ms(marks[2]) * 1e3


#: The environment scripts/launch_cp.py gives each rank's process.
ENV_RANK, ENV_WORLD, ENV_UID = "KVATTN_CP_RANK", "KVATTN_CP_WORLD", "KVATTN_CP_UNIQUE_ID"


def communicator_from_env():
    """This process's NCCL communicator (nccl4py), from the rank, world size and unique id (hex) that
    scripts/launch_cp.py puts in the environment; a world of one (a fresh unique id) when they are absent.
    NVLink multicast stays off (NCCL_NVLS_ENABLE=0: the shared machines require it)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        import nccl.core as nccl
    except ImportError as exc:
        raise ImportError("context parallelism needs NVIDIA's nccl4py: pip install 'kvattn[multigpu]'") from exc
    if ENV_UID not in os.environ:
        return nccl.Communicator.init(1, 0, nccl.get_unique_id())
    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    uid = nccl.UniqueId.from_bytes(bytes.fromhex(os.environ[ENV_UID]))
    return nccl.Communicator.init(world, rank, uid)
