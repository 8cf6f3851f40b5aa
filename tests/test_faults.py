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
"""
import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext

D = 24
BATCH = 6


class Interrupt(BaseException):
    """A KeyboardInterrupt-like exception of the user's own (not an Exception)."""


EXCEPTIONS = [RuntimeError, KeyboardInterrupt, Interrupt]


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------
def settle():
    torch.zeros((), requires_grad=True).backward()  # discards tasks a failed backward left queued


def in_use():
    settle()
    return ckpt_ext.pool_stats("cpu")["in_use_bytes"]


def autocast_nesting():
    n = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return n - 1


def thread_state():
    return dict(recomputing=ckpt_ext.is_recomputing(), grad=torch.is_grad_enabled(),
                autocast=torch.is_autocast_enabled("cpu"), autocast_dtype=torch.get_autocast_dtype("cpu"),
                nesting=autocast_nesting())


def raise_caught(fn, exc_type):
    """Runs fn, which must raise exc_type (exactly that type: not wrapped, not converted); returns the
    exception's text and notes. The exception object is not kept: its traceback holds the graph."""
    try:
        fn()
    except BaseException as e:  # noqa: B902 -- KeyboardInterrupt and Interrupt are the point
        assert type(e) is exc_type, f"expected {exc_type.__name__}, got {type(e).__name__}: {e}"
        return str(e), list(getattr(e, "__notes__", []))
    raise AssertionError(f"{exc_type.__name__} was not raised")


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), n
        assert a[n] is None or torch.equal(a[n], b[n]), n


class Trap(nn.Module):
    """Identity, until armed: then raises once, in forward or only in a replay (after `skip` calls of that
    kind)."""

    def __init__(self):
        super().__init__()
        self.armed = None  # [phase: "forward" | "replay", exception type, message, calls to skip]

    def arm(self, phase, exc_type, message="trapped", skip=0):
        self.armed = [phase, exc_type, message, skip]

    def forward(self, x):
        if self.armed is not None:
            phase, exc_type, message, skip = self.armed
            if (phase == "replay") == ckpt_ext.is_recomputing():
                if skip:
                    self.armed[3] -= 1
                else:
                    self.armed = None
                    raise exc_type(message)
        return x


class OpTrap(TorchDispatchMode):
    """Raises at the n-th call of an operator while active (reaches C++ code that runs no Python)."""

    def __init__(self, op, n, exc_type, message="trapped"):
        super().__init__()
        self.op, self.n, self.exc_type, self.message = op, n, exc_type, message
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.count += 1
            if self.count == self.n:
                raise self.exc_type(self.message)
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------------------
# The three paths, each a checkpointed model and the same model without checkpointing
# --------------------------------------------------------------------------------------------------
def make_block():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.BatchNorm1d(2 * D), Trap(), nn.GELU(), nn.Dropout(0.2),
                         nn.Linear(2 * D, D))


class Net(nn.Module):
    def __init__(self, n=4, wrap=False):
        super().__init__()
        self.blocks = nn.ModuleList(make_block() for _ in range(n))
        self.head = nn.Linear(D, 3)
        self.wrap = wrap  # each block through ckpt_ext.checkpoint
        self.seen = None  # a list: collects what the loop passes on after each block

    def forward(self, x):
        for b in self.blocks:
            x = ckpt_ext.checkpoint(b, x) if self.wrap else b(x)
            if self.seen is not None:
                self.seen.append(x)
        return self.head(x)


