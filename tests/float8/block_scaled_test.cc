// Tests for amp/float8/mxfp8.h, mxfp8_linear.h, nvfp4.h and block_scaled_mm.h: the block-scaled quantizers
// against hand-computed scale bytes and codes (each scale mode at its
// boundaries, inf and NaN, the clamp, NVFP4's packing and tensor scale, the
// Hadamard matrix), NVFP4's stochastic rounding (unbiased over 10^6 draws,
// reproducible), the bytes they keep, their amp: errors, the scale swizzle
// against cuBLAS's documented layout, where a GEMM goes (emulated off CUDA),
// and, on a CUDA device of compute capability 10.0+, the routed _scaled_mm
// against the emulated GEMM (elsewhere that test says why it skipped). Bit-for-bit agreement with torchao
// and Transformer Engine is tests/parity/block_scaled_parity_test. Needs the
// float8 dtypes (LibTorch 2.1+); before, one test says it skipped.
//
//   bazel test //tests:float8_test
#include "amp/float8/block_scaled_mm.h"
#include "amp/float8/mxfp8.h"
#include "amp/float8/mxfp8_linear.h"
#include "amp/float8/nvfp4.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat_cuda.h"
#include "amp/detail/compat_float8.h"
#include "../error_of.h"

#if AMP_DETAIL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace float8_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
namespace bs = amp::float8::detail;
using amp_test::error_of;

// One block of 32: `amax` first, the rest smaller (halves of it, alternating sign).
torch::Tensor mx_block(float amax) {
  torch::Tensor b = torch::full({1, 32}, amax / 2, torch::kFloat);
  b.index_put_({0, torch::indexing::Slice(1, 32, 2)}, -amax / 2);
  b[0][0] = amax;
  return b;
}

int scale_byte(float amax, bs::MxScale mode, at::ScalarType elem = at::kFloat8_e4m3fn) {
  return bs::e8m0_bytes(bs::to_mx(mx_block(amax), mode, elem).scale).item<uint8_t>();
}

constexpr bs::MxScale kModes[] = {bs::MxScale::kFloor, bs::MxScale::kRceil, bs::MxScale::kCeil, bs::MxScale::kEven};

TEST(BlockScaled, MxScaleBytesAtTheModesBoundaries) {
  // floor(log2 amax) - 8 (e4m3's largest power of 2 is 2^8), biased by 127.
  EXPECT_EQ(scale_byte(256.0f, bs::MxScale::kFloor), 127);
  EXPECT_EQ(scale_byte(511.0f, bs::MxScale::kFloor), 127);
  EXPECT_EQ(scale_byte(512.0f, bs::MxScale::kFloor), 128);
  EXPECT_EQ(scale_byte(1.0f, bs::MxScale::kFloor), 127 - 8);
  EXPECT_EQ(scale_byte(1.0f, bs::MxScale::kFloor, at::kFloat8_e5m2), 127 - 15);
  // CEIL rounds the exponent up when the amax has mantissa bits.
  EXPECT_EQ(scale_byte(256.0f, bs::MxScale::kCeil), 127);
  EXPECT_EQ(scale_byte(257.0f, bs::MxScale::kCeil), 128);
  // EVEN rounds the amax to e4m3's 3 mantissa bits first: 480 = 1.875 * 2^8 stays, 496 = 1.9375 * 2^8 carries.
  EXPECT_EQ(scale_byte(480.0f, bs::MxScale::kEven), 127);
  EXPECT_EQ(scale_byte(496.0f, bs::MxScale::kEven), 128);
  // RCEIL: amax / 448 rounded up to a power of 2: 448 * 2^k fits 2^k exactly or just above it.
  EXPECT_EQ(scale_byte(224.0f, bs::MxScale::kRceil), 126);  // 224 * fp32(1/448) is 0.5 exactly
  EXPECT_EQ(scale_byte(448.0f, bs::MxScale::kRceil), 127);
  EXPECT_EQ(scale_byte(225.0f, bs::MxScale::kRceil), 127);
  EXPECT_EQ(scale_byte(449.0f, bs::MxScale::kRceil), 128);
  EXPECT_EQ(scale_byte(1.0f, bs::MxScale::kRceil), 127 - 8);  // 1/448 = 1.14 * 2^-9, up to 2^-8
  // 0 and the smallest subnormals: byte 0 (2^-127) in every mode; inf and NaN: 0xFF (torchao, not TE's 0xFE).
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (bs::MxScale mode : kModes) {
    EXPECT_EQ(scale_byte(0.0f, mode), 0);
    EXPECT_EQ(scale_byte(inf, mode), 255);
    EXPECT_EQ(scale_byte(nan, mode), 255);
  }
}

