// Data-parallel training on CPU processes (amp/distributed.h, c10d over Gloo):
//
//   tools/launch -n 2 -- bazel-bin/examples/data_parallel     (or torchrun --nproc-per-node 2 ...)
//
// Each process trains the same model on its own shard of every batch; the
// gradients are averaged across processes in buckets during backward, so all
// processes keep identical weights. Rank 0 alone writes the checkpoint.
#include <amp/amp.h>
#include <amp/distributed.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

int main() {
  torch::set_num_threads(1);
  amp::ProcessGroup pg = amp::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  auto model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 1));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer,
                                                                       amp::TrainerOptions().progress(false));
  amp::DataParallel dp(pg, trainer);  // rank 0's initial weights on every rank

  torch::manual_seed(0);  // the same global data on every rank; each takes its shard
  const int64_t per_rank = 64;
  auto x = torch::randn({per_rank * dp.world_size(), 8}), y = x.sum(1, true);
  auto my_x = x.narrow(0, dp.rank() * per_rank, per_rank), my_y = y.narrow(0, dp.rank() * per_rank, per_rank);
  double first = 0, last = 0;
  for (int step = 0; step < 100; ++step) {
    auto r = trainer.step([&](auto& /*region*/) { return torch::mse_loss(model->forward(my_x), my_y); });
    (step == 0 ? first : last) = r.loss_value();
  }
  amp::save_on_rank0(pg, trainer, "data_parallel.pt");  // rank 0 writes; every rank waits until it is there
  trainer.load("data_parallel.pt");                     // and any rank (with any world size) can resume from it
  std::printf("rank %d of %d: loss %.4f -> %.4f, %lld all-reduces in %lld bucket(s)\n", dp.rank(), dp.world_size(),
              first, last, static_cast<long long>(dp.allreduces()), static_cast<long long>(dp.buckets()));
  return last < first ? 0 : 1;
}
