// The low-bit Adams' fused CPU step (amp/optim/detail/lowbit_fused_step.h)
// against their ATen-op path (LowBitOptions().fused(false), torchao's eager
// code op for op): parameters, gradients, codes, scales and step counters
// bitwise, for every format, Adam and AdamW, amsgrad, fp32 and bf16 (with and
// without stochastic rounding), under a GradScaler's inverse scale and skip,
// with edge values: zero blocks, the clip at 1e-12, subnormals, huge values,
// inf and NaN gradients. Which path ran is checked by counting aten::lerp.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/detail/parallel.h>
#include <amp/optim/detail/lowbit_fused_step.h>
#include <amp/optim/low_bit_adam.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace low_bit_fused_step_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using amp::StateFormat;
using amp::detail::QuantizedState;

// Bitwise, with every NaN equal to every NaN: a NaN's sign and payload are
// not part of the contract (x86 picks one NaN operand by instruction form).
// fp8 codes compare as their values.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  at::Tensor x = a.reshape({-1}).contiguous(), y = b.reshape({-1}).contiguous();
  if (x.is_floating_point()) {
    if (x.element_size() == 1) {  // float8
      x = x.to(at::kFloat);
      y = y.to(at::kFloat);
    }
    const at::Tensor xn = x.isnan(), yn = y.isnan();
    if (!torch::equal(xn, yn)) return false;
    x = x.masked_fill(xn, 0);
    y = y.masked_fill(yn, 0);
  }
  return torch::equal(x.view(at::kByte), y.view(at::kByte));
}

// Counts aten::lerp calls on this thread (the ATen-op path lerps each moment).
struct LerpCalls {
  static int64_t& count() {
    static thread_local int64_t n = 0;
    return n;
  }
  LerpCalls() {
    count() = 0;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (std::string(fn.name()).rfind("aten::lerp", 0) == 0) ++count();
          return nullptr;
        }));
  }
  ~LerpCalls() { at::removeCallback(handle_); }
  at::CallbackHandle handle_;
};

// Gradients with the edge values, on a parameter of `numel` elements with blocks of `bs`.
at::Tensor edge_grad(int64_t numel, int64_t bs, int step, at::ScalarType dtype) {
  at::Tensor g = torch::randn({numel}) * torch::rand({numel}).pow(4) * 2;
  if (numel < 8 * bs) return g.to(dtype);    // the small tensor (plain states)
  g.slice(0, 0, bs).zero_();                 // a zero block: scale clipped at 1e-12
  g.slice(0, bs, 2 * bs).mul_(1e-13);        // below the clip
  g.slice(0, 2 * bs, 3 * bs).fill_(1e-40f);  // subnormal
  g.slice(0, 3 * bs, 4 * bs).mul_(1e30);     // huge: the squares overflow to inf
  g[4 * bs + step] = -0.0;
  if (step == 2) g.slice(0, 5 * bs, 6 * bs).fill_(0.5);  // one value per block: ties in the map
  return g.to(dtype);
}

template <class Opt>
std::vector<at::Tensor> all_state(const Opt& opt, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    const auto& s = static_cast<const amp::detail::LowBitAdamParamState&>(
        *opt.state().at(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl())));
    out.push_back(s.step());
    for (const QuantizedState* q : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()}) {
      if (!q->defined()) continue;
      out.push_back(q->format() == StateFormat::kFloat ? q->values() : q->codes());
      if (q->format() != StateFormat::kFloat) out.push_back(q->scale());
    }
  }
  return out;
}

struct Case {
  bool amsgrad = false;
  at::ScalarType dtype = at::kFloat;
  bool stochastic = false;
  bool scaled = false;  // a GradScaler's inv scale, then a skipped step with inf/NaN gradients
  std::string name() const {
    return std::string(amsgrad ? "amsgrad " : "") + (dtype == at::kFloat ? "fp32" : "bf16") +
           (stochastic ? " stochastic" : "") + (scaled ? " scaled" : "");
  }
};