TEST(BlockScaled, MxCodesClampAndRoundTrip) {
  // FLOOR with amax 511 keeps scale 1: 511 does not fit e4m3 and becomes 448,
  // by the clamp before LibTorch 2.13 and the saturating cast after.
  const bs::MxBlocks q = bs::to_mx(mx_block(511.0f), bs::MxScale::kFloor);
  EXPECT_EQ(q.data.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(bs::from_mx(q, torch::kFloat)[0][0].item<float>(), 448.0f);
  EXPECT_EQ(bs::from_mx(q, torch::kFloat)[0][1].item<float>(), -256.0f);  // 255.5 rounds to e4m3's 256
  // RCEIL leaves no overflow: 511 / 2 fits.
  EXPECT_EQ(bs::from_mx(bs::to_mx(mx_block(511.0f), bs::MxScale::kRceil), torch::kFloat)[0][0].item<float>(), 512.0f);
  // Powers of 2 come back exactly, scaled far from 1, with several blocks and leading dimensions, in fp32 and bf16.
  // (each block spans 2^b .. 2^(b+15), which e4m3 holds after scaling; b is -40, -10, 20)
  const torch::Tensor i = torch::arange(96, torch::kFloat);
  const torch::Tensor x = torch::exp2(i.remainder(16) + torch::floor(i / 32) * 30 - 40).repeat({6}).view({2, 3, 96});
  for (bs::MxScale mode : kModes) {
    const bs::MxBlocks m = bs::to_mx(x, mode);
    EXPECT_EQ(m.scale.sizes(), (std::vector<int64_t>{2, 3, 3}));
    EXPECT_TRUE(torch::equal(bs::from_mx(m, torch::kFloat), x));
  }
  const torch::Tensor y = torch::exp2(torch::arange(-4, 4, 1, torch::kFloat)).repeat({8}).view({2, 32});
  for (bs::MxScale mode : kModes) {
    EXPECT_TRUE(torch::equal(bs::from_mx(bs::to_mx(y, mode), torch::kFloat), y));
    EXPECT_TRUE(
        torch::equal(bs::from_mx(bs::to_mx(y.to(torch::kBFloat16), mode), torch::kBFloat16), y.to(torch::kBFloat16)));
  }
  // A block holding inf or NaN: every element NaN after the round trip (scale 0xFF); the other block intact.
  torch::Tensor z = torch::ones({1, 64});
  z[0][3] = std::numeric_limits<float>::infinity();
  const torch::Tensor back = bs::from_mx(bs::to_mx(z, bs::MxScale::kRceil), torch::kFloat);
  EXPECT_TRUE(torch::isnan(back.narrow(1, 0, 32)).all().item<bool>());
  EXPECT_TRUE(torch::equal(back.narrow(1, 32, 32), torch::ones({1, 32})));
#if AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES
  EXPECT_EQ(bs::to_mx(y, bs::MxScale::kFloor).scale.scalar_type(), at::kFloat8_e8m0fnu);
#else
  EXPECT_EQ(bs::to_mx(y, bs::MxScale::kFloor).scale.scalar_type(), at::kByte);
#endif
}

TEST(BlockScaled, Nvfp4PacksTwoCodesAByteAndScalesByTheTensorAmax) {
  // amax 6: the tensor scale makes the block scale 448 and the elements their own E2M1 values.
  const torch::Tensor x = torch::tensor({0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                         -3.0f, -4.0f, -6.0f, 0.25f})
                              .view({1, 16});
  const bs::Nvfp4Blocks q = bs::to_nvfp4(x);
  const torch::Tensor b = q.data.view(torch::kByte);
  // codes 1 2 3 4 5 6 7 0 9 10 11 12 13 14 15 0 (0.25 ties to 0), the even element in the low nibble.
  EXPECT_EQ(b.sizes(), (std::vector<int64_t>{1, 8}));
  const std::vector<int> expected{0x21, 0x43, 0x65, 0x07, 0xA9, 0xCB, 0xED, 0x0F};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b[0][i].item<uint8_t>(), expected[static_cast<size_t>(i)]) << "byte " << i;
  EXPECT_EQ(q.scale.to(torch::kFloat).item<float>(), 448.0f);
  EXPECT_EQ(q.global_amax.item<float>(), 6.0f);
  EXPECT_TRUE(torch::allclose(bs::from_nvfp4(q, torch::kFloat), x.where(x != 0.25f, torch::zeros_like(x))));
  // 16x16 tiles share one scale over 16 rows; rows that are not a multiple of 16 are padded with zeros.
  torch::manual_seed(0);
  const torch::Tensor w = torch::randn({20, 32});
  const bs::Nvfp4Blocks t = bs::to_nvfp4(w, /*tiles_16x16=*/true);
  EXPECT_EQ(t.scale.sizes(), (std::vector<int64_t>{20, 2}));
  EXPECT_TRUE(torch::equal(t.scale.view(torch::kByte).narrow(0, 0, 16), t.scale.view(torch::kByte)[0].expand({16, 2})));
  // All zeros: scale 0, codes 0, back to zeros.
  const bs::Nvfp4Blocks zero = bs::to_nvfp4(torch::zeros({2, 16}));
  EXPECT_TRUE(torch::equal(bs::from_nvfp4(zero, torch::kFloat), torch::zeros({2, 16})));
}

