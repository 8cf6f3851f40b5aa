"""Faults: exceptions in the user's function during the replay and in forward, KeyboardInterrupt-like
BaseExceptions, graphs dropped half-way, nested checkpoints and the determinism check -- through
ckpt_ext.checkpoint, enable_checkpointing stacks and fused Hugging Face layers (the C++ SegmentFunction).

After each fault: the exception that comes out is the one raised (same type, same text; a replay adds a
note naming the function), the pool is back at its starting in_use_bytes once the graph is gone,
is_recomputing() is False, grad mode, autocast and the CPU RNG are as before, BatchNorm running statistics
are not updated twice, and the next step gives gradients bit-identical to the same model without
checkpointing.

How faults are planted: a `Trap` module inside the checkpointed blocks raises in forward or only in the
replay (ckpt_ext.is_recomputing()); the fused layers run no Python, so an `OpTrap` dispatch mode raises at
the n-th fused GELU, which the fused layers call in forward and in the replay (backward calls
bias_gelu_backward instead).

The pool is read without gc.collect(): what a fault leaves is freed by reference counting alone, no cycle
is involved. `settle()` runs a trivial backward first: after an exception in backward, PyTorch's autograd
engine leaves the tasks it had queued in the thread's ready queue, holding the part of the graph they
reference, until the next backward on the thread discards them (plain PyTorch does the same with ordinary
activations).

Their models, traps and checks: tests/helpers/faults.py.
"""
import copy

import pytest
import torch
from torch import nn

import ckpt_ext

from helpers.faults import (BATCH, EXCEPTIONS, D, Net, Path, _one_thread, assert_same_grads,  # noqa: F401
                            grads, in_use, path, raise_caught, thread_state)  # (fixtures: _one_thread, path)


# --------------------------------------------------------------------------------------------------
# An exception in the replay (backward)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc_type", EXCEPTIONS, ids=lambda t: t.__name__)
def test_exception_in_replay(path, exc_type):
    start = in_use()
    state = thread_state()
    loss = path.loss()
    # The fused SegmentFunction holds its boundaries in the pool; ckpt_ext.checkpoint keeps the graph's own.
    assert (ckpt_ext.pool_stats("cpu")["in_use_bytes"] > start) == path.fused
    bn = None if path.fused else {k: v.clone() for k, v in path.batchnorm().state_dict().items()}
    rng = torch.get_rng_state()

    def backward():
        with path.planted("replay", exc_type, "no luck in the replay"):
            loss.backward()

    text, notes = raise_caught(backward, exc_type)
    assert text == "no luck in the replay"
    if not path.fused:  # the Python runner says where the exception came from
        assert any("replayed the checkpointed function" in n and "during backward" in n for n in notes), notes
    assert thread_state() == state
    assert torch.equal(torch.get_rng_state(), rng)  # the replay's RNG fork was undone
    if bn is not None:  # the replay ran the BatchNorm, then failed: statistics as after the forward
        for k, v in path.batchnorm().state_dict().items():
            assert torch.equal(v, bn[k]), k
    del loss
    assert in_use() == start
    path.assert_next_step_right()
    assert in_use() == start


def test_replay_error_message_names_the_function():
    path = Path("checkpoint")
    loss = path.loss()
    with path.planted("replay", ValueError, "bad"):
        text, notes = raise_caught(loss.backward, ValueError)
    assert text == "bad"
    assert len(notes) == 1 and "`Sequential`" in notes[0] and "is_recomputing() True" in notes[0]


def test_replay_failure_under_autocast_restores_autocast():
    path = Path("checkpoint")
    start = in_use()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = path.loss()
    state = thread_state()
    assert not state["autocast"]
    with path.planted("replay", KeyboardInterrupt):
        raise_caught(loss.backward, KeyboardInterrupt)
    assert thread_state() == state  # autocast off again, its nesting counter as before
    del loss
    assert in_use() == start
    path.assert_next_step_right()


