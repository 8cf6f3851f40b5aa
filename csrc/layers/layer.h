// Fused transformer layers: pure forward functions of (hidden states, mask / rotary tables, weights,
// dropout seed) for five families, built from ATen matmuls, SDPA's attention kernels and the
// ckpt_ext ops (called through the dispatcher, so they record C++ autograd when grad mode is on).
//
//   BERT/RoBERTa encoder layer  post-LN, exact or tanh GELU, biases, padding mask, hidden and
//                               attention-probability dropout
//   GPT-2 block                 pre-LN, causal, Conv1D weights ([in, out]), resid/attn dropout
//   Llama decoder layer         RMSNorm, rotary q/k, SwiGLU, grouped-query attention, causal, optional
//                               biases, attention dropout (also Qwen2 and Mistral)
//   Qwen3 decoder layer         Llama's, with an RMSNorm over each head of q and k
//   Gemma decoder layer         Llama's, with RMSNorm scaled by (1 + weight) and GeGLU
//
// Dropout: every dropout site of a layer call uses the call's seed and an offset of its own
// (DropoutSite), so a replay with the same seed draws the same masks. The seed is drawn once per call
// from the default generator of the device (rng.h); the functions here never draw from the user's
// generator state.
//
// Files: one per family (bert.cpp, gpt2.cpp, llama.cpp: forward, weight slots and checks), the shared
// pieces (attention.cpp, residual_linear.cpp, rng.cpp; family.h declares them), and layer.cpp (the
// spec, the input checks, the dispatch by family, the segment's replay interface).
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

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ckpt_ext {
namespace layers {

using at::Tensor;

enum class Family : int64_t { kBert = 0, kGPT2 = 1, kLlama = 2, kQwen3 = 3, kGemma = 4, kGemma3 = 5, kGemma2 = 6 };

// The rotary decoder families (llama.cpp: Llama and its relatives, one forward on one spec): grouped-query
// attention, head_dim independent of hidden / num_heads, no hidden dropout.
inline bool is_rotary_decoder(Family f) {
  return f == Family::kLlama || f == Family::kQwen3 || f == Family::kGemma || f == Family::kGemma3 ||
         f == Family::kGemma2;
}

const char* family_name(Family f);

// The configuration of one layer: everything besides weights and inputs.
struct LayerSpec {
  Family family = Family::kBert;
  int64_t hidden = 0;        // model width
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // key/value heads (< num_heads: grouped-query attention, rotary decoders only)
  int64_t head_dim = 0;
  double scaling = 1.0;      // attention score scale
  double attn_p = 0.0;       // attention-probability dropout
  double hidden_p = 0.0;     // BERT hidden_dropout_prob, GPT-2 resid_pdrop; 0 for Llama
  double eps = 1e-5;         // LayerNorm / RMSNorm epsilon
  bool gelu_tanh = false;    // BERT/GPT-2/Gemma: tanh-approximated GELU instead of the exact one
  double attn_softcap = 0.0; // Gemma 2: attention logits capped to tanh(s / cap) * cap before the mask (0: none)
  // LoRA adapters (peft), one entry per projection of FamilyInfo::lora, or empty when the call has none:
  // each adapter's scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) and the dropout on its input.
  std::vector<double> lora_scaling;
  std::vector<double> lora_p;

  // Checks that the fields describe a layer; throws with a clear message otherwise.
  void validate() const;
  std::string repr() const;
};

// Weight slots: each family's list of names (family_info(f).slots, exported to Python as
// _C.layer_families()) is the order in which the weights are passed. Optional biases may be undefined.
// After them come two optional slots per projection that may carry a LoRA adapter (`lora`, the names of
// those projections' weight slots, exported as _C.layer_adapters()): A [r, in] then B [out, r], both
// undefined when the projection has no active adapter. y = x W^T + b + scaling * (dropout(x) A^T) B^T.
struct FamilyInfo {
  Family id;
  const char* name;
  std::vector<std::string> slots;
  std::vector<std::string> lora;
  bool conv1d = false;  // weights are [in, out] (GPT-2's Conv1D) rather than [out, in] (nn.Linear)

  size_t num_weights() const { return slots.size() + 2 * lora.size(); }
  std::string slot_name(size_t i) const;  // "q_weight", or "q_weight.lora_A" for an adapter slot
};
const FamilyInfo& family_info(Family f);
const std::vector<Family>& all_families();

// Checks count, presence of the required weights, and device/dtype against the hidden states.
void check_weights(const LayerSpec& spec, const std::vector<Tensor>& weights, const Tensor& hidden);

// Non-weight inputs of a layer call, as Hugging Face's stack passes them.
struct LayerInputs {
  Tensor mask;  // undefined, bool (true = attend) or additive float; broadcastable to [B, heads, S, S]
  Tensor cos;   // Llama: rotary tables [B or 1, S, head_dim]
  Tensor sin;
};

// The inputs as the layers read them: an additive float mask clamped to a finite lowest value (see
// attention.cpp). Done once per layer call or segment by the entry points, not once per layer.
LayerInputs prepared(const LayerInputs& in);

// Dropout offsets of the sites of one layer call (all under the call's seed).
// LoRA adapter j's input dropout is site kLoraInput + j (each adapter its own mask, as peft's modules).
enum DropoutSite : int64_t { kAttnProbs = 0, kAttnOut = 1, kMlpOut = 2, kLoraInput = 16 };

struct LayerRng {
  bool training = false;  // dropout active (module.training)
  int64_t seed = 0;
};

// True when a call of this layer draws a seed (training and some dropout probability > 0).
bool uses_dropout(const LayerSpec& spec, bool training);

// What a layer forward returns: `out`; or, from a replay_forward that stopped before the layer's
// last linear, `last_input` (that linear's input) and `residual` (the tensor its output is added
// to: out = residual + dropout(last_input @ W + b)) with `out` undefined.
// A BERT layer forward into out_slot (no grad) also returns its last norm's input `pre_norm` and row statistics
// `mean`, `rstd` (the pre-norm boundary below); undefined elsewhere.
// A replay stopped before the last linear's input (issue 33): `act` holds the inputs of the activation that
// computes it (gate, up; or the GEMM output and its bias), `last_input` is undefined, and replay_backward runs the
// activation's backward, which also writes the last linear's input, instead of the replay's activation forward.
struct StoppedActivation {
  enum Kind : int { kNone = 0, kSwiglu, kGeglu, kBiasGelu };
  Kind kind = kNone;
  bool tanh = false;  // GeGLU / bias-GELU: the tanh approximation
  Tensor a, b;        // gate, up (GLUs); x, bias (bias-GELU; the bias may be undefined)
  bool defined() const { return kind != kNone; }
};

struct LayerOutput {
  Tensor out;
  Tensor last_input;
  Tensor residual;
  Tensor pre_norm, mean, rstd;
  StoppedActivation act;
};

// Whether a replay stops before its last layer's activation where it can (StoppedActivation; default on) or
// before the last linear as before (off: A/B tests and benchmarks; the same bits). Sets it when `set` is given
// (between steps: a replay reads it); returns the setting before. _C.tail_activation_in_backward.
bool tail_activation_in_backward(std::optional<bool> set);

// Keep-attention (a checkpointed segment's keep_attention): what a layer call's attention kernel returned
// in forward, kept until backward so that the replay runs the layer without the attention forward.
// Attention runs one of SDPA's fused kernels, chosen as SDPA chooses (CPU: flash; CUDA: flash, the
// memory-efficient kernel for a mask, cuDNN where SDPA prefers it), called directly in every mode so that
// plain, checkpointed and keep-attention runs use the same kernel (attention.cpp). A layer call given an
// empty KeptAttention (forward, no grad) fills it; one given a filled KeptAttention (replay, grad on)
// returns the kept `out` as a node whose backward is the kernel's own backward op with the kept `out` and
// `lse`. Where the attention runs no kernel with a log-sum-exp (SDPA's math path, attention dropout on CPU,
// a CUDA flash head dim SDPA pads) nothing is filled: `not_kept` says why, and the layer's replay runs its
// attention forward like any other op (full recompute of that layer; the same gradients).
struct KeptAttention {
  Tensor out;                         // the kernel's output [B, heads, S, D]
  Tensor lse;                         // its log-sum-exp (float32)
  Tensor philox_seed, philox_offset;  // CUDA: the kernel's dropout state (its backward redraws the mask)
  Tensor cum_seq_q, cum_seq_k;        // CUDA flash: what its backward takes (undefined for dense inputs)
  int64_t max_q = 0, max_k = 0;       // CUDA flash: sequence lengths its backward takes
  int64_t kernel = -1;                // SDPA's numbering (_fused_sdp_choice): 1 flash, 2 efficient
  std::string who;                    // names the layer in errors ("layer 2 (llama) of a checkpointed segment")
  std::string not_kept;               // forward: why nothing was kept (empty when kept or not yet run)

  bool filled() const { return out.defined(); }
  // The tensors, in a fixed order (saved by the segment's node, restored with from_tensors).
  std::vector<Tensor> tensors() const;
  void from_tensors(const Tensor* t);
  static constexpr size_t kTensors = 6;
};

// Recompute levels of a checkpointed segment beyond keep-attention (keep="attention_inputs", "gemms",
// "gemms_attention"): the outputs of a layer call's GEMMs, kept from forward to backward so that the replay runs
// the layer without them. Each family tags its own GEMMs with a site (kQkv: the q/k/v projection, one GEMM over the
// concatenated weights; the rest numbered by the family, kLastLinear: the linear that feeds only the residual sum,
// which the replay of a segment's last layer skips anyway and so is never kept there). A layer call given a
// KeptGemms with `recording` (forward, no grad) keeps the output of each site it selects (`all`, or kQkv only); one
// given it without `recording` (the replay, grad on) gets each kept output back as an autograd node whose backward
// is the GEMM's own -- the calls autograd makes for at::linear's node (mm/addmm backward on the same operands), or
// the CPU layout policy's functions (gemm.cpp), or the q/k/v node's (qkv.cpp), or the last linear's
// (residual_linear.cpp) -- so the gradients are the same bits as a full replay's. Kept: the tensors the GEMMs
// returned (no copy), held by the segment's node. A layer call with LoRA adapters keeps none (`not_kept` says so;
// its attention is kept as its level says).
struct KeptGemms {
  enum Site : int { kNone = -1, kQkv = 0, kLastLinear = 4, kCount = 5 };
  bool all = false;        // every GEMM of the layer; false: the q/k/v projection only
  bool recording = false;  // forward: fill; otherwise the replay: hand back
  std::array<Tensor, kCount> out;
  std::string not_kept;    // why this layer call kept no GEMM output ("" when it kept or was not asked to)

  bool selects(int site) const { return site >= 0 && site < kCount && (all || site == kQkv); }
  bool filled() const;
  int64_t nbytes() const;  // bytes of the distinct storages kept
  std::vector<Tensor> tensors() const { return {out.begin(), out.end()}; }
  void from_tensors(const Tensor* t) {
    for (size_t i = 0; i < kTensors; ++i) out[i] = t[i];
  }
  static constexpr size_t kTensors = kCount;
};

// Why torch's cuDNN attention ops cannot be called by name in this process ("" when they can; attention.cpp).
std::string cudnn_attention_problem();

// One layer. Differentiable through the weights and `hidden` when grad mode is on. `out_slot`
// (no grad only): where to write the output (contiguous, hidden's shape), e.g. a BoundaryPool slot.
// `kept`: keep-attention, see KeptAttention (nullptr: attention runs as usual); `gemms`: the GEMM outputs of the
// recompute levels, see KeptGemms (nullptr: the GEMMs run as usual).
LayerOutput layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                          const std::vector<Tensor>& weights, const LayerRng& rng, const Tensor& out_slot = Tensor(),
                          KeptAttention* kept = nullptr, KeptGemms* gemms = nullptr);

// The entry point for one layer call outside a segment: checks the weights, draws the call's seed
// (training with dropout) and runs layer_forward.
Tensor fused_layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                           const std::vector<Tensor>& weights, bool training);