TEST(BlockScaled, HadamardIsTeSignedSylvesterOverFour) {
  const torch::Tensor h = bs::hadamard16();
  EXPECT_TRUE(torch::equal(torch::matmul(h, h.t()), torch::eye(16) * 16));
  // Row i is Sylvester's row i times TE's sign i: row 3's sign is -1, row 0's +1.
  EXPECT_TRUE(torch::equal(h[0], torch::ones({16})));
  EXPECT_EQ(h[3][0].item<float>(), -1.0f);
  // rht16 is orthogonal: applied twice with the transpose it gives x back exactly for small integers.
  const torch::Tensor x = torch::arange(0, 32, torch::kFloat).view({2, 16});
  EXPECT_TRUE(torch::equal(torch::matmul(bs::rht16(x), h.t()) * 0.25, x));
}

// One E2M1 value per code, as TE's cast_from_fp4x2 table.
torch::Tensor e2m1_values(const torch::Tensor& codes) {
  const torch::Tensor table = torch::tensor(
      {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f});
  return table.index({codes.to(torch::kLong)});
}

TEST(BlockScaled, StochasticRoundingIsUnbiasedAndReproducible) {
  // 10^6 draws of each value: the mean is the value within 5 standard errors
  // (a draw's deviation is at most half the grid gap), seeded, so not flaky.
  constexpr int64_t kDraws = 1000000;
  struct Case {
    float v, lo, hi;  // the value and its neighbours on the E2M1 grid
  };
  for (const Case& c : {Case{0.1f, 0.0f, 0.5f}, Case{0.7f, 0.5f, 1.0f}, Case{-1.6f, -1.5f, -2.0f},
                        Case{-2.7f, -2.0f, -3.0f}, Case{3.3f, 3.0f, 4.0f}, Case{5.9f, 4.0f, 6.0f}}) {
    const torch::Tensor x = torch::full({kDraws}, c.v);
    const torch::Tensor values =
        e2m1_values(bs::e2m1_codes_stochastic(x, at::make_generator<at::CPUGeneratorImpl>(42)));
    const double bound = 5 * std::abs(c.hi - c.lo) / 2 / std::sqrt(static_cast<double>(kDraws));
    EXPECT_NEAR(values.to(torch::kDouble).mean().item<double>(), c.v, bound) << "value " << c.v;
    EXPECT_TRUE(((values == c.lo) | (values == c.hi)).all().item<bool>()) << "value " << c.v;  // only the neighbours
  }
  // Grid values stay, NaN gives 0, -0 gives 0; a negative value that rounds to 0 keeps its sign (code 8).
  const torch::Tensor grid = torch::tensor(
      {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.5f, -6.0f, -0.0f, std::numeric_limits<float>::quiet_NaN()});
  const torch::Tensor g = bs::e2m1_codes_stochastic(grid.repeat({1000}), at::make_generator<at::CPUGeneratorImpl>(1));
  EXPECT_TRUE(torch::equal(g, bs::e2m1_codes(grid).repeat({1000})));
  const torch::Tensor tiny =
      bs::e2m1_codes_stochastic(torch::full({1000}, -0.01f), at::make_generator<at::CPUGeneratorImpl>(1));
  EXPECT_TRUE(((tiny == 8) | (tiny == 9)).all().item<bool>());
  // The same seed gives the same codes, another seed others; the scales are round-to-nearest's.
  torch::manual_seed(3);
  const torch::Tensor w = torch::randn({64, 64});
  const bs::Nvfp4Blocks a = bs::to_nvfp4(w, false, at::make_generator<at::CPUGeneratorImpl>(7));
  const bs::Nvfp4Blocks b = bs::to_nvfp4(w, false, at::make_generator<at::CPUGeneratorImpl>(7));
  const bs::Nvfp4Blocks c = bs::to_nvfp4(w, false, at::make_generator<at::CPUGeneratorImpl>(8));
  const bs::Nvfp4Blocks nearest = bs::to_nvfp4(w);
  EXPECT_TRUE(torch::equal(a.data.view(torch::kByte), b.data.view(torch::kByte)));
  EXPECT_FALSE(torch::equal(a.data.view(torch::kByte), c.data.view(torch::kByte)));
  EXPECT_FALSE(torch::equal(a.data.view(torch::kByte), nearest.data.view(torch::kByte)));
  EXPECT_TRUE(torch::equal(a.scale.view(torch::kByte), nearest.scale.view(torch::kByte)));
}

