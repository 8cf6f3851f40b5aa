"""Conformance: ckpt_ext.checkpoint behaves as torch.utils.checkpoint.checkpoint(use_reentrant=False).

Every test runs one scenario twice, once with torch's checkpoint and once with ckpt_ext's, on the same
fresh random inputs, and asserts that what user code can observe is identical (gradients bitwise, hook
calls, exceptions, side effects of replays). The scenarios are this project's own, written from the
behaviours torch documents and tests (TestCheckpoint, TestNestedCheckpoint, selective checkpointing).
"""
import functools
import gc
import inspect
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as tc

import ckpt_ext

TORCH = functools.partial(tc.checkpoint, use_reentrant=False)
CKPT = functools.partial(ckpt_ext.checkpoint, use_reentrant=False)
# torch >= 2.15: checkpoint(respect_saved_tensors_hooks=...)
RESPECT = "respect_saved_tensors_hooks" in inspect.signature(tc.checkpoint).parameters
from helpers.devices import DEVICES, requires_cuda  # noqa: E402  (cuda: marked `cuda`, skipped without a GPU)


def both(scenario, *args, **kwargs):
    """Runs scenario(checkpoint_fn, ...) with torch's checkpoint and ckpt_ext's; returns both results."""
    return scenario(TORCH, *args, **kwargs), scenario(CKPT, *args, **kwargs)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a - b).abs().max()
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b, (a, b)


def conform(scenario, *args, **kwargs):
    a, b = both(scenario, *args, **kwargs)
    assert_same(a, b)
    return a


def model(seed=0, d=8, p=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(p), nn.Linear(d, d))


def data(seed=1, d=8, requires_grad=True):
    torch.manual_seed(seed)
    return torch.randn(4, d, requires_grad=requires_grad)


def grads(m, *tensors):
    return [p.grad for p in m.parameters()] + [t.grad for t in tensors]


# ------------------------------------------------------------------------------------------------ hooks
def test_parameter_hook_fires_once():
    def run(ckpt):
        m, x = model(), data()
        calls = []
        m[0].weight.register_hook(lambda g: calls.append(1) or 2 * g)
        ckpt(m, x).sum().backward()
        return grads(m, x), len(calls)

    (_, calls) = conform(run)
    assert calls == 1


def test_input_output_and_post_accumulate_hooks():
    def run(ckpt):
        m, x = model(), data()
        log = []
        x.register_hook(lambda g: log.append("x"))
        m[3].bias.register_post_accumulate_grad_hook(lambda p: log.append("post"))
        h = x * 2
        h.register_hook(lambda g: log.append("h") or g * 3)
        out = ckpt(m, h)
        out.register_hook(lambda g: log.append("out") or g + 1)
        out.sum().backward()
        return grads(m, x), log

    conform(run)


def test_hook_on_output_grad_fn_calling_backward_on_input_descendant():
    def run(ckpt):
        m, x = model(), data()
        out = ckpt(m, x)
        calls = []

        def hook(*_):
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("hook re-entered")
            with torch.enable_grad():
                (x * 3).sum().backward()

        out.grad_fn.register_prehook(hook)
        out.sum().backward()
        return grads(m, x), len(calls)

    conform(run)


# ------------------------------------------------------------------------------ autograd inside/between
def test_autograd_grad_inside_the_function():
    def fn(x, w):
        y = (x * w).sin()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return g * y

    def run(ckpt, early_stop):
        x, w = data(), data(2)
        ckpt(fn, x, w, early_stop=early_stop).sum().backward()
        return x.grad, w.grad

    conform(run, True)
    conform(run, False)


def test_autograd_grad_between_outputs_of_one_call():
    def fn(x):
        y = x.sin()
        return y, y.exp() * x

    def run(ckpt):
        x = data()
        y, z = ckpt(fn, x)
        (g,) = torch.autograd.grad(z.sum(), inputs=(y,), retain_graph=True)
        (gx,) = torch.autograd.grad(z.sum(), inputs=(x,))
        return g, gx

    conform(run)


def test_backward_inputs_subset_and_retain_graph():
    def run(ckpt):
        m, x = model(), data()
        out = ckpt(m, x)
        out.sum().backward(inputs=[x], retain_graph=True)
        first = x.grad.clone()
        out.pow(2).sum().backward()
        return first, grads(m, x)

    conform(run)


