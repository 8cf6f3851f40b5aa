// Randomness of the fused layers. A layer call draws ONE 64-bit dropout seed (draw_dropout_seed) and
// every dropout site of the call derives its mask from (seed, site): the residual sites through the
// ckpt_ext Philox ops, attention's through SDPA with the device generator temporarily set to a state
// derived from (seed, site) (SeededGeneratorScope). A replay with the same seed draws the same masks.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace ckpt_ext {
namespace layers {

// A random 64-bit dropout seed from the default generator of `device`. CPU: one draw of the
// mt19937 generator. Philox devices (CUDA): the generator's (seed, offset) reserves 4 offsets, as
// torch's own dropout does, and the pair is hashed into the seed -- no synchronisation.
int64_t draw_dropout_seed(c10::Device device);

// A 64-bit mixing function (splitmix64's finaliser), for deriving seeds from seeds.
uint64_t mix64(uint64_t x);

// Sets the default generator of `device` to `seed` (offset 0 for Philox generators) for its lifetime
// and puts the previous state back afterwards: CUDA's (seed, offset), any other generator's state tensor.
// The generator's mutex is not held in between (SDPA takes it to draw), so, like torch.utils.checkpoint's
// set_rng_state, this assumes no other thread draws from the same generator during the call.
class SeededGeneratorScope {
 public:
  SeededGeneratorScope(c10::Device device, uint64_t seed);
  ~SeededGeneratorScope();
  SeededGeneratorScope(const SeededGeneratorScope&) = delete;
  SeededGeneratorScope& operator=(const SeededGeneratorScope&) = delete;

 private:
  at::Generator gen_;
  bool philox_;
  uint64_t saved_seed_ = 0, saved_offset_ = 0;  // philox_
  at::Tensor saved_;                            // otherwise
};

}  // namespace layers
}  // namespace ckpt_ext
