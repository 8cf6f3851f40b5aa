// LoRA adapters (peft) on the projections of the fused layers, computed as peft's lora.Linear does:
// y = x W^T + b + scaling * (dropout(x) A^T) B^T, with the dropout mask drawn from the layer call's seed
// at a site of its own (kLoraInput + j), so that a checkpointed replay draws it again. A and B go through
// ATen's linear (autocast casts them like peft's nn.Linear adapters) and C++ autograd.
#include <ATen/ATen.h>

#include <algorithm>

#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {

std::string FamilyInfo::slot_name(size_t i) const {
  if (i < slots.size()) return slots[i];
  const size_t j = (i - slots.size()) / 2;
  return (j < lora.size() ? lora[j] : std::string("?")) + ((i - slots.size()) % 2 == 0 ? ".lora_A" : ".lora_B");
}

Tensor lora_delta(const LayerSpec& s, const std::vector<Tensor>& w, int64_t j, const Tensor& x, const LayerRng& rng) {
  const size_t a = family_info(s.family).slots.size() + 2 * static_cast<size_t>(j);
  if (a + 1 >= w.size() || !w[a].defined()) return Tensor();
  const double p = effective(s.lora_p[static_cast<size_t>(j)], rng);
  const Tensor xd = p > 0 ? ops::dropout(x, p, rng.seed, kLoraInput + j) : x;
  return at::linear(at::linear(xd, w[a]), w[a + 1]) * s.lora_scaling[static_cast<size_t>(j)];
}

Tensor plus_lora(const Tensor& y, const Tensor& delta) { return delta.defined() ? y + like(delta, y) : y; }

Tensor plus_lora_parts(const Tensor& y, std::initializer_list<Tensor> deltas, std::initializer_list<int64_t> widths) {
  if (std::none_of(deltas.begin(), deltas.end(), [](const Tensor& d) { return d.defined(); })) return y;
  std::vector<Tensor> parts;
  auto width = widths.begin();
  for (const Tensor& d : deltas) {
    if (d.defined()) {
      parts.push_back(like(d, y));
    } else {
      auto sizes = y.sizes().vec();
      sizes.back() = *width;
      parts.push_back(at::zeros(sizes, y.options()));
    }
    ++width;
  }
  return y + at::cat(parts, -1);
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
    const bool conv1d = s.family == Family::kGPT2;  // Conv1D weights are [in, out]
    const int64_t in = conv1d ? W.size(0) : W.size(1), out = conv1d ? W.size(1) : W.size(0);
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
