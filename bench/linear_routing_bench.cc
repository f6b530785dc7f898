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
//
// BM_PrecisionMapDispatch: what an installed precision map
// (amp/precision/precision_map.h) costs the ops it does not change. 16 blocks
// of LayerNorm(128) + Linear(128, 128) + GELU, batch 4 (small, so per-op
// dispatch shows), trained by Trainer<Mixed<bf16, NoScaler>, CPU> + SGD, once
// without a map and once with one that maps only "head" to kBf16 (what the
// policy computes anyway), interleaved. With a map, every LayerNorm and Linear
// passes the boxed mapped-op kernel and the parameter lookup. The LayerNorms
// are without affine: LibTorch 1.13's CPU layer_norm fails on a bf16 input
// with fp32 weights, with or without a map. Counters:
// map_ms, no_map_ms, map_over_no_map.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include <chrono>
#include <utility>

namespace {

using Clock = std::chrono::steady_clock;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

// The seconds a() and b() take over the benchmark's iterations, one of each
// per iteration, alternating which goes first so neither always runs on a warmer cache.
template <class A, class B>
std::pair<double, double> interleaved_seconds(benchmark::State& state, A&& a, B&& b) {
  double ta = 0, tb = 0;
  bool a_first = true;
  for (auto _ : state) {
    auto t0 = Clock::now();
    a_first ? a() : b();
    auto t1 = Clock::now();
    a_first ? b() : a();
    auto t2 = Clock::now();
    (a_first ? ta : tb) += std::chrono::duration<double>(t1 - t0).count();
    (a_first ? tb : ta) += std::chrono::duration<double>(t2 - t1).count();
    a_first = !a_first;
  }
  return {ta, tb};
}

constexpr int kCalls = 32;
constexpr int64_t kWidth = 512, kBatch = 64;

struct Recurrent {
  torch::nn::Linear cell{kWidth, kWidth};
  torch::optim::SGD opt{cell->parameters(), torch::optim::SGDOptions(1e-3)};
  amp::Trainer<Bf16, amp::CPU> trainer;
  explicit Recurrent(amp::LinearRouting routing)
      : trainer(cell, opt, amp::TrainerOptions().progress(false).region(amp::RegionOptions().linear_routing(routing))) {
  }
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
  const auto [t_on, t_off] = interleaved_seconds(
      state, [&] { on.step(xs); }, [&] { off.step(xs); });
  const double n = static_cast<double>(state.iterations());
  state.counters["on_ms"] = 1e3 * t_on / n;
  state.counters["off_ms"] = 1e3 * t_off / n;
  state.counters["on_over_off"] = t_on / t_off;
}
BENCHMARK(BM_RecurrentLinear)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(5.0);

constexpr int kBlocks = 16;
constexpr int64_t kSmall = 128, kSmallBatch = 4;

struct Blocks : torch::nn::Module {
  torch::nn::Sequential body;
  torch::nn::Linear head{kSmall, kSmall};
  Blocks() {
    for (int i = 0; i < kBlocks; ++i) {
      body->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kSmall}).elementwise_affine(false)));
      body->push_back(torch::nn::Linear(kSmall, kSmall));
      body->push_back(torch::nn::GELU());
    }
    register_module("body", body);
    register_module("head", head);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(body->forward(x)); }
};

struct MappedOrNot {
  std::shared_ptr<Blocks> model = std::make_shared<Blocks>();
  torch::optim::SGD opt{model->parameters(), torch::optim::SGDOptions(1e-3)};
  amp::Trainer<Bf16, amp::CPU> trainer;
  explicit MappedOrNot(const amp::PrecisionMap& map)
      : trainer(model, opt, amp::TrainerOptions().progress(false).region(amp::RegionOptions().precision_map(map))) {}
  void step(const torch::Tensor& x) {
    trainer.step([&](auto&) { return model->forward(x).to(torch::kFloat).pow(2).mean(); });
  }
};

void BM_PrecisionMapDispatch(benchmark::State& state) {
  torch::manual_seed(0);
  MappedOrNot mapped(amp::PrecisionMap().path("head", amp::ModulePrecision::kBf16));
  torch::manual_seed(0);
  MappedOrNot plain{amp::PrecisionMap()};
  const torch::Tensor x = torch::randn({kSmallBatch, kSmall});
  for (int i = 0; i < 3; ++i) {
    mapped.step(x);
    plain.step(x);
  }
  const auto [t_map, t_plain] = interleaved_seconds(
      state, [&] { mapped.step(x); }, [&] { plain.step(x); });
  const double n = static_cast<double>(state.iterations());
  state.counters["map_ms"] = 1e3 * t_map / n;
  state.counters["no_map_ms"] = 1e3 * t_plain / n;
  state.counters["map_over_no_map"] = t_map / t_plain;
}
BENCHMARK(BM_PrecisionMapDispatch)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(3.0);

}  // namespace