def test_double_backward():
    def run(ckpt):
        x = data()
        y = ckpt(lambda t: (t.sin() * t).sum(), x)
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.pow(2).sum().backward()
        return g.detach(), x.grad

    conform(run)


def test_inputs_without_grad_and_detached_inputs():
    def run(ckpt):
        m, x = model(), data(requires_grad=False)
        mask = torch.ones(4, 8)
        out = ckpt(lambda a, b: m(a) * b, x.detach(), mask)
        out.sum().backward()
        return grads(m), out.requires_grad

    conform(run)


# ------------------------------------------------------------------------------ nesting and early stop
def _counted(calls):
    def fn(x):
        calls.append("start")
        y = x.sin()
        calls.append("after-sin")
        z = y.cos()
        calls.append("after-cos")
        return z * 2  # saves no tensor: early stop ends the replay inside cos

    return fn


@pytest.mark.parametrize("early_stop", [True, False, "context"])
def test_early_stop(early_stop):
    def run(ckpt):
        calls = []
        x = data()
        if early_stop == "context":
            with tc.set_checkpoint_early_stop(False):
                out = ckpt(_counted(calls), x)
        else:
            out = ckpt(_counted(calls), x, early_stop=early_stop)
        out.sum().backward()
        return x.grad, calls

    conform(run)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoints(early_stop):
    def run(ckpt):
        calls = []
        m, x = model(), data()
        inner = _counted(calls)

        def outer(t):
            return ckpt(inner, m(t), early_stop=early_stop).tanh()

        out = ckpt(outer, x, early_stop=early_stop)
        out.sum().backward()
        return grads(m, x), calls

    conform(run)


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen operators that reach a kernel (an op that early stop skips does not)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_skips_the_op_whose_inputs_were_the_last_save(early_stop):
    # An op saves its inputs before it runs: early stop at that save skips it (torch's
    # test_nested_checkpoint_set_early_stop_no_recompution_needed).
    def run(ckpt):
        calls = []

        def fn(x):
            calls.append(1)
            return x.sin()

        a = torch.tensor(1.0, requires_grad=True)
        with _OpCounter() as counter:
            with tc.set_checkpoint_early_stop(early_stop):
                out = ckpt(fn, a)
            out.backward()
        return a.grad, len(calls), counter.ops.count("sin")

    (_, calls, sins) = conform(run)
    assert calls == 2 and sins == (1 if early_stop else 2)


@pytest.mark.parametrize("tail", ["gemm", "gemm+residual", "tanh", "layer_norm", "dropout", "custom_function"])
def test_replay_runs_no_op_that_torchs_skips(tail):
    # Whatever ends the function (a GEMM whose inputs are its last save, an op saving its output, outputs without
    # grad such as LayerNorm's statistics or dropout's mask, a custom Function), the replay runs the same ops.
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2 + 0 * x

    def fn(x):
        fc1, fc2, ln = m
        h = F.gelu(fc1(x))
        if tail == "gemm":
            return fc2(h)
        if tail == "gemm+residual":
            return x + fc2(h)
        if tail == "tanh":
            return torch.tanh(fc2(h))
        if tail == "layer_norm":
            return ln(fc2(h))
        if tail == "dropout":
            return F.dropout(fc2(h), 0.5)
        return Double.apply(fc2(h))

    m = []

    def run(ckpt):
        torch.manual_seed(0)
        m[:] = [nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)]
        x = data()
        out = ckpt(fn, x)
        with _OpCounter() as counter:
            out.sum().backward()
        return grads(nn.ModuleList(m), x), counter.ops

    conform(run)


def test_two_backwards_over_a_retained_graph():
    def run(ckpt):
        calls = []
        x = data()
        out = ckpt(_counted(calls), x)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        return x.grad, calls

    conform(run)


# ------------------------------------------------------------------------------ saved tensors, Functions
def test_save_on_cpu_and_counting_hooks_around():
    def run(ckpt):
        m, x = model(), data()
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ckpt(m, x * 1)
        with torch.autograd.graph.save_on_cpu():
            out2 = ckpt(m, x)
        (out.sum() + out2.sum()).backward()
        if ckpt is TORCH and not hasattr(torch._C._autograd, "_make_saved_tensor"):
            # torch before 2.13 saves the inputs through a no-op autograd Function whose empty dummy
            # input the hooks see too; ckpt_ext saves the same inputs without it.
            packed = [s for s in packed if s != (0,)]
        return grads(m, x), packed

    conform(run)


