// bench/fused_step_bench.cc: the Trainer's fused, sync-free step against its
// unfused path (the optimizer's own step(); with a loss scaler, one host sync
// per step), measured interleaved in one process.
//
//   bazel run -c opt //bench:fused_step_bench          (CPU: fused from LibTorch 2.4)
//   build/fused_step_bench                             (CMake; CUDA cases where a GPU is visible)
//
// BM_CpuMlp: trainer_bench's MLP (512-2048-512, batch 512), bf16-mixed, Adam.
// BM_CudaLaunchBound: 8 x Linear(256) + ReLU, batch 64, 16-mixed, Adam.
// BM_CudaLaunchBoundCaptured: the same model, Trainer::capture's CUDA graph
// against the eager fused step.
// BM_CudaComputeBound: 4 transformer FFN blocks (d=2048, 4d hidden, GELU,
// residual), 8192 tokens, bf16-mixed, Adam.
// Counters: fused_steps_per_s, unfused_steps_per_s, speedup; on CUDA also
// syncs_per_step of the fused path, counted with LibTorch's CUDA sync debug
// mode. bench/fused_step_twin.py runs the CUDA models with Python's torch.amp
// (Adam(fused=True) + GradScaler) on the same machine, for the ratio to Python.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <chrono>
#include <string>
#include <utility>

#include "cuda_syncs.h"
#include "ffn_block.h"

namespace {

using Clock = std::chrono::steady_clock;

torch::nn::Sequential launch_bound() {
  torch::nn::Sequential m;
  for (int i = 0; i < 8; ++i) {
    m->push_back(torch::nn::Linear(256, 256));
    m->push_back(torch::nn::ReLU());
  }
  return m;
}
torch::nn::Sequential compute_bound() {
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) m->push_back(amp_bench::FfnBlock(2048));
  return m;
}
torch::nn::Sequential cpu_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(512, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 512));
}

// Times a() and b(), steps_per_round calls of each per benchmark round,
// interleaved, each round ended by sync(); returns their steps per second.
template <class A, class B, class Sync>
std::pair<double, double> interleaved(benchmark::State& state, int steps_per_round, A&& a, B&& b, Sync&& sync) {
  double a_s = 0, b_s = 0;
  int64_t steps = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    for (int i = 0; i < steps_per_round; ++i) a();
    sync();
    auto t1 = Clock::now();
    for (int i = 0; i < steps_per_round; ++i) b();
    sync();
    auto t2 = Clock::now();
    a_s += std::chrono::duration<double>(t1 - t0).count();
    b_s += std::chrono::duration<double>(t2 - t1).count();
    steps += steps_per_round;
  }
  return {static_cast<double>(steps) / a_s, static_cast<double>(steps) / b_s};
}

// One Trainer of policy P on `device`, fused or not.
template <class P, class Device>
struct Setup {
  torch::nn::Sequential model;
  torch::optim::Adam opt;
  amp::Trainer<P, Device> trainer;
  Setup(torch::nn::Sequential (*make)(), torch::Device device, bool fused)
      : model(seeded(make, device)),
        opt(model->parameters(), torch::optim::AdamOptions(1e-4)),
        trainer(model, opt, amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(fused))) {}
  static torch::nn::Sequential seeded(torch::nn::Sequential (*make)(), torch::Device device) {
    torch::manual_seed(0);
    auto m = make();
    m->to(device);
    return m;
  }
  void step(const torch::Tensor& x, const torch::Tensor& y) {
    trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); });
  }
};

