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
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/core/policy.h"
#include "amp/detail/compat_float8.h"
#include "amp/float8/recipe.h"
#include "amp/precision/linear_routing.h"
#include "amp/precision/strict_casts.h"

namespace amp {
namespace float8 {

namespace detail {

// Whether a linear of `weight` ([out, in]) runs in float8: both dimensions
// multiples of 16. Others stay in the region's 16-bit dtype (torchao's filter).
inline bool fits(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0;
}

// Every torch::nn::Linear in `model`, with its module path ("linear" for a
// model that is one), in named_modules() order.
inline std::vector<std::pair<std::string, torch::nn::LinearImpl*>> linears_of(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::nn::LinearImpl*>> out;
  // The model itself apart: one held without ownership (a `Net model;`) has no shared_ptr for named_modules().
  if (const auto* self = dynamic_cast<const torch::nn::LinearImpl*>(&model))
    out.emplace_back("linear", const_cast<torch::nn::LinearImpl*>(self));
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) out.emplace_back(item.key(), linear);
  }
  return out;
}

// An amp: error when `guard` is opened where a block-scaled region's recipe
// is in force (LinearRoutingState::fixed_by): it would replace that recipe
// for every linear.
inline void check_no_block_scaled_region(const char* guard, const char* replacement) {
  const char* recipe = amp::detail::linear_routing_state().fixed_by;
  TORCH_CHECK(recipe == nullptr, "amp: ", guard, " opened inside a Region<Float8<", recipe,
              "<...>>> (a Trainer's or Fabric's too) would run its linears in ", replacement, " instead of ", recipe,
              ", which takes each block's scale from its own amax at the cast and keeps no scaling state; use one "
              "recipe: the region's without the guard, or a Region, Trainer or Fabric of amp::Float8<",
              replacement, ">");
}
}  // namespace detail

#if AMP_DETAIL_HAS_FLOAT8_MATMUL

namespace detail {
// The dtype a float8 linear computes and returns in (and that the rest of a
// float8 model runs in under autocast).
inline constexpr at::ScalarType kComputeDtype = at::kBFloat16;

// at::_scaled_mm as torchao reaches it: inside mm's autocast kernel, with
// autocast excluded. Where LibTorch emulates it (a CPU without AMX-INT8, or
// oneDNN off) it dequantizes to fp32 and calls at::matmul, which autocast
// would otherwise round to bf16.
inline at::Tensor scaled_mm_call(const at::Tensor& a8, const at::Tensor& b8, const at::Tensor& a_inv_scale,
                                 const at::Tensor& b_inv_scale, at::ScalarType out, bool fast_accum) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::_scaled_mm(a8, b8, a_inv_scale, b_inv_scale, c10::nullopt, c10::nullopt, out, fast_accum);
}

// a8 [M, K] row-major times b8 [K, N] column-major, each with its scale
// (x_fp8 = x * scale): _scaled_mm takes the inverse scales.
inline at::Tensor scaled_mm(const at::Tensor& a8, const at::Tensor& b8, const at::Tensor& a_scale,
                            const at::Tensor& b_scale, at::ScalarType out) {
  return scaled_mm_call(a8, b8, a_scale.reciprocal(), b_scale.reciprocal(), out, false);
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

// Delayed scaling's state for one linear (TE's layout): the forward's group
// (roles 0 input, 1 weight; e4m3) and the backward's (role 0 output
// gradient; e5m2), each an amax history [length, roles] and a scale [roles],
// fp32 on the weight's device. amp/float8/delayed.h owns and updates them.
struct DelayedSlots {
  at::Tensor fwd_history, fwd_scale, bwd_history, bwd_scale;
};

// The scale of tensor t in role `role` of a group: its own amax's
// (tensorwise current scaling, slots null) or the group's delayed scale, the
// amax then kept in the history's slot 0 (the largest of the step's calls).
inline at::Tensor scale_for(const at::Tensor& t, at::ScalarType fp8, const at::Tensor* history, const at::Tensor* scale,
                            int64_t role) {
  const at::Tensor amax = amax_of(t);
  if (history == nullptr) return scale_from_amax(amax, fp8);
  at::Tensor slot = history->select(0, 0).select(0, role);
  slot.copy_(at::maximum(slot, amax));
  return scale->select(0, role).clone();
}

// x [M, K] (compute dtype) · w [N, K]ᵀ (fp32 master weight) -> [M, N] in x's
// dtype; delayed scaling when `slots` is not null, tensorwise otherwise.
struct Float8Matmul : torch::autograd::Function<Float8Matmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const DelayedSlots* slots) {
    const at::Tensor* history = slots ? &slots->fwd_history : nullptr;
    const at::Tensor* scale = slots ? &slots->fwd_scale : nullptr;
    const at::Tensor x_scale = scale_for(x, kE4M3, history, scale, 0);
    const at::Tensor w_scale = scale_for(w, kE4M3, history, scale, 1);
    const at::Tensor x8 = to_float8(x, x_scale, kE4M3);
    const at::Tensor w8 = to_float8(w, w_scale, kE4M3);
    ctx->save_for_backward({x8, x_scale, w8, w_scale});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    if (slots) {
      ctx->saved_data["bwd_history"] = slots->bwd_history;  // the same tensors: backward records into them
      ctx->saved_data["bwd_scale"] = slots->bwd_scale;
    }
    return scaled_mm(x8, w8.t(), x_scale, w_scale, x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x8 = saved[0], &x_scale = saved[1], &w8 = saved[2], &w_scale = saved[3];
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor g_scale;
    if (ctx->saved_data.count("bwd_history")) {
      const at::Tensor history = ctx->saved_data["bwd_history"].toTensor();
      const at::Tensor scale = ctx->saved_data["bwd_scale"].toTensor();
      g_scale = scale_for(dy, kE5M2, &history, &scale, 0);
    } else {
      g_scale = scale_for(dy, kE5M2, nullptr, nullptr, 0);
    }
    const at::Tensor g8 = to_float8(dy, g_scale, kE5M2);
    // dX [M, K] = dY [M, N] · W [N, K] (W column-major).
    const at::Tensor dx = scaled_mm(g8, w8.t().contiguous().t(), g_scale, w_scale, dy.scalar_type());
    // dW [N, K] = dYᵀ [N, M] · X [M, K] (X column-major), M padded to a multiple of 16.
    const at::Tensor g8p = pad_rows_to_16(g8), x8p = pad_rows_to_16(x8);
    const at::Tensor dw = scaled_mm(g8p.t().contiguous(), x8p.t().contiguous().t(), g_scale, x_scale, dy.scalar_type());
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    return {dx, dw.to(w_dtype), at::Tensor()};
  }
};

