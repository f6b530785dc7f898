// examples/sharded_ladder.cc: the memory ladder per rank, under more than one
// process (`tools/dev demo --ranks=2` runs it at N = 1 and 2):
//
//   tools/launch -n 2 -- bazel-bin/examples/sharded_ladder [--steps=20] [--csv=out/sharded.csv]
//
// The demo's task and residual MLP (demo_task.h) under bf16-mixed, data
// parallel (amp::DataParallel: each rank takes its share of every batch) with
// the optimizer state sharded (amp::ShardedOptimizer, ZeRO-1): AdamW, then
// AdamW8bit. Rank 0 prints every rank's training-state bytes per parameter
// (parameters and gradients: every rank holds all of them; optimizer state:
// amp::optimizer_state_bytes of the rank's local optimizer) next to the
// formula s x P / N (s: the optimizer's state bytes per parameter unsharded,
// 8 for AdamW, 2 + 8/256 for AdamW8bit; P parameters, N processes), and
// appends them to --csv. Whole tensors go to ranks (torch's
// ZeroRedundancyOptimizer's partition), so a rank's share is P / N to within
// a tensor: 0.4% at N = 2 for the default width. Then the same model fully
// sharded (amp::FullyShard, FSDP2's shape: each linear a unit, the head in
// the root's; bf16 compute, fp32 reduction, fp32 loss): parameters,
// gradients and optimizer state are each rank's dim-0 shards, (4 + 4 + s) x
// P / N, and only the unit being computed is whole (its peak, in bf16, is
// printed after the table).
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/distributed.h>

#include "demo_task.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Options {
  int64_t steps = 20, batch_size = 256, ffn = 1024, seed = 42;
  std::string csv;
};

// One rank's numbers, gathered to rank 0 as doubles (exact below 2^53).
struct RankRow {
  double param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, shard = 0, steps_per_s = 0, final_loss = 0;
};

std::vector<RankRow> gather_rows(const amp::ProcessGroup& pg, RankRow mine, const std::vector<torch::Tensor>& losses);

template <class Inner, class... LowBit>
std::vector<RankRow> train(const amp::ProcessGroup& pg, const Options& o, const demo::Task& task, LowBit... low_bit) {
  using Policy = amp::Mixed<amp::bf16, amp::NoScaler>;
  torch::manual_seed(o.seed);  // the same initial weights on every rank and at every N
  demo::ResidualMlp model(o.ffn);
  amp::ShardedOptimizer<Inner> optimizer(pg, model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0),
                                         low_bit...);
  amp::Trainer<Policy, amp::CPU> trainer(
      model, optimizer, amp::TrainerOptions().progress(false).step(amp::StepOptions().max_grad_norm(1.0)));
  amp::DataParallel dp(pg, trainer);
  const int64_t per_rank = o.batch_size / pg.world_size();
  const int64_t batches = task.train_x.size(0) / o.batch_size;
  std::vector<torch::Tensor> losses;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < o.steps; ++s) {
    if (s == 1) t0 = std::chrono::steady_clock::now();  // the first step (states made, first calls) untimed
    const int64_t start = (s % batches) * o.batch_size + pg.rank() * per_rank;
    const auto x = task.train_x.narrow(0, start, per_rank), y = task.train_y.narrow(0, start, per_rank);
    losses.push_back(trainer.step([&](auto&) { return torch::cross_entropy_loss(model(x), y); }).loss);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RankRow mine;
  const auto params = model->parameters();
  mine.param_bytes = static_cast<double>(demo::tensor_bytes(params));
  mine.grad_bytes = static_cast<double>(demo::gradient_bytes(params));
  mine.optimizer_bytes = static_cast<double>(amp::optimizer_state_bytes(optimizer.local()));
  mine.shard = static_cast<double>(optimizer.shard_numel());
  mine.steps_per_s = o.steps > 1 ? static_cast<double>(o.steps - 1) / secs : 0.0;
  return gather_rows(pg, mine, losses);
}

// Every rank's row (with the mean of its last 10 losses), gathered to every rank.
std::vector<RankRow> gather_rows(const amp::ProcessGroup& pg, RankRow mine, const std::vector<torch::Tensor>& losses) {
  const size_t tail = std::min<size_t>(10, losses.size());
  for (size_t i = losses.size() - tail; i < losses.size(); ++i)
    mine.final_loss += losses[i].item<double>() / static_cast<double>(tail);
  const torch::Tensor packed = torch::tensor(
      {mine.param_bytes, mine.grad_bytes, mine.optimizer_bytes, mine.shard, mine.steps_per_s, mine.final_loss},
      torch::kDouble);
  std::vector<RankRow> all;
  for (const auto& t : pg.allgather(packed, "sharded_ladder's per-rank bytes")) {
    const auto v = t.accessor<double, 1>();
    all.push_back(RankRow{v[0], v[1], v[2], v[3], v[4], v[5]});
  }
  return all;
}

