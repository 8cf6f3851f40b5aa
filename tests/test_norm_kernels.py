"""The row-wise norm kernels (csrc/kernels/cuda/norms*.cu*) at the shapes that matter and at odd ones.

Each op's forward op and its ``*_backward`` op are called directly (what the fused layers and the
bandwidth script call) and compared with a float64 reference computed from the same inputs, with
flash-attention's scheme: the kernel's max error must be at most 2x (outputs) or 3x (gradients) the max
error of PyTorch eager running the reference in the kernel's dtype, plus a small atol (one rounding at the
output's scale, at least 1e-5 * (1 + max |ref|)).
The numerical tests run on aligned tensors and on views one element into their storage (the CUDA kernels'
element-by-element path; a misaligned 16-byte access would fault). Dropout masks must equal the CPU kernel's (the Philox mapping of csrc/kernels/philox.h), forward and
backward, on the 16-byte path and on the element-by-element path (odd hidden, misaligned views).

The same tests run on the CPU kernels at small shapes (they check the harness itself, and that the CPU
kernels agree with the reference); the CUDA cases are skipped without a GPU. A pure-Python emulation of the
CUDA kernels' thread -> column mapping checks that every column is owned exactly once at every hidden size.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ckpt_ext import ops

from helpers.cuda_shapes import MIXED_HIDDENS  # noqa: E402
from helpers.devices import requires_cuda  # noqa: E402
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, hidden): the model sizes (1024/4096/8192), odd hidden (element-by-element path), hidden % 8 == 4
# (1028, 6004: 16-byte path for float, element by element for 16-bit types), hidden just past a launch
# bucket (1025, 2049, 4097), backward's widest bucket (6000, 6004, 8192), past the register-resident limit of
# 8192 (multi-pass kernels), one row (three idle warps in a four-row block), no rows, rows up to 4097; 72, 200,
# 201, 302, 384, 999, 1536: the launch buckets (16-byte or element by element) the others miss, so that every
# register kernel instantiation runs (test_cuda_tests_reach_every_register_bucket).
CUDA_SHAPES = [(4097, 1024), (1000, 4096), (257, 8192), (1, 1), (3, 7), (129, 33), (4097, 1000), (2, 1025),
               (1, 1024), (7, 1028), (33, 2049), (65, 4097), (9, 6000), (9, 6004), (5, 8193), (1, 8193),
               (3, 12288), (0, 1024), (37, 72), (6, 200), (5, 201), (37, 302), (259, 384), (3, 999), (17, 1536)]
CPU_SHAPES = [(1, 1), (3, 7), (129, 33), (4, 1000), (2, 1025), (0, 7)]
SHAPES = [pytest.param("cpu", s, id=f"cpu-{s[0]}x{s[1]}") for s in CPU_SHAPES] + [
    pytest.param("cuda", s, id=f"cuda-{s[0]}x{s[1]}", marks=[requires_cuda, pytest.mark.cuda]) for s in CUDA_SHAPES
]
SEED, OFFSET = 1234, 2**33 + 5


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _randn(*shape, dtype, device, scale=1.0, offset=0):
    """Random values; offset > 0: a view `offset` elements into its storage (a row pointer that is not
    16-byte aligned, which takes the CUDA kernels off their 16-byte path)."""
    values = (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)
    if not offset:
        return values
    storage = torch.empty(values.numel() + offset, dtype=dtype, device=device)
    view = storage[offset:].view(values.shape)
    view.copy_(values)
    return view


def _check_bias_sum(got, gx):
    """got: the column sums of gx's stored values, accumulated in float and rounded once to gx's dtype. Bound:
    a float sum of n terms is within (n - 1) * 2**-24 * sum |x| of the exact one, plus the final rounding."""
    assert got.shape == gx.shape[-1:] and got.dtype == gx.dtype and got.device == gx.device
    rows = gx.shape[0]
    ref = gx.double().sum(0)
    bound = max(rows - 1, 1) * 2.0**-24 * gx.double().abs().sum(0) + torch.finfo(gx.dtype).eps * ref.abs()
    err = (got.double() - ref).abs()
    assert bool((err <= bound + 1e-30).all()), f"bias gradient off by {(err - bound).max().item()} beyond the bound"


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_torch_error(name, got, ref64, torch_lowp):
    """|got - ref64| <= factor * |torch_lowp - ref64| + atol (max over elements), atol = the larger of
    1e-5 * (1 + max |ref64|) and one unit roundoff of the dtype at max |ref64|: with a few rows or columns
    torch's own max error is a noisy yardstick (it can be luckily small), one rounding at the output's scale is not."""
    assert got.shape == ref64.shape and got.dtype == torch_lowp.dtype, f"{name}: {got.shape} {got.dtype}"
    factor = 3.0 if name.startswith("grad") else 2.0
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    atol = max(1e-5 * (1.0 + scale), torch.finfo(got.dtype).eps / 2 * scale)
    err, pt_err = _max_err(got, ref64), _max_err(torch_lowp, ref64)
    assert err <= factor * pt_err + atol, f"{name} ({got.dtype}): error {err:.3g} > {factor} x torch's {pt_err:.3g} + {atol:.2g}"


def _grads(ref_fn, inputs, grad_outputs, dtype):
    """Outputs of ref_fn on copies of inputs in `dtype` and the gradients of sum(out_k * grad_k) wrt them."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    outs = ref_fn(*leaves)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(outs, present, [g.to(dtype) for g in grad_outputs])
    return [o.detach() for o in outs], list(grads)


