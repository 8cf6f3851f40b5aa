// The fused layers' GEMMs on CPU in reduced precision: the operand layouts ATen's fast paths need.
//
// Without oneDNN's bfloat16 GEMM (which torch uses only on CPUs with AVX-512), ATen's CPU bfloat16 and
// float16 GEMM (cpublas) is fast only where the second operand is read along its rows -- a @ b with b a
// transposed view of a row-major [N, K] tensor ("NT"), or a^T @ b ("TN"). a @ b with both operands
// row-major ("NN") or both transposed ("TT") runs 10-50x slower (AMD EPYC, AVX2, torch 2.13: bf16 [512,
// 1024] @ [1024, 256] 260 ms NN, 15 ms NT; [2048, 1024] @ [1024, 4096] 51 s NN, 0.93 s NT). Autograd's
// backward of x @ W^T computes grad @ W, an NN product: the input gradient of every nn.Linear (and the
// forward of every Conv1D) takes the slow path, and on such CPUs that is most of a bfloat16 step.
//
// Here, where the policy applies (cpu_gemm_layout() below), a 2-D product that would run NN or TT is given
// the NT layout by copying one operand (b transposed for NN -- the smaller one in the layers: a weight --
// a for TT); TN is left as it is (fast where the layers use it: weight gradients). Batched products
// (attention) run TN, copying what is not in that layout already. A copy is O(size) against the GEMM's
// O(size * K).
// gemm_linear() and gemm_matmul() are autograd functions of their own whose backward uses the same rule.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ExpandUtils.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include <algorithm>

#include "family.h"

