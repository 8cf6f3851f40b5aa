"""ckpt_ext.checkpoint's behaviour beyond parity: the determinism check, calls that need no graph,
is_recomputing, BatchNorm statistics, exceptions, threads, checkpoint_sequential, autocast and the
options, each against no checkpointing or torch.utils.checkpoint (non-reentrant)."""
import contextlib
import copy
import functools
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckpt_ext
from helpers.checkpointing import BATCH, DIM, apply_module as _apply, ckpt, cpu_pool
from helpers.checkpointing import no_warnings  # noqa: F401 (a fixture)
from reference import assert_grads_close, chain, leaf_inputs, loss_of, make_block, make_stack, run_step


# --------------------------------------------------------------------------------------------------
# Determinism check
# --------------------------------------------------------------------------------------------------
class Toggle:
    """Counts calls; every second call changes what the function computes."""

    def __init__(self):
        self.calls = 0

    def flip(self) -> bool:
        self.calls += 1
        return self.calls % 2 == 0


_TOGGLE = Toggle()
_TOGGLE_BLOCK = make_block(p=0.0, seed=14)


def shape_toggling_fn(x):
    # What is checked is what the replay saves for backward (as torch does), not the outputs.
    return _TOGGLE_BLOCK(x[:-1] if _TOGGLE.flip() else x)


def count_toggling_fn(x):
    h = _TOGGLE_BLOCK(x)
    return (h,) if _TOGGLE.flip() else (h, h.exp())  # the replay saves one tensor fewer (exp's result)


def _replay_error(fn, **options):
    _TOGGLE.calls = 0
    x, = leaf_inputs((BATCH, DIM), seed=14)
    y = ckpt(fn, x, **options)
    y = y[0] if isinstance(y, tuple) else y
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    if "differs from its forward" in str(info.value):
        assert isinstance(info.value, torch_checkpoint.CheckpointError)
    return str(info.value)


def test_replay_shape_change_raises_naming_the_function():
    msg = _replay_error(shape_toggling_fn)
    assert "`shape_toggling_fn`" in msg and "differs from its forward" in msg
    assert "[6, 19]" in msg and "[5, 19]" in msg
    assert "debug: forward ran" not in msg


def test_replay_shape_change_with_debug_lists_operators():
    msg = _replay_error(shape_toggling_fn, debug=True)
    assert "`shape_toggling_fn`" in msg and "debug" in msg
    assert "debug: forward ran" in msg and "aten.slice" in msg


def test_determinism_check_none_skips_the_check():
    # determinism_check="none" skips the metadata check only; a different number of saved tensors is
    # always an error (as in torch).
    msg = _replay_error(count_toggling_fn, determinism_check="none")
    assert "`count_toggling_fn`" in msg and "different number of tensors" in msg
    assert _TOGGLE.calls == 2  # forward and replay
    msg = _replay_error(count_toggling_fn)
    assert "`count_toggling_fn`" in msg and "differs from its forward" in msg
    # A changed shape unchecked: whatever autograd says then, it is not ckpt_ext's determinism error.
    msg = _replay_error(shape_toggling_fn, determinism_check="none")
    assert "differs from its forward" not in msg


# --------------------------------------------------------------------------------------------------
# Nothing to checkpoint
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_plain_call_when_no_graph_is_needed(mode, no_warnings):
    block = make_block(p=0.3, seed=15)
    x, = leaf_inputs((BATCH, DIM), seed=15, requires_grad=mode != "nothing_requires_grad")
    if mode == "nothing_requires_grad":
        block.requires_grad_(False)
    calls = []

    def fn(t):
        calls.append(torch.is_grad_enabled())
        return block(t)

    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    allocations = cpu_pool()["allocations"]
    with context():
        torch.manual_seed(6)
        out = ckpt(fn, x)
        torch.manual_seed(6)
        ref = block(x)
    assert len(calls) == 1
    assert not ckpt_ext.is_pooled(out)
    assert torch.equal(out, ref)
    assert not out.requires_grad
    assert cpu_pool()["allocations"] == allocations


