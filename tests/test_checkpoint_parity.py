"""ckpt_ext.checkpoint and checkpoint_sequential against running without checkpointing and against
torch.utils.checkpoint (non-reentrant): outputs, input gradients and every parameter's gradient.

With dropout on, ckpt_ext must be bit-identical to no checkpointing under the same seed: the forward
runs the same operators, and the replay draws the forward's random numbers.
"""
import copy
import functools
import gc
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckpt_ext
from reference import assert_grads_close, chain, leaf_inputs, loss_of, make_block, make_stack, run_step

ckpt = ckpt_ext.checkpoint
torch_ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)

DIM = 19
BATCH = 6


def cpu_pool():
    gc.collect()
    return ckpt_ext.pool_stats("cpu")


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --------------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_chained_blocks_with_dropout_match_references(n_blocks, no_warnings):
    stack = make_stack(n_blocks, p=0.2, seed=1)
    params = dict(stack.named_parameters())
    x, = leaf_inputs((BATCH, DIM), seed=1)
    plain = run_step(chain(stack), [x], params=params, seed=7)
    ours = run_step(chain(stack, ckpt), [x], params=params, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own checkpoint may warn about its options
        theirs = run_step(chain(stack, torch_ckpt), [x], params=params, seed=7)
    assert_grads_close(plain, ours, exact=True)
    assert_grads_close(theirs, ours)
    assert not ckpt_ext.is_pooled(ours.outputs)  # the function's own outputs: no pool copy in the new design
    # Dropout really was on: another seed gives another output.
    other = run_step(chain(stack, ckpt), [x], params=params, seed=8)
    assert not torch.equal(other.outputs, ours.outputs)


def test_whole_stack_in_one_checkpoint_matches(no_warnings):
    stack = make_stack(3, p=0.2, seed=2)
    x, = leaf_inputs((BATCH, DIM), seed=2)
    plain = run_step(stack, [x], seed=3)
    ours = run_step(lambda t: ckpt(stack, t), [x], params=dict(stack.named_parameters()), seed=3)
    assert_grads_close(plain, ours, exact=True)
    assert not ckpt_ext.is_pooled(ours.outputs)  # the function's own outputs: no pool copy in the new design


class ScaledBlock(nn.Module):
    """A module whose forward takes keyword arguments, tensors among them."""

    def __init__(self):
        super().__init__()
        self.block = make_block(p=0.2, seed=5)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, DIM))

    def forward(self, x, *, scale, shift=None, mask=None):
        h = self.block(x) * scale * self.gate
        if shift is not None:
            h = h + shift
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return h


def test_module_with_kwargs_matches(no_warnings):
    mod = ScaledBlock()
    x, shift = leaf_inputs((BATCH, DIM), (DIM,), seed=3)
    mask = torch.zeros(BATCH, DIM, dtype=torch.bool)
    mask[::2, ::3] = True
    kwargs = {"scale": 1.5, "mask": mask}

    def plain(x, shift):
        return mod(x, shift=shift, **kwargs)

    def ours(x, shift):
        return ckpt(mod, x, shift=shift, **kwargs)

    def theirs(x, shift):
        return torch_ckpt(mod, x, shift=shift, **kwargs)

    ref = run_step(plain, [x, shift], params=dict(mod.named_parameters()), seed=4)
    got = run_step(ours, [x, shift], params=dict(mod.named_parameters()), seed=4)
    tc = run_step(theirs, [x, shift], params=dict(mod.named_parameters()), seed=4)
    assert_grads_close(ref, got, exact=True)
    assert_grads_close(tc, got)
    assert not ckpt_ext.is_pooled(got.outputs)  # the function's own outputs: no pool copy in the new design


# --------------------------------------------------------------------------------------------------
# torch.autograd.grad and backward(inputs=...)
# --------------------------------------------------------------------------------------------------
def _forward(stack, x, wrap, seed):
    torch.manual_seed(seed)
    return loss_of(chain(stack, wrap)(x))