namespace ckpt_ext {
namespace layers {

namespace {

enum Mode : int { kAuto = 0, kNT = 1, kOff = 2 };

int mode_from(const std::string& s) {
  if (s == "auto") return kAuto;
  if (s == "nt") return kNT;
  if (s == "off") return kOff;
  TORCH_CHECK(false, "ckpt_ext: CPU GEMM layout must be 'auto', 'nt' or 'off', got '", s,
              "' (CKPT_EXT_CPU_GEMM_LAYOUT or _C.cpu_gemm_layout)");
  return kAuto;
}

std::atomic<int>& mode() {
  static std::atomic<int> m{[] {
    const char* env = std::getenv("CKPT_EXT_CPU_GEMM_LAYOUT");
    return env && *env ? mode_from(env) : int(kAuto);
  }()};
  return m;
}

// torch's bfloat16 CPU GEMM goes to oneDNN where ATen's capability is AVX-512 (oneDNN's bfloat16 check);
// float16 only on CPUs with AVX-512 FP16 / AMX, which this does not try to tell apart: the copy costs
// little where it is not needed.
bool slow_layouts(at::ScalarType t) {
  static const bool avx512 = std::strncmp(at::get_cpu_capability().c_str(), "AVX512", 6) == 0;
  return t == at::kHalf || (t == at::kBFloat16 && !avx512);
}

bool row_major(const Tensor& t) { return t.stride(-1) == 1 && (t.size(-2) == 1 || t.stride(-2) >= t.size(-1)); }
bool col_major(const Tensor& t) { return t.stride(-2) == 1 && (t.size(-1) == 1 || t.stride(-1) >= t.size(-2)); }
// `t` as the transpose of a row-major tensor (a copy unless it already is one).
Tensor as_col_major(const Tensor& t) {
  return col_major(t) ? t : t.transpose(-2, -1).contiguous().transpose(-2, -1);
}
Tensor as_row_major(const Tensor& t) { return row_major(t) ? t : t.contiguous(); }

// a @ b, no autograd of its own. 2-D: NN and TT turned into NT (TN, fast where the layers use it, kept).
// 3-D (batched, equal batch): always TN, the fastest of the four for every batched shape measured (AMD EPYC,
// bf16: [16, 128, 128] @ [16, 128, 64] 1.7 ms TN, 4.8 NT, 11.6 NN; [16, 1024, 64] @ [16, 64, 1024] 119 ms
// TN, 303 NT), where for 2-D products NT wins at large sizes ([2048, 1024] @ [1024, 4096]: 0.93 s NT, 3.6 s TN).
// bias (2-D only): added by the GEMM itself (addmm, one rounding, as at::linear does), not in a second pass.
// The 2-D operands a, b in the layout described above.
std::pair<Tensor, Tensor> layout_2d(const Tensor& a, const Tensor& b) {
  Tensor x = a, y = b;
  if (!row_major(x) && !col_major(x)) x = x.contiguous();
  if (!row_major(y) && !col_major(y)) y = as_col_major(y);
  if (row_major(x) && row_major(y) && !col_major(y)) y = as_col_major(y);                       // NN -> NT
  else if (col_major(x) && !row_major(x) && col_major(y) && !row_major(y)) x = x.contiguous();  // TT -> NT
  return {x, y};
}

Tensor mm_layout(const Tensor& a, const Tensor& b, const Tensor& bias = Tensor()) {
  if (a.dim() == 3) return as_col_major(a).bmm(as_row_major(b));
  const auto [x, y] = layout_2d(a, b);
  return bias.defined() ? at::addmm(bias, x, y) : x.mm(y);
}

// y = x @ w^T (+ bias) on x's 2-D view, w [out, in] in any layout (a Conv1D weight [in, out] passes as its
// transpose view).
struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& w,
                        const std::optional<Tensor>& bias) {
    const Tensor x2d = x.reshape({-1, x.size(-1)});
    const Tensor y = mm_layout(x2d, w.t(), bias.has_value() ? *bias : Tensor());
    ctx->save_for_backward({x, w});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data.at("has_bias").toBool();
    auto g = layout_linear_backward(saved[0], saved[1], grads[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                    has_bias && ctx->needs_input_grad(2));
    return {g[0], g[1], g[2]};
  }

  // {dx, dw, db} of y = x @ w^T + b in the policy's layouts (also the kept GEMM's backward on this path).
  static std::array<Tensor, 3> layout_linear_backward(const Tensor& x, const Tensor& w, const Tensor& grad,
                                                      bool need_x, bool need_w, bool need_b) {
    std::array<Tensor, 3> out;
    if (!grad.defined()) return out;
    const Tensor g = grad.reshape({-1, grad.size(-1)});
    if (need_x) out[0] = mm_layout(g, w).view(x.sizes());
    if (need_w) out[1] = mm_layout(g.t(), x.reshape({-1, x.size(-1)}));
    if (need_b) out[2] = g.sum(0);
    return out;
  }
};

// {dx, dw, db} of at::linear(x, w, b) for x 2-D or contiguous, as autograd computes them for its nodes: at::linear
// flattens such an x to 2-D (a view) and runs addmm(b, x2d, w^T) (mm without bias); the node's backward is
// torch's mm_mat1_backward / mm_mat2_backward (FunctionsManual.cpp) -- a column-major operand gets its gradient
// computed transposed, as there --, w^T's gradient transposed back, and the bias's the incoming gradient summed to
// the bias's shape (at::sum_to, what the engine does for addmm's broadcast input). The same operands in the same
// calls: the same bits.
std::array<Tensor, 3> aten_linear_backward(const Tensor& x, const Tensor& w, const Tensor& grad, bool need_x,
                                           bool need_w, bool need_b) {
  std::array<Tensor, 3> out;
  if (!grad.defined()) return out;
  const Tensor x2d = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
  const Tensor g = grad.reshape({-1, grad.size(-1)});
  const Tensor mat2 = w.t();
  const auto column_major = [](const Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); };
  if (need_x) {
    const Tensor dx2d = column_major(x2d) ? mat2.mm(g.t()).t() : g.mm(mat2.t());
    out[0] = x.dim() == 2 ? dx2d : dx2d.reshape(x.sizes());
  }
  if (need_w) out[1] = (column_major(mat2) ? g.t().mm(x2d).t() : x2d.t().mm(g)).t();
  if (need_b) {
    const int64_t bias_size[1] = {w.size(0)};
    out[2] = at::sum_to(g, at::IntArrayRef(bias_size, 1));
  }
  return out;
}

// The replay of a kept GEMM output (KeptGemms): returns it, and in backward computes the GEMM's gradients as the
// node of the full replay would (`layouts`: gemm_linear's CPU layout policy applies, LinearFunction's backward;
// otherwise at::linear's).
struct KeptLinearFunction : torch::autograd::Function<KeptLinearFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& w,
                        const std::optional<Tensor>& bias, const KeptTensor& kept, bool layouts) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["layouts"] = layouts;
    return kept.t.detach();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data.at("has_bias").toBool();
    const bool nx = ctx->needs_input_grad(0), nw = ctx->needs_input_grad(1), nb = has_bias && ctx->needs_input_grad(2);
    const auto g = ctx->saved_data.at("layouts").toBool()
                       ? LinearFunction::layout_linear_backward(saved[0], saved[1], grads[0], nx, nw, nb)
                       : aten_linear_backward(saved[0], saved[1], grads[0], nx, nw, nb);
    return {g[0], g[1], g[2], Tensor(), Tensor()};
  }
};

