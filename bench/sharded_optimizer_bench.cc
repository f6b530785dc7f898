// bench/sharded_optimizer_bench.cc: ShardedOptimizer (ZeRO-1) against
// unsharded DataParallel: step time, optimizer-state bytes per rank and bytes
// communicated per step, on an MLP of 9.4M parameters (1024-4096-1024-1024,
// AdamW, bf16-mixed) over Gloo.
//
//   bazel build -c opt //bench:sharded_optimizer_bench
//   tools/launch -n 2 -- bazel-bin/bench/sharded_optimizer_bench   (every rank runs the same fixed iterations)
//
// Counters (per rank): state_bytes (AdamW's moments this rank holds),
// sent_bytes (what a ring all-reduce of the gradient buckets and a ring
// all-gather of the parameter shards send per step: 2(N-1)/N of the
// gradient bytes, plus (N-1) padded shards). One thread per process.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/distributed.h>
#include <amp/optim/state_bytes.h>
#include <amp/train/trainer.h>

#include <cstdlib>
#include <memory>
#include <optional>

namespace {

void run(benchmark::State& state, bool sharded) {
  torch::set_num_threads(1);
  if (std::getenv("WORLD_SIZE") == nullptr) {
    state.SkipWithError("run through tools/launch -n 2");
    return;
  }
  static std::optional<amp::ProcessGroup> pg;  // one rendezvous per process
  if (!pg) pg.emplace(amp::init_process_group());
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(1024, 4096), torch::nn::ReLU(), torch::nn::Linear(4096, 1024),
                                     torch::nn::ReLU(), torch::nn::Linear(1024, 1024));
  const auto options = torch::optim::AdamWOptions(1e-4);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (sharded)
    opt = std::make_unique<amp::ShardedOptimizer<torch::optim::AdamW>>(*pg, model->parameters(), options);
  else
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), options);
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, *opt,
                                                                       amp::TrainerOptions().progress(false));
  amp::DataParallel dp(*pg, trainer);
  const int64_t rows = 256 / pg->world_size();
  const auto x = torch::randn({rows, 1024}), y = torch::randn({rows, 1024});
  auto step = [&] { trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); }); };
  for (int i = 0; i < 2; ++i) step();
  for (auto _ : state) step();
  const double n = pg->world_size();
  const double grad_bytes = 4.0 * static_cast<double>(amp::parameter_count(*opt));
  double sent = 2.0 * (n - 1) / n * grad_bytes;
  double state_bytes = static_cast<double>(amp::optimizer_state_bytes(*opt));
  if (auto* s = dynamic_cast<amp::ShardedOptimizer<torch::optim::AdamW>*>(opt.get())) {
    sent += (n - 1) * static_cast<double>(s->gathered_bytes());
    state_bytes = static_cast<double>(amp::optimizer_state_bytes(s->local()));
  }
  state.counters["params"] = static_cast<double>(amp::parameter_count(*opt));
  state.counters["state_bytes"] = state_bytes;
  state.counters["sent_bytes"] = sent;
}

void BM_Unsharded(benchmark::State& state) { run(state, false); }
void BM_Sharded(benchmark::State& state) { run(state, true); }

}  // namespace

BENCHMARK(BM_Unsharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Unsharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Sharded)->Iterations(10)->UseRealTime()->Unit(benchmark::kMillisecond);
