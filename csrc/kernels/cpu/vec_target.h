// Included first by vec_avx2.cpp / vec_avx512.cpp: the headers the SIMD kernels need that are not
// at::vec's own, included here -- before the target pragma -- so that their inline functions are compiled
// for the baseline instruction set (the linker keeps one copy of each; it must run on every CPU). Only
// at::vec's headers and vec_impl.h come after the pragma.
#pragma once

#include <ATen/NumericUtils.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Load.h>
#include <c10/util/TypeCast.h>
#include <c10/util/complex.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ostream>
#include <tuple>
#include <type_traits>

#include "../math.h"
#include "vec.h"
