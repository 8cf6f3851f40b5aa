"""Stateless kernels for fused transformer layers, as ``torch.ops.ckpt_ext`` ops.

The C++ side (csrc/ops/fused_ops.cpp) defines the schemas and the CPU/CUDA kernels; this module adds
what makes them first-class PyTorch ops: a fake (meta) kernel for every op, so they trace under
``torch.compile`` and ``FakeTensorMode``, and autograd formulas for the forward ops, whose backward calls
the matching ``*_backward`` op. The Python functions below are the documented entry points.

Conventions:

* Row-wise ops normalise the last dimension; per-row statistics (``mean``, ``rstd``) have the input's
  shape without its last dimension and dtype float32 (float64 for float64 inputs).
* Weights and biases must have the dtype of the activations (cast them with ``.to(x.dtype)``).
* All arithmetic is in float32 (float64 for float64 inputs), rounded once on store.
* Dropout is a pure function of ``(seed, offset)`` and the element's row-major index (Philox4x32-10,
  see csrc/kernels/philox.h): backward regenerates the mask, nothing is stored, and the CPU and CUDA
  kernels draw the same mask. ``p == 0`` disables dropout. Use a fresh ``offset`` (or seed) per call.
* Inputs that are not contiguous are copied to contiguous memory first; outputs are contiguous, except
  :func:`rotary`'s, which are laid out like its input.
* Gradients are first order only (the ``*_backward`` ops have no autograd formula of their own).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

_lib = torch.ops.ckpt_ext

__all__ = [
    "bias_gelu",
    "bias_gelu_backward",
    "bias_dropout_add",
    "dropout_backward",
    "dropout_mask",
    "bias_dropout_add_layer_norm",
    "bias_dropout_add_layer_norm_backward",
    "add_layer_norm",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "rotary",
    "rotary_backward",
]


# ---- public functions ------------------------------------------------------------------------------------


def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """``gelu(x + bias)``; ``bias`` (optional) is broadcast over the last dimension of ``x``.

    ``approximate`` is ``"none"`` (erf) or ``"tanh"``, as in :func:`torch.nn.functional.gelu`.
    Differentiable in ``x`` and ``bias``.
    """
    return _lib.bias_gelu.default(x, bias, approximate)


def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """Gradient of :func:`bias_gelu` with respect to ``x``; the bias gradient is its sum over rows."""
    return _lib.bias_gelu_backward.default(grad, x, bias, approximate)


def bias_dropout_add(
    x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float = 0.0, seed: int = 0, offset: int = 0
) -> Tensor:
    """``residual + dropout(x + bias, p)`` with the Philox mask of ``(seed, offset)``.

    Kept values are scaled by ``1 / (1 - p)``. Differentiable in ``x``, ``bias`` and ``residual``.
    """
    return _lib.bias_dropout_add.default(x, bias, residual, p, seed, offset)


def dropout_backward(grad: Tensor, p: float, seed: int, offset: int) -> Tensor:
    """``grad * mask / (1 - p)`` with the mask that the forward drew for ``(seed, offset)``."""
    return _lib.dropout_backward.default(grad, p, seed, offset)


def dropout_mask(numel: int, p: float, seed: int, offset: int, device="cpu") -> Tensor:
    """The keep mask (bool, shape ``[numel]``) of the first ``numel`` elements for ``(seed, offset)``.

    Element ``i``'s flag does not depend on ``numel`` (a mask is a prefix of any longer one). For tests
    and statistics; the kernels never materialise it.
    """
    return _lib.dropout_mask.default(numel, p, seed, offset, torch.device(device))


def bias_dropout_add_layer_norm(
    x: Tensor,
    bias: Optional[Tensor],
    residual: Tensor,
    weight: Tensor,
    ln_bias: Optional[Tensor],
    p: float = 0.0,
    eps: float = 1e-5,
    seed: int = 0,
    offset: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """BERT's output block, fused: ``pre_norm = residual + dropout(x + bias)``, ``out = layer_norm(pre_norm)``.

    Returns ``(out, pre_norm, mean, rstd)``; backward needs only ``pre_norm``, ``mean`` and ``rstd``
    (the dropout mask is regenerated). Differentiable in ``x``, ``bias``, ``residual``, ``weight`` and
    ``ln_bias`` (``mean`` and ``rstd`` are not differentiable).
    """
    return _lib.bias_dropout_add_layer_norm.default(x, bias, residual, weight, ln_bias, p, eps, seed, offset)


def bias_dropout_add_layer_norm_backward(
    grad_out: Tensor,
    grad_pre_norm: Optional[Tensor],
    pre_norm: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    p: float,
    seed: int,
    offset: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`bias_dropout_add_layer_norm`: ``(grad_x, grad_residual, grad_weight, grad_ln_bias)``.

    ``grad_pre_norm`` (optional) is the gradient flowing into ``pre_norm`` from elsewhere; it is added
    to the LayerNorm input gradient. The dense bias's gradient is ``grad_x`` summed over rows.
    """
    return _lib.bias_dropout_add_layer_norm_backward.default(
        grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, p, seed, offset
    )


