// amp/float8/linear.h: a linear layer's matmuls in float8 with tensorwise
// current scaling (torchao.float8's default recipe), as one autograd function.
//
//   auto y = amp::float8::linear(x, fc->weight, fc->bias);   // y in bf16; fc's weight stays fp32
//
// Forward: y = x·Wᵀ with x and W cast to e4m3, each with its own scale.
// Backward: the output gradient dY cast to e5m2 ("HYBRID"), then
// dX = dY·W (e5m2 × e4m3) and dW = dYᵀ·X (e5m2 × e4m3), both by _scaled_mm,
// the latter over the batch padded with zero rows to a multiple of 16. The
// saved activations are the float8 copies. The bias is added in bf16 after
// the matmul, as torchao does. A weight whose dimensions are not multiples of
// 16 (_scaled_mm's rule) runs at::linear instead (under autocast: bf16).
// Needs at::_scaled_mm: LibTorch 2.5 (CUDA, compute capability 8.9+), 2.8
// for CPU (emulated there: for correctness, not speed).
#pragma once

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdint>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/float8/recipe.h"
#include "amp/linear_routing.h"
#include "amp/strict_casts.h"

namespace amp {
namespace float8 {

// Whether a linear of `weight` ([out, in]) runs in float8: both dimensions
// multiples of 16. Others stay in the region's 16-bit dtype (torchao's filter).
inline bool fits(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0;
}

#if AMP_DETAIL_HAS_FLOAT8_MATMUL

// The dtype a float8 linear computes and returns in (and that the rest of a
// float8 model runs in under autocast).
inline constexpr at::ScalarType kComputeDtype = at::kBFloat16;

namespace detail {

// a8 [M, K] row-major times b8 [K, N] column-major, each with its scale
// (x_fp8 = x * scale): _scaled_mm takes the inverse scales.
inline at::Tensor scaled_mm(const at::Tensor& a8, const at::Tensor& b8, const at::Tensor& a_scale,
                            const at::Tensor& b_scale, at::ScalarType out) {
  return at::_scaled_mm(a8, b8, a_scale.reciprocal(), b_scale.reciprocal(), c10::nullopt, c10::nullopt, out, false);
}

// t [M, ...] with zero rows appended up to a multiple of 16 (t itself when M is one).
inline at::Tensor pad_rows_to_16(const at::Tensor& t) {
  const int64_t rows = t.size(0), padded = (rows + 15) / 16 * 16;
  if (padded == rows) return t;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = padded;
  at::Tensor out = at::zeros(shape, t.options());
  out.narrow(0, 0, rows).copy_(t);
  return out;
}

// x [M, K] (compute dtype) · w [N, K]ᵀ (fp32 master weight) -> [M, N] in x's dtype.
struct TensorwiseMatmul : torch::autograd::Function<TensorwiseMatmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    const at::Tensor x_scale = scale_from_amax(amax_of(x), kE4M3);
    const at::Tensor w_scale = scale_from_amax(amax_of(w), kE4M3);
    const at::Tensor x8 = to_float8(x, x_scale, kE4M3);
    const at::Tensor w8 = to_float8(w, w_scale, kE4M3);
    ctx->save_for_backward({x8, x_scale, w8, w_scale});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return scaled_mm(x8, w8.t(), x_scale, w_scale, x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x8 = saved[0], &x_scale = saved[1], &w8 = saved[2], &w_scale = saved[3];
    const at::Tensor dy = grads[0].contiguous();
    const at::Tensor g_scale = scale_from_amax(amax_of(dy), kE5M2);
    const at::Tensor g8 = to_float8(dy, g_scale, kE5M2);
    // dX [M, K] = dY [M, N] · W [N, K] (W column-major).
    const at::Tensor dx = scaled_mm(g8, w8.t().contiguous().t(), g_scale, w_scale, dy.scalar_type());
    // dW [N, K] = dYᵀ [N, M] · X [M, K] (X column-major), M padded to a multiple of 16.
    const at::Tensor g8p = pad_rows_to_16(g8), x8p = pad_rows_to_16(x8);
    const at::Tensor dw = scaled_mm(g8p.t().contiguous(), x8p.t().contiguous().t(), g_scale, x_scale, dy.scalar_type());
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    return {dx, dw.to(w_dtype)};
  }
};

}  // namespace detail

// y = x·Wᵀ (+ b): in float8 (tensorwise) when `weight` fits, else at::linear.
// x of any shape [..., in]; y [..., out] in bf16 on the float8 path.
inline at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias = c10::nullopt) {
  if (!fits(weight)) return at::linear(input, weight, bias);
  // amp's own casts, not the user's: strict casts do not see them.
  c10::impl::ExcludeDispatchKeyGuard not_user_code(amp::detail::kStrictCastsKey);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "amp: float8::linear got input ", input.sizes(),
              " for a weight ", weight.sizes(), "; the input's last dimension must be the weight's second");
  const at::Tensor x = input.to(kComputeDtype);
  at::Tensor y = detail::TensorwiseMatmul::apply(x.reshape({-1, x.size(-1)}), weight);
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = weight.size(0);
  y = y.reshape(shape);
  if (bias && bias->defined()) y = y + bias->to(kComputeDtype);
  return y;
}

// RAII: while it lives, every linear that a routing region routes on this
// thread (amp/linear_routing.h: a Mixed region with LinearRouting::kOn)
// runs float8::linear, whatever module or function called it. The previous
// LinearFn comes back after.
class LinearGuard {
 public:
  LinearGuard() : prev_(amp::detail::set_linear_fn(&float8::linear)) {}
  ~LinearGuard() { amp::detail::set_linear_fn(prev_); }
  LinearGuard(const LinearGuard&) = delete;
  LinearGuard& operator=(const LinearGuard&) = delete;

 private:
  amp::detail::LinearFn prev_;
};

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace float8
}  // namespace amp