# --------------------------------------------------------------------------------------------------
# An exception in forward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc_type", EXCEPTIONS, ids=lambda t: t.__name__)
def test_exception_in_forward(path, exc_type):
    start = in_use()
    state = thread_state()

    def forward():
        with path.planted("forward", exc_type, "no luck in forward"):
            path.loss()

    text, notes = raise_caught(forward, exc_type)
    assert text == "no luck in forward" and not notes
    assert thread_state() == state
    assert in_use() == start  # the groups that ran before hold nothing once the frames are gone
    if not path.fused:
        # The interrupted forward drew the random numbers the model without checkpointing draws up to the
        # same point. (Not so for fused groups: a SegmentFunction draws the seeds of all its layers first.)
        rng = torch.get_rng_state()
        path.trap_of(path.ref).arm("forward", exc_type)
        raise_caught(lambda: path.loss(path.ref), exc_type)
        assert torch.equal(torch.get_rng_state(), rng)
    path.assert_next_step_right()


def test_interrupt_during_the_planners_first_step():
    """enable_checkpointing(budget=...): the first step measures each layer on a throw-away run with the RNG
    forked. Interrupted there, the RNG fork is undone, nothing is held, and the next steps measure the rest,
    plan and stay bit-identical to the model without checkpointing."""
    path = Path("stack")
    ckpt_ext.disable_checkpointing(path.ck)
    ckpt_ext.enable_checkpointing(path.ck, layers=path.ck.blocks, budget="1GiB")
    start = in_use()
    state = thread_state()
    path.trap().arm("forward", KeyboardInterrupt, "probe")
    raise_caught(path.loss, KeyboardInterrupt)
    assert thread_state() == state and in_use() == start
    rng = torch.get_rng_state()
    path.trap_of(path.ref).arm("forward", KeyboardInterrupt)
    raise_caught(lambda: path.loss(path.ref), KeyboardInterrupt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert "plan pending" in ckpt_ext.explain(path.ck)
    for _ in range(3):  # measure the rest, plan, run the plan
        path.assert_next_step_right()
    assert "plan in use" in ckpt_ext.explain(path.ck)
    assert in_use() == start


@pytest.mark.parametrize("kind", ["stack", "fused-bert"])
def test_interrupt_between_two_layers_of_a_group(kind):
    """enable_checkpointing(every=2): the group runs both layers when the stack calls the first, and hands
    its output to the second. An interrupt in between (a hook, a Ctrl-C in the stack's loop) must leave
    nothing behind: this kept the group's output, its graph and every pooled boundary before it alive until
    the next step (fixed; regression test)."""
    if kind.startswith("fused"):
        pytest.importorskip("transformers")
    path = Path(kind)
    start = in_use()
    layers = path.ck.blocks if kind == "stack" else path.ck.encoder.layer
    second = layers[3]  # second layer of the second group

    def interrupt(module, args, kwargs=None):
        raise KeyboardInterrupt("between layers")

    handle = second.register_forward_pre_hook(interrupt)
    try:
        raise_caught(path.loss, KeyboardInterrupt)
    finally:
        handle.remove()
    assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == start  # no gc needed: nothing holds it
    path.assert_next_step_right()
    assert in_use() == start


# --------------------------------------------------------------------------------------------------
# Graphs dropped half-way
# --------------------------------------------------------------------------------------------------
def test_graph_dropped_without_backward(path):
    start = in_use()
    loss = path.loss()
    assert (ckpt_ext.pool_stats("cpu")["in_use_bytes"] > start) == path.fused
    del loss
    assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == start  # freed at once, no cycle to collect
    path.assert_next_step_right()


def _first_boundary(path, model):
    """The loss and the output of the model's first checkpointed group (a pool slot when checkpointed)."""
    if not path.fused:
        model.seen = []
        try:
            loss = path.loss(model)
            return loss, model.seen[1]  # after blocks 0 and 1: the first group of the stack
        finally:
            model.seen = None
    seen = []
    layer = model.encoder.layer[1] if path.kind == "fused-bert" else model.h[0]  # ends the first group
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        return path.loss(model), seen[0]
    finally:
        handle.remove()


def test_backward_through_part_of_the_graph_then_drop(path):
    start = in_use()
    loss, boundary = _first_boundary(path, path.ck)
    assert ckpt_ext.is_pooled(boundary) == path.fused  # a SegmentFunction's boundary is pooled
    (g,) = torch.autograd.grad(loss, boundary)  # replays the later groups only, retain_graph=False
    ref_loss, ref_boundary = _first_boundary(path, path.ref)
    (g_ref,) = torch.autograd.grad(ref_loss, ref_boundary)
    assert torch.equal(g, g_ref)
    assert all(p.grad is None for p in path.ck.parameters())
    del loss, boundary, ref_loss, ref_boundary
    assert in_use() == start
    path.assert_next_step_right()


def test_exception_between_forward_and_backward(path):
    start = in_use()

    def step_that_fails():
        loss = path.loss()
        if loss.item() > -1:
            raise ValueError("the loss looked wrong")
        loss.backward()

    try:
        step_that_fails()
    except ValueError as e:
        kept = e
    # The exception's traceback holds the frame, and so the loss and its graph, as long as it is kept
    # (sys.last_exc in a REPL does that): the pool slots are held, not lost.
    assert (ckpt_ext.pool_stats("cpu")["in_use_bytes"] > start) == path.fused
    del kept
    assert in_use() == start
    path.assert_next_step_right()


# --------------------------------------------------------------------------------------------------
# Nested checkpoints, the determinism check
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt], ids=lambda t: t.__name__)
@pytest.mark.parametrize("where", ["forward", "outer-replay", "inner-replay"])
def test_exception_in_a_nested_checkpoint(where, exc_type):
    """The inner block is checkpointed inside the outer checkpoint: its forward runs in the outer forward
    and again in the outer replay; its own replay runs inside the backward of the outer replay (two levels
    of recomputation, two autograd engine calls deep)."""
    torch.manual_seed(0)
    ref = Net(n=3).train()
    ck = copy.deepcopy(ref)

    def nested(net):
        def outer(x):
            x = net.blocks[0](x)
            x = ckpt_ext.checkpoint(net.blocks[1], x, use_reentrant=False)
            return net.blocks[2](x)

        def run(x, checkpointed):
            return net.head(ckpt_ext.checkpoint(outer, x, use_reentrant=False) if checkpointed else outer(x))
        return run

    run_ck, run_ref = nested(ck), nested(ref)
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(3))
    start = in_use()
    state = thread_state()
    trap = ck.blocks[1][2]
    torch.manual_seed(5)
    if where == "forward":
        trap.arm("forward", exc_type, "inner")
        text, notes = raise_caught(lambda: run_ck(x, True), exc_type)
    else:
        loss = (run_ck(x, True) ** 2).mean()
        # In the outer replay the inner block first runs as the inner checkpoint's forward, then is replayed
        # by the inner checkpoint's backward: is_recomputing() is True both times.
        trap.arm("replay", exc_type, "inner", skip=0 if where == "outer-replay" else 1)
        text, notes = raise_caught(loss.backward, exc_type)
        del loss
        named = "`Sequential`" if where == "inner-replay" else ".outer`"
        assert len(notes) == 1 and named in notes[0], notes
    assert text == "inner"
    assert trap.armed is None  # it did fire where intended
    assert thread_state() == state
    assert in_use() == start
    for model, run, checkpointed in ((ck, run_ck, True), (ref, run_ref, False)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        (run(x, checkpointed) ** 2).mean().backward()
    assert_same_grads(grads(ck), grads(ref))
    assert in_use() == start


def test_determinism_check_failure_leaves_nothing_behind():
    flips = {"n": 0}
    lin = nn.Linear(D, D)

    def changes_shape_in_replay(x):
        flips["n"] += 1
        return lin(x if flips["n"] == 1 else x[:-1])  # the replay saves a smaller input

    start = in_use()
    state = thread_state()
    x = torch.randn(BATCH, D, requires_grad=True)
    y = ckpt_ext.checkpoint(changes_shape_in_replay, x, use_reentrant=False)
    text, _ = raise_caught(lambda: y.sum().backward(), torch.utils.checkpoint.CheckpointError)
    assert "differs from its forward" in text
    assert thread_state() == state
    del y
    assert in_use() == start
    flips["n"] = 0
    y = ckpt_ext.checkpoint(changes_shape_in_replay, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="differs"):
        y.sum().backward()
    del y
    assert in_use() == start
