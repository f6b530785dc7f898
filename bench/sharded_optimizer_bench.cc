// bench/sharded_optimizer_bench.cc: ShardedOptimizer (ZeRO-1) against
// unsharded DataParallel: step time, optimizer-state bytes per rank and bytes
// communicated per step, on an MLP of 9.4M parameters (1024-4096-1024-1024,
// AdamW, bf16-mixed) over Gloo.
//
//   bazel build -c opt //bench:sharded_optimizer_bench
//   tools/launch -n 2 -- bazel-bin/bench/sharded_optimizer_bench   (every rank runs the same fixed iterations)
//
// Counters (per rank): state_bytes (AdamW's moments this rank holds),
// sent_bytes (what a ring all-reduce of the gradients and, sharded, a ring
// all-gather of the parameter shards send per step: data_parallel_run.h).
// One thread per process.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/distributed.h>
#include <amp/optim/state_bytes.h>

#include <memory>

#include "data_parallel_run.h"

namespace {

void run(benchmark::State& state, bool sharded) {
  amp::ProcessGroup* pg = amp_bench::process_group(state);
  if (pg == nullptr) return;
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(1024, 4096), torch::nn::ReLU(), torch::nn::Linear(4096, 1024),
                                     torch::nn::ReLU(), torch::nn::Linear(1024, 1024));
  const auto options = torch::optim::AdamWOptions(1e-4);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (sharded)
    opt = std::make_unique<amp::ShardedOptimizer<torch::optim::AdamW>>(*pg, model->parameters(), options);
  else
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), options);
  amp_bench::data_parallel_steps(state, *pg, model, *opt);
  double gathered = 0.0, state_bytes = static_cast<double>(amp::optimizer_state_bytes(*opt));
  if (auto* s = dynamic_cast<amp::ShardedOptimizer<torch::optim::AdamW>*>(opt.get())) {
    gathered = static_cast<double>(s->gathered_bytes());
    state_bytes = static_cast<double>(amp::optimizer_state_bytes(s->local()));
  }
  state.counters["params"] = static_cast<double>(amp::parameter_count(*opt));
  state.counters["state_bytes"] = state_bytes;
  state.counters["sent_bytes"] = amp_bench::ring_sent_bytes(*pg, *opt, gathered);
}

void BM_Unsharded(benchmark::State& state) { run(state, false); }
void BM_Sharded(benchmark::State& state) { run(state, true); }

}  // namespace

BENCHMARK(BM_Unsharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Unsharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