TEST(BlockScaled, BytesPerElement) {
  // What a quantized [64, 128] tensor keeps: MXFP8 8 + 8/32 = 8.25 bits an
  // element; NVFP4 4 + 8/16 + 32/numel (codes, block scales, the fp32 amax).
  const torch::Tensor w = torch::randn({64, 128});
  const int64_t n = w.numel();
  const bs::MxBlocks mx = bs::to_mx(w, bs::MxScale::kRceil);
  EXPECT_EQ((mx.data.nbytes() + mx.scale.nbytes()) * 8 * 4, n * 33);  // 8.25 = 33 / 4
  const bs::Nvfp4Blocks nv = bs::to_nvfp4(w);
  EXPECT_EQ((nv.data.nbytes() + nv.scale.nbytes() + nv.global_amax.nbytes()) * 8, n * 4 + n * 8 / 16 + 32);
}

TEST(BlockScaled, BadInputIsAnAmpErrorNamingTheFix) {
  EXPECT_NE(error_of([] {
              bs::to_mx(torch::ones({2, 33}), bs::MxScale::kFloor);
            }).find("pad it to a multiple of 32"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              bs::to_mx(torch::ones({32}, torch::kInt), bs::MxScale::kFloor);
            }).find("amp: MXFP8 quantizes fp32 or bf16"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { bs::to_mx(torch::ones({32}), bs::MxScale::kFloor, at::kFloat); }).find("amp: MXFP8's elements"),
      std::string::npos);
  EXPECT_NE(error_of([] { bs::to_nvfp4(torch::ones({32})); }).find("amp: NVFP4 quantizes a 2-D tensor"),
            std::string::npos);
  EXPECT_NE(error_of([] { bs::to_nvfp4(torch::ones({2, 24})); }).find("multiple of 16"), std::string::npos);
  EXPECT_NE(error_of([] { bs::rht16(torch::ones({2, 8})); }).find("amp: the Hadamard transform"), std::string::npos);
  EXPECT_NE(error_of([] {
              bs::mxfp8_linear(torch::ones({24, 64}), torch::ones({32, 64}), {}, bs::MxScale::kRceil);
            }).find("use at::linear for this layer"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              bs::mxfp8_linear(torch::ones({32, 48}), torch::ones({32, 64}), {}, bs::MxScale::kRceil);
            }).find("amp: mxfp8_linear got input"),
            std::string::npos);
  const bs::MxBlocks q = bs::to_mx(torch::ones({2, 32}), bs::MxScale::kFloor);
  EXPECT_NE(error_of([&] {
              bs::from_mx({q.data, q.scale.narrow(0, 0, 1)}, torch::kFloat);
            }).find("amp: an MX tensor"),
            std::string::npos);
}

