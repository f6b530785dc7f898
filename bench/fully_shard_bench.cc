// bench/fully_shard_bench.cc: FullyShard (FSDP2's shape) against DataParallel
// + ShardedOptimizer (ZeRO-1) on the same model: step time and the bytes each
// step puts into collectives, beside FSDP2's formula. The model of
// sharded_optimizer_bench (1024-4096-1024-1024, 9.44M parameters, AdamW,
// batch 256 split over the processes), its first two layers the units, the
// last the root's.
//
//   bazel build -c opt //bench:fully_shard_bench
//   tools/launch -n 2 -- bazel-bin/bench/fully_shard_bench   (every rank runs the same fixed iterations)
//
// Variants: ZeRO1 (DataParallel + ShardedOptimizer, a bf16-mixed Trainer);
// FullyShard_autocast (fp32 shards under the same bf16-mixed Trainer: the
// same arithmetic); FullyShard_bf16 (param_dtype bf16, reduce_dtype fp32, a
// Stepper: FSDP2's usual policy, no autocast); FullyShard_bf16_prefetch (the
// same with FullyShardOptions::prefetch: each all-gather issued one unit early).
// Counters (per rank and step): gathered_bytes and scattered_bytes, the
// all-gathers' outputs and the reduce-scatters' inputs as FullyShard counts
// them; formula_bytes, FSDP2's two all-gathers of the padded parameters in
// the compute dtype and one reduce-scatter of the gradients in reduce_dtype;
// root_once_bytes, the same with the root's parameters gathered once;
// sent_bytes, what a ring sends of them per rank ((N-1)/N), and for ZeRO1 its
// ring all-reduce of the gradients and all-gather of the shards. One thread
// per process.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <amp/distributed.h>
#include <amp/train/trainer.h>

#include <cstdint>

#include "data_parallel_run.h"

namespace {

struct UnitImpl : torch::nn::Module {
  UnitImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(torch::linear(x, fc->weight, fc->bias)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Unit);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : u0(register_module("u0", Unit(1024, 4096))),
        u1(register_module("u1", Unit(4096, 1024))),
        head(register_module("head", torch::nn::Linear(1024, 1024))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = fsdp != nullptr ? fsdp->forward(u1, fsdp->forward(u0, x)) : u1->forward(u0->forward(x));
    return torch::linear(h, head->weight, head->bias);
  }
  Unit u0, u1;
  torch::nn::Linear head;
  amp::FullyShard* fsdp = nullptr;
};
TORCH_MODULE(Net);

void BM_ZeRO1(benchmark::State& state) {
  amp::ProcessGroup* pg = amp_bench::process_group(state);
  if (pg == nullptr) return;
  torch::manual_seed(0);
  Net model;
  amp::ShardedOptimizer<torch::optim::AdamW> opt(*pg, model->parameters(), torch::optim::AdamWOptions(1e-4));
  amp_bench::data_parallel_steps(state, *pg, model, opt);
  state.counters["sent_bytes"] = amp_bench::ring_sent_bytes(*pg, opt, static_cast<double>(opt.gathered_bytes()));
}

void fully_shard(benchmark::State& state, bool autocast, bool prefetch = false) {
  amp::ProcessGroup* pg = amp_bench::process_group(state);
  if (pg == nullptr) return;
  torch::manual_seed(0);
  Net model;
  amp::FullyShardOptions options;
  options.prefetch(prefetch);
  if (!autocast) options.param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
  amp::FullyShard fsdp(*pg, *model, {model->u0.ptr(), model->u1.ptr()}, options);
  model->fsdp = &fsdp;
  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-4));
  const int64_t rows = 256 / pg->world_size();
  const auto x = torch::randn({rows, 1024}), y = torch::randn({rows, 1024});
  auto loss_of = [&] { return torch::mse_loss(fsdp.forward(model, x).to(torch::kFloat), y); };
  int64_t gathered = 0, scattered = 0;
  auto measure = [&](auto&& step) {
    for (int i = 0; i < 2; ++i) step();
    gathered = fsdp.allgathered_bytes(), scattered = fsdp.reduce_scattered_bytes();
    for (auto _ : state) step();
  };
  if (autocast) {
    amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, opt,
                                                                         amp::TrainerOptions().progress(false));
    trainer.stepper().set_gradient_sync(&fsdp);
    measure([&] { trainer.step([&](auto&) { return loss_of(); }); });
  } else {
    // A Stepper, not a Trainer<True<fp32>>: that one converts the module's
    // parameters to fp32, which are FullyShard's bf16 unsharded tensors here.
    amp::Stepper<amp::NoScaler> stepper(opt);
    stepper.set_gradient_sync(&fsdp);
    measure([&] { stepper.step(loss_of()); });
  }
  const double steps = static_cast<double>(state.iterations()), n = pg->world_size();
  const double padded = static_cast<double>(fsdp.parameter_bytes()) / 4.0 * n;  // padded elements, all ranks
  const double compute = autocast ? 4.0 : 2.0, reduce = 4.0;
  const int64_t chunk = (1024 + pg->world_size() - 1) / pg->world_size();
  const int64_t root_padded = (chunk * 1024 + chunk) * static_cast<int64_t>(compute);  // head's padded shard bytes
  state.counters["gathered_bytes"] = static_cast<double>(fsdp.allgathered_bytes() - gathered) / steps;
  state.counters["scattered_bytes"] = static_cast<double>(fsdp.reduce_scattered_bytes() - scattered) / steps;
  state.counters["formula_bytes"] = 2.0 * padded * compute + padded * reduce;
  // The root is gathered once (kept from its forward to its backward, as FSDP2's root).
  state.counters["root_once_bytes"] = 2.0 * padded * compute + padded * reduce - n * static_cast<double>(root_padded);
  state.counters["sent_bytes"] =
      (n - 1) / n *
      static_cast<double>(fsdp.allgathered_bytes() - gathered + fsdp.reduce_scattered_bytes() - scattered) / steps;
}

void BM_FullyShard_autocast(benchmark::State& state) { fully_shard(state, true); }
void BM_FullyShard_bf16(benchmark::State& state) { fully_shard(state, false); }
void BM_FullyShard_bf16_prefetch(benchmark::State& state) { fully_shard(state, false, true); }

}  // namespace

BENCHMARK(BM_ZeRO1)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FullyShard_autocast)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FullyShard_bf16)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FullyShard_bf16_prefetch)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ZeRO1)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FullyShard_autocast)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FullyShard_bf16)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FullyShard_bf16_prefetch)->Iterations(5)->UseRealTime()->Unit(benchmark::kMillisecond);
