// bench/data_parallel_bench.cc: what DataParallel's overlap of all-reduce and
// backward buys, on trainer_bench's MLP (512-2048-512, Adam, bf16-mixed).
//
//   bazel build -c opt //bench:data_parallel_bench
//   tools/launch -n 2 -- bazel-bin/bench/data_parallel_bench   (every rank runs the same fixed iterations)
//
// BM_Overlap/BM_AfterBackward: a step on each rank's half of a batch of 512,
// all-reduces started as buckets fill vs all after backward (1 MiB buckets, so
// there are several); BM_OneProcess (WORLD_SIZE=1 or no launcher): the whole
// batch in one process. One thread per process, so that 2 processes on 2
// cores compare fairly with 1 process on 1.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/distributed.h>
#include <amp/train/trainer.h>

#include <cstdlib>
#include <optional>

namespace {

void run(benchmark::State& state, bool overlap) {
  torch::set_num_threads(1);
  const bool distributed = std::getenv("WORLD_SIZE") != nullptr;
  if (!distributed && state.range(0) == 1) {
    state.SkipWithError("run through tools/launch -n 2");
    return;
  }
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(512, 2048), torch::nn::ReLU(), torch::nn::Linear(2048, 512));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, opt,
                                                                       amp::TrainerOptions().progress(false));
  std::optional<amp::ProcessGroup> pg;
  std::optional<amp::DataParallel> dp;
  int64_t rows = 512;
  if (state.range(0) == 1) {
    pg.emplace(amp::init_process_group());
    dp.emplace(*pg, trainer, amp::DataParallelOptions().bucket_cap_mb(1.0).overlap(overlap));
    rows = 512 / pg->world_size();
  }
  const auto x = torch::randn({rows, 512}), y = torch::randn({rows, 512});
  auto step = [&] { trainer.step([&](auto&) { return torch::mse_loss(model->forward(x), y); }); };
  for (int i = 0; i < 3; ++i) step();
  for (auto _ : state) step();
}

void BM_Overlap(benchmark::State& state) { run(state, true); }
void BM_AfterBackward(benchmark::State& state) { run(state, false); }
void BM_OneProcess(benchmark::State& state) { run(state, true); }

}  // namespace

BENCHMARK(BM_Overlap)->Arg(1)->Iterations(30)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AfterBackward)->Arg(1)->Iterations(30)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_OneProcess)->Arg(0)->Iterations(30)->UseRealTime()->Unit(benchmark::kMillisecond);
