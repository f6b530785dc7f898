// amp/optim/quantized_state.h: QuantizedState, one optimizer moment kept in
// 8 bits, 4 bits or fp8 with one fp32 scale per block (torchao.optim's
// OptimState8bit, OptimState4bit and OptimStateFp8), or in the parameter's
// own dtype for small tensors.
//
//   amp::QuantizedState m = amp::QuantizedState::zeros(param, amp::StateFormat::kInt8, /*is_signed=*/true, 256);
//   at::Tensor f = m.dequantize();       // fp32, param's shape
//   m.assign_(f.lerp(grad, 0.1));        // block-wise absmax scale, codes rounded to the nearest map entry
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

namespace amp {

// How a moment is stored. kFloat: a plain tensor of the parameter's dtype
// (tensors below the quantization threshold). kInt8: one uint8 code per
// element into bitsandbytes' dynamic map; kInt4: two 4-bit codes per byte
// (torchao's 4-bit maps); kFp8: float8_e4m3fn (LibTorch 2.1+). Every
// quantized format keeps one fp32 absmax scale per block.
enum class StateFormat { kFloat, kInt8, kInt4, kFp8 };

inline const char* state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::kInt8:
      return "8-bit";
    case StateFormat::kInt4:
      return "4-bit";
    case StateFormat::kFp8:
      return "fp8";
    case StateFormat::kFloat:
      break;
  }
  return "float";
}