// a @ b for 3-D a [n, M, K], b [n, K, N].
struct MatmulFunction : torch::autograd::Function<MatmulFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    ctx->save_for_backward({a, b});
    return mm_layout(a, b);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    torch::autograd::variable_list out(2);
    if (!grads[0].defined()) return out;
    if (ctx->needs_input_grad(0)) out[0] = mm_layout(grads[0], saved[1].transpose(-2, -1));
    if (ctx->needs_input_grad(1)) out[1] = mm_layout(saved[0].transpose(-2, -1), grads[0]);
    return out;
  }
};

// Autocast: linear and matmul are on autocast's lower-precision list; cast as autocast would (its weight
// cache included), outside the autograd function so that the casts' gradients flow back to the
// parameters' dtype, and run the function with autocast off.
Tensor autocast_arg(const Tensor& t, c10::DeviceType dt) {
  return t.defined() ? at::autocast::cached_cast(at::autocast::get_autocast_dtype(dt), t, dt) : t;
}

bool layouts_apply(const Tensor& t, at::ScalarType dt) {
  if (!t.defined() || !t.is_cpu()) return false;
  const int m = mode().load(std::memory_order_relaxed);
  return m == kOff ? false : m == kNT ? at::isFloatingType(dt) : slow_layouts(dt);
}

// For linear and matmul, which autocast would run in its dtype.
bool autocast_layouts_apply(const Tensor& t) {
  at::ScalarType dt = t.defined() ? t.scalar_type() : at::kFloat;
  if (at::autocast::is_autocast_enabled(c10::DeviceType::CPU) && at::isFloatingType(dt))
    dt = at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
  return layouts_apply(t, dt);
}

}  // namespace

namespace {

thread_local KeptGemms* active_gemms = nullptr;

// The cast autocast would make of a linear's argument on x's device type (none outside autocast).
Tensor linear_autocast_arg(const Tensor& t, const Tensor& x) {
  const c10::DeviceType dt = x.device().type();
  if (!t.defined() || (dt != c10::DeviceType::CPU && dt != c10::DeviceType::CUDA) ||
      !at::autocast::is_autocast_enabled(dt))
    return t;
  return autocast_arg(t, dt);
}

// The replay of a kept output: the casts autocast (or the layout path) makes, then the kept node.
Tensor kept_linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& kept) {
  const bool layouts = autocast_layouts_apply(x);
  const Tensor xx = linear_autocast_arg(x, x), ww = linear_autocast_arg(w, x), bb = linear_autocast_arg(bias, x);
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  TORCH_CHECK(kept.sizes() == at::IntArrayRef(sizes) && kept.scalar_type() == ww.scalar_type(),
              "ckpt_ext fused segment: the GEMM output kept in forward (", kept.sizes(), " ", kept.scalar_type(),
              ") does not match the replay's GEMM (", at::IntArrayRef(sizes), " ", ww.scalar_type(),
              "); the replay must run the layers as forward did");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return KeptLinearFunction::apply(xx, ww, opt(bb), KeptTensor{kept}, layouts);
}

Tensor plain_linear(const Tensor& x, const Tensor& w, const Tensor& bias);

}  // namespace

KeptGemmsScope::KeptGemmsScope(KeptGemms* gemms) : prev_(active_gemms) { active_gemms = gemms; }
KeptGemmsScope::~KeptGemmsScope() { active_gemms = prev_; }

Tensor kept_gemm(int site) {
  const KeptGemms* g = active_gemms;
  return g != nullptr && !g->recording && g->selects(site) ? g->out[static_cast<size_t>(site)] : Tensor();
}

void record_gemm(int site, const Tensor& y) {
  KeptGemms* g = active_gemms;
  if (g != nullptr && g->recording && g->selects(site)) g->out[static_cast<size_t>(site)] = y;
}

bool KeptGemms::filled() const {
  for (const auto& t : out)
    if (t.defined()) return true;
  return false;
}

int64_t KeptGemms::nbytes() const {
  int64_t n = 0;
  std::vector<const void*> seen;
  for (const auto& t : out) {
    if (!t.defined()) continue;
    const void* p = t.storage().unsafeGetStorageImpl();
    if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;
    seen.push_back(p);
    n += static_cast<int64_t>(t.storage().nbytes());
  }
  return n;
}