class _SaveNonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, g):
        x, scale = ctx.saved_tensors
        ctx.same_object = scale is ctx.scale
        try:
            ctx.saved_tensors
            ctx.second = "ok"
        except Exception as e:  # torch raises CheckpointError on a second access
            ctx.second = type(e).__name__
        return g * scale, None


def test_custom_function_saved_tensors():
    def run(ckpt):
        x = data()
        scale = torch.full((8,), 3.0)
        out = ckpt(lambda a, s: _SaveNonGrad.apply(a.sin(), s), x, scale)
        ctx = out.grad_fn
        out.sum().backward()
        return x.grad, ctx.same_object, ctx.second

    conform(run)


def test_grad_fn_is_the_last_operator():
    def run(ckpt):
        x = data()
        out = ckpt(lambda t: t.sin().mul(2.0).exp(), x)
        name = type(out.grad_fn).__name__
        saved = out.grad_fn._saved_result.clone()
        out.sum().backward()
        return name, saved, x.grad

    conform(run)


# ------------------------------------------------------------------------------ determinism check
@pytest.mark.parametrize("change", ["count", "shape"])
def test_nondeterministic_replay_raises_checkpoint_error(change):
    def run(ckpt):
        state = {"n": 0}

        def fn(x):
            state["n"] += 1
            if state["n"] == 1:
                return x.sin().cos()
            if change == "count":  # saves one tensor fewer
                return x.sin() * 2
            return x[:2].sin().cos()

        out = ckpt(fn, data())
        with pytest.raises(tc.CheckpointError):
            out.sum().backward()
        return state["n"]

    conform(run)


def _nondeterministic(first, then):
    calls = []

    def fn(x):
        calls.append(1)
        return (first if len(calls) == 1 else then)(x)

    return fn


def _save_2(x):
    return x.sin().exp()


def _save_3(x):
    return x.sin().exp().sin()


@pytest.mark.parametrize("first, then, early_stop, message", [
    (_save_3, _save_2, True, "A different number of tensors was saved"),
    (_save_2, _save_3, False, "trying to save more tensors during recomputation"),
    (_save_2, _save_3, True, None),  # early stop: the replay stops where the forward's saves end
    (_save_2, lambda x: x.sin() * torch.tensor([1.0, 2.0]), True,
     "Recomputed values for the following tensors have different metadata"),
])
def test_nondeterministic_replay_messages_are_torchs(first, then, early_stop, message):
    # torch's test_checkpoint_detects_non_determinism: code and tests match on torch's sentences.
    def run(ckpt):
        a = data()[0, :1].detach().requires_grad_()
        out = ckpt(_nondeterministic(first, then), a, early_stop=early_stop)
        if message is None:
            out.backward()
            return a.grad
        with pytest.raises(tc.CheckpointError, match=message):
            out.backward()
        return None

    conform(run)


def test_debug_message_names_debug():
    # torch's test_checkpoint_detects_non_determinism matches "You are seeing this error because you passed
    # `debug=True` to checkpoint"; set_checkpoint_debug_enabled overrides the argument.
    def run(ckpt, debug, enabled):
        with pytest.raises(tc.CheckpointError) as info:
            with tc.set_checkpoint_debug_enabled(enabled):
                out = ckpt(_nondeterministic(_save_2, lambda x: x.sin() * torch.tensor([1.0, 2.0])),
                           torch.randn(1, requires_grad=True), debug=debug)
                out.backward()
        return "You are seeing this error because you passed `debug=True` to checkpoint" in str(info.value)

    for debug, enabled in ((True, None), (False, True), (True, False)):
        assert conform(run, debug, enabled) == (enabled is not False)


def test_determinism_check_none_skips_metadata_check():
    def run(ckpt):
        state = {"n": 0}

        def fn(x):
            state["n"] += 1
            y = x.sin() if state["n"] == 1 else x.double().sin().float()
            return y * 2

        x = data()
        out = ckpt(fn, x, determinism_check="none")
        try:
            out.sum().backward()
            return "ok"
        except Exception as e:
            return type(e).__name__

    conform(run)


