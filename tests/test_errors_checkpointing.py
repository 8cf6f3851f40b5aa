"""Bad input to ckpt_ext's checkpointing functions: checkpoint, checkpoint_sequential, is_recomputing,
enable_checkpointing, disable_checkpointing and explain. What each case checks: tests/helpers/errors.py."""
import gc
import math

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckpt_ext
from reference import leaf_inputs, make_block, make_stack

transformers = pytest.importorskip("transformers")
from helpers.hf_models import make_model  # noqa: E402

from helpers.devices import requires_cuda  # noqa: E402
from helpers.errors import _raises, nothing_left_behind  # noqa: E402,F401  (an autouse fixture)
_ATTR = "_ckpt_ext_group"


def _setup_of(model: nn.Module):
    """What enable_checkpointing installed: per module, its group's layers and the patched forward."""
    out = []
    for name, m in model.named_modules():
        g = m.__dict__.get(_ATTR)
        out.append((name, None if g is None else tuple(id(x) for x in g.layers), "forward" in m.__dict__))
    return out


# ---- ckpt_ext.checkpoint --------------------------------------------------------------------------------------------
BLOCK = make_block(p=0.1, seed=3)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(use_reentrant="yes"), TypeError, "use_reentrant must be None, True or False"),
    (dict(determinism_check="bogus"), ValueError, r"determinism_check must be one of \['default', 'none'\]"),
    (dict(debug=1), TypeError, "debug must be True or False"),
    (dict(preserve_rng_state="yes"), TypeError, "preserve_rng_state must be True or False"),
    (dict(early_stop=None), TypeError, "early_stop must be True or False"),
])
def test_checkpoint_bad_options(kwargs, exc, match):
    x, = leaf_inputs((4, 19), seed=1)
    _raises(exc, match, ckpt_ext.checkpoint, BLOCK, x, **kwargs)


def test_checkpoint_function_not_callable():
    x, = leaf_inputs((4, 19), seed=1)
    _raises(TypeError, "function must be callable, got Tensor", ckpt_ext.checkpoint, x, x)


def test_checkpoint_context_fn_accepted_and_checked():
    # Selective checkpointing works (tests/test_conformance.py); a context_fn that is not callable is refused.
    x, = leaf_inputs((4, 19), seed=2)
    _raises(TypeError, "context_fn must be callable", ckpt_ext.checkpoint, BLOCK, x, context_fn=3)
    out = ckpt_ext.checkpoint(BLOCK, x, context_fn=torch_checkpoint.noop_context_fn, use_reentrant=False)
    assert out.requires_grad


def test_checkpoint_arguments_the_function_does_not_take():
    x, = leaf_inputs((4, 19), seed=3)
    # The user's own TypeError, unchanged, and nothing kept.
    _raises(TypeError, "positional argument", ckpt_ext.checkpoint, BLOCK, x, x)


def _same_as_torch(fn, *inputs):
    """Once limitations of the old pooled design (refused with an error); now as torch.utils.checkpoint."""
    results = []
    for ckpt in (ckpt_ext.checkpoint, torch_checkpoint.checkpoint):
        xs = [t.detach().requires_grad_() for t in inputs]
        out = ckpt(fn, *xs, use_reentrant=False)
        out.sum().backward()
        results.append([t.grad for t in xs])
    for a, b in zip(*results):
        assert torch.equal(a.to_dense(), b.to_dense())


def test_checkpoint_sparse_input_and_output_work():
    _same_as_torch(lambda a: (a * 2).to_dense().sin(), torch.randn(5, 5).to_sparse())


def test_checkpoint_tensor_subclass_output_works():
    from torch.testing._internal.two_tensor import TwoTensor

    seen = []
    for ckpt in (ckpt_ext.checkpoint, torch_checkpoint.checkpoint):
        x, = leaf_inputs((3, 4), seed=5)
        out = ckpt(lambda a: TwoTensor(a * 2, a.sin()), x, use_reentrant=False)
        out.a.sum().backward()
        seen.append((type(out), x.grad))
    (t1, g1), (t2, g2) = seen
    assert t1 is t2 is TwoTensor and torch.equal(g1, g2)