def _compare(names, got, ref_fn, inputs, grad_outputs, skip_grads=()):
    """Compares got (outputs, then the gradients of the present inputs, less those at skip_grads)."""
    ref64, ref64_grads = _grads(ref_fn, inputs, grad_outputs, torch.float64)
    lowp, lowp_grads = _grads(ref_fn, inputs, grad_outputs, got[0].dtype)
    ref64_grads = [g for i, g in enumerate(ref64_grads) if i not in skip_grads]
    lowp_grads = [g for i, g in enumerate(lowp_grads) if i not in skip_grads]
    assert len(names) == len(got) == len(ref64) + len(ref64_grads)
    for name, g, r, t in zip(names, got, ref64 + ref64_grads, lowp + lowp_grads):
        assert_within_torch_error(name, g, r, t)


def cpu_mask(rows, hidden, p):
    """The CPU kernel's dropout mask for (SEED, OFFSET): the mask every device must draw."""
    return ops.dropout_mask(rows * hidden, p, SEED, OFFSET, "cpu").reshape(rows, hidden)


def ref_layer_norm(x, bias, residual, weight, ln_bias, mask, p):
    h = x if bias is None else x + bias
    if mask is not None:
        h = h * mask.to(h.dtype) * (1.0 / (1.0 - p))
    s = h if residual is None else h + residual
    return F.layer_norm(s, (s.shape[-1],), weight, ln_bias, 1e-5), s