// ---- the segment's replay (csrc/segment/): the one interface it uses besides layer_forward ----

// Replays the last layer of a segment for backward (grad mode on, under the forward's autocast): a
// family whose last linear only feeds the residual sum (GPT-2, Llama) stops before it, to compute its
// gradients directly in replay_backward and save that GEMM; the others run whole.
LayerOutput replay_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                           const std::vector<Tensor>& weights, const LayerRng& rng, KeptAttention* kept = nullptr,
                           KeptGemms* gemms = nullptr);

// Where backward goes from a replay_forward: autograd::grad(outputs, ..., grads) gives the rest of
// the gradients; slot_grads are the (weight slot, gradient) pairs computed directly.
struct ReplayBackward {
  std::vector<Tensor> outputs, grads;
  std::vector<std::pair<int64_t, Tensor>> slot_grads;
};
// `need_slot[i]`: the gradient of weight slot i is wanted. Runs under the backward's autocast state.
ReplayBackward replay_backward(const LayerSpec& spec, const std::vector<Tensor>& weights, const LayerRng& rng,
                               const LayerOutput& replayed, const Tensor& grad_out,
                               const std::vector<bool>& need_slot);

// ---- the pre-norm boundary (BERT/RoBERTa; issue 32) ----
// A post-LN layer ends out = LN(pre_norm), pre_norm = h1 + dropout(o W + b); its backward needs pre_norm and
// the norm's row statistics, not `out`. A segment whose last layer has this boundary keeps (pre_norm, mean,
// rstd) instead of recomputing the layer's output GEMM and norm in its replay, and the next segment recomputes
// its input `out` from pre_norm (one norm forward) instead of keeping it.
struct PreNormBoundary {
  Tensor pre_norm, mean, rstd;  // of the layer's last norm, as its forward stored them
  bool defined() const { return pre_norm.defined(); }
};
// Whether the layer ends in such a norm and the segment can replay it from the boundary: BERT/RoBERTa
// without a LoRA adapter on the output linear (whose direct gradients know no adapter).
bool has_pre_norm_boundary(const LayerSpec& spec, const std::vector<Tensor>& weights);
// The layer's output from its boundary (no grad): its last norm run again on the stored pre_norm, the same
// kernel on the same stored values, hence the forward's bits.
Tensor output_from_pre_norm(const LayerSpec& spec, const std::vector<Tensor>& weights, const Tensor& pre_norm);
// replay_forward for a layer with the boundary: stops before its output linear (last_input = that linear's
// input, residual = h1; `out` undefined).
// `gemms` (recompute levels) as replay_forward's; the output linear's kept output, if any, goes unused.
LayerOutput pre_norm_replay_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                                    const std::vector<Tensor>& weights, const LayerRng& rng,
                                    KeptAttention* kept = nullptr, KeptGemms* gemms = nullptr);