def test_autograd_grad_wrt_input_matches(no_warnings):
    stack = make_stack(3, p=0.2, seed=4)
    x0, = leaf_inputs((BATCH, DIM), seed=4)
    x = x0.detach().clone().requires_grad_()
    (gx,) = torch.autograd.grad(_forward(stack, x, ckpt, 9), [x])
    xr = x0.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(_forward(stack, xr, None, 9), [xr])
    assert torch.equal(gx, gr)
    assert x.grad is None


def test_autograd_grad_wrt_params_matches(no_warnings):
    stack = make_stack(3, p=0.2, seed=5)
    params = list(stack.parameters())
    x0, = leaf_inputs((BATCH, DIM), seed=5)
    x = x0.detach().clone().requires_grad_()
    ours = torch.autograd.grad(_forward(stack, x, ckpt, 9), params)
    ref = torch.autograd.grad(_forward(stack, x0.detach().clone().requires_grad_(), None, 9), params)
    for (name, _), a, b in zip(stack.named_parameters(), ours, ref):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in params)
    assert x.grad is None


def test_autograd_grad_wrt_input_leaves_param_grads_alone():
    stack = make_stack(2, p=0.0, seed=6)
    x = leaf_inputs((BATCH, DIM), seed=6)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.autograd.grad(_forward(stack, x, ckpt, 0), [x])
    assert [n for n, p in stack.named_parameters() if p.grad is not None] == []


def test_backward_inputs_fills_only_that_param():
    stack = make_stack(3, p=0.2, seed=7)
    x0, = leaf_inputs((BATCH, DIM), seed=7)
    target = stack[1].fc1.weight
    (ref,) = torch.autograd.grad(_forward(stack, x0.detach().clone().requires_grad_(), None, 9), [target])
    x = x0.detach().clone().requires_grad_()
    _forward(stack, x, ckpt, 9).backward(inputs=[target])
    assert torch.equal(target.grad, ref)
    assert x.grad is None
    filled = [n for n, p in stack.named_parameters() if p.grad is not None]
    assert filled == ["1.fc1.weight"]


# --------------------------------------------------------------------------------------------------
# Parameters found without any input requiring grad
# --------------------------------------------------------------------------------------------------
_GLOBAL_BLOCK = make_block(p=0.2, seed=21)


def _uses_global_block(x):
    return _GLOBAL_BLOCK(x) * 2.0


def _apply(module, x):
    return module(x)


_CALLABLES = {
    "module": lambda: _GLOBAL_BLOCK,
    "bound_method": lambda: _GLOBAL_BLOCK.forward,
    "partial": lambda: functools.partial(_apply, _GLOBAL_BLOCK),
    "closure": lambda: (lambda m: (lambda x: m(x) - 1.0))(_GLOBAL_BLOCK),
    "global": lambda: _uses_global_block,
}


@pytest.mark.parametrize("kind", sorted(_CALLABLES))
def test_input_without_grad_trains_params(kind, no_warnings):
    fn = _CALLABLES[kind]()
    params = dict(_GLOBAL_BLOCK.named_parameters())
    x, = leaf_inputs((BATCH, DIM), seed=8, requires_grad=False)
    ref = run_step(fn, [x], params=params, seed=10)
    ours = run_step(lambda t: ckpt(fn, t), [x], params=params, seed=10)
    assert all(g is not None for g in ours.param_grads.values())
    assert_grads_close(ref, ours, exact=True)
    # Checkpointed for real (without found parameters ckpt_ext falls back to a plain call), and the
    # parameters are inputs of the checkpoint's node, not .grad written from inside the replay:
    # autograd.grad reaches them.
    torch.manual_seed(10)
    out = ckpt(fn, x)
    assert not ckpt_ext.is_pooled(out)  # the function's own outputs: no pool copy in the new design
    grads = torch.autograd.grad(loss_of(out), list(params.values()))
    for (name, expected), got in zip(ref.param_grads.items(), grads):
        assert torch.equal(got, expected), name
    assert all(p.grad is None for p in params.values())


# --------------------------------------------------------------------------------------------------
# Arguments and outputs of any structure
# --------------------------------------------------------------------------------------------------
_STRUCT_BLOCK = make_block(p=0.3, seed=4)


