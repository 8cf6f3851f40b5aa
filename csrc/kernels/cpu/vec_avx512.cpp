// The SIMD CPU kernels (vec_impl.h) for AVX-512 (F, BW, VL, DQ) + FMA, the set ATen's AVX512 kernels are
// compiled for: ckpt_ext::kernels::cpu::avx512::table<T>().
#include "vec_target.h"
#include "softmax_dropout.h"

#ifdef CKPT_EXT_VEC_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC push_options
// a * b + c stays two roundings, as in the portable loops (an FMA would change, e.g., LayerNorm's
// gradient of a constant row from exactly 0 to rstd * (one rounding)); fused only where fmadd is called.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif
// GCC's target pragma enables the instructions but not their macros, which sleef.h and at::vec test.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define CKPT_EXT_VEC_NS avx512
#include "vec_impl.h"
#include "softmax_dropout_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
