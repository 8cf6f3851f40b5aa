// LoRA adapters (peft) on the projections of the fused layers, computed as peft's lora.Linear does:
// y = x W^T + b + scaling * (dropout(x) A^T) B^T, with the dropout mask drawn from the layer call's seed
// at a site of its own (kLoraInput + j), so that a checkpointed replay draws it again. A and B go through
// ATen's linear (autocast casts them like peft's nn.Linear adapters) and C++ autograd. The q, k and v
// adapters of one input share their first GEMM when no adapter dropout applies (plus_lora_qkv).
//
// What peft's order costs, and what is skipped where the bits are the same (docs/lora-work.md):
//   * float32 adapters under autocast (peft's default, autocast_adapter_dtype): peft casts x to float32, drops out in
//     float32, and linear casts the result to autocast's dtype -- three passes forward, three backward. The adapter's
//     input is written in the GEMM's dtype directly (adapter_gemm_input): x itself without dropout (a bfloat16 x:
//     the round trip through float32 is exact), else one dropout rounding the float result once (ops::dropout
//     computes in float; the same bits, the same mask).
//   * a scaling that is a power of two (alpha = 2r: peft's usual) multiplies B (a small [out, r] matrix) instead of
//     the [T, out] term, forward and backward: scaling by 2^k commutes with every rounding (barring overflow and
//     subnormals), so the bits are the same.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>

#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {

std::string FamilyInfo::slot_name(size_t i) const {
  if (i < slots.size()) return slots[i];
  const size_t j = (i - slots.size()) / 2;
  return (j < lora.size() ? lora[j] : std::string("?")) + ((i - slots.size()) % 2 == 0 ? ".lora_A" : ".lora_B");
}

namespace {

size_t a_slot(const LayerSpec& s, int64_t j) { return family_info(s.family).slots.size() + 2 * static_cast<size_t>(j); }

bool has_adapter(const LayerSpec& s, const std::vector<Tensor>& w, int64_t j) {
  const size_t a = a_slot(s, j);
  return a + 1 < w.size() && w[a].defined();
}

// peft casts the adapter's input to the adapter weights' dtype (float32 adapters on a bfloat16 model: peft's
// autocast_adapter_dtype default); under autocast gemm_linear (family.h) casts it on as peft's nn.Linear does.
Tensor adapter_input(const Tensor& x, const Tensor& A) {
  return x.scalar_type() == A.scalar_type() ? x : x.to(A.scalar_type());
}

// The dtype autocast runs the adapter's GEMMs in, where it changes float32 adapters' (bfloat16/float16 autocast on
// x's device, a float32 A, x float32 or already in that dtype); nullopt otherwise.
std::optional<at::ScalarType> autocast_adapter_gemm(const Tensor& x, const Tensor& A) {
  const c10::DeviceType dt = x.device().type();
  if ((dt != c10::DeviceType::CPU && dt != c10::DeviceType::CUDA) || !at::autocast::is_autocast_enabled(dt) ||
      A.scalar_type() != at::kFloat)
    return std::nullopt;
  const at::ScalarType c = at::autocast::get_autocast_dtype(dt);
  if ((c != at::kBFloat16 && c != at::kHalf) || (x.scalar_type() != at::kFloat && x.scalar_type() != c))
    return std::nullopt;
  return c;
}

// dropout(x.to(A's dtype)) as the adapter's first GEMM reads it (see the top): under autocast with float32 adapters,
// in the GEMM's dtype without the casts (the same bits); otherwise peft's cast, then the dropout (p > 0).
Tensor adapter_gemm_input(const Tensor& x, const Tensor& A, double p, const LayerRng& rng, int64_t site) {
  const auto gemm = autocast_adapter_gemm(x, A);
  if (!gemm.has_value()) {
    const Tensor xa = adapter_input(x, A);
    return p > 0 ? ops::dropout(xa, p, rng.seed, site) : xa;
  }
  if (p <= 0) return x;  // a float32 x: autocast's cast, as before; a bfloat16 x: the exact round trip skipped
  return ops::dropout(x, p, rng.seed, site,
                      x.scalar_type() == *gemm ? std::nullopt : std::optional<at::ScalarType>(*gemm));
}

// Whether `scaling` is a power of two (2^k, k within float's normal range): then B * scaling rounds as the term
// times scaling does.
bool exact_scaling(double scaling) {
  int e = 0;
  return scaling > 0 && std::frexp(scaling, &e) == 0.5 && e > -100 && e < 100;
}

}  // namespace

Tensor lora_delta(const LayerSpec& s, const std::vector<Tensor>& w, int64_t j, const Tensor& x, const LayerRng& rng) {
  if (!has_adapter(s, w, j)) return Tensor();
  const size_t a = a_slot(s, j);
  const double p = effective(s.lora_p[static_cast<size_t>(j)], rng);
  const double scaling = s.lora_scaling[static_cast<size_t>(j)];
  const Tensor xd = adapter_gemm_input(x, w[a], p, rng, kLoraInput + j);
  if (exact_scaling(scaling)) return gemm_linear(gemm_linear(xd, w[a]), w[a + 1] * scaling);
  return gemm_linear(gemm_linear(xd, w[a]), w[a + 1]) * scaling;
}