template <class Opt>
void fused_equals_ops(const Case& c) {
  using Options = typename Opt::Options;
  const int64_t bs = Opt::kDefaultBlockSize;
  // Two quantized; two plain (under 4096 elements, or not a multiple of the block size), both with a short last block.
  const std::vector<int64_t> shapes[] = {{64, bs}, {48, bs}, {300}, {4100}};
  std::vector<at::Tensor> fused_params, op_params;
  torch::manual_seed(3);
  for (const auto& shape : shapes) {
    at::Tensor p = (torch::randn(shape) * 0.5).to(c.dtype);
    fused_params.push_back(p.clone().requires_grad_());
    op_params.push_back(p.clone().requires_grad_());
  }
  const Options options = Options(1e-2).weight_decay(0.1).amsgrad(c.amsgrad);
  Opt fused(fused_params, options, amp::LowBitOptions().bf16_stochastic_round(c.stochastic));
  Opt ops(op_params, options, amp::LowBitOptions().bf16_stochastic_round(c.stochastic).fused(false));
  ASSERT_EQ(fused.step_path(), Opt::name() + "'s fused CPU step, one pass per block");
  ASSERT_EQ(ops.step_path(), Opt::name() + "'s step_scaled(): ATen ops one at a time, not fused");
  for (int step = 0; step < 4; ++step) {
    const bool skip = c.scaled && step == 2;
    for (size_t i = 0; i < fused_params.size(); ++i) {
      at::Tensor g = edge_grad(fused_params[i].numel(), bs, step, c.dtype).view(fused_params[i].sizes());
      if (skip) {
        g.view({-1})[7] = std::numeric_limits<float>::infinity();
        g.view({-1})[9] = std::numeric_limits<float>::quiet_NaN();
      }
      if (c.scaled) g = g * 1024;
      fused_params[i].mutable_grad() = g.clone();
      op_params[i].mutable_grad() = g.clone();
    }
    const at::Tensor scale = at::full({}, 1024.f), found_inf = at::full({}, skip ? 1.f : 0.f);
    const uint64_t seed = 100 + step;
    torch::manual_seed(seed);                   // the same random bits for stochastic rounding
    auto step_counting_lerps = [&](Opt& opt) {  // one step; returns its aten::lerp calls
      LerpCalls calls;
      if (c.scaled) {
        opt.step_scaled(scale, found_inf);
      } else {
        opt.step();
      }
      return LerpCalls::count();
    };
    const int64_t lerps_fused = step_counting_lerps(fused);
    torch::manual_seed(seed);
    const int64_t lerps_ops = step_counting_lerps(ops);
    // Each parameter the fused step takes lerps twice on the op path only (plain
    // states of bf16 parameters take the ATen ops on both).
    int64_t fused_here = 0;
    for (size_t i = 0; i < fused_params.size(); ++i) {
      const bool plain = fused.format_for(fused_params[i]) == StateFormat::kFloat;
      EXPECT_EQ(fused.takes_fused_step(fused_params[i]), !plain || c.dtype == at::kFloat) << c.name() << " " << i;
      fused_here += fused.takes_fused_step(fused_params[i]) ? 1 : 0;
    }
    if (!skip) {
      EXPECT_EQ(lerps_ops - lerps_fused, 2 * fused_here) << c.name();
    }
    for (size_t i = 0; i < fused_params.size(); ++i) {
      EXPECT_TRUE(same_bits(fused_params[i], op_params[i])) << c.name() << " step " << step << " parameter " << i;
      EXPECT_TRUE(same_bits(fused_params[i].grad(), op_params[i].grad()))
          << c.name() << " step " << step << " gradient " << i;
    }
    const auto a = all_state(fused, fused_params), b = all_state(ops, op_params);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(same_bits(a[i], b[i])) << c.name() << " step " << step << " state " << i;
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (bool amsgrad : {false, true})
    for (bool scaled : {false, true}) {
      out.push_back(Case{amsgrad, at::kFloat, false, scaled});
      out.push_back(Case{amsgrad, at::kBFloat16, false, scaled});
      out.push_back(Case{amsgrad, at::kBFloat16, true, scaled});
    }
  return out;
}

// Every case on the best vector ISA this CPU has; on each lower one (AVX-512
// without VBMI, the AVX2 and portable loops), the cases that touch every branch.
template <class Opt>
void on_every_isa() {
  namespace lb = amp::detail::lowbit;
  const int best = static_cast<int>(lb::cpu_isa());
  for (int isa = best; isa >= 0; --isa) {
    lb::isa_limit() = isa;
    SCOPED_TRACE("vector ISA " + std::to_string(isa));
    for (const Case& c : cases())
      if (isa == best || (c.amsgrad && c.scaled && c.dtype == at::kFloat) || (c.stochastic && !c.amsgrad))
        fused_equals_ops<Opt>(c);
  }
  lb::isa_limit() = static_cast<int>(lb::Isa::kAvx512Vbmi);
}

TEST(LowBitFusedStep, AdamW8bitEqualsTheAtenOps) { on_every_isa<amp::AdamW8bit>(); }
TEST(LowBitFusedStep, Adam8bitEqualsTheAtenOps) { on_every_isa<amp::Adam8bit>(); }
TEST(LowBitFusedStep, AdamW4bitEqualsTheAtenOps) { on_every_isa<amp::AdamW4bit>(); }
TEST(LowBitFusedStep, Adam4bitEqualsTheAtenOps) { on_every_isa<amp::Adam4bit>(); }
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
TEST(LowBitFusedStep, AdamWFp8EqualsTheAtenOps) { on_every_isa<amp::AdamWFp8>(); }
TEST(LowBitFusedStep, AdamFp8EqualsTheAtenOps) { on_every_isa<amp::AdamFp8>(); }
#endif

#if AMP_DETAIL_LOWBIT_X86_CLONES
// The vector searches against the scalar one on every map entry, every
// midpoint between neighbours (a tie rounds up), just below and above them,
// zeros, the ends and NaN.
TEST(LowBitFusedStep, VectorSearchesFindTorchaosCodes) {
  namespace lb = amp::detail::lowbit;
  for (StateFormat f : {StateFormat::kInt8, StateFormat::kInt4})
    for (bool is_signed : {true, false}) {
      const at::Tensor map = lb::qmap(f, is_signed, at::kCPU);
      const float* m = map.data_ptr<float>();
      const int64_t levels = map.numel();
      std::vector<float> x;
      for (int64_t i = 0; i < levels; ++i) {
        x.push_back(m[i]);
        x.push_back(std::nextafter(m[i], -2.f));
        x.push_back(std::nextafter(m[i], 2.f));
        if (i + 1 < levels) x.push_back((m[i] + m[i + 1]) * 0.5f);
      }
      for (float e : {0.f, -0.f, -1.f, 1.f, 2.f, -2.f, std::numeric_limits<float>::quiet_NaN()}) x.push_back(e);
      while (x.size() % 16 != 0) x.push_back(0.25f);
      std::vector<int32_t> codes(x.size());
      const int best = static_cast<int>(lb::cpu_isa());
      for (int isa = 1; isa <= std::min(best, 2); ++isa) {
        if (isa == 2) {
          alignas(64) float columns[272];
          lb::map_columns(m, levels, columns);
          lb::nearest_codes_avx512(x.data(), static_cast<int64_t>(x.size()), 1.f, m, levels, columns, codes.data());
        } else {
          lb::nearest_codes_avx2(x.data(), static_cast<int64_t>(x.size()), 1.f, m, levels, codes.data());
        }
        for (size_t i = 0; i < x.size(); ++i)
          ASSERT_EQ(codes[i], lb::nearest_code(x[i] / 1.f, m, levels))
              << amp::detail::state_format_name(f) << (is_signed ? " signed" : " unsigned") << " ISA " << isa
              << " x=" << x[i];
      }
    }
}
#endif

// The threshold tables (lowbit_threshold.h) against torchao's search
// (nearest_code) for each of torchao's four maps: on a grid of every 4099th
// float bit pattern (NaNs, infinities, subnormals and both zeros among
// them), on every threshold and 3 floats either side, with the scalar lookup
// and each vector one this CPU has. The whole float range was compared once
// by hand: a program looping over all 2^32 bit patterns per map with
// ThresholdTable::code and nearest_code found 0 mismatches (docs/low-bit-optimizers.md).
TEST(LowBitFusedStep, ThresholdTablesFindTorchaosCodes) {
  namespace lb = amp::detail::lowbit;
  for (StateFormat f : {StateFormat::kInt8, StateFormat::kInt4})
    for (bool is_signed : {true, false}) {
      const std::string name = std::string(amp::detail::state_format_name(f)) + (is_signed ? " signed" : " unsigned");
      const at::Tensor map = lb::qmap(f, is_signed, at::kCPU);
      const float* m = map.data_ptr<float>();
      const int64_t levels = map.numel();
      const lb::ThresholdTable* table = lb::threshold_table(f, m, levels);
      ASSERT_NE(table, nullptr) << name;
      ASSERT_EQ(table, &lb::standard_threshold_table(f, is_signed)) << name;
      std::vector<float> x;
      for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4099) {
        const uint32_t b = static_cast<uint32_t>(bits);
        float v;
        std::memcpy(&v, &b, 4);
        x.push_back(v);
      }
      ASSERT_EQ(table->thresholds.size(), static_cast<size_t>(std::max<int64_t>(levels - 1, 16))) << name;
      for (int64_t c = 1; c < levels; ++c) {
        const uint32_t t = table->thresholds[static_cast<size_t>(c - 1)];
        // T_c is where the code first reaches c.
        ASSERT_GE(lb::nearest_code(lb::key_float(t), m, levels), c) << name;
        ASSERT_LT(lb::nearest_code(lb::key_float(t - 1), m, levels), c) << name;
        for (uint32_t d = 0; d <= 6; ++d) x.push_back(lb::key_float(t - 3 + d));
      }
      for (float e : {0.f, -0.f, -1.f, 1.f, std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                      -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
        x.push_back(e);
      while (x.size() % 16 != 0) x.push_back(0.25f);
      std::vector<int32_t> expected(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        expected[i] = static_cast<int32_t>(lb::nearest_code(x[i], m, levels));
        ASSERT_EQ(table->code(x[i]), expected[i]) << name << " scalar, x=" << x[i];
      }
#if AMP_DETAIL_LOWBIT_X86_CLONES
      if (levels == 256 && lb::cpu_isa() == lb::Isa::kAvx512Vbmi) {  // VBMI's dequantization: every code, twice
        std::vector<uint8_t> all(512);
        for (size_t c = 0; c < all.size(); ++c) all[c] = static_cast<uint8_t>(c * 7 % 256);
        std::vector<float> values(all.size());
        lb::lookup_block_vbmi(all.data(), 512, table->planes.data(), values.data());
        for (size_t c = 0; c < all.size(); ++c) ASSERT_EQ(values[c], m[all[c]]) << name << " code " << int(all[c]);
      }
      std::vector<int32_t> codes(x.size());
      const int64_t n = static_cast<int64_t>(x.size());
      const int best = static_cast<int>(lb::cpu_isa());
      for (int isa = 1; isa <= std::min(best, 2);
           ++isa) {  // AVX2: the table; AVX-512: the table or 4-bit's register search
        if (isa == 1) lb::table_codes_avx2(x.data(), n, 1.f, *table, codes.data());
        if (isa == 2) lb::table_codes_avx512(x.data(), n, 1.f, *table, f, codes.data());
        for (size_t i = 0; i < x.size(); ++i)
          ASSERT_EQ(codes[i], expected[i]) << name << " ISA " << isa << ", x=" << x[i];
      }
#endif
    }
}

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
// fp8's table (this LibTorch's c10::Float8_e4m3fn conversion on |x|'s bits)
// against the conversion itself, on the same kind of grid: every 4099th bit
// pattern, every threshold and 3 floats either side, with either sign. All
// 2^32 floats were compared once by hand too (docs/low-bit-optimizers.md).
TEST(LowBitFusedStep, Fp8TableIsC10sConversion) {
  namespace lb = amp::detail::lowbit;
  const lb::ThresholdTable* table = lb::threshold_table(StateFormat::kFp8, nullptr, 0);
  ASSERT_NE(table, nullptr);
  std::vector<uint32_t> bits;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099) bits.push_back(static_cast<uint32_t>(b));
  for (uint32_t t : table->thresholds)
    if (t != 0xFFFFFFFFu)
      for (uint32_t d = 0; d <= 6; ++d) {
        bits.push_back(t - 3 + d);
        bits.push_back((t - 3 + d) | 0x80000000u);
      }
  while (bits.size() % 16 != 0) bits.push_back(0x7FC00000u);
  std::vector<float> x(bits.size());
  std::memcpy(x.data(), bits.data(), bits.size() * 4);
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(lb::fp8_code(*table, x[i]), lb::fp8_bits_of(bits[i])) << std::hex << "bits 0x" << bits[i];
#if AMP_DETAIL_LOWBIT_X86_CLONES
  if (lb::cpu_isa() == lb::Isa::kAvx512Vbmi) {
    std::vector<uint8_t> all(256);
    for (size_t c = 0; c < all.size(); ++c) all[c] = static_cast<uint8_t>(255 - c);
    std::vector<float> values(all.size());
    lb::lookup_block_vbmi(all.data(), 256, table->planes.data(), values.data());
    for (size_t c = 0; c < all.size(); ++c) {
      const float expected = static_cast<float>(c10::Float8_e4m3fn(all[c], c10::Float8_e4m3fn::from_bits()));
      uint32_t a, e;
      std::memcpy(&a, &values[c], 4);
      std::memcpy(&e, &expected, 4);
      ASSERT_EQ(a, e) << "fp8 code " << int(all[c]);
    }
  }
  if (lb::cpu_isa() >= lb::Isa::kAvx512) {
    std::vector<int32_t> codes(x.size());
    lb::table_codes_avx512(x.data(), static_cast<int64_t>(x.size()), 1.f, *table, StateFormat::kFp8, codes.data());
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(static_cast<uint32_t>(codes[i]), lb::fp8_bits_of(bits[i])) << std::hex << "AVX-512, bits 0x" << bits[i];
  }
#endif
}
#endif

// A map that is not torchao's (a loaded state's) has no table: the search stays.
TEST(LowBitFusedStep, OtherMapsKeepTheSearch) {
  namespace lb = amp::detail::lowbit;
  at::Tensor map = lb::qmap(StateFormat::kInt8, true, at::kCPU).clone();
  map.data_ptr<float>()[3] = std::nextafter(map.data_ptr<float>()[3], 0.f);
  EXPECT_EQ(lb::threshold_table(StateFormat::kInt8, map.data_ptr<float>(), map.numel()), nullptr);
  EXPECT_EQ(lb::threshold_table(StateFormat::kFloat, map.data_ptr<float>(), map.numel()), nullptr);
}

// amp's own loops run on LibTorch's threads without -fopenmp too
// (detail/parallel.h): every index once, on more than one thread, exceptions
// reach the caller.
TEST(ParallelChunks, EveryIndexOnceOnSeveralThreads) {
  const int threads = at::get_num_threads();
  at::set_num_threads(std::max(threads, 2));
  std::vector<std::atomic<int>> seen(1000);
  std::mutex mutex;
  std::set<std::thread::id> ids;
  amp::detail::parallel_chunks(1000, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++seen[static_cast<size_t>(i)];
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // long enough for a second thread to take a chunk
    std::lock_guard<std::mutex> lock(mutex);
    ids.insert(std::this_thread::get_id());
  });
  for (const auto& s : seen) ASSERT_EQ(s.load(), 1);
  EXPECT_GE(ids.size(), 2u);
  EXPECT_THROW(amp::detail::parallel_chunks(1000, 16,
                                            [](int64_t b, int64_t) {
                                              if (b > 0) throw std::runtime_error("chunk");
                                            }),
               std::runtime_error);
  at::set_num_threads(threads);
}

// Blocks are written in parallel: the bits do not depend on the thread count.
TEST(LowBitFusedStep, ThreadCountDoesNotChangeTheBits) {
  const int threads = at::get_num_threads();
  std::vector<at::Tensor> results;
  for (int n : {1, 2, 3}) {
    at::set_num_threads(n);
    torch::manual_seed(9);
    at::Tensor p = torch::randn({96, 1024}).requires_grad_();
    amp::AdamW4bit opt({p}, torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      p.mutable_grad() = torch::randn({96, 1024});
      opt.step();
    }
    results.push_back(p.detach().clone());
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(same_bits(results[0], results[1]));
  EXPECT_TRUE(same_bits(results[0], results[2]));
}

}  // namespace
}  // namespace low_bit_fused_step_test
