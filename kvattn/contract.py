"""The scheduler's device contract: the header every op's packed int32 plan buffer starts with, field by field.

Python writes the header through the indices below (never literals); CUDA reads it through `kvattn::PlanHeader`
(cuda_src/common.cuh), declared with the same fields in the same order. tests/test_contract.py compares the two
declarations field by field (CPU) and the compiled struct's offsets (GPU). Decode, prefill and every later op
(cascade, block-sparse, context parallelism) share it; the regions after the header are each op's own layout.
"""
from __future__ import annotations

import numpy as np

PLAN_HEADER = np.dtype([
    ("num_items", "<i4"),          # work items (CTAs with work; a padded graph-mode grid exits past it)
    ("num_merge", "<i4"),          # output rows merged from partial states (the merge kernel's row count)
    ("batch_size", "<i4"),         # requests in the plan
    ("num_partial_rows", "<i4"),   # partial (o, lse) rows the items write
    ("num_chunks", "<i4"),         # decode: CTAs of the split-KV grid
    ("num_kv_heads", "<i4"),       # prefill: KV heads per item (the sm90 kernel's units are items x heads)
    ("kv_head_group", "<i4"),      # prefill: KV heads walked together (sm90 units by head group; 0: all of them)
    ("reserved", "<i4", (1,)),
])
HEADER_INT32 = PLAN_HEADER.itemsize // 4


def align4(n: int) -> int:
    """n int32 elements rounded up to a multiple of 4 (16 bytes): where every region of a plan buffer starts."""
    return (n + 3) & ~3


def index(name: str) -> int:
    """The int32 index of a header field in the plan buffer."""
    return PLAN_HEADER.fields[name][1] // 4


NUM_ITEMS = index("num_items")
NUM_MERGE = index("num_merge")
BATCH_SIZE = index("batch_size")
NUM_PARTIAL_ROWS = index("num_partial_rows")
NUM_CHUNKS = index("num_chunks")
NUM_KV_HEADS = index("num_kv_heads")
KV_HEAD_GROUP = index("kv_head_group")


def page_size_shift(page_size: int) -> int:
    """The kernels' page_shift parameter: log2(page_size) for a power of two (they shift), else -1 (they divide)."""
    return (page_size.bit_length() - 1) if page_size & (page_size - 1) == 0 else -1


def write_header(buf: np.ndarray, *, num_items: int, num_merge: int, batch_size: int, num_partial_rows: int,
                 num_chunks: int = 0, num_kv_heads: int = 0, kv_head_group: int = 0):
    """Fill the header of an int32 plan buffer buf (at least HEADER_INT32 elements)."""
    buf[:HEADER_INT32] = 0
    buf[NUM_ITEMS] = num_items
    buf[NUM_MERGE] = num_merge
    buf[BATCH_SIZE] = batch_size
    buf[NUM_PARTIAL_ROWS] = num_partial_rows
    buf[NUM_CHUNKS] = num_chunks
    buf[NUM_KV_HEADS] = num_kv_heads
    buf[KV_HEAD_GROUP] = kv_head_group
