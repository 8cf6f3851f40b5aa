"""Stateless kernels for fused transformer layers, as ``torch.ops.ckpt_ext`` ops.

The C++ side defines the schemas (csrc/ops/schemas.cpp), the checks and CPU/CUDA kernels (the op groups
csrc/ops/elementwise.cpp and norms.cpp) and the autograd kernels of the forward ops (csrc/ops/autograd.cpp,
registered on the Autograd key so that C++ code such as the fused layers gets gradients without Python;
each backward calls the matching ``*_backward`` op). This module adds a fake (meta) kernel for every op, so they trace under ``torch.compile`` and
``FakeTensorMode``. The Python functions below are the documented entry points.

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
* Gradients are first order only: the ``*_backward`` ops have no autograd formula of their own, except
  :func:`dropout`, which is linear in ``x`` and so is its own derivative.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

_lib = torch.ops.ckpt_ext

__all__ = [
    "bias_gelu",
    "bias_gelu_backward",
    "bias_dropout_add",
    "dropout",
    "dropout_mask",
    "bias_dropout_add_layer_norm",
    "bias_dropout_add_layer_norm_dual",
    "bias_dropout_add_layer_norm_backward",
    "add_layer_norm",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "geglu",
    "geglu_backward",
    "swiglu_backward_act_",
    "geglu_backward_act_",
    "bias_gelu_backward_act_",
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


def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none",
                       grad_bias: bool = False):
    """Gradient of :func:`bias_gelu` with respect to ``x``; the bias gradient is its sum over rows. With
    ``grad_bias=True`` returns ``(grad_x, grad_bias)``, the kernel summing the bias's gradient in the same pass
    (in float, of ``grad_x``'s stored values, in a fixed order: the same bits run to run on one device)."""
    grad_x, gb = _lib.bias_gelu_backward.default(grad, x, bias, approximate, grad_bias)
    return (grad_x, gb) if grad_bias else grad_x


def bias_dropout_add(
    x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float = 0.0, seed: int = 0, offset: int = 0
) -> Tensor:
    """``residual + dropout(x + bias, p)`` with the Philox mask of ``(seed, offset)``.

    Kept values are scaled by ``1 / (1 - p)``. Differentiable in ``x``, ``bias`` and ``residual``.
    ``x`` may be bfloat16 / float16 beside a float32 ``residual`` (autocast's float32 stream; ``bias`` then float32):
    computed as for ``x.float()``, the result float32, x's gradient in x's dtype.
    """
    return _lib.bias_dropout_add.default(x, bias, residual, p, seed, offset)


def dropout(x: Tensor, p: float, seed: int, offset: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``x * mask / (1 - p)`` with the mask of ``(seed, offset)``: dropout without bias or residual, and
    the backward of every ckpt_ext dropout drawn for ``(seed, offset)`` (same mask, linear map).

    ``dtype``: the result's (default ``x.dtype``); a float32 ``x`` may give bfloat16 / float16, the bits of
    ``dropout(x).to(dtype)`` in one pass (autocast: the residual stream's float32 gradient into the GEMMs' dtype)."""
    return _lib.dropout.default(x, p, seed, offset, dtype)


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
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """BERT's output block, fused: ``pre_norm = residual + dropout(x + bias)``, ``out = layer_norm(pre_norm)``.

    Returns ``(out, pre_norm, mean, rstd, keep_bits)``; backward needs ``pre_norm``, ``mean``, ``rstd``
    and, where there are any, ``keep_bits``: on CPU with ``p > 0`` the dropout mask, one bit per element
    (``uint8`` of shape ``[*x.shape[:-1], ceil(hidden / 8)]``, 1/32 of an fp32 activation), which the
    backward reads instead of regenerating the mask; elsewhere (CUDA, ``p == 0``) an empty ``uint8``
    tensor and the backward regenerates the mask from ``(seed, offset)``. Differentiable in ``x``,
    ``bias``, ``residual``, ``weight`` and ``ln_bias`` (``mean``, ``rstd`` and ``keep_bits`` are not).

    ``x`` has ``residual``'s dtype or, beside a float32 ``residual`` (autocast: a GEMM's output joining the
    float32 stream), bfloat16 or float16: it is read as float (exact), so the results are those of
    ``x.float()`` bit for bit, ``out`` and ``pre_norm`` are float32, and ``x``'s gradient comes in ``x``'s
    dtype, rounded once from the float gradient (the CPU kernels and CUDA's register kernels read and write it
    directly; CUDA rows wider than 8192 elements or not 16-byte aligned convert it around the float kernels).

    ``out_dtype``: ``out``'s dtype, ``residual``'s (None) or, beside a float32 ``residual``, bfloat16 / float16
    (autocast: an output that only feeds GEMMs, written in their dtype): the float result rounded once, the bits
    of ``out.to(out_dtype)``; its gradient then arrives in that dtype and is read as float (exact).
    """
    return _lib.bias_dropout_add_layer_norm.default(x, bias, residual, weight, ln_bias, p, eps, seed, offset,
                                                    out_dtype)


def bias_dropout_add_layer_norm_dual(
    x: Tensor,
    bias: Optional[Tensor],
    residual: Tensor,
    weight: Tensor,
    ln_bias: Optional[Tensor],
    p: float = 0.0,
    eps: float = 1e-5,
    seed: int = 0,
    offset: int = 0,
    out2_dtype: torch.dtype = torch.bfloat16,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`bias_dropout_add_layer_norm` with ``out`` also written in ``out2_dtype`` (bfloat16 / float16 beside a
    float32 ``residual``; autocast: BERT's ``h1``, the next norm's float32 residual and a GEMM's input): returns
    ``(out, out2, pre_norm, mean, rstd, keep_bits)``, ``out2`` the bits of ``out.to(out2_dtype)``. Backward reads
    ``out2``'s gradient as float and adds it to ``out``'s, as autograd adds the float gradient of a cast.
    """
    return _lib.bias_dropout_add_layer_norm_dual.default(x, bias, residual, weight, ln_bias, p, eps, seed, offset,
                                                         out2_dtype)


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
    keep_bits: Optional[Tensor] = None,
    grad_bias: bool = False,
    x_dtype: Optional[torch.dtype] = None,
    grad_out2: Optional[Tensor] = None,
) -> Tuple[Tensor, ...]:
    """Backward of :func:`bias_dropout_add_layer_norm`: ``(grad_x, grad_residual, grad_weight, grad_ln_bias)``,
    and ``grad_bias`` fifth when asked for.

    ``grad_pre_norm`` (optional) is the gradient flowing into ``pre_norm`` from elsewhere; it is added
    to the LayerNorm input gradient. The dense bias's gradient is ``grad_x`` summed over rows: with
    ``grad_bias=True`` the kernel sums it in the same pass (in float, of ``grad_x``'s stored values, in a
    fixed order: the same bits run to run on one device). ``keep_bits``: the forward's, as returned (the
    mask is read from it; empty: regenerated), or None (regenerated from ``(seed, offset)``); both give the
    same gradients bit for bit. ``x_dtype``: ``grad_x``'s dtype, the forward's ``x``'s (None: ``pre_norm``'s;
    bfloat16 or float16 beside a float32 ``pre_norm``: rounded once from the float gradient, while
    ``grad_bias`` sums the float values). ``grad_out`` may be in the lower-precision dtype of an ``out`` written in
    ``out_dtype``, read as float; ``grad_out2``: a second gradient of ``out`` (the dual op's ``out2``'s), added to it
    in float.
    """
    r = _lib.bias_dropout_add_layer_norm_backward.default(
        grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, p, seed, offset, keep_bits, grad_bias, x_dtype, grad_out2
    )
    return tuple(r) if grad_bias else tuple(r[:4])


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
    x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, out_dtype: Optional[torch.dtype] = None
) -> Tuple[Tensor, Tensor, Tensor]:
    """``sum = x + residual``, ``out = weight * (sum * rsqrt(mean(sum^2) + eps)).to(x.dtype)``.

    Hugging Face ``LlamaRMSNorm`` semantics: normalise in float32, cast back to the input dtype, then
    multiply by the weight. Returns ``(out, sum, rstd)``. Differentiable through ``out`` and ``sum``.
    ``out_dtype``: ``out``'s dtype, as :func:`bias_dropout_add_layer_norm`'s (bfloat16 / float16 beside a float32
    stream: the float result rounded once; its gradient read as float).
    """
    return _lib.add_rms_norm.default(x, residual, weight, eps, out_dtype)