def _structured(d, lst, scale, none_arg, *, bias=None, mode="add"):
    assert none_arg is None and mode == "mul" and isinstance(scale, float)
    a = _STRUCT_BLOCK(d["x"]) * scale
    b = lst[0] * lst[1] + bias
    return {"out": [a, (b, None)], "n": 3, "s": "text", "t": (a.sum(), 7)}


def _call_structured(wrap):
    def run(x, y, z, b):
        args = ({"x": x}, [y, z], 2.5, None)
        if wrap is None:
            return _structured(*args, bias=b, mode="mul")
        return wrap(_structured, *args, bias=b, mode="mul")

    return run


def test_kwargs_non_tensor_none_and_nested_arguments_and_outputs(no_warnings):
    x, y, z, b = leaf_inputs((3, DIM), (3, DIM), (3, DIM), (DIM,), seed=1, requires_grad=[True, False, True, True])
    params = dict(_STRUCT_BLOCK.named_parameters())
    ref = run_step(_call_structured(None), [x, y, z, b], params=params, seed=1)
    ours = run_step(_call_structured(ckpt), [x, y, z, b], params=params, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run_step(_call_structured(torch_ckpt), [x, y, z, b], params=params, seed=1)
    assert_grads_close(ref, ours, exact=True)  # also compares the structure of the outputs
    assert_grads_close(theirs, ours)
    out = ours.outputs
    assert type(out) is dict and type(out["out"]) is list and type(out["out"][1]) is tuple
    assert out["out"][1][1] is None and out["n"] == 3 and out["s"] == "text" and out["t"][1] == 7


@pytest.mark.parametrize("make_output, check", [
    (lambda a: None, lambda o: o is None),
    (lambda a: 3, lambda o: o == 3),
    (lambda a: (a * 2, None, 5, "s"), lambda o: type(o) is tuple and o[1:] == (None, 5, "s")),
    (lambda a: [a * 2], lambda o: type(o) is list and len(o) == 1),
    (lambda a: (a * 2,), lambda o: type(o) is tuple and len(o) == 1),
    (lambda a: {"k": [a + 1, {"j": (a * 3, a.argmax())}]},
     lambda o: type(o) is dict and type(o["k"]) is list and type(o["k"][1]["j"]) is tuple),
])
def test_output_structure_preserved(make_output, check, no_warnings):
    x, = leaf_inputs((3, DIM), seed=2)
    ours = ckpt(make_output, x)
    plain = make_output(x)
    assert check(ours)
    ours_leaves, ours_spec = torch.utils._pytree.tree_flatten(ours)
    plain_leaves, plain_spec = torch.utils._pytree.tree_flatten(plain)
    assert ours_spec == plain_spec
    for a, b in zip(ours_leaves, plain_leaves):
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b)
            assert a.requires_grad == (b.requires_grad and b.is_floating_point())
        else:
            assert a == b
    floats = [t for t in ours_leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if floats:
        sum(t.sum() for t in floats).backward()
        assert x.grad is not None


_PASS_BLOCK = make_block(p=0.0, seed=27)


@pytest.mark.parametrize("fn", [lambda a, b: (a, _PASS_BLOCK(b)), lambda a, b: a],
                         ids=["pass_through", "identity"])
def test_output_that_is_an_input(fn):
    a, b = leaf_inputs((3, DIM), (3, DIM), seed=27)
    params = dict(_PASS_BLOCK.named_parameters())
    ref = run_step(fn, [a, b], params=params)
    ours = run_step(lambda x, y: ckpt(fn, x, y), [a, b], params=params)
    assert_grads_close(ref, ours, exact=True)


# --------------------------------------------------------------------------------------------------
# Nested checkpoints, retain_graph, second backward
# --------------------------------------------------------------------------------------------------
def test_inside_torch_checkpoint_matches(no_warnings):
    # torch's non-reentrant checkpoint hands ckpt_ext's backward the saved tensors it recomputed:
    # other tensor objects than the parameters the replay uses.
    stack = make_stack(3, p=0.2, seed=29)

    def outer(x):
        return ckpt(stack[2], ckpt(stack[1], stack[0](x)))

    x, = leaf_inputs((BATCH, DIM), seed=29, requires_grad=False)
    params = dict(stack.named_parameters())
    ref = run_step(chain(stack), [x], params=params, seed=6)
    ours = run_step(lambda t: torch_ckpt(outer, t), [x], params=params, seed=6)
    assert_grads_close(ref, ours)


def test_nested_checkpoints_match(no_warnings):
    stack = make_stack(3, p=0.2, seed=9)

    def outer(x):
        h = ckpt(stack[0], x)
        h = ckpt(lambda t: stack[2](ckpt(stack[1], t)), h)
        return h * 2.0

    x, = leaf_inputs((BATCH, DIM), seed=9)
    params = dict(stack.named_parameters())
    ref = run_step(lambda t: chain(stack)(t) * 2.0, [x], params=params, seed=5)
    ours = run_step(lambda t: ckpt(outer, t), [x], params=params, seed=5)
    theirs = run_step(lambda t: torch_ckpt(outer, t), [x], params=params, seed=5)
    assert_grads_close(ref, ours, exact=True)
    assert_grads_close(theirs, ours)
    assert not ckpt_ext.is_pooled(ours.outputs)  # the function's own outputs: no pool copy in the new design


@pytest.mark.parametrize("wrap", [None, ckpt], ids=["plain", "ckpt_ext"])
def test_retain_graph_then_second_backward_doubles_grads(wrap):
    stack = make_stack(2, p=0.2, seed=10)
    x0, = leaf_inputs((BATCH, DIM), seed=10)
    once = run_step(chain(stack), [x0], params=dict(stack.named_parameters()), seed=3)
    x = x0.detach().clone().requires_grad_()
    loss = _forward(stack, x, wrap, 3)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * once.input_grads[0], rtol=1e-5, atol=1e-6)
    for name, p in stack.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once.param_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    stack.zero_grad(set_to_none=True)