// replay_backward from the boundary: one autograd node (in `outputs`, computing nothing in forward) whose
// backward is the norm's backward from pre_norm/mean/rstd, then the output linear's gradients as autograd
// computes them in the un-checkpointed layer (the same ops, the same order); `slot_grads` stays empty.
// `boundary` is taken by value: the node holds it until its backward (its memory free for the rest).
ReplayBackward pre_norm_replay_backward(const LayerSpec& spec, const std::vector<Tensor>& weights,
                                        const LayerRng& rng, const LayerOutput& replayed, PreNormBoundary boundary,
                                        const Tensor& grad_out, const std::vector<bool>& need_slot);

// The layers' GEMMs (gemm.cpp): x @ w^T (+ bias) as at::linear, and a @ b as at::matmul (batched: equal
// batch dims). On CPUs whose reduced-precision GEMM is slow in some operand layouts (no oneDNN bfloat16),
// the product runs in a fast layout instead, in forward and backward (autograd functions of their own);
// elsewhere these are the ATen calls themselves.
// `site` (KeptGemms::Site, a family's own GEMMs only): under an active KeptGemms (gemm.cpp's KeptGemmsScope) the
// output is kept (forward) or handed back (replay); -1 (LoRA adapters, anything else): never.
Tensor gemm_linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(), int site = -1);
Tensor gemm_matmul(const Tensor& a, const Tensor& b);
// a @ b for 3-D a [n, M, K], b [n, K, N] (equal batch): at::bmm itself, or gemm_matmul's policy. Unlike
// gemm_matmul it records no expand / reshape around the product (at::matmul's batched path does).
Tensor gemm_bmm(const Tensor& a, const Tensor& b);

