"""The BoundaryPool on CUDA: checkpoint outputs are not pooled (parity with dropout), fused segments' boundaries are
and the pool goes back to its start, and stream-ordered reuse of a slot used on a side stream. Shared helpers: tests/helpers/pool.py."""
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
def test_cuda_checkpoint_outputs_are_not_pooled():
    # ckpt_ext.checkpoint follows torch's non-reentrant design (issue 13): its outputs are the function's own
    # tensors in the real graph, so the CUDA pool is untouched, as on CPU (test_pool_training.py).
    stack = make_stack(4, dim=64, hidden=128, p=0.1, seed=6).cuda()
    x, = leaf_inputs((32, 64), seed=6, device="cuda")
    start = stats("cuda")
    outs = _forward_chain(stack, x)
    assert not any(ckpt_ext.is_pooled(t) for t in outs)
    assert stats("cuda")["in_use_bytes"] == start["in_use_bytes"]
    loss_of(outs[-1]).backward()
    del outs
    assert stats("cuda")["live_slots"] == start["live_slots"]


BOUNDARY = (4, 16, 16)  # float32: 4096 bytes, a whole number of slots' alignment on either device


def _fused_cuda_layers(n, seed):
    """n tiny fused BERT layers on CUDA, dropout 0.1 (hidden and attention)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=n, num_attention_heads=2, intermediate_size=24,
                                  vocab_size=11, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = transformers.BertModel(cfg, add_pooling_layer=False).cuda().train()
    ckpt_ext.fuse(model)
    return list(model.encoder.layer)


def _segments(layers, x):
    from ckpt_ext.fused import run_segment
    outs, h = [], x
    for layer in layers:
        h = run_segment([layer], (h,), {})
        outs.append(h)
    return outs


@pytest.mark.cuda
@requires_cuda
def test_cuda_pool_returns_to_start():
    # What the pool holds since issue 13: the boundaries of fused segments (one per segment here), returned by
    # the backward that consumes them, or when a graph is dropped without backward.
    layers = _fused_cuda_layers(4, seed=6)
    x, = leaf_inputs(BOUNDARY, seed=6, device="cuda")
    start = stats("cuda")
    outs = _segments(layers, x)
    during = stats("cuda")
    assert all(ckpt_ext.is_pooled(t) and t.is_cuda for t in outs)
    assert during["live_slots"] - start["live_slots"] == len(outs)
    assert during["in_use_bytes"] - start["in_use_bytes"] == sum(slot_bytes(t) for t in outs)
    loss_of(outs[-1]).backward()
    assert x.grad is not None and all(p.grad is not None for p in layers[0].parameters() if p.requires_grad)
    del outs
    torch.cuda.synchronize()
    end = stats("cuda")
    assert (end["in_use_bytes"], end["live_slots"]) == (start["in_use_bytes"], start["live_slots"])
    # The same after a graph dropped without backward.
    out = _segments(layers, x)[-1]
    assert stats("cuda")["live_slots"] - start["live_slots"] == len(layers)  # the graph holds every boundary
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