# ------------------------------------------------------------------------------ RNG and autocast
@pytest.mark.parametrize("device", DEVICES)
def test_rng_dropout_matches_no_checkpoint(device):
    def run(ckpt):
        m, x = model(p=0.5).to(device), data().to(device).detach().requires_grad_()
        torch.manual_seed(5)
        out = m(x) if ckpt is None else ckpt(m, x)
        after = torch.rand(3, device=device)  # the generator continues as without checkpointing
        out.sum().backward()
        return out.detach(), after, grads(m, x)

    ref = run(None)
    a, b = both(run)
    assert_same(a, ref)
    assert_same(b, ref)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16), pytest.param(
    "cuda", torch.float16, marks=[requires_cuda, pytest.mark.cuda])])
def test_autocast_gradients_bit_identical(device, dtype):
    def run(ckpt):
        m, x = model(p=0.1).to(device), data().to(device).detach().requires_grad_()
        torch.manual_seed(5)
        with torch.autocast(device, dtype=dtype):
            out = m(x) if ckpt is None else ckpt(m, x)
        out.float().sum().backward()
        return out.detach(), grads(m, x)

    ref = run(None)
    a, b = both(run)
    assert_same(a, ref)
    assert_same(b, ref)


# ------------------------------------------------------------------------------ selective checkpointing
def _policy_run(policy_name):
    aten = torch.ops.aten

    def run(ckpt):
        counts = {"mm": 0}
        x, w = data(), data(2, requires_grad=True)

        def policy(ctx, op, *args, **kwargs):
            if op == aten.mm.default:
                if not ctx.is_recompute:
                    counts["mm"] += 1
                return getattr(tc.CheckpointPolicy, policy_name)
            return tc.CheckpointPolicy.PREFER_RECOMPUTE

        def fn(a, b):
            return torch.mm(a.sin(), b.t()).relu().sum(0)

        ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy)
        out = ckpt(fn, x, w, context_fn=ctx_fn)
        out.sum().backward()
        return x.grad, w.grad, counts["mm"]

    return run


@pytest.mark.parametrize("policy", [p for p in ("MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE",
                                                "MUST_CPU_OFFLOAD") if hasattr(tc.CheckpointPolicy, p)])
def test_selective_checkpoint_policies(policy):
    conform(_policy_run(policy))


def test_selective_checkpoint_op_list():
    def run(ckpt):
        x = data()
        ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        out = ckpt(lambda a: torch.mm(a.sin(), a.t()).exp(), x, context_fn=ctx_fn)
        out.sum().backward()
        return x.grad

    conform(run)


def test_context_fn_contexts_entered_in_forward_and_replay():
    def run(ckpt):
        log = []

        class Ctx:
            def __init__(self, name):
                self.name = name

            def __enter__(self):
                log.append(self.name + ckpt_ext.is_recomputing().__class__.__name__)

            def __exit__(self, *a):
                log.append("/" + self.name)

        x = data()
        ckpt(lambda a: a.sin(), x, context_fn=lambda: (Ctx("fwd"), Ctx("rec"))).sum().backward()
        return x.grad, [entry.replace("bool", "") for entry in log]

    conform(run)


# -------------------------------------------- selective checkpointing under outer saved-tensor hooks
def _recording_hooks(seen):
    """Outer hooks that record every tensor packed (shape, value sum) and unpacked; pack returns a copy
    in a tuple, so a saved tensor that skips the unpack hook cannot be used."""
    def pack(t):
        seen.append(("pack", tuple(t.shape), t.detach().double().sum().item()))
        return (t.detach().clone(),)

    def unpack(packed):
        seen.append(("unpack", tuple(packed[0].shape)))
        return packed[0]

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _sac_under_hooks(respect, hooks, outer=None):
    """SAC (mm saved) under recording outer hooks; `outer`: nest the call in a checkpoint of that kind.
    Returns gradients, what the hooks saw, and the warnings raised (torch warns for respect=None)."""
    def run(ckpt):
        seen = []
        x, w = data(), data(2)
        ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        options = {} if respect == "absent" else {"respect_saved_tensors_hooks": respect}

        def fn(a, b):
            return torch.mm(a.sin(), b.t()).relu().sum(0)

        def call(a, b):
            return ckpt(fn, a, b, context_fn=ctx_fn, **options)

        if outer is not None:
            nested = call
            call = lambda a, b: (CKPT if outer == "ckpt_ext" else TORCH)(lambda c, d: nested(c.cos(), d).tanh(), a, b)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if hooks:
                with _recording_hooks(seen):
                    out = call(x, w)
            else:
                out = call(x, w)
            out.sum().backward()
        return x.grad, w.grad, seen, [(w.category, str(w.message)) for w in caught]

    return run