// peft adds the term in the wider dtype of the two, then casts to the base output's.
Tensor plus_lora(const Tensor& y, const Tensor& delta) {
  if (!delta.defined()) return y;
  return delta.scalar_type() == y.scalar_type() ? y + delta : (y + delta).to(y.scalar_type());
}

bool any_adapter(const LayerSpec& s, const std::vector<Tensor>& w, std::array<int64_t, 3> j) {
  return has_adapter(s, w, j[0]) || has_adapter(s, w, j[1]) || has_adapter(s, w, j[2]);
}

Tensor plus_lora_qkv(const LayerSpec& s, const std::vector<Tensor>& w, std::array<int64_t, 3> j, const Tensor& x,
                     const Tensor& y, std::array<int64_t, 3> widths, const LayerRng& rng) {
  bool all = true, any = false, dropout = false;
  for (int64_t k : j) {
    const bool has = has_adapter(s, w, k);
    all = all && has;
    any = any || has;
    dropout = dropout || (has && effective(s.lora_p[static_cast<size_t>(k)], rng) > 0);
  }
  if (!any) return y;
  const Tensor &Aq = w[a_slot(s, j[0])], &Ak = w[a_slot(s, j[1])], &Av = w[a_slot(s, j[2])];
  if (all && !dropout && Aq.scalar_type() == Ak.scalar_type() && Aq.scalar_type() == Av.scalar_type()) {
    // One input, no adapter dropout: x [A_q; A_k; A_v]^T as one GEMM (x read once), then one GEMM against
    // blockdiag(s_q B_q, s_k B_k, s_v B_v), which lays the three terms out as the fused qkv projection.
    // Copies only the small adapter matrices (peft allocates each A apart, so their concatenation cannot
    // be a view); autograd splits the gradients back.
    const Tensor xa = gemm_linear(adapter_gemm_input(x, Aq, 0.0, rng, 0), at::cat({Aq, Ak, Av}, 0));
    std::vector<Tensor> b;
    for (int64_t k : j) b.push_back(w[a_slot(s, k) + 1] * s.lora_scaling[static_cast<size_t>(k)]);
    return plus_lora(y, gemm_linear(xa, at::block_diag(b)));
  }
  // Each adapter its own dropout mask (as peft's modules draw them), or not all three adapted.
  std::vector<Tensor> deltas;
  Tensor first;
  for (int64_t k : j) {
    deltas.push_back(lora_delta(s, w, k, x, rng));
    if (!first.defined()) first = deltas.back();
  }
  for (size_t k = 0; k < deltas.size(); ++k) {
    if (deltas[k].defined()) continue;
    auto sizes = y.sizes().vec();
    sizes.back() = widths[k];
    deltas[k] = at::zeros(sizes, first.options());
  }
  return plus_lora(y, at::cat(deltas, -1));
}

void check_lora(const LayerSpec& s, const std::vector<Tensor>& w) {
  const FamilyInfo& info = family_info(s.family);
  bool any = false;
  for (size_t j = 0; j < info.lora.size(); ++j) {
    const size_t a = info.slots.size() + 2 * j;
    const Tensor &A = w[a], &B = w[a + 1];
    TORCH_CHECK(A.defined() == B.defined(), "ckpt_ext fused ", info.name, " layer: the LoRA adapter of ",
                info.lora[j], " needs both A and B (or neither)");
    if (!A.defined()) continue;
    any = true;
    const size_t base = static_cast<size_t>(
        std::find(info.slots.begin(), info.slots.end(), info.lora[j]) - info.slots.begin());
    const Tensor& W = w[base];
    const int64_t in = info.conv1d ? W.size(0) : W.size(1), out = info.conv1d ? W.size(1) : W.size(0);
    TORCH_CHECK(A.scalar_type() == B.scalar_type(), "ckpt_ext fused ", info.name, " layer: the LoRA adapter of ",
                info.lora[j], " has A in ", A.scalar_type(), " but B in ", B.scalar_type());
    TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && A.size(1) == in && B.size(0) == out && B.size(1) == A.size(0),
                "ckpt_ext fused ", info.name, " layer: the LoRA adapter of ", info.lora[j], " must be A [r, ", in,
                "] and B [", out, ", r], got A ", A.sizes(), " and B ", B.sizes());
  }
  TORCH_CHECK(!any || (s.lora_scaling.size() == info.lora.size() && s.lora_p.size() == info.lora.size()),
              "ckpt_ext fused ", info.name, " layer: LoRA adapters were passed but the spec has ",
              s.lora_scaling.size(), " scalings and ", s.lora_p.size(), " dropout probabilities for ",
              info.lora.size(), " adapter projections (LayerSpec.with_lora)");
}

}  // namespace layers
}  // namespace ckpt_ext
