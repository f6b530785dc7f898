// bench/low_bit_optim_bench.cc: the optimizer step alone (no forward or
// backward) of LibTorch's AdamW, ATen's fused AdamW (amp::FusedStep) and amp's
// low-bit AdamW8bit, AdamW4bit and AdamWFp8 (their fused CPU step, and
// AdamW8bit's ATen ops one at a time: LowBitOptions().fused(false)), on CPU,
// beside a plain copy that moves as many bytes as each step must (the
// bandwidth limit, as scaler_bench has it).
//
//   bazel run -c opt //bench:low_bit_optim_bench
//   OMP_NUM_THREADS=2 build/bench/low_bit_optim_bench --benchmark_min_time=2      (CMake)
//
// Every benchmark steps the same ~10M fp32 parameters (two 2048x2048,
// 512x2048, 512x1024 and two biases, seeded alike; bf16 in the *Bf16 cases,
// against ATen's fused AdamW on the same bf16 parameters) whose gradients are
// fixed random tensors set once; a few untimed steps first make the
// optimizer's state. A low-bit case's /1 runs the best vector ISA this CPU
// has, /0 AVX-512 without VBMI (gathers), where the CPU has VBMI.
// Counters: steps_per_s (wall clock; the time column is one step),
// state_B_per_param (amp::optimizer_state_bytes / amp::parameter_count: LibTorch's
// AdamW 8; AdamW8bit and AdamWFp8 about 2, AdamW4bit about 1, plus block scales
// and the biases' fp32 moments, under LowBitAdam's kMinQuantizedNumel) and params. The
// fused case needs ATen's CPU fused AdamW (LibTorch 2.4+; otherwise it reports
// an error and no numbers), AdamWFp8 a LibTorch with float8 dtypes (2.1+).
// The benchmarks run one after another in one process; compare ratios within
// one run only.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/optim/detail/lowbit_fused_step.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int kWarmupSteps = 3;

// ~10M parameters: 2 * 2048*2048 + 512*2048 + 512*1024 + 2048 + 512 = 9,964,032.
std::vector<torch::Tensor> make_params(torch::ScalarType dtype = torch::kFloat) {
  const std::vector<std::vector<int64_t>> shapes = {{2048, 2048}, {2048, 2048}, {512, 2048},
                                                    {512, 1024},  {2048},       {512}};
  torch::manual_seed(0);
  std::vector<torch::Tensor> params;
  params.reserve(shapes.size());
  for (const auto& shape : shapes) {
    torch::Tensor p = torch::randn(shape).mul_(0.02).to(dtype).requires_grad_();
    p.mutable_grad() = torch::randn_like(p);
    params.push_back(p);
  }
  return params;
}

torch::optim::AdamWOptions options() { return torch::optim::AdamWOptions(1e-3); }

