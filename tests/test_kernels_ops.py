"""Tests of the fused-layer kernels (torch.ops.ckpt_ext, wrapped by ckpt_ext.ops).

Every op is compared, forward and backward (through its registered autograd, which calls the
``*_backward`` op), with a plain-PyTorch reference (helpers/kernel_refs.py), on odd shapes and in float32, bfloat16 and
float16:

* float32: against a float64 reference, to about 1e-5 relative to the output's magnitude;
* bfloat16 / float16 (flash-attention's scheme): the kernel's max error against a float64 reference
  computed from the same low-precision inputs must be at most 2x (outputs) or 3x (gradients) the max
  error of PyTorch running the reference in that low precision, plus a tiny atol.

Dropout is tested for its rate, determinism, prefix property, agreement with an independent Philox
implementation written here, and for forward and backward using the same mask. ``opcheck`` and float64
``gradcheck`` run on every op. CUDA tests are the same tests on device "cuda" (skipped without a GPU),
plus CPU == CUDA for the dropout masks and the outputs.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import ckpt_ext
from ckpt_ext import ops

from helpers.devices import DEVICES, requires_cuda
from helpers.kernel_refs import (assert_matches_reference, philox4x32_10, randn_on, ref_add_layer_norm,
                                 ref_bias_dropout_add, ref_bias_dropout_add_layer_norm, ref_bias_gelu, ref_dropout,
                                 ref_rms_norm, ref_rotary, ref_row_stats, ref_swiglu, reference_dropout_mask)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows..., hidden): odd sizes on purpose, hidden from 1 to 1000, one 3-D input, and the model widths the
# CUDA kernels specialise for (BERT-large 1024, Llama/GPT 4096 and 8192) with few rows, cheap on CPU.
ROW_SHAPES = [(1, 1), (37, 72), (3, 129), (129, 3), (1000, 72), (2, 1000), (2, 5, 72), (3, 1024), (2, 4096),
              (1, 8192)]
ROW_SHAPE_IDS = ["x".join(map(str, s)) for s in ROW_SHAPES]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_ops_come_from_this_checkout():
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.dirname(os.path.dirname(os.path.abspath(ckpt_ext.__file__))) == here


# ---- dropout -----------------------------------------------------------------------------------------------


def test_philox_reference_known_answers():
    """The test's Philox is the Random123 one (its known-answer vectors), so it can specify the kernels' masks."""
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((_MASK32,) * 4, (_MASK32, _MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in kat:
        got = philox4x32_10(tuple(torch.tensor([c]) for c in counter), key)
        assert tuple(int(w) for w in got) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,offset", [(0, 0), (1234, 5), (2**40 + 7, 2**33 + 1), (-1, 3), (7, -2)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_dropout_mask_matches_specification(device, seed, offset, p):
    mask = ops.dropout_mask(1001, p, seed, offset, device)
    assert mask.dtype == torch.bool and mask.shape == (1001,) and mask.device.type == device
    assert torch.equal(mask.cpu(), reference_dropout_mask(1001, p, seed, offset))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_rate(device, p):
    n = 1 << 20
    for seed, offset in [(0, 0), (17, 3)]:
        rate = 1.0 - ops.dropout_mask(n, p, seed, offset, device).double().mean().item()
        assert abs(rate - p) <= 5 * math.sqrt(p * (1 - p) / n), f"drop rate {rate} for p={p}"


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_mask_determinism_and_prefix(device):
    m = ops.dropout_mask(4099, 0.5, 42, 7, device)
    assert torch.equal(m, ops.dropout_mask(4099, 0.5, 42, 7, device))
    assert not torch.equal(m, ops.dropout_mask(4099, 0.5, 42, 8, device))
    assert not torch.equal(m, ops.dropout_mask(4099, 0.5, 43, 7, device))
    for n in (1, 3, 37, 1000, 4098):  # element i's flag does not depend on numel
        assert torch.equal(ops.dropout_mask(n, 0.5, 42, 7, device), m[:n])
    assert ops.dropout_mask(0, 0.5, 42, 7, device).shape == (0,)
    assert bool(ops.dropout_mask(100, 0.0, 1, 2, device).all())
    assert not bool(ops.dropout_mask(100, 1.0, 1, 2, device).any())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 72), (3, 129), (5, 1)])
def test_dropout_forward_and_backward_use_the_same_mask(device, dtype, shape):
    p, seed, offset = 0.3, 99, 12
    numel = math.prod(shape)
    mask = ops.dropout_mask(numel, p, seed, offset, device).reshape(shape)
    ones = torch.ones(shape, dtype=dtype, device=device)
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    scale = torch.tensor(1 / (1 - p), dtype=dtype).item()
    fwd = ops.bias_dropout_add(ones, None, zeros, p, seed, offset)
    assert torch.equal(fwd != 0, mask)
    assert torch.all(fwd[mask] == scale)
    bwd = ops.dropout(ones, p, seed, offset)
    assert torch.equal(bwd, fwd)
    # The same mask through autograd of bias_dropout_add, and inside the fused LayerNorm.
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    ops.bias_dropout_add(x, None, zeros, p, seed, offset).backward(ones)
    assert torch.equal(x.grad, fwd)
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    out, pre, mean, rstd = ops.bias_dropout_add_layer_norm(ones, None, zeros, w, None, p, 1e-5, seed, offset)
    assert torch.equal(pre, fwd)
    g = torch.randn(shape, dtype=dtype, device=device)
    grad_x, grad_res, _, _ = ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, p, seed, offset)
    assert torch.equal(grad_x == 0, ~mask | (grad_res == 0))
    rtol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad_x, ref_dropout(grad_res, mask, p), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_p_zero_and_one(device):
    x = torch.randn(7, 9, device=device)
    r = torch.randn(7, 9, device=device)
    torch.testing.assert_close(ops.bias_dropout_add(x, None, r, 0.0, 1, 2), x + r)
    torch.testing.assert_close(ops.bias_dropout_add(x, None, r, 1.0, 1, 2), r)
    assert torch.equal(ops.dropout(x, 0.0, 1, 2), x)
    assert torch.equal(ops.dropout(x, 1.0, 1, 2), torch.zeros_like(x))


# ---- elementwise ops ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_SHAPE_IDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(device, dtype, shape, approximate, with_bias):
    x = randn_on(*shape, dtype=dtype, device=device, scale=2.0)
    bias = randn_on(shape[-1], dtype=dtype, device=device) if with_bias else None
    g = randn_on(*shape, dtype=dtype, device=device, requires_grad=False)
    assert_matches_reference(
        lambda x, b: ops.bias_gelu(x, b, approximate),
        lambda x, b: ref_bias_gelu(x, b, approximate),
        [x, bias],
        [g],
        (["out"], ["x", "bias"] if with_bias else ["x"]),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_SHAPE_IDS)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_bias_dropout_add(device, dtype, shape, p):
    seed, offset = 2024, 3
    x = randn_on(*shape, dtype=dtype, device=device)
    bias = randn_on(shape[-1], dtype=dtype, device=device)
    residual = randn_on(*shape, dtype=dtype, device=device)
    mask = ops.dropout_mask(math.prod(shape), p, seed, offset, device).reshape(shape)
    g = randn_on(*shape, dtype=dtype, device=device, requires_grad=False)
    assert_matches_reference(
        lambda x, b, r: ops.bias_dropout_add(x, b, r, p, seed, offset),
        lambda x, b, r: ref_bias_dropout_add(x, b, r, mask, p),
        [x, bias, residual],
        [g],
        (["out"], ["x", "bias", "residual"]),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES + [(4, 3, 1000)], ids=ROW_SHAPE_IDS + ["4x3x1000"])
def test_swiglu(device, dtype, shape):
    gate = randn_on(*shape, dtype=dtype, device=device, scale=2.0)
    up = randn_on(*shape, dtype=dtype, device=device)
    g = randn_on(*shape, dtype=dtype, device=device, requires_grad=False)
    assert_matches_reference(ops.swiglu, ref_swiglu, [gate, up], [g], (["out"], ["gate", "up"]))


ROTARY_CASES = [
    # (B, H, S, D), cos batch (1, B or None for [S, D]), x given as a transposed [B, S, H, D] view?
    ((1, 1, 1, 2), 1, False),
    ((2, 3, 37, 72), 2, False),
    ((2, 3, 37, 72), 1, True),
    ((3, 2, 129, 16), None, True),
    ((1, 4, 5, 128), 1, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROTARY_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-cos{c[1]}-{c[2]}")
def test_rotary(device, dtype, case):
    (B, H, S, D), cos_batch, transposed = case
    if transposed:  # q = q_proj(h).view(B, S, H, D).transpose(1, 2), as in Llama attention
        x = randn_on(B, S, H, D, dtype=dtype, device=device, requires_grad=False).transpose(1, 2).requires_grad_()
    else:
        x = randn_on(B, H, S, D, dtype=dtype, device=device)
    pos = torch.arange(S, dtype=torch.float32)[:, None] * (1e-2 ** (torch.arange(D // 2) / (D // 2)))[None]
    emb = torch.cat((pos, pos), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if cos_batch is not None:
        cos, sin = cos.expand(cos_batch, S, D) + 0, sin.expand(cos_batch, S, D) + 0
    cos, sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    g = randn_on(B, H, S, D, dtype=dtype, device=device, requires_grad=False)
    assert_matches_reference(ops.rotary, ref_rotary, [x, cos, sin], [g], (["out"], ["x"]))
    out = ops.rotary(x.detach(), cos, sin)
    assert out.stride() == torch.empty_like(x).stride()  # laid out like x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_general_tables_and_their_gradients(device, dtype):
    """Random cos/sin whose halves differ: catches a backward written as forward(-sin), which is exact
    only for Hugging Face tables (cos[j] == cos[j + D/2])."""
    x = randn_on(2, 3, 5, 8, dtype=dtype, device=device)
    cos = randn_on(1, 5, 8, dtype=dtype, device=device)
    sin = randn_on(1, 5, 8, dtype=dtype, device=device)
    g = randn_on(2, 3, 5, 8, dtype=dtype, device=device, requires_grad=False)
    assert_matches_reference(ops.rotary, ref_rotary, [x, cos, sin], [g], (["out"], ["x", "cos", "sin"]))


# ---- row-wise norms -----------------------------------------------------------------------------------------

def assert_row_stats_match(x, mean, rstd, eps):
    """mean/rstd must be the statistics of the pre-norm tensor the kernel stored (backward relies on it).

    Compared with x itself rather than with a float64 reference: in low precision the statistics of a
    few rounded values are ill-conditioned (hidden=3), and what matters is that they describe x."""
    ref_mean, ref_rstd = ref_row_stats(x.double(), eps) if mean is not None else (None, None)
    if mean is None:  # RMSNorm
        ref_rstd = torch.rsqrt(x.double().pow(2).mean(-1) + eps)
    else:
        assert mean.dtype == _acc(x) and mean.shape == x.shape[:-1]
        torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-6 * (1 + x.abs().max().item()))
    assert rstd.dtype == _acc(x) and rstd.shape == x.shape[:-1]
    torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_SHAPE_IDS)
@pytest.mark.parametrize("p,with_biases", [(0.1, True), (0.0, False)])
def test_bias_dropout_add_layer_norm(device, dtype, shape, p, with_biases):
    seed, offset, eps = 11, 2**35 + 1, 1e-5
    hidden = shape[-1]
    x = randn_on(*shape, dtype=dtype, device=device)
    bias = randn_on(hidden, dtype=dtype, device=device) if with_biases else None
    residual = randn_on(*shape, dtype=dtype, device=device, scale=2.0)
    weight = randn_on(hidden, dtype=dtype, device=device)
    ln_bias = randn_on(hidden, dtype=dtype, device=device) if with_biases else None
    mask = ops.dropout_mask(math.prod(shape), p, seed, offset, device).reshape(shape)
    grads = [randn_on(*shape, dtype=dtype, device=device, requires_grad=False) for _ in range(2)]
    grad_names = ["x", "bias", "residual", "weight", "ln_bias"] if with_biases else ["x", "residual", "weight"]
    assert_matches_reference(
        lambda x, b, r, w, lb: ops.bias_dropout_add_layer_norm(x, b, r, w, lb, p, eps, seed, offset)[:2],
        lambda x, b, r, w, lb: ref_bias_dropout_add_layer_norm(x, b, r, w, lb, mask, p, eps)[:2],
        [x, bias, residual, weight, ln_bias],
        grads,
        (["out", "pre_norm"], grad_names),
    )
    _, pre_norm, mean, rstd = ops.bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p, eps, seed, offset)
    assert_row_stats_match(pre_norm, mean, rstd, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_SHAPE_IDS)
@pytest.mark.parametrize("with_residual,with_bias", [(True, True), (False, False)])
def test_add_layer_norm(device, dtype, shape, with_residual, with_bias):
    hidden, eps = shape[-1], 1e-5
    x = randn_on(*shape, dtype=dtype, device=device, scale=3.0)
    residual = randn_on(*shape, dtype=dtype, device=device) if with_residual else None
    weight = randn_on(hidden, dtype=dtype, device=device)
    bias = randn_on(hidden, dtype=dtype, device=device) if with_bias else None
    grads = [randn_on(*shape, dtype=dtype, device=device, requires_grad=False) for _ in range(2)]
    grad_names = ["x"] + (["residual"] if with_residual else []) + ["weight"] + (["bias"] if with_bias else [])
    assert_matches_reference(
        lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, eps)[:2],
        lambda x, r, w, b: ref_add_layer_norm(x, r, w, b, eps)[:2],
        [x, residual, weight, bias],
        grads,
        (["out", "sum"], grad_names),
    )
    _, s, mean, rstd = ops.add_layer_norm(x, residual, weight, bias, eps)
    assert_row_stats_match(s, mean, rstd, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=ROW_SHAPE_IDS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(device, dtype, shape, with_residual):
    hidden, eps = shape[-1], 1e-6
    x = randn_on(*shape, dtype=dtype, device=device, scale=3.0)
    residual = randn_on(*shape, dtype=dtype, device=device) if with_residual else None
    weight = randn_on(hidden, dtype=dtype, device=device)
    grads = [randn_on(*shape, dtype=dtype, device=device, requires_grad=False) for _ in range(2)]
    grad_names = ["x"] + (["residual"] if with_residual else []) + ["weight"]
    assert_matches_reference(
        lambda x, r, w: ops.add_rms_norm(x, r, w, eps)[:2],
        lambda x, r, w: ref_rms_norm(x, r, w, eps)[:2],
        [x, residual, weight],
        grads,
        (["out", "sum"], grad_names),
    )
    _, s, rstd = ops.add_rms_norm(x, residual, weight, eps)
    assert_row_stats_match(s, None, rstd, eps)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_outputs_used_alone(device):
    """Gradients flow when only `out` or only `sum` is used (the other output's gradient is None)."""
    x = torch.randn(6, 10, device=device, requires_grad=True)
    w = torch.randn(10, device=device, requires_grad=True)
    out, s, _ = ops.add_rms_norm(x, None, w, 1e-6)
    s.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    assert w.grad is None or torch.all(w.grad == 0)
    x.grad = None
    out, s, mean, rstd = ops.add_layer_norm(x, None, w, None, 1e-5)
    assert not mean.requires_grad and not rstd.requires_grad
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    x = torch.randn(72, 37, device=device).t()  # [37, 72], not contiguous
    r = torch.randn(72, 37, device=device).t()
    w = torch.randn(72, device=device)
    torch.testing.assert_close(ops.bias_gelu(x, None), F.gelu(x))
    torch.testing.assert_close(ops.swiglu(x, r), ref_swiglu(x, r))
    torch.testing.assert_close(ops.add_rms_norm(x, r, w, 1e-6)[0], ref_rms_norm(x, r, w, 1e-6)[0])
    out = ops.add_layer_norm(x, r, w, None, 1e-5)[0]
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref_add_layer_norm(x, r, w, None, 1e-5)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    x = torch.empty(0, 8, device=device)
    w = torch.ones(8, device=device)
    assert ops.bias_gelu(x, None).shape == (0, 8)
    out, s, mean, rstd = ops.add_layer_norm(x, None, w, None, 1e-5)
    assert out.shape == (0, 8) and mean.shape == (0,)
    _, gw, gb = ops.add_layer_norm_backward(x, None, s, w, mean, rstd)
    assert torch.equal(gw, torch.zeros(8, device=device)) and torch.equal(gb, torch.zeros(8, device=device))
    out, s, rstd = ops.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(ops.add_rms_norm_backward(x, None, s, w, rstd)[1], torch.zeros(8, device=device))


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
    return [
        (L.bias_gelu.default, (x, b, "none")),
        (L.bias_gelu.default, (x, None, "tanh")),
        (L.bias_gelu_backward.default, (g, x.detach(), b.detach(), "tanh")),
        (L.bias_dropout_add.default, (x, b, r, 0.3, 5, 7)),
        (L.bias_dropout_add.default, (x, None, r, 0.0, 5, 7)),
        (L.dropout.default, (g, 0.3, 5, 7)),
        (L.dropout_mask.default, (37, 0.3, 5, 7, torch.device(device))),
        (L.bias_dropout_add_layer_norm.default, (x, b, r, w, b, 0.2, 1e-5, 3, 4)),
        (L.bias_dropout_add_layer_norm.default, (x, None, r, w, None, 0.0, 1e-5, 3, 4)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, g, s, w.detach(), mean, rstd, 0.2, 3, 4)),
        (L.bias_dropout_add_layer_norm_backward.default, (g, None, s, w.detach(), mean, rstd, 0.0, 3, 4)),
        (L.add_layer_norm.default, (x, r, w, b, 1e-5)),
        (L.add_layer_norm.default, (x, None, w, None, 1e-5)),
        (L.add_layer_norm_backward.default, (g, g, s, w.detach(), mean, rstd)),
        (L.add_rms_norm.default, (x, r, w, 1e-6)),
        (L.add_rms_norm.default, (x, None, w, 1e-6)),
        (L.add_rms_norm_backward.default, (g, None, s, w.detach(), rstd)),
        (L.swiglu.default, (x, r)),
        (L.swiglu_backward.default, (g, x.detach(), r.detach())),
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

_FORWARD_OPS = ["bias_gelu", "bias_dropout_add", "dropout", "bias_dropout_add_layer_norm", "add_layer_norm",
                "add_rms_norm", "swiglu", "rotary"]


@pytest.mark.parametrize("name", _FORWARD_OPS)
def test_autograd_kernel_is_registered_in_cpp(name):
    dump = torch._C._dispatch_dump(f"ckpt_ext::{name}")
    autograd = [line for line in dump.splitlines() if line.startswith("Autograd")]
    assert len(autograd) == 1 and "csrc/ops/autograd.cpp" in autograd[0], dump


def test_autograd_nodes_are_cpp_functions():
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    for out in [ops.bias_gelu(x, w), ops.swiglu(x, x), ops.add_rms_norm(x, None, w)[0],
                ops.bias_dropout_add_layer_norm(x, w, x, w, w, 0.2, 1e-5, 1, 2)[0]]:
        assert type(out.grad_fn).__name__ == "CppFunction"


def test_non_differentiable_outputs_and_unused_grads():
    x, r = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6)
    out, pre, mean, rstd = ops.bias_dropout_add_layer_norm(x, None, r, w, b, 0.0, 1e-5, 1, 2)
    assert not mean.requires_grad and not rstd.requires_grad
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
        (ops.rotary, (t(2, 3, 5, 4), t(1, 5, 4), t(1, 5, 4))),
    ]
    for fn, args in checks:
        assert torch.autograd.gradcheck(fn, args), fn