def ref_rms_norm(x, residual, weight):
    """Hugging Face LlamaRMSNorm after a residual add (float32 statistics for low-precision inputs)."""
    s = x if residual is None else x + residual
    h = s.to(torch.float64 if s.dtype == torch.float64 else torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(s.dtype), s


def assert_stats_describe(s, mean, rstd, eps):
    """mean / rstd are float32 statistics of the stored pre-norm tensor (the layout backward reads)."""
    h = s.double()
    assert rstd.dtype == torch.float32 or s.dtype == torch.float64
    assert rstd.shape == s.shape[:-1]
    if mean is not None:
        assert mean.shape == s.shape[:-1]
        scale = h.abs().max().item() if h.numel() else 0.0
        torch.testing.assert_close(mean.double(), h.mean(-1), rtol=1e-5, atol=1e-6 * (1 + scale))
        want = torch.rsqrt(h.var(-1, unbiased=False) + eps)
    else:
        want = torch.rsqrt(h.pow(2).mean(-1) + eps)
    torch.testing.assert_close(rstd.double(), want, rtol=1e-5, atol=0.0)


# ---- LayerNorm ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device,shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_bias_dropout_add_layer_norm(device, shape, dtype, p, offset):
    rows, hidden = shape
    randn = lambda *size, scale=1.0: _randn(*size, dtype=dtype, device=device, scale=scale, offset=offset)  # noqa: E731
    x, r = randn(rows, hidden), randn(rows, hidden, scale=2)
    b, w, lb = (randn(hidden) for _ in range(3))
    g_out, g_pre = randn(rows, hidden), randn(rows, hidden)
    out, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(x, b, r, w, lb, p, 1e-5, SEED, OFFSET)
    gx, gr, gw, glb = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED, OFFSET)
    # the mask read from the forward's keep bits (CPU with dropout; empty elsewhere): bit for bit the same
    for a, b_ in zip(ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED, OFFSET, bits),
                     (gx, gr, gw, glb)):
        assert torch.equal(a, b_)
    mask = cpu_mask(rows, hidden, p).to(device) if p > 0 else None
    if mask is not None:  # backward dropped exactly the CPU mask's elements (grad_x = grad_residual * mask * scale)
        assert torch.equal(gx != 0, mask & (gr != 0))
    # grad_bias=True: the same four outputs bit for bit, and the dense bias's gradient summed in the kernel's
    # pass (the 16-slot backward kernels on CUDA; wider rows: ATen's sum after the kernel; multi-pass: its own)
    *four, gb = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED, OFFSET, bits,
                                                         grad_bias=True)
    for a, b_ in zip(four, (gx, gr, gw, glb)):
        assert torch.equal(a, b_)
    _check_bias_sum(gb, gx)
    again = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED, OFFSET, bits,
                                                     grad_bias=True)[4]
    assert torch.equal(again, gb)  # a fixed order: the same bits run to run
    _compare(["out", "pre_norm", "grad_x", "grad_residual", "grad_weight", "grad_ln_bias"],
             [out, pre, gx, gr, gw, glb],
             lambda x, b, r, w, lb: ref_layer_norm(x, b, r, w, lb, mask, p), [x, b, r, w, lb], [g_out, g_pre],
             skip_grads=(1,))
    assert_stats_describe(pre, mean, rstd, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device,shape", SHAPES)
@pytest.mark.parametrize("with_residual,with_bias,with_grad_sum", [(True, True, True), (False, False, False)])
def test_add_layer_norm(device, shape, dtype, with_residual, with_bias, with_grad_sum):
    rows, hidden = shape
    x = _randn(rows, hidden, dtype=dtype, device=device, scale=3)
    r = _randn(rows, hidden, dtype=dtype, device=device) if with_residual else None
    w = _randn(hidden, dtype=dtype, device=device)
    b = _randn(hidden, dtype=dtype, device=device) if with_bias else None
    g_out = _randn(rows, hidden, dtype=dtype, device=device)
    g_sum = _randn(rows, hidden, dtype=dtype, device=device) if with_grad_sum else None
    out, s, mean, rstd = ops.add_layer_norm(x, r, w, b, 1e-5)
    g_in, gw, gb = ops.add_layer_norm_backward(g_out, g_sum, s, w, mean, rstd)
    grad_outputs = [g_out, g_sum if with_grad_sum else torch.zeros_like(g_out)]
    inputs = [x, r, w, b]
    names = ["out", "sum", "grad_x"] + (["grad_residual"] if with_residual else []) + ["grad_weight"]
    got = [out, s, g_in] + ([g_in] if with_residual else []) + [gw]
    if with_bias:
        names, got = names + ["grad_bias"], got + [gb]
    else:  # the op still returns the column sums of grad_out (nothing consumes them)
        torch.testing.assert_close(gb.double(), g_out.double().sum(0), rtol=1e-2, atol=1e-2 * math.sqrt(rows))
    _compare(names, got, lambda x, r, w, b: ref_layer_norm(x, None, r, w, b, None, 0.0), inputs, grad_outputs)
    assert_stats_describe(s, mean, rstd, 1e-5)


# ---- RMSNorm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device,shape", SHAPES)
@pytest.mark.parametrize("with_residual,with_grad_sum", [(True, True), (False, False)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_add_rms_norm(device, shape, dtype, with_residual, with_grad_sum, offset):
    rows, hidden = shape
    randn = lambda *size, scale=1.0: _randn(*size, dtype=dtype, device=device, scale=scale, offset=offset)  # noqa: E731
    x = randn(rows, hidden, scale=3)
    r = randn(rows, hidden) if with_residual else None
    w = randn(hidden)
    g_out = randn(rows, hidden)
    g_sum = randn(rows, hidden) if with_grad_sum else None
    out, s, rstd = ops.add_rms_norm(x, r, w, 1e-6)
    g_in, gw = ops.add_rms_norm_backward(g_out, g_sum, s, w, rstd)
    names = ["out", "sum", "grad_x"] + (["grad_residual"] if with_residual else []) + ["grad_weight"]
    got = [out, s, g_in] + ([g_in] if with_residual else []) + [gw]
    grad_outputs = [g_out, g_sum if with_grad_sum else torch.zeros_like(g_out)]
    _compare(names, got, ref_rms_norm, [x, r, w], grad_outputs)
    assert_stats_describe(s, None, rstd, 1e-6)


# ---- dropout masks: bit-identical to the CPU kernel's ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device,shape", SHAPES)
@pytest.mark.parametrize("misaligned", [False, True])
def test_dropout_mask_and_values_equal_the_cpu_kernels(device, shape, dtype, misaligned):
    """With x = 1, no biases and residual = 0, pre_norm = mask * scale; with grad_out = 0 and grad_pre_norm = 1,
    grad_x = mask * scale. Both must be bit-identical to the CPU kernel's. `misaligned` offsets every input by
    one element (a contiguous view), which takes the CUDA kernels off their 16-byte path."""
    rows, hidden = shape
    p = 0.3

    def tensor(fill):
        buf = torch.full((rows * hidden + 1,), fill, dtype=dtype, device=device)
        return (buf[1:] if misaligned else buf[:-1]).view(rows, hidden)

    ones, zeros, w = tensor(1.0), tensor(0.0), torch.ones(hidden, dtype=dtype, device=device)
    _, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(ones, None, zeros, w, None, p, 1e-5, SEED, OFFSET)
    gx = ops.bias_dropout_add_layer_norm_backward(zeros, ones, pre, w, mean, rstd, p, SEED, OFFSET)[0]
    cpu_x, cpu_z, cpu_w = ones.cpu(), zeros.cpu(), w.cpu()
    _, cpu_pre, cpu_mean, cpu_rstd, _ = ops.bias_dropout_add_layer_norm(cpu_x, None, cpu_z, cpu_w, None, p, 1e-5, SEED,
                                                                        OFFSET)
    cpu_gx = ops.bias_dropout_add_layer_norm_backward(cpu_z, cpu_x, cpu_pre, cpu_w, cpu_mean, cpu_rstd, p, SEED, OFFSET)[0]
    mask = cpu_mask(rows, hidden, p)
    assert torch.equal(cpu_pre != 0, mask) and torch.equal(pre.cpu(), cpu_pre)
    assert torch.equal(cpu_gx != 0, mask) and torch.equal(gx.cpu(), cpu_gx)


# ---- keep bits: the CPU forward's mask, one bit per element, read by the backward ------------------------------------


def packed(mask):
    """[*rows, hidden] bool -> uint8 [*rows, ceil(hidden / 8)], bit j % 8 of byte j / 8, zero padding."""
    hidden = mask.shape[-1]
    pad = torch.zeros(*mask.shape[:-1], -hidden % 8, dtype=torch.bool)
    bits = torch.cat([mask, pad], -1).unflatten(-1, (-1, 8)).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])  # float64: the portable loops
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 8), (2, 9), (129, 33), (4, 1000), (3, 1027), (0, 7), (2, 3, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_keep_bits_are_the_mask_and_the_backward_reads_them(shape, dtype, p):
    hidden = shape[-1]
    x, r, g_out, g_pre = (torch.randn(shape, dtype=dtype) for _ in range(4))
    b, w, lb = (torch.randn(hidden, dtype=dtype) for _ in range(3))
    out, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(x, b, r, w, lb, p, 1e-5, SEED, OFFSET)
    mask = cpu_mask(math.prod(shape[:-1]), hidden, p).reshape(shape)
    assert bits.dtype == torch.uint8 and bits.shape == (*shape[:-1], (hidden + 7) // 8)
    assert torch.equal(bits, packed(mask))
    regenerated = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED, OFFSET)
    read = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED, OFFSET, bits)
    for a, b_ in zip(read, regenerated):
        assert torch.equal(a, b_)
    # the bits decide: flipped bits flip which gradients are dropped (the seed no longer matters)
    if bits.numel() and p < 1.0:
        other = ops.bias_dropout_add_layer_norm_backward(g_out, g_pre, pre, w, mean, rstd, p, SEED + 1, OFFSET,
                                                         packed(~mask))[0]
        assert torch.equal(other != 0, ~mask & (read[1] != 0))


