"""Context parallelism, the plan: split each request's KV pages across ranks by position, balanced by bytes.

A context-parallel decode (or prefill) gives every rank a shard of each request's KV cache; each rank attends its
query rows to its shard and returns (o, lse); the ranks' states are gathered and merged (kvattn.merge_states, in
rank order). Every page of the full table lands on exactly one rank, in position order (rank 0 holds each
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
            marks[2].record(s)
            marks[2].synchronize()
            timings["attention_us"] = marks[0].elapsed_ms(marks[1]) * 1e3
            timings["exchange_merge_us"] = marks[1].elapsed_ms(marks[2]) * 1e3
        return out


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
