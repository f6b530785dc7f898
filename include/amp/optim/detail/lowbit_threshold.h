// amp/optim/detail/lowbit_threshold.h: torchao's nearest-entry search
// (nearest_code, lowbit_codec.h) as a threshold table: the same code for
// every float, from one table load and one comparison instead of the
// 8-level search and its rounding.
//
//   const amp::detail::lowbit::ThresholdTable* t = amp::detail::lowbit::threshold_table(map, levels);
//   int64_t code = t != nullptr ? t->code(v) : amp::detail::lowbit::nearest_code(v, map, levels);
//
// nearest_code is monotone in v over the float order (NaN aside: it gives 0),
// so a map is described by its thresholds T_c, the smallest float whose code
// is >= c, found by bisection over the floats' order (ordered_key). Keys
// split into buckets by their high bits; where no bucket holds two
// thresholds, a bucket's entry is its first key's code (`base`) and the
// offset of its one threshold, and code = base + (offset(v) >= threshold).
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_codec.h"
#include "amp/optim/state_format.h"

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
#include <c10/util/Float8_e4m3fn.h>
#endif

namespace amp {
namespace detail {
namespace lowbit {

// The float's bits as an unsigned key in the float order: -NaN < -inf < ... <
// -0 < +0 < ... < +inf < +NaN.
C10_ALWAYS_INLINE uint32_t ordered_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits ^ ((bits >> 31) != 0 ? 0xFFFFFFFFu : 0x80000000u);
}

C10_ALWAYS_INLINE float key_float(uint32_t key) {
  const uint32_t bits = key ^ ((key >> 31) != 0 ? 0x80000000u : 0xFFFFFFFFu);
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

constexpr uint32_t kKeyNegInf = 0x007FFFFFu;  // ordered_key(-inf)
constexpr uint32_t kKeyPosInf = 0xFF800000u;  // ordered_key(+inf)

// T_c (c = 1 .. top) as keys: the smallest key in [lo, hi] whose code is
// >= c, for a code that is monotone over [lo, hi], 0 at lo and top at hi.
// Empty when the ends are not 0 and top.
template <typename Code>
std::vector<uint32_t> code_thresholds(Code code, uint32_t lo, uint32_t hi, int64_t top) {
  if (code(lo) != 0 || code(hi) != top) return {};
  std::vector<uint32_t> t;
  for (int64_t c = 1; c <= top; ++c) {
    uint32_t below = lo, at = hi;  // code(below) < c <= code(at)
    while (at - below > 1) {
      const uint32_t mid = below + (at - below) / 2;
      (code(mid) >= c ? at : below) = mid;
    }
    t.push_back(at);
  }
  return t;
}

// Thresholds as a table over key >> shift; entry: base | offset << 8, offset
// 2^shift where the bucket holds no threshold. code(key) = base + (key's
// offset in its bucket >= the entry's offset).
struct ThresholdTable {
  int shift = 0;  // 0: no table
  std::vector<uint32_t> entries;
  std::vector<uint32_t> thresholds;  // T_1 .. T_top, then 0xFFFFFFFF up to 16 (the 16-level register search)
  std::vector<float> map;            // the map it was built from (8-/4-bit)
  std::vector<uint8_t> planes;       // 256 codes' fp32 values as 4 byte planes: byte k of value c at 256 k + c

  void set_planes(const float* values) {  // 256 values (8-bit maps, fp8): the VBMI dequantization's table
    planes.assign(1024, 0);
    for (int c = 0; c < 256; ++c) {
      uint32_t bits;
      std::memcpy(&bits, &values[c], 4);
      for (int k = 0; k < 4; ++k) planes[static_cast<size_t>(256 * k + c)] = static_cast<uint8_t>(bits >> (8 * k));
    }
  }

  C10_ALWAYS_INLINE uint32_t key_code(uint32_t key) const {
    const uint32_t e = entries[key >> shift];
    return (e & 0xFFu) + ((key & ((1u << shift) - 1u)) >= (e >> 8) ? 1u : 0u);
  }
  // nearest_code(v, map, levels).
  C10_ALWAYS_INLINE int64_t code(float v) const { return std::isnan(v) ? 0 : key_code(ordered_key(v)); }
  size_t bytes() const { return entries.size() * sizeof(uint32_t); }
};

// The table with the fewest buckets (the largest shift, up to 23) that holds
// at most one threshold per bucket; shift 0 (no table) when none from 12 up does.
inline ThresholdTable table_of(const std::vector<uint32_t>& t) {
  ThresholdTable out;
  if (t.empty() || t.size() > 255) return out;
  for (int shift = 23; shift >= 12; --shift) {
    const uint64_t buckets = uint64_t{1} << (32 - shift), width = uint64_t{1} << shift;
    std::vector<uint32_t> entries(static_cast<size_t>(buckets));
    size_t next = 0;  // the first threshold above the bucket's first key
    bool fits = true;
    for (uint64_t b = 0; b < buckets && fits; ++b) {
      const uint64_t start = b * width;
      while (next < t.size() && t[next] <= start) ++next;
      uint64_t offset = width;
      if (next < t.size() && t[next] < start + width) {
        offset = t[next] - start;
        fits = next + 1 >= t.size() || t[next + 1] >= start + width;
      }
      entries[static_cast<size_t>(b)] = static_cast<uint32_t>(next) | static_cast<uint32_t>(offset << 8);
    }
    if (!fits) continue;
    out.shift = shift;
    out.entries = std::move(entries);
    out.thresholds = t;
    while (out.thresholds.size() < 16) out.thresholds.push_back(0xFFFFFFFFu);
    return out;
  }
  return out;
}

// A map's table: nearest_code over the non-NaN keys, -inf to +inf.
inline ThresholdTable build_threshold_table(const float* m, int64_t levels) {
  if (levels < 2 || levels > 256) return ThresholdTable();
  auto code = [&](uint32_t key) { return nearest_code(key_float(key), m, levels); };
  ThresholdTable out = table_of(code_thresholds(code, kKeyNegInf, kKeyPosInf, levels - 1));
  if (out.shift != 0) out.map.assign(m, m + levels);
  if (out.shift != 0 && levels == 256) out.set_planes(m);
  return out;
}

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
// This LibTorch's fp32 -> float8_e4m3fn conversion (c10::Float8_e4m3fn; from
// 2.x versions differ in how they saturate) of the float with bits `bits`.
C10_ALWAYS_INLINE uint32_t fp8_bits_of(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, 4);
  return c10::Float8_e4m3fn(v).x;
}

// c10's conversion is sign | g(|x|), g monotone in |x|'s bits, NaNs (above
// +inf) included: a table over |x|'s bits, 0 to 0x7FFFFFFF, gives g.
// fp8_code(v) == fp8_bits_of(v's bits) for every float.
inline const ThresholdTable& fp8_threshold_table() {
  static const ThresholdTable table = [] {
    auto g = [](uint32_t abs_bits) { return static_cast<int64_t>(fp8_bits_of(abs_bits)); };
    ThresholdTable t = table_of(code_thresholds(g, 0u, 0x7FFFFFFFu, g(0x7FFFFFFFu)));
    float values[256];
    for (int c = 0; c < 256; ++c)
      values[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
    if (t.shift != 0) t.set_planes(values);
    return t;
  }();
  return table;
}

C10_ALWAYS_INLINE uint32_t fp8_code(const ThresholdTable& t, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return t.key_code(bits & 0x7FFFFFFFu) | ((bits >> 24) & 0x80u);
}
#endif

// The table of torchao's map for `format` and signedness (qmap), built once
// per process on first use (thread-safe statics).
inline const ThresholdTable& standard_threshold_table(StateFormat format, bool is_signed) {
  auto build = [](StateFormat f, bool s) {
    const at::Tensor map = qmap(f, s, at::kCPU);
    return build_threshold_table(map.data_ptr<float>(), map.numel());
  };
  if (format == StateFormat::kInt8) {
    if (is_signed) {
      static const ThresholdTable table = build(StateFormat::kInt8, true);
      return table;
    }
    static const ThresholdTable table = build(StateFormat::kInt8, false);
    return table;
  }
  if (is_signed) {
    static const ThresholdTable table = build(StateFormat::kInt4, true);
    return table;
  }
  static const ThresholdTable table = build(StateFormat::kInt4, false);
  return table;
}

// The table for a moment's map when it is one of torchao's (a state loaded
// with another map keeps the search), fp8's, else null.
inline const ThresholdTable* threshold_table(StateFormat format, const float* map, int64_t levels) {
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  if (format == StateFormat::kFp8) return fp8_threshold_table().shift != 0 ? &fp8_threshold_table() : nullptr;
#endif
  if (map == nullptr || (format != StateFormat::kInt8 && format != StateFormat::kInt4)) return nullptr;
  for (bool is_signed : {true, false}) {
    const ThresholdTable& t = standard_threshold_table(format, is_signed);
    if (t.shift != 0 && static_cast<int64_t>(t.map.size()) == levels &&
        std::memcmp(t.map.data(), map, static_cast<size_t>(levels) * sizeof(float)) == 0)
      return &t;
  }
  return nullptr;
}

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
