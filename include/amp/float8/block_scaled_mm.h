// amp/float8/block_scaled_mm.h: one block-scaled GEMM, a · bᵀ of two MXFP8
// or two NVFP4 operands, emulated or on CUDA's block-scaled _scaled_mm.
//
//   namespace f8 = amp::float8::detail;  // internal: the block-scaled recipes' GEMMs
//   at::Tensor y = f8::mx_mm(f8::to_mx(x, m), at::kBFloat16, f8::to_mx(w, m), at::kBFloat16);
//   at::Tensor z = f8::nvfp4_mm(f8::to_nvfp4(x), f8::to_nvfp4(w, true), at::kBFloat16);
//
// Emulated (every CPU, and CUDA where the route below does not apply): both
// operands dequantized, then one at::mm. MXFP8 multiplies in the operands'
// dtype (torchao's KernelPreference.EMULATED); NVFP4 in fp32, the product
// cast to the output dtype (torchao's NVFP4Tensor.dequantize, then mm).
//
// Routed to at::_scaled_mm, as torchao's AUTO kernel preference calls it
// (mx_tensor.py: _addmm_mx_dispatch; nvfp4_tensor.py: _addmm_nvfp4_dispatch),
// when all of these hold:
//   - a LibTorch with block-scaled _scaled_mm (detail/compat_float8.h);
//   - the operands are CUDA tensors and the output is bf16;
//   - the GEMM's shape fits _scaled_mm: M and N multiples of 16, K of 32;
//   - the device runs it: asked once per device and format by a 128x128x128
//     probe (block_scaled_mm_probe below) whose exact answer is known, so the
//     compute capability (10.0+), the CUDA build (cuBLAS 12.8+) and amp's
//     layout are checked together, with no CUDA header (2.14's CPU headers
//     have no compute-capability query: CUDAHooksInterface's isGPUArch is
//     ROCm's, at::accelerator::getDeviceCapability lists dtypes). A probe
//     that runs but disagrees turns the route off with a warning.
// The call: a [M, K] row-major, b's codes [N, K] passed transposed (the
// column-major [K, N] cuBLAS wants), each scale matrix swizzled by to_blocked
// (cuBLAS's 128x4 tiled layout) and flattened; MXFP8 with e8m0 scales of
// blocks of 32, NVFP4 with Float4_e2m1fn_x2 codes and e4m3 scales of blocks
// of 16, then the product times the two tensor scales (amax / (448 * 6)
// each) in the output dtype, after the GEMM as torchao does. cuBLAS
// accumulates in fp32 in its own order, so the routed product is not the
// emulated one bit for bit.
// The route has never run: no sm_100 device has been lent (docs/float8.md).
// Needs the float8 dtypes (LibTorch 2.1+).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "amp/detail/compat_float8.h"
#include "amp/float8/mxfp8.h"
#include "amp/float8/nvfp4.h"

