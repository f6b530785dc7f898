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
// Every benchmark steps the same ~10M fp32 parameters (two 2048x2048, 512x2048,
// 512x1024 and two biases, seeded alike) whose gradients are fixed random
// tensors set once; a few untimed steps first make the optimizer's state.
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

#include <cstdint>
#include <vector>

namespace {

constexpr int kWarmupSteps = 3;

// ~10M parameters: 2 * 2048*2048 + 512*2048 + 512*1024 + 2048 + 512 = 9,964,032.
std::vector<torch::Tensor> make_params() {
  const std::vector<std::vector<int64_t>> shapes = {{2048, 2048}, {2048, 2048}, {512, 2048},
                                                    {512, 1024},  {2048},       {512}};
  torch::manual_seed(0);
  std::vector<torch::Tensor> params;
  params.reserve(shapes.size());
  for (const auto& shape : shapes) {
    torch::Tensor p = torch::randn(shape).mul_(0.02).requires_grad_();
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

void BM_AdamW8bit(benchmark::State& state) { run_own_step<amp::AdamW8bit>(state); }

void BM_AdamW8bitAtenOps(benchmark::State& state) {
  amp::AdamW8bit optimizer(make_params(), options(), amp::LowBitOptions().fused(false));
  run(state, optimizer, [&] { optimizer.step(); });
}

void BM_AdamW4bit(benchmark::State& state) { run_own_step<amp::AdamW4bit>(state); }

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
void BM_AdamWFp8(benchmark::State& state) { run_own_step<amp::AdamWFp8>(state); }
#endif

}  // namespace

BENCHMARK(BM_AdamW)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamWFused)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW8bit)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW8bitAtenOps)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AdamW4bit)->UseRealTime()->Unit(benchmark::kMillisecond);
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
BENCHMARK(BM_AdamWFp8)->UseRealTime()->Unit(benchmark::kMillisecond);
#endif
BENCHMARK(BM_CopyBytes)->Arg(28)->Arg(16)->Arg(14)->UseRealTime()->Unit(benchmark::kMillisecond);
