"""Tests of how the fused-layer kernels are registered: the ops come from this checkout, ``opcheck`` (schemas,
fake kernels, autograd registration, AOT dispatch) and float64 ``gradcheck`` on every op, their autograd kernels
are C++ functions, and CUDA rejects float64 clearly."""
import pytest
import torch

import ckpt_ext
from ckpt_ext import ops

from helpers.devices import requires_cuda
from helpers.kernel_fixtures import _seed  # noqa: F401  (an autouse fixture)


def test_ops_come_from_this_checkout():
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.dirname(os.path.dirname(os.path.abspath(ckpt_ext.__file__))) == here


# ---- argument checks ---------------------------------------------------------------------------------------------


# ---- opcheck (schemas, fake kernels, autograd registration, AOT dispatch) -------------------------------------------


def _opcheck_samples(device="cpu"):
    def t(*shape, grad=False):
        return torch.randn(*shape, device=device, requires_grad=grad)

    x, r, g = t(5, 12, grad=True), t(5, 12, grad=True), t(5, 12)
    w, b = t(12, grad=True), t(12, grad=True)
    s, mean, rstd = t(5, 12), t(5).abs(), t(5).abs() + 0.5
    q = t(2, 6, 3, 8).transpose(1, 2).detach().requires_grad_()  # [2, 3, 6, 8] view
    cos, sin = t(1, 6, 8), t(1, 6, 8)
    L = torch.ops.ckpt_ext
    # the forward's keep bits (CPU: one bit per element; CUDA: empty)
    bits = L.bias_dropout_add_layer_norm.default(g, None, s, w.detach(), None, 0.2, 1e-5, 3, 4)[4]
    return [
        (L.bias_gelu.default, (x, b, "none")),
        (L.bias_gelu.default, (x, None, "tanh")),
        (L.bias_gelu_backward.default, (g, x.detach(), b.detach(), "tanh")),
        (L.bias_gelu_backward.default, (g, x.detach(), b.detach(), "none", True)),
        (L.bias_dropout_add.default, (x, b, r, 0.3, 5, 7)),
        (L.bias_dropout_add.default, (x, None, r, 0.0, 5, 7)),
        (L.dropout.default, (g, 0.3, 5, 7)),
        # autocast's float32 stream beside a bfloat16 x / a dropout into bfloat16
        (L.bias_dropout_add.default, (x.detach().bfloat16().requires_grad_(), b, r, 0.3, 5, 7)),
        (L.dropout.default, (x, 0.3, 5, 7, torch.bfloat16)),
        (L.dropout_mask.default, (37, 0.3, 5, 7, torch.device(device))),
        (L.bias_dropout_add_layer_norm.default, (x, b, r, w, b, 0.2, 1e-5, 3, 4)),
        (L.bias_dropout_add_layer_norm.default, (x, None, r, w, None, 0.0, 1e-5, 3, 4)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, g, s, w.detach(), mean, rstd, 0.2, 3, 4)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, None, s, w.detach(), mean, rstd, 0.0, 3, 4)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, g, s, w.detach(), mean, rstd, 0.2, 3, 4, bits)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, g, s, w.detach(), mean, rstd, 0.2, 3, 4, bits, True)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, None, s, w.detach(), mean, rstd, 0.0, 3, 4, None, True)),
        # autocast, issue 32: an out written in the GEMMs' dtype, its gradient read in it (and a second one added)
        (L.bias_dropout_add_layer_norm.default, (x, b, r, w, b, 0.2, 1e-5, 3, 4, torch.bfloat16)),
        (L.bias_dropout_add_layer_norm_dual.default, (x, b, r, w, b, 0.2, 1e-5, 3, 4, torch.bfloat16)),
        (L.bias_dropout_add_layer_norm_dual.default, (x.detach().bfloat16().requires_grad_(), None, r, w, None, 0.0,
                                                      1e-5, 3, 4, torch.float16)),
        (L.bias_dropout_add_layer_norm_backward.default,
         (g, g, s, w.detach(), mean, rstd, 0.2, 3, 4, None, True, torch.bfloat16, g.bfloat16())),
        (L.bias_dropout_add_layer_norm_backward.default, (g.bfloat16(), None, s, w.detach(), mean, rstd, 0.0, 3, 4)),
        (L.add_rms_norm.default, (x, None, w, 1e-6, torch.bfloat16)),
        (L.add_rms_norm.default, (x.detach().bfloat16().requires_grad_(), r, w, 1e-6, torch.bfloat16)),
        (L.add_rms_norm_backward.default, (g.bfloat16(), g, s, w.detach(), rstd, g.bfloat16())),
        (L.add_layer_norm.default, (x, r, w, b, 1e-5)),
        (L.add_layer_norm.default, (x, None, w, None, 1e-5)),
        (L.add_layer_norm_backward.default, (g, g, s, w.detach(), mean, rstd)),
        (L.add_rms_norm.default, (x, r, w, 1e-6)),
        (L.add_rms_norm.default, (x, None, w, 1e-6)),
        (L.add_rms_norm_backward.default, (g, None, s, w.detach(), rstd)),
        (L.swiglu.default, (x, r)),
        (L.swiglu_backward.default, (g, x.detach(), r.detach())),
        (L.geglu.default, (x, r, "tanh")),
        (L.geglu.default, (x, r.detach(), "none")),
        (L.geglu_backward.default, (g, x.detach(), r.detach(), "tanh")),
        # issue 33: the backwards writing the activation, in place (fresh tensors: each sample is run more than once)
        (L.swiglu_backward_act_.default, (t(5, 12), t(5, 12), t(5, 12))),
        (L.geglu_backward_act_.default, (t(5, 12), t(5, 12), t(5, 12), "none")),
        (L.bias_gelu_backward_act_.default, (t(5, 12), t(5, 12), b.detach(), "tanh", True)),
        (L.bias_gelu_backward_act_.default, (t(5, 12), t(5, 12), None, "none")),
        (L.rotary.default, (q, cos, sin)),
        (L.rotary.default, (t(2, 3, 6, 8, grad=True), cos.squeeze(0), sin.squeeze(0))),
        (L.rotary_backward.default, (g.reshape(1, 1, 5, 12), t(5, 12), t(5, 12))),
    ]