namespace detail {
namespace lowbit {

// bitsandbytes' create_dynamic_map as torchao copies it (quant_utils.py,
// zero padding removed): the same torch ops, so the fp32 entries are
// Python's. Sorted, 2^total_bits entries.
inline std::vector<double> create_dynamic_map(bool is_signed, int max_exponent_bits, int total_bits) {
  std::vector<double> data;
  const int non_sign_bits = total_bits - 1;
  const int additional_items = (1 << (non_sign_bits - max_exponent_bits)) - 1;
  auto append = [&](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const float* v = c.data_ptr<float>();
    for (int64_t k = 0; k < c.numel(); ++k) data.push_back(static_cast<double>(v[k]));
  };
  auto means_of = [](int64_t items) {
    const at::Tensor boundaries = at::linspace(0.1, 1, items);  // fp32, torch.linspace's default dtype
    return (boundaries.slice(0, 0, items - 1) + boundaries.slice(0, 1, items)) / 2.0;
  };
  int i = 0;
  for (i = 0; i < max_exponent_bits; ++i) {
    const int64_t fraction_items = is_signed ? (int64_t{1} << (i + non_sign_bits - max_exponent_bits)) + 1
                                             : (int64_t{1} << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    const at::Tensor means = means_of(fraction_items);
    // Python's 10 ** (-(max_exponent_bits - 1) + i): an int, or libm's pow for a negative exponent.
    const double power = std::pow(10.0, static_cast<double>(-(max_exponent_bits - 1) + i));
    append(power * means);
    if (is_signed) append(-power * means);
  }
  if (additional_items > 0) {
    const at::Tensor means = means_of(additional_items + 1);
    const double power = std::pow(10.0, static_cast<double>(-(max_exponent_bits - 1) + i));
    append(power * means);
    if (is_signed) append(-power * means);
  }
  data.push_back(0.0);
  data.push_back(1.0);
  TORCH_INTERNAL_ASSERT(data.size() == (size_t{1} << total_bits), "amp: dynamic map of the wrong size");
  std::sort(data.begin(), data.end());
  return data;
}

// The lookup table of a format and signedness, fp32 on `device`.
inline at::Tensor qmap(StateFormat format, bool is_signed, const c10::Device& device) {
  std::vector<double> values;
  if (format == StateFormat::kInt8) {
    values = create_dynamic_map(is_signed, 7, 8);
  } else if (is_signed) {
    values = create_dynamic_map(true, 3, 4);  // subclass_4bit.py
  } else {
    // subclass_4bit.py: torch.linspace(0, 1, 17)[1:] (linear, no zero).
    const at::Tensor lin = at::linspace(0, 1, 17).slice(0, 1, 17).contiguous();
    for (int64_t k = 0; k < lin.numel(); ++k) values.push_back(static_cast<double>(lin.data_ptr<float>()[k]));
  }
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kFloat);
  for (size_t k = 0; k < values.size(); ++k) t.data_ptr<float>()[k] = static_cast<float>(values[k]);
  return t.to(device);
}

// scale_tensor: input.view(-1, block) / its rows' absmax (clipped at 1e-12).
inline std::pair<at::Tensor, at::Tensor> scale_tensor(const at::Tensor& flat, int64_t block_size) {
  const at::Tensor blocks = flat.view({-1, block_size});
  const at::Tensor scale = blocks.abs().amax(-1).clamp_min(1e-12);
  return {(blocks / scale.view({-1, 1})).view({-1}), scale};
}

// quantize_8bit_with_qmap / quantize_4bit_with_qmap: a branchless binary
// search for the largest entry <= x, then round to the nearer neighbour.
inline at::Tensor quantize_with_qmap(const at::Tensor& x, const at::Tensor& map) {
  const int64_t n = map.numel();
  const at::Tensor zero = at::zeros({}, x.options().dtype(at::kLong));
  at::Tensor codes = at::where(x >= map.select(0, n / 2), at::full({}, n / 2, zero.options()), zero);
  for (int64_t step = n / 4; step >= 1; step /= 2) {
    const at::Tensor probe = at::index_select(map, 0, codes + step);
    codes = codes + at::where(x >= probe, at::full({}, step, zero.options()), zero);
  }
  const at::Tensor codes_up = (codes + 1).clamp_max(n - 1);
  const at::Tensor val_down = at::index_select(map, 0, codes);
  const at::Tensor val_up = at::index_select(map, 0, codes_up);
  const at::Tensor residual = x - val_down;
  codes = at::where(residual >= (val_up - val_down) * 0.5, codes_up, codes);
  return codes.to(at::kByte);
}

// dequant_with_qmap: map[codes] * the block's scale.
inline at::Tensor dequant_with_qmap(const at::Tensor& codes, const at::Tensor& map, const at::Tensor& scale) {
  return at::index_select(map, 0, codes.to(at::kInt).view({-1})).view({scale.size(0), -1}) * scale.view({-1, 1});
}

inline constexpr double kFp8Max = 448.0;  // torch.finfo(torch.float8_e4m3fn).max

// torchao's copy_ (8-/4-bit) as tensor ops: scale_tensor, the search, the
// 4-bit packing ((codes[::2] << 4) | codes[1::2]). Any device.
inline std::pair<at::Tensor, at::Tensor> quantize_ops(const at::Tensor& flat, const at::Tensor& map, int64_t block_size,
                                                      bool four_bit) {
  auto scaled = scale_tensor(flat, block_size);
  at::Tensor codes = quantize_with_qmap(scaled.first, map);
  const int64_t n = flat.numel();
  if (four_bit) codes = at::bitwise_or(codes.slice(0, 0, n, 2).__lshift__(4), codes.slice(0, 1, n, 2));
  return {codes, scaled.second};
}

// torchao's dequantize() (8-/4-bit) as tensor ops; 4-bit unpacks as
// torch.stack([codes >> 4, codes & 0b1111], dim=-1). Flat fp32.
inline at::Tensor dequantize_ops(const at::Tensor& codes, const at::Tensor& map, const at::Tensor& scale,
                                 bool four_bit) {
  if (!four_bit) return dequant_with_qmap(codes, map, scale).view({-1});
  const at::Tensor unpacked = at::stack({codes.__rshift__(4), at::bitwise_and(codes, 15)}, -1);
  return dequant_with_qmap(unpacked, map, scale).view({-1});
}

// The CPU path of scale_tensor + quantize_with_qmap (+ 4-bit packing) and of
// dequant_with_qmap: one pass per block instead of ~30 tensor passes. Every
// step is a comparison or one IEEE operation (abs, max, division, subtraction,
// multiplication; no sum that could fuse), so the bits are those of the
// tensor ops above (low_bit_optim_test checks both paths agree).
inline bool cpu_path(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

inline std::pair<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& flat, const at::Tensor& map, int64_t block_size,
                                                      bool four_bit) {
  const int64_t n = flat.numel(), blocks = n / block_size, levels = map.numel();
  at::Tensor codes = at::empty({four_bit ? n / 2 : n}, flat.options().dtype(at::kByte));
  at::Tensor scale = at::empty({blocks}, flat.options());
  const float* x = flat.data_ptr<float>();
  const at::Tensor map_c = map.contiguous();
  const float* m = map_c.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* s = scale.data_ptr<float>();
  const float floor = static_cast<float>(1e-12);  // clip(1e-12): the scalar rounded to fp32
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * block_size;
      float amax = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < block_size; ++i) {
        const float a = std::fabs(xb[i]);
        if (std::isnan(a)) nan = true;
        if (a > amax) amax = a;
      }
      const float sc = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, floor);
      s[b] = sc;
      for (int64_t i = 0; i < block_size; ++i) {
        const float v = xb[i] / sc;
        // Branchless, as torchao's search: a mispredicted branch per level costs more than the loads.
        int64_t code = (levels / 2) & -static_cast<int64_t>(v >= m[levels / 2]);
        for (int64_t step = levels / 4; step >= 1; step /= 2) code += step & -static_cast<int64_t>(v >= m[code + step]);
        const int64_t up = std::min(code + 1, levels - 1);
        const float down_v = m[code], up_v = m[up];
        const float residual = v - down_v;
        const float half = (up_v - down_v) * 0.5f;
        code += (up - code) & -static_cast<int64_t>(residual >= half);
        const int64_t k = b * block_size + i;
        if (!four_bit) {
          c[k] = static_cast<uint8_t>(code);
        } else if (k % 2 == 0) {
          c[k / 2] = static_cast<uint8_t>(code << 4);
        } else {
          c[k / 2] = static_cast<uint8_t>(c[k / 2] | code);
        }
      }
    }
  });
  return {codes, scale};
}