# ---- CUDA == CPU -----------------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("numel", [1, 3, 1001, 1 << 20])
def test_cpu_and_cuda_draw_the_same_mask(numel):
    for p, seed, offset in [(0.1, 0, 0), (0.5, 2**40 + 3, 2**33 + 9), (0.7, -5, 1)]:
        cuda = ops.dropout_mask(numel, p, seed, offset, "cuda").cpu()
        assert torch.equal(cuda, ops.dropout_mask(numel, p, seed, offset, "cpu"))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 72), (3, 129), (129, 3), (2, 1001)])
def test_cuda_dropout_kernels_match_cpu(dtype, shape):
    """The fused kernels apply the same mask on both devices (compared through the dropped pattern)."""
    p, seed, offset = 0.25, 123, 456
    x = torch.randn(shape).to(dtype) + 3.0  # never zero, so zeros in the output are exactly the dropped elements
    zeros = torch.zeros(shape, dtype=dtype)
    w = torch.ones(shape[-1], dtype=dtype)
    cpu = ops.bias_dropout_add(x, None, zeros, p, seed, offset)
    cuda = ops.bias_dropout_add(x.cuda(), None, zeros.cuda(), p, seed, offset).cpu()
    assert torch.equal(cpu == 0, cuda == 0)
    torch.testing.assert_close(cuda, cpu)
    pre_cpu = ops.bias_dropout_add_layer_norm(x, None, zeros, w, None, p, 1e-5, seed, offset)[1]
    pre_cuda = ops.bias_dropout_add_layer_norm(x.cuda(), None, zeros.cuda(), w.cuda(), None, p, 1e-5, seed, offset)[1]
    assert torch.equal(pre_cpu == 0, pre_cuda.cpu() == 0)
    grad_cuda = ops.dropout(x.cuda(), p, seed, offset).cpu()
    assert torch.equal(ops.dropout(x, p, seed, offset) == 0, grad_cuda == 0)


@requires_cuda
@pytest.mark.cuda
def test_cuda_rejects_float64_clearly():
    with pytest.raises(RuntimeError, match="CUDA kernels support float32, float16 and bfloat16"):
        ops.swiglu(torch.ones(3, device="cuda", dtype=torch.float64), torch.ones(3, device="cuda", dtype=torch.float64))
