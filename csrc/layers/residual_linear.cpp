// Building blocks shared by the fused layers: the dropout seed, the last linear with its residual
// (an autograd node of its own, so the segment replay can compute its gradients without running it),
// and attention (SDPA, its dropout drawn from a generator state derived from the layer's seed).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

#include "../ops/fused_ops.h"
#include "layer.h"

namespace ckpt_ext {
namespace layers {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

int64_t draw_dropout_seed(c10::Device device) {
  if (device.is_cpu()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    return static_cast<int64_t>(at::check_generator<at::CPUGeneratorImpl>(gen)->random64());
  }
  // Philox generators (CUDA) are fully described by (seed, offset): reserve offsets as torch's own
  // kernels do (multiples of 4) and hash the pair, so that our counters never coincide with the ones
  // torch's kernels use under the same seed, and nothing waits for the device.
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const uint64_t seed = gen.current_seed();
  const uint64_t offset = gen.get_offset();
  gen.set_offset(offset + 4);
  return static_cast<int64_t>(splitmix64(seed ^ splitmix64(offset)));
}

// ---- residual linear ---------------------------------------------------------------------------------------------

namespace {

// `t` in `dtype`: a no-op outside autocast. Under autocast the last linear's input is in the autocast
// dtype (it comes from GEMMs) while its weight and the residual stream keep the parameters' dtype.
Tensor in_dtype(const Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// x @ W^T (Linear) or x @ W (Conv1D) on the 2-D view of x, without bias (the bias is fused into the
// dropout-residual kernel). Computed in x's dtype -- the autocast dtype under autocast, as autocast's
// mm would -- explicitly, so that the node's backward (which runs outside autocast) and the segment
// replay compute the same thing.
Tensor matmul_2d(const Tensor& x, const LastLinear& lin) {
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  const Tensor w = in_dtype(lin.weight, x.scalar_type());
  return lin.conv1d ? x2d.mm(w) : x2d.mm(w.t());
}

std::optional<Tensor> bias_of(const LastLinear& lin) {
  return lin.bias.defined() ? std::optional<Tensor>(lin.bias) : std::nullopt;
}

struct ResidualLinearFunction : torch::autograd::Function<ResidualLinearFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& residual, bool conv1d, double p,
                        int64_t seed, int64_t offset) {
    LastLinear lin{weight, bias.has_value() ? *bias : Tensor(), conv1d, p, offset, -1, -1};
    // The GEMM's output joins the residual stream in the stream's dtype (Hugging Face's residual add
    // promotes the same way under autocast).
    const Tensor y = in_dtype(matmul_2d(x, lin).view(residual.sizes()), residual.scalar_type());
    ctx->save_for_backward({x, weight});
    ctx->saved_data["conv1d"] = conv1d;
    ctx->saved_data["has_bias"] = lin.bias.defined();
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    // Grad mode is off inside Function::forward, so this records nothing of its own.
    return ops::bias_dropout_add(y, bias_of(lin), residual, p, seed, offset);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data.at("has_bias").toBool();
    LastLinear lin{saved[1], Tensor(), ctx->saved_data.at("conv1d").toBool(), ctx->saved_data.at("p").toDouble(),
                   ctx->saved_data.at("offset").toInt(), -1, -1};
    torch::autograd::variable_list out(8);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    // Edges: x, weight, bias (if present), residual.
    const int64_t residual_edge = has_bias ? 3 : 2;
    auto g = residual_linear_backward(grad, saved[0], lin, ctx->saved_data.at("seed").toInt(),
                                      ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      has_bias && ctx->needs_input_grad(2));
    out[0] = g.x;
    out[1] = g.weight;
    out[2] = g.bias;
    if (ctx->needs_input_grad(residual_edge)) out[3] = grad;
    return out;
  }
};

}  // namespace

Tensor residual_linear(const Tensor& x, const LastLinear& lin, const Tensor& residual, int64_t seed) {
  return ResidualLinearFunction::apply(x, lin.weight, bias_of(lin), residual, lin.conv1d, lin.p, seed, lin.offset);
}

ResidualLinearGrads residual_linear_backward(const Tensor& grad, const Tensor& x, const LastLinear& lin, int64_t seed,
                                             bool need_x, bool need_weight, bool need_bias) {
  ResidualLinearGrads r;
  if (!(need_x || need_weight || need_bias)) return r;
  const Tensor g = lin.p > 0 ? ops::dropout_backward(grad, lin.p, seed, lin.offset) : grad;
  const Tensor g2d = g.reshape({-1, g.size(-1)});
  // The GEMMs run in x's dtype, as in forward (autocast: the weight cast down, its gradient cast back
  // to the parameter's dtype, as autograd does for Hugging Face's layer); the bias gradient is summed
  // from the incoming gradient in the stream's dtype.
  const auto cdt = x.scalar_type();
  const Tensor gc = in_dtype(g2d, cdt);
  if (need_x) {
    const Tensor w = in_dtype(lin.weight, cdt);
    r.x = (lin.conv1d ? gc.mm(w.t()) : gc.mm(w)).view(x.sizes());
  }
  if (need_weight) {
    const Tensor x2d = x.reshape({-1, x.size(-1)});
    r.weight = in_dtype(lin.conv1d ? x2d.t().mm(gc) : gc.t().mm(x2d), lin.weight.scalar_type());
  }
  if (need_bias) r.bias = g2d.sum(0);
  return r;
}

// ---- attention ---------------------------------------------------------------------------------------------------

namespace {

// [B, kv_heads, S, D] -> [B, kv_heads * n_rep, S, D], each kv head repeated n_rep times (Hugging Face's repeat_kv).
Tensor repeat_kv(const Tensor& t, int64_t n_rep) {
  if (n_rep == 1) return t;
  const auto B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  return t.unsqueeze(2).expand({B, H, n_rep, S, D}).reshape({B, H * n_rep, S, D});
}

// Hugging Face's eager masks are additive with the dtype's lowest value; a query whose keys are all
// masked (left padding) then gets a uniform row in its eager softmax. CUDA's fused kernels scale
// score + mask by log2(e) in float32, which overflows float32's / bfloat16's lowest to -inf, and an
// all -inf row comes out as zeros: the CUDA-only eager+padding parity failures. -1e30 is as good as
// -inf for any row with one unmasked key (exp underflows to 0) and leaves fully masked rows uniform.
Tensor finite_additive_mask(const Tensor& mask) {
  const auto t = mask.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kDouble) return mask;  // float16's lowest is safe
  return mask.clamp_min(-1e30);
}

constexpr uint64_t kSdpaSalt = 0x5DBA7E11A5EEDULL;  // separates SDPA's generator seeds from our Philox keys

// Sets the default generator of `device` to `seed` (offset 0 for Philox generators) for its lifetime
// and puts the previous state back afterwards. The generator's mutex is not held in between (SDPA
// takes it to draw), so, like torch.utils.checkpoint's set_rng_state, this assumes no other thread
// draws from the same generator during the call.
class SeededGeneratorScope {
 public:
  SeededGeneratorScope(c10::Device device, uint64_t seed)
      : gen_(device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device)) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    saved_ = gen_.get_state();
    gen_.set_current_seed(seed);
  }
  ~SeededGeneratorScope() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(saved_);
  }
  SeededGeneratorScope(const SeededGeneratorScope&) = delete;
  SeededGeneratorScope& operator=(const SeededGeneratorScope&) = delete;

 private:
  at::Generator gen_;
  Tensor saved_;
};

}  // namespace

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset) {
  const int64_t n_rep = q.size(1) / k.size(1);
  const bool use_causal = causal && !mask.defined() && q.size(2) > 1;
  // Grouped-query attention: SDPA's own GQA support when there is no mask (the fast kernels need
  // none), repeated heads otherwise -- Hugging Face's rule.
  const bool gqa = n_rep > 1 && !mask.defined();
  const Tensor kk = gqa ? k : repeat_kv(k, n_rep), vv = gqa ? v : repeat_kv(v, n_rep);
  std::optional<Tensor> m;
  if (mask.defined()) m = mask.scalar_type() == at::kBool ? mask : finite_additive_mask(mask);
  if (p == 0.0) return at::scaled_dot_product_attention(q, kk, vv, m, 0.0, use_causal, scale, gqa);
  // SDPA draws its dropout from the device's default generator (CUDA flash/efficient kernels: the
  // philox (seed, offset) they read from it and return for their backward; the math path, CPU: a
  // bernoulli mask from it). Set to a state that is a function of the layer call's seed and this
  // site, its mask is one more dropout site of the call: a replay with the same seed draws it again,
  // and the user's generator is left as it was.
  SeededGeneratorScope rng(q.device(), splitmix64(static_cast<uint64_t>(seed) ^ splitmix64(kSdpaSalt + offset)));
  return at::scaled_dot_product_attention(q, kk, vv, m, p, use_causal, scale, gqa);
}

}  // namespace layers
}  // namespace ckpt_ext
