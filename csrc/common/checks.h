// The shape check the ops and the layers share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace ckpt_ext {

// `t` must be 1-D of size n (a per-feature weight or bias). `who...`: the message's prefix (built only
// on failure); `of`: what n is the size of ("x" -> "the last dimension of x"), or nullptr.
template <typename... Who>
void check_vector(const at::Tensor& t, int64_t n, const char* name, const char* of, const Who&... who) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, who..., ": ", name, " must be 1-D of size ", n,
              of ? " (the last dimension of " : "", of ? of : "", of ? ")" : "", ", got shape ", t.sizes());
}

}  // namespace ckpt_ext
