"""The BoundaryPool on CUDA: parity with dropout, the pool back at its start, and stream-ordered reuse of a slot
used on a side stream. Shared helpers: tests/helpers/pool.py."""
import pytest
import torch

import ckpt_ext
from reference import assert_grads_close, chain, leaf_inputs, loss_of, make_stack, run_step

from helpers.devices import requires_cuda
from helpers.pool import _forward_chain, pool_store, slot_bytes, stats


@pytest.mark.cuda
@requires_cuda
def test_cuda_parity_with_dropout():
    stack = make_stack(3, dim=64, hidden=128, p=0.2, seed=5).cuda()
    params = dict(stack.named_parameters())
    x, = leaf_inputs((32, 64), seed=5, device="cuda")
    ref = run_step(chain(stack), [x], params=params, seed=3)
    ours = run_step(chain(stack, ckpt_ext.checkpoint), [x], params=params, seed=3)
    assert_grads_close(ref, ours, exact=True)


@pytest.mark.cuda
@requires_cuda
def test_cuda_pool_returns_to_start():
    stack = make_stack(4, dim=64, hidden=128, p=0.1, seed=6).cuda()
    x, = leaf_inputs((32, 64), seed=6, device="cuda")
    start = stats("cuda")
    outs = _forward_chain(stack, x)
    during = stats("cuda")
    assert all(ckpt_ext.is_pooled(t) for t in outs)
    assert during["in_use_bytes"] - start["in_use_bytes"] == sum(slot_bytes(t) for t in outs)
    loss_of(outs[-1]).backward()
    del outs
    torch.cuda.synchronize()
    end = stats("cuda")
    assert (end["in_use_bytes"], end["live_slots"]) == (start["in_use_bytes"], start["live_slots"])
    # The same after a graph dropped without backward.
    out = chain(stack, ckpt_ext.checkpoint)(x)
    del out
    end = stats("cuda")
    assert (end["in_use_bytes"], end["live_slots"]) == (start["in_use_bytes"], start["live_slots"])


@pytest.mark.cuda
@requires_cuda
def test_cuda_slot_used_on_side_stream_not_reused_early():
    n = 1 << 22
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    pooled = pool_store(torch.full((n,), 1.0, device="cuda"))
    address = pooled.data_ptr()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # a long kernel: the read below runs well after the free
        seen = pooled * 1.0
    ckpt_ext.record_stream(pooled, side)
    fences = ckpt_ext.pool_stats("cuda")["stream_fences"]
    del pooled
    # A new slot of the same size on the main stream: the LIFO pool hands out the same memory, and
    # its copy must wait for the side stream's read.
    fresh = pool_store(torch.full((n,), 2.0, device="cuda"))
    assert fresh.data_ptr() == address
    torch.cuda.synchronize()
    assert ckpt_ext.pool_stats("cuda")["stream_fences"] > fences
    assert torch.equal(seen, torch.full((n,), 1.0, device="cuda"))
    assert torch.equal(fresh, torch.full((n,), 2.0, device="cuda"))