// cuBLAS's 1-D block scaling layout (cuBLAS docs, "1D Block Scaling Factors
// Layout"): scale (r, c) of a [rows, cols] matrix sits in 128x4 tile
// (r / 128, c / 4), tiles in row-major order of 512 bytes, at
// (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4 within it; the rest is zero.
TEST(BlockScaledMm, ToBlockedPlacesEachScaleWhereCublasReadsIt) {
  torch::manual_seed(3);
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {130, 9}, {256, 8}, {5, 130}}) {
    const torch::Tensor s = torch::randint(1, 256, {rows, cols}, torch::kByte);
    const torch::Tensor out = bs::to_blocked(s);
    const int64_t row_tiles = (rows + 127) / 128, col_tiles = (cols + 3) / 4;
    ASSERT_EQ(out.dim(), 1);
    ASSERT_EQ(out.numel(), row_tiles * 128 * col_tiles * 4);
    EXPECT_EQ(out.scalar_type(), torch::kByte);
    torch::Tensor expected = torch::zeros({out.numel()}, torch::kByte);
    const auto src = s.accessor<uint8_t, 2>();
    auto dst = expected.accessor<uint8_t, 1>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        dst[((r / 128) * col_tiles + c / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4] = src[r][c];
    EXPECT_TRUE(torch::equal(out, expected)) << rows << "x" << cols;
  }
  const torch::Tensor e4m3 = torch::full({3, 2}, 0.5).to(at::kFloat8_e4m3fn);
  EXPECT_EQ(bs::to_blocked(e4m3).scalar_type(), at::kFloat8_e4m3fn);  // the scales keep their dtype
  EXPECT_NE(error_of([] {
              bs::to_blocked(torch::ones({2, 2, 2}, torch::kByte));
            }).find("amp: to_blocked swizzles"),
            std::string::npos);
  EXPECT_NE(error_of([] { bs::to_blocked(torch::ones({2, 2})); }).find("one-byte scales"), std::string::npos);
}

// Off CUDA every GEMM is the emulated one, bit for bit, whatever the LibTorch.
TEST(BlockScaledMm, OffCudaEveryGemmIsEmulated) {
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({32, 64}).to(torch::kBFloat16), w = torch::randn({48, 64}).to(torch::kBFloat16);
  EXPECT_FALSE(bs::routes_to_scaled_mm(x.device(), bs::BlockFormat::kMxfp8, 32, 48, 64, torch::kBFloat16));
  EXPECT_FALSE(bs::routes_to_scaled_mm(x.device(), bs::BlockFormat::kNvfp4, 32, 48, 64, torch::kBFloat16));
  const bs::MxBlocks a = bs::to_mx(x, bs::MxScale::kRceil), b = bs::to_mx(w, bs::MxScale::kRceil);
  EXPECT_TRUE(torch::equal(bs::mx_mm(a, torch::kBFloat16, b, torch::kBFloat16),
                           bs::mx_mm_emulated(a, torch::kBFloat16, b, torch::kBFloat16)));
  const bs::Nvfp4Blocks p = bs::to_nvfp4(x), q = bs::to_nvfp4(w, true);
  EXPECT_TRUE(torch::equal(bs::nvfp4_mm(p, q, torch::kBFloat16), bs::nvfp4_mm_emulated(p, q, torch::kBFloat16)));
}

#if AMP_DETAIL_HAS_BLOCK_SCALED_MM
// The probe's premise, on the CPU: its emulated product is exact in fp32 (the
// fp64 product is the same), so a right route matches it bit for bit in any
// summation order; and a scale read from the wrong block or row changes it.
TEST(BlockScaledMm, TheProbesAnswerIsExactAndSeesAMisplacedScale) {
  const c10::Device cpu(torch::kCPU);
  const auto mx = bs::mx_probe_operands(cpu);
  const torch::Tensor mx32 = bs::mx_mm_emulated(mx.first, torch::kFloat, mx.second, torch::kFloat);
  const torch::Tensor mx64 = bs::mx_mm_emulated(mx.first, torch::kDouble, mx.second, torch::kDouble);
  EXPECT_TRUE(torch::equal(mx32.to(torch::kDouble), mx64));
  EXPECT_GT(mx32.abs().max().item<float>(), 0.0f);
  for (int64_t dim : {0, 1}) {  // a scale one block along K, or one row, off
    const bs::MxBlocks moved{mx.first.data, bs::as_e8m0(bs::e8m0_bytes(mx.first.scale).roll(1, dim))};
    EXPECT_FALSE(torch::equal(bs::mx_mm_emulated(moved, torch::kFloat, mx.second, torch::kFloat).to(torch::kBFloat16),
                              mx32.to(torch::kBFloat16)));
  }
  const auto nv = bs::nvfp4_probe_operands(cpu);
  const torch::Tensor nv32 = bs::nvfp4_mm_emulated(nv.first, nv.second, torch::kFloat);
  const torch::Tensor nv64 =
      at::mm(bs::from_nvfp4(nv.first, torch::kDouble), bs::from_nvfp4(nv.second, torch::kDouble).t());
  EXPECT_TRUE(torch::equal(nv32.to(torch::kDouble), nv64));
  for (int64_t dim : {0, 1}) {
    const bs::Nvfp4Blocks moved{nv.first.data, nv.first.scale.view(torch::kByte).roll(1, dim).view(at::kFloat8_e4m3fn),
                                nv.first.global_amax};
    EXPECT_FALSE(torch::equal(bs::nvfp4_mm_emulated(moved, nv.second, torch::kBFloat16),
                              bs::nvfp4_mm_emulated(nv.first, nv.second, torch::kBFloat16)));
  }
}
#endif

