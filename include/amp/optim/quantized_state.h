// amp/optim/quantized_state.h: QuantizedState, one optimizer moment kept in
// 8 bits, 4 bits or fp8 with one fp32 scale per block (torchao.optim's
// OptimState8bit, OptimState4bit and OptimStateFp8), or in the parameter's
// own dtype for small tensors.
//
//   amp::detail::QuantizedState m = amp::detail::QuantizedState::zeros(param, amp::StateFormat::kInt8,
//   /*is_signed=*/true, 256); at::Tensor f = m.dequantize();       // fp32, param's shape m.assign_(f.lerp(grad, 0.1));
//   // block-wise absmax scale, codes rounded to the nearest map entry
//
// The math is torchao's, op for op in eager mode (torchao/optim/quant_utils.py,
// subclass_8bit.py, subclass_4bit.py, subclass_fp8.py), so the codes and
// scales are bitwise those of the same algorithm in Python torch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_codec.h"
#include "amp/optim/state_format.h"

namespace amp {
namespace detail {

class QuantizedState {
 public:
  QuantizedState() = default;

  // A zero state for `param` (its shape, device and, for kFloat, dtype).
  // Quantized formats need numel a multiple of block_size.
  static QuantizedState zeros(const at::Tensor& param, StateFormat format, bool is_signed, int64_t block_size) {
    QuantizedState s;
    s.format_ = format;
    s.signed_ = is_signed;
    s.sizes_ = param.sizes().vec();
    s.numel_ = param.numel();
    s.block_size_ = format == StateFormat::kFloat ? 0 : block_size;
    if (format == StateFormat::kFloat) {
      s.values_ = at::zeros_like(param, at::MemoryFormat::Contiguous);
      return s;
    }
    TORCH_CHECK(block_size > 0 && s.numel_ % block_size == 0, "amp: a ", detail::state_format_name(format),
                " state needs a numel that is a multiple of the block size ", block_size, ", got ", s.numel_);
    TORCH_CHECK(format != StateFormat::kInt4 || block_size % 2 == 0, "amp: a 4-bit state needs an even block size");
    const at::TensorOptions on = param.options();
    s.scale_ = at::zeros({s.numel_ / block_size}, on.dtype(at::kFloat));
    s.codes_ = at::zeros({format == StateFormat::kInt4 ? s.numel_ / 2 : s.numel_}, on.dtype(code_dtype(format)));
    if (format != StateFormat::kFp8) s.qmap_ = detail::lowbit::qmap(format, is_signed, param.device());
    return s;
  }

