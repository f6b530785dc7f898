// amp/train/rng_state.h: the process's random generators in a checkpoint
// (Hugging Face's Trainer does the same), so that a resumed run draws the same
// dropout masks and random batches as the uninterrupted one.
//
//   amp::detail::RngStates s = amp::detail::capture_rng();   // CPU + every CUDA device
//   amp::detail::write_rng(archive, s, "amp/rng/");
//   if (auto r = amp::detail::read_rng(archive, "amp/rng/")) amp::detail::restore_rng(*r);
//
// Keys under the prefix: "cpu" (the default CPU generator's state, uint8),
// "cuda_count" (int) and "cuda<i>" (device i's). A checkpoint without them
// (written before amp 0.2, or with the entry turned off) restores nothing.
#pragma once

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace amp::detail {

struct RngStates {
  at::Tensor cpu;                // the default CPU generator's state
  std::vector<at::Tensor> cuda;  // each CUDA device's default generator state, by index
};

inline at::Generator cuda_generator(int64_t i) {
  return at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
}

inline int64_t cuda_generators() { return at::hasCUDA() ? static_cast<int64_t>(at::getNumGPUs()) : 0; }

inline at::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

inline at::Tensor cpu_rng_state() { return state_of(at::detail::getDefaultCPUGenerator()); }

inline void set_state_of(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

inline RngStates capture_rng() {
  RngStates s;
  s.cpu = cpu_rng_state();
  for (int64_t i = 0; i < cuda_generators(); ++i) s.cuda.push_back(state_of(cuda_generator(i)));
  return s;
}

inline void write_rng(torch::serialize::OutputArchive& archive, const RngStates& s, const std::string& prefix) {
  archive.write(prefix + "cpu", s.cpu, /*is_buffer=*/true);
  archive.write(prefix + "cuda_count", c10::IValue(static_cast<int64_t>(s.cuda.size())));
  for (size_t i = 0; i < s.cuda.size(); ++i) archive.write(prefix + "cuda" + std::to_string(i), s.cuda[i], true);
}

// The states under `prefix`, checked against this process's generators (a
// uint8 tensor of the size each one's state has); nullopt when the archive
// has none. Throws an amp: error on a malformed entry, before anything changes.
inline std::optional<RngStates> read_rng(torch::serialize::InputArchive& archive, const std::string& prefix) {
  RngStates s;
  if (!archive.try_read(prefix + "cpu", s.cpu, /*is_buffer=*/true)) return std::nullopt;
  auto check = [&](at::Tensor& t, const at::Tensor& now, const std::string& key) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kByte && t.dim() == 1 && t.numel() == now.numel(), "amp: the ",
                "checkpoint's random-generator entry '", key, "' is not a generator state of this LibTorch (",
                now.numel(), " bytes expected); to load the rest, turn the entry off (TrainerOptions or ",
                "FabricOptions: .rng_state(false)) and keep this process's generators");
    t = t.to(at::kCPU).contiguous();
  };
  check(s.cpu, cpu_rng_state(), prefix + "cpu");
  c10::IValue count;
  TORCH_CHECK(archive.try_read(prefix + "cuda_count", count) && count.isInt() && count.toInt() >= 0,
              "amp: the checkpoint's random-generator entry '", prefix, "cuda_count' is missing or not a count");
  // A checkpoint from a machine with another number of GPUs: the devices both have.
  const int64_t n = std::min(count.toInt(), cuda_generators());
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor t;
    const std::string key = prefix + "cuda" + std::to_string(i);
    TORCH_CHECK(archive.try_read(key, t, true), "amp: the checkpoint's random-generator entry '", key, "' is missing");
    check(t, state_of(cuda_generator(i)), key);
    s.cuda.push_back(t);
  }
  return s;
}

inline void restore_rng(const RngStates& s) {
  set_state_of(at::detail::getDefaultCPUGenerator(), s.cpu);
  for (size_t i = 0; i < s.cuda.size(); ++i) set_state_of(cuda_generator(static_cast<int64_t>(i)), s.cuda[i]);
}

}  // namespace amp::detail