class Path:
    """A checkpointed model `ck`, its reference `ref` (same weights, not checkpointed), inputs, a step,
    and how to plant a fault in forward or in the replay."""

    def __init__(self, kind):
        self.kind = kind
        torch.manual_seed(0)
        if kind in ("checkpoint", "stack"):
            self.ref = Net().train()
            self.ck = copy.deepcopy(self.ref)
            if kind == "checkpoint":
                self.ck.wrap = True
            else:
                ckpt_ext.enable_checkpointing(self.ck, every=2, layers=self.ck.blocks)
            gen = torch.Generator().manual_seed(1)
            self.inputs = {"x": torch.randn(BATCH, D, generator=gen)}
        else:
            from transformers import BertConfig, BertModel, GPT2Config, GPT2Model
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if kind == "fused-bert":
                    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                                 intermediate_size=48, vocab_size=50, hidden_dropout_prob=0.1,
                                                 attention_probs_dropout_prob=0.1), add_pooling_layer=False)
                    every = 2
                else:
                    model = GPT2Model(GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=50, bos_token_id=0,
                                                 eos_token_id=0))
                    every = 1
                self.ref = ckpt_ext.fuse(model).train()
                self.ck = ckpt_ext.enable_checkpointing(copy.deepcopy(self.ref), every=every)
            gen = torch.Generator().manual_seed(1)
            mask = torch.ones(3, 11, dtype=torch.long)
            mask[1, 7:] = 0
            self.inputs = {"input_ids": torch.randint(0, 50, (3, 11), generator=gen), "attention_mask": mask}

    @property
    def fused(self):
        return self.kind.startswith("fused")

    def trap(self):
        return self.trap_of(self.ck)

    @staticmethod
    def trap_of(model):
        return model.blocks[2][2]  # in the last group of the stack, after its BatchNorm

    def batchnorm(self):
        return self.ck.blocks[2][1]

    def loss(self, model=None, seed=7):
        model = model or self.ck
        torch.manual_seed(seed)
        if self.fused:
            out = model(**self.inputs, **({"use_cache": False} if self.kind == "fused-gpt2" else {})).last_hidden_state
        else:
            out = model(self.inputs["x"])
        return (out ** 2).mean()

    def planted(self, phase, exc_type, message="trapped"):
        """A context manager around the forward (phase "forward") or the backward (phase "replay") that
        makes the fault happen there."""
        if self.fused:
            # The first fused GELU of the forward; the second one of the backward, which is in a replay.
            return OpTrap(torch.ops.ckpt_ext.bias_gelu.default, 1 if phase == "forward" else 2, exc_type, message)
        self.trap().arm(phase, exc_type, message)
        return contextlib.nullcontext()

    def step(self, model, seed=11):
        model.zero_grad(set_to_none=True)
        loss = self.loss(model, seed)
        loss.backward()
        return loss.detach(), grads(model)

    def assert_next_step_right(self):
        """A whole step of the checkpointed model gives the reference's loss and gradients, bit for bit."""
        # BatchNorm statistics may differ after a fault in forward (the reference did not run it); training
        # uses batch statistics, so the step's results do not depend on them.
        loss_ck, g_ck = self.step(self.ck)
        loss_ref, g_ref = self.step(self.ref)
        assert torch.equal(loss_ck, loss_ref)
        assert_same_grads(g_ck, g_ref)
        assert not ckpt_ext.is_recomputing()


PATHS = ["checkpoint", "stack", "fused-bert", "fused-gpt2"]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second thread only waits (on a loaded machine, 100x slower steps).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=PATHS)
def path(request):
    if request.param.startswith("fused"):
        pytest.importorskip("transformers")
    return Path(request.param)


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
            x = ckpt_ext.checkpoint(net.blocks[1], x)
            return net.blocks[2](x)

        def run(x, checkpointed):
            return net.head(ckpt_ext.checkpoint(outer, x) if checkpointed else outer(x))
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
    y = ckpt_ext.checkpoint(changes_shape_in_replay, x)
    text, _ = raise_caught(lambda: y.sum().backward(), torch.utils.checkpoint.CheckpointError)
    assert "differs from its forward" in text
    assert thread_state() == state
    del y
    assert in_use() == start
    flips["n"] = 0
    y = ckpt_ext.checkpoint(changes_shape_in_replay, x)
    with pytest.raises(RuntimeError, match="differs"):
        y.sum().backward()
    del y
    assert in_use() == start
