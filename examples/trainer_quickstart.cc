// examples/trainer_quickstart.cc: the shortest complete program with amp::Trainer.
#include <torch/torch.h>

#include <amp/amp.h>

#include <filesystem>
#include <iostream>

int main() {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(8, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer);

  auto x = torch::randn({256, 8});
  auto y = x.sum(1, /*keepdim=*/true);
  double loss = 0;
  for (int step = 0; step < 200; ++step)
    loss = trainer.step([&](auto& /*region*/) { return torch::mse_loss(model->forward(x), y); }).loss_value();
  // A temporary path, so that running the example leaves nothing behind.
  const auto path = (std::filesystem::temp_directory_path() / "amp_quickstart.pt").string();
  trainer.save(path);
  std::filesystem::remove(path);

  std::cout << "bf16-mixed: final loss " << loss << " (checkpoint written and removed: " << path << ")\n";
  return loss < 0.05 ? 0 : 1;
}