def test_checkpoint_non_contiguous_and_mixed_dtype_inputs_work():
    big, other = leaf_inputs((19, 8), (4, 19), seed=6)
    other64 = other.detach().double().requires_grad_()

    def fn(a, b):
        return BLOCK(a) * b.float().sum()

    x = big.t()  # non-contiguous view of a leaf
    assert not x.is_contiguous()
    torch.manual_seed(7)
    out = ckpt_ext.checkpoint(fn, x, other64, use_reentrant=False)
    out.square().sum().backward()
    got = (big.grad.clone(), other64.grad.clone(), [p.grad.clone() for p in BLOCK.parameters()])
    for t in (big, other64, *BLOCK.parameters()):
        t.grad = None
    torch.manual_seed(7)
    fn(big.t(), other64).square().sum().backward()
    assert torch.equal(got[0], big.grad) and torch.equal(got[1], other64.grad)
    for a, p in zip(got[2], BLOCK.parameters()):
        assert torch.equal(a, p.grad)
        p.grad = None


@requires_cuda
@pytest.mark.cuda
def test_checkpoint_mixed_cpu_and_cuda_inputs_match_plain():
    block = make_block(p=0.0, seed=8).cuda()
    a, = leaf_inputs((4, 19), seed=8, device="cuda")
    scale, = leaf_inputs((1,), seed=9)  # on CPU

    def fn(x, s):
        return block(x) * s.cuda()

    ckpt_ext.checkpoint(fn, a, scale, use_reentrant=False).sum().backward()
    got = a.grad.clone(), scale.grad.clone()
    a.grad = scale.grad = None
    fn(a, scale).sum().backward()
    torch.testing.assert_close(got[0], a.grad)
    torch.testing.assert_close(got[1], scale.grad)


# ---- checkpoint_sequential ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("functions,segments,exc,match", [
    (5, 1, TypeError, "functions must be an nn.Sequential or a list of callables, got int"),
    ([BLOCK, 3], 2, TypeError, r"functions\[1\] is not callable \(got int\)"),
    ([], 1, ValueError, r"segments must be between 1 and the number of functions \(0\), got 1"),
    ("stack", 0, ValueError, r"segments must be between 1 and the number of functions \(5\), got 0"),
    ("stack", -1, ValueError, "got -1"),
    ("stack", 6, ValueError, "got 6"),
    ("stack", "2", TypeError, "segments must be an int, got str"),
    ("stack", 2.0, TypeError, "segments must be an int, got float"),
    ("stack", True, TypeError, "segments must be an int, got bool"),
])
def test_checkpoint_sequential_bad_arguments(functions, segments, exc, match):
    if functions == "stack":
        functions = make_stack(5, p=0.0, seed=22)
    x, = leaf_inputs((3, 19), seed=22)
    _raises(exc, match, ckpt_ext.checkpoint_sequential, functions, segments, x)


def test_checkpoint_sequential_unknown_keyword():
    x, = leaf_inputs((3, 19), seed=23)
    _raises(ValueError, "unexpected keyword arguments: foo", ckpt_ext.checkpoint_sequential, make_stack(2), 1, x,
            foo=1)


def test_is_recomputing_takes_no_arguments():
    with pytest.raises(TypeError):
        ckpt_ext.is_recomputing(True)


