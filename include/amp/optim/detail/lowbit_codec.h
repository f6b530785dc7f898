// amp/optim/detail/lowbit_codec.h: the quantization maps and the block-wise
// quantize/dequantize of QuantizedState (amp/optim/quantized_state.h), as
// torchao computes them (torchao/optim/quant_utils.py), op for op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/detail/parallel.h"
#include "amp/optim/state_format.h"

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
#include <c10/util/Float8_e4m3fn.h>
#endif

namespace amp {
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

// torchao's search for one value: a branchless binary search for the largest
// entry <= v, then the nearer neighbour (residual >= half the gap: up).
C10_ALWAYS_INLINE int64_t nearest_code(float v, const float* m, int64_t levels) {
  // Branchless, as torchao's search: a mispredicted branch per level costs more than the loads.
  int64_t code = (levels / 2) & -static_cast<int64_t>(v >= m[levels / 2]);
  for (int64_t step = levels / 4; step >= 1; step /= 2) code += step & -static_cast<int64_t>(v >= m[code + step]);
  const int64_t up = std::min(code + 1, levels - 1);
  const float down_v = m[code], up_v = m[up];
  const float residual = v - down_v;
  const float half = (up_v - down_v) * 0.5f;
  return code + ((up - code) & -static_cast<int64_t>(residual >= half));
}

// torchao's scale_tensor for one block: abs, amax (NaN if any value is NaN),
// clipped at 1e-12 (the scalar rounded to fp32). `amax`/`nan`: a block's
// absmax and NaN flag found elsewhere (a vector loop), or the loop here.
C10_ALWAYS_INLINE float clip_absmax(float amax, bool nan) {
  return nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, static_cast<float>(1e-12));
}

C10_ALWAYS_INLINE float clipped_absmax(const float* x, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan = nan || std::isnan(a);
    amax = a > amax ? a : amax;
  }
  return clip_absmax(amax, nan);
}

// One block of n values (fp32) to its absmax scale and codes: torchao's
// scale_tensor (abs, amax, clip at 1e-12) and quantize_*_with_qmap for 8 and
// 4 bits (two codes per byte, the first in the high nibble), or
// subclass_fp8.py's quantize_fp8 (scale = clipped absmax / 448, codes
// float8_e4m3fn). `codes` is the block's first byte.
C10_ALWAYS_INLINE void quantize_block(const float* x, int64_t n, StateFormat format, const float* map, int64_t levels,
                                      uint8_t* codes, float* scale) {
  const float clipped = clipped_absmax(x, n);
  if (format == StateFormat::kFp8) {
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
    const float sc = clipped / static_cast<float>(kFloat8E4M3Max);
    *scale = sc;
    for (int64_t i = 0; i < n; ++i) codes[i] = c10::Float8_e4m3fn(x[i] / sc).x;
#endif
    return;
  }
  *scale = clipped;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t code = nearest_code(x[i] / clipped, map, levels);
    if (format == StateFormat::kInt8) {
      codes[i] = static_cast<uint8_t>(code);
    } else if (i % 2 == 0) {
      codes[i / 2] = static_cast<uint8_t>(code << 4);
    } else {
      codes[i / 2] = static_cast<uint8_t>(codes[i / 2] | code);
    }
  }
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
  const StateFormat format = four_bit ? StateFormat::kInt4 : StateFormat::kInt8;
  const int64_t block_bytes = four_bit ? block_size / 2 : block_size;
  parallel_chunks(blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block(x + b * block_size, block_size, format, m, levels, c + b * block_bytes, s + b);
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
  parallel_chunks(scale.numel(), 16, [&](int64_t b0, int64_t b1) {
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
}  // namespace amp
