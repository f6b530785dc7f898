// bench/scaler_bench.cc: GradScaler::unscale_ (unscale + inf/NaN check) against a plain copy.
//
//   bazel run -c opt //bench:scaler_bench
//   bazel run -c opt //bench:scaler_bench -- --benchmark_filter=/100000000/
//
// Both benchmarks walk the same fp32 gradients (1M, 10M, 100M elements split
// into equal tensors) and count 8 bytes per element (one read, one write), so
// their bytes_per_second compare directly: a copy is one read+write pass, the
// bandwidth an unscale kernel can reach at best. On LibTorch 1.13's CPU,
// unscale_ takes amp's portable path (aminmax + mul_, chunked so the multiply
// re-reads from cache).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "amp/scaler/dynamic_scaler.h"

namespace {

std::vector<torch::Tensor> make_tensors(int64_t total, int64_t count) {
  std::vector<torch::Tensor> tensors;
  tensors.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    tensors.push_back(torch::randn({total / count}));
  }
  return tensors;
}

void set_bytes(benchmark::State& state, int64_t total) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * total * 2 * int64_t{sizeof(float)});
}

// scaler.unscale_(optimizer) over `count` gradients. The scale alternates
// between 2**16 and 2**-16, so the gradients are really multiplied (not by 1)
// and come back to their values every two iterations instead of underflowing.
void BM_Unscale(benchmark::State& state) {
  const int64_t total = state.range(0);
  const int64_t count = state.range(1);
  std::vector<torch::Tensor> params;
  for (const torch::Tensor& g : make_tensors(total, count)) {
    params.push_back(torch::zeros_like(g).requires_grad_(true));
    params.back().mutable_grad() = g;
  }
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.0));
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(65536.0));
  scaler.scale(torch::ones({}));
  bool up = false;
  for (auto _ : state) {
    scaler.unscale_(optimizer);
    benchmark::DoNotOptimize(scaler.found_inf());
    scaler.update(up ? 65536.0 : 1.0 / 65536.0);  // ends the iteration without a found-inf read
    up = !up;
  }
  set_bytes(state, total);
}

// dst.copy_(src) over the same tensor sizes: one read and one write per element.
void BM_Copy(benchmark::State& state) {
  const int64_t total = state.range(0);
  const int64_t count = state.range(1);
  const std::vector<torch::Tensor> src = make_tensors(total, count);
  const std::vector<torch::Tensor> dst = make_tensors(total, count);
  for (auto _ : state) {
    for (size_t i = 0; i < src.size(); ++i) {
      dst[i].copy_(src[i]);
    }
    benchmark::ClobberMemory();
  }
  set_bytes(state, total);
}

void Sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"elements", "tensors"});
  b->Args({1'000'000, 1000})->Args({10'000'000, 1000})->Args({100'000'000, 1000});
  b->Args({100'000'000, 10});  // few large tensors, where chunking matters
  b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);
}

BENCHMARK(BM_Copy)->Apply(Sizes);
BENCHMARK(BM_Unscale)->Apply(Sizes);

}  // namespace