# --------------------------------------------------------------------------------------------------
# is_recomputing
# --------------------------------------------------------------------------------------------------
def test_is_recomputing_only_during_replay():
    block = make_block(p=0.0, seed=16)
    seen = []

    def fn(t):
        seen.append(ckpt_ext.is_recomputing())
        return block(t)

    x, = leaf_inputs((BATCH, DIM), seed=16)
    assert not ckpt_ext.is_recomputing()
    y = ckpt(fn, x)
    assert seen == [False]
    assert not ckpt_ext.is_recomputing()
    y.sum().backward()
    assert seen == [False, True]
    assert not ckpt_ext.is_recomputing()


# --------------------------------------------------------------------------------------------------
# BatchNorm
# --------------------------------------------------------------------------------------------------
class BatchNormNet(nn.Module):
    def __init__(self, fail_in_replay=False):
        super().__init__()
        self.fc = nn.Linear(DIM, 11)
        self.bn = nn.BatchNorm1d(11)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(11, 5)
        self.fail_in_replay = fail_in_replay

    def forward(self, x, scale=None):
        h = self.bn(self.fc(x))
        if self.fail_in_replay and ckpt_ext.is_recomputing():
            raise RuntimeError("replay failed after BatchNorm")
        return self.out(self.drop(torch.relu(h)))


def _bn_nets():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(17)
        plain = BatchNormNet()
    return plain, copy.deepcopy(plain)


class _BatchNormLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.fc(x))))


class _BatchNormStack(nn.Module):
    """Three BatchNorm layers as a layer stack (enable_checkpointing's path)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_BatchNormLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# How the BatchNorm modules reach the replay: the checkpointed module itself (walked in C++), a closure or
# bound method (Python discovery), the layers enable_checkpointing groups, checkpoint_sequential's segments.
_BN_PATHS = {
    "module": lambda net: (net, lambda t: ckpt(net, t)),
    "closure": lambda net: (net, lambda t: ckpt(lambda u: net(u), t)),
    "bound-method": lambda net: (net, lambda t: ckpt(net.forward, t)),
    "sequential": lambda net: (net, lambda t: torch_checkpoint_sequential_like(net, t)),
    # Hugging Face's layers: partial(super().__call__, **kwargs) (the frame finds the module in C++)
    "bound-call": lambda net: (net, lambda t: ckpt(net.__call__, t)),
    "partial-call": lambda net: (net, lambda t: ckpt(functools.partial(net.__call__, scale=None), t)),
    # A module passed as an argument of a partial: the module called is not the one with the BatchNorm.
    "partial-module-argument": lambda net: (net, lambda t: ckpt(functools.partial(_Apply().__call__, net), t)),
}


class _Apply(nn.Module):
    def forward(self, module, x, scale=None):
        return module(x)


def torch_checkpoint_sequential_like(net, t):
    return ckpt_ext.checkpoint_sequential([net.fc, net.bn, nn.ReLU(), net.drop, net.out], 2, t, use_reentrant=False)


def _sequential_reference(net, t):
    return net.out(net.drop(torch.relu(net.bn(net.fc(t)))))


@pytest.mark.parametrize("path", list(_BN_PATHS))
def test_batchnorm_running_stats_match(path, no_warnings):
    plain, ours = _bn_nets()
    net, call = _BN_PATHS[path](ours)
    reference = _sequential_reference if path == "sequential" else (lambda m, t: m(t))
    x, = leaf_inputs((BATCH, DIM), seed=17)
    for step in range(2):
        ref = run_step(lambda t: reference(plain, t), [x], params=dict(plain.named_parameters()), seed=step)
        got = run_step(call, [x], params=dict(ours.named_parameters()), seed=step)
        assert_grads_close(ref, got, exact=path != "sequential")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(ours.bn, name), getattr(plain.bn, name)), (step, name)
    assert ours.bn.num_batches_tracked.item() == 2


@pytest.mark.parametrize("every", [1, 2])
def test_batchnorm_running_stats_match_in_enabled_stack(every, no_warnings):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(21)
        plain = _BatchNormStack()
    ours = copy.deepcopy(plain)
    ckpt_ext.enable_checkpointing(ours, layers=list(ours.layers), every=every)
    x, = leaf_inputs((BATCH, DIM), seed=21)
    for step in range(2):
        ref = run_step(plain, [x], seed=step)
        got = run_step(ours, [x], params=dict(ours.named_parameters()), seed=step)
        assert_grads_close(ref, got, exact=True)
        for p_layer, o_layer in zip(plain.layers, ours.layers):
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                assert torch.equal(getattr(o_layer.bn, name), getattr(p_layer.bn, name)), (step, name)


def test_batchnorm_running_stats_match_module_path_exactly(no_warnings):
    plain, ours = _bn_nets()
    x, = leaf_inputs((BATCH, DIM), seed=17)
    for step in range(2):
        ref = run_step(plain, [x], seed=step)
        got = run_step(lambda t: ckpt(ours, t), [x], params=dict(ours.named_parameters()), seed=step)
        assert_grads_close(ref, got, exact=True)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(ours.bn, name), getattr(plain.bn, name)), (step, name)
    assert ours.bn.num_batches_tracked.item() == 2


def test_batchnorm_running_stats_kept_when_replay_raises():
    _, net = _bn_nets()
    x, = leaf_inputs((BATCH, DIM), seed=18)
    net.fail_in_replay = True
    y = ckpt(net, x)
    after_forward = {k: v.clone() for k, v in net.bn.state_dict().items()}
    with pytest.raises(RuntimeError, match="replay failed"):
        y.sum().backward()
    for k, v in net.bn.state_dict().items():
        assert torch.equal(v, after_forward[k]), k


# --------------------------------------------------------------------------------------------------
# Exceptions
# --------------------------------------------------------------------------------------------------
class ForwardError(Exception):
    pass


class ReplayError(Exception):
    pass


def _next_step_is_right(stack):
    x, = leaf_inputs((BATCH, DIM), seed=30)
    params = dict(stack.named_parameters())
    ref = run_step(chain(stack), [x], params=params, seed=31)
    ours = run_step(chain(stack, ckpt), [x], params=params, seed=31)
    assert_grads_close(ref, ours, exact=True)
    assert not ckpt_ext.is_recomputing()


def _saved_tensor_hooks_popped():
    """No checkpoint's saved-tensor hooks are left active: an op saves its input as usual."""
    t = torch.randn(3, requires_grad=True)
    assert t.sin().grad_fn._saved_self is t