@pytest.mark.parametrize("wrap", [None, ckpt, torch_ckpt], ids=["plain", "ckpt_ext", "torch"])
def test_second_backward_without_retain_graph_raises(wrap):
    stack = make_stack(2, p=0.2, seed=11)
    x, = leaf_inputs((BATCH, DIM), seed=11)
    loss = _forward(stack, x, wrap, 3)
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def _second_order(module, x0, wrap):
    """Gradient of the squared norm of (d loss / d inputs-and-params) w.r.t. inputs and params."""
    params = list(module.parameters())
    x = x0.detach().clone().requires_grad_()
    y = wrap(module, x) if wrap is not None else module(x)
    first = torch.autograd.grad(y.pow(2).sum(), [x] + params, create_graph=True)
    return torch.autograd.grad(sum(g.pow(2).sum() for g in first), [x] + params, allow_unused=True)


def test_double_backward_matches():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(28)
        mlp = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, = leaf_inputs((4, 5), seed=28)
    ref = _second_order(mlp, x, None)
    theirs = _second_order(mlp, x, torch_ckpt)
    ours = _second_order(mlp, x, ckpt)
    for i, (r, t, o) in enumerate(zip(ref, theirs, ours)):
        torch.testing.assert_close(t, r, rtol=1e-5, atol=1e-6)
        assert o is not None, f"second-order gradient {i} missing"
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6, msg=f"second-order gradient {i}")


