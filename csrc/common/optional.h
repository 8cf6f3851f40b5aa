// Optional tensors: the one set of converters between std::optional<at::Tensor> (schemas' `Tensor?`,
// pybind11's None) and an undefined at::Tensor (what kernels and the layers pass for "absent").
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace ckpt_ext {

using OptTensor = std::optional<at::Tensor>;

// True when `t` holds a defined tensor.
inline bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// Undefined -> nullopt.
inline OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// nullopt -> undefined.
inline at::Tensor undefined_if_absent(const OptTensor& t) { return present(t) ? *t : at::Tensor(); }

inline std::vector<at::Tensor> undefined_if_absent(const std::vector<OptTensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(undefined_if_absent(t));
  return out;
}

}  // namespace ckpt_ext
