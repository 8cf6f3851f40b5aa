"""Tests of the dropout kernels (torch.ops.ckpt_ext.dropout and the dropout inside the fused ops).

Dropout is tested for its rate, determinism, prefix property, agreement with an independent Philox
implementation written here, and for forward and backward using the same mask. On CUDA (skipped
without a GPU) the CPU and CUDA masks and outputs must be equal.
"""
import math

import pytest
import torch

from ckpt_ext import ops

from helpers.devices import DEVICES, requires_cuda
from helpers.kernel_refs import _MASK32, philox4x32_10, ref_dropout, reference_dropout_mask
from helpers.kernel_fixtures import DTYPES, _seed  # noqa: F401  (an autouse fixture)


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
    out, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(ones, None, zeros, w, None, p, 1e-5, seed, offset)
    assert torch.equal(pre, fwd)
    g = torch.randn(shape, dtype=dtype, device=device)
    grad_x, grad_res, _, _ = ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, p, seed, offset)
    # the mask read from the forward's keep bits (CPU; empty on CUDA): the same gradient
    from_bits = ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, p, seed, offset, bits)[0]
    assert torch.equal(from_bits, grad_x)
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
@pytest.mark.parametrize("shape", [(2347, 4096), (4099, 1031)])
def test_cuda_elementwise_kernels_past_one_grid(shape):
    """Tensors of several grid passes with a ragged tail (each thread takes two groups of four per iteration,
    kGroupsInFlight in csrc/kernels/cuda/elementwise.cu; hidden 1031: no vector loads): the dropped pattern
    is CPU's and the biased GELU and its backward agree with CPU's -- a group computed with another group's
    bias or mask would not."""
    p, seed, offset = 0.25, 77, 5
    x = torch.randn(shape).to(torch.bfloat16) + 3.0
    b = torch.randn(shape[-1]).to(torch.bfloat16)
    zeros = torch.zeros(shape, dtype=torch.bfloat16)
    cpu = ops.bias_dropout_add(x, b, zeros, p, seed, offset)
    cuda = ops.bias_dropout_add(x.cuda(), b.cuda(), zeros.cuda(), p, seed, offset).cpu()
    assert torch.equal(cpu == 0, cuda == 0)
    torch.testing.assert_close(cuda, cpu)
    assert torch.equal(ops.dropout(x, p, seed, offset) == 0, ops.dropout(x.cuda(), p, seed, offset).cpu() == 0)
    g = torch.randn(shape).to(torch.bfloat16)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(ops.bias_gelu(x.cuda() - 3.0, b.cuda(), approximate).cpu(),
                                   ops.bias_gelu(x - 3.0, b, approximate), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(ops.bias_gelu_backward(g.cuda(), x.cuda() - 3.0, b.cuda(), approximate).cpu(),
                                   ops.bias_gelu_backward(g, x - 3.0, b, approximate), atol=2e-2, rtol=2e-2)


# ---- past 2^31 elements (docs/cuda-audit.md: the 64-bit index arithmetic, read but never run) ---------------------


def _spec_keep(index, p, seed, offset):
    """The specification's keep flag of each element index (int64 tensor): Philox word index % 4 of group index / 4."""
    group = index >> 2
    lo, hi = torch.full_like(group, offset & _MASK32), torch.full_like(group, offset >> 32)
    words = torch.stack(philox4x32_10((group & _MASK32, group >> 32, lo, hi), (seed & _MASK32, seed >> 32)), dim=1)
    word = words.gather(1, (index & 3).unsqueeze(1)).squeeze(1)
    return (word >> 8).to(torch.float32) * 2.0**-24 >= torch.tensor(p, dtype=torch.float32)


def _column_sums_bound_ok(got, gx, chunk=1 << 16):
    """got: gx's column sums (float accumulation, then gx's dtype): within (rows - 1) * 2^-24 * sum |gx| of the exact
    sums, plus the final rounding; the exact ones taken in float64 a chunk of rows at a time (no float64 copy of gx)."""
    ref = torch.zeros(gx.shape[-1], dtype=torch.float64, device=gx.device)
    mag = torch.zeros_like(ref)
    for i in range(0, gx.shape[0], chunk):
        part = gx[i:i + chunk].double()
        ref += part.sum(0)
        mag += part.abs().sum(0)
    bound = max(gx.shape[0] - 1, 1) * 2.0**-24 * mag + torch.finfo(gx.dtype).eps * ref.abs()
    return bool(((got.double() - ref).abs() <= bound + 1e-30).all())


def _assert_index_math(rows, hidden, device):
    """bias_dropout_add, the fused LayerNorm (forward and backward, with the bias's column sums), RMSNorm and
    bias_gelu_backward's column kernel on [rows, hidden] bfloat16: at the first rows, the rows around element 2^31
    and the last row, the dropout mask is the specification's at the global element index and each row is normalised
    with its own statistics (the CPU kernels on those rows alone as the yardstick)."""
    p, seed, offset, dt = 0.5, 91, 3, torch.bfloat16
    edge = 2**31 // hidden
    sel = torch.tensor(sorted({r for r in (0, 1, rows // 2, edge - 1, edge, edge + 1, rows - 1) if 0 <= r < rows}))
    keep = _spec_keep((sel[:, None] * hidden + torch.arange(hidden)[None, :]).reshape(-1), p, seed, offset)
    keep = keep.reshape(len(sel), hidden)
    g = torch.Generator().manual_seed(5)
    b = (torch.randn(hidden, generator=g) * 0.5).to(dt)
    w = (1 + torch.randn(hidden, generator=g) * 0.1).to(dt)
    lb = (torch.randn(hidden, generator=g) * 0.1).to(dt)
    bd, wd, lbd, seld = b.to(device), w.to(device), lb.to(device), sel.to(device)
    ones = torch.ones(rows, hidden, dtype=dt, device=device)
    zeros = torch.zeros(rows, hidden, dtype=dt, device=device)
    # kept: (1 + b) * 2 (exact in float, one rounding to bfloat16), dropped: 0
    want = torch.where(keep, (1 + b.float()) * 2, 0.0).to(dt)
    summed = ops.bias_dropout_add(ones, bd, zeros, p, seed, offset)
    assert torch.equal(summed[seld].cpu(), want)

    out, pre, mean, rstd, _ = ops.bias_dropout_add_layer_norm(ones, bd, zeros, wd, lbd, p, 1e-5, seed, offset)
    del zeros
    assert torch.equal(pre[seld].cpu(), want)
    ref_out, _, ref_mean, ref_rstd = ops.add_layer_norm(want, None, w, lb, 1e-5)
    torch.testing.assert_close(mean[seld].cpu(), ref_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd[seld].cpu(), ref_rstd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[seld].cpu(), ref_out, rtol=2e-2, atol=2e-2)
    del out
    # backward (grad_out = ones): grad_x is grad_residual * 2 where kept (a power of two: the same rounding)
    gx, gres, _, _, gb = ops.bias_dropout_add_layer_norm_backward(ones, None, pre, wd, mean, rstd, p, seed, offset,
                                                                  grad_bias=True)
    assert torch.equal(gx[seld].cpu(), torch.where(keep, gres[seld].cpu().float() * 2, 0.0).to(dt))
    ref_gres = ops.bias_dropout_add_layer_norm_backward(torch.ones_like(want), None, want, w, ref_mean, ref_rstd, 0.0,
                                                        0, 0)[1]
    torch.testing.assert_close(gres[seld].cpu(), ref_gres, rtol=2e-2, atol=2e-2)
    assert _column_sums_bound_ok(gb, gx)
    del pre, mean, rstd, gx, gres, gb

    rms_out, rms_sum, rms_rstd = ops.add_rms_norm(summed, None, wd, 1e-6)
    ref_rms = ops.add_rms_norm(want, None, w, 1e-6)
    assert torch.equal(rms_sum[seld].cpu(), want)
    torch.testing.assert_close(rms_rstd[seld].cpu(), ref_rms[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_out[seld].cpu(), ref_rms[0], rtol=2e-2, atol=2e-2)
    del rms_out, rms_sum, rms_rstd

    ggx, ggb = ops.bias_gelu_backward(ones, summed, bd, "tanh", grad_bias=True)
    torch.testing.assert_close(ggx[seld].cpu(), ops.bias_gelu_backward(torch.ones_like(want), want, b, "tanh"),
                               rtol=2e-2, atol=2e-2)
    assert _column_sums_bound_ok(ggb, ggx)


def test_index_math_check_on_small_rows():
    """The past-2^31 check's own logic, on CPU rows small enough to run anywhere (no row near element 2^31)."""
    for hidden in (64, 72):
        _assert_index_math(37, hidden, "cpu")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [4096, 8200], ids=["register-kernels", "multipass-kernels"])
def test_cuda_index_math_past_2_31_elements(hidden):
    """[rows, hidden] bfloat16 with rows * hidden > 2^31 (4 GiB a tensor, about 26 GiB at the peak): a 32-bit element
    index anywhere in the kernels (a row offset, a Philox group, a column-sum row) would show at the rows past
    element 2^31."""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    if free < 32 * 2**30:  # under pytest -n, other workers' tensors share the GPU
        pytest.skip(f"needs 32 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    _assert_index_math(2**31 // hidden + 3, hidden, "cuda")
    torch.cuda.empty_cache()
