// SegmentFunction: K consecutive fused transformer layers (csrc/layers/) as ONE autograd node.
//
// Forward runs the K layer forwards without building a graph and writes the segment's output straight
// into a BoundaryPool slot (the last fused op computes into it, no copy); only the segment's input is
// saved (without copying: in a chain of segments it is the previous segment's pooled output). The
// dropout seed of each layer is drawn once in forward and kept in the node, with the autocast state
// of the forward (the replay's layer forwards run under it).
//
// Backward replays the K layers in C++ from the saved input, with grad enabled and the same seeds (so
// the same dropout masks), then calls torch::autograd::grad once for the input's gradient and every
// parameter's. The replay runs on detached aliases of the parameters, so that grad never reaches the
// real leaves: their tensor hooks, AccumulateGrad (and DDP/FSDP hooks) fire once, when this node's
// gradients reach them. All parameters are inputs of the node. The last layer is replayed through the
// layers' replay interface (layer.h: replay_forward / replay_backward), which lets a family skip its
// last linear (GPT-2, Llama: its gradients come directly from the incoming gradient, saving one of
// the layer's four large GEMMs). The segment knows no family.
//
// BERT/RoBERTa (layers::PreNormBoundary): a segment keeps its last layer's pre-norm sum and norm statistics
// instead, its replay stops before that layer's output linear and norm, and the next segment, called on this
// segment's unchanged output, keeps that sum rather than its input and recomputes the input from it
// (pre_norm_boundaries below).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "../layers/layer.h"  // the layers floor's public interface

namespace ckpt_ext {

// `weights[l]`: the weights of layer l (layers::check_weights order; undefined = absent bias).
// `training`: dropout active. Returns the segment output (pooled, differentiable).
// `keep_attention`: each layer's attention output and log-sum-exp (CUDA: and dropout state) are kept in
// pool slots from forward to backward, and the replay runs the layers without the attention forward,
// calling the attention kernel's backward op with them (layers::KeptAttention). A layer whose attention
// runs no kernel with a log-sum-exp (SDPA's math path, attention dropout on CPU) keeps nothing and is
// replayed in full; `not_kept` (when given) receives, per layer, why ("" for a layer that kept its attention).
// `gemm_level` (recompute levels, layers::KeptGemms): 0 keeps no GEMM output, 1 each layer's q/k/v projection, 2
// every GEMM's (the last layer's last linear excepted: its replay skips it anyway); the replay hands them back
// (bit-identical gradients). `gemm_bytes` / `gemm_not_kept` (when given) receive, per layer, the bytes kept and why
// nothing was ("" otherwise: LoRA adapters).
// `pre_norm_boundary` (this call; ANDed with the process-wide pre_norm_boundaries()): false, the segment neither
// keeps a pre-norm boundary nor takes the one before as its input (it keeps its input and replays in full).
at::Tensor segment_apply(const std::vector<layers::LayerSpec>& specs, const at::Tensor& hidden,
                         const layers::LayerInputs& inputs, const std::vector<std::vector<at::Tensor>>& weights,
                         bool training, bool keep_attention = false, std::vector<std::string>* not_kept = nullptr,
                         int gemm_level = 0, std::vector<int64_t>* gemm_bytes = nullptr,
                         std::vector<std::string>* gemm_not_kept = nullptr, bool pre_norm_boundary = true);

// BERT's pre-norm boundary between eager segments (layers::PreNormBoundary): a segment whose last layer has one
// keeps it (not its output) and replays without that layer's output linear and norm; a segment called on such
// a segment's output (unchanged) keeps not its input but that boundary, recomputing the input in its replay.
// Under torch.compile the operator pair ckpt_ext::fused_segment_boundary / _backward (below) carries the same
// boundary between the operators (ckpt_ext/compiled.py, stack.py's traced hand-over; docs/compile.md). On by
// default (eager and compiled); `enable` sets it (tests compare both); returns the setting before the call.
bool pre_norm_boundaries(std::optional<bool> enable);

// The operators ckpt_ext::fused_segment(specs, hidden, mask, cos, sin, weights, layout, training, seeds,
// autocast_dtype) -> out and ckpt_ext::fused_segment_backward(..., needs) -> grads: the same segment as a
// pure function of its inputs, for torch.compile (ckpt_ext/compiled.py: fake kernels and autograd). The
// layers are named by ids from register_spec; `weights` holds the present weights, `layout` each layer's
// slots in turn (index into weights, -1: absent bias); `seeds` (int64, one per layer) replaces the draw;
// the backward replays the segment from `hidden` in C++.
// ckpt_ext::fused_segment_boundary(..., bool keep_boundary, Tensor? in_pre_norm, int in_spec, Tensor? in_ln_weight,
// Tensor? in_ln_bias) -> (out, pre_norm, mean, rstd) and ckpt_ext::fused_segment_boundary_backward(..., needs,
// pre_norm, mean, rstd, in_pre_norm, in_spec, in_ln_weight, in_ln_bias) -> grads: the same with BERT's pre-norm
// boundary: `keep_boundary` returns the last layer's (empty [0] tensors otherwise), which the backward's replay goes
// back from; `in_pre_norm` (the segment before's, whose output `hidden` is) is what the backward recomputes its
// input from (`hidden` then not given), with the producing layer's last norm (spec id, weight, bias).
int64_t register_spec(const layers::LayerSpec& spec);
const layers::LayerSpec& registered_spec(int64_t id);

}  // namespace ckpt_ext
