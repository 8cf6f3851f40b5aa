#include "rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

namespace ckpt_ext {
namespace layers {

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

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
  return static_cast<int64_t>(mix64(seed ^ mix64(offset)));
}

SeededGeneratorScope::SeededGeneratorScope(c10::Device device, uint64_t seed)
    : gen_(device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device)),
      philox_(device.is_cuda()) {
  std::lock_guard<std::mutex> lock(gen_.mutex());
  if (philox_) {  // (seed, offset) is the whole state: no state tensor to allocate
    saved_seed_ = gen_.current_seed();
    saved_offset_ = gen_.get_offset();
  } else {
    saved_ = gen_.get_state();
  }
  gen_.set_current_seed(seed);
}

SeededGeneratorScope::~SeededGeneratorScope() {
  std::lock_guard<std::mutex> lock(gen_.mutex());
  if (philox_) {
    gen_.set_current_seed(saved_seed_);  // resets the offset, so the offset goes back second
    gen_.set_offset(saved_offset_);
  } else {
    gen_.set_state(saved_);
  }
}

}  // namespace layers
}  // namespace ckpt_ext