// A float8 linear's frame: input [..., in] cast to the compute dtype and
// flattened to 2-D for matmul(x2d) (an autograd function's apply), the
// result reshaped to [..., out], the bias added in that dtype (torchao's
// `output + bias.to(output.dtype)`).
template <class Matmul>
at::Tensor linear_via(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      Matmul&& matmul) {
  // amp's own casts, not the user's: strict casts do not see them.
  c10::impl::ExcludeDispatchKeyGuard not_user_code(amp::detail::kStrictCastsKey);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "amp: float8::linear got input ", input.sizes(),
              " for a weight ", weight.sizes(), "; the input's last dimension must be the weight's second");
  const at::Tensor x = input.to(kComputeDtype);
  at::Tensor y = matmul(x.reshape({-1, x.size(-1)}));
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = weight.size(0);
  y = y.reshape(shape);
  if (bias && bias->defined()) y = y + bias->to(kComputeDtype);
  return y;
}

// float8::linear's body, with delayed scaling when `slots` is not null.
inline at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const DelayedSlots* slots) {
  return linear_via(input, weight, bias, [&](const at::Tensor& x) { return Float8Matmul::apply(x, weight, slots); });
}

}  // namespace detail

// y = x·Wᵀ (+ b): in float8 with Recipe's scaling when `weight` fits, else
// at::linear. x of any shape [..., in]; y [..., out] in bf16 on the float8
// path. Recipe: Tensorwise (here), Rowwise or RowwiseWithGwHp
// (amp/float8/rowwise.h); Delayed's scales live in a DelayedScaling
// (amp/float8/delayed.h).
template <class Recipe = Tensorwise>
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias = c10::nullopt) {
  static_assert(std::is_same_v<Recipe, Tensorwise>,  // rowwise.h specializes Rowwise and RowwiseWithGwHp
                "amp: float8::linear<Recipe> takes amp::Tensorwise here; for amp::Rowwise and "
                "amp::RowwiseWithGwHp #include <amp/float8/rowwise.h>; Delayed scaling runs through "
                "amp::float8::DelayedScaling and DelayedLinearGuard");
  if (!detail::fits(weight)) return at::linear(input, weight, bias);
  return detail::float8_linear(input, weight, bias, nullptr);
}

// RAII: while it lives, every linear that a routing region routes on this
// thread (amp/precision/linear_routing.h: a Mixed region with LinearRouting::kOn)
// runs float8::linear<Recipe>, whatever module or function called it. The
// previous LinearFn comes back after.
template <class Recipe = Tensorwise>
class LinearGuard {
 public:
  // Inside a block-scaled region (Float8<MXFP8<...>> or <NVFP4<...>>): an amp: error.
  LinearGuard()
      : fn_((detail::check_no_block_scaled_region("amp::float8::LinearGuard", recipe_name()),
             &float8::linear<Recipe>)) {}

 private:
  static const char* recipe_name() {
    if constexpr (std::is_same_v<Recipe, Rowwise>) return "amp::Rowwise";
    if constexpr (std::is_same_v<Recipe, RowwiseWithGwHp>) return "amp::RowwiseWithGwHp";
    return "amp::Tensorwise";
  }
  amp::detail::LinearFnGuard fn_;
};

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace float8
}  // namespace amp