_OPCHECK_CPU = _opcheck_samples()


@pytest.mark.parametrize("op,args", _OPCHECK_CPU, ids=[f"{op._opname}-{i}" for i, (op, _) in enumerate(_OPCHECK_CPU)])
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


@requires_cuda
@pytest.mark.cuda
def test_opcheck_cuda():
    for op, args in _opcheck_samples("cuda"):
        torch.library.opcheck(op, args)


def test_every_op_has_an_opcheck_sample():
    checked = {op._opname for op, _ in _OPCHECK_CPU}
    assert checked == set(ops.__all__)


# ---- autograd registration: in C++, so that C++ code (the fused layers) differentiates without Python ------------

_FORWARD_OPS = ["bias_gelu", "bias_dropout_add", "dropout", "bias_dropout_add_layer_norm",
                "bias_dropout_add_layer_norm_dual", "add_layer_norm", "add_rms_norm", "swiglu", "geglu", "rotary"]


@pytest.mark.parametrize("name", _FORWARD_OPS)
def test_autograd_kernel_is_registered_in_cpp(name):
    dump = torch._C._dispatch_dump(f"ckpt_ext::{name}")
    autograd = [line for line in dump.splitlines() if line.startswith("Autograd")]
    assert len(autograd) == 1 and "csrc/ops/autograd.cpp" in autograd[0], dump


def test_autograd_nodes_are_cpp_functions():
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    for out in [ops.bias_gelu(x, w), ops.swiglu(x, x), ops.geglu(x, x), ops.add_rms_norm(x, None, w)[0],
                ops.bias_dropout_add_layer_norm(x, w, x, w, w, 0.2, 1e-5, 1, 2)[0]]:
        assert type(out.grad_fn).__name__ == "CppFunction"


def test_non_differentiable_outputs_and_unused_grads():
    x, r = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6)
    out, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(x, None, r, w, b, 0.0, 1e-5, 1, 2)
    assert not mean.requires_grad and not rstd.requires_grad and not bits.requires_grad
    assert bits.dtype == torch.uint8 and bits.shape == (0,)  # no dropout: no keep bits
    assert not ops.bias_dropout_add_layer_norm(x, None, r, w, b, 0.5, 1e-5, 1, 2)[4].requires_grad
    pre.sum().backward()  # only pre_norm used: out's gradient is taken as zero
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))
    assert torch.equal(w.grad, torch.zeros_like(w))
    y, s, rstd = ops.add_rms_norm(x.detach(), r, w, 1e-6)
    assert not rstd.requires_grad
    (gr,) = torch.autograd.grad(s.sum(), r)
    assert torch.equal(gr, torch.ones_like(r))


def test_dropout_is_its_own_derivative():
    g = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g: ops.dropout(g, 0.3, 4, 9), (g,))
    assert torch.autograd.gradgradcheck(lambda g: ops.dropout(g, 0.3, 4, 9), (g,))


# ---- float64 gradcheck -------------------------------------------------------------------------------------------


def test_gradcheck_float64():
    def t(*shape, grad=True):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)

    x, r, w, b = t(4, 6), t(4, 6), t(6), t(6)
    checks = [
        (lambda x, b: ops.bias_gelu(x, b, "none"), (x, b)),
        (lambda x, b: ops.bias_gelu(x, b, "tanh"), (x, b)),
        (lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.4, 1, 2), (x, b, r)),
        (lambda x, b, r, w, lb: ops.bias_dropout_add_layer_norm(x, b, r, w, lb, 0.4, 1e-5, 1, 2)[:2], (x, b, r, w, b)),
        (lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5)[:2], (x, r, w, b)),
        (lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6)[:2], (x, r, w)),
        (ops.swiglu, (x, r)),
        (lambda g, u: ops.geglu(g, u, "tanh"), (x, r)),
        (lambda g, u: ops.geglu(g, u, "none"), (x, r)),
        (ops.rotary, (t(2, 3, 5, 4), t(1, 5, 4), t(1, 5, 4))),
    ]
    for fn, args in checks:
        assert torch.autograd.gradcheck(fn, args), fn


@requires_cuda
@pytest.mark.cuda
def test_cuda_rejects_float64_clearly():
    with pytest.raises(RuntimeError, match="CUDA kernels support float32, float16 and bfloat16"):
        ops.swiglu(torch.ones(3, device="cuda", dtype=torch.float64), torch.ones(3, device="cuda", dtype=torch.float64))