  bool defined() const { return values_.defined() || codes_.defined(); }
  StateFormat format() const { return format_; }
  bool is_signed() const { return signed_; }
  int64_t block_size() const { return block_size_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  // kFloat: the plain tensor. Quantized: the codes (uint8, flat; fp8: e4m3fn),
  // the per-block fp32 scales and (8-/4-bit) the lookup table.
  const at::Tensor& values() const { return values_; }
  const at::Tensor& codes() const { return codes_; }
  const at::Tensor& scale() const { return scale_; }
  const at::Tensor& qmap() const { return qmap_; }

  // Bytes of the state's own tensors (the lookup table excluded: one per format, not per element).
  int64_t nbytes() const {
    if (format_ == StateFormat::kFloat) return values_.defined() ? values_.numel() * values_.element_size() : 0;
    return codes_.numel() * codes_.element_size() + scale_.numel() * scale_.element_size();
  }

  // fp32, the parameter's shape: torchao's dequantize(), or the plain
  // tensor as fp32 (`exp_avg.float()`: the tensor itself when it is fp32).
  at::Tensor dequantize() const {
    TORCH_CHECK(defined(), "amp: dequantize() of an empty QuantizedState");
    switch (format_) {
      case StateFormat::kFloat:
        return values_.to(at::kFloat);
      case StateFormat::kInt8:
      case StateFormat::kInt4: {
        const bool four_bit = format_ == StateFormat::kInt4;
        const at::Tensor flat = detail::lowbit::cpu_path(scale_)
                                    ? detail::lowbit::dequantize_cpu(codes_, qmap_, scale_, numel_, four_bit)
                                    : detail::lowbit::dequantize_ops(codes_, qmap_, scale_, four_bit);
        return flat.view(sizes_);
      }
      case StateFormat::kFp8:
        return (codes_.to(at::kFloat).view({-1, block_size_}) * scale_.view({-1, 1})).view(sizes_);
    }
    return at::Tensor();
  }

  // The codes and scales (kFloat: the values) that `src` (fp32, the state's
  // numel) quantizes to, as torchao's copy_ computes them; nothing is written.
  std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& src) const {
    TORCH_CHECK(defined() && src.numel() == numel_, "amp: QuantizedState::quantize: expected ", numel_,
                " elements, got ", src.numel());
    if (format_ == StateFormat::kFloat) return {src.to(values_.dtype()), at::Tensor()};
    const at::Tensor flat = src.reshape({-1});
    if (format_ == StateFormat::kFp8) {
      // subclass_fp8.py quantize_fp8
      const at::Tensor blocks = flat.view({-1, block_size_});
      const at::Tensor scale = blocks.abs().amax(-1).clamp_min(1e-12) / detail::kFloat8E4M3Max;
      return {(blocks / scale.view({-1, 1})).to(code_dtype(format_)).view({-1}), scale};
    }
    const bool four_bit = format_ == StateFormat::kInt4;
    return detail::lowbit::cpu_path(flat) ? detail::lowbit::quantize_cpu(flat, qmap_, block_size_, four_bit)
                                          : detail::lowbit::quantize_ops(flat, qmap_, block_size_, four_bit);
  }

  // torchao's copy_ into the state: quantizes `src`. With `keep` (a 0-dim
  // bool tensor on the state's device) true, the state is left as it was,
  // without a host sync.
  void assign_(const at::Tensor& src, const at::Tensor& keep = at::Tensor()) {
    auto q = quantize(src);
    // fp8 codes are selected as bytes: where() has no float8 kernel on 2.6.
    const bool bytes = format_ == StateFormat::kFp8;
    at::Tensor first = format_ == StateFormat::kFloat ? values_ : bytes ? codes_.view(at::kByte) : codes_;
    const at::Tensor next = format_ == StateFormat::kFloat ? q.first.view(sizes_)
                            : bytes                        ? q.first.view(at::kByte)
                                                           : q.first;
    first.copy_(keep.defined() ? at::where(keep, first, next) : next);
    if (format_ != StateFormat::kFloat) scale_.copy_(keep.defined() ? at::where(keep, scale_, q.second) : q.second);
  }

  // Checkpoints: "<key>" (kFloat), or "<key>.codes" (8-/4-bit) or
  // "<key>.fp8_codes" (fp8, as their uint8 bytes) and "<key>.scale".
  void write(torch::serialize::OutputArchive& archive, const std::string& key) const {
    if (format_ == StateFormat::kFloat) {
      archive.write(key, values_);
    } else {
      if (format_ == StateFormat::kFp8) {
        archive.write(key + ".fp8_codes", codes_.view(at::kByte));
      } else {
        archive.write(key + ".codes", codes_);
      }
      archive.write(key + ".scale", scale_);
    }
  }

  // The state under `key`, or an empty one when the archive has none. The
  // format is what the tensors say; check_fits() checks them against a parameter.
  static QuantizedState read(torch::serialize::InputArchive& archive, const std::string& key, bool is_signed) {
    QuantizedState s;
    s.signed_ = is_signed;
    at::Tensor values;
    if (archive.try_read(key, values)) {
      s.format_ = StateFormat::kFloat;
      s.values_ = values;
      s.sizes_ = values.sizes().vec();
      s.numel_ = values.numel();
      return s;
    }
    at::Tensor codes, scale;
    if (archive.try_read(key + ".codes", codes)) {
      s.format_ = StateFormat::kInt8;  // 8- or 4-bit: check_fits() tells them apart by the codes' count
    } else if (archive.try_read(key + ".fp8_codes", codes)) {
      s.format_ = StateFormat::kFp8;
    } else {
      return s;
    }
    TORCH_CHECK(archive.try_read(key + ".scale", scale), "amp: the checkpoint has codes of ", key, " but no ", key,
                ".scale");
    s.codes_ = codes;
    s.scale_ = scale;
    return s;
  }

