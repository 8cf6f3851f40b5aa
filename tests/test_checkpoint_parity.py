"""ckpt_ext.checkpoint and checkpoint_sequential against running without checkpointing and against
torch.utils.checkpoint (non-reentrant): outputs, input gradients and every parameter's gradient.

With dropout on, ckpt_ext must be bit-identical to no checkpointing under the same seed: the forward
runs the same operators, and the replay draws the forward's random numbers.
"""
import collections
import functools
import warnings

import pytest
import torch
from torch import nn

import ckpt_ext
from helpers.checkpointing import BATCH, DIM, apply_module as _apply, ckpt, cpu_pool, torch_ckpt
from helpers.checkpointing import no_warnings  # noqa: F401 (a fixture)
from reference import assert_grads_close, chain, leaf_inputs, loss_of, make_block, make_stack, run_step


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
_Pair = collections.namedtuple("_Pair", "a b")
_WRAPS = {  # how the two tensors reach the function: plain containers (walked in C++) and other pytree nodes
    "flat": lambda a, b: ((a, b), {}),
    "list": lambda a, b: (([a, b],), {}),
    "nested-dict": lambda a, b: (({"x": [a], "y": {"b": b}},), {}),
    "namedtuple": lambda a, b: ((_Pair(a, b),), {}),
    "ordereddict": lambda a, b: ((collections.OrderedDict(x=a, y=b),), {}),
    "kwargs": lambda a, b: ((a,), {"other": (b,)}),
}


def _takes_any(*args, other=None):
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, other)) if isinstance(t, torch.Tensor)]
    a, b = leaves
    return torch.tanh(a @ b) * 2.0


@pytest.mark.parametrize("wrap", list(_WRAPS))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tensors_anywhere_in_the_arguments_match_torch(wrap, device, no_warnings):
    # The frame finds the devices whose generators it snapshots in the arguments' pytrees: plain lists,
    # tuples and dicts in C++, other nodes through pytree. Meta tensors have no generator (torch skips them).
    def run(checkpoint_fn):
        torch.manual_seed(3)
        a = torch.randn(3, 4, device=device, requires_grad=True)
        b = torch.randn(4, 5, device=device, requires_grad=True)
        args, kwargs = _WRAPS[wrap](a, b)
        out = checkpoint_fn(_takes_any, *args, **kwargs)
        out.sum().backward()
        return out, a.grad, b.grad

    for ours, theirs in zip(run(ckpt), run(torch_ckpt)):
        assert ours.device == theirs.device and ours.shape == theirs.shape
        if device == "cpu":
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


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
