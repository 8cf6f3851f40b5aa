// Inside the layers floor: what a family file (bert.cpp, gpt2.cpp, llama.cpp) provides, and the shared
// pieces the families are built from (attention.cpp, residual_linear.cpp). Not for code outside
// csrc/layers/, which uses layer.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "../common/optional.h"
#include "layer.h"

namespace ckpt_ext {
namespace layers {

// The last linear of a layer whose output only feeds the residual sum (GPT-2, Llama): which weights it
// uses and how.
struct LastLinear {
  Tensor weight;
  Tensor bias;   // may be undefined
  bool conv1d;   // weight is [in, out] (GPT-2 Conv1D) rather than [out, in] (nn.Linear)
  double p;      // dropout probability (0 when not training)
  int64_t offset;
  int64_t weight_slot;  // positions of weight and bias in the family's weight list
  int64_t bias_slot;
};

// One family: its slots and checks, its forward, and (optional) its last linear.
struct LayerFamily {
  FamilyInfo info;
  // Shapes and presence of the family's weights (count, device and dtype are checked by the caller).
  void (*check_weights)(const LayerSpec&, const std::vector<Tensor>& weights);
  // `stop`: return before the last linear (only when last_linear is set); `out_slot`: see layer_forward.
  // `kept`: keep-attention (layer.h), passed on to attention().
  LayerOutput (*forward)(const LayerSpec&, const Tensor& x, const LayerInputs&, const std::vector<Tensor>& w,
                         const LayerRng&, const Tensor& out_slot, bool stop, KeptAttention* kept);
  // nullptr when the family's forward cannot stop before its last linear.
  LastLinear (*last_linear)(const LayerSpec&, const std::vector<Tensor>& w, const LayerRng&);
};

extern const LayerFamily kBertFamily;
extern const LayerFamily kGpt2Family;
extern const LayerFamily kLlamaFamily;
extern const LayerFamily kQwen3Family;
extern const LayerFamily kGemmaFamily;
extern const LayerFamily kGemma3Family;
extern const LayerFamily kGemma2Family;

// ---- shared pieces ----------------------------------------------------------------------------------------

inline double effective(double p, const LayerRng& rng) { return rng.training ? p : 0.0; }

// Autocast (layer.h): `t` in `ref`'s dtype -- a GEMM output (autocast dtype) joining the residual
// stream, or a bias / rotary table joining a tensor in the GEMM's dtype. Outside autocast the dtypes
// already agree and nothing is copied.
inline Tensor like(const Tensor& t, const Tensor& ref) {
  return !t.defined() || t.scalar_type() == ref.scalar_type() ? t : t.to(ref.scalar_type());
}
inline OptTensor opt_like(const Tensor& t, const Tensor& ref) { return opt(like(t, ref)); }

// Autocast (issue 32): a GEMM's output `t` joining the float32 stream at a norm op (bias_dropout_add_layer_norm,
// add_rms_norm) is handed to the op as it is, bfloat16/float16, where mixed_dtype_norms() (layer.h) is on: the
// op reads it as float (the same bits as like()'s cast, without its pass over [T, H] and its backward's).
inline bool mixed_norm_input(const Tensor& t, const Tensor& stream) {
  const auto dt = t.scalar_type();
  return mixed_dtype_norms() && stream.scalar_type() == at::kFloat && (dt == at::kBFloat16 || dt == at::kHalf);
}
inline Tensor norm_input(const Tensor& t, const Tensor& stream) {
  return mixed_norm_input(t, stream) ? t : like(t, stream);
}

// Autocast (issue 32; layer.h's mixed_dtype_norm_outputs): the dtype a norm beside the float32 `stream` writes an
// output in that feeds only GEMMs -- autocast's (bfloat16/float16), which the GEMMs' own cast would round the
// float output to -- or nullopt (the stream's: the switch off, outside autocast, not float32).
std::optional<at::ScalarType> gemm_input_dtype(const Tensor& stream);

// a @ b as Tensor::mm (2-D or 3-D), recording no autograd (for use inside autograd functions), in the
// layout gemm_linear's policy picks (layer.h).
Tensor gemm_mm(const Tensor& a, const Tensor& b);
// acc += a @ b in place (2-D, one GEMM with beta = 1), recording no autograd, in gemm_mm's layout.
Tensor& gemm_addmm_(Tensor& acc, const Tensor& a, const Tensor& b);

// gemm_linear(x, w)'s gradients (no bias), computed directly as its autograd backward computes them (the same
// products in the same layouts): {x's (when need_x), w's (when need_w)}. `grad` and `w` in x's dtype (autocast:
// the caller casts as autocast cast the forward's operands).
std::pair<Tensor, Tensor> gemm_linear_grads(const Tensor& grad, const Tensor& x, const Tensor& w, bool need_x,
                                            bool need_w);

// BERT's pre-norm boundary (bert.cpp; layer.h describes it).
bool bert_has_pre_norm_boundary(const LayerSpec& s, const std::vector<Tensor>& w);
Tensor bert_output_from_pre_norm(const LayerSpec& s, const std::vector<Tensor>& w, const Tensor& pre_norm);
ReplayBackward bert_pre_norm_backward(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng,
                                      const LayerOutput& replayed, PreNormBoundary b, const Tensor& grad_out,
                                      const std::vector<bool>& need_slot);

// y = x @ W + b for a Conv1D weight [in, out], as Hugging Face computes it.
Tensor conv1d(const Tensor& x, const Tensor& w, const Tensor& b, int site = -1);
// x @ W (no bias: the bias is fused into the following op), keeping x's leading dims.
Tensor conv1d_nobias(const Tensor& x, const Tensor& w, int site = -1);

// ---- recompute levels (layer.h's KeptGemms; gemm.cpp) ----
// Makes `gemms` the active KeptGemms of this thread for its lifetime (nullptr: none).
class KeptGemmsScope {
 public:
  explicit KeptGemmsScope(KeptGemms* gemms);
  ~KeptGemmsScope();
  KeptGemmsScope(const KeptGemmsScope&) = delete;
  KeptGemmsScope& operator=(const KeptGemmsScope&) = delete;

