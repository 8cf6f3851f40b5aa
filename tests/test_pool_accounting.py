"""The BoundaryPool's accounting, growth and release: out-of-order frees, views, peaks, chunks given back, the
chunk size, bad arguments, and random store/write/free sequences (hypothesis). Shared helpers:
tests/helpers/pool.py."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt_ext

from helpers.pool import (ALIGN, CPU, _empty_pool_at_start, chunk_bytes, pool_store,  # noqa: F401  (a fixture)
                          slot_bytes, stats)


# --------------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------------
def _filled(n: int, value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)


def test_out_of_order_frees_keep_accounting():
    start = stats()
    sizes = {"a": 100, "b": 1000, "c": 37, "d": 513}
    held = {k: pool_store(_filled(n, i + 1.0)) for i, (k, n) in enumerate(sizes.items())}
    expect = {k: _filled(n, i + 1.0) for i, (k, n) in enumerate(sizes.items())}

    def check():
        s = ckpt_ext.pool_stats("cpu")
        assert s["live_slots"] - start["live_slots"] == len(held)
        assert s["in_use_bytes"] - start["in_use_bytes"] == sum(slot_bytes(t) for t in held.values())
        for k, t in held.items():
            assert ckpt_ext.is_pooled(t) and torch.equal(t, expect[k]), k

    check()
    # Hold the middle ones, free the first and the last: a hole below and a lowered top.
    del held["a"], held["d"]
    check()
    for k, n in (("e", 50), ("f", 90), ("g", 4000)):  # fit in the hole, fill it, go on top
        held[k] = pool_store(_filled(n, -float(n)))
        expect[k] = _filled(n, -float(n))
        check()
    del held["b"]
    check()
    held["h"] = pool_store(_filled(700, 8.0))
    expect["h"] = _filled(700, 8.0)
    check()
    for k in ("c", "g", "e", "h", "f"):
        del held[k]
        check()
    end = stats()
    assert end["in_use_bytes"] == start["in_use_bytes"]
    assert end["live_slots"] == start["live_slots"]


def test_views_share_the_slot():
    start = stats()
    t = pool_store(torch.arange(64, dtype=torch.float32).reshape(8, 8))
    view = t.t()[2:5]
    assert ckpt_ext.is_pooled(view)
    del t
    assert stats()["live_slots"] == start["live_slots"] + 1  # the view keeps the slot alive
    assert torch.equal(view, torch.arange(64, dtype=torch.float32).reshape(8, 8).t()[2:5])
    del view
    assert stats()["live_slots"] == start["live_slots"]


def test_peak_in_use_and_reset():
    start = stats()
    ckpt_ext.reset_peak_stats("cpu")
    assert ckpt_ext.pool_stats("cpu")["peak_in_use_bytes"] == start["in_use_bytes"]
    big = pool_store(torch.zeros(10_000))
    small = pool_store(torch.zeros(10))
    top = start["in_use_bytes"] + slot_bytes(big) + slot_bytes(small)
    assert ckpt_ext.pool_stats("cpu")["peak_in_use_bytes"] == top
    del big
    s = ckpt_ext.pool_stats("cpu")
    assert s["peak_in_use_bytes"] == top  # a high-water mark
    assert s["in_use_bytes"] == start["in_use_bytes"] + slot_bytes(small)
    ckpt_ext.reset_peak_stats("cpu")
    assert ckpt_ext.pool_stats("cpu")["peak_in_use_bytes"] == start["in_use_bytes"] + slot_bytes(small)
    del small


def test_empty_chunk_goes_back_at_once_but_one_spare(chunk_bytes):
    _empty_pool_at_start()
    ckpt_ext.reset_peak_stats("cpu")
    chunk = 1 << 20
    chunk_bytes(chunk)
    n = chunk // 4 // 4  # four slots fill a shared chunk exactly
    held = [pool_store(_filled(n, float(i))) for i in range(12)]
    s = ckpt_ext.pool_stats("cpu")
    assert (s["reserved_bytes"], s["chunks"], s["live_slots"], s["in_use_bytes"]) == (3 * chunk, 3, 12, 3 * chunk)
    releases = s["releases"]

    def reserved_chunks_releases():
        s = ckpt_ext.pool_stats("cpu")
        return s["reserved_bytes"], s["chunks"], s["releases"] - releases

    del held[8:]  # the last chunk is empty: kept as the spare
    assert reserved_chunks_releases() == (3 * chunk, 3, 0)
    del held[4:]  # a second empty chunk: one of the two goes back
    assert reserved_chunks_releases() == (2 * chunk, 2, 1)
    first = held.pop(0)
    del held[:]  # the first chunk keeps one live slot
    assert reserved_chunks_releases() == (2 * chunk, 2, 1)
    assert torch.equal(first, _filled(n, 0.0))
    assert ckpt_ext.empty_pool("cpu") == chunk  # the spare
    assert reserved_chunks_releases() == (chunk, 1, 2)
    assert ckpt_ext.empty_pool("cpu") == 0  # the live slot's chunk stays
    del first  # now the first chunk is the spare
    assert reserved_chunks_releases() == (chunk, 1, 2)
    assert ckpt_ext.empty_pool("cpu") == chunk
    s = ckpt_ext.pool_stats("cpu")
    assert (s["reserved_bytes"], s["chunks"], s["in_use_bytes"], s["peak_reserved_bytes"]) == (0, 0, 0, 3 * chunk)
    ckpt_ext.reset_peak_stats("cpu")
    assert ckpt_ext.pool_stats("cpu")["peak_reserved_bytes"] == 0
    # The pool grows again after being emptied.
    again = pool_store(_filled(10, 3.0))
    assert ckpt_ext.pool_stats("cpu")["chunks"] == 1 and torch.equal(again, _filled(10, 3.0))


def test_spare_is_the_larger_empty_chunk(chunk_bytes):
    _empty_pool_at_start()
    chunk_bytes(1 << 20)
    small = pool_store(_filled(1000, 1.0))  # a shared chunk of 1 MiB
    chunk_bytes(4 << 20)
    first = pool_store(_filled(262_000, 2.0))  # does not fit beside `small`: a second chunk, of four such slots
    second_chunk = ckpt_ext.pool_stats("cpu")["reserved_bytes"] - (1 << 20)
    assert second_chunk > 1 << 20
    del first  # the larger chunk empties first: the spare
    del small  # the smaller one goes back
    s = ckpt_ext.pool_stats("cpu")
    assert (s["reserved_bytes"], s["chunks"]) == (second_chunk, 1)


def test_small_chunk_size_is_honoured(chunk_bytes):
    _empty_pool_at_start()
    chunk_bytes(64 * 1024)
    held = [pool_store(_filled(1000, 1.0)) for _ in range(3)]
    s = ckpt_ext.pool_stats("cpu")
    assert (s["reserved_bytes"], s["chunks"]) == (64 * 1024, 1)
    del held


def test_shared_chunks_hold_a_whole_number_of_slots(chunk_bytes):
    # A slot of 0.9 MiB in 4 MiB chunks: four to a chunk and no unusable tail, so eight slots reserve
    # exactly their bytes (a 4 MiB chunk would leave 0.4 MiB of each idle).
    _empty_pool_at_start()
    chunk_bytes(4 << 20)
    n = 900 * 1024 // 4
    held = [pool_store(_filled(n, float(i))) for i in range(8)]
    s = ckpt_ext.pool_stats("cpu")
    assert (s["chunks"], s["reserved_bytes"], s["in_use_bytes"]) == (2, 8 * 900 * 1024, 8 * 900 * 1024)
    assert all(torch.equal(t, _filled(n, float(i))) for i, t in enumerate(held))


@pytest.mark.parametrize("numel", [(1 << 20) // 4 // 4 + 64, 3 << 20])  # just over a quarter chunk; 12 MiB
def test_large_slot_gets_its_own_chunk_and_gives_it_back_at_once(chunk_bytes, numel):
    _empty_pool_at_start()
    chunk = 1 << 20
    chunk_bytes(chunk)
    big = pool_store(torch.ones(numel))
    small = pool_store(_filled(10, 1.0))  # big's chunk is full: a shared chunk
    s = ckpt_ext.pool_stats("cpu")
    assert (s["chunks"], s["reserved_bytes"]) == (2, chunk + slot_bytes(big))  # exactly the slot
    assert torch.equal(big, torch.ones(numel)) and torch.equal(small, _filled(10, 1.0))
    del big  # never kept as the spare
    s = ckpt_ext.pool_stats("cpu")
    assert (s["chunks"], s["reserved_bytes"]) == (1, chunk)
    del small


def test_empty_tensors_are_not_pooled():
    start = stats()
    t = pool_store(torch.zeros(0, 5))
    assert t.shape == (0, 5) and not ckpt_ext.is_pooled(t)
    assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == start["in_use_bytes"]


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------
MIN_CHUNK = ckpt_ext.pool_min_chunk_bytes()  # defined once, in the C++ pool


@pytest.mark.parametrize("nbytes,error", [(0, ValueError), (-1, ValueError), (MIN_CHUNK - 1, ValueError),
                                          (1 << 62, ValueError),
                                          (2.0, TypeError), (True, TypeError), ("4096", TypeError), (None, TypeError)])
def test_set_pool_chunk_bytes_invalid(nbytes, error):
    before = ckpt_ext.pool_chunk_bytes(CPU)
    with pytest.raises(error, match="nbytes"):
        ckpt_ext.set_pool_chunk_bytes(nbytes, "cpu")
    assert ckpt_ext.pool_chunk_bytes(CPU) == before


def test_set_pool_chunk_bytes_aligns(chunk_bytes):
    chunk_bytes(1000)
    assert ckpt_ext.pool_chunk_bytes(CPU) == 1024
    chunk_bytes(MIN_CHUNK)
    assert ckpt_ext.pool_chunk_bytes(CPU) == MIN_CHUNK == ALIGN


@pytest.mark.parametrize("device", ["not_a_device", "cpu:x", 3.5])
@pytest.mark.parametrize("call", ["pool_stats", "reset_peak_stats", "empty_pool"])
def test_bad_device_raises_clear_error(call, device):
    with pytest.raises(TypeError, match="expected a device") as info:
        getattr(ckpt_ext, call)(device)
    assert repr(device) in str(info.value)


def test_record_stream_needs_a_stream():
    t = pool_store(torch.ones(4))
    with pytest.raises(TypeError, match="Stream"):
        ckpt_ext.record_stream(t, "side")


def test_is_pooled_needs_a_tensor():
    with pytest.raises(TypeError, match="Tensor"):
        ckpt_ext.is_pooled([1.0])


# --------------------------------------------------------------------------------------------------
# Property: random stores, writes and frees never corrupt data or accounting
# --------------------------------------------------------------------------------------------------
_KINDS = ["f32", "f64", "i16", "bool", "transposed", "strided"]


def _source(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "transposed":  # dense, not contiguous: the pool keeps the strides
        return torch.randn(3, n, generator=gen).t()
    if kind == "strided":  # not dense: stored contiguously
        return torch.randn(n, 2, generator=gen)[:, 0]
    if kind == "bool":
        return torch.rand(n, generator=gen) > 0.5
    if kind == "i16":
        return torch.randint(-3000, 3000, (n,), generator=gen, dtype=torch.int16)
    return torch.randn(n, generator=gen, dtype=torch.float64 if kind == "f64" else torch.float32)


_OPS = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(_KINDS), st.integers(0, 3000) | st.integers(50_000, 200_000)),
    st.tuples(st.just("free"), st.integers(0, 63)),
    st.tuples(st.just("write"), st.integers(0, 63)),
)


def _store_checked(kind, n, gen):
    src = _source(kind, n, gen)
    pooled = pool_store(src)
    assert pooled.shape == src.shape and pooled.dtype == src.dtype
    assert ckpt_ext.is_pooled(pooled) == (src.numel() > 0)
    if kind == "strided":
        assert pooled.is_contiguous()
    else:  # dense: same strides, transposed or not
        assert pooled.stride() == src.stride()
    return pooled, src.clone()


def _overwrite(pooled, gen):
    """Writes new values into a slot in place; its neighbours must not change."""
    new = _source("f32", max(pooled.numel(), 1), gen)[: pooled.numel()].reshape(pooled.shape)
    pooled.copy_(new)
    return pooled, pooled.clone()


def _check_live(start, live):
    s = ckpt_ext.pool_stats("cpu")
    assert s["in_use_bytes"] - start["in_use_bytes"] == sum(slot_bytes(t) for t, _ in live)
    assert s["live_slots"] - start["live_slots"] == sum(1 for t, _ in live if t.numel())
    assert s["peak_in_use_bytes"] >= s["in_use_bytes"]
    assert s["reserved_bytes"] >= s["in_use_bytes"]
    for i, (t, expected) in enumerate(live):
        assert torch.equal(t, expected), f"slot {i} of {len(live)} changed"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, max_size=40), chunk_kib=st.sampled_from([4, 16, 64]))
def test_random_store_write_free_sequences(ops, chunk_kib):
    old_chunk = ckpt_ext.pool_chunk_bytes(CPU)
    ckpt_ext.set_pool_chunk_bytes(chunk_kib * 1024, "cpu")  # small chunks: several chunks, holes
    try:
        gen = torch.Generator().manual_seed(len(ops))
        start = ckpt_ext.pool_stats("cpu")
        live = []  # (pooled tensor, expected values)
        for op in ops:
            if op[0] == "store":
                live.append(_store_checked(op[1], op[2], gen))
            elif live:
                i = op[1] % len(live)
                if op[0] == "free":
                    del live[i]
                else:
                    live[i] = _overwrite(live[i][0], gen)
            _check_live(start, live)
        live.clear()
        s = ckpt_ext.pool_stats("cpu")
        assert (s["in_use_bytes"], s["live_slots"]) == (start["in_use_bytes"], start["live_slots"])
    finally:
        ckpt_ext.set_pool_chunk_bytes(old_chunk, "cpu")
        ckpt_ext.empty_pool("cpu")