def test_exception_in_forward_propagates_and_hooks_popped():
    stack = make_stack(2, p=0.2, seed=19)

    def fails(t):
        stack[1](t)
        raise ForwardError("no luck in forward")

    x, = leaf_inputs((BATCH, DIM), seed=19)
    h = ckpt(stack[0], x)
    with pytest.raises(ForwardError, match="^no luck in forward$"):
        ckpt(fails, h)
    _saved_tensor_hooks_popped()
    del h
    _next_step_is_right(stack)


def test_saved_tensor_hooks_disabled_raises_torchs_error():
    # The frame pushes its hooks on ATen's stack itself: where torch disables saved-tensor hooks, the
    # error is torch's own (its message, RuntimeError), nothing is left pushed, and the next call works.
    x = torch.randn(BATCH, DIM, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("saved-tensor hooks are off here"):
        with pytest.raises(RuntimeError, match="^saved-tensor hooks are off here$"):
            ckpt(lambda t: t.sin(), x)
        with pytest.raises(RuntimeError, match="^saved-tensor hooks are off here$"):
            torch_checkpoint.checkpoint(lambda t: t.sin(), x, use_reentrant=False)
    _saved_tensor_hooks_popped()
    _next_step_is_right(make_stack(2, p=0.2, seed=32))


def test_exception_in_replay_propagates_and_state_recovers():
    stack = make_stack(3, p=0.2, seed=20)

    def fails_in_replay(t):
        if ckpt_ext.is_recomputing():
            raise ReplayError("no luck in the replay")
        return stack[1](t)

    x, = leaf_inputs((BATCH, DIM), seed=20)
    torch.manual_seed(0)
    y = ckpt(stack[2], ckpt(fails_in_replay, ckpt(stack[0], x)))
    loss = loss_of(y)
    with pytest.raises(ReplayError, match="no luck in the replay") as info:
        loss.backward()
    assert any("replayed the checkpointed function" in n and "fails_in_replay`" in n for n in info.value.__notes__)
    assert not ckpt_ext.is_recomputing()
    _saved_tensor_hooks_popped()
    del y, loss
    _next_step_is_right(stack)


# --------------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------------
def test_two_threads_get_the_grads_they_get_alone():
    # Models and inputs are made here: building them draws from the global RNG, which is not
    # per-thread. No dropout: the replays of both threads restore the same global CPU generator.
    steps = 8
    models = [make_stack(3, dim=33, hidden=65, p=0.0, seed=s) for s in (1, 2)]
    inputs = [leaf_inputs((16, 33), seed=s)[0] for s in (1, 2)]

    def train(i, results, barrier=None):
        if barrier is not None:
            barrier.wait()
        m, x = models[i], inputs[i]
        results[i] = [run_step(chain(m, ckpt), [x], params=dict(m.named_parameters())) for _ in range(steps)]

    alone = {}
    for i in range(2):
        train(i, alone)
    together, errors = {}, []
    barrier = threading.Barrier(2)

    def guarded(i):
        try:
            train(i, together, barrier)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i in range(2):
        assert len(together[i]) == steps
        for a, b in zip(alone[i], together[i]):
            assert_grads_close(a, b, exact=True)


# --------------------------------------------------------------------------------------------------
# checkpoint_sequential
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("segments", [1, 2, 5])
def test_checkpoint_sequential_matches(segments, no_warnings):
    stack = make_stack(5, p=0.25, seed=22)
    params = dict(stack.named_parameters())
    x, = leaf_inputs((7, DIM), seed=22)
    ours = run_step(lambda t: ckpt_ext.checkpoint_sequential(stack, segments, t, use_reentrant=False), [x],
                    params=params, seed=11)
    plain = run_step(stack, [x], seed=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run_step(lambda t: torch_checkpoint.checkpoint_sequential(stack, segments, t, use_reentrant=False),
                          [x], params=params, seed=11)
    assert_grads_close(plain, ours, exact=True)
    assert_grads_close(theirs, ours)


def test_checkpoint_sequential_list_of_callables(no_warnings):
    stack = make_stack(4, p=0.25, seed=23)
    fns = [stack[0], stack[1].forward, functools.partial(_apply, stack[2]), lambda t: stack[3](t)]
    x, = leaf_inputs((7, DIM), seed=23, requires_grad=False)
    ours = run_step(lambda t: ckpt_ext.checkpoint_sequential(fns, 2, t, use_reentrant=False), [x],
                    params=dict(stack.named_parameters()), seed=12)
    plain = run_step(stack, [x], seed=12)
    assert_grads_close(plain, ours, exact=True)


# --------------------------------------------------------------------------------------------------
# Autocast
# --------------------------------------------------------------------------------------------------
def test_cpu_autocast_bf16_bit_identical(no_warnings):
    stack = make_stack(2, p=0.2, seed=24)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(24)
        head = nn.Linear(DIM, 7)
    layers = list(stack) + [head]
    params = dict(nn.ModuleList(layers).named_parameters())

    def autocast_run(wrap):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return chain(layers, wrap)(x)

        return run

    x, = leaf_inputs((BATCH, DIM), seed=24)
    plain = run_step(autocast_run(None), [x], params=params, seed=13)
    ours = run_step(autocast_run(ckpt), [x], params=params, seed=13)
    assert plain.outputs.dtype == ours.outputs.dtype == torch.bfloat16
    assert not ckpt_ext.is_pooled(ours.outputs)  # the function's own outputs: no pool copy in the new design
    assert_grads_close(plain, ours, exact=True)
    # The replay ran under autocast too: without it the head's output would not be bf16 and the
    # determinism check would have failed. Autocast is off again afterwards.
    assert not torch.is_autocast_enabled("cpu")


# --------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_use_reentrant_accepted_silently(use_reentrant, no_warnings):
    # Either value runs the non-reentrant engine; omitted, torch's warning is given (test_conformance.py).
    block = make_block(p=0.2, seed=25)
    x, = leaf_inputs((BATCH, DIM), seed=25)
    params = dict(block.named_parameters())
    plain = run_step(block, [x], seed=2)
    ours = run_step(lambda t: ckpt(block, t, use_reentrant=use_reentrant), [x], params=params, seed=2)
    assert_grads_close(plain, ours, exact=True)
    seq = run_step(lambda t: ckpt_ext.checkpoint_sequential([block, block], 2, t, use_reentrant=use_reentrant),
                   [x], params=params, seed=2)
    twice = run_step(nn.Sequential(block, block), [x], params=params, seed=2)
    assert_grads_close(twice, seq, exact=True)


def test_decorator_form_checkpoints_every_call(no_warnings):
    # torch 2.15's @checkpoint(use_reentrant=False) (offered on every torch): the function's own keywords
    # stay the function's, even where they are named like an option.
    block = make_block(p=0.2, seed=26)
    params = dict(block.named_parameters())
    x, = leaf_inputs((BATCH, DIM), seed=26)

    def scaled(t, debug=1.0):
        return block(t) * debug

    decorated = ckpt_ext.checkpoint(use_reentrant=False, determinism_check="none")(scaled)
    assert decorated.__name__ == "scaled" and decorated.__wrapped__ is scaled
    plain = run_step(lambda t: scaled(t, debug=3.0), [x], params=params, seed=3)
    before = ckpt_ext._C.checkpoint_frames_created()
    ours = run_step(lambda t: decorated(t, debug=3.0), [x], params=params, seed=3)
    assert ckpt_ext._C.checkpoint_frames_created() == before + 1
    assert_grads_close(plain, ours, exact=True)


def test_decorator_form_on_a_method_binds_the_instance(no_warnings):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = make_block(p=0.2, seed=27)

        @ckpt_ext.checkpoint(use_reentrant=False)
        def run(self, t):
            return self.block(t)

        def forward(self, t):
            return self.run(t)

    net = Net()
    x, = leaf_inputs((BATCH, DIM), seed=27)
    plain = run_step(net.block, [x], params=dict(net.block.named_parameters()), seed=4)
    before = ckpt_ext._C.checkpoint_frames_created()
    ours = run_step(net, [x], params=dict(net.block.named_parameters()), seed=4)
    assert ckpt_ext._C.checkpoint_frames_created() == before + 1
    assert_grads_close(plain, ours, exact=True)
    assert isinstance(Net.__dict__["run"], ckpt_ext.checkpoint(use_reentrant=False).func)


def test_decorator_form_rejects_bad_options_at_once():
    with pytest.raises(ValueError, match="unexpected keyword arguments.*mystery"):
        ckpt_ext.checkpoint(use_reentrant=False, mystery=1)
    with pytest.raises(ValueError, match="determinism_check must be one of"):
        ckpt_ext.checkpoint(determinism_check="sometimes")
    with pytest.raises(TypeError, match="decorates a callable"):
        ckpt_ext.checkpoint(use_reentrant=False)(42)
    with pytest.raises(TypeError, match="function must be callable"):
        ckpt_ext.checkpoint(None, torch.randn(2))


def test_parameters_held_out_of_sight_are_checkpointed_and_trained(no_warnings):
    # The real autograd graph carries every parameter's gradient: nothing has to be discovered.
    class Holder:
        __slots__ = ("mod", "calls")

        def __init__(self, mod):
            self.mod = mod
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return self.mod(x).tanh()

    holder = Holder(nn.Linear(3, 3))
    x = torch.randn(2, 3)  # does not require grad
    ref = torch.autograd.grad(holder(x).sum(), list(holder.mod.parameters()))
    holder.calls = 0
    y = ckpt(holder, x)
    y.sum().backward()
    assert holder.calls == 2  # forward and replay
    for p, g in zip(holder.mod.parameters(), ref):
        assert torch.equal(p.grad, g)


def test_replay_frees_the_frame_and_its_inputs():
    # Nothing of a checkpointed call outlives its graph: no cycle, no reference kept by the replay's hooks.
    import weakref
    block = make_block(p=0.2, seed=4)
    x, = leaf_inputs((BATCH, DIM), seed=4)
    h = x * 2
    alive = weakref.ref(h)
    out = ckpt(block, h)
    del h
    loss_of(out).backward()
    del out
    assert alive() is None


# --------------------------------------------------------------------------------------------------
# Early stop: where the replay ends
# --------------------------------------------------------------------------------------------------
def _tail_fn(calls, tail_op):
    def fn(x):
        calls.append("start")
        y = x.sin().tanh()  # tanh saves its result: the last tensor saved
        calls.append("after-tanh")
        if tail_op:
            y = -y  # a differentiable op after the last save (neg saves nothing)
        calls.append("end")
        return y

    return fn


@pytest.mark.parametrize("tail_op", [True, False], ids=["differentiable-tail", "no-differentiable-tail"])
def test_early_stop_skips_only_a_tail_with_differentiable_ops(tail_op, no_warnings):
    """The stop is an exception thrown through torch's C++ frames (~20 µs on CPU), as torch's is. ckpt_ext
    throws it only where the forward ran a differentiable op after its last saved tensor; otherwise the
    replay runs to the end of the function (torch would stop it after `tanh`). Gradients are the same."""
    x = torch.randn(BATCH, DIM, requires_grad=True)
    ref = torch.autograd.grad(_tail_fn([], tail_op)(x).sum(), x)[0]
    calls = []
    out = ckpt_ext.checkpoint(_tail_fn(calls, tail_op), x, use_reentrant=False)
    (got,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    replay = calls[3:]
    assert replay == (["start"] if tail_op else ["start", "after-tanh", "end"])
    with torch_checkpoint.set_checkpoint_early_stop(False):  # both run to the end without early stop
        calls.clear()
        ckpt_ext.checkpoint(_tail_fn(calls, tail_op), x, use_reentrant=False).sum().backward()
        assert calls[3:] == ["start", "after-tanh", "end"]


@pytest.mark.skipif(not hasattr(torch_checkpoint, "GraphExecGroup"), reason="torch without GraphExecGroup")
@pytest.mark.parametrize("grouped", [True, False])
def test_graph_exec_group_replays_once_for_its_backward_calls(grouped, no_warnings):
    # Under one torch.utils.checkpoint.GraphExecGroup, backward calls over disjoint parts of a checkpointed
    # region share one replay (the frame reads the group from the autograd TLS); without it, each backward
    # replays. Counted against torch's own checkpoint.
    def run(checkpoint_fn):
        calls = []
        w1 = torch.randn(DIM, DIM, requires_grad=True)
        w2 = torch.randn(DIM, DIM, requires_grad=True)

        def two_branches(t):
            calls.append(1)
            return (t @ w1).tanh(), (t @ w2).sin()

        x = torch.randn(BATCH, DIM)
        a, b = checkpoint_fn(two_branches, x)
        context = torch_checkpoint.GraphExecGroup() if grouped else contextlib.nullcontext()
        with context:
            g1, = torch.autograd.grad(a.sum(), w1)
            g2, = torch.autograd.grad(b.sum(), w2)
        return len(calls), g1, g2

    torch.manual_seed(5)
    theirs = run(functools.partial(torch_checkpoint.checkpoint, use_reentrant=False))
    torch.manual_seed(5)
    ours = run(ckpt)
    assert ours[0] == theirs[0] == (2 if grouped else 3)
    for o, t in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(o, t, rtol=0, atol=0)


@pytest.mark.skipif(not hasattr(torch_checkpoint, "GraphExecGroup"), reason="torch without GraphExecGroup")
def test_graph_exec_group_refuses_overlapping_backward_calls(no_warnings):
    # Two backward calls under one GraphExecGroup that need the same saved tensor raise torch's error (its
    # message, which code matches on), as torch's test_checkpoint_graph_execution_group checks.
    for checkpoint_fn in (functools.partial(torch_checkpoint.checkpoint, use_reentrant=False), ckpt):
        x = torch.randn(BATCH, DIM, requires_grad=True)
        out = checkpoint_fn(lambda t: t.sin().exp(), x)
        with pytest.raises(torch_checkpoint.CheckpointError, match="Performing two backward calls that overlap"):
            with torch_checkpoint.GraphExecGroup():
                torch.autograd.grad(out.sum(), x, retain_graph=True)
                torch.autograd.grad(out.sum(), x)