// The same task and model, fully sharded, in a plain loop (FullyShard's
// documented use): each rank computes on its share of the batch.
template <class Optimizer, class... LowBit>
std::vector<RankRow> train_fully_sharded(const amp::ProcessGroup& pg, const Options& o, const demo::Task& task,
                                         int64_t* peak_unsharded, LowBit... low_bit) {
  torch::manual_seed(o.seed);  // the same initial weights as the rows above
  demo::ResidualMlp model(o.ffn);
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (size_t b = 0; b < model->up.size(); ++b) {
    units.push_back(model->up[b].ptr());
    units.push_back(model->down[b].ptr());
  }
  amp::FullyShard fsdp(
      pg, *model, units,
      amp::FullyShardOptions().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat));
  model->linear = [&fsdp](torch::nn::Linear& l, const torch::Tensor& in) { return fsdp.forward(l, in); };
  Optimizer optimizer(fsdp.parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0), low_bit...);
  const int64_t per_rank = o.batch_size / pg.world_size();
  const int64_t batches = task.train_x.size(0) / o.batch_size;
  std::vector<torch::Tensor> losses;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < o.steps; ++s) {
    if (s == 1) t0 = std::chrono::steady_clock::now();
    const int64_t start = (s % batches) * o.batch_size + pg.rank() * per_rank;
    const auto x = task.train_x.narrow(0, start, per_rank), y = task.train_y.narrow(0, start, per_rank);
    optimizer.zero_grad();
    auto loss = torch::cross_entropy_loss(fsdp.forward(model, x), y);
    loss.backward();  // each unit's gradients reduce-scattered as backward reaches it
    fsdp.clip_grad_norm(1.0);
    optimizer.step();
    losses.push_back(loss.detach());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *peak_unsharded = fsdp.peak_unsharded_bytes();
  RankRow mine;
  mine.param_bytes = static_cast<double>(fsdp.parameter_bytes());
  mine.grad_bytes = static_cast<double>(fsdp.gradient_bytes());
  mine.optimizer_bytes = static_cast<double>(amp::optimizer_state_bytes(optimizer));
  mine.shard = static_cast<double>(amp::parameter_count(optimizer));
  mine.steps_per_s = o.steps > 1 ? static_cast<double>(o.steps - 1) / secs : 0.0;
  return gather_rows(pg, mine, losses);
}

