// amp/checkpoint.h: the training checkpoint archive and its atomic write.
//
//   amp::detail::write_checkpoint(path, header, module, optimizer, scaler);   // atomic
//   auto archive = amp::detail::open_checkpoint(path, device, "bf16-mixed"); // checks format and precision
//   amp::CheckpointCounters c = amp::detail::apply_checkpoint(archive, module, optimizer, scaler);
//
// Layout (a torch::serialize archive): "amp/format" (int), "amp/precision"
// (the policy's name), "amp/step", "amp/epoch", "amp/batch_in_epoch" (ints),
// and the sub-archives "model", "optimizer" (LibTorch's own formats) and
// "scaler" (the scaler's state_dict entries, torch's keys). Trainer::save and
// Trainer::load use these; load() rolls back on any failure.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <string>

#include "amp/detail/atomic_file.h"
#include "amp/scaler/detail/state_dict.h"

namespace amp {

// The counters a checkpoint carries besides model, optimizer and scaler.
struct CheckpointCounters {
  int64_t step = 0;            // optimizer steps done
  int64_t epoch = 0;           // fit()'s current epoch
  int64_t batch_in_epoch = 0;  // batches of that epoch already trained on
};

namespace detail {

inline constexpr int64_t kCheckpointFormat = 1;

template <class Scaler>
torch::serialize::OutputArchive checkpoint_archive(const std::string& precision, const CheckpointCounters& counters,
                                                   const torch::nn::Module& module,
                                                   const torch::optim::Optimizer& optimizer, const Scaler& scaler) {
  torch::serialize::OutputArchive archive;
  archive.write("amp/format", c10::IValue(kCheckpointFormat));
  archive.write("amp/precision", c10::IValue(precision));
  archive.write("amp/step", c10::IValue(counters.step));
  archive.write("amp/epoch", c10::IValue(counters.epoch));
  archive.write("amp/batch_in_epoch", c10::IValue(counters.batch_in_epoch));
  torch::serialize::OutputArchive model, optim, scaler_archive;
  module.save(model);
  optimizer.save(optim);
  for (const auto& kv : scaler.state_dict()) scaler_archive.write(kv.key(), kv.value());
  archive.write("model", model);
  archive.write("optimizer", optim);
  archive.write("scaler", scaler_archive);
  return archive;
}

// Writes the checkpoint to `path` atomically (detail/atomic_file.h).
template <class Scaler>
void write_checkpoint(const std::string& path, const std::string& precision, const CheckpointCounters& counters,
                      const torch::nn::Module& module, const torch::optim::Optimizer& optimizer, const Scaler& scaler) {
  torch::serialize::OutputArchive archive = checkpoint_archive(precision, counters, module, optimizer, scaler);
  atomic_write(path, [&](const std::string& tmp) { archive.save_to(tmp); });
}

// Reads `path` and checks that amp wrote it, in this format, under `precision`.
inline torch::serialize::InputArchive open_checkpoint(const std::string& path, const c10::Device& device,
                                                      const std::string& precision) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path, device);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "amp: could not read checkpoint '", path,
                "' (missing, truncated or not a checkpoint written by amp::Trainer::save): ", e.what_without_backtrace());
  }
  c10::IValue format, name;
  TORCH_CHECK(archive.try_read("amp/format", format) && archive.try_read("amp/precision", name), "amp: '", path,
              "' is not a checkpoint written by amp::Trainer::save (no amp/format entry)");
  TORCH_CHECK(format.isInt() && format.toInt() == kCheckpointFormat, "amp: checkpoint '", path, "' has format ", format,
              ", this amp reads format ", kCheckpointFormat);
  TORCH_CHECK(name.isString() && name.toStringRef() == precision, "amp: checkpoint '", path,
              "' was saved under precision \"", name.isString() ? name.toStringRef() : std::string("?"),
              "\" but this Trainer's policy is \"", precision,
              "\"; load it into a Trainer of that policy (see amp::dispatch_precision), or start from the model "
              "weights alone with torch::load");
  return archive;
}

// Loads model, optimizer and scaler from `archive`; returns its counters.
// Throws on a mismatch, possibly after loading part of it: callers roll back.
template <class Scaler>
CheckpointCounters apply_checkpoint(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer, Scaler& scaler) {
  torch::serialize::InputArchive model, optim, scaler_archive;
  archive.read("model", model);
  archive.read("optimizer", optim);
  archive.read("scaler", scaler_archive);
  c10::IValue step, epoch, batch;
  archive.read("amp/step", step);
  archive.read("amp/epoch", epoch);
  archive.read("amp/batch_in_epoch", batch);
  StateDict state = empty_state_dict();
  for (const auto& key : scaler_archive.keys()) {
    c10::IValue v;
    scaler_archive.read(key, v);
    state.insert(key, v);
  }
  module.load(model);
  // LibTorch's optimizer.load() keeps entries the archive lacks (a parameter
  // that had no state when saved would keep the state it has now): start empty.
  optimizer.state().clear();
  optimizer.load(optim);
  scaler.load_state_dict(state);
  return CheckpointCounters{step.toInt(), epoch.toInt(), batch.toInt()};
}

}  // namespace detail
}  // namespace amp