// On a CUDA device of compute capability 10.0+ with LibTorch 2.8+: the
// device passes the exact probe, and the routed GEMMs (which sum in another
// order and, for NVFP4, scale after a bf16 product) stay within a few bf16
// steps of the emulated ones. Never run so far: no such device was lent.
TEST(BlockScaledMm, RoutedScaledMmAgreesWithTheEmulationOnComputeCapability10) {
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: the routed block-scaled _scaled_mm is unverified here";
#if !AMP_DETAIL_HAS_BLOCK_SCALED_MM
  GTEST_SKIP() << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
               << " has no block-scaled _scaled_mm (2.8+): the GEMMs run emulated";
#endif
#if AMP_DETAIL_WITH_CUDA
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(0);
  if (props->major < 10)
    GTEST_SKIP() << "the block-scaled _scaled_mm needs compute capability 10.0+ (sm_100); this GPU is " << props->major
                 << "." << props->minor << ": the GEMMs run emulated";
#else
  GTEST_SKIP() << "built without LibTorch's CUDA headers: the compute capability cannot be asked";
#endif
#if AMP_DETAIL_HAS_BLOCK_SCALED_MM  // compiled wherever the route is (2.14 CPU too), run where it applies
  const c10::Device cuda(torch::kCUDA, 0);
  ASSERT_TRUE(bs::device_runs_block_scaled_mm(cuda, bs::BlockFormat::kMxfp8));
  ASSERT_TRUE(bs::device_runs_block_scaled_mm(cuda, bs::BlockFormat::kNvfp4));
  torch::manual_seed(7);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(cuda);
  const torch::Tensor x = torch::randn({256, 512}, bf16), w = torch::randn({384, 512}, bf16);
  auto close = [](const torch::Tensor& routed, const torch::Tensor& emulated) {
    const torch::Tensor r = routed.to(torch::kFloat), e = emulated.to(torch::kFloat);
    return (r - e).abs().max().item<float>() <= e.abs().max().item<float>() / 64;
  };
  const bs::MxBlocks a = bs::to_mx(x, bs::MxScale::kRceil), b = bs::to_mx(w, bs::MxScale::kRceil);
  EXPECT_TRUE(bs::routes_to_scaled_mm(cuda, bs::BlockFormat::kMxfp8, 256, 384, 512, torch::kBFloat16));
  EXPECT_TRUE(close(bs::mx_mm(a, torch::kBFloat16, b, torch::kBFloat16),
                    bs::mx_mm_emulated(a, torch::kBFloat16, b, torch::kBFloat16)));
  const bs::Nvfp4Blocks p = bs::to_nvfp4(x), q = bs::to_nvfp4(w, true);
  EXPECT_TRUE(close(bs::nvfp4_mm(p, q, torch::kBFloat16), bs::nvfp4_mm_emulated(p, q, torch::kBFloat16)));
#endif
}
#else
TEST(BlockScaled, NeedsFloat8Dtypes) {
  GTEST_SKIP() << "MXFP8 and NVFP4 need the float8 dtypes (LibTorch 2.1+; this is " << TORCH_VERSION_MAJOR << "."
               << TORCH_VERSION_MINOR << ")";
}
#endif

}  // namespace
}  // namespace float8_test
