"""Fused layers under torch.compile: the operators ``ckpt_ext::fused_segment`` and ``fused_segment_backward``.

The eager fused path (``_C.fused_layer_forward``, ``_C.segment_apply``) is pybind code that builds C++
autograd graphs and draws dropout seeds on the host: Dynamo cannot trace it. While Dynamo traces, a
fused layer or a checkpointed group of fused layers is instead one call of the registered operator
``ckpt_ext::fused_segment`` (csrc/segment/segment_function.cpp): a pure function of the hidden states,
mask, rotary tables, weights and an int64 tensor of dropout seeds (one per layer), which runs the
layers in C++ without a graph and writes its output into the BoundaryPool. Its autograd formula
(registered here) calls ``ckpt_ext::fused_segment_backward``, which replays the layers in C++ from the
saved input with the same seeds, as SegmentFunction's backward does. The compiled graph therefore holds
ATen ops and these operators only: no graph break, and AOTAutograd saves the segment's input (its
boundary) and nothing inside it.

The seeds are drawn in the graph (``torch.randint`` on the default CPU generator), so they are a graph
value, not a constant: no recompilation per step, and a new mask every step. They differ from the
seeds the eager path draws in C++ (other numbers from the same generator), so a compiled model with
dropout draws other masks than the same model run eagerly, as any compiled dropout does; the replay
uses the forward's seeds, so gradients are exact for the masks drawn.

BERT's pre-norm boundary (C++ layers::PreNormBoundary; what the eager segments do: SegmentState::keeps_boundary /
input_from): a checkpointed BERT group is ``ckpt_ext::fused_segment_boundary`` instead, which also returns its last
layer's pre-norm sum and row statistics (non-differentiable outputs saved for its own backward, whose replay then
stops before that layer's output linear and GELU), and, given the pre-norm sum of the group before (whose output is
its input: stack.py hands it over while Dynamo traces), saves that sum instead of its input and recomputes the
input from it in backward. The same ops run in the compiled replay as in the eager one, and the same tensors are
held (docs/compile.md).

A fused layer that is not checkpointed runs, in training, as the eager fused layer behind a graph break
(fused._traced_forward); where the graph may not break (fullgraph=True, torch.export) it is the one-layer
segment: its backward replays the layer (one extra layer forward), where the eager path keeps its activations.

peft LoRA adapters (FusedTransformerLayer._op_args): each adapter projection's A and B are weights of the
call (after the layer's own; an absent adapter is two -1 layout entries), its scaling and adapter dropout
are in the layer spec (the layer's spec with_lora, registered once per configuration: its id is a constant
of the graph), so the replay differentiates them as any weight and the adapter dropout uses the layer's seed.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from ._extension import load
from ._layout import BERT, FAMILIES

_C = load()

__all__ = ["fused_segment"]

# BERT's weight slots the pre-norm boundary reads (C++ bert.cpp's order): the last norm's weight and bias, and
# where the output linear's LoRA A sits among a layer's operator weights (its slots, then A and B per projection).
_BERT_SLOTS = FAMILIES["bert"][1]
_LN2_WEIGHT, _LN2_BIAS = _BERT_SLOTS.index("ln2_weight"), _BERT_SLOTS.index("ln2_bias")
_OUT_LORA_A = len(_BERT_SLOTS) + 2 * _C.layer_adapters()["bert"].index("out_weight")

_SEED_HIGH = 1 << 62
# Tests only: True runs the operators outside torch.compile too (the eager reference of the compiled path).
USE_OPS_EAGERLY = False


def use_ops() -> bool:
    """Whether fused layers take the operator path: while Dynamo traces (or when forced, for tests)."""
    return torch.compiler.is_compiling() or USE_OPS_EAGERLY


def operator_args(layers: Sequence) -> Tuple[List[int], List[torch.Tensor], List[int], bool]:
    """(spec ids, weights, layout, whether any layer draws dropout in training) of fused layers
    (FusedTransformerLayer), as ``ckpt_ext::fused_segment`` takes them: per weight slot of each layer in turn
    (peft LoRA adapters' A and B after the layer's own), its index in weights, or -1 for an absent one."""
    ids: List[int] = []
    weights: List[torch.Tensor] = []
    layout: List[int] = []
    dropout = False
    for layer in layers:
        spec_id, has_dropout, layer_weights = layer._op_args()  # peft LoRA adapters included
        ids.append(spec_id)
        for w in layer_weights:
            layout.append(-1 if w is None else len(weights))
            if w is not None:
                weights.append(w)
        dropout = dropout or has_dropout
    return ids, weights, layout, dropout


def fused_segment(layers: Sequence, hidden: torch.Tensor, mask: Optional[torch.Tensor], cos: Optional[torch.Tensor],
                  sin: Optional[torch.Tensor], training: bool, keep_boundary: bool = False,
                  taken: Optional[Tuple[torch.Tensor, object]] = None):
    """Fused layers (FusedTransformerLayer) run as one ``ckpt_ext::fused_segment`` call. Returns the output,
    or, with ``keep_boundary`` or ``taken`` (BERT's pre-norm boundary, stack.py's traced hand-over), the pair
    (output, the kept pre-norm sum or None) of one ``ckpt_ext::fused_segment_boundary`` call:
    ``keep_boundary`` (only where ``has_pre_norm_boundary(layers[-1])``): the segment keeps its last layer's
    pre-norm sum and row statistics for its replay, which then stops before that layer's output linear;
    ``taken`` = (pre-norm sum, producing fused layer): ``hidden`` is that layer's output, and the segment keeps
    the sum instead of ``hidden``, recomputing it in backward."""
    ids, weights, layout, dropout = operator_args(layers)
    if training and dropout:
        seeds = torch.randint(0, _SEED_HIGH, (len(ids),), dtype=torch.int64)
    else:
        seeds = torch.zeros(len(ids), dtype=torch.int64)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if not keep_boundary and taken is None:
        return torch.ops.ckpt_ext.fused_segment(ids, hidden, mask, cos, sin, weights, layout, training, seeds, dtype)
    in_pre_norm, in_spec, in_ln_w, in_ln_b = None, -1, None, None
    if taken is not None:
        in_pre_norm, producer = taken
        in_spec, _, producer_weights = producer._op_args()
        in_ln_w, in_ln_b = producer_weights[_LN2_WEIGHT], producer_weights[_LN2_BIAS]
    out, pre_norm, _, _ = torch.ops.ckpt_ext.fused_segment_boundary(
        ids, hidden, mask, cos, sin, weights, layout, training, seeds, dtype, keep_boundary, in_pre_norm, in_spec,
        in_ln_w, in_ln_b)
    return out, (pre_norm if keep_boundary else None)


def has_pre_norm_boundary(layer) -> bool:
    """Whether a fused layer ends in BERT's pre-norm boundary the replay can go back from (C++
    layers::has_pre_norm_boundary): a BERT/RoBERTa layer without a LoRA adapter on its output linear."""
    if layer.family != BERT:
        return False
    weights = layer._op_args()[2]
    return len(weights) <= _OUT_LORA_A or weights[_OUT_LORA_A] is None


@torch.compiler.assume_constant_result
def pre_norm_boundaries_enabled() -> bool:
    """_C.pre_norm_boundaries(), read while Dynamo traces as a constant of the graph (it is switched between
    steps by tests and benchmarks, which reset Dynamo)."""
    return bool(_C.pre_norm_boundaries())


# ---- fake kernels and autograd ---------------------------------------------------------------------------


@torch.library.register_fake("ckpt_ext::fused_segment")
def _fused_segment_fake(specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.register_fake("ckpt_ext::fused_segment_backward")
def _fused_segment_backward_fake(specs, grad_out, hidden, mask, cos, sin, weights, layout, training, seeds,
                                 autocast_dtype, needs):
    out = [torch.empty_like(hidden, memory_format=torch.contiguous_format)] if needs[0] else []
    out += [torch.empty_like(w, memory_format=torch.contiguous_format) for w, n in zip(weights, needs[1:]) if n]
    return out


def _setup_context(ctx, inputs, output):
    specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype = inputs
    ctx.options = (specs, layout, training, autocast_dtype)
    ctx.needs = [int(hidden.requires_grad)] + [int(w.requires_grad) for w in weights]
    ctx.save_for_backward(hidden, mask, cos, sin, seeds, *weights)


def _backward(ctx, grad):
    specs, layout, training, autocast_dtype = ctx.options
    hidden, mask, cos, sin, seeds, *weights = ctx.saved_tensors
    needs = ctx.needs
    grads = iter(torch.ops.ckpt_ext.fused_segment_backward(specs, grad, hidden, mask, cos, sin, weights, layout,
                                                           training, seeds, autocast_dtype, needs))
    grad_hidden = next(grads) if needs[0] else None
    grad_weights = [next(grads) if n else None for n in needs[1:]]
    return None, grad_hidden, None, None, None, grad_weights, None, None, None, None


torch.library.register_autograd("ckpt_ext::fused_segment", _backward, setup_context=_setup_context)


# ---- the pre-norm boundary's operator pair (ckpt_ext::fused_segment_boundary) --------------------------------------


@torch.library.register_fake("ckpt_ext::fused_segment_boundary")
def _fused_segment_boundary_fake(specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype,
                                 keep_boundary, in_pre_norm, in_spec, in_ln_weight, in_ln_bias):
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if not keep_boundary:
        return out, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    stats = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return (out, hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape[:-1], dtype=stats),
            hidden.new_empty(hidden.shape[:-1], dtype=stats))


@torch.library.register_fake("ckpt_ext::fused_segment_boundary_backward")
def _fused_segment_boundary_backward_fake(specs, grad_out, hidden, mask, cos, sin, weights, layout, training, seeds,
                                          autocast_dtype, needs, pre_norm, mean, rstd, in_pre_norm, in_spec,
                                          in_ln_weight, in_ln_bias):
    x = hidden if hidden is not None else in_pre_norm
    out = [torch.empty_like(x, memory_format=torch.contiguous_format)] if needs[0] else []
    out += [torch.empty_like(w, memory_format=torch.contiguous_format) for w, n in zip(weights, needs[1:]) if n]
    return out


def _boundary_setup_context(ctx, inputs, output):
    (specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype, keep_boundary, in_pre_norm,
     in_spec, in_ln_weight, in_ln_bias) = inputs
    _, pre_norm, mean, rstd = output
    ctx.mark_non_differentiable(pre_norm, mean, rstd)
    ctx.options = (specs, layout, training, autocast_dtype, keep_boundary, in_spec)
    ctx.needs = [int(hidden.requires_grad)] + [int(w.requires_grad) for w in weights]
    # A segment given the pre-norm sum of the one before keeps that sum (which that segment keeps anyway), not its
    # input: the segment before's output is then held by nobody after the forward.
    kept = (None, in_pre_norm, in_ln_weight, in_ln_bias) if in_pre_norm is not None else (hidden, None, None, None)
    boundary = (pre_norm, mean, rstd) if keep_boundary else (None, None, None)
    ctx.save_for_backward(*kept, *boundary, mask, cos, sin, seeds, *weights)


def _boundary_backward(ctx, grad, *_):
    specs, layout, training, autocast_dtype, keep_boundary, in_spec = ctx.options
    hidden, in_pre_norm, in_ln_weight, in_ln_bias, pre_norm, mean, rstd, mask, cos, sin, seeds, *weights = \
        ctx.saved_tensors
    needs = ctx.needs
    grads = iter(torch.ops.ckpt_ext.fused_segment_boundary_backward(
        specs, grad, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype, needs, pre_norm, mean,
        rstd, in_pre_norm, in_spec, in_ln_weight, in_ln_bias))
    grad_hidden = next(grads) if needs[0] else None
    grad_weights = [next(grads) if n else None for n in needs[1:]]
    return (None, grad_hidden, None, None, None, grad_weights, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("ckpt_ext::fused_segment_boundary", _boundary_backward,
                                setup_context=_boundary_setup_context)
