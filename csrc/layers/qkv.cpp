// The fused q/k/v projection as one autograd node (qkv_heads, family.h): one GEMM over the three weights
// forward, and a backward that works on the three gradients as the attention backward returns them, with
// no [T, q + 2 kv] gradient concatenated (autograd's backward of split_qkv's split) and no concatenated
// weight saved or split again:
//
//   dx  = dq Wq + dk Wk + dv Wv   (one GEMM, then two accumulating into its output: addmm_, beta = 1;
//                                  Hugging Face's three nn.Linear add their input gradients the same way)
//   dWq = dq^T x, db_q = sum of dq over tokens (and k, v alike)
//
// dq as [T, H] is a view when the attention backward leaves it laid out [B, S, heads, D] (the CUDA fused
// kernels); otherwise one copy per part (what the concatenation copied). Autocast: the arguments are cast
// as autocast casts linear's (gemm_linear), outside the node, which then runs with autocast off -- except x where
// the caller asks for x's residual handle (issue 32, BERT: x is also LN1's residual): the node takes x itself, casts
// it inside (the same bits as autocast's cast) and returns an alias of x as a fourth output for the residual; its
// backward adds that handle's gradient (float32) to dx (the GEMMs' dtype) in one mixed-dtype add, where autograd
// ran the cast's backward (bfloat16 -> float32) and then its own add: the same float32 sums, one pass fewer.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include "family.h"

namespace ckpt_ext {
namespace layers {

namespace {

// [B, heads, S, D] -> [B * S, heads * D] (a view when laid out [B, S, heads, D]).
Tensor tokens_2d(const Tensor& t) { return t.transpose(1, 2).reshape({t.size(0) * t.size(2), t.size(1) * t.size(3)}); }

struct QkvFunction : torch::autograd::Function<QkvFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const Tensor& wq, const Tensor& wk, const Tensor& wv,
                                                const std::optional<Tensor>& bq, const std::optional<Tensor>& bk,
                                                const std::optional<Tensor>& bv, int64_t q_heads, int64_t kv_heads,
                                                int64_t head_dim, std::optional<at::ScalarType> x_cast) {
    const bool bias = bq.has_value() && bq->defined();
    const Tensor xg = gemm_x(x, x_cast);
    const Tensor qkv = gemm_linear(xg, at::cat({wq, wk, wv}, 0), bias ? at::cat({*bq, *bk, *bv}, 0) : Tensor());
    record_gemm(KeptGemms::kQkv, qkv);  // a recompute level's forward keeps it (KeptGemms)
    return finish(ctx, x, xg, wq, wk, wv, bias, qkv, q_heads, kv_heads, head_dim, x_cast.has_value());
  }

  // x_cast (the residual handle, under autocast): x in the GEMMs' dtype, cast here as autocast casts it.
  static Tensor gemm_x(const Tensor& x, std::optional<at::ScalarType> x_cast) {
    return x_cast.has_value() && x.scalar_type() != *x_cast ? x.to(*x_cast) : x;
  }

  // Saves what backward needs and returns q, k, v of the projection `qkv` (also the kept node's forward), and with
  // `residual` an alias of x (the residual handle; only xg, x in the GEMMs' dtype, is saved).
  static torch::autograd::variable_list finish(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                               const Tensor& xg, const Tensor& wq, const Tensor& wk,
                                               const Tensor& wv, bool bias, const Tensor& qkv, int64_t q_heads,
                                               int64_t kv_heads, int64_t head_dim, bool residual) {
    ctx->save_for_backward({xg, wq, wk, wv});
    ctx->saved_data["bias"] = bias;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    const auto parts = split_qkv(qkv, q_heads, kv_heads, head_dim);
    if (residual) return {parts[0], parts[1], parts[2], x.alias()};
    return {parts[0], parts[1], parts[2]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto out = gradients(ctx, grads);
    out.resize(11);
    return out;
  }

  // {dx, dwq, dwk, dwv, dbq, dbk, dbv}.
  static torch::autograd::variable_list gradients(torch::autograd::AutogradContext* ctx,
                                                  const torch::autograd::variable_list& grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];  // x in the GEMMs' dtype
    const bool bias = ctx->saved_data.at("bias").toBool();
    torch::autograd::variable_list out(7);
    const Tensor x2d = x.reshape({-1, x.size(-1)});
    Tensor dx;
    for (int i = 0; i < 3; ++i) {
      if (!grads[i].defined()) continue;
      const Tensor g = tokens_2d(grads[i]);
      const Tensor& w = saved[1 + i];
      if (ctx->needs_input_grad(0)) dx = dx.defined() ? gemm_addmm_(dx, g, w) : gemm_mm(g, w);
      if (ctx->needs_input_grad(1 + i)) out[1 + i] = gemm_mm(g.t(), x2d);
      if (bias && ctx->needs_input_grad(4 + i)) out[4 + i] = g.sum(0);
    }
    if (!ctx->needs_input_grad(0)) return out;
    // The residual handle's gradient (x's dtype, float32 under autocast): one add, promoting dx as autograd's cast
    // did; without it, dx cast back to x's dtype (the cast's backward).
    const Tensor res = grads.size() > 3 ? grads[3] : Tensor();
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data.at("x_dtype").toInt());
    if (dx.defined()) dx = dx.view(x.sizes());
    if (res.defined())
      out[0] = dx.defined() ? at::add(res, dx) : res;
    else if (dx.defined())
      out[0] = dx.scalar_type() == x_dtype ? dx : dx.to(x_dtype);
    return out;
  }
};