inline at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& map, const at::Tensor& scale, int64_t numel,
                                 bool four_bit) {
  at::Tensor out = at::empty({numel}, scale.options());
  const int64_t block_size = numel / scale.numel();
  const at::Tensor map_c = map.contiguous(), codes_c = codes.contiguous(), scale_c = scale.contiguous();
  const float* m = map_c.data_ptr<float>();
  const uint8_t* c = codes_c.data_ptr<uint8_t>();
  const float* s = scale_c.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, scale.numel(), 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k = b * block_size; k < (b + 1) * block_size; ++k) {
        const int code = !four_bit ? c[k] : (k % 2 == 0 ? c[k / 2] >> 4 : c[k / 2] & 15);
        o[k] = m[code] * s[b];
      }
  });
  return out;
}

}  // namespace lowbit
}  // namespace detail

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
    TORCH_CHECK(block_size > 0 && s.numel_ % block_size == 0, "amp: a ", state_format_name(format),
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
      const at::Tensor scale = blocks.abs().amax(-1).clamp_min(1e-12) / detail::lowbit::kFp8Max;
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
    at::Tensor& first = format_ == StateFormat::kFloat ? values_ : codes_;
    const at::Tensor next = format_ == StateFormat::kFloat ? q.first.view(sizes_) : q.first;
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
                "optimizer keeps it ", state_format_name(format), " (a checkpoint of another optimizer?)");
    TORCH_CHECK((format_ == StateFormat::kFp8) == (format == StateFormat::kFp8), "amp: ", what, " is ",
                format_ == StateFormat::kFp8 ? "fp8" : "8-/4-bit", " in the checkpoint, but this optimizer keeps it ",
                state_format_name(format), " (a checkpoint of another optimizer?)");
    const at::ScalarType expected_codes = code_dtype(format);
    const at::ScalarType saved = format == StateFormat::kFp8 ? at::kByte : expected_codes;
    const int64_t expected_numel = format == StateFormat::kInt4 ? numel / 2 : numel;
    TORCH_CHECK(codes_.scalar_type() == saved && codes_.dim() == 1 && codes_.numel() == expected_numel, "amp: ", what,
                " has ", codes_.numel(), " codes of type ", codes_.scalar_type(), " in the checkpoint; a ",
                state_format_name(format), " state of this parameter has ", expected_numel, " codes of type ", saved);
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

}  // namespace amp
