"""The LM head and its cross-entropy as one chunked operation: the logits of the whole batch never exist.

    loss = linear_cross_entropy(hidden, weight, bias, labels)     # = HF's ForCausalLMLoss(lm_head(hidden), labels)

Per chunk of tokens (``chunk_rows`` rows of the flattened hidden states): the chunk's logits (one GEMM, in the
weight's dtype: bfloat16 under autocast, as Hugging Face's lm_head computes them), their float32 copy
(optionally soft-capped), the log-sum-exp, the chunk's loss, and -- in the forward, as Liger-Kernel does --
the gradient of the logits, turned at once into the chunk's rows of the hidden states' gradient and added to
the weight's (and bias') gradient. Backward only scales those by the incoming gradient. ``docs/head.md`` says
why this order (rather than recomputing the logits in backward, also implemented: ``recompute=True``) and
how large a chunk is.

Two operators (``torch.library.custom_op``): ``ckpt_ext::linear_cross_entropy`` (the forward with the
gradients) and ``ckpt_ext::linear_cross_entropy_recompute`` / ``..._backward`` (the checkpoint's way).
They are opaque to torch.compile (no graph break, any shapes), and inside them the trained rows are picked
out (data-dependent shapes are fine there) and the labels checked.
"""
import functools
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["linear_cross_entropy", "chunk_rows", "CHUNK_ROWS", "CHUNK_BYTES"]

# Rows (tokens) per chunk: CHUNK_ROWS, fewer if their float32 logits would pass CHUNK_BYTES. Each chunk adds its
# weight-gradient term to a V x H sum (read and written once per chunk), so rows set the ratio of GEMM work to
# that traffic (0.75 x rows FLOP/byte: 1024 rows is ~3x an H100's ridge); on CPU 1024 rows ran 1.46x faster
# than 128 and as fast as 512 (docs/head.md). V = 128256: 1024 rows, 501 MiB of float32 logits; V = 256000: 512.
CHUNK_ROWS = int(os.environ.get("CKPT_EXT_HEAD_CHUNK_ROWS", 1024))
CHUNK_BYTES = int(os.environ.get("CKPT_EXT_HEAD_CHUNK_BYTES", 512 << 20))
# What the weight's gradient is summed in over the chunks, for bfloat16/float16 weights: "weight" (its own dtype,
# in place, as Liger-Kernel's chunk loop sums it with addmm: no buffer beside the gradient itself) or "float32" (a
# float32 V x H sum rounded once at the end, so the chunking adds no rounding of its own; 2 x V x H bytes more
# while the loss runs: 2 GiB at Llama-3's 128256 x 4096, which kept the Llama-3 8B step of issue 37 over its
# memory target -- docs/head.md).
ACCUMULATE = os.environ.get("CKPT_EXT_HEAD_ACCUMULATE", "weight")
if ACCUMULATE not in ("weight", "float32"):
    raise ValueError(f"CKPT_EXT_HEAD_ACCUMULATE must be 'weight' or 'float32', got {ACCUMULATE!r}")
_LOW = (torch.float16, torch.bfloat16)


