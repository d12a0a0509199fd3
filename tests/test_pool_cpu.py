"""CPU tests of the stream-ordered pool's bookkeeping (the driver calls are faked): a freed block is reused only
for the same size on the same stream, a block read on another stream is freed after waiting for that stream and
never reused directly, and the free lists are bounded."""
import gc

import numpy as np
import pytest

from kvattn import pool, stream as st


@pytest.fixture
def fake_driver(monkeypatch):
    calls = []
    next_ptr = [0x100000]

    def alloc(nbytes, p, s):
        next_ptr[0] += 0x10000
        calls.append(("alloc", nbytes, s))
        return 0, next_ptr[0]

    def free(ptr, s):
        calls.append(("free", ptr, s))
        return (0,)

    waits = []
    monkeypatch.setattr(pool, "_hot", [alloc, free])
    monkeypatch.setattr(pool, "_pools", {0: object(), 1: object()})
    monkeypatch.setattr(pool, "_free_lists", {})
    monkeypatch.setattr(pool, "_free_bytes", [0])
    monkeypatch.setattr(st, "order_after", lambda producer, consumer: waits.append((producer, consumer.ptr)))
    return calls, waits


F16 = np.dtype(np.float16)


def test_freed_block_is_reused_for_the_same_size_and_stream_only(fake_driver):
    calls, _ = fake_driver
    s1, s2 = st.as_stream(None), st.as_stream(0x7000)
    a = pool.pool_empty((4, 8), F16, s1, 0)
    ptr = a.ptr
    assert a.stream == 1 and a.strides == (16, 2)
    del a
    gc.collect()
    b = pool.pool_empty((4, 8), F16, s1, 0)        # same size, same stream: the same block, no driver call
    assert b.ptr == ptr and [c[0] for c in calls] == ["alloc"]
    c = pool.pool_empty((4, 8), F16, s2, 0)        # another stream: a new block
    d = pool.pool_empty((4, 16), F16, s1, 0)       # another size: a new block
    assert c.ptr != ptr and d.ptr != ptr and [x[0] for x in calls] == ["alloc"] * 3
    del b
    gc.collect()
    e = pool.pool_empty((4, 8), F16, s1, 1)     # the same size and stream on another device: a new block
    assert e.ptr != ptr and [x[0] for x in calls] == ["alloc"] * 4


def test_block_read_on_another_stream_waits_then_frees(fake_driver):
    calls, waits = fake_driver
    a = pool.pool_empty((4, 8), F16, st.as_stream(None), 0)
    ptr = a.ptr
    pool.note_use(a[1:], 0x9000)                # exported (a view) to a consumer on stream 0x9000
    del a
    gc.collect()
    assert waits == [(0x9000, 1)] and calls[-1] == ("free", ptr, 1)
    b = pool.pool_empty((4, 8), F16, st.as_stream(None), 0)
    assert b.ptr != ptr


def test_free_lists_are_bounded(fake_driver, monkeypatch):
    calls, _ = fake_driver
    s = st.as_stream(None)
    arrays = [pool.pool_empty((64,), F16, s, 0) for _ in range(pool.FREE_LIST_BLOCKS + 3)]
    ptrs = [a.ptr for a in arrays]
    del arrays
    gc.collect()
    frees = [c for c in calls if c[0] == "free"]
    assert len(frees) == 3 and pool._free_bytes[0] == pool.FREE_LIST_BLOCKS * 128
    monkeypatch.setattr(pool, "FREE_LIST_BYTES", 0)
    x = pool.pool_empty((1000,), F16, s, 0)
    del x
    gc.collect()
    assert calls[-1][0] == "free"               # over the byte bound: straight back to the pool
    pool.release_free_lists()
    assert pool._free_bytes[0] == 0 and len([c for c in calls if c[0] == "free"]) == 4 + pool.FREE_LIST_BLOCKS
    assert set(ptrs) >= {c[1] for c in calls if c[0] == "free" and c[1] in ptrs}


def _stream_calls(calls, handle):
    """The names of the faked driver calls that name the stream `handle`, in order."""
    return [name for name, args in calls if any(type(x) is not np.ndarray and _is_handle(x, handle) for x in args)]


def _is_handle(x, handle):
    try:
        return int(x) == handle
    except (TypeError, ValueError):
        return False


def test_a_created_stream_outlives_its_blocks_and_frees_its_free_list_before_it_is_destroyed():
    """Run 50a's segfault: a test's own kvattn.Stream was collected before the output allocated on it, and the
    output's free was queued on the destroyed handle. Now the block keeps its Stream alive; once both are garbage
    (either order), the block kept in the free list is freed on the stream, then the stream is destroyed, and no
    free-list entry names the dead handle."""
    import weakref
    from _fake_driver import fake_driver
    for stream_first in (True, False):
        with fake_driver() as calls:
            s = st.Stream()
            h, gone = s.ptr, weakref.ref(s)
            a = pool.pool_empty((4, 8), F16, s, 0)
            if stream_first:
                del s
                gc.collect()
                assert gone() is not None and "cuStreamDestroy" not in calls.names()   # a keeps it
                del a
            else:
                del a
                gc.collect()
                assert pool._free_lists[(64, h, 0)] and "cuMemFreeAsync" not in calls.names()   # kept for reuse
                del s
            gc.collect()
            assert gone() is None
            assert _stream_calls(calls, h)[-2:] == ["cuMemFreeAsync", "cuStreamDestroy"]
            assert not any(k[1] == h for k in pool._free_lists) and pool._free_bytes[0] == 0


def test_an_array_written_on_a_created_stream_keeps_it_alive():
    """An array a kvattn kernel wrote remembers its writer's handle for exports (CAI's stream field, DLPack's
    wait), so the Stream lives as long as the array: no export waits on a destroyed handle."""
    import weakref
    from _fake_driver import fake_driver
    from kvattn import memory
    with fake_driver() as calls:
        s = st.Stream()
        h, gone = s.ptr, weakref.ref(s)
        a = memory.DeviceArray(0x7000_0000, (4, 8), "float16")   # e.g. a caller's `out`
        a.written_on(s)
        del s
        gc.collect()
        assert gone() is not None and a.__cuda_array_interface__["stream"] == h
        assert "cuStreamDestroy" not in calls.names()
        del a
        gc.collect()
        assert gone() is None and _stream_calls(calls, h)[-1] == "cuStreamDestroy"