def add_layer_norm(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Optional[Tensor] = None, eps: float = 1e-5
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``sum = x + residual``, ``out = layer_norm(sum) * weight + bias`` (GPT-2's pre-LN residual step).

    Returns ``(out, sum, mean, rstd)``; ``sum`` is the new residual stream (a copy of ``x`` when
    ``residual`` is None). Differentiable in ``x``, ``residual``, ``weight`` and ``bias`` through both
    ``out`` and ``sum``.
    """
    return _lib.add_layer_norm.default(x, residual, weight, bias, eps)


def add_layer_norm_backward(
    grad_out: Tensor, grad_sum: Optional[Tensor], sum: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`add_layer_norm`: ``(grad_input, grad_weight, grad_bias)``.

    ``grad_input`` is the gradient of both ``x`` and ``residual``; it includes ``grad_sum`` if given.
    """
    return _lib.add_layer_norm_backward.default(grad_out, grad_sum, sum, weight, mean, rstd)


def add_rms_norm(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6
) -> Tuple[Tensor, Tensor, Tensor]:
    """``sum = x + residual``, ``out = weight * (sum * rsqrt(mean(sum^2) + eps)).to(x.dtype)``.

    Hugging Face ``LlamaRMSNorm`` semantics: normalise in float32, cast back to the input dtype, then
    multiply by the weight. Returns ``(out, sum, rstd)``. Differentiable through ``out`` and ``sum``.
    """
    return _lib.add_rms_norm.default(x, residual, weight, eps)


def add_rms_norm_backward(
    grad_out: Tensor, grad_sum: Optional[Tensor], sum: Tensor, weight: Tensor, rstd: Tensor
) -> Tuple[Tensor, Tensor]:
    """Backward of :func:`add_rms_norm`: ``(grad_input, grad_weight)``; ``grad_input`` includes ``grad_sum``."""
    return _lib.add_rms_norm_backward.default(grad_out, grad_sum, sum, weight, rstd)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (Llama's MLP). Differentiable in ``gate`` and ``up``."""
    return _lib.swiglu.default(gate, up)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """Backward of :func:`swiglu`: ``(grad_gate, grad_up)``."""
    return _lib.swiglu_backward.default(grad, gate, up)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding, Hugging Face Llama convention: ``x * cos + rotate_half(x) * sin``.

    ``x`` is ``[batch, heads, seq, head_dim]`` with any strides but a contiguous last dimension (the
    transposed view of a ``[batch, seq, heads, head_dim]`` projection is read in place); ``cos`` and
    ``sin`` are ``[batch or 1, seq, head_dim]`` (or ``[seq, head_dim]``) and broadcast over heads.
    The output is laid out like ``x``. Differentiable in ``x``, ``cos`` and ``sin``.
    """
    return _lib.rotary.default(x, cos, sin)


def rotary_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Gradient of :func:`rotary` with respect to ``x``: ``grad * cos + rotate_half^T(grad * sin)``."""
    return _lib.rotary_backward.default(grad, cos, sin)


# ---- fake kernels (shapes, dtypes and layouts of the C++ outputs) -------------------------------------------


def _empty(t: Tensor, dtype=None) -> Tensor:
    return t.new_empty(t.shape, dtype=dtype or t.dtype)  # contiguous, like the C++ outputs


def _row_stats(t: Tensor) -> Tensor:
    return t.new_empty(t.shape[:-1], dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


def _rotary_like(x: Tensor) -> Tensor:
    return torch.empty_like(x) if x.stride(-1) == 1 else _empty(x)


@torch.library.register_fake("ckpt_ext::bias_gelu")
def _(x, bias, approximate):
    return _empty(x)


@torch.library.register_fake("ckpt_ext::bias_gelu_backward")
def _(grad, x, bias, approximate):
    return _empty(x)


@torch.library.register_fake("ckpt_ext::bias_dropout_add")
def _(x, bias, residual, p, seed, offset):
    torch._check(x.shape == residual.shape, lambda: "bias_dropout_add: residual must have the shape of x")
    return _empty(x)


@torch.library.register_fake("ckpt_ext::dropout_backward")
def _(grad, p, seed, offset):
    return _empty(grad)


@torch.library.register_fake("ckpt_ext::dropout_mask")
def _(numel, p, seed, offset, device):
    return torch.empty(numel, dtype=torch.bool, device=device)


@torch.library.register_fake("ckpt_ext::bias_dropout_add_layer_norm")
def _(x, bias, residual, weight, ln_bias, p, eps, seed, offset):
    return _empty(x), _empty(x), _row_stats(x), _row_stats(x)


@torch.library.register_fake("ckpt_ext::bias_dropout_add_layer_norm_backward")
def _(grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, p, seed, offset):
    return _empty(pre_norm), _empty(pre_norm), _empty(weight), _empty(weight)


@torch.library.register_fake("ckpt_ext::add_layer_norm")
def _(x, residual, weight, bias, eps):
    return _empty(x), _empty(x), _row_stats(x), _row_stats(x)


@torch.library.register_fake("ckpt_ext::add_layer_norm_backward")
def _(grad_out, grad_sum, sum, weight, mean, rstd):
    return _empty(sum), _empty(weight), _empty(weight)


@torch.library.register_fake("ckpt_ext::add_rms_norm")
def _(x, residual, weight, eps):
    return _empty(x), _empty(x), _row_stats(x)


@torch.library.register_fake("ckpt_ext::add_rms_norm_backward")
def _(grad_out, grad_sum, sum, weight, rstd):
    return _empty(sum), _empty(weight)


@torch.library.register_fake("ckpt_ext::swiglu")
def _(gate, up):
    return _empty(gate)


@torch.library.register_fake("ckpt_ext::swiglu_backward")
def _(grad, gate, up):
    return _empty(gate), _empty(gate)


@torch.library.register_fake("ckpt_ext::rotary")
def _(x, cos, sin):
    return _rotary_like(x)


@torch.library.register_fake("ckpt_ext::rotary_backward")
def _(grad, cos, sin):
    return _rotary_like(grad)


# ---- autograd: each forward op's backward calls its *_backward op --------------------------------------------


def _sum_rows(t: Tensor) -> Tensor:
    """Gradient of a bias broadcast over the last dimension."""
    return t.reshape(-1, t.shape[-1]).sum(0)


def _needs(ctx, *indices) -> bool:
    return any(ctx.needs_input_grad[i] for i in indices)


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.approximate = approximate
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    if not _needs(ctx, 0, 1):
        return None, None, None
    grad_x = _lib.bias_gelu_backward.default(grad, x, bias, ctx.approximate)
    grad_bias = _sum_rows(grad_x) if ctx.needs_input_grad[1] else None
    return grad_x, grad_bias, None


torch.library.register_autograd("ckpt_ext::bias_gelu", _bias_gelu_backward, setup_context=_bias_gelu_setup)


def _bias_dropout_add_setup(ctx, inputs, output):
    x, bias, residual, p, seed, offset = inputs
    ctx.dropout = (p, seed, offset)


def _bias_dropout_add_backward(ctx, grad):
    grad_x = grad_bias = None
    if _needs(ctx, 0, 1):
        grad_x = _lib.dropout_backward.default(grad, *ctx.dropout)
        grad_bias = _sum_rows(grad_x) if ctx.needs_input_grad[1] else None
    grad_residual = grad if ctx.needs_input_grad[2] else None
    return grad_x, grad_bias, grad_residual, None, None, None


torch.library.register_autograd(
    "ckpt_ext::bias_dropout_add", _bias_dropout_add_backward, setup_context=_bias_dropout_add_setup
)


def _bias_dropout_add_layer_norm_setup(ctx, inputs, output):
    x, bias, residual, weight, ln_bias, p, eps, seed, offset = inputs
    out, pre_norm, mean, rstd = output
    ctx.dropout = (p, seed, offset)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(pre_norm, weight, mean, rstd)


def _bias_dropout_add_layer_norm_backward(ctx, grad_out, grad_pre_norm, _grad_mean, _grad_rstd):
    pre_norm, weight, mean, rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(pre_norm)
    grad_x, grad_residual, grad_weight, grad_ln_bias = _lib.bias_dropout_add_layer_norm_backward.default(
        grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, *ctx.dropout
    )
    n = ctx.needs_input_grad
    return (
        grad_x if n[0] else None,
        _sum_rows(grad_x) if n[1] else None,
        grad_residual if n[2] else None,
        grad_weight if n[3] else None,
        grad_ln_bias if n[4] else None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd(
    "ckpt_ext::bias_dropout_add_layer_norm",
    _bias_dropout_add_layer_norm_backward,
    setup_context=_bias_dropout_add_layer_norm_setup,
)


def _add_layer_norm_setup(ctx, inputs, output):
    out, sum_, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(sum_, inputs[2], mean, rstd)


def _add_layer_norm_backward(ctx, grad_out, grad_sum, _grad_mean, _grad_rstd):
    sum_, weight, mean, rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(sum_)
    grad_input, grad_weight, grad_bias = _lib.add_layer_norm_backward.default(
        grad_out, grad_sum, sum_, weight, mean, rstd
    )
    n = ctx.needs_input_grad
    return (
        grad_input if n[0] else None,
        grad_input if n[1] else None,
        grad_weight if n[2] else None,
        grad_bias if n[3] else None,
        None,
    )


torch.library.register_autograd(
    "ckpt_ext::add_layer_norm", _add_layer_norm_backward, setup_context=_add_layer_norm_setup
)


def _add_rms_norm_setup(ctx, inputs, output):
    out, sum_, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(sum_, inputs[2], rstd)


def _add_rms_norm_backward(ctx, grad_out, grad_sum, _grad_rstd):
    sum_, weight, rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(sum_)
    grad_input, grad_weight = _lib.add_rms_norm_backward.default(grad_out, grad_sum, sum_, weight, rstd)
    n = ctx.needs_input_grad
    return grad_input if n[0] else None, grad_input if n[1] else None, grad_weight if n[2] else None, None


torch.library.register_autograd("ckpt_ext::add_rms_norm", _add_rms_norm_backward, setup_context=_add_rms_norm_setup)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = _lib.swiglu_backward.default(grad, gate, up)
    return grad_gate if ctx.needs_input_grad[0] else None, grad_up if ctx.needs_input_grad[1] else None


torch.library.register_autograd("ckpt_ext::swiglu", _swiglu_backward, setup_context=_swiglu_setup)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _reduce_to(t: Tensor, like: Tensor) -> Tensor:
    """Sum a [B, H, S, D] product over the dims that ``like`` ([B or 1, S, D] or [S, D]) broadcasts."""
    t = t.sum(1)
    if like.dim() == 2:
        return t.sum(0)
    return t.sum(0, keepdim=True) if like.shape[0] == 1 else t


def _rotary_setup(ctx, inputs, output):
    x, cos, sin = inputs
    # x is needed only for the (rare) gradients of the cos/sin tables.
    ctx.save_for_backward(x if _needs(ctx, 1, 2) else None, cos, sin)


def _rotary_backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    grad_x = _lib.rotary_backward.default(grad, cos, sin) if ctx.needs_input_grad[0] else None
    grad_cos = _reduce_to(grad * x, cos) if ctx.needs_input_grad[1] else None
    grad_sin = _reduce_to(grad * _rotate_half(x), sin) if ctx.needs_input_grad[2] else None
    return grad_x, grad_cos, grad_sin


torch.library.register_autograd("ckpt_ext::rotary", _rotary_backward, setup_context=_rotary_setup)