def add_rms_norm_backward(
    grad_out: Tensor, grad_sum: Optional[Tensor], sum: Tensor, weight: Tensor, rstd: Tensor,
    grad_out2: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Backward of :func:`add_rms_norm`: ``(grad_input, grad_weight)``; ``grad_input`` includes ``grad_sum``.

    ``grad_out`` (and ``grad_out2``, a second gradient of ``out``, added to it in float) in ``sum``'s dtype or,
    beside a float32 ``sum``, the bfloat16 / float16 of an ``out`` written in ``out_dtype``, read as float."""
    return _lib.add_rms_norm_backward.default(grad_out, grad_sum, sum, weight, rstd, grad_out2)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (Llama's MLP). Differentiable in ``gate`` and ``up``."""
    return _lib.swiglu.default(gate, up)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """Backward of :func:`swiglu`: ``(grad_gate, grad_up)``."""
    return _lib.swiglu_backward.default(grad, gate, up)


def geglu(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(gate) * up`` (Gemma's MLP: GeGLU). ``approximate`` is ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``)
    or ``"none"`` (erf), as in :func:`torch.nn.functional.gelu`. Differentiable in ``gate`` and ``up``."""
    return _lib.geglu.default(gate, up, approximate)


def geglu_backward(grad: Tensor, gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tuple[Tensor, Tensor]:
    """Backward of :func:`geglu`: ``(grad_gate, grad_up)``."""
    return _lib.geglu_backward.default(grad, gate, up, approximate)


def swiglu_backward_act_(grad: Tensor, gate: Tensor, up: Tensor) -> None:
    """:func:`swiglu_backward` and :func:`swiglu` in one pass, in place: ``grad`` becomes ``swiglu(gate, up)`` (the
    same bits), ``gate`` and ``up`` their gradients. All three contiguous, distinct. The replay of a checkpointed
    segment's last layer takes the last linear's input from it instead of running the activation forward, its
    inputs being its own (issue 33)."""
    _lib.swiglu_backward_act_.default(grad, gate, up)


def geglu_backward_act_(grad: Tensor, gate: Tensor, up: Tensor, approximate: str = "tanh") -> None:
    """:func:`geglu_backward` and :func:`geglu` in one pass, in place (see :func:`swiglu_backward_act_`)."""
    _lib.geglu_backward_act_.default(grad, gate, up, approximate)


def bias_gelu_backward_act_(grad: Tensor, x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none",
                            grad_bias: bool = False) -> Tensor:
    """:func:`bias_gelu_backward` and :func:`bias_gelu` in one pass, in place: ``grad`` becomes ``x``'s gradient,
    ``x`` becomes ``bias_gelu(x, bias)`` (the same bits). Returns the bias's gradient (empty without
    ``grad_bias``). ``grad`` and ``x`` contiguous, distinct."""
    return _lib.bias_gelu_backward_act_.default(grad, x, bias, approximate, grad_bias)


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


def _like(op: str, ref_name: str, ref: Tensor, **others: Optional[Tensor]) -> None:
    """The C++ ops' device/dtype checks, repeated in the fake kernels: mixed devices (a meta tensor among
    CPU ones dispatches here) and compiled graphs get the same message as eager calls."""
    for name, t in others.items():
        if t is None:
            continue
        torch._check(t.device == ref.device, lambda: f"ckpt_ext::{op}: {name} must be on the device of {ref_name} "
                                                     f"({ref.device}), got {t.device}")
        torch._check(t.dtype == ref.dtype, lambda: f"ckpt_ext::{op}: {name} must have the dtype of {ref_name} "
                                                   f"({ref.dtype}), got {t.dtype}; cast it with .to({ref_name}.dtype)")


def _empty(t: Tensor, dtype=None) -> Tensor:
    return t.new_empty(t.shape, dtype=dtype or t.dtype)  # contiguous, like the C++ outputs


def _row_stats(t: Tensor) -> Tensor:
    return t.new_empty(t.shape[:-1], dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


def _rotary_like(x: Tensor) -> Tensor:
    return torch.empty_like(x) if x.stride(-1) == 1 else _empty(x)


@torch.library.register_fake("ckpt_ext::bias_gelu")
def _(x, bias, approximate):
    _like("bias_gelu", "x", x, bias=bias)
    return _empty(x)


@torch.library.register_fake("ckpt_ext::bias_gelu_backward")
def _(grad, x, bias, approximate, grad_bias=False):
    _like("bias_gelu_backward", "x", x, grad=grad, bias=bias)
    return _empty(x), x.new_empty(x.shape[-1:] if grad_bias else (0,))


_LOWP = (torch.bfloat16, torch.float16)


@torch.library.register_fake("ckpt_ext::bias_dropout_add")
def _(x, bias, residual, p, seed, offset):
    # x may be bfloat16/float16 beside a float32 residual (autocast's stream): bias and result are then float32.
    if x.dtype in _LOWP and residual.dtype == torch.float32:
        _like("bias_dropout_add", "residual", residual, bias=bias)
        torch._check(x.device == residual.device,
                     lambda: f"ckpt_ext::bias_dropout_add: residual must be on the device of x ({x.device}), "
                             f"got {residual.device}")
    else:
        _like("bias_dropout_add", "x", x, bias=bias, residual=residual)
    torch._check(x.shape == residual.shape, lambda: "bias_dropout_add: residual must have the shape of x")
    return _empty(residual)


@torch.library.register_fake("ckpt_ext::dropout")
def _(x, p, seed, offset, dtype=None):
    torch._check(dtype is None or dtype == x.dtype or (x.dtype == torch.float32 and dtype in _LOWP),
                 lambda: f"ckpt_ext::dropout: dtype must be x's ({x.dtype}), or bfloat16 / float16 for a float32 x, "
                         f"got {dtype}")
    return _empty(x, dtype)


@torch.library.register_fake("ckpt_ext::dropout_mask")
def _(numel, p, seed, offset, device):
    return torch.empty(numel, dtype=torch.bool, device=device)


def _keep_bits(x: Tensor, p: float) -> Tensor:
    """The C++ op's keep_bits (ops/checks.h): one bit per element on CPU with dropout, else empty."""
    if x.device.type == "cpu" and p > 0:
        return x.new_empty((*x.shape[:-1], (x.shape[-1] + 7) // 8), dtype=torch.uint8)
    return x.new_empty((0,), dtype=torch.uint8)


def _lowp_beside_float(x: torch.dtype, stream: torch.dtype) -> bool:
    """ops/checks.h's is_lowp_beside_float: a norm's x in bfloat16/float16 beside a float32 stream."""
    return stream == torch.float32 and x in (torch.bfloat16, torch.float16)


def _out_dtype(op: str, out_dtype, stream: torch.dtype) -> torch.dtype:
    """ops/norms.cpp's check_out_dtype: a norm's out in the stream's dtype or, beside float32, bfloat16/float16."""
    torch._check(out_dtype in (None, stream) or _lowp_beside_float(out_dtype, stream),
                 lambda: f"ckpt_ext::{op}: out_dtype must be the stream's dtype ({stream}) or, beside a float32 "
                         f"stream, bfloat16 or float16; got {out_dtype}")
    return out_dtype or stream


@torch.library.register_fake("ckpt_ext::bias_dropout_add_layer_norm")
def _(x, bias, residual, weight, ln_bias, p, eps, seed, offset, out_dtype=None):
    return _bdaln_fake("bias_dropout_add_layer_norm", x, bias, residual, weight, ln_bias, p, out_dtype)


def _bdaln_fake(op, x, bias, residual, weight, ln_bias, p, out_dtype):
    if _lowp_beside_float(x.dtype, residual.dtype):  # a mixed x: the rest is checked against the stream
        torch._check(residual.device == x.device,
                     lambda: f"ckpt_ext::{op}: residual must be on the device of x ({x.device}), got {residual.device}")
        _like(op, "residual", residual, bias=bias, weight=weight, ln_bias=ln_bias)
    else:
        _like(op, "x", x, bias=bias, residual=residual, weight=weight, ln_bias=ln_bias)
    torch._check(x.shape == residual.shape, lambda: f"ckpt_ext::{op}: residual must have the shape of x")
    out = _empty(residual, _out_dtype(op, out_dtype, residual.dtype))
    return out, _empty(residual), _row_stats(residual), _row_stats(residual), _keep_bits(x, p)


@torch.library.register_fake("ckpt_ext::bias_dropout_add_layer_norm_dual")
def _(x, bias, residual, weight, ln_bias, p, eps, seed, offset, out2_dtype):
    op = "bias_dropout_add_layer_norm_dual"
    torch._check(_lowp_beside_float(out2_dtype, residual.dtype),
                 lambda: f"ckpt_ext::bias_dropout_add_layer_norm_dual: out2_dtype must be bfloat16 or float16 beside a "
                         f"float32 stream; got {out2_dtype} beside {residual.dtype}")
    out, pre, mean, rstd, bits = _bdaln_fake(op, x, bias, residual, weight, ln_bias, p, None)
    return out, _empty(residual, out2_dtype), pre, mean, rstd, bits


@torch.library.register_fake("ckpt_ext::bias_dropout_add_layer_norm_backward")
def _(grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, p, seed, offset, keep_bits=None, grad_bias=False,
      x_dtype=None, grad_out2=None):
    torch._check(x_dtype in (None, pre_norm.dtype) or _lowp_beside_float(x_dtype, pre_norm.dtype),
                 lambda: f"ckpt_ext::bias_dropout_add_layer_norm_backward: x_dtype must be the pre-norm tensor's "
                         f"dtype ({pre_norm.dtype}) or, beside a float32 stream, bfloat16 or float16; got {x_dtype}")
    bias = pre_norm.new_empty(pre_norm.shape[-1:] if grad_bias else (0,))
    return _empty(pre_norm, x_dtype), _empty(pre_norm), _empty(weight), _empty(weight), bias


@torch.library.register_fake("ckpt_ext::add_layer_norm")
def _(x, residual, weight, bias, eps):
    _like("add_layer_norm", "x", x, residual=residual, weight=weight, bias=bias)
    return _empty(x), _empty(x), _row_stats(x), _row_stats(x)


@torch.library.register_fake("ckpt_ext::add_layer_norm_backward")
def _(grad_out, grad_sum, sum, weight, mean, rstd):
    return _empty(sum), _empty(weight), _empty(weight)


@torch.library.register_fake("ckpt_ext::add_rms_norm")
def _(x, residual, weight, eps, out_dtype=None):
    op = "add_rms_norm"
    stream = residual if residual is not None else weight
    if _lowp_beside_float(x.dtype, stream.dtype):  # a mixed x: the rest is checked against the stream
        torch._check(stream.device == x.device, lambda: f"ckpt_ext::{op}: "
                     f"{'residual' if residual is not None else 'weight'} must be on the device of x ({x.device}), "
                     f"got {stream.device}")
        if residual is not None:
            _like(op, "residual", residual, weight=weight)
            torch._check(x.shape == residual.shape, lambda: f"ckpt_ext::{op}: residual must have the shape of x")
        return _empty(x, _out_dtype(op, out_dtype, stream.dtype)), _empty(x, stream.dtype), _row_stats(stream)
    _like(op, "x", x, residual=residual, weight=weight)
    return _empty(x, _out_dtype(op, out_dtype, x.dtype)), _empty(x), _row_stats(x)


@torch.library.register_fake("ckpt_ext::add_rms_norm_backward")
def _(grad_out, grad_sum, sum, weight, rstd, grad_out2=None):
    return _empty(sum), _empty(weight)


@torch.library.register_fake("ckpt_ext::swiglu")
def _(gate, up):
    _like("swiglu", "gate", gate, up=up)
    return _empty(gate)


@torch.library.register_fake("ckpt_ext::swiglu_backward")
def _(grad, gate, up):
    return _empty(gate), _empty(gate)


@torch.library.register_fake("ckpt_ext::geglu")
def _(gate, up, approximate="tanh"):
    _like("geglu", "gate", gate, up=up)
    return _empty(gate)


@torch.library.register_fake("ckpt_ext::geglu_backward")
def _(grad, gate, up, approximate="tanh"):
    return _empty(gate), _empty(gate)


@torch.library.register_fake("ckpt_ext::swiglu_backward_act_")
def _(grad, gate, up):
    _like("swiglu_backward_act_", "gate", gate, up=up, grad=grad)


@torch.library.register_fake("ckpt_ext::geglu_backward_act_")
def _(grad, gate, up, approximate="tanh"):
    _like("geglu_backward_act_", "gate", gate, up=up, grad=grad)


@torch.library.register_fake("ckpt_ext::bias_gelu_backward_act_")
def _(grad, x, bias, approximate, grad_bias=False):
    _like("bias_gelu_backward_act_", "x", x, grad=grad, bias=bias)
    return x.new_empty(x.shape[-1:] if grad_bias else (0,))


@torch.library.register_fake("ckpt_ext::rotary")
def _(x, cos, sin):
    _like("rotary", "x", x, cos=cos, sin=sin)
    return _rotary_like(x)


@torch.library.register_fake("ckpt_ext::rotary_backward")
def _(grad, cos, sin):
    _like("rotary_backward", "grad", grad, cos=cos, sin=sin)
    return _rotary_like(grad)