// Times step() alone after kWarmupSteps untimed steps; reports the counters of
// `optimizer`'s state after the timed steps.
template <class Step>
void run(benchmark::State& state, const torch::optim::Optimizer& optimizer, Step&& step) {
  for (int i = 0; i < kWarmupSteps; ++i) step();
  for (auto _ : state) step();
  const int64_t params = amp::parameter_count(optimizer);
  state.counters["steps_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["state_B_per_param"] =
      static_cast<double>(amp::optimizer_state_bytes(optimizer)) / static_cast<double>(params);
  state.counters["params"] = static_cast<double>(params);
}

template <class Optimizer>
void run_own_step(benchmark::State& state) {
  Optimizer optimizer(make_params(), options());
  run(state, optimizer, [&] { optimizer.step(); });
}

// A low-bit step with range(0) = 1: the best vector ISA this CPU has; 0: at
// most AVX-512 without VBMI (the gathers), where the CPU has VBMI.
template <class Optimizer>
void run_low_bit(benchmark::State& state, torch::ScalarType dtype = torch::kFloat, bool stochastic = false) {
  namespace lb = amp::detail::lowbit;
  if (state.range(0) == 0 && lb::cpu_isa() != lb::Isa::kAvx512Vbmi)
    return state.SkipWithError("no AVX512-VBMI on this CPU: /1 is the only choice");
  lb::isa_limit() = static_cast<int>(state.range(0) == 0 ? lb::Isa::kAvx512 : lb::Isa::kAvx512Vbmi);
  Optimizer optimizer(make_params(dtype), options(), amp::LowBitOptions().bf16_stochastic_round(stochastic));
  run(state, optimizer, [&] { optimizer.step(); });
  lb::isa_limit() = static_cast<int>(lb::Isa::kAvx512Vbmi);
}

// A copy of range(0) bytes per parameter, read and written (a copy of n bytes
// moves 2n): fused AdamW 28 (parameter, gradient, two fp32 moments: 4 reads, 3
// writes), the 8-bit and fp8 steps 16 (parameter 8, gradient 4, two 1-byte
// codes read and written 4), the 4-bit step 14, block scales aside.
void BM_CopyBytes(benchmark::State& state) {
  const int64_t params = 9964032;
  const at::Tensor src = torch::ones({params * state.range(0) / 2}, torch::kByte);
  at::Tensor dst = torch::empty_like(src);
  for (int i = 0; i < kWarmupSteps; ++i) dst.copy_(src);
  for (auto _ : state) dst.copy_(src);
  state.counters["steps_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["bytes_per_param"] = static_cast<double>(state.range(0));
}

void BM_AdamW(benchmark::State& state) { run_own_step<torch::optim::AdamW>(state); }

void BM_AdamWFused(benchmark::State& state) {
  torch::optim::AdamW optimizer(make_params(), options());
  if (amp::detail::fused_kind(optimizer, c10::DeviceType::CPU) == amp::FusedKind::kNone)
    return state.SkipWithError("no CPU fused AdamW in this LibTorch");
  amp::FusedStep fused(optimizer);
  run(state, optimizer, [&] { fused.step(); });
}

// ATen's fused AdamW on bf16 parameters (bf16 moments), the bf16 cases' baseline.
void BM_AdamWFusedBf16(benchmark::State& state) {
  torch::optim::AdamW optimizer(make_params(torch::kBFloat16), options());
  if (amp::detail::fused_kind(optimizer, c10::DeviceType::CPU) == amp::FusedKind::kNone)
    return state.SkipWithError("no CPU fused AdamW in this LibTorch");
  amp::FusedStep fused(optimizer);
  run(state, optimizer, [&] { fused.step(); });
}

void BM_AdamW8bit(benchmark::State& state) { run_low_bit<amp::AdamW8bit>(state); }
void BM_AdamW8bitBf16(benchmark::State& state) { run_low_bit<amp::AdamW8bit>(state, torch::kBFloat16); }
void BM_AdamW8bitBf16Stochastic(benchmark::State& state) {
  run_low_bit<amp::AdamW8bit>(state, torch::kBFloat16, /*stochastic=*/true);
}

void BM_AdamW8bitAtenOps(benchmark::State& state) {
  amp::AdamW8bit optimizer(make_params(), options(), amp::LowBitOptions().fused(false));
  run(state, optimizer, [&] { optimizer.step(); });
}

void BM_AdamW4bit(benchmark::State& state) { run_low_bit<amp::AdamW4bit>(state); }

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
void BM_AdamWFp8(benchmark::State& state) { run_low_bit<amp::AdamWFp8>(state); }
#endif

}  // namespace

BENCHMARK(BM_AdamW)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamWFused)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW8bit)->Arg(1)->Arg(0)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW8bitAtenOps)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW4bit)->Arg(1)->Arg(0)->UseRealTime()->Unit(benchmark::kMillisecond);
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
BENCHMARK(BM_AdamWFp8)->Arg(1)->Arg(0)->UseRealTime()->Unit(benchmark::kMillisecond);
#endif
BENCHMARK(BM_AdamWFusedBf16)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW8bitBf16)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW8bitBf16Stochastic)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CopyBytes)->Arg(28)->Arg(16)->Arg(14)->UseRealTime()->Unit(benchmark::kMillisecond);
