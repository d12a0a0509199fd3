"""KV-cache formats on the host (numpy only): ragged, paged, block-sparse, cascade.

The FlashInfer idea: ragged tensors, page tables and composable (cascade)
formats are all block-sparse matrices over one KV storage.  Semantics are
those of DESIGN.md section 3 (FlashInfer-compatible).  All index arrays are
stored as read-only, C-contiguous int32 arrays; constructors validate and
raise ValueError / TypeError naming the offending argument.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from . import _validate as _v

__all__ = [
    "Ragged",
    "PageTable",
    "PagedKVLayout",
    "BlockSparse",
    "CascadeLevels",
    "pack_mask",
    "unpack_mask",
]


def _set(obj, **kw):
    for k, val in kw.items():
        object.__setattr__(obj, k, val)


def _arrays_equal(a, b, names) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in names)


# ---------------------------------------------------------------------------
# Ragged
# ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Ragged:
    """Ragged batch: request i owns rows ``data[indptr[i]:indptr[i+1]]``.

    indptr: int32 [B+1], starts at 0, non-decreasing.
    """

    indptr: np.ndarray

    def __post_init__(self):
        _set(self, indptr=_v.as_indptr(self.indptr, "indptr"))

    @classmethod
    def from_lengths(cls, lengths) -> "Ragged":
        """lengths: int [B] (>= 0)."""
        lens = _v.as_index_array(lengths, "lengths", min_value=0)
        return cls(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]))

    @property
    def batch_size(self) -> int:
        return int(self.indptr.size - 1)

    @property
    def lengths(self) -> np.ndarray:
        """int32 [B]"""
        return np.diff(self.indptr).astype(np.int32)

    @property
    def total(self) -> int:
        return int(self.indptr[-1])

    def segment(self, i: int) -> slice:
        i = _v.as_int(i, "i", min_value=-self.batch_size, max_value=self.batch_size - 1)
        i %= max(self.batch_size, 1)
        return slice(int(self.indptr[i]), int(self.indptr[i + 1]))

    def __eq__(self, other):
        return isinstance(other, Ragged) and _arrays_equal(self, other, ["indptr"])

    __hash__ = None


# ---------------------------------------------------------------------------
# Cache layouts
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PagedKVLayout:
    """Paged cache layout: "NHD" = [num_pages, page_size, Hkv, D],
    "HND" = [num_pages, Hkv, page_size, D].  K and V are separate arrays, or
    one combined array [num_pages, 2, ...] (index 0 = K, 1 = V)."""

    kv_layout: str = "NHD"

    def __post_init__(self):
        _v.check_layout(self.kv_layout)

    @classmethod
    def of(cls, kv_layout) -> "PagedKVLayout":
        """Accept a PagedKVLayout or the strings "NHD" / "HND"."""
        return kv_layout if isinstance(kv_layout, PagedKVLayout) else cls(kv_layout)

    def cache_shape(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        if self.kv_layout == "NHD":
            return (num_pages, page_size, num_kv_heads, head_dim)
        return (num_pages, num_kv_heads, page_size, head_dim)

    def split(self, k_cache, v_cache=None):
        """(k_cache, v_cache) -> two 4-D arrays; v_cache=None means k_cache is [num_pages, 2, ...]."""
        k = np.asarray(k_cache)
        if v_cache is None:
            if k.ndim != 5 or k.shape[1] != 2:
                raise ValueError(
                    f"k_cache: with v_cache=None expected a combined [num_pages, 2, ...] 5-D array, got shape {k.shape}"
                )
            return k[:, 0], k[:, 1]
        v = np.asarray(v_cache)
        for name, a in (("k_cache", k), ("v_cache", v)):
            if a.ndim != 4:
                raise ValueError(f"{name}: expected a 4-D {self.kv_layout} cache, got shape {a.shape}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"v_cache: shape {v.shape} must match k_cache {k.shape} except the head dim")
        return k, v

    def to_nhd(self, cache) -> np.ndarray:
        """A 4-D cache of this layout viewed as [num_pages, page_size, Hkv, D] (no copy)."""
        return cache if self.kv_layout == "NHD" else cache.transpose(0, 2, 1, 3)

    def dims(self, cache) -> tuple:
        """(num_pages, page_size, num_kv_heads, head_dim) of a 4-D cache."""
        return tuple(int(x) for x in self.to_nhd(cache).shape)


# ---------------------------------------------------------------------------
# Page table
# ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PageTable:
    """CSR over physical pages.

    indptr: int32 [B+1]; indices: int32 [indptr[-1]] physical page ids (>= 0;
    ``validate(num_pages)`` checks the upper bound); last_page_len: int32 [B],
    in [1, page_size] for a request with pages; a request with zero pages has
    kv_len 0 and may store any value in [0, page_size] (kvattn writes 0).
    ``kv_len[i] = (pages_i - 1) * page_size + last_page_len[i]``.
    """

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    page_size: int

    def __post_init__(self):
        ps = _v.as_int(self.page_size, "page_size", min_value=1)
        indptr = _v.as_indptr(self.indptr, "indptr")
        b = indptr.size - 1
        indices = _v.as_index_array(self.indices, "indices")
        if indices.size != indptr[-1]:
            raise ValueError(f"indices: expected indptr[-1] = {int(indptr[-1])} page ids, got {indices.size}")
        if indices.size and indices.min() < 0:
            i = int(np.argmax(indices < 0))
            raise ValueError(f"indices: page ids must be >= 0, got {int(indices[i])} at position {i}")
        lpl = _v.as_index_array(self.last_page_len, "last_page_len")
        if lpl.size != b:
            raise ValueError(f"last_page_len: expected {b} entries (batch_size), got {lpl.size}")
        has = np.diff(indptr) > 0
        bad = (has & ((lpl < 1) | (lpl > ps))) | (~has & ((lpl < 0) | (lpl > ps)))
        if bad.any():
            i = int(np.argmax(bad))
            rng = "[1, page_size]" if has[i] else "[0, page_size] (request has no pages)"
            raise ValueError(f"last_page_len: must be in {rng} = {ps}, got {int(lpl[i])} for request {i}")
        _set(self, page_size=ps, indptr=indptr, indices=indices, last_page_len=lpl)

    # -- queries -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.indptr.size - 1)

    @property
    def num_pages_per_request(self) -> np.ndarray:
        """int32 [B]"""
        return np.diff(self.indptr).astype(np.int32)

    @property
    def kv_lens(self) -> np.ndarray:
        """int64 [B]: (pages - 1) * page_size + last_page_len, 0 for zero pages."""
        n = np.diff(self.indptr).astype(np.int64)
        return np.where(n > 0, (n - 1) * self.page_size + self.last_page_len, 0)

    @property
    def num_pages_used(self) -> int:
        """Number of page slots referenced (indptr[-1]); a page shared by two requests counts twice."""
        return int(self.indptr[-1])

    def pages(self, i: int) -> np.ndarray:
        """int32 [pages_i]: the physical pages of request i."""
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def token_slots(self, i: int) -> np.ndarray:
        """int64 [kv_len_i]: flat slot ``page * page_size + offset`` of each token of request i."""
        p = self.pages(i).astype(np.int64)
        kv = int(self.kv_lens[i])
        slots = (p[:, None] * self.page_size + np.arange(self.page_size)).ravel()
        return slots[:kv]

    def validate(self, num_pages: int, pool: str = "num_pages") -> "PageTable":
        """Check every page id is < num_pages; returns self. pool: what the error calls num_pages (e.g. the cache
        array it was read from)."""
        num_pages = _v.as_int(num_pages, "num_pages", min_value=0)
        if self.indices.size and self.indices.max() >= num_pages:
            i = int(np.argmax(self.indices >= num_pages))
            raise ValueError(f"indices: page ids must be < {pool} = {num_pages}, got {int(self.indices[i])} at "
                             f"position {i}")
        return self

    # -- construction ----------------------------------------------------------
    @classmethod
    def from_kv_lens(cls, kv_lens, page_size: int, num_pages: int | None = None, rng=None) -> "PageTable":
        """Build a table for ``kv_lens`` (int [B]) with pages scattered over a pool.

        num_pages: pool size (default: exactly the pages needed); must be >= the
        pages needed.  rng: int seed, numpy Generator or None.  The pages are a
        random sample (in random order) of the pool, as an allocator that has
        run for a while would leave them.  Example::

            PageTable.from_kv_lens([5, 0, 16], page_size=4, num_pages=10, rng=0)
            # pages per request 2, 0, 4; last_page_len [1, 0, 4]
        """
        ps = _v.as_int(page_size, "page_size", min_value=1)
        kv = _v.as_index_array(kv_lens, "kv_lens", min_value=0).astype(np.int64)
        n = -(-kv // ps)
        need = int(n.sum())
        if num_pages is None:
            num_pages = need
        num_pages = _v.as_int(num_pages, "num_pages", min_value=0)
        if num_pages < need:
            raise ValueError(f"num_pages: the pool needs at least {need} pages for these kv_lens, got {num_pages}")
        gen = np.random.default_rng(rng)
        indices = gen.permutation(num_pages)[:need]
        lpl = np.where(n > 0, kv - (n - 1) * ps, 0)
        return cls(np.concatenate([[0], np.cumsum(n)]), indices, lpl, ps)

    # -- conversions -----------------------------------------------------------
    def to_block_sparse(self, qo_indptr, num_pages: int | None = None) -> "BlockSparse":
        """The equivalent BSR over query rows x KV token slots.

        qo_indptr: int [B+1] query rows per request.  The matrix has shape
        (qo_indptr[-1], num_pages * page_size) (num_pages defaults to
        max page id + 1); column ``page * page_size + t`` is token t of that
        page.  Block shape (R, C): C = gcd(page_size, every partial last page
        length), R = gcd of the non-zero query lengths; with full last pages and
        equal query lengths this is R = qo_len, C = page_size (DESIGN.md 3).
        Row r of request i sees exactly the request's kv_len tokens.
        """
        qo = _v.as_indptr(qo_indptr, "qo_indptr", length=self.indptr.size)
        if num_pages is None:
            num_pages = int(self.indices.max()) + 1 if self.indices.size else 0
        self.validate(num_pages)
        ps = self.page_size
        qlen = np.diff(qo).astype(np.int64)
        has = np.diff(self.indptr) > 0
        c = math.gcd(ps, *self.last_page_len[has].tolist())
        r = math.gcd(*qlen[qlen > 0].tolist()) if (qlen > 0).any() else 1
        sub = ps // c
        cols_per_req, counts = [], []
        for i in range(self.batch_size):
            nblk = -(-int(self.kv_lens[i]) // c)
            blk = (self.pages(i).astype(np.int64)[:, None] * sub + np.arange(sub)).ravel()[:nblk]
            nrow = int(qlen[i]) // r
            cols_per_req.extend([blk] * nrow)
            counts.extend([blk.size] * nrow)
        indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        indices = np.concatenate(cols_per_req) if cols_per_req else np.zeros(0, np.int64)
        return BlockSparse(indptr, indices, (r, c), (int(qo[-1]), num_pages * ps))

    def host_arrays(self) -> dict:
        """The index arrays (int32, C-contiguous) as a dict, ready for a host->device copy."""
        return {"indptr": self.indptr, "indices": self.indices, "last_page_len": self.last_page_len}

    def to_device(self, copy: Callable[[np.ndarray], object]) -> dict:
        """Copy the index arrays with ``copy`` (e.g. kvattn.memory's host->device
        function); returns {"indptr", "indices", "last_page_len": device arrays,
        "page_size": int}."""
        out = {k: copy(a) for k, a in self.host_arrays().items()}
        out["page_size"] = self.page_size
        return out

    def __eq__(self, other):
        return (
            isinstance(other, PageTable)
            and self.page_size == other.page_size
            and _arrays_equal(self, other, ["indptr", "indices", "last_page_len"])
        )

    __hash__ = None


# ---------------------------------------------------------------------------
# Block-sparse (BSR)
# ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class BlockSparse:
    """Block-sparse row matrix, scipy BSR semantics (structure only).

    indptr: int32 [M/R + 1]; indices: int32 [nnz] block-column ids in
    [0, N/C), no duplicates within a block row; block_shape (R, C); shape (M, N)
    with M % R == 0 and N % C == 0.
    """

    indptr: np.ndarray
    indices: np.ndarray
    block_shape: tuple
    shape: tuple

    def __post_init__(self):
        bs, sh = tuple(self.block_shape), tuple(self.shape)
        if len(bs) != 2:
            raise ValueError(f"block_shape: expected (R, C), got {self.block_shape!r}")
        if len(sh) != 2:
            raise ValueError(f"shape: expected (M, N), got {self.shape!r}")
        r = _v.as_int(bs[0], "block_shape[0]", min_value=1)
        c = _v.as_int(bs[1], "block_shape[1]", min_value=1)
        m = _v.as_int(sh[0], "shape[0]", min_value=0)
        n = _v.as_int(sh[1], "shape[1]", min_value=0)
        if m % r:
            raise ValueError(f"shape: M = {m} must be a multiple of R = {r}")
        if n % c:
            raise ValueError(f"shape: N = {n} must be a multiple of C = {c}")
        indptr = _v.as_indptr(self.indptr, "indptr", length=m // r + 1)
        indices = _v.as_index_array(self.indices, "indices")
        if indices.size != indptr[-1]:
            raise ValueError(f"indices: expected indptr[-1] = {int(indptr[-1])} entries, got {indices.size}")
        if indices.size and (indices.min() < 0 or indices.max() >= n // c):
            i = int(np.argmax((indices < 0) | (indices >= n // c)))
            raise ValueError(f"indices: block columns must be in [0, {n // c}), got {int(indices[i])} at position {i}")
        rows = np.repeat(np.arange(m // r), np.diff(indptr))
        key = rows.astype(np.int64) * max(n // c, 1) + indices
        if np.unique(key).size != key.size:
            raise ValueError("indices: duplicate block column within a block row")
        _set(self, indptr=indptr, indices=indices, block_shape=(r, c), shape=(m, n))

    @property
    def nnz_blocks(self) -> int:
        return int(self.indices.size)

    @property
    def num_block_rows(self) -> int:
        return int(self.indptr.size - 1)

    def columns(self, block_row: int) -> np.ndarray:
        """int64 [nnz_in_row * C]: the dense columns of a block row, in stored order."""
        r, c = self.block_shape
        blk = self.indices[self.indptr[block_row]:self.indptr[block_row + 1]].astype(np.int64)
        return (blk[:, None] * c + np.arange(c)).ravel()

    def to_dense_mask(self) -> np.ndarray:
        """bool [M, N]: True inside every stored block."""
        r, c = self.block_shape
        m, n = self.shape
        blocks = np.zeros((m // r, n // c), dtype=bool)
        rows = np.repeat(np.arange(m // r), np.diff(self.indptr))
        blocks[rows, self.indices] = True
        return np.repeat(np.repeat(blocks, r, axis=0), c, axis=1)

    @classmethod
    def from_dense_mask(cls, mask, block_shape) -> "BlockSparse":
        """BSR whose blocks are those holding any True of ``mask`` (bool [M, N]); sorted indices."""
        mask = _v.as_bool_array(mask, "mask")
        if mask.ndim != 2:
            raise ValueError(f"mask: expected a 2-D bool array, got shape {mask.shape}")
        r, c = (int(x) for x in block_shape)
        m, n = mask.shape
        if r < 1 or c < 1 or m % r or n % c:
            raise ValueError(f"block_shape: {block_shape!r} must divide mask shape {mask.shape}")
        blocks = mask.reshape(m // r, r, n // c, c).any(axis=(1, 3))
        rows, cols = np.nonzero(blocks)
        indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=m // r))])
        return cls(indptr, cols, (r, c), (m, n))

    @classmethod
    def from_page_table(cls, page_table: "PageTable", qo_indptr, num_pages: int | None = None) -> "BlockSparse":
        """Same as ``page_table.to_block_sparse(qo_indptr, num_pages)``."""
        return page_table.to_block_sparse(qo_indptr, num_pages)

    def __eq__(self, other):
        return (
            isinstance(other, BlockSparse)
            and self.block_shape == other.block_shape
            and self.shape == other.shape
            and _arrays_equal(self, other, ["indptr", "indices"])
        )

    __hash__ = None


# ---------------------------------------------------------------------------
# Cascade (composable) format
# ---------------------------------------------------------------------------
class CascadeLevels:
    """A list of levels over one page pool; each level is ``(qo_indptr, PageTable)``.

    Every level partitions the same query rows (equal qo_indptr[-1]) into
    groups; the group's query rows attend to that level's pages, and the
    per-level (o, lse) are merged.  Levels go from coarse (shared prefixes) to
    fine: the boundaries of every level must be boundaries of the last level.
    In cascade attention a causal mask applies to the last level only, so a
    query row sees every token of the coarser levels.
    """

    def __init__(self, levels: Sequence):
        levels = list(levels)
        if not levels:
            raise ValueError("levels: expected at least one (qo_indptr, PageTable) level, got none")
        out = []
        for li, lvl in enumerate(levels):
            if not isinstance(lvl, (tuple, list)) or len(lvl) != 2:
                raise TypeError(f"levels[{li}]: expected a (qo_indptr, PageTable) pair")
            qo, pt = lvl
            if not isinstance(pt, PageTable):
                raise TypeError(f"levels[{li}]: expected a PageTable, got {type(pt).__name__}")
            qo = _v.as_indptr(qo, f"levels[{li}].qo_indptr", length=pt.indptr.size)
            if out and qo[-1] != out[0][0][-1]:
                raise ValueError(
                    f"levels[{li}].qo_indptr: every level must cover the same {int(out[0][0][-1])} query rows, got {int(qo[-1])}"
                )
            if out and pt.page_size != out[0][1].page_size:
                raise ValueError(f"levels[{li}]: page_size {pt.page_size} differs from level 0's {out[0][1].page_size}")
            out.append((qo, pt))
        last = out[-1][0]
        for li, (qo, _) in enumerate(out[:-1]):
            if not np.isin(qo, last).all():
                raise ValueError(f"levels[{li}].qo_indptr: its boundaries must also be boundaries of the last level")
        self.levels = out

    def __len__(self):
        return len(self.levels)

    def __iter__(self):
        return iter(self.levels)

    def __getitem__(self, i):
        return self.levels[i]

    @property
    def page_size(self) -> int:
        return self.levels[0][1].page_size

    def validate(self, num_pages: int) -> "CascadeLevels":
        for _, pt in self.levels:
            pt.validate(num_pages)
        return self

    def _groups(self, li: int) -> np.ndarray:
        """int [B_last]: the group of level li that holds each last-level request's first row."""
        qo, pt = self.levels[li]
        starts = self.levels[-1][0][:-1]
        return np.clip(np.searchsorted(qo, starts, side="right") - 1, 0, max(pt.batch_size - 1, 0))

    def flatten(self):
        """The equivalent single level: (qo_indptr int32 [B+1], PageTable) with B the
        last level's batch; request i's pages are the pages of its group at every
        level, coarse first.  Every non-last level must end its requests on full
        pages (else ValueError).  A last-level request with zero query rows is
        attributed to the group holding its row position (ambiguous at a group
        boundary)."""
        for li, (_, pt) in enumerate(self.levels[:-1]):
            has = np.diff(pt.indptr) > 0
            if (pt.last_page_len[has] != pt.page_size).any():
                raise ValueError(f"levels[{li}]: a non-last level must use full last pages to be flattened")
        qo_last, pt_last = self.levels[-1]
        maps = [self._groups(li) for li in range(len(self.levels))]
        pages, counts = [], []
        for i in range(pt_last.batch_size):
            pg = []
            for li, (_, pt) in enumerate(self.levels[:-1]):
                if pt.batch_size:
                    pg.append(pt.pages(int(maps[li][i])))
            pg.append(pt_last.pages(i))
            p = np.concatenate(pg)
            pages.append(p)
            counts.append(p.size)
        indices = np.concatenate(pages) if pages else np.zeros(0, np.int32)
        indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        lpl = pt_last.last_page_len.copy()
        full = (np.diff(pt_last.indptr) == 0) & (np.asarray(counts) > 0)
        lpl[full] = pt_last.page_size  # suffix empty: the prefix's full last page ends the request
        return qo_last, PageTable(indptr, indices, lpl, pt_last.page_size)

    @classmethod
    def from_shared_prefixes(cls, page_lists, kv_lens, qo_lens, page_size: int, group_sizes=None) -> "CascadeLevels":
        """Two-level form from per-request page lists.

        page_lists: sequence of B int sequences (request i's pages, in order);
        kv_lens: int [B]; qo_lens: int [B]; group_sizes: int [G] summing to B
        (consecutive requests form a group), default: consecutive requests whose
        first page is the same.  Level 0 holds, per group, the longest common
        prefix of full pages that leaves every member at least qo_len tokens of
        its own (so causal cascade stays exact); level 1 holds each request's
        remaining pages.  Example::

            CascadeLevels.from_shared_prefixes(
                [[7, 3, 9], [7, 3, 4, 1]], kv_lens=[10, 13], qo_lens=[1, 1], page_size=4)
            # level 0: one group, qo_indptr [0, 2], pages [7, 3]
            # level 1: qo_indptr [0, 1, 2], pages [9] and [4, 1], last_page_len [2, 1]
        """
        ps = _v.as_int(page_size, "page_size", min_value=1)
        lists = [_v.as_index_array(p, f"page_lists[{i}]", min_value=0) for i, p in enumerate(page_lists)]
        b = len(lists)
        kv = _v.as_index_array(kv_lens, "kv_lens", min_value=0).astype(np.int64)
        qo = _v.as_index_array(qo_lens, "qo_lens", min_value=0).astype(np.int64)
        if kv.size != b:
            raise ValueError(f"kv_lens: expected {b} entries (one per page list), got {kv.size}")
        if qo.size != b:
            raise ValueError(f"qo_lens: expected {b} entries (one per page list), got {qo.size}")
        npg = np.array([p.size for p in lists], dtype=np.int64)
        if (npg != -(-kv // ps)).any():
            i = int(np.argmax(npg != -(-kv // ps)))
            raise ValueError(f"page_lists[{i}]: kv_len {int(kv[i])} needs {-(-int(kv[i]) // ps)} pages of {ps}, got {npg[i]}")
        if group_sizes is None:
            sizes, i = [], 0
            while i < b:
                j = i + 1
                while j < b and lists[i].size and lists[j].size and lists[j][0] == lists[i][0]:
                    j += 1
                sizes.append(j - i)
                i = j
        else:
            sizes = _v.as_index_array(group_sizes, "group_sizes", min_value=0).tolist()
            if sum(sizes) != b:
                raise ValueError(f"group_sizes: must sum to the batch size {b}, got {sum(sizes)}")
        # pages a member can give to the shared prefix: full pages not among its last qo_len tokens
        cap = np.maximum(kv - qo, 0) // ps
        pre_pages, pre_counts, sfx, g0 = [], [], [0] * b, 0
        for g in sizes:
            members = range(g0, g0 + g)
            p = min((int(cap[m]) for m in members), default=0)
            if g < 2:
                p = 0  # nothing is shared in a group of one
            for m in members[1:]:   # the longest run of pages every member shares with the first (vectorised)
                if not p:
                    break
                diff = np.flatnonzero(lists[m][:p] != lists[g0][:p])
                if diff.size:
                    p = int(diff[0])
            pre_pages.append(lists[g0][:p] if g else np.zeros(0, np.int32))
            pre_counts.append(p)
            for m in members:
                sfx[m] = p
            g0 += g
        cq = np.concatenate([[0], np.cumsum(qo)])
        qo0 = cq[np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])]
        lvl0 = PageTable(
            np.concatenate([[0], np.cumsum(pre_counts, dtype=np.int64)]),
            np.concatenate(pre_pages) if pre_pages else np.zeros(0, np.int32),
            np.where(np.asarray(pre_counts, dtype=np.int64) > 0, ps, 0),
            ps,
        )
        suf = [lists[m][sfx[m]:] for m in range(b)]
        skv = kv - np.asarray(sfx, dtype=np.int64) * ps
        sn = np.array([s.size for s in suf], dtype=np.int64)
        lvl1 = PageTable(
            np.concatenate([[0], np.cumsum(sn)]),
            np.concatenate(suf) if suf else np.zeros(0, np.int32),
            np.where(sn > 0, skv - (sn - 1) * ps, 0),
            ps,
        )
        return cls([(qo0, lvl0), (cq, lvl1)])


# ---------------------------------------------------------------------------
# Custom masks
# ---------------------------------------------------------------------------
def pack_mask(masks, indptr=None):
    """Bit-pack custom masks per request, little bit order (FlashInfer segment_packbits).

    masks: a sequence of per-request bool [qo_i, kv_i] arrays (flattened
    row-major and concatenated), or a flat bool [sum(qo*kv)] array with
    ``indptr`` int [B+1] (bit offsets, = cumsum(qo*kv)).  Each request starts on
    a byte boundary.  Returns (packed uint8 [mask_indptr[-1]], mask_indptr int32
    [B+1] byte offsets).
    """
    if indptr is None:
        if isinstance(masks, np.ndarray):
            raise ValueError("indptr: required when masks is a flat array (bit offsets, cumsum(qo*kv))")
        parts = [_v.as_bool_array(m, f"masks[{i}]").ravel() for i, m in enumerate(masks)]
        indptr = np.concatenate([[0], np.cumsum([p.size for p in parts], dtype=np.int64)])
        flat = np.concatenate(parts) if parts else np.zeros(0, bool)
    else:
        flat = _v.as_bool_array(masks, "masks").ravel()
    indptr = _v.as_indptr(indptr, "indptr", total=flat.size)
    lens = np.diff(indptr).astype(np.int64)
    nbytes = -(-lens // 8)
    byte_indptr = np.concatenate([[0], np.cumsum(nbytes)])
    # pad every segment to a multiple of 8 bits, then pack once
    padded = np.zeros(int(byte_indptr[-1]) * 8, dtype=bool)
    seg = np.repeat(np.arange(lens.size), lens)
    pos = byte_indptr[seg] * 8 + (np.arange(flat.size) - indptr[seg])
    padded[pos] = flat
    packed = np.packbits(padded, bitorder="little")
    return packed, _v.as_index_array(byte_indptr, "mask_indptr")


def unpack_mask(packed, mask_indptr, indptr) -> np.ndarray:
    """Inverse of pack_mask: packed uint8 [mask_indptr[-1]], mask_indptr int [B+1]
    (byte offsets), indptr int [B+1] (bit offsets) -> flat bool [indptr[-1]]."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed: expected a uint8 array, got dtype {packed.dtype}")
    mind = _v.as_indptr(mask_indptr, "mask_indptr", total=packed.size)
    ind = _v.as_indptr(indptr, "indptr", length=mind.size)
    lens = np.diff(ind).astype(np.int64)
    if (np.diff(mind) != -(-lens // 8)).any():
        raise ValueError("mask_indptr: byte segments must be ceil(bit length / 8) of indptr's segments")
    bits = np.unpackbits(packed.ravel(), bitorder="little").astype(bool)
    seg = np.repeat(np.arange(lens.size), lens)
    pos = mind[seg].astype(np.int64) * 8 + (np.arange(int(ind[-1])) - ind[seg])
    return bits[pos]
