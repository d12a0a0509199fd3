"""The device contract: kvattn.contract.PLAN_HEADER against kvattn::PlanHeader (cuda_src/common.cuh), field by
field; both decode and prefill plans write their header through it."""
import os
import re

import numpy as np
from kvattn import compiler, contract, scheduler

_C_TYPES = {"int": np.dtype("<i4")}


def _cuda_fields():
    """(name, numpy dtype, count) of each member of struct PlanHeader, in declaration order."""
    src = open(os.path.join(compiler.source_dir(), "common.cuh")).read()
    body = re.search(r"struct PlanHeader \{(.*?)\};", src, re.S).group(1)
    out = []
    for line in body.splitlines():
        code = line.split("//")[0].strip()
        if not code:
            continue
        m = re.fullmatch(r"(\w+)\s+(\w+)(?:\[(\d+)\])?;", code)
        assert m, f"unparsed PlanHeader member: {code!r}"
        out.append((m.group(2), _C_TYPES[m.group(1)], int(m.group(3) or 1)))
    return out


def test_plan_header_matches_cuda_struct_field_by_field():
    py = [(name, contract.PLAN_HEADER.fields[name][0]) for name in contract.PLAN_HEADER.names]
    cu = _cuda_fields()
    assert [n for n, _ in py] == [n for n, _, _ in cu]
    offset = 0
    for (name, dt), (_, ctype, count) in zip(py, cu):
        base = dt.base if dt.shape else dt
        assert base == ctype and (dt.shape or (1,))[0] == count, name
        assert contract.PLAN_HEADER.fields[name][1] == offset, f"{name}: offset"
        offset += ctype.itemsize * count
    assert offset == contract.PLAN_HEADER.itemsize == 4 * contract.HEADER_INT32 == 32


def test_decode_and_prefill_plans_write_the_named_header():
    p = scheduler.plan_decode(np.array([5000, 17, 0, 300]), 16, 8, 2, 128, num_sms=132, ctas_per_sm=3,
                              allow_no_split=False)
    h = p.header
    assert h[contract.NUM_ITEMS] == p.num_work and h[contract.NUM_MERGE] == p.num_merge
    assert h[contract.BATCH_SIZE] == 4 and h[contract.NUM_PARTIAL_ROWS] == p.num_partial_rows
    assert h[contract.NUM_CHUNKS] == p.num_chunks
    buf = np.full(16, 7, np.int32)
    contract.write_header(buf, num_items=3, num_merge=2, batch_size=5, num_partial_rows=9)
    assert list(buf[:8]) == [3, 2, 5, 9, 0, 0, 0, 0] and (buf[8:] == 7).all()
    contract.write_header(buf, num_items=3, num_merge=2, batch_size=5, num_partial_rows=9, num_kv_heads=8,
                          kv_head_group=2)
    assert buf[contract.NUM_KV_HEADS] == 8 and buf[contract.KV_HEAD_GROUP] == 2
