// Writes a GradScaler state_dict with torch::pickle_save, for
// tests/python/read_scaler_state.py (Python's side of the format).
//   write_scaler_state OUT.pt
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <fstream>
#include <iostream>
#include <limits>
#include <vector>

#include "amp/scaler/dynamic_scaler.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: write_scaler_state OUT.pt\n";
    return 2;
  }
  // A state that is not the defaults: scale 1024 backed off once to 512,
  // growth interval 7, tracker reset to 0 by the overflow.
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(1024.0).growth_factor(3.0).growth_interval(7));
  auto w = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
  scaler.scale((w * std::numeric_limits<float>::infinity()).sum()).backward();
  scaler.step(opt);
  scaler.update();
  const std::vector<char> bytes = torch::pickle_save(scaler.state_dict());
  std::ofstream(argv[1], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return 0;
}