def chunk_rows(vocab: int, chunk_bytes: Optional[int] = None, rows: Optional[int] = None) -> int:
    """Rows (tokens) per chunk: ``rows`` (CHUNK_ROWS), fewer if their float32 logits pass ``chunk_bytes``
    (CHUNK_BYTES), then a multiple of 64 (or at least 1)."""
    budget = CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    n = min(CHUNK_ROWS if rows is None else int(rows), max(1, budget // (4 * max(1, vocab))))
    return n - n % 64 if n >= 64 else n


def _check_labels(target: Tensor, ignore_index: int, vocab: int, seq: int, shifted: bool) -> Tuple[Tensor, int]:
    """(mask of the trained rows, their count); ValueError for a label outside [0, vocab) other than
    ignore_index. One reduction and one device-to-host copy (on CUDA: a synchronisation instead of a
    device-side assert in the loss kernel)."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab))
    counts = torch.stack([valid.sum(), bad.sum()]).tolist()
    if counts[1]:
        first = int(bad.nonzero()[0, 0])
        value = int(target[first])
        if seq > 0:
            b, s = divmod(first, seq)
            where = f"labels[{b}, {s + 1 if shifted else s}]"
        else:
            where = f"label {first}"
        raise ValueError(f"ckpt_ext linear_cross_entropy: {where} = {value} is outside the vocabulary [0, {vocab}) "
                         f"and is not ignore_index ({ignore_index}); {counts[1]} such label(s) in the batch. Check "
                         "the tokenizer's vocabulary against the model's (config.vocab_size) and the padding label.")
    return valid, int(counts[0])


def _chunk_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: float):
    """(float32 logits after the soft cap, tanh for the cap's derivative or None) of one chunk."""
    logits = torch.addmm(bias, h, weight.t()) if bias is not None else torch.mm(h, weight.t())
    z = logits.float()  # a copy in bfloat16/float16 (as HF's .float()); the same tensor in float32
    if softcap:
        th = z.div_(softcap).tanh_()  # z is this chunk's own buffer
        return th * softcap, th
    return z, None


def _softmax_(z: Tensor, t: Tensor) -> Tuple[Tensor, Tensor]:
    """Over z (one chunk's float32 logits, ours to overwrite) their softmax; returns (log-sum-exp per row,
    loss per row). One exp per logit: the softmax is the exponentials divided by their sum."""
    m = z.amax(1, keepdim=True)
    zt = z.gather(1, t.unsqueeze(1))
    s = z.sub_(m).exp_().sum(1, keepdim=True)
    z.div_(s)
    lse = m.add_(s.log_())
    return lse.squeeze(1), (lse - zt).squeeze(1)


def _grad_logits_(p: Tensor, t: Tensor, th: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
    """d(sum of the chunk's losses)/d(logits before the cap), over the softmax p: p - one-hot, times the cap's
    derivative (1 - tanh^2) and ``scale`` (the incoming gradient; None: 1)."""
    p.scatter_add_(1, t.unsqueeze(1), torch.full((t.numel(), 1), -1.0, dtype=p.dtype, device=p.device))
    if th is not None:
        p.mul_(th.mul_(th).neg_().add_(1))  # 1 - tanh^2, over th (the chunk's own, not used after)
    if scale is not None:
        p.mul_(scale)
    return p


def _chunk_grads(g: Tensor, hc: Tensor, weight: Tensor, gh: Optional[Tensor], rows: slice, idx: Optional[Tensor],
                 gw: Optional[Tensor], gb: Optional[Tensor]):
    """The chunk's gradient of the logits (float32) into the hidden rows' gradient (rows ``rows`` of the trained
    rows: of ``gh`` itself, or its rows ``idx[rows]``) and the weight's and bias' sums: g @ W, g^T @ h, g.sum(0),
    the GEMMs in the weight's dtype (as HF's backward)."""
    if gb is not None:
        gb += g.sum(0)
    g = g.to(weight.dtype)
    if gh is not None:
        if idx is None:
            torch.mm(g, weight, out=gh[rows])
        else:
            gh.index_copy_(0, idx[rows], torch.mm(g, weight))
    if gw is not None:
        if gw.dtype == g.dtype:
            gw.addmm_(g.t(), hc)
        else:  # a float32 sum: the product in the GEMM dtype, a block of vocabulary rows at a time (no V x H copy)
            block = max(1, g.shape[0] * g.shape[1] // max(1, hc.shape[1]))  # as large as the chunk's logits
            for v in range(0, gw.shape[0], block):
                gw[v:v + block] += torch.mm(g[:, v:v + block].t(), hc)


def _select(target: Tensor, valid: Tensor, count: int):
    """The trained rows' targets and their indices (None: all rows are trained)."""
    if count == target.numel():
        return target, None
    idx = valid.nonzero().squeeze(1)
    return target.index_select(0, idx), idx


def _rows(hidden: Tensor, idx: Optional[Tensor], rows: slice) -> Tensor:
    """Rows ``rows`` of the trained rows of ``hidden``: a view, or a chunk-sized copy when some rows are ignored
    (never a copy of all the hidden states)."""
    return hidden[rows] if idx is None else hidden.index_select(0, idx[rows])


def _weight_grad_buffer(weight: Tensor) -> Tensor:
    # Half-precision weights: the chunks' products summed in the weight's dtype (ACCUMULATE = "weight": the
    # buffer is the gradient), or in float32 and rounded once at the end (a float32 V x H buffer while the loss
    # runs, so the chunking adds no rounding of its own).
    fp32 = ACCUMULATE == "float32" and weight.dtype in _LOW
    return torch.zeros(weight.shape, dtype=torch.float32 if fp32 else weight.dtype, device=weight.device)


def _hidden_grad_buffer(hidden: Tensor, idx: Optional[Tensor]) -> Tensor:
    # Rows of ignored positions get no gradient: zeros where some are ignored.
    return torch.empty_like(hidden) if idx is None else torch.zeros_like(hidden)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _no_autocast(fn):
    """The operators run their ops in the dtypes they are given: a custom op falls through autocast's
    dispatch key, so eager autocast would otherwise still be on inside (the casts are made by the caller)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast(args[1].device.type, enabled=False):
            return fn(*args, **kwargs)
    return run


@_no_autocast
def _lce_impl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
         softcap: float, chunk: int, grad_hidden: bool, grad_weight: bool, grad_bias: bool, seq: int,
         shifted: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(sum of the losses of the trained rows (float32), their count (float32), d sum/d hidden,
    d sum/d weight, d sum/d bias); a gradient not asked for is an empty tensor."""
    vocab = weight.shape[0]
    valid, count = _check_labels(target, ignore_index, vocab, seq, shifted)
    t, idx = _select(target, valid, count)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    gh = _hidden_grad_buffer(hidden, idx) if grad_hidden else None
    gw = _weight_grad_buffer(weight) if grad_weight else None
    gb = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if grad_bias else None
    for s in range(0, t.shape[0], chunk):
        rows = slice(s, s + chunk)
        hc, tc = _rows(hidden, idx, rows), t[rows]
        z, th = _chunk_logits(hc, weight, bias, softcap)
        _, losses = _softmax_(z, tc)
        loss += losses.sum()
        if gh is not None or gw is not None or gb is not None:
            _chunk_grads(_grad_logits_(z, tc, th, None), hc, weight, gh, rows, idx, gw, gb)
        del z, th, hc  # before the next chunk's GEMM allocates: one chunk of logits alive at a time
    return (loss, torch.tensor(float(count), device=hidden.device),
            gh if gh is not None else _empty(hidden),
            gw.to(weight.dtype) if gw is not None else _empty(weight),
            gb.to(bias.dtype) if gb is not None else _empty(weight))


_lce = torch.library.custom_op("ckpt_ext::linear_cross_entropy", _lce_impl, mutates_args=())


@_lce.register_fake
def _lce_fake(hidden, weight, bias, target, ignore_index, softcap, chunk, grad_hidden, grad_weight, grad_bias,
              seq, shifted):
    scalar = hidden.new_empty((), dtype=torch.float32)
    return (scalar, scalar.clone(), torch.empty_like(hidden) if grad_hidden else _empty(hidden),
            torch.empty_like(weight) if grad_weight else _empty(weight),
            torch.empty_like(bias) if grad_bias else _empty(weight))


def _lce_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[2:])
    ctx.has = inputs[7:10]
    ctx.mark_non_differentiable(output[1], output[2], output[3], output[4])


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _lce_backward(ctx, g_loss, g_count, g_gh, g_gw, g_gw_b):
    gh, gw, gb = ctx.saved_tensors
    has_h, has_w, has_b = ctx.has
    # Eager: scaled in place (the gradients are the operator's own outputs, dropped by its caller), so the
    # weight's gradient is not held twice when backward starts, the step's peak. A second backward through
    # the same graph (retain_graph) then meets autograd's error for a saved tensor modified in place, instead
    # of scaling twice. Traced (compile, AOT, fake tensors): out of place, which the compiler may reuse.
    eager = not _is_compiling() and all(type(t) is torch.Tensor for t in (g_loss, gh, gw, gb))  # not traced
    scale = (lambda t: t.mul_(g_loss.to(t.dtype))) if eager else (lambda t: t * g_loss.to(t.dtype))
    return (scale(gh) if has_h else None, scale(gw) if has_w else None, scale(gb) if has_b else None,
            None, None, None, None, None, None, None, None, None)


_lce.register_autograd(_lce_backward, setup_context=_lce_setup)


# The checkpoint's way: forward keeps the log-sum-exp of each row (float32, N values); backward computes the
# logits of each chunk again. Measured against the above in benchmarks/bench_head.py (docs/head.md).
@_no_autocast
def _lce_rc_impl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            softcap: float, chunk: int, seq: int, shifted: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(sum of the losses, count of trained rows, log-sum-exp per row (0 for ignored rows))."""
    vocab = weight.shape[0]
    valid, count = _check_labels(target, ignore_index, vocab, seq, shifted)
    t, idx = _select(target, valid, count)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    lses = torch.empty(t.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, t.shape[0], chunk):
        z, _ = _chunk_logits(_rows(hidden, idx, slice(s, s + chunk)), weight, bias, softcap)
        lses[s:s + chunk], losses = _softmax_(z, t[s:s + chunk])
        loss += losses.sum()
        del z
    if idx is not None:
        lses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device).index_copy_(0, idx, lses)
    return loss, torch.tensor(float(count), device=hidden.device), lses


_lce_rc = torch.library.custom_op("ckpt_ext::linear_cross_entropy_recompute", _lce_rc_impl, mutates_args=())


@_lce_rc.register_fake
def _lce_rc_fake(hidden, weight, bias, target, ignore_index, softcap, chunk, seq, shifted):
    scalar = hidden.new_empty((), dtype=torch.float32)
    return scalar, scalar.clone(), hidden.new_empty(hidden.shape[0], dtype=torch.float32)


@_no_autocast
def _lce_rc_bwd_impl(grad: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                lse: Tensor, ignore_index: int, softcap: float, chunk: int, grad_hidden: bool, grad_weight: bool,
                grad_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    valid = target != ignore_index
    count = int(valid.sum())
    t, idx = _select(target, valid, count)
    lse = lse if idx is None else lse.index_select(0, idx)
    gh = _hidden_grad_buffer(hidden, idx) if grad_hidden else None
    gw = _weight_grad_buffer(weight) if grad_weight else None
    gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device) if grad_bias else None
    scale = grad.float()
    for s in range(0, t.shape[0], chunk):
        rows = slice(s, s + chunk)
        hc = _rows(hidden, idx, rows)
        z, th = _chunk_logits(hc, weight, bias, softcap)
        p = z.sub_(lse[rows].unsqueeze(1)).exp_()
        _chunk_grads(_grad_logits_(p, t[rows], th, scale), hc, weight, gh, rows, idx, gw, gb)
        del z, th, p, hc
    return (gh if gh is not None else _empty(hidden), gw.to(weight.dtype) if gw is not None else _empty(weight),
            gb.to(bias.dtype) if gb is not None else _empty(weight))


_lce_rc_bwd = torch.library.custom_op("ckpt_ext::linear_cross_entropy_backward", _lce_rc_bwd_impl, mutates_args=())


@_lce_rc_bwd.register_fake
def _lce_rc_bwd_fake(grad, hidden, weight, bias, target, lse, ignore_index, softcap, chunk, grad_hidden,
                     grad_weight, grad_bias):
    return (torch.empty_like(hidden) if grad_hidden else _empty(hidden),
            torch.empty_like(weight) if grad_weight else _empty(weight),
            torch.empty_like(bias) if grad_bias else _empty(weight))


def _lce_rc_setup(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, softcap, chunk, _, _ = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[2])
    ctx.args = (ignore_index, softcap, chunk)
    ctx.mark_non_differentiable(output[1], output[2])


def _lce_rc_backward(ctx, g_loss, g_count, g_lse):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    need = ctx.needs_input_grad
    gh, gw, gb = _lce_rc_bwd(g_loss, hidden, weight, bias, target, lse, *ctx.args, need[0], need[1],
                             bias is not None and need[2])
    return (gh if need[0] else None, gw if need[1] else None, gb if bias is not None and need[2] else None,
            None, None, None, None, None, None)


_lce_rc.register_autograd(_lce_rc_backward, setup_context=_lce_rc_setup)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                         ignore_index: int = -100, num_items_in_batch=None, shift_labels: Optional[Tensor] = None,
                         shift: bool = True, softcap: Optional[float] = None, chunk: Optional[int] = None,
                         recompute: bool = False) -> Tensor:
    """Hugging Face's ``ForCausalLMLoss(F.linear(hidden, weight, bias), labels, ...)`` without the logits.

    hidden: [..., S, H] (the last hidden states, after ``logits_to_keep``); weight: [V, H]; labels: [..., S].
    With ``shift`` (HF's causal shift) row s is scored against labels[s + 1], the last against nothing;
    ``shift_labels`` (already shifted) replaces it as in HF. The loss is the mean over the trained rows, or
    their sum / ``num_items_in_batch`` (Trainer's gradient accumulation); no trained row: nan (the mean) as HF.
    ``softcap``: Gemma's final_logit_softcapping, cap * tanh(logits / cap) before the loss. Under autocast the
    logits are computed in the autocast dtype (as HF's lm_head) and upcast to float32 for the loss (as HF)."""
    if shift_labels is None:
        if shift:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = labels
    else:
        shift = False
    vocab, width = weight.shape
    if hidden.shape[:-1] != shift_labels.shape:
        raise ValueError(f"ckpt_ext linear_cross_entropy: hidden states {tuple(hidden.shape)} do not match labels "
                         f"{tuple(shift_labels.shape)} (one label per position; with labels, logits_to_keep must keep "
                         "every position, as in Hugging Face's loss)")
    seq = shift_labels.shape[-1] if shift_labels.dim() >= 2 else 0
    h = hidden.reshape(-1, width)
    t = shift_labels.reshape(-1).to(device=h.device, dtype=torch.long)
    dev = h.device.type
    if torch.is_autocast_enabled(dev) if hasattr(torch, "get_autocast_dtype") else torch.is_autocast_enabled():
        # What autocast makes of HF's lm_head (F.linear): both operands in the autocast dtype.
        dtype = torch.get_autocast_dtype(dev) if hasattr(torch, "get_autocast_dtype") else (
            torch.get_autocast_gpu_dtype() if dev == "cuda" else torch.get_autocast_cpu_dtype())
        h, weight = h.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    elif h.dtype != weight.dtype:
        raise TypeError(f"ckpt_ext linear_cross_entropy: hidden states are {h.dtype} and the head's weight "
                        f"{weight.dtype} (outside autocast they must match, as for F.linear)")
    rows = chunk if chunk is not None else chunk_rows(vocab)
    cap = float(softcap) if softcap else 0.0
    if recompute:
        loss, count, _ = _lce_rc(h, weight, bias, t, ignore_index, cap, rows, seq, shift)
    else:
        need = torch.is_grad_enabled()
        loss, count, _, _, _ = _lce(h, weight, bias, t, ignore_index, cap, rows, need and h.requires_grad,
                                    need and weight.requires_grad,
                                    need and bias is not None and bias.requires_grad, seq, shift)
    if num_items_in_batch is None:
        # HF's mean: nan for a batch without a trained token, and zero gradients (not nan's 0 * inf).
        return torch.where(count > 0, loss / count.clamp(min=1), torch.full_like(loss, float("nan")))
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
