// bench/data_parallel_run.h: the data-parallel run that sharded_optimizer_bench
// and fully_shard_bench's ZeRO-1 baseline share: this process's group (one
// thread, through tools/launch), a bf16-mixed Trainer under DataParallel on a
// 1024 -> 1024 model (batch 256 split over the processes, MSE loss), and the
// bytes a ring sends per rank and step.
#pragma once

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/distributed.h>
#include <amp/optim/state_bytes.h>
#include <amp/train/trainer.h>

#include <cstdint>
#include <cstdlib>
#include <optional>

namespace amp_bench {

// This process's group (one rendezvous per process); nullptr, the benchmark
// skipped, when not run through tools/launch.
inline amp::ProcessGroup* process_group(benchmark::State& state) {
  torch::set_num_threads(1);
  if (std::getenv("WORLD_SIZE") == nullptr) {
    state.SkipWithError("run through tools/launch -n 2");
    return nullptr;
  }
  static std::optional<amp::ProcessGroup> pg;
  if (!pg) pg.emplace(amp::init_process_group());
  return &*pg;
}

// Trains `model` with `opt` (built from its parameters) under a bf16-mixed
// Trainer and DataParallel: two untimed steps, then the benchmark's.
template <class Model>
void data_parallel_steps(benchmark::State& state, amp::ProcessGroup& pg, Model& model, torch::optim::Optimizer& opt) {
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, opt,
                                                                       amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);
  const int64_t rows = 256 / pg.world_size();
  const auto x = torch::randn({rows, 1024}), y = torch::randn({rows, 1024});
  auto step = [&] { trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); }); };
  for (int i = 0; i < 2; ++i) step();
  for (auto _ : state) step();
}

// What a ring sends per rank and step: its all-reduce of the fp32 gradients,
// 2(N-1)/N of their bytes, and for ZeRO-1 its all-gather of the parameter
// shards, (N-1) padded shards (`gathered_bytes`; 0 without).
inline double ring_sent_bytes(const amp::ProcessGroup& pg, const torch::optim::Optimizer& opt, double gathered_bytes) {
  const double n = pg.world_size();
  const double grad_bytes = 4.0 * static_cast<double>(amp::parameter_count(opt));
  return 2.0 * (n - 1) / n * grad_bytes + (n - 1) * gathered_bytes;
}

}  // namespace amp_bench