# ---- enable_checkpointing / disable_checkpointing / explain ---------------------------------------------------------
class Net(nn.Module):
    def __init__(self, n=4, d=19):
        super().__init__()
        self.blocks = make_stack(n, dim=d, p=0.0, seed=31)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def _foreign_layers():
    return [make_block(), make_block()]


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(every=0), ValueError, "every must be at least 1, got 0"),
    (dict(every=-2), ValueError, "every must be at least 1, got -2"),
    (dict(every=1.5), TypeError, "every must be a positive int, got 1.5"),
    (dict(every="2"), TypeError, "every must be a positive int, got '2'"),
    (dict(every=True), TypeError, "every must be a positive int, got True"),
    (dict(every=5), ValueError, "every=5 is larger than the 4 layers"),
    (dict(every=2, budget="1GiB"), ValueError, r"either every= \(fixed groups\) or budget= \(planned groups\)"),
    (dict(budget=-1), ValueError, "budget must be positive, got -1"),
    (dict(budget=0), ValueError, "budget must be positive, got 0"),
    (dict(budget="lots"), ValueError, "cannot read the memory budget 'lots'.*'20GiB'"),
    (dict(budget="-3GiB"), ValueError, "cannot read the memory budget '-3GiB'"),
    (dict(budget="3 parsecs"), ValueError, "cannot read the memory budget"),
    (dict(budget=math.nan), ValueError, "positive finite number of bytes, got nan"),
    (dict(budget=math.inf), ValueError, "positive finite number of bytes, got inf"),
    (dict(budget=True), TypeError, "memory budget must be a size such as '20GiB'"),
    (dict(budget=[1]), TypeError, "memory budget must be a size such as '20GiB'.*got list"),
    (dict(layers="blocks"), TypeError, "layers must be an nn.ModuleList, an nn.Sequential or a non-empty list"),
    (dict(layers=[]), TypeError, "non-empty list of modules"),
    (dict(layers=[1, 2]), TypeError, "non-empty list of modules"),
    (dict(layers=_foreign_layers()), ValueError, "layers must be modules of the model given"),
])
@pytest.mark.parametrize("already", [None, 2], ids=["fresh", "enabled-every-2"])
def test_enable_checkpointing_bad_arguments_leave_the_model_as_it_was(kwargs, exc, match, already):
    model = Net()
    if already:
        ckpt_ext.enable_checkpointing(model, every=already)
    before = _setup_of(model)
    _raises(exc, match, ckpt_ext.enable_checkpointing, model, **kwargs)
    assert _setup_of(model) == before
    # The model still trains, with the setup it had.
    x, = leaf_inputs((3, 19), seed=32)
    model(x).sum().backward()


def test_enable_checkpointing_models_without_a_layer_stack():
    for model in (nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.ReLU()), nn.ModuleList()):
        _raises(ValueError, "found no layer stack.*Pass the stack explicitly, e.g. "
                r"enable_checkpointing\(model, layers=model.encoder.layer\)", ckpt_ext.enable_checkpointing, model)
        assert all(_ATTR not in m.__dict__ for m in model.modules())


def test_enable_checkpointing_a_layer_twice_in_the_stack():
    block = make_block()
    model = nn.Sequential(block, block, make_block())
    _raises(ValueError, "a layer appears twice", ckpt_ext.enable_checkpointing, model, layers=model)
    assert all(_ATTR not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("fn", [ckpt_ext.enable_checkpointing, ckpt_ext.disable_checkpointing, ckpt_ext.explain,
                                ckpt_ext.fuse])
@pytest.mark.parametrize("bad", ["model", None, 3, [nn.Linear(2, 2)]])
def test_model_functions_want_a_module(fn, bad):
    _raises(TypeError, "expects an nn.Module, got", fn, bad)


def test_enable_checkpointing_on_top_of_hugging_face_checkpointing():
    model = make_model("gpt2")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    before = _setup_of(model)
    _raises(ValueError, r"activation_checkpointing_disable\(\)", ckpt_ext.enable_checkpointing, model)
    assert _setup_of(model) == before


def test_budget_below_least_achievable_fails_every_step_until_changed():
    model = Net().train()
    ckpt_ext.enable_checkpointing(model, budget=1000)
    x, = leaf_inputs((64, 19), seed=33)
    start = ckpt_ext.pool_stats("cpu")["in_use_bytes"]
    for _ in range(2):  # the same clear error each time, nothing kept
        with pytest.raises(ValueError, match=r"least achievable.*[0-9]"):
            model(x).sum().backward()
        gc.collect()
        assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == start
    ckpt_ext.enable_checkpointing(model, budget="1GiB")
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_disable_checkpointing_on_a_model_without_it_is_a_no_op():
    model = Net()
    before = _setup_of(model)
    assert ckpt_ext.disable_checkpointing(model) is model
    assert _setup_of(model) == before
    assert "not enabled" in ckpt_ext.explain(model)