def test_keep_bits_only_where_stored():
    x, w = torch.randn(4, 10), torch.randn(10)
    assert ops.bias_dropout_add_layer_norm(x, None, x, w, None, 0.0, 1e-5, 1, 2)[4].shape == (0,)  # no dropout
    with torch.no_grad():  # the op's outputs do not depend on grad mode
        assert ops.bias_dropout_add_layer_norm(x, None, x, w, None, 0.3, 1e-5, 1, 2)[4].shape == (4, 2)


def test_keep_bits_bad_input_says_what_to_pass():
    x, g, w = torch.randn(4, 10), torch.randn(4, 10), torch.randn(10)
    _, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(x, None, x, w, None, 0.3, 1e-5, 1, 2)
    bwd = lambda p, kb: ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, p, 1, 2, kb)  # noqa: E731
    for bad in (bits.to(torch.int32), bits[:, :1], bits[:3], torch.zeros(4, 4, dtype=torch.uint8)[:, ::2]):
        with pytest.raises(RuntimeError, match=r"keep_bits must be the contiguous uint8 tensor of shape \[4, 2\]"):
            bwd(0.3, bad)
    with pytest.raises(RuntimeError, match=r"keep_bits are stored only by the CPU forward with dropout \(p > 0\)"):
        bwd(0.0, bits)
    assert torch.equal(bwd(0.3, torch.empty(0, dtype=torch.uint8))[0], bwd(0.3, None)[0])  # empty: regenerated


