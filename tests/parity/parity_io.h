// tests/parity/parity_io.h: what the C++ halves of the parity pairs share
// with their Python twins: the model they both build and the file formats.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace amp_parity {

// A float's bits, as the twins' struct.pack("<f") reads them.
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The 64-128-128-10 MLP of the twins' make_mlp(): seed 0, then explicit randn
// weights (the modules' own init differs between C++ and Python).
inline torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  auto m = torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::ReLU(), torch::nn::Linear(128, 128),
                                 torch::nn::ReLU(), torch::nn::Linear(128, 10));
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.copy_(torch::randn(p.sizes()) * 0.05);
  return m;
}

// The transformer twins' init(): after manual_seed(0), in parameter order,
// LayerNorm weights ("ln...weight") 1 + 0.05 randn, everything else 0.05 randn.
inline void init(torch::nn::Module& m) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    const bool norm = p.key().find("ln") != std::string::npos && p.key().size() > 6 &&
                      p.key().compare(p.key().size() - 6, 6, "weight") == 0;
    p.value().copy_(torch::randn(p.value().sizes()) * 0.05 + (norm ? 1.0 : 0.0));
  }
}

// Tensors as a list that Python's torch.load reads.
inline void save(const std::string& path, const std::vector<torch::Tensor>& tensors) {
  c10::List<torch::Tensor> list;
  for (const auto& t : tensors) list.push_back(t.detach());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(list));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace amp_parity