template <class P, class Device>
void run(benchmark::State& state, torch::nn::Sequential (*make)(), torch::Device device, int64_t rows, int64_t width,
         int steps_per_round) {
  Setup<P, Device> fused(make, device, true), unfused(make, device, false);
  torch::manual_seed(1);
  const auto x = torch::randn({rows, width}, device), y = torch::randn({rows, width}, device);
  auto sync = [&] {
#ifdef AMP_LIBTORCH_HAS_CUDA
    if (device.is_cuda()) torch::cuda::synchronize();
#endif
  };
  for (int i = 0; i < 5; ++i) fused.step(x, y), unfused.step(x, y);  // warm-up: allocator, cuBLAS, state
  sync();
  const auto [fused_rate, unfused_rate] = interleaved(
      state, steps_per_round, [&] { fused.step(x, y); }, [&] { unfused.step(x, y); }, sync);
  state.counters["fused_steps_per_s"] = fused_rate;
  state.counters["unfused_steps_per_s"] = unfused_rate;
  state.counters["speedup"] = fused_rate / unfused_rate;
  state.counters["fused_path"] = fused.trainer.fused() ? 1 : 0;
#ifdef AMP_LIBTORCH_HAS_CUDA
  if (device.is_cuda())
    state.counters["fused_syncs_per_step"] = amp_bench::syncs_per_step([&] { fused.step(x, y); }, 20);
#endif
}

#ifdef AMP_LIBTORCH_HAS_CUDA
// The launch-bound step two ways in one run: captured in a CUDA graph
// (Trainer::capture) against the eager fused step, interleaved per round.
// Counters: captured_steps_per_s, eager_fused_steps_per_s, speedup (captured
// over eager fused), captured_syncs_per_step, pool_mib (the graph's private
// pool). bench/fused_step_twin.py gives Python's fused torch.amp on the same
// model, for the ratio to Python.
void run_captured(benchmark::State& state, int steps_per_round) {
  using P = amp::Mixed<amp::fp16, amp::DynamicScaler>;
  Setup<P, amp::CUDA> eager(launch_bound, torch::kCUDA, true), graphed(launch_bound, torch::kCUDA, true);
  torch::manual_seed(1);
  using Batch = std::pair<torch::Tensor, torch::Tensor>;
  const Batch batch{torch::randn({64, 256}, torch::kCUDA), torch::randn({64, 256}, torch::kCUDA)};
  auto model = graphed.model.ptr();
  auto step = graphed.trainer.capture(
      [model](auto&, const Batch& b) { return torch::mse_loss(model->forward(b.first), b.second); }, batch);
  for (int i = 0; i < 5; ++i) eager.step(batch.first, batch.second), step(batch);
  torch::cuda::synchronize();
  const auto [captured_rate, eager_rate] = interleaved(
      state, steps_per_round, [&] { step(batch); }, [&] { eager.step(batch.first, batch.second); },
      [] { torch::cuda::synchronize(); });
  state.counters["captured_steps_per_s"] = captured_rate;
  state.counters["eager_fused_steps_per_s"] = eager_rate;
  state.counters["speedup"] = captured_rate / eager_rate;
  state.counters["pool_mib"] = static_cast<double>(step.pool_bytes()) / (1 << 20);
  state.counters["captured_syncs_per_step"] = amp_bench::syncs_per_step([&] { step(batch); }, 20);
}
#endif

void BM_CpuMlp(benchmark::State& state) {
  run<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>(state, cpu_mlp, torch::kCPU, 512, 512, 2);
}

void BM_CudaLaunchBound(benchmark::State& state) {
  if (!torch::cuda::is_available()) return state.SkipWithError("no CUDA device");
  run<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA>(state, launch_bound, torch::kCUDA, 64, 256, 200);
}

void BM_CudaComputeBound(benchmark::State& state) {
  if (!torch::cuda::is_available()) return state.SkipWithError("no CUDA device");
  run<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CUDA>(state, compute_bound, torch::kCUDA, 8192, 2048, 10);
}

void BM_CudaLaunchBoundCaptured(benchmark::State& state) {
  if (!torch::cuda::is_available()) return state.SkipWithError("no CUDA device");
#ifdef AMP_LIBTORCH_HAS_CUDA
  run_captured(state, 1000);
#endif
}

}  // namespace

BENCHMARK(BM_CpuMlp)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(5);
BENCHMARK(BM_CudaLaunchBound)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(5);
BENCHMARK(BM_CudaLaunchBoundCaptured)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(5);
BENCHMARK(BM_CudaComputeBound)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