# --------------------------------------------------------------------------------------------------
# In-place modification
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_saved_input_modified_before_backward_raises(input_requires_grad):
    block = make_block(p=0.0, seed=12)
    x, = leaf_inputs((BATCH, DIM), seed=12)
    h = x * 1.0 if input_requires_grad else x.detach().clone()
    y = ckpt(block, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_function_modifying_its_input_raises(input_requires_grad):
    block = make_block(p=0.0, seed=13)

    def scales_input(t):
        t.mul_(2.0)
        return block(t)

    x, = leaf_inputs((BATCH, DIM), seed=13)
    h = x * 1.0 if input_requires_grad else x.detach().clone()
    before = cpu_pool()["in_use_bytes"]
    with pytest.raises(RuntimeError, match=r"scales_input` modified its tensor argument 0 in place"):
        ckpt(scales_input, h)
    assert cpu_pool()["in_use_bytes"] == before


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

    def forward(self, x):
        h = self.bn(self.fc(x))
        if self.fail_in_replay and ckpt_ext.is_recomputing():
            raise RuntimeError("replay failed after BatchNorm")
        return self.out(self.drop(torch.relu(h)))


def _bn_nets():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(17)
        plain = BatchNormNet()
    return plain, copy.deepcopy(plain)


def test_batchnorm_running_stats_match(no_warnings):
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
    ours = run_step(lambda t: ckpt_ext.checkpoint_sequential(stack, segments, t), [x], params=params, seed=11)
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
    ours = run_step(lambda t: ckpt_ext.checkpoint_sequential(fns, 2, t), [x], params=dict(stack.named_parameters()),
                    seed=12)
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
@pytest.mark.parametrize("use_reentrant", [True, False, None])
def test_use_reentrant_accepted_silently(use_reentrant, no_warnings):
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


# ------------------------------------------------------------------------------------------------
# Fused layers falling back to Hugging Face's forward, every family with its default config (use_cache
# left on): the KV cache must not be written in forward and again in the replay (issue 13 item 7).
# ------------------------------------------------------------------------------------------------
class _Wrap(nn.Module):
    """Replaces a projection after fuse(), so that the fused layer falls back to Hugging Face's forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _default_model(family):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=97)
    if family == "bert":
        cfg = transformers.BertConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, **small)
        return transformers.BertModel(cfg, add_pooling_layer=False), ("attention", "self", "query")
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0, **small)
        return transformers.GPT2Model(cfg), ("attn", "c_attn")
    cfg = transformers.LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   attention_dropout=0.1, **small)
    return transformers.LlamaModel(cfg), ("self_attn", "q_proj")


def _replace(model, path):
    for layer in model.modules():
        if type(layer).__name__ in ("BertLayer", "GPT2Block", "LlamaDecoderLayer", "FusedTransformerLayer"):
            parent = layer
            for name in path[:-1]:
                parent = getattr(parent, name)
            setattr(parent, path[-1], _Wrap(getattr(parent, path[-1])))


@pytest.mark.parametrize("fallback", ["replaced", "autocast"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_fused_fallback_default_config_matches_no_checkpointing(family, fallback):
    import copy
    import logging
    import warnings
    from ckpt_ext import fused as fused_module
    warned = set(fused_module._warned)  # fused warnings are once per process: leave them to test_fused
    torch.manual_seed(0)
    ref, path = _default_model(family)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.fuse(model)
        if fallback == "autocast":
            # Autocast runs the fused path itself since issue 10 (no fallback): the reference is the same
            # fused model not checkpointed, which draws the same dropout masks, so the KV-cache bug would show.
            ref = copy.deepcopy(model)
        if fallback == "replaced":
            _replace(ref, path)
            _replace(model, path)
        logging.getLogger("ckpt_ext").setLevel(logging.ERROR)
        ckpt_ext.enable_checkpointing(model)
        ids = torch.randint(1, 97, (2, 12))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0  # padding
        results = []
        for m in (ref, model):
            m.train()
            torch.manual_seed(1)
            losses = []
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fallback == "autocast"):
                    out = m(input_ids=ids, attention_mask=mask).last_hidden_state
                loss = out.float().pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
                grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
                opt.step()
            results.append((losses, grads))
    fused_module._warned.clear()
    fused_module._warned.update(warned)
    (l_ref, g_ref), (l_ck, g_ck) = results
    assert g_ref.keys() == g_ck.keys()
    for a, b in zip(l_ref, l_ck):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for n in g_ref:
        torch.testing.assert_close(g_ck[n], g_ref[n], rtol=1e-5, atol=1e-6, msg=n)


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