def test_autograd_saves_the_keep_bits_not_a_mask():
    """Under autograd the op keeps 1 bit per element for its backward (CPU); gradients equal the regenerated
    mask's and the eager reference's."""
    rows, hidden, p = 6, 40, 0.25
    leaves = [torch.randn(rows, hidden, requires_grad=True), torch.randn(hidden, requires_grad=True),
              torch.randn(rows, hidden, requires_grad=True), torch.randn(hidden, requires_grad=True),
              torch.randn(hidden, requires_grad=True)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(*leaves, p, 1e-5, SEED, OFFSET)
    assert [t.dtype for t in saved if t.dtype == torch.uint8] == [torch.uint8]
    assert any(t is bits or (t.shape == bits.shape and torch.equal(t, bits)) for t in saved)
    g = torch.randn(rows, hidden)
    got = torch.autograd.grad(out, leaves, g)
    mask = cpu_mask(rows, hidden, p)
    ref = torch.autograd.grad(ref_layer_norm(*leaves[:2], leaves[2], leaves[3], leaves[4], mask, p)[0], leaves, g)
    for a, b_ in zip(got, ref):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
    gx, gr, gw, glb = ops.bias_dropout_add_layer_norm_backward(g, None, pre.detach(), leaves[3].detach(), mean, rstd,
                                                               p, SEED, OFFSET)
    assert torch.equal(got[0], gx) and torch.equal(got[2], gr) and torch.equal(got[3], gw)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [1024, 1000, 6004, 8192, 8200])
def test_backward_is_deterministic(hidden):
    """Column sums go through per-block partials in a fixed order: two runs give the same bits."""
    x, g = torch.randn(3000, hidden, device="cuda"), torch.randn(3000, hidden, device="cuda")
    w = torch.randn(hidden, device="cuda")
    _, s, mean, rstd = ops.add_layer_norm(x, None, w, None, 1e-5)
    first = ops.add_layer_norm_backward(g, None, s, w, mean, rstd)
    second = ops.add_layer_norm_backward(g, None, s, w, mean, rstd)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---- the CUDA kernels' thread -> column mapping (norms.cu with_row_shape, norms_rowwise.cuh) ------------------

WARP = 32  # kWarpSize
# rowwise::ForwardLimits / BackwardLimits: (kElemsPerThread, kMaxElemsPerThread, kWarpsPerRow)
FORWARD_LIMITS, BACKWARD_LIMITS = (32, 32, 8), (16, 32, 8)


