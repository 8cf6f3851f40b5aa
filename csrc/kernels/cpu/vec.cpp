// vec_kernels<T>(): the SIMD kernels for this CPU (vec.h), chosen once from ATen's CPU capability --
// so ATEN_CPU_CAPABILITY=default / avx2 caps ours as it caps ATen's -- and the instruction sets the
// CPU reports.
#include "vec.h"

#include <ATen/Version.h>

#include <string>
#include <type_traits>

namespace ckpt_ext {
namespace kernels {
namespace cpu {

namespace {

enum class Level { kNone, kAvx2, kAvx512 };

Level level() {
#ifdef CKPT_EXT_VEC_X86
  static const Level l = [] {
    const std::string cap = at::get_cpu_capability();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (cap == "AVX512" && avx512) return Level::kAvx512;
    if ((cap == "AVX512" || cap == "AVX2") && avx2) return Level::kAvx2;
    return Level::kNone;
  }();
  return l;
#else
  return Level::kNone;
#endif
}

}  // namespace

template <typename T>
const VecKernels<T>* vec_kernels() {
#ifdef CKPT_EXT_VEC_X86
  switch (level()) {
    case Level::kAvx512:
      return avx512::table<T>();
    case Level::kAvx2:
      return avx2::table<T>();
    case Level::kNone:
      break;
  }
#endif
  return nullptr;
}

template const VecKernels<float>* vec_kernels<float>();
template const VecKernels<c10::BFloat16>* vec_kernels<c10::BFloat16>();
template const VecKernels<c10::Half>* vec_kernels<c10::Half>();

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
