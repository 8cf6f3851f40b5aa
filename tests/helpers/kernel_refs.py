"""Plain-PyTorch references of the fused ops (computed in float32/float64), an independent Philox
(Random123) to specify the dropout masks, and the comparisons the kernel tests make with them."""
import torch
import torch.nn.functional as F

# ---- plain-PyTorch references ---------------------------------------------------------------------------------


def _acc(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def ref_bias_gelu(x, bias, approximate):
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def ref_dropout(h, mask, p):
    return h * mask.to(h.dtype) * (1.0 / (1.0 - p)) if p < 1 else h * 0


def ref_bias_dropout_add(x, bias, residual, mask, p):
    return residual + ref_dropout(x if bias is None else x + bias, mask, p)


def ref_row_stats(s, eps):
    h = s.to(_acc(s))
    return h.mean(-1), torch.rsqrt(h.var(-1, unbiased=False) + eps)


def ref_add_layer_norm(x, residual, weight, bias, eps):
    s = x if residual is None else x + residual
    out = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return (out, s, *ref_row_stats(s.detach(), eps))


def ref_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, mask, p, eps):
    s = ref_bias_dropout_add(x, bias, residual, mask, p)
    out = F.layer_norm(s, (s.shape[-1],), weight, ln_bias, eps)
    return (out, s, *ref_row_stats(s.detach(), eps))


def ref_rms_norm(x, residual, weight, eps):
    """Hugging Face LlamaRMSNorm after a residual add."""
    s = x if residual is None else x + residual
    h = s.to(_acc(s))
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(s.dtype), s, rstd.squeeze(-1).detach()


def ref_swiglu(gate, up):
    return F.silu(gate) * up


def ref_geglu(gate, up, approximate="tanh"):
    """Gemma's MLP activation: act_fn(gate_proj(x)) * up_proj(x), act_fn GELU (tanh: gelu_pytorch_tanh)."""
    return F.gelu(gate, approximate=approximate) * up


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_rotary(x, cos, sin):
    """Hugging Face apply_rotary_pos_emb with unsqueeze_dim=1."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


# ---- independent Philox4x32-10 (int64 torch arithmetic), the specification of the dropout mask -----------------

_M0, _M1, _W0, _W1, _MASK32 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF


def _mulhilo(a, b):
    """(lo32, hi32) of a * b for a python int a < 2^32 and an int64 tensor b of values < 2^32, without overflow."""
    t1 = a * (b & 0xFFFF)
    t2 = a * (b >> 16)
    lo_part = t1 + ((t2 & 0xFFFF) << 16)
    return lo_part & _MASK32, ((t2 >> 16) + (lo_part >> 32)) & _MASK32


def philox4x32_10(counter, key):
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        lo0, hi0 = _mulhilo(_M0, c0)
        lo1, hi1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def reference_dropout_mask(numel, p, seed, offset):
    seed, offset = seed % 2**64, offset % 2**64
    group = torch.arange((numel + 3) // 4, dtype=torch.int64)
    lo, hi = torch.full_like(group, offset & _MASK32), torch.full_like(group, offset >> 32)
    counter = (group & _MASK32, group >> 32, lo, hi)
    words = torch.stack(philox4x32_10(counter, (seed & _MASK32, seed >> 32)), dim=1).reshape(-1)[:numel]
    u = (words >> 8).to(torch.float32) * 2.0**-24
    return u >= torch.tensor(p, dtype=torch.float32)


# ---- comparison harness ------------------------------------------------------------------------------------


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def forward_backward(fn, inputs, grad_outputs):
    """fn(*inputs) and the gradients of sum(out_k * grad_outputs[k]) wrt the inputs that require grad."""
    outs = as_tuple(fn(*inputs))
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None]
    grads = ()
    if leaves:
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def clone_inputs(inputs, dtype=None):
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            c = t.detach().to(dtype) if dtype is not None else t.detach().clone()
            out.append(c.requires_grad_(t.requires_grad))
        else:
            out.append(t)
    return out


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_matches_reference(kernel_fn, ref_fn, inputs, grad_outputs, what):
    """Runs kernel_fn and ref_fn on copies of `inputs` (leaves keep their requires_grad) and compares the
    outputs and the input gradients with the dtype's scheme (see the module docstring)."""
    dtype = next(t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point())
    got, got_grads = forward_backward(kernel_fn, clone_inputs(inputs), grad_outputs)
    ref64, ref64_grads = forward_backward(
        ref_fn, clone_inputs(inputs, torch.float64), [None if g is None else g.double() for g in grad_outputs]
    )
    assert len(got) == len(ref64) and len(got_grads) == len(ref64_grads)
    if dtype == torch.float32:
        for name, a, r in named_errors(what, got, ref64, got_grads, ref64_grads):
            assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
            assert_close_fp32(name, a, r)
        return
    lowp, lowp_grads = forward_backward(ref_fn, clone_inputs(inputs), grad_outputs)
    named_lowp = [r for _, _, r in named_errors(what, got, lowp, got_grads, lowp_grads)]
    for (name, a, r), pt in zip(named_errors(what, got, ref64, got_grads, ref64_grads), named_lowp):
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert a.dtype == pt.dtype, f"{name}: dtype {a.dtype} != PyTorch's {pt.dtype}"
        factor = 3.0 if name.startswith("grad") else 2.0
        atol = 1e-5 * (1.0 + (r.abs().max().item() if r.numel() else 0.0))
        err, pt_err = max_err(a, r), max_err(pt, r)
        assert err <= factor * pt_err + atol, (
            f"{name} ({dtype}): kernel max error {err:.3g} > {factor:g} x PyTorch's {pt_err:.3g} + {atol:.1e}"
        )


def assert_close_fp32(name, got, ref, rtol=1e-5):
    """|got - ref| <= rtol * |ref| + atol elementwise, atol = rtol * (1 + max |ref|) (torch.isclose is slow here)."""
    assert got.dtype == torch.float32, f"{name}: dtype {got.dtype}"
    if not got.numel():
        return
    err = (got.double() - ref).abs()
    atol = rtol * (1.0 + ref.abs().max().item())
    excess = (err - (rtol * ref.abs() + atol)).max().item()
    assert excess <= 0, f"{name}: max error {err.max().item():.3g} exceeds rtol={rtol:g}, atol={atol:.2g}"


def named_errors(what, outs, ref_outs, grads, ref_grads):
    out_names, grad_names = what
    assert len(out_names) == len(outs) and len(grad_names) == len(grads)
    for n, a, r in zip(out_names, outs, ref_outs):
        yield n, a, r
    for n, a, r in zip(grad_names, grads, ref_grads):
        yield "grad " + n, a, r


def randn_on(*shape, dtype, device, requires_grad=True, scale=1.0):
    t = (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)