def row_shape(hidden, vec_width, limits):
    """(slots per thread, warps per row) as norms.cu's with_row_shape picks them; None: multi-pass kernels."""
    elems, max_elems, max_warps = limits
    im, imax = elems // vec_width, max_elems // vec_width
    iters, warps = max(1, im // 4), 1
    while hidden > warps * WARP * iters * vec_width:
        if warps == 1 and iters < im:
            iters *= 2
        elif warps < max_warps:
            warps *= 2
        elif iters < imax:
            iters *= 2
        else:
            return None
    return iters, warps


@pytest.mark.parametrize("limits", [FORWARD_LIMITS, BACKWARD_LIMITS], ids=["forward", "backward"])
@pytest.mark.parametrize("vec_width", [4, 8])  # float; half / bfloat16
@pytest.mark.parametrize("hidden", [1, 2, 3, 7, 8, 33, 255, 256, 257, 1000, 1024, 1025, 1028, 2048, 2049, 4095, 4096,
                                    4097, 6000, 6004, 8191, 8192])
def test_every_column_is_owned_once(hidden, vec_width, limits):
    """Emulates the kernels' index math: thread t of a row owns slots it * TPR + t, slot s = columns
    s*V .. s*V+V-1; columns < hidden are owned exactly once, 16-byte slots start at multiples of 4 elements
    (whole Philox groups), a thread holds at most 32 elements (one bit each in backward's dropout mask), and
    a block has at most 256 threads (255 registers a thread)."""
    iters, warps = row_shape(hidden, vec_width, limits)
    tpr = warps * WARP
    assert iters * vec_width <= limits[1] <= 32
    assert (4 if warps == 1 else 1) * tpr <= 256  # rowwise::cta_threads
    owned = [0] * hidden
    vec = hidden % vec_width == 0
    for t in range(tpr):
        for it in range(iters):
            col = (it * tpr + t) * vec_width
            if vec and col < hidden:
                assert col + vec_width <= hidden  # a 16-byte slot is wholly inside the row
                for row in (0, 1, 4097):  # element index row * hidden + col starts a Philox group of 4
                    assert (row * hidden + col) % 4 == 0
            for k in range(vec_width):
                if col + k < hidden:
                    owned[col + k] += 1
    assert owned == [1] * hidden


def test_wide_rows_take_the_multipass_kernels():
    for limits in (FORWARD_LIMITS, BACKWARD_LIMITS):
        assert row_shape(8192, 8, limits) == (4, 8) and row_shape(8192, 4, limits) == (8, 8)
        assert row_shape(8193, 8, limits) is None and row_shape(8193, 4, limits) is None
    assert row_shape(1024, 8, FORWARD_LIMITS) == (4, 1) and row_shape(1024, 4, FORWARD_LIMITS) == (8, 1)
    assert row_shape(4096, 8, FORWARD_LIMITS) == (4, 4)
    # backward: 16 elements a thread while 8 warps hold the row that way, 32 only beyond
    assert row_shape(1024, 8, BACKWARD_LIMITS) == (2, 2) and row_shape(1024, 4, BACKWARD_LIMITS) == (4, 2)
    assert row_shape(4096, 8, BACKWARD_LIMITS) == (2, 8) and row_shape(4097, 8, BACKWARD_LIMITS) == (4, 8)


def _register_buckets(hiddens, vec_width, limits, vec=None):
    """The (slots per thread, warps per row, 16-byte) kernels that rows of these widths launch (vec: only those
    aligned rows take, or only element-by-element ones); multi-pass widths left out."""
    out = set()
    for h in hiddens:
        aligned = h % vec_width == 0
        if (vec is None or vec == aligned) and row_shape(h, vec_width, limits) is not None:
            out.add(row_shape(h, vec_width, limits) + (aligned,))
    return out


@pytest.mark.parametrize("limits", [FORWARD_LIMITS, BACKWARD_LIMITS], ids=["forward", "backward"])
@pytest.mark.parametrize("vec_width", [4, 8])  # float; half / bfloat16
def test_cuda_tests_reach_every_register_bucket(vec_width, limits):
    """Every register kernel instantiation runs in some CUDA test (docs/cuda-audit.md: compiled code no test launched
    was never run): this file's CUDA_SHAPES reach each launch bucket with 16-byte and element-by-element rows, and the
    mixed-dtype tests' widths (helpers/cuda_shapes.py; those kernels exist with 16-byte accesses only) reach each
    float32 bucket, and each 16-bit one of the fanout's second gradient (G2, backward)."""
    every = _register_buckets(range(1, 8193), vec_width, limits)
    assert _register_buckets([h for _, h in CUDA_SHAPES], vec_width, limits) == every
    if vec_width == 4 or limits is BACKWARD_LIMITS:
        aligned = _register_buckets(range(1, 8193), vec_width, limits, vec=True)
        assert _register_buckets(MIXED_HIDDENS, vec_width, limits, vec=True) == aligned
