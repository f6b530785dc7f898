// bench/linear_routing_bench.cc: what linear routing (amp/precision/linear_routing.h)
// costs or saves on a model that calls one layer many times per step.
//
//   bazel run -c opt //bench:linear_routing_bench
//
// BM_RecurrentLinear: a recurrent-style cell, h = tanh(W h + x_t) with one
// torch::nn::Linear(512, 512) called 32 times per step (batch 64), trained by
// Trainer<Mixed<bf16, NoScaler>, CPU> + SGD, with LinearRouting::kOn and kOff
// on two identical models, interleaved. Routing on, the weight is cast to bf16
// once per step (and its gradient cast back once); off, 32 times. Counters:
// on_ms, off_ms, on_over_off.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <chrono>

namespace {

using Clock = std::chrono::steady_clock;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

constexpr int kCalls = 32;
constexpr int64_t kWidth = 512, kBatch = 64;

struct Recurrent {
  torch::nn::Linear cell{kWidth, kWidth};
  torch::optim::SGD opt{cell->parameters(), torch::optim::SGDOptions(1e-3)};
  amp::Trainer<Bf16, amp::CPU> trainer;
  explicit Recurrent(amp::LinearRouting routing)
      : trainer(cell, opt, amp::TrainerOptions().progress(false).linear_routing(routing)) {}
  void step(const torch::Tensor& xs) {
    trainer.step([&](auto&) {
      torch::Tensor h = torch::zeros({kBatch, kWidth});
      for (int t = 0; t < kCalls; ++t) h = torch::tanh(cell(h) + xs[t]);
      return h.to(torch::kFloat).pow(2).mean();
    });
  }
};

void BM_RecurrentLinear(benchmark::State& state) {
  torch::manual_seed(0);
  Recurrent on(amp::LinearRouting::kOn);
  torch::manual_seed(0);
  Recurrent off(amp::LinearRouting::kOff);
  const torch::Tensor xs = torch::randn({kCalls, kBatch, kWidth});
  for (int i = 0; i < 3; ++i) {  // warm-up: allocator, oneDNN primitives
    on.step(xs);
    off.step(xs);
  }
  double t_on = 0, t_off = 0;
  bool on_first = true;
  for (auto _ : state) {
    // Alternate which goes first, so neither always runs on a warmer cache.
    auto t0 = Clock::now();
    on_first ? on.step(xs) : off.step(xs);
    auto t1 = Clock::now();
    on_first ? off.step(xs) : on.step(xs);
    auto t2 = Clock::now();
    (on_first ? t_on : t_off) += std::chrono::duration<double>(t1 - t0).count();
    (on_first ? t_off : t_on) += std::chrono::duration<double>(t2 - t1).count();
    on_first = !on_first;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["on_ms"] = 1e3 * t_on / n;
  state.counters["off_ms"] = 1e3 * t_off / n;
  state.counters["on_over_off"] = t_on / t_off;
}
BENCHMARK(BM_RecurrentLinear)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(5.0);

}  // namespace