@pytest.mark.skipif(not RESPECT, reason="torch < 2.15 has no respect_saved_tensors_hooks")
@pytest.mark.parametrize("hooks", [True, False])
@pytest.mark.parametrize("respect", ["absent", None, True, False])
def test_respect_saved_tensors_hooks(respect, hooks):
    out = conform(_sac_under_hooks(respect, hooks))
    packed_by_sac = [e for e in out[2] if e[0] == "pack" and e[1] == (4, 4)]  # the mm output
    assert len(packed_by_sac) == (1 if hooks and respect is True else 0)
    assert len(out[3]) == (1 if hooks and respect in ("absent", None) else 0)


@pytest.mark.skipif(not RESPECT, reason="torch < 2.15 has no respect_saved_tensors_hooks")
@pytest.mark.parametrize("outer,inner", [("ckpt_ext", "ckpt_ext"), ("torch", "ckpt_ext"), ("ckpt_ext", "torch")])
@pytest.mark.parametrize("respect", [None, True])
def test_respect_saved_tensors_hooks_nested(respect, outer, inner):
    # torch looks past checkpoint-internal hooks (ckpt_ext's included) for the user's, whichever nests.
    ref = _sac_under_hooks(respect, True, outer="torch")(TORCH)
    assert_same(_sac_under_hooks(respect, True, outer=outer)(CKPT if inner == "ckpt_ext" else TORCH), ref)


@pytest.mark.skipif(not RESPECT, reason="torch < 2.15 has no respect_saved_tensors_hooks")
def test_respect_saved_tensors_hooks_refuses_a_non_bool():
    # torch takes any value as its truth; ckpt_ext refuses one that is not None/True/False, as for debug.
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be None, True or False"):
        CKPT(torch.sin, data(), respect_saved_tensors_hooks=1)


@pytest.mark.skipif(RESPECT, reason="torch >= 2.15 takes respect_saved_tensors_hooks itself")
def test_respect_saved_tensors_hooks_is_the_functions_keyword_before_2_15():
    def run(ckpt):
        x = data()
        out, kw = ckpt(lambda a, **k: (a.sin(), k), x, respect_saved_tensors_hooks=True)
        out.sum().backward()
        with pytest.raises(TypeError) as e:
            ckpt(lambda a: a.sin(), x, respect_saved_tensors_hooks=True)
        message = str(e.value).split("() ")[-1]  # the lambda's qualified name differs
        # torch before 2.13 pops the hooks of a call that failed in forward only when the call's generator
        # is collected, and the traceback keeps it: let it go before the next scenario runs.
        del e
        gc.collect()
        return x.grad, kw, message

    conform(run)


# ------------------------------------------------------------------------------ call conventions
def test_kwargs_non_tensor_outputs_and_returned_inputs():
    def fn(x, y, *, scale, tag):
        return {"x": x, "sum": (x * y).sin() * scale, "tag": tag, "n": 3, "none": None}

    def run(ckpt):
        x, y = data(), data(2)
        out = ckpt(fn, x, y, scale=2.0, tag="t")
        same_input = out["x"] is x
        (out["sum"].sum() + out["x"].sum()).backward()
        return same_input, out["tag"], out["n"], out["none"], x.grad, y.grad

    conform(run)


def test_same_tensor_returned_twice():
    def run(ckpt):
        x = data()
        a, b = ckpt(lambda t: (t.sin(),) * 2, x)
        same = a is b
        (a.sum() + 2 * b.sum()).backward()
        return same, x.grad

    conform(run)


