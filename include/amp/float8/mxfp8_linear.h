// amp/float8/mxfp8_linear.h: a linear layer's three GEMMs in MXFP8 (each one
// block_scaled_mm.h's mx_mm: emulated, or CUDA's block-scaled _scaled_mm
// where that applies), as one autograd function.
//
//   namespace f8 = amp::float8::detail;  // internal until the MXFP8 policy lands
//   at::Tensor y = f8::mxfp8_linear(x, fc->weight, fc->bias, f8::MxScale::kRceil);
//
// The reference is torchao's MXFP8Linear with KernelPreference.EMULATED
// (torchao/prototype/moe_training/mxfp8_linear.py: mx_mm; mx_formats/utils.py:
// _to_mxfp8_dim1_kernel_wrapper's EMULATED branch; mx_tensor.py:
// _addmm_mx_dispatch's EMULATED branch, mx_t), every cast e4m3 in blocks of 32:
//   forward  Y  = X·Wᵀ   X and W blocked along K (in_features);
//   dgrad    dX = dY·W   dY blocked along N (out_features), W along N
//                        (Wᵀ made contiguous, then quantized);
//   wgrad    dW = dYᵀ·X  dYᵀ and Xᵀ blocked along M (the batch rows), or
//                        (wgrad_hp) the plain mm of dYᵀ and X.
// Emulated, each product is at::mm of the operands dequantized to their own
// dtype (the second as a transposed view, as torchao's dequantize of a
// transposed MXTensor gives it); the bias is added after, in the output's dtype. x is
// flattened to [M, K]; M, K and N must be multiples of 32 (mxfp8_fits).
// Parity with torchao is checked in fp32 (tests/parity/block_scaled_parity):
// under autocast torchao's subclass dispatch is not yet transcribed.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/autograd.h>

#include <cstdint>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/float8/block_scaled_mm.h"
#include "amp/float8/mxfp8.h"

namespace amp {
namespace float8 {
namespace detail {

#if AMP_DETAIL_HAS_FLOAT8_DTYPE

struct Mxfp8Matmul : torch::autograd::Function<Mxfp8Matmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            int64_t mode, bool wgrad_hp) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["wgrad_hp"] = wgrad_hp;
    const auto m = static_cast<MxScale>(mode);
    return mx_mm(to_mx(x, m), x.scalar_type(), to_mx(w, m), w.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const auto m = static_cast<MxScale>(ctx->saved_data["mode"].toInt());
    const at::Tensor dy = grads[0].contiguous();
    const at::Tensor wt = w.t().contiguous();
    const at::Tensor dx = mx_mm(to_mx(dy, m), dy.scalar_type(), to_mx(wt, m), w.scalar_type());
    at::Tensor dw;
    if (ctx->saved_data["wgrad_hp"].toBool()) {
      dw = at::mm(dy.t(), x);
    } else {
      dw = mx_mm(to_mx(dy.t().contiguous(), m), dy.scalar_type(), to_mx(x.t().contiguous(), m), x.scalar_type());
    }
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

// Whether an MXFP8 linear of `weight` ([out, in]) over `rows` input rows can
// run: every blocked dimension a multiple of 32.
inline bool mxfp8_fits(const at::Tensor& weight, int64_t rows) {
  return weight.dim() == 2 && weight.size(0) % kMxBlock == 0 && weight.size(1) % kMxBlock == 0 && rows % kMxBlock == 0;
}

// y = x·Wᵀ (+ b) with the three GEMMs in MXFP8 (see the top of this file).
// A block-scaled GEMM's 2-D output y back in input's shape (the last
// dimension out_features), the bias added after in y's dtype.
inline at::Tensor finish_linear(at::Tensor y, const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = weight.size(0);
  y = y.reshape(shape);
  if (bias && bias->defined()) y = y + bias->to(y.scalar_type());
  return y;
}

inline at::Tensor mxfp8_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               MxScale mode, bool wgrad_hp = false) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "amp: mxfp8_linear got input ", input.sizes(),
              " for a weight ", weight.sizes(), "; the input's last dimension must be the weight's second");
  const at::Tensor x = input.reshape({-1, input.size(-1)});
  TORCH_CHECK(mxfp8_fits(weight, x.size(0)), "amp: an MXFP8 linear blocks its rows, in_features and out_features ",
              "by 32; got ", x.size(0), " rows and a weight ", weight.sizes(), ": use at::linear for this layer");
  return finish_linear(Mxfp8Matmul::apply(x, weight, static_cast<int64_t>(mode), wgrad_hp), input, weight, bias);
}

#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace detail
}  // namespace float8
}  // namespace amp