namespace amp {
namespace float8 {
namespace detail {

// cuBLAS's scale tile: 128 rows by 4 columns of one-byte scales.
inline constexpr int64_t kScaleTileRows = 128;
inline constexpr int64_t kScaleTileCols = 4;

// torchao's to_blocked (mx_formats/utils.py), its eager path: a scale matrix
// [rows, cols] of one-byte scales (e8m0, e4m3 or bytes) padded with zeros
// to a multiple of 128 rows and 4 columns, cut into 128x4 tiles in row-major
// tile order, each tile's four 32-row bands interleaved ([32, 16]: row r of
// the tile holds bands 0-3's row r side by side), flattened.
inline at::Tensor to_blocked(const at::Tensor& scale) {
  TORCH_CHECK(scale.dim() == 2 && scale.element_size() == 1, "amp: to_blocked swizzles a 2-D matrix of one-byte ",
              "scales [rows, cols]; got ", scale.sizes(), " of ", scale.scalar_type());
  const int64_t rows = scale.size(0), cols = scale.size(1);
  const int64_t row_tiles = (rows + kScaleTileRows - 1) / kScaleTileRows;
  const int64_t col_tiles = (cols + kScaleTileCols - 1) / kScaleTileCols;
  // Moved as bytes (a zero byte is torch.zeros' 0 in e8m0 and e4m3 alike), so
  // no kernel of the scale's own dtype is needed on any device.
  const at::Tensor bytes = scale.view(at::kByte);
  at::Tensor padded = bytes;
  if (rows != row_tiles * kScaleTileRows || cols != col_tiles * kScaleTileCols) {
    padded = at::zeros({row_tiles * kScaleTileRows, col_tiles * kScaleTileCols}, bytes.options());
    padded.narrow(0, 0, rows).narrow(1, 0, cols).copy_(bytes);
  }
  const at::Tensor tiles = padded.reshape({row_tiles, kScaleTileRows, col_tiles, kScaleTileCols}).permute({0, 2, 1, 3});
  return tiles.reshape({-1, 4, 32, 4}).transpose(1, 2).reshape({-1, 32, 16}).flatten().view(scale.scalar_type());
}

#if AMP_DETAIL_HAS_FLOAT8_DTYPE

// a [M, K] · b [N, K]ᵀ, both MXFP8 blocked along K, dequantized to their own
// dtypes and multiplied there (torchao's emulated mm).
inline at::Tensor mx_mm_emulated(const MxBlocks& a, at::ScalarType a_dtype, const MxBlocks& b, at::ScalarType b_dtype) {
  return at::mm(from_mx(a, a_dtype), from_mx(b, b_dtype).t());
}

// a [M, K] · b [N, K]ᵀ, both NVFP4, dequantized to fp32 and multiplied there; in `out`.
inline at::Tensor nvfp4_mm_emulated(const Nvfp4Blocks& a, const Nvfp4Blocks& b, at::ScalarType out) {
  return at::mm(from_nvfp4(a, at::kFloat), from_nvfp4(b, at::kFloat).t()).to(out);
}

enum class BlockFormat { kMxfp8, kNvfp4 };

// Whether M x N x K (K unpacked) fits block-scaled _scaled_mm's shape rules.
inline bool scaled_mm_shape_fits(int64_t m, int64_t n, int64_t k) { return m % 16 == 0 && n % 16 == 0 && k % 32 == 0; }

#if AMP_DETAIL_HAS_BLOCK_SCALED_MM

// The routed GEMMs (see the top of this file); the caller checked the route.
inline at::Tensor mx_mm_scaled(const MxBlocks& a, const MxBlocks& b, at::ScalarType out) {
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  return at::_scaled_mm(
      a.data.contiguous(), b.data.contiguous().t(), to_blocked(a.scale.reshape({m, k / kMxBlock})).contiguous(),
      to_blocked(b.scale.reshape({n, k / kMxBlock})).contiguous(), c10::nullopt, c10::nullopt, out, false);
}

inline at::Tensor nvfp4_mm_scaled(const Nvfp4Blocks& a, const Nvfp4Blocks& b, at::ScalarType out) {
  const at::Tensor raw = at::_scaled_mm(a.data.contiguous(), b.data.contiguous().t(), to_blocked(a.scale).contiguous(),
                                        to_blocked(b.scale).contiguous(), c10::nullopt, c10::nullopt, out, false);
  const double max = amp::detail::kFloat8E4M3Max * kFp4Max;
  const at::Tensor scale_result = (a.global_amax.to(at::kFloat) / max) * (b.global_amax.to(at::kFloat) / max);
  return raw * scale_result.to(out);
}

// The probe's operands: codes and scales whose products and sums are exact
// in fp32 (small integers times powers of 2), in a pattern that differs
// per row, column and block, so a misplaced scale or code changes the product.
inline std::pair<MxBlocks, MxBlocks> mx_probe_operands(const c10::Device& device) {
  auto make = [&](int64_t salt) {
    const at::Tensor i = at::arange(128, at::kLong).view({128, 1}), j = at::arange(128, at::kLong).view({1, 128});
    const at::Tensor codes = (at::remainder(i * (7 + salt) + j * 3, 5) - 2).to(at::kFloat);
    const at::Tensor bi = at::arange(128, at::kLong).view({128, 1}), bj = at::arange(4, at::kLong).view({1, 4});
    const at::Tensor bytes = (at::remainder(bi + bj * (3 + salt), 5) + (kE8m0Bias - 2)).to(at::kByte);
    return MxBlocks{codes.to(at::kFloat8_e4m3fn).to(device), as_e8m0(bytes).to(device)};
  };
  return {make(0), make(1)};
}

inline std::pair<Nvfp4Blocks, Nvfp4Blocks> nvfp4_probe_operands(const c10::Device& device) {
  auto make = [&](int64_t salt) {
    const at::Tensor i = at::arange(128, at::kLong).view({128, 1}), j = at::arange(64, at::kLong).view({1, 64});
    const at::Tensor packed = at::remainder(i * (5 + salt) + j * 11, 256).to(at::kByte);  // two E2M1 codes a byte
    const at::Tensor bi = at::arange(128, at::kLong).view({128, 1}), bj = at::arange(8, at::kLong).view({1, 8});
    const at::Tensor exps = at::remainder(bi + bj * (1 + salt), 3) - 1;  // scales 0.5, 1, 2
    const at::Tensor s = at::pow(at::full({128, 8}, 2.0, at::kFloat), exps.to(at::kFloat)).to(at::kFloat8_e4m3fn);
    // A tensor amax of 448 * 6 makes each tensor scale exactly 1.
    const at::Tensor amax = at::full({1}, amp::detail::kFloat8E4M3Max * kFp4Max, at::kFloat);
    return Nvfp4Blocks{as_fp4x2(packed).to(device), s.to(device), amax.to(device)};
  };
  return {make(0), make(1)};
}

// Runs the format's routed GEMM on `device` once and compares it with the
// emulated product computed on the CPU (exact here, so the two agree bit for
// bit when the route is right): true when they do; false when LibTorch or
// cuBLAS refuses (below compute capability 10.0, a CUDA build before 12.8),
// or, with a warning, when the result differs.
inline bool block_scaled_mm_probe(const c10::Device& device, BlockFormat format) {
  at::Tensor routed, expected;
  try {
    if (format == BlockFormat::kMxfp8) {
      const auto ops = mx_probe_operands(device);
      routed = mx_mm_scaled(ops.first, ops.second, at::kBFloat16).cpu();
      const MxBlocks a{ops.first.data.cpu(), ops.first.scale.cpu()}, b{ops.second.data.cpu(), ops.second.scale.cpu()};
      expected = mx_mm_emulated(a, at::kFloat, b, at::kFloat).to(at::kBFloat16);
    } else {
      const auto ops = nvfp4_probe_operands(device);
      routed = nvfp4_mm_scaled(ops.first, ops.second, at::kBFloat16).cpu();
      auto cpu = [](const Nvfp4Blocks& q) { return Nvfp4Blocks{q.data.cpu(), q.scale.cpu(), q.global_amax.cpu()}; };
      expected = nvfp4_mm_emulated(cpu(ops.first), cpu(ops.second), at::kBFloat16);
    }
  } catch (const c10::Error&) {
    return false;  // this device or build has no block-scaled _scaled_mm
  }
  if (at::equal(routed, expected)) return true;
  TORCH_WARN("amp: the block-scaled _scaled_mm on ", device, " gave ", at::ne(routed, expected).sum().item<int64_t>(),
             " of ", expected.numel(), " wrong values on an exact probe; the ",
             format == BlockFormat::kMxfp8 ? "MXFP8" : "NVFP4",
             " GEMMs run emulated on this device. Please report it with your LibTorch and CUDA versions.");
  return false;
}

// block_scaled_mm_probe's answer, asked once per device and format.
inline bool device_runs_block_scaled_mm(const c10::Device& device, BlockFormat format) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> answers;
  const std::pair<int, int> key{device.has_index() ? device.index() : -1, static_cast<int>(format)};
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = answers.find(key);
  if (found != answers.end()) return found->second;
  const bool runs = block_scaled_mm_probe(device, format);
  answers.emplace(key, runs);
  return runs;
}

#endif  // AMP_DETAIL_HAS_BLOCK_SCALED_MM

// Whether an a · bᵀ of operands on `device` ([M, K] and [N, K]) with an
// `out` product takes the routed path (see the top of this file).
inline bool routes_to_scaled_mm(const c10::Device& device, BlockFormat format, int64_t m, int64_t n, int64_t k,
                                at::ScalarType out) {
#if AMP_DETAIL_HAS_BLOCK_SCALED_MM
  return device.is_cuda() && out == at::kBFloat16 && scaled_mm_shape_fits(m, n, k) &&
         device_runs_block_scaled_mm(device, format);
#else
  (void)device, (void)format, (void)m, (void)n, (void)k, (void)out;
  return false;
#endif
}

// a [M, K] · b [N, K]ᵀ in MXFP8: routed where it applies, else emulated.
inline at::Tensor mx_mm(const MxBlocks& a, at::ScalarType a_dtype, const MxBlocks& b, at::ScalarType b_dtype) {
#if AMP_DETAIL_HAS_BLOCK_SCALED_MM
  if (a_dtype == b_dtype && a.data.dim() == 2 && b.data.dim() == 2 &&
      routes_to_scaled_mm(a.data.device(), BlockFormat::kMxfp8, a.data.size(0), b.data.size(0), a.data.size(1),
                          a_dtype))
    return mx_mm_scaled(a, b, a_dtype);
#endif
  return mx_mm_emulated(a, a_dtype, b, b_dtype);
}

// a [M, K] · b [N, K]ᵀ in NVFP4, the product in `out`: routed where it applies, else emulated.
inline at::Tensor nvfp4_mm(const Nvfp4Blocks& a, const Nvfp4Blocks& b, at::ScalarType out) {
#if AMP_DETAIL_HAS_BLOCK_SCALED_MM
  if (routes_to_scaled_mm(a.data.device(), BlockFormat::kNvfp4, a.data.size(0), b.data.size(0), a.data.size(1) * 2,
                          out))
    return nvfp4_mm_scaled(a, b, out);
#endif
  return nvfp4_mm_emulated(a, b, out);
}

#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace detail
}  // namespace float8
}  // namespace amp
