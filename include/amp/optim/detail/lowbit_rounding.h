// amp/optim/detail/lowbit_rounding.h: how ATen's CPU kernels round on this
// machine (measured once per process), and the scalar operations the fused
// low-bit step rounds as ATen does.
//
//   const auto& aten = amp::detail::lowbit::aten_cpu_rounding();
//   float m = amp::detail::lowbit::lerp_as(aten.lerp, start, end, weight);   // at::lerp's bits
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace amp {
namespace detail {
namespace lowbit {

// How ATen's CPU kernels round here, measured once per process on ATen
// itself. Its vector kernels (AVX2/AVX-512) lerp with a scalar weight as
// fma(w, end - start, start) (|w| < 0.5) or fma(w - 1, end - start, end); its
// portable build (no FMA, or ATEN_CPU_CAPABILITY=default) multiplies and adds.
// at::maximum's NaN is all ones in the vector kernels and quiet_NaN() in the
// portable one; the NaN's bits matter where torchao's stochastic rounding
// adds 0x10000 to them (0xFFFFFFFF wraps to 0). Unknown (neither formula
// holds, or the NaNs disagree) keeps the tensor-op path.
enum class LerpRounding { kFma, kSeparate, kUnknown };

struct AtenCpuRounding {
  LerpRounding lerp = LerpRounding::kUnknown;
  uint32_t maximum_nan = 0;  // the bits of at::maximum(x, NaN)
  bool known() const { return lerp != LerpRounding::kUnknown; }
};

// x as a rounded fp32 value: a product passed through here is not contracted
// with the next addition into an fma (GCC contracts C++ by default,
// -ffp-contract=fast), which ATen's separate ops never do.
C10_ALWAYS_INLINE float rounded(float x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  volatile float kept = x;
  x = kept;
#endif
  return x;
}

C10_ALWAYS_INLINE float lerp_as(LerpRounding r, float start, float end, float w) {
  const float d = end - start;
  if (std::fabs(w) < 0.5f) return r == LerpRounding::kFma ? std::fma(w, d, start) : start + rounded(w * d);
  return r == LerpRounding::kFma ? std::fma(w - 1.f, d, end) : end - rounded(d * (1.f - w));
}

inline const AtenCpuRounding& aten_cpu_rounding() {
  static const AtenCpuRounding rounding = [] {
    at::NoGradGuard no_grad;
    constexpr int64_t n = 256;  // past every vector width and unroll, with a scalar tail of 0
    at::Tensor a = at::empty({n}, at::kFloat), b = at::empty({n}, at::kFloat);
    uint32_t x = 12345u;  // a fixed LCG: the same probe in every process
    for (int64_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      a.data_ptr<float>()[i] = static_cast<float>(x >> 8) / 16777216.f - 0.5f;
      x = x * 1664525u + 1013904223u;
      b.data_ptr<float>()[i] = static_cast<float>(x >> 8) / 4194304.f;
    }
    bool fma = true, separate = true;
    for (double w : {0.1, 0.001, 0.7}) {
      const at::Tensor r = at::lerp(a, b, w);
      for (int64_t i = 0; i < n; ++i) {
        const float got = r.data_ptr<float>()[i], s = a.data_ptr<float>()[i], e = b.data_ptr<float>()[i];
        fma = fma && got == lerp_as(LerpRounding::kFma, s, e, static_cast<float>(w));
        separate = separate && got == lerp_as(LerpRounding::kSeparate, s, e, static_cast<float>(w));
      }
    }
    AtenCpuRounding out;
    out.lerp = fma ? LerpRounding::kFma : separate ? LerpRounding::kSeparate : LerpRounding::kUnknown;
    b.fill_(std::numeric_limits<float>::quiet_NaN());
    const at::Tensor left = at::maximum(a, b), right = at::maximum(b, a);
    const uint32_t* l = reinterpret_cast<const uint32_t*>(left.data_ptr<float>());
    const uint32_t* r = reinterpret_cast<const uint32_t*>(right.data_ptr<float>());
    for (int64_t i = 0; i < n; ++i)
      if (l[i] != l[0] || r[i] != l[0]) out.lerp = LerpRounding::kUnknown;
    out.maximum_nan = l[0];
    return out;
  }();
  return rounding;
}

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
