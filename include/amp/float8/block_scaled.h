// amp/float8/block_scaled.h: what a Float8 region runs for its linears under
// the block-scaled recipes, MXFP8<Mode> and NVFP4<SR> (amp/core/policy.h),
// each GEMM's operands quantized, then multiplied by block_scaled_mm.h
// (emulated: dequantized, then one mm; CUDA's block-scaled _scaled_mm where
// that applies, which the sentences on dtypes below do not describe).
//
//   amp::Trainer<amp::Float8<amp::MXFP8<>>, amp::CPU> trainer(model, opt);   // or amp::NVFP4<>
//   trainer.step([&](auto&) { return loss_fn(model->forward(x), y); });
//
// Both recipes first cast the input and the weight to bf16, as torchao's
// MXLinear and Transformer Engine's Linear do under autocast, pad the input's
// rows with zeros to a multiple of the block (the padded rows change no real
// row's bits and are dropped after), and add the bias in bf16 after the GEMM.
//   - MXFP8<Mode>: torchao's MXFP8Linear with KernelPreference.EMULATED
//     (mxfp8_linear.h): e4m3 in blocks of 32 along each GEMM's reduction
//     dimension, forward, dgrad and wgrad; every operand dequantized to bf16
//     and multiplied there. A linear runs it when in and out features are
//     multiples of 32.
//   - NVFP4<SR>: Transformer Engine's NVFP4BlockScaling recipe (nvfp4.h):
//       forward  Y  = X·Wᵀ   X in 1x16 blocks, W in 16x16 tiles;
//       dgrad    dX = dY·W   dY in 1x16 blocks (along N), Wᵀ in 16x16 tiles;
//       wgrad    dW = dYᵀ·X  dYᵀ and Xᵀ through the random Hadamard transform
//                            (16-element blocks along the batch rows), then
//                            1x16 blocks;
//     every operand dequantized to fp32 (torchao's NVFP4Tensor.dequantize),
//     multiplied in fp32 (the tensor cores' accumulator), the product cast
//     to bf16. With SR the gradient's two casts (dY, dYᵀ) round
//     stochastically, from the generator bound on this thread at the
//     forward (a Trainer's or Fabric's, detail::StochasticRoundingGuard) or
//     else the device's default generator. A linear runs it when in and out features
//     are multiples of 16.
// Other linears (and every other op) run in bf16, as in every Float8 region.
// Needs the float8 dtypes (LibTorch 2.1+).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <ATen/Context.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Optional.h>
#include <torch/autograd.h>

#include <cstdint>
#include <vector>

#include "amp/core/policy.h"
#include "amp/detail/compat_float8.h"
#include "amp/float8/block_scaled_mm.h"
#include "amp/float8/mxfp8.h"
#include "amp/float8/mxfp8_linear.h"
#include "amp/float8/nvfp4.h"
#include "amp/precision/strict_casts.h"

namespace amp {
namespace float8 {
namespace detail {

// The block a recipe's linears are tiled by: a weight whose dimensions are
// multiples of it runs the recipe (16 for the per-tensor and rowwise
// recipes: _scaled_mm's rule).
template <class Recipe>
inline constexpr int64_t kLinearBlock = 16;
template <MxScaleMode Mode>
inline constexpr int64_t kLinearBlock<MXFP8<Mode>> = kMxBlock;

template <class Recipe>
inline bool fits_recipe(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.size(0) % kLinearBlock<Recipe> == 0 && weight.size(1) % kLinearBlock<Recipe> == 0;
}

// The generator NVFP4's stochastic rounding draws from on this thread (null: the device's default).
inline at::Generator*& stochastic_rounding_generator() {
  static thread_local at::Generator* gen = nullptr;
  return gen;
}

// RAII: `gen` is this thread's stochastic-rounding generator while it lives.
class StochasticRoundingGuard {
 public:
  explicit StochasticRoundingGuard(at::Generator& gen) : prev_(stochastic_rounding_generator()) {
    stochastic_rounding_generator() = &gen;
  }
  ~StochasticRoundingGuard() { stochastic_rounding_generator() = prev_; }
  StochasticRoundingGuard(const StochasticRoundingGuard&) = delete;
  StochasticRoundingGuard& operator=(const StochasticRoundingGuard&) = delete;

 private:
  at::Generator* prev_;
};

#if AMP_DETAIL_HAS_FLOAT8_DTYPE

inline at::Generator rounding_generator(const at::Tensor& like) {
  at::Generator* bound = stochastic_rounding_generator();
  return bound != nullptr ? *bound : at::globalContext().defaultGenerator(like.device());
}

// x [M, K] · w [N, K]ᵀ with Transformer Engine's NVFP4 recipe (see the top
// of this file); M a multiple of 16.
struct Nvfp4Matmul : torch::autograd::Function<Nvfp4Matmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            bool stochastic) {
    ctx->save_for_backward({x, w});
    if (stochastic) ctx->saved_data["gen"] = rounding_generator(x);  // the forward's: backward runs unbound
    return nvfp4_mm(to_nvfp4(x), to_nvfp4(w, /*tiles_16x16=*/true), x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor dy = grads[0].contiguous();
    c10::optional<at::Generator> gen;
    if (ctx->saved_data.count("gen")) gen = ctx->saved_data["gen"].toGenerator();
    const at::Tensor dx = nvfp4_mm(to_nvfp4(dy, false, gen), to_nvfp4(w.t().contiguous(), true), dy.scalar_type());
    const at::Tensor dw = nvfp4_mm(to_nvfp4(rht16(dy.t().contiguous()), false, gen),
                                   to_nvfp4(rht16(x.t().contiguous())), w.scalar_type());
    return {dx, dw, at::Tensor()};
  }
};

// t [M, ...] with zero rows appended up to a multiple of `block`.
inline at::Tensor pad_rows(const at::Tensor& t, int64_t block) {
  const int64_t rows = t.size(0), padded = (rows + block - 1) / block * block;
  return padded == rows ? t : at::constant_pad_nd(t, {0, 0, 0, padded - rows}, 0.0);
}

// A routed linear under a block-scaled recipe: the recipe's GEMMs where the
// weight fits it, else at::linear (bf16 under the region's autocast).
template <class Recipe>
at::Tensor block_scaled_linear(const at::Tensor& input, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias) {
  if (!fits_recipe<Recipe>(weight)) return at::linear(input, weight, bias);
  // amp's own casts, not the user's: strict casts do not see them; the GEMMs run as written.
  c10::impl::ExcludeDispatchKeyGuard not_user_code(amp::detail::kStrictCastsKey);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "amp: a block-scaled linear got input ",
              input.sizes(), " for a weight ", weight.sizes(),
              "; the input's last dimension must be the weight's second");
  const at::Tensor x2d = input.to(at::kBFloat16).reshape({-1, input.size(-1)});
  const at::Tensor x = pad_rows(x2d, kLinearBlock<Recipe>);
  const at::Tensor w = weight.to(at::kBFloat16);
  at::Tensor y;
  if constexpr (kLinearBlock<Recipe> == kMxBlock) {
    y = Mxfp8Matmul::apply(
        x, w, static_cast<int64_t>(Recipe::scale_mode == MxScaleMode::kFloor ? MxScale::kFloor : MxScale::kRceil),
        false);
  } else {
    y = Nvfp4Matmul::apply(x, w, Recipe::stochastic_rounding);
  }
  if (x.size(0) != x2d.size(0)) y = y.narrow(0, 0, x2d.size(0));
  return finish_linear(y, input, weight, bias);
}

#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace detail
}  // namespace float8
}  // namespace amp