Tensor gemm_linear(const Tensor& x, const Tensor& w, const Tensor& bias, int site) {
  if (site < 0 || active_gemms == nullptr) return plain_linear(x, w, bias);
  // kept only for the inputs at::linear flattens to a view (the backward above is that case's)
  const bool keepable = x.dim() == 2 || x.is_contiguous();
  const Tensor kept = kept_gemm(site);
  if (kept.defined()) return kept_linear(x, w, bias, kept);
  Tensor y = plain_linear(x, w, bias);
  if (keepable && !at::GradMode::is_enabled()) record_gemm(site, y);
  return y;
}

namespace {

Tensor plain_linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  if (!autocast_layouts_apply(x)) return at::linear(x, w, opt(bias));
  Tensor xx = x, ww = w, bb = bias;
  if (at::autocast::is_autocast_enabled(c10::DeviceType::CPU)) {
    xx = autocast_arg(x, c10::DeviceType::CPU);
    ww = autocast_arg(w, c10::DeviceType::CPU);
    bb = autocast_arg(bias, c10::DeviceType::CPU);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return LinearFunction::apply(xx, ww, opt(bb));
}

}  // namespace

Tensor gemm_matmul(const Tensor& a, const Tensor& b) {
  if (!autocast_layouts_apply(a) || a.dim() < 3 || b.dim() != a.dim() ||
      a.sizes().slice(0, a.dim() - 2) != b.sizes().slice(0, b.dim() - 2))
    return at::matmul(a, b);
  Tensor aa = a, bb = b;
  if (at::autocast::is_autocast_enabled(c10::DeviceType::CPU)) {
    aa = autocast_arg(a, c10::DeviceType::CPU);
    bb = autocast_arg(b, c10::DeviceType::CPU);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto M = aa.size(-2), K = aa.size(-1), N = bb.size(-1);
  // Flattened to 3-D by autograd-recorded reshapes; a is flattened through its transpose, so that a copy,
  // where one is needed, comes out in the TN layout directly.
  const Tensor a3 = aa.transpose(-2, -1).reshape({-1, K, M}).transpose(-2, -1);
  const Tensor b3 = bb.reshape({-1, K, N});
  auto sizes = aa.sizes().vec();
  sizes.back() = N;
  return MatmulFunction::apply(a3, b3).view(sizes);
}

Tensor gemm_bmm(const Tensor& a, const Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), "ckpt_ext gemm_bmm: expects [n, M, K] @ [n, K, N]");
  if (!autocast_layouts_apply(a)) return at::bmm(a, b);
  Tensor aa = a, bb = b;
  if (at::autocast::is_autocast_enabled(c10::DeviceType::CPU)) {
    aa = autocast_arg(a, c10::DeviceType::CPU);
    bb = autocast_arg(b, c10::DeviceType::CPU);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return MatmulFunction::apply(aa, bb);
}

std::pair<Tensor, Tensor> gemm_linear_grads(const Tensor& grad, const Tensor& x, const Tensor& w, bool need_x,
                                            bool need_w) {
  const Tensor g = grad.reshape({-1, grad.size(-1)});
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  Tensor dx, dw;
  // gemm_linear took LinearFunction where the policy applies to x in its GEMM dtype (x's own: under autocast x
  // is already in autocast's dtype here), else at::linear, whose x2d @ w^T is an aten::mm: autograd's
  // mm_mat1_backward (row-major x2d) is grad @ w, mm_mat2_backward (w^T column-major) is (grad^T @ x2d)^T,
  // transposed back to w's orientation.
  if (layouts_apply(x, x.scalar_type())) {
    if (need_x) dx = mm_layout(g, w).view(x.sizes());
    if (need_w) dw = mm_layout(g.t(), x2d);
  } else {
    if (need_x) dx = g.mm(w).view(x.sizes());
    if (need_w) dw = g.t().mm(x2d);
  }
  return {dx, dw};
}

Tensor gemm_mm(const Tensor& a, const Tensor& b) { return layouts_apply(a, a.scalar_type()) ? mm_layout(a, b) : a.mm(b); }

Tensor& gemm_addmm_(Tensor& acc, const Tensor& a, const Tensor& b) {
  if (!layouts_apply(a, a.scalar_type())) return acc.addmm_(a, b);
  const auto [x, y] = layout_2d(a, b);
  return acc.addmm_(x, y);
}

std::string cpu_gemm_layout(const std::optional<std::string>& set) {
  static const char* names[] = {"auto", "nt", "off"};
  const int before = set.has_value() ? mode().exchange(mode_from(*set)) : mode().load();
  return names[before];
}

}  // namespace layers
}  // namespace ckpt_ext