// CPU attention with ckpt_ext's Philox dropout (p > 0; attention.cpp): `fused`, the mask, softmax and dropout in
// one row pass forward and one backward, one autograd node for the whole attention (kernels/cpu/softmax_dropout.h);
// else the written-out ATen ops it replaces (the reference of tests/test_cpu_attention_dropout.py). Same masks
// (seed, offset) and roundings; the softmax's exp and sums may differ in the last float bits. Bound for tests.
Tensor attention_philox_dropout_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                    bool causal, double scale, double p, int64_t seed, int64_t offset, bool fused);
// Whether the layers' CPU attention with dropout runs fused (default; CKPT_EXT_CPU_FUSED_ATTENTION=0 turns it
// off): sets it when `set` is given (before a step: a replay must see the forward's setting); returns the
// setting before the call.
bool cpu_fused_attention(std::optional<bool> set);

// The CPU GEMM layout policy of the layers (gemm.cpp): "auto" (default, or CKPT_EXT_CPU_GEMM_LAYOUT):
// reduced-precision products on CPU run in a fast operand layout where ATen's GEMM has slow ones (no
// oneDNN bfloat16); "nt": every floating-point CPU product (tests use it to reach the path on any CPU);
// "off": ATen's calls as they are. Sets it when `set` is given; returns the setting before the call.
std::string cpu_gemm_layout(const std::optional<std::string>& set);
// Under autocast, the norm ops take a GEMM's bfloat16/float16 output beside the float32 residual stream
// (family.h's norm_input; issue 32); off: the output is cast to float32 first (like(), the reference of the
// A/B tests). On by default; `set` sets it (before a step: a replay must see the forward's setting); returns
// the setting before. _C.mixed_dtype_norms.
bool mixed_dtype_norms();
bool set_mixed_dtype_norms(std::optional<bool> set);
// Under autocast, a norm whose normalised output feeds only GEMMs (the pre-norm families' input norms: Llama /
// Qwen2 / Mistral / Qwen3 / Gemma n1 and n2, GPT-2's ln_2) writes it in autocast's dtype, the float result rounded
// once, so that no cast runs (forward, backward, replay), and reads its gradient in that dtype (family.h's
// gemm_input_dtype; issue 32); BERT's h1 (also LN2's float32 residual) is written in both dtypes. The same bits as
// the casts. Not where a LoRA adapter reads the output (it keeps float32 and the casts). On by default; `set` sets
// it (before a step, as above); returns the setting before.
// _C.mixed_dtype_norm_outputs.
bool mixed_dtype_norm_outputs();
bool set_mixed_dtype_norm_outputs(std::optional<bool> set);

// Under autocast, whether the last linear's GEMM output joins the float32 residual stream as it is and its
// backward's dropout writes the GEMMs' dtype (residual_linear.cpp; default on), or both go through casts as
// before (off: A/B tests and benchmarks; the same bits). Sets it when `set` is given; returns the one before.
bool mixed_dtype_residual(std::optional<bool> set);

}  // namespace layers
}  // namespace ckpt_ext