// mode: "zero1" (DataParallel + ShardedOptimizer) or "fully" (FullyShard).
void report(const amp::ProcessGroup& pg, const Options& o, const std::string& mode, const std::string& name,
            double unsharded_per_param, int64_t parameters, const std::vector<RankRow>& rows) {
  if (pg.rank() != 0) return;
  const int n = pg.world_size();
  const double formula = unsharded_per_param * static_cast<double>(parameters) / n;
  for (size_t r = 0; r < rows.size(); ++r) {
    const RankRow& x = rows[r];
    const double p = static_cast<double>(parameters);
    std::printf("%-4d %-6s %-10s %10.3f %10.3f %14.3f %12.3f %+10.2f%% %10.3f %9.2f %11.4f\n", static_cast<int>(r),
                mode.c_str(), name.c_str(), x.param_bytes / p, x.grad_bytes / p, x.optimizer_bytes / p, formula / p,
                100.0 * (x.optimizer_bytes / formula - 1.0), (x.param_bytes + x.grad_bytes + x.optimizer_bytes) / p,
                x.steps_per_s, x.final_loss);
  }
  if (o.csv.empty()) return;
  std::ifstream existing(o.csv);
  const bool header = !existing.good() || existing.peek() == std::ifstream::traits_type::eof();
  existing.close();
  std::ofstream out(o.csv, std::ios::app);
  if (!out) throw std::runtime_error("amp: cannot write --csv file " + o.csv);
  if (header)
    out << "world,rank,optimizer,parameters,shard_parameters,param_bytes,grad_bytes,optimizer_bytes,formula_bytes,"
           "steps_per_s,final_loss,mode\n";
  out.precision(12);
  for (size_t r = 0; r < rows.size(); ++r)
    out << n << "," << r << "," << name << "," << parameters << "," << static_cast<int64_t>(rows[r].shard) << ","
        << static_cast<int64_t>(rows[r].param_bytes) << "," << static_cast<int64_t>(rows[r].grad_bytes) << ","
        << static_cast<int64_t>(rows[r].optimizer_bytes) << "," << formula << "," << rows[r].steps_per_s << ","
        << rows[r].final_loss << "," << mode << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"amp's memory ladder per rank: data parallel with sharded optimizer state (run under tools/launch)"};
  app.add_option("--steps", o.steps, "optimizer steps per optimizer (default 20)")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", o.batch_size, "global batch, split over the processes (default 256)")
      ->check(CLI::PositiveNumber);
  app.add_option("--ffn", o.ffn, "block width of the residual MLP (default 1024)")->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "seed of the data and of the initial weights");
  app.add_option("--csv", o.csv, "append one line per rank and optimizer here (rank 0 writes)");
  CLI11_PARSE(app, argc, argv);
  try {
    amp::ProcessGroup pg = amp::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    TORCH_CHECK(o.batch_size % pg.world_size() == 0, "amp: sharded_ladder's --batch-size (", o.batch_size,
                ") must be a multiple of the number of processes (", pg.world_size(), ")");
    // One thread per process, as examples/data_parallel: with two, OpenMP's
    // threads spin while Gloo's thread works (measured at N = 1: 2.3 steps/s
    // with two threads, 56 with one).
    torch::set_num_threads(1);
    const demo::Task task(std::min<int64_t>(o.batch_size * o.steps, 16384), 16, static_cast<uint64_t>(o.seed));
    int64_t parameters = 0;
    for (const auto& p : demo::ResidualMlp(o.ffn)->parameters()) parameters += p.numel();
    if (pg.rank() == 0) {
      std::printf(
          "sharded ladder: N = %d process%s (zero1: amp::ShardedOptimizer with amp::DataParallel, bf16-mixed; fully: "
          "amp::FullyShard, bf16 compute); "
          "residual MLP %lld-[%lld-%lld]x%lld-%lld, %lld parameters; global batch %lld, %lld steps\n",
          pg.world_size(), pg.world_size() == 1 ? "" : "es", static_cast<long long>(demo::Task::kIn),
          static_cast<long long>(o.ffn), static_cast<long long>(demo::Task::kIn),
          static_cast<long long>(demo::ResidualMlpImpl::kBlocks), static_cast<long long>(demo::Task::kClasses),
          static_cast<long long>(parameters), static_cast<long long>(o.batch_size), static_cast<long long>(o.steps));
      std::printf("%-4s %-6s %-10s %10s %10s %14s %12s %11s %10s %9s %11s\n", "rank", "mode", "optimizer", "params B/p",
                  "grads B/p", "optimizer B/p", "formula B/p", "vs formula", "total B/p", "steps/s", "final loss");
    }
    const double adamw = 8.0, adamw8bit = 2.0 + 8.0 / 256;
    report(pg, o, "zero1", "AdamW", adamw, parameters, train<torch::optim::AdamW>(pg, o, task));
    report(pg, o, "zero1", "AdamW8bit", adamw8bit, parameters,
           train<amp::AdamW8bit>(pg, o, task, amp::LowBitOptions()));
    int64_t peak = 0, peak8 = 0;
    report(pg, o, "fully", "AdamW", adamw, parameters, train_fully_sharded<torch::optim::AdamW>(pg, o, task, &peak));
    report(pg, o, "fully", "AdamW8bit", adamw8bit, parameters,
           train_fully_sharded<amp::AdamW8bit>(pg, o, task, &peak8, amp::LowBitOptions()));
    if (pg.rank() == 0)
      std::printf(
          "(bytes per parameter of the whole model, on each rank. zero1: amp::DataParallel + amp::ShardedOptimizer, "
          "every rank holds all parameters and gradients; fully: amp::FullyShard, each rank its shards of all "
          "three. optimizer: amp::optimizer_state_bytes of the rank's own state; formula: s x P / N, s = 8 for "
          "AdamW, 2 + 8/256 for AdamW8bit; a shard under 4096 elements keeps fp32 states, as the head's at N >= "
          "2. fully sharded, the peak of whole parameters on rank 0: %lld bytes, bf16: the root's head and one "
          "unit)\n",
          static_cast<long long>(std::max(peak, peak8)));
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