 private:
  KeptGemms* prev_;
};
// The replay: the output kept for `site` (undefined when nothing is kept there or no replay is active).
Tensor kept_gemm(int site);
// The forward: keeps `y` as the output of `site` when a recording KeptGemms selects it.
void record_gemm(int site, const Tensor& y);
// A non-tensor argument of an autograd function carrying a kept output (not an input of the node).
struct KeptTensor {
  Tensor t;
};
// The concatenation of the parts along dim 0, or undefined when one is (absent q/k/v biases).
Tensor cat_or_undefined(std::initializer_list<Tensor> parts);

// Splits the fused [B, S, (q_heads + 2 * kv_heads) * D] projection into q, k, v as [B, heads, S, D] views.
std::array<Tensor, 3> split_qkv(const Tensor& qkv, int64_t q_heads, int64_t kv_heads, int64_t head_dim);
// q, k, v as split_qkv returns them, of x's projection by w = {Wq, Wk, Wv} (+ b, all three or none), as one
// autograd node (qkv.cpp): one GEMM over the concatenated weights; its backward takes dq, dk, dv apart
// (no [T, q + 2 kv] gradient concatenated, no concatenated weight saved). Casts as linear under autocast.
// Under a KeptGemms (site kQkv), the projection is kept in forward, and the replay returns the kept one as a node
// with the same backward. `residual` (x also a residual, BERT's LN1): set to the handle of x to use as that residual
// -- under autocast, where x is cast for the GEMM, an alias of x returned by the node, whose backward adds its
// gradient to dx in one mixed-dtype add instead of the cast's backward and autograd's add (issue 32); else x.
std::array<Tensor, 3> qkv_heads(const Tensor& x, std::array<Tensor, 3> w, std::array<Tensor, 3> b, int64_t q_heads,
                                int64_t kv_heads, int64_t head_dim, Tensor* residual = nullptr);
// [B, heads, S, D] -> [B, S, heads * D] (contiguous).
Tensor merge_heads(const Tensor& ctx);

// Multi-head attention of q [B, heads, S, D] over k, v [B, kv_heads, S, D] -> [B, heads, S, D]. The kernel
// is SDPA's own choice (at::_fused_sdp_choice); a fused kernel with a log-sum-exp (CPU: flash; CUDA: flash,
// memory-efficient, cuDNN) is called directly, the rest (the math path) through
// at::scaled_dot_product_attention. `mask`: see LayerInputs; `causal` applies only when there is no mask
// (Hugging Face passes causal masks explicitly when padding is present). p > 0: SDPA's dropout, drawn
// from the device's default generator set to a state derived from (seed, offset) for the call and
// restored afterwards (rng.h). `kept`: keep-attention (layer.h): fill it (no grad), or replay from it;
// a path without a log-sum-exp fills only kept->not_kept (the reason) and runs as without `kept`.
// `softcap` > 0 (Gemma 2): scores = tanh(scores * scale / softcap) * softcap before the mask, which no SDPA kernel
// computes: the attention written out as Hugging Face's eager attention computes it (never kept).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset, KeptAttention* kept = nullptr, double softcap = 0.0);

// LoRA: the adapter term scaling_j * (dropout(x) A_j^T) B_j^T of projection j (FamilyInfo::lora), or
// undefined when the projection has no adapter in this call.
Tensor lora_delta(const LayerSpec& s, const std::vector<Tensor>& w, int64_t j, const Tensor& x, const LayerRng& rng);
// y + delta, computed in the wider dtype of the two and returned in y's (y itself when delta is undefined).
Tensor plus_lora(const Tensor& y, const Tensor& delta);
// y + the adapter terms of the q, k and v projections j (all reading x), concatenated along the last dim
// as the fused qkv projection y is (`widths`: each part's width; a projection without adapter adds
// nothing to its part). With all three adapted and no adapter dropout in this call, the terms come from
// two GEMMs in all instead of six. y itself when none is adapted.
Tensor plus_lora_qkv(const LayerSpec& s, const std::vector<Tensor>& w, std::array<int64_t, 3> j, const Tensor& x,
                     const Tensor& y, std::array<int64_t, 3> widths, const LayerRng& rng);
// Whether any of the projections j has an adapter in this call.
bool any_adapter(const LayerSpec& s, const std::vector<Tensor>& w, std::array<int64_t, 3> j);
// Shapes of the adapter slots against their base weights.
void check_lora(const LayerSpec& s, const std::vector<Tensor>& w);

// The end of a GPT-2/Llama layer: out = h1 + dropout(act @ W + b) through the family's last linear,
// written into out_slot when given; with `stop`, only what the segment replay needs to skip it. `lora`:
// the linear's adapter term (lora_delta of act) or undefined; with one, the layer runs whole (`stop` is
// ignored: the replay's direct gradients of the last linear know no adapter) and autograd differentiates it.
LayerOutput last_linear_tail(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng,
                             const LastLinear& lin, const Tensor& act, const Tensor& h1, const Tensor& out_slot,
                             bool stop, const Tensor& lora = Tensor());

// out = residual + dropout(x @ W^T + b) (nn.Linear) or residual + dropout(x @ W + b) (Conv1D), as one
// autograd node whose backward is residual_linear_backward.
Tensor residual_linear(const Tensor& x, const LastLinear& lin, const Tensor& residual, int64_t seed);

struct ResidualLinearGrads {
  Tensor x, weight, bias;  // undefined where not asked for; the residual's gradient is `grad` itself
};
// The backward of residual_linear, also called directly by the segment replay (so that both give
// bit-identical gradients).
ResidualLinearGrads residual_linear_backward(const Tensor& grad, const Tensor& x, const LastLinear& lin, int64_t seed,
                                             bool need_x, bool need_weight, bool need_bias);

// The replay stopped before the activation (layer.h's StoppedActivation; issue 33): one node (a root computing
// nothing in forward) whose backward runs the last linear's input gradient, the activation's backward writing the
// linear's input (the _act_ ops), and the linear's weight and bias gradients; and the residual with grad_out.
ReplayBackward last_linear_act_backward(const LastLinear& lin, const StoppedActivation& act, const Tensor& residual,
                                        const Tensor& grad_out, int64_t seed);
// Whether a replay with `stop` stops before the activation: the switch on, no adapter on the last linear (it reads
// the activation's output), and the activation's inputs the replay's own (`kept`: one is a GEMM output kept in
// forward, which the backward must not overwrite; such a layer keeps the replay before the last linear).
inline bool stops_before_activation(bool stop, bool last_linear_adapter, bool kept) {
  return stop && !last_linear_adapter && !kept && tail_activation_in_backward(std::nullopt);
}

// `t` must be [rows, cols] (messages name the family's layer).
void check_matrix(const LayerSpec& s, const char* name, const Tensor& t, int64_t rows, int64_t cols);
// Weight slot i must be present.
void check_present(const LayerSpec& s, const std::vector<Tensor>& w, int64_t i, const char* what);

}  // namespace layers
}  // namespace ckpt_ext
