"""What checkpointing puts in the BoundaryPool and what training does to it: checkpoint outputs are not pooled,
fused segments' boundaries are, reserved bytes fall during backward, a training loop reaches a steady state.
Shared helpers: tests/helpers/pool.py."""
import functools

import pytest
import torch

import ckpt_ext
from reference import assert_grads_close, chain, leaf_inputs, loss_of, make_stack, run_step

from helpers.pool import _empty_pool_at_start, _forward_chain, chunk_bytes, stats  # noqa: F401  (a fixture)

CKPT = functools.partial(ckpt_ext.checkpoint, use_reentrant=False)


# --------------------------------------------------------------------------------------------------
# What checkpointing keeps in the pool
# --------------------------------------------------------------------------------------------------
def test_checkpoint_outputs_are_not_pooled():
    # ckpt_ext.checkpoint follows torch's non-reentrant design (issue 13): its outputs are the function's
    # own tensors in the real graph, so the pool is untouched; the fused SegmentFunction still pools.
    stack = make_stack(4, p=0.1, seed=1)
    x, = leaf_inputs((9, 19), seed=1)
    start = stats()
    outs = _forward_chain(stack, x)
    assert not any(ckpt_ext.is_pooled(t) for t in outs)
    assert stats()["in_use_bytes"] == start["in_use_bytes"]
    loss_of(outs[-1]).backward()
    del outs
    assert stats()["live_slots"] == start["live_slots"]


def test_steady_state_training_does_not_grow_the_pool():
    stack = make_stack(3, p=0.1, seed=3)
    params = dict(stack.named_parameters())
    x, = leaf_inputs((8, 19), seed=3)
    start = stats()
    run_step(chain(stack, CKPT), [x], params=params, seed=0)
    after_first = stats()
    seen = set()
    for step in range(1, 51):
        run_step(chain(stack, CKPT), [x], params=params, seed=step)
        s = ckpt_ext.pool_stats("cpu")
        seen.add((s["reserved_bytes"], s["grows"], s["chunks"]))
    assert seen == {(after_first["reserved_bytes"], after_first["grows"], after_first["chunks"])}
    assert stats()["in_use_bytes"] == start["in_use_bytes"]


# What the pool holds: the outputs of fused segments (ckpt_ext.checkpoint keeps no pool bytes since
# issue 13). A stack of tiny fused BERT layers, each run as its own segment, gives one boundary each.
BOUNDARY = (4, 16, 16)  # float32: 4096 bytes, a multiple of the alignment
BOUNDARY_BYTES = 4 * 16 * 16 * 4


@pytest.fixture(autouse=True)
def _outputs_as_boundaries():
    """BERT segments keep their last layer's pre-norm sum outside the pool and the next segment does not keep its
    input (tests/test_bert_boundary.py); these tests exercise the pool with one pooled boundary per segment, as
    every segment held before that: the boundary is off here."""
    before = ckpt_ext._C.pre_norm_boundaries(False)
    yield
    ckpt_ext._C.pre_norm_boundaries(before)


def _fused_layers(n, seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=n, num_attention_heads=2, intermediate_size=24,
                                  vocab_size=11, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = transformers.BertModel(cfg, add_pooling_layer=False).train()
    ckpt_ext.fuse(model)
    return list(model.encoder.layer)


def _segment(layer, h):
    from ckpt_ext.fused import run_segment
    return run_segment([layer], (h,), {})


def _sampled_backward(layers, x):
    """Forward through fused segments keeping only the last output; returns the pool's stats after
    forward and as sampled by a hook on each boundary's gradient during backward."""
    samples = []
    h = x
    for layer in layers:
        h = _segment(layer, h)
        assert ckpt_ext.is_pooled(h)
        h.register_hook(lambda g: samples.append(ckpt_ext.pool_stats("cpu")))
    after_forward = ckpt_ext.pool_stats("cpu")
    loss = loss_of(h)
    del h  # the graph alone holds the boundaries now
    loss.backward()
    return after_forward, samples


def test_reserved_bytes_fall_during_backward(chunk_bytes):
    _empty_pool_at_start()
    chunk = 4 * BOUNDARY_BYTES  # four boundaries a chunk: twelve layers fill three
    chunk_bytes(chunk)
    layers = _fused_layers(12, seed=7)
    x, = leaf_inputs(BOUNDARY, seed=7)
    after_forward, samples = _sampled_backward(layers, x)
    assert (after_forward["reserved_bytes"], after_forward["live_slots"]) == (3 * chunk, 12)
    reserved = [s["reserved_bytes"] for s in samples]
    assert len(reserved) == 12 and reserved == sorted(reserved, reverse=True)
    assert min(reserved) < after_forward["reserved_bytes"]  # given back while backward still runs
    # What is reserved beyond the live slots is at most the spare and one partly freed chunk.
    assert all(s["reserved_bytes"] - s["in_use_bytes"] <= 2 * chunk for s in samples)
    end = stats()
    assert (end["reserved_bytes"], end["chunks"], end["live_slots"]) == (chunk, 1, 0)  # the spare


def test_training_loop_reaches_a_steady_state(chunk_bytes):
    # Chunks go back and come again every step; what the pool holds between steps and at its peak
    # within a step stays the same for 50 steps after the warm-up.
    _empty_pool_at_start()
    chunk_bytes(4 * BOUNDARY_BYTES)
    layers = _fused_layers(12, seed=8)
    params = {f"{i}.{n}": p for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    x, = leaf_inputs(BOUNDARY, seed=8)
    for step in range(3):
        run_step(chain(layers, _segment), [x], params=params, seed=step)
    before = ckpt_ext.pool_stats("cpu")
    seen = set()
    for step in range(50):
        ckpt_ext.reset_peak_stats("cpu")
        run_step(chain(layers, _segment), [x], params=params, seed=step)
        s = ckpt_ext.pool_stats("cpu")
        seen.add((s["reserved_bytes"], s["chunks"], s["peak_reserved_bytes"], s["in_use_bytes"]))
    assert seen == {(4 * BOUNDARY_BYTES, 1, 3 * 4 * BOUNDARY_BYTES, 0)}
    assert ckpt_ext.pool_stats("cpu")["releases"] - before["releases"] == 50 * 2  # not vacuous


def test_checkpointed_training_matches_after_many_steps():
    # Slots reused step after step still hold the right boundaries.
    stack = make_stack(3, p=0.2, seed=4)
    params = dict(stack.named_parameters())
    x, = leaf_inputs((8, 19), seed=4)
    for step in range(5):
        ref = run_step(chain(stack), [x], params=params, seed=step)
        ours = run_step(chain(stack, CKPT), [x], params=params, seed=step)
        assert_grads_close(ref, ours, exact=True)
