// bench/float8_ffn_bench.cc: Float8 against bf16-mixed on a compute-bound
// model, Trainers of both measured interleaved in one process.
//
//   build/float8_ffn_bench                       (CMake; tools/gpu/check.sh with AMP_GPU_BENCH=1)
//   bazel run -c opt //bench:float8_ffn_bench    (CPU: the small case only, for correctness of the code)
//
// BM_CudaFfn<Recipe>: 2 transformer FFN blocks (LayerNorm, d=4096 -> 16384 ->
// 4096, GELU, residual), 8192 tokens, AdamW (fused), Float8<Recipe> against
// Mixed<bf16, NoScaler>. Counters: fp8_steps_per_s, bf16_steps_per_s, speedup,
// fp8_syncs_per_step (LibTorch's CUDA sync debug mode), fp8_peak_mib and
// bf16_peak_mib (the caching allocator's peak over a step). The goal (issue
// 23): speedup >= 1.3 on an H100, 0 syncs, fp8_peak_mib <= bf16_peak_mib.
// bench/float8_ffn_twin.py runs the same recipe in plain Python torch
// (torch._scaled_mm in an autograd.Function) on the same GPU.
// BM_CpuFfnSmall<Recipe>: d=64, 128 tokens, on CPU where LibTorch has a CPU
// _scaled_mm (2.8+): emulated there, so its ratio means nothing; it runs the
// same code.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <chrono>
#include <string>

#include "cuda_syncs.h"
#include "ffn_block.h"

#ifdef AMP_LIBTORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

torch::nn::Sequential ffn_blocks(int64_t d, int blocks, torch::Device device) {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < blocks; ++i) m->push_back(amp_bench::FfnBlock(d));
  m->to(device);
  return m;
}

template <class P, class Device>
struct Setup {
  torch::nn::Sequential model;
  torch::optim::AdamW opt;
  amp::Trainer<P, Device> trainer;
  Setup(int64_t d, int blocks, torch::Device device)
      : model(ffn_blocks(d, blocks, device)),
        opt(model->parameters(), torch::optim::AdamWOptions(1e-4)),
        trainer(model, opt, amp::TrainerOptions().progress(false)) {}
  void step(const torch::Tensor& x, const torch::Tensor& y) {
    trainer.step([&](auto&) { return torch::mse_loss(model->forward(x).to(torch::kFloat), y); });
  }
};

#ifdef AMP_LIBTORCH_HAS_CUDA
// The caching allocator's peak over one step, in MiB.
template <class F>
double peak_mib(F&& step) {
  const c10::DeviceIndex dev = c10::cuda::current_device();
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(dev);
  step();
  torch::cuda::synchronize();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev);
  return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);
}
#endif

template <class Recipe, class Device>
void run(benchmark::State& state, torch::Device device, int64_t d, int blocks, int64_t tokens, int steps_per_round) {
  Setup<amp::Float8<Recipe>, Device> fp8(d, blocks, device);
  Setup<Bf16, Device> bf16(d, blocks, device);
  torch::manual_seed(1);
  const auto x = torch::randn({tokens, d}, device), y = torch::randn({tokens, d}, device);
  auto sync = [&] {
#ifdef AMP_LIBTORCH_HAS_CUDA
    if (device.is_cuda()) torch::cuda::synchronize();
#endif
  };
  for (int i = 0; i < 3; ++i) fp8.step(x, y), bf16.step(x, y);  // warm-up: allocator, kernels, state
  sync();
  double fp8_s = 0, bf16_s = 0;
  int64_t steps = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    for (int i = 0; i < steps_per_round; ++i) fp8.step(x, y);
    sync();
    const auto t1 = Clock::now();
    for (int i = 0; i < steps_per_round; ++i) bf16.step(x, y);
    sync();
    const auto t2 = Clock::now();
    fp8_s += std::chrono::duration<double>(t1 - t0).count();
    bf16_s += std::chrono::duration<double>(t2 - t1).count();
    steps += steps_per_round;
  }
  state.counters["fp8_steps_per_s"] = static_cast<double>(steps) / fp8_s;
  state.counters["bf16_steps_per_s"] = static_cast<double>(steps) / bf16_s;
  state.counters["speedup"] = bf16_s / fp8_s;
  state.counters["fp8_linears"] = static_cast<double>(amp::float8::coverage(*fp8.model).converted.size());
#ifdef AMP_LIBTORCH_HAS_CUDA
  if (device.is_cuda()) {
    state.counters["fp8_syncs_per_step"] = amp_bench::syncs_per_step([&] { fp8.step(x, y); }, 5);
    state.counters["fp8_peak_mib"] = peak_mib([&] { fp8.step(x, y); });
    state.counters["bf16_peak_mib"] = peak_mib([&] { bf16.step(x, y); });
  }
#endif
}

template <class Recipe>
void BM_CudaFfn(benchmark::State& state) {
  if (!torch::cuda::is_available()) return state.SkipWithError("no CUDA device");
  if constexpr (amp::is_supported_v<amp::Float8<Recipe>, amp::CUDA>) {
    run<Recipe, amp::CUDA>(state, torch::kCUDA, 4096, 2, 8192, 10);
  } else {
    state.SkipWithError("Float8 needs LibTorch 2.5+");
  }
}

template <class Recipe>
void BM_CpuFfnSmall(benchmark::State& state) {
  if constexpr (amp::is_supported_v<amp::Float8<Recipe>, amp::CPU>) {
    run<Recipe, amp::CPU>(state, torch::kCPU, 64, 1, 128, 5);
  } else {
    state.SkipWithError("Float8 on CPU needs LibTorch 2.8+");
  }
}

}  // namespace

BENCHMARK_TEMPLATE(BM_CudaFfn, amp::Tensorwise)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_TEMPLATE(BM_CudaFfn, amp::Delayed<>)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_TEMPLATE(BM_CpuFfnSmall, amp::Tensorwise)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_TEMPLATE(BM_CpuFfnSmall, amp::Delayed<>)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_TEMPLATE(BM_CudaFfn, amp::Rowwise)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_TEMPLATE(BM_CudaFfn, amp::RowwiseWithGwHp)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_TEMPLATE(BM_CpuFfnSmall, amp::Rowwise)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(2);
BENCHMARK_TEMPLATE(BM_CpuFfnSmall, amp::RowwiseWithGwHp)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(2);
