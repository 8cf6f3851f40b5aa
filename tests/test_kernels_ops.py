"""Tests of the fused-layer kernels (torch.ops.ckpt_ext, wrapped by ckpt_ext.ops): the elementwise ops and the
row-wise norms against their references. Dropout: test_kernels_dropout.py; opcheck, autograd registration and
gradcheck: test_kernels_registration.py.

Every op is compared, forward and backward (through its registered autograd, which calls the
``*_backward`` op), with a plain-PyTorch reference (helpers/kernel_refs.py), on odd shapes and in float32, bfloat16 and
float16:

* float32: against a float64 reference, to about 1e-5 relative to the output's magnitude;
* bfloat16 / float16 (flash-attention's scheme): the kernel's max error against a float64 reference
  computed from the same low-precision inputs must be at most 2x (outputs) or 3x (gradients) the max
  error of PyTorch running the reference in that low precision, plus a tiny atol.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ckpt_ext import ops

from helpers.devices import DEVICES
from helpers.kernel_refs import (_acc, assert_matches_reference, randn_on, ref_add_layer_norm, ref_bias_dropout_add,
                                 ref_bias_dropout_add_layer_norm, ref_bias_gelu, ref_rms_norm, ref_rotary,
                                 ref_geglu, ref_row_stats, ref_swiglu)
from helpers.kernel_fixtures import DTYPES, _seed  # noqa: F401  (an autouse fixture)

# (rows..., hidden): odd sizes on purpose, hidden from 1 to 1000, one 3-D input, and the model widths the
# CUDA kernels specialise for (BERT-large 1024, Llama/GPT 4096 and 8192) with few rows, cheap on CPU.
ROW_SHAPES = [(1, 1), (37, 72), (3, 129), (129, 3), (1000, 72), (2, 1000), (2, 5, 72), (3, 1024), (2, 4096),
              (1, 8192)]
ROW_SHAPE_IDS = ["x".join(map(str, s)) for s in ROW_SHAPES]


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
@pytest.mark.parametrize("shape", ROW_SHAPES + [(3001, 72), (9, 4097), (0, 64)],
                         ids=ROW_SHAPE_IDS + ["3001x72", "9x4097", "0x64"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_backward_sums_the_bias_gradient(device, dtype, shape, approximate):
    """grad_bias=True: grad_x bit for bit as without, and the bias's gradient = grad_x's column sums (of the
    stored values, accumulated in float: within (rows - 1) * 2^-24 * sum |grad_x| plus the final rounding),
    the same bits on a second call (a fixed order)."""
    x = randn_on(*shape, dtype=dtype, device=device, scale=2.0, requires_grad=False)
    b = randn_on(shape[-1], dtype=dtype, device=device, requires_grad=False)
    g = randn_on(*shape, dtype=dtype, device=device, requires_grad=False)
    gx = ops.bias_gelu_backward(g, x, b, approximate)
    gx2, gb = ops.bias_gelu_backward(g, x, b, approximate, grad_bias=True)
    assert torch.equal(gx2, gx)
    assert gb.shape == (shape[-1],) and gb.dtype == dtype and gb.device == gx.device
    flat = gx.reshape(-1, shape[-1]).double()
    ref = flat.sum(0)
    bound = max(flat.shape[0] - 1, 1) * 2.0**-24 * flat.abs().sum(0) + torch.finfo(dtype).eps * ref.abs()
    assert bool(((gb.double() - ref).abs() <= bound + 1e-30).all())
    assert torch.equal(ops.bias_gelu_backward(g, x, b, approximate, grad_bias=True)[1], gb)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES + [(4, 3, 1000)], ids=ROW_SHAPE_IDS + ["4x3x1000"])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_geglu(device, dtype, shape, approximate):
    gate = randn_on(*shape, dtype=dtype, device=device, scale=2.0)
    up = randn_on(*shape, dtype=dtype, device=device)
    g = randn_on(*shape, dtype=dtype, device=device, requires_grad=False)
    assert_matches_reference(lambda a, b: ops.geglu(a, b, approximate), lambda a, b: ref_geglu(a, b, approximate),
                             [gate, up], [g], (["out"], ["gate", "up"]))


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
    _, pre_norm, mean, rstd, _ = ops.bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p, eps, seed,
                                                                 offset)
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