def test_no_grad_call_runs_plainly():
    def run(ckpt):
        x = data()
        with torch.no_grad():
            out = ckpt(lambda t: t.sin(), x)
        return out, out.requires_grad

    conform(run)


def test_no_grad_call_makes_but_does_not_enter_the_contexts():
    def run(ckpt):
        log = []

        class Ctx:
            def __enter__(self):
                log.append("entered")

            def __exit__(self, *a):
                log.append("exited")

        def context_fn():
            log.append("context_fn")
            return Ctx(), Ctx()

        with torch.no_grad():
            out = ckpt(lambda t: t.sin(), data(), context_fn=context_fn)
        return out, log

    conform(run)


def test_unpack_outside_backward_recomputes():
    def run(ckpt):
        x = data()
        out = ckpt(lambda t: t.sin().exp(), x)
        first = out.grad_fn._saved_result.clone()
        second = out.grad_fn._saved_result.clone()
        out.sum().backward()
        return first, second, x.grad

    conform(run)


def test_error_in_function_propagates():
    def run(ckpt):
        def fn(x):
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            ckpt(fn, data())
        return True

    conform(run)


def test_gradient_checkpointing_kwargs_style_call():
    # Hugging Face passes use_reentrant and context_fn through gradient_checkpointing_kwargs.
    def run(ckpt):
        m, x = model(), data()
        ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
        call = functools.partial(ckpt, use_reentrant=False, context_fn=ctx_fn) if ckpt is CKPT else \
            functools.partial(tc.checkpoint, use_reentrant=False, context_fn=ctx_fn)
        F.mse_loss(call(m, x), torch.zeros(4, 8)).backward()
        return grads(m, x)

    conform(run)


# ------------------------------------------------------------------------------- use_reentrant omitted
def _use_reentrant_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if "use_reentrant" in str(w.message)]


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint_sequential"])
def test_omitted_use_reentrant_warns_where_torch_warns(name):
    # torch 2.13's test_checkpoint_(sequential_)warns_if_use_reentrant_not_passed_explcitly: without use_reentrant
    # torch warns, and runs its reentrant variant; ckpt_ext warns then too, with torch's sentence (what code
    # and tests match on), once per call, at the caller's line. Passed explicitly, neither warns.
    mods = [nn.Linear(8, 8), nn.Linear(8, 8)]
    ours, theirs = getattr(ckpt_ext, name), getattr(tc, name)
    args = (mods, 2, data()) if name == "checkpoint_sequential" else (mods[0], data())
    sentence = "the use_reentrant parameter should be passed explicitly"
    torch_warns = _use_reentrant_warnings(lambda: theirs(*args))
    ours_warn = _use_reentrant_warnings(lambda: ours(*args))
    assert len(ours_warn) == len(torch_warns) <= 1
    assert all(sentence in m for m in torch_warns + ours_warn)
    assert all(f"ckpt_ext.{name}" in m and "use_reentrant=False" in m for m in ours_warn)
    for use_reentrant in (False, True):
        assert _use_reentrant_warnings(lambda: ours(*args, use_reentrant=use_reentrant)) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours(*args); line = sys._getframe().f_lineno  # noqa: E702
    assert [(os.path.basename(w.filename), w.lineno) for w in caught if "use_reentrant" in str(w.message)] == \
        [(os.path.basename(__file__), line)] * len(torch_warns)


def test_omitted_use_reentrant_with_torchs_checkpoint_replaced_by_ckpt_ext(monkeypatch):
    # Adopting the drop-in by assigning it over torch's functions: ckpt_ext asks the torch functions it imported,
    # not the replacements, whether torch warns (no recursion into itself), and warns as above.
    m, x = model(), data()
    expected = len(_use_reentrant_warnings(lambda: tc.checkpoint(m, x)))
    monkeypatch.setattr(sys.modules["ckpt_ext.checkpoint"], "_torch_warns", {})  # ask torch again
    monkeypatch.setattr(tc, "checkpoint", ckpt_ext.checkpoint)
    monkeypatch.setattr(tc, "checkpoint_sequential", ckpt_ext.checkpoint_sequential)
    assert len(_use_reentrant_warnings(lambda: tc.checkpoint(m, x).sum().backward())) == expected
    assert len(_use_reentrant_warnings(lambda: tc.checkpoint_sequential(list(m), 2, x))) == expected
