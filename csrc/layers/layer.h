// Fused transformer layers: pure forward functions of (hidden states, mask / rotary tables, weights,
// dropout seed) for three families, built from ATen matmuls, at::scaled_dot_product_attention and the
// ckpt_ext ops (called through the dispatcher, so they record C++ autograd when grad mode is on).
//
//   BERT/RoBERTa encoder layer  post-LN, exact or tanh GELU, biases, padding mask, hidden and
//                               attention-probability dropout
//   GPT-2 block                 pre-LN, causal, Conv1D weights ([in, out]), resid/attn dropout
//   Llama decoder layer         RMSNorm, rotary q/k, SwiGLU, grouped-query attention, causal, optional
//                               biases, attention dropout
//
// Dropout: every dropout site of a layer call uses the call's seed and an offset of its own
// (DropoutSite), so a replay with the same seed draws the same masks. The seed is drawn once per call
// from the default generator of the device (draw_dropout_seed); the functions here never draw from
// the user's generator state. Residual dropout: the ckpt_ext Philox ops keyed by (seed, site).
// Attention dropout: SDPA's, from the device generator temporarily set to a state derived from
// (seed, kAttnProbs) (see attention()).
//
// Autocast (CUDA bfloat16/float16, CPU bfloat16): the layers follow Hugging Face's dtype policy. The
// GEMMs and SDPA, dispatched through autocast, run in the autocast dtype from the parameters; the
// norms compute from and return the residual stream's dtype (the parameters' dtype: float32 for
// float32 master weights), as LayerNorm on autocast's float32 list and Llama's RMSNorm do; a GEMM
// output joins the stream in the stream's dtype, a bias feeding an op in the GEMM's dtype is cast to
// it. Outside autocast every tensor has the model's dtype and none of these casts happen.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ckpt_ext {
namespace layers {

using at::Tensor;

enum class Family : int64_t { kBert = 0, kGPT2 = 1, kLlama = 2 };

const char* family_name(Family f);

// The configuration of one layer: everything besides weights and inputs.
struct LayerSpec {
  Family family = Family::kBert;
  int64_t hidden = 0;        // model width
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // key/value heads (< num_heads: grouped-query attention, Llama only)
  int64_t head_dim = 0;
  double scaling = 1.0;      // attention score scale
  double attn_p = 0.0;       // attention-probability dropout
  double hidden_p = 0.0;     // BERT hidden_dropout_prob, GPT-2 resid_pdrop; 0 for Llama
  double eps = 1e-5;         // LayerNorm / RMSNorm epsilon
  bool gelu_tanh = false;    // BERT/GPT-2: tanh-approximated GELU instead of the exact one

  // Checks that the fields describe a layer; throws with a clear message otherwise.
  void validate() const;
  std::string repr() const;
};

// Weight slots, in the order the Python side passes them. Optional biases may be undefined tensors.
namespace bert {
enum : int64_t { kQW, kQB, kKW, kKB, kVW, kVB, kAttnOutW, kAttnOutB, kLn1W, kLn1B, kInterW, kInterB, kOutW, kOutB,
                 kLn2W, kLn2B, kCount };
}
namespace gpt2 {
enum : int64_t { kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB, kLn2W, kLn2B, kFcW, kFcB, kMlpProjW, kMlpProjB,
                 kCount };
}
namespace llama {
enum : int64_t { kLn1W, kQW, kQB, kKW, kKB, kVW, kVB, kOW, kOB, kLn2W, kGateW, kGateB, kUpW, kUpB, kDownW, kDownB,
                 kCount };
}

int64_t weight_count(Family f);
// Checks count, presence of the required weights, and device/dtype against the hidden states.
void check_weights(const LayerSpec& spec, const std::vector<Tensor>& weights, const Tensor& hidden);

// Non-weight inputs of a layer call, as Hugging Face's stack passes them.
struct LayerInputs {
  Tensor mask;  // undefined, bool (true = attend) or additive float; broadcastable to [B, heads, S, S]
  Tensor cos;   // Llama: rotary tables [B or 1, S, head_dim]
  Tensor sin;
};

// Dropout offsets of the sites of one layer call (all under the call's seed).
enum DropoutSite : int64_t { kAttnProbs = 0, kAttnOut = 1, kMlpOut = 2 };

struct LayerRng {
  bool training = false;  // dropout active (module.training)
  int64_t seed = 0;
};

// A random 64-bit dropout seed from the default generator of `device`. CPU: one draw of the
// mt19937 generator. Philox devices (CUDA): the generator's (seed, offset) reserves 4 offsets, as
// torch's own dropout does, and the pair is hashed into the seed -- no synchronisation.
int64_t draw_dropout_seed(c10::Device device);

// True when a call of this layer draws a seed (training and some dropout probability > 0).
bool uses_dropout(const LayerSpec& spec, bool training);

// What a layer forward returns. With stop_before_last_linear (GPT-2 and Llama only), `out` is not
// computed: `last_input` is the input of the layer's last linear and `residual` the tensor its output
// is added to (out = residual + dropout(last_input @ W + b)). The segment replay uses this to skip the
// last GEMM, whose output only feeds the residual sum.
struct LayerOutput {
  Tensor out;
  Tensor last_input;
  Tensor residual;
};

// One layer. Differentiable through the weights and `hidden` when grad mode is on. `out_slot`
// (no grad only): where to write the output (contiguous, hidden's shape), e.g. a BoundaryPool slot.
LayerOutput layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                          const std::vector<Tensor>& weights, const LayerRng& rng, const Tensor& out_slot = Tensor(),
                          bool stop_before_last_linear = false);

// The entry point for one layer call outside a segment: checks the weights, draws the call's seed
// (training with dropout) and runs layer_forward.
Tensor fused_layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                           const std::vector<Tensor>& weights, bool training);

// True when layer_forward supports stop_before_last_linear for this family.
bool can_stop_before_last_linear(Family f);

// The last linear of a GPT-2/Llama layer: which weights it uses and how.
struct LastLinear {
  Tensor weight;
  Tensor bias;   // may be undefined
  bool conv1d;   // weight is [in, out] (GPT-2 Conv1D) rather than [out, in] (nn.Linear)
  double p;      // dropout probability (0 when not training)
  int64_t offset;
  int64_t weight_slot;  // positions of weight and bias in the family's weight list
  int64_t bias_slot;
};
LastLinear last_linear(const LayerSpec& spec, const std::vector<Tensor>& weights, const LayerRng& rng);

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

// Multi-head attention of q [B, heads, S, D] over k, v [B, kv_heads, S, D] -> [B, heads, S, D], always
// through at::scaled_dot_product_attention (on CUDA the flash kernel for causal/no mask, the efficient
// or cuDNN kernel for a mask; SDPA's math path on CPU and for what no fused kernel takes). `mask`: see
// LayerInputs; `causal` applies only when there is no mask (Hugging Face passes causal masks
// explicitly when padding is present). p > 0: SDPA's dropout, drawn from the device's default
// generator set to a state derived from (seed, offset) for the call and restored afterwards.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset);

}  // namespace layers
}  // namespace ckpt_ext
