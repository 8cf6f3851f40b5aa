"""What the pool tests (test_pool_*.py) share: slot sizes, the pool's counters, a fixture setting the CPU pool's
chunk size for one test. The pool of a device is shared by the whole process, so the tests compare counters with
their values at the start of the test, not with zero."""
import gc

import pytest
import torch

import ckpt_ext

ALIGN = 256
CPU = torch.device("cpu")
pool_store = ckpt_ext._C.pool_store


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def slot_bytes(t: torch.Tensor) -> int:
    """What a pooled copy of t occupies: its byte span, 256-byte aligned (nothing when empty)."""
    return aligned(t.numel() * t.element_size()) if t.numel() else 0


def stats(device="cpu"):
    gc.collect()  # pooled tensors held only by reference cycles (tracebacks) die here
    return ckpt_ext.pool_stats(device)


@pytest.fixture
def chunk_bytes():
    """Sets the CPU pool's chunk size for the test, restores it and drops empty chunks afterwards."""
    old = ckpt_ext.pool_chunk_bytes(CPU)
    yield lambda n: ckpt_ext.set_pool_chunk_bytes(n, "cpu")
    ckpt_ext.set_pool_chunk_bytes(old, "cpu")
    gc.collect()
    ckpt_ext.empty_pool("cpu")


def _forward_chain(stack, x):
    outs, h = [], x
    for block in stack:
        h = ckpt_ext.checkpoint(block, h, use_reentrant=False)
        outs.append(h)
    return outs


def _empty_pool_at_start():
    s = stats()
    assert s["live_slots"] == 0, "an earlier test left pooled tensors alive"
    ckpt_ext.empty_pool("cpu")
    s = ckpt_ext.pool_stats("cpu")
    assert (s["reserved_bytes"], s["chunks"]) == (0, 0)
    return s


def allocator_events(fn):
    """(ptr, bytes: + allocated / - freed, the op that allocated it) of the CPU allocator while fn() runs."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            op = e.parent
            while op is not None and op.name.startswith(("aten::empty", "aten::zeros", "aten::resize")):
                op = op.parent
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, op.name if op else ""))
    return [ev[1:] for ev in sorted(events, key=lambda ev: ev[0])]


def allocator_peak(fn) -> int:
    """The peak of the CPU allocator's live bytes while fn() runs, above what was live before it."""
    live = peak = 0
    for _, size, _ in allocator_events(fn):
        live += size
        peak = max(peak, live)
    return peak