// The replay of a kept projection (KeptGemms, site kQkv): q, k, v of the kept output, and QkvFunction's backward.
struct KeptQkvFunction : torch::autograd::Function<KeptQkvFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const Tensor& wq, const Tensor& wk, const Tensor& wv,
                                                const std::optional<Tensor>& bq, const std::optional<Tensor>& bk,
                                                const std::optional<Tensor>& bv, const KeptTensor& kept,
                                                int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                                std::optional<at::ScalarType> x_cast) {
    return QkvFunction::finish(ctx, x, QkvFunction::gemm_x(x, x_cast), wq, wk, wv, bq.has_value() && bq->defined(),
                               kept.t.detach(), q_heads, kv_heads, head_dim, x_cast.has_value());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto out = QkvFunction::gradients(ctx, grads);
    out.resize(12);
    return out;
  }
};

Tensor autocast_cast(const Tensor& t, c10::DeviceType dt) {
  return t.defined() ? at::autocast::cached_cast(at::autocast::get_autocast_dtype(dt), t, dt) : t;
}

}  // namespace

std::array<Tensor, 3> qkv_heads(const Tensor& x, std::array<Tensor, 3> w, std::array<Tensor, 3> b, int64_t q_heads,
                                int64_t kv_heads, int64_t head_dim, Tensor* residual) {
  const bool bias = b[0].defined() && b[1].defined() && b[2].defined();
  Tensor xx = x;
  std::optional<at::ScalarType> x_cast;
  const c10::DeviceType dt = x.device().type();
  if ((dt == c10::DeviceType::CPU || dt == c10::DeviceType::CUDA) && at::autocast::is_autocast_enabled(dt) &&
      at::isFloatingType(x.scalar_type())) {
    // The residual handle where autocast casts x (x is not a cached weight: autocast's cast is a plain x.to()).
    const auto cast = at::autocast::get_autocast_dtype(dt);
    if (residual != nullptr && x.scalar_type() != cast)
      x_cast = cast;
    else
      xx = autocast_cast(x, dt);
    for (int i = 0; i < 3; ++i) {
      w[i] = autocast_cast(w[i], dt);
      b[i] = bias ? autocast_cast(b[i], dt) : Tensor();
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const Tensor kept = kept_gemm(KeptGemms::kQkv);
  if (kept.defined()) {
    const int64_t width = (q_heads + 2 * kv_heads) * head_dim;
    TORCH_CHECK(kept.dim() == 3 && kept.size(0) == x.size(0) && kept.size(1) == x.size(1) && kept.size(2) == width &&
                    kept.scalar_type() == w[0].scalar_type(),
                "ckpt_ext fused segment: the q/k/v projection kept in forward (", kept.sizes(), ") does not match the "
                "replay's; the replay must run the layers as forward did");
    const auto r = KeptQkvFunction::apply(xx, w[0], w[1], w[2], bias ? opt(b[0]) : std::nullopt,
                                          bias ? opt(b[1]) : std::nullopt, bias ? opt(b[2]) : std::nullopt,
                                          KeptTensor{kept}, q_heads, kv_heads, head_dim, x_cast);
    if (residual != nullptr) *residual = x_cast ? r[3] : x;
    return {r[0], r[1], r[2]};
  }
  const auto r = QkvFunction::apply(xx, w[0], w[1], w[2], bias ? opt(b[0]) : std::nullopt,
                                    bias ? opt(b[1]) : std::nullopt, bias ? opt(b[2]) : std::nullopt, q_heads,
                                    kv_heads, head_dim, x_cast);
  if (residual != nullptr) *residual = x_cast ? r[3] : x;
  return {r[0], r[1], r[2]};
}

}  // namespace layers
}  // namespace ckpt_ext
