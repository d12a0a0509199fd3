"""CPU tests of append_paged_kv_cache's host checks (every bad index named before anything is written) and of
its parameter struct."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvattn import compiler, kernels
from kvattn.formats import PageTable
from kvattn.page import APPEND_PARAMS, _host_indices, get_batch_indices_positions
from kvattn.reference import batch_indices_positions


def _pt():
    # request 0: 2 pages (kv 7 at page 4), request 1: 1 page (kv 2), request 2: none
    return PageTable([0, 2, 3, 3], [5, 1, 0], [3, 2, 0], 4)


def test_batch_indices_positions_from_indptr():
    b, pos = get_batch_indices_positions([0, 3, 5, 5], _pt())
    assert b.tolist() == [0, 0, 0, 1, 1] and pos.tolist() == [4, 5, 6, 0, 1]
    assert b.dtype == np.int32 and pos.dtype == np.int32
    b2, pos2 = get_batch_indices_positions([0, 3, 5, 5], [7, 2, 0])
    assert b2.tolist() == b.tolist() and pos2.tolist() == pos.tolist()


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=12),
       st.sampled_from([1, 5, 16]))
def test_host_indices_from_append_indptr_match_the_reference(reqs, page):
    """The host path's int32 batch indices / positions (derived from append_indptr) are the float64 reference's."""
    kv = [a + n for a, n in reqs]            # lengths after the append
    appended = [n for _, n in reqs]
    pt = PageTable.from_kv_lens(np.array(kv), page, rng=np.random.default_rng(0))
    indptr = np.concatenate([[0], np.cumsum(appended)]).astype(np.int32)
    nnz = int(indptr[-1])
    h = _host_indices(nnz, indptr, None, None, pt, pt.num_pages_used)
    b, pos = batch_indices_positions(indptr, pt.kv_lens)
    assert h[:nnz].tolist() == b.tolist() and h[nnz:2 * nnz].tolist() == pos.tolist()
    assert h.tolist() == _host_indices(nnz, None, b, pos, pt, pt.num_pages_used).tolist()


def test_host_indices_pack_every_array():
    h = _host_indices(5, [0, 3, 5, 5], None, None, _pt(), 6)
    assert h.dtype == np.int32
    assert h.tolist() == [0, 0, 0, 1, 1, 4, 5, 6, 0, 1] + [0, 2, 3, 3] + [5, 1, 0] + [3, 2, 0]


@pytest.mark.parametrize("kw,msg", [
    (dict(append_indptr=[0, 3, 5, 6]), "request 2 appends 1 tokens but its kv_len is only 0"),
    (dict(append_indptr=[0, 8, 8, 8]), "request 0 appends 8 tokens but its kv_len is only 7"),
    (dict(batch_indices=[0, 3], positions=[0, 0]), "batch_indices: token 1 names request 3"),
    (dict(batch_indices=[0, 1], positions=[7, 0]), r"positions: token 0 has position 7, outside \[0, kv_len 7\)"),
    (dict(batch_indices=[0, 1], positions=[0, -1]), "positions: must be >= 0|positions: token 1"),
    (dict(batch_indices=[0, 1], positions=[0]), "positions: expected 2 entries"),
    (dict(batch_indices=[0, 1]), "both required"),
    (dict(append_indptr=[0, 1, 2, 2], batch_indices=[0, 1], positions=[0, 0]), "not both"),
])
def test_host_indices_errors(kw, msg):
    args = dict(append_indptr=None, batch_indices=None, positions=None)
    args.update(kw)
    nnz = 2 if kw.get("append_indptr") is None else int(kw["append_indptr"][-1])
    with pytest.raises(ValueError, match=msg):
        _host_indices(nnz, args["append_indptr"], args["batch_indices"], args["positions"], _pt(), 6)


def test_host_indices_page_ids_beyond_the_cache():
    with pytest.raises(ValueError, match=r"page ids must be < num_pages \(the pages k_cache holds\) = 5, got 5"):
        _host_indices(1, None, [0], [0], _pt(), 5)


def test_append_param_struct_size_matches_c_struct():
    src = '#include "page.cuh"\n' + kernels.size_assert("kvattn::AppendParams", APPEND_PARAMS)
    compiler.compile_cubin(src, "page_asserts.cu", [], [], "sm_90a")


def test_append_params_pack_with_one_setter():
    """_launcher packs every field with one struct.Struct: they must follow each other with no padding."""
    p = kernels.ParamBuffer(APPEND_PARAMS)
    p.setter(*APPEND_PARAMS.names)(*range(1, 1 + len(APPEND_PARAMS.names)))
    assert [int(p[n]) for n in APPEND_PARAMS.names] == list(range(1, 1 + len(APPEND_PARAMS.names)))


def test_append_cache_hint_instances_compile_without_spills(monkeypatch):
    """bench_append.py --hints' instances (page.HINTS 1, the default: no-L1 loads, streaming stores; 2: loads only;
    0: plain, no define) build for sm_90a with 0 spills."""
    from kvattn import page

    def hints_define():
        return dict(page.append_spec("bfloat16", 128).defines).get("KVATTN_APPEND_HINTS")
    assert page.HINTS == 1 and hints_define() == 1
    monkeypatch.setattr(page, "HINTS", 0)
    assert hints_define() is None
    for hints in (1, 2):
        monkeypatch.setattr(page, "HINTS", hints)
        spec = page.append_spec("bfloat16", 128)
        assert hints_define() == hints
        compiled, _ = spec.compile("sm_90a")
        assert all(r.spills == 0 for r in compiled.resources.values())


@pytest.mark.parametrize("loads_first", [1, 0])
def test_append_load_orders_compile_without_spills(loads_first, monkeypatch):
    """Both sides of bench_append.py --loads-first (page.LOADS_FIRST 1, the default since run 53a: a token's new rows
    loaded before its page lookup; 0: after) are their own instances (1 a define in the cache key, 0 none) and
    build with 0 spills for the registered shapes, RoPE and fp8 included."""
    from kvattn import page
    assert page.LOADS_FIRST == 1
    monkeypatch.setattr(page, "LOADS_FIRST", loads_first)
    for args in (("bfloat16", 128), ("float16", 128), ("bfloat16", 64), ("bfloat16", 128, 1),
                 ("bfloat16", 128, 0, "float8_e4m3fn")):
        spec = page.append_spec(*args)
        assert (("KVATTN_APPEND_LOADS_FIRST", 1) in spec.defines) == bool(loads_first)
        compiled, _ = spec.compile("sm_90a")
        assert all(r.spills == 0 for r in compiled.resources.values())