  // Checks a state read from a checkpoint against `param` and the format and
  // block size the optimizer uses for it, and finishes it (its qmap, sizes;
  // tensors moved to the parameter's device). Throws "amp: ..." when it does
  // not fit; `what` names it in the message.
  void check_fits(const at::Tensor& param, StateFormat format, int64_t block_size, const std::string& what) {
    const int64_t numel = param.numel();
    if (format == StateFormat::kFloat) {
      TORCH_CHECK(format_ == StateFormat::kFloat, "amp: ", what, " is quantized in the checkpoint, but this optimizer",
                  " keeps a plain tensor for a parameter of ", numel, " elements");
      TORCH_CHECK(values_.sizes() == param.sizes(), "amp: ", what, " has shape ", values_.sizes(),
                  " in the checkpoint, the parameter ", param.sizes());
      values_ = values_.to(param.device(), param.scalar_type()).contiguous();
      sizes_ = param.sizes().vec();
      numel_ = numel;
      return;
    }
    TORCH_CHECK(format_ != StateFormat::kFloat, "amp: ", what, " is a plain tensor in the checkpoint, but this ",
                "optimizer keeps it ", detail::state_format_name(format), " (a checkpoint of another optimizer?)");
    TORCH_CHECK((format_ == StateFormat::kFp8) == (format == StateFormat::kFp8), "amp: ", what, " is ",
                format_ == StateFormat::kFp8 ? "fp8" : "8-/4-bit", " in the checkpoint, but this optimizer keeps it ",
                detail::state_format_name(format), " (a checkpoint of another optimizer?)");
    const at::ScalarType expected_codes = code_dtype(format);
    const at::ScalarType saved = format == StateFormat::kFp8 ? at::kByte : expected_codes;
    const int64_t expected_numel = format == StateFormat::kInt4 ? numel / 2 : numel;
    TORCH_CHECK(codes_.scalar_type() == saved && codes_.dim() == 1 && codes_.numel() == expected_numel, "amp: ", what,
                " has ", codes_.numel(), " codes of type ", codes_.scalar_type(), " in the checkpoint; a ",
                detail::state_format_name(format), " state of this parameter has ", expected_numel, " codes of type ",
                saved);
    TORCH_CHECK(scale_.scalar_type() == at::kFloat && scale_.dim() == 1 && scale_.numel() * block_size == numel,
                "amp: ", what, " has ", scale_.numel(), " scales in the checkpoint; with block size ", block_size,
                " this parameter has ", numel / block_size, " (a checkpoint of another block size?)");
    format_ = format;
    block_size_ = block_size;
    sizes_ = param.sizes().vec();
    numel_ = numel;
    codes_ = codes_.to(param.device()).contiguous();
    if (format == StateFormat::kFp8) codes_ = codes_.view(expected_codes);
    scale_ = scale_.to(param.device()).contiguous();
    if (format != StateFormat::kFp8) qmap_ = detail::lowbit::qmap(format, signed_, param.device());
  }

 private:
  static at::ScalarType code_dtype(StateFormat format) {
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
    if (format == StateFormat::kFp8) return at::kFloat8_e4m3fn;
#else
    TORCH_CHECK(format != StateFormat::kFp8, "amp: fp8 optimizer states need LibTorch 2.1 or newer (float8_e4m3fn)");
#endif
    return at::kByte;
  }

  StateFormat format_ = StateFormat::kFloat;
  bool signed_ = true;
  int64_t block_size_ = 0;
  int64_t numel_ = 0;
  std::vector<int64_t> sizes_;
  at::Tensor values_, codes_, scale_, qmap_;
};

}  // namespace detail
}  // namespace amp
