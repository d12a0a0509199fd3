"""Context parallelism, the plan: split each request's KV pages across ranks by position, balanced by bytes.

A context-parallel decode (or prefill) gives every rank a shard of each request's KV cache; each rank attends its
query rows to its shard and returns (o, lse); the ranks' states are gathered and merged (kvattn.merge_states, in
rank order). Every page of the full table lands on exactly one rank, in position order (rank 0 holds each
request's first pages), so the shards of a request are contiguous runs of its tokens.
"""
from __future__ import annotations

import dataclasses

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
