// amp/train/checkpoint.h: the training checkpoint archive and its atomic write.
//
//   auto out = amp::detail::checkpoint_archive("bf16-mixed", counters, module, optimizer, scaler);
//   amp::detail::atomic_write(path, [&](const std::string& tmp) { out.save_to(tmp); });
//   auto archive = amp::detail::open_checkpoint(path, device, "bf16-mixed"); // checks format and precision
//   amp::detail::CheckpointCounters c = amp::detail::apply_checkpoint(archive, module, optimizer, scaler);
//
// Layout (a torch::serialize archive): "amp/format" (int), "amp/precision"
// (the policy's name), "amp/step", "amp/epoch", "amp/batch_in_epoch" (ints),
// "amp/lr" (each parameter group's learning rate, a double tensor),
// and the sub-archives "model", "optimizer" (LibTorch's own formats) and
// "scaler" (the scaler's state_dict entries, torch's keys); a Float8<Delayed>
// policy adds "float8" (amp/float8/policy.h), and the random generators'
// states are under "amp/rng/" (train/rng_state.h). Trainer::save and
// Trainer::load use these; load() rolls back on any failure. Several models
// and optimizers (Fabric::save) instead have "amp/models" and
// "amp/optimizers" (their counts) and "model_<i>", "optimizer_<i>", "amp/lr_<i>"
// in setup order. User entries (amp/train/user_state.h): "amp/user", "user/<name>".
// A multi-process sync adds its own (detail::CheckpointParticipant; DataParallel's
// bucket layout: "amp/data_parallel/", amp/distributed/detail/layout_checkpoint.h).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/atomic_file.h"
#include "amp/detail/checked_archive.h"
#include "amp/detail/compat.h"
#include "amp/scaler/state_dict.h"

namespace amp {
namespace detail {

// The counters a checkpoint carries besides model, optimizer and scaler.
struct CheckpointCounters {
  int64_t step = 0;            // optimizer steps done
  int64_t epoch = 0;           // fit()'s current epoch
  int64_t batch_in_epoch = 0;  // batches of that epoch already trained on
};

inline constexpr int64_t kCheckpointFormat = 1;

inline void write_header(torch::serialize::OutputArchive& archive, const std::string& precision,
                         const CheckpointCounters& counters) {
  archive.write("amp/format", c10::IValue(kCheckpointFormat));
  archive.write("amp/precision", c10::IValue(precision));
  archive.write("amp/step", c10::IValue(counters.step));
  archive.write("amp/epoch", c10::IValue(counters.epoch));
  archive.write("amp/batch_in_epoch", c10::IValue(counters.batch_in_epoch));
}

// Each parameter group's learning rate, under `key`: LibTorch 1.13's
// Optimizer::load() does not restore the groups' options (2.x does), so a
// scheduler's or a hand-set rate would be lost on resume.
inline void write_lrs(torch::serialize::OutputArchive& archive, const std::string& key,
                      const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  archive.write(key, torch::tensor(lrs, torch::kDouble), /*is_buffer=*/true);
}
inline void read_lrs(torch::serialize::InputArchive& archive, const std::string& key,
                     torch::optim::Optimizer& optimizer) {
  at::Tensor lrs;
  if (!archive.try_read(key, lrs, /*is_buffer=*/true)) return;  // a checkpoint from before amp wrote it
  auto& groups = optimizer.param_groups();
  TORCH_CHECK(lrs.dim() == 1 && lrs.numel() == static_cast<int64_t>(groups.size()), "amp: the checkpoint's '", key,
              "' has ", lrs.numel(), " learning rates for an optimizer of ", groups.size(), " parameter groups");
  TORCH_CHECK(lrs.scalar_type() == torch::kDouble, "amp: the checkpoint's '", key, "' is ", lrs.toString(),
              ", not Double: the checkpoint is damaged");
  const at::Tensor values = lrs.to(torch::kCPU).contiguous();
  for (size_t i = 0; i < groups.size(); ++i) {
    const double lr = values.data_ptr<double>()[i];
    TORCH_CHECK(std::isfinite(lr) && lr >= 0.0, "amp: the checkpoint's '", key, "' holds the learning rate ", lr,
                " for parameter group ", i, ": the checkpoint is damaged");
  }
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(values.data_ptr<double>()[i]);
}

template <class Scaler>
void write_scaler(torch::serialize::OutputArchive& archive, const Scaler& scaler) {
  torch::serialize::OutputArchive scaler_archive;
  for (const auto& kv : scaler.state_dict()) scaler_archive.write(kv.key(), kv.value());
  archive.write("scaler", scaler_archive);
}

template <class Scaler>
torch::serialize::OutputArchive checkpoint_archive(const std::string& precision, const CheckpointCounters& counters,
                                                   const torch::nn::Module& module,
                                                   const torch::optim::Optimizer& optimizer, const Scaler& scaler) {
  torch::serialize::OutputArchive archive;
  write_header(archive, precision, counters);
  torch::serialize::OutputArchive model, optim;
  module.save(model);
  optimizer.save(optim);
  archive.write("model", model);
  archive.write("optimizer", optim);
  write_lrs(archive, "amp/lr", optimizer);
  write_scaler(archive, scaler);
  return archive;
}

// Several models and optimizers, in the order given.
template <class Scaler>
torch::serialize::OutputArchive checkpoint_archive(const std::string& precision, const CheckpointCounters& counters,
                                                   const std::vector<const torch::nn::Module*>& modules,
                                                   const std::vector<const torch::optim::Optimizer*>& optimizers,
                                                   const Scaler& scaler) {
  torch::serialize::OutputArchive archive;
  write_header(archive, precision, counters);
  archive.write("amp/models", c10::IValue(static_cast<int64_t>(modules.size())));
  archive.write("amp/optimizers", c10::IValue(static_cast<int64_t>(optimizers.size())));
  for (size_t i = 0; i < modules.size(); ++i) {
    torch::serialize::OutputArchive model;
    modules[i]->save(model);
    archive.write("model_" + std::to_string(i), model);
  }
  for (size_t i = 0; i < optimizers.size(); ++i) {
    torch::serialize::OutputArchive optim;
    optimizers[i]->save(optim);
    archive.write("optimizer_" + std::to_string(i), optim);
    write_lrs(archive, "amp/lr_" + std::to_string(i), *optimizers[i]);
  }
  write_scaler(archive, scaler);
  return archive;
}

// open_checkpoint reads `path` and checks that amp wrote it, in this format,
// under `precision`; check_header checks an archive already read. `who`
// names the loader in errors ("Trainer").
inline void check_header(torch::serialize::InputArchive& archive, const std::string& path, const std::string& precision,
                         const char* who = "Trainer") {
  c10::IValue format, name;
  TORCH_CHECK(archive.try_read("amp/format", format) && archive.try_read("amp/precision", name), "amp: '", path,
              "' is not a checkpoint written by amp::", who, "::save (no amp/format entry)");
  TORCH_CHECK(format.isInt() && format.toInt() == kCheckpointFormat, "amp: checkpoint '", path, "' has format ", format,
              ", this amp reads format ", kCheckpointFormat);
  TORCH_CHECK(name.isString() && name.toStringRef() == precision, "amp: checkpoint '", path,
              "' was saved under precision \"", name.isString() ? name.toStringRef() : std::string("?"), "\" but this ",
              who, "'s policy is \"", precision, "\"; load it into a ", who,
              " of that policy (see amp::dispatch_precision), or start from the model "
              "weights alone with torch::load");
}
inline torch::serialize::InputArchive open_checkpoint(const std::string& path, const c10::Device& device,
                                                      const std::string& precision, const char* who = "Trainer") {
  torch::serialize::InputArchive archive =
      read_archive(path, device, std::string("a checkpoint written by amp::") + who + "::save");
  check_header(archive, path, precision, who);
  return archive;
}

// The scaler entries' values (torch.amp.GradScaler's keys and amp's
// extensions), where present: torch's load_state_dict takes any value, so a
// checkpoint with a NaN or negative scale would train on with it.
inline void check_scaler_state(const StateDict& state) {
  auto get = [&](const char* key, bool integer) -> std::optional<double> {
    if (!state.contains(key)) return std::nullopt;
    return integer ? static_cast<double>(state_int(state, key)) : state_double(state, key);
  };
  auto check = [](const char* key, double v, bool fits, const char* rule) {
    TORCH_CHECK(fits, "amp: the checkpoint's 'scaler/", key, "' is ", v, ", but it must be ", rule,
                ": the checkpoint is damaged");
  };
  if (auto v = get("scale", false)) check("scale", *v, std::isfinite(*v) && *v > 0.0, "finite and > 0");
  if (auto v = get("growth_factor", false)) check("growth_factor", *v, std::isfinite(*v) && *v > 1.0, "finite and > 1");
  if (auto v = get("backoff_factor", false)) check("backoff_factor", *v, *v > 0.0 && *v < 1.0, "in (0, 1)");
  const auto interval = get("growth_interval", true);
  if (interval) check("growth_interval", *interval, *interval >= 1.0, ">= 1");
  if (auto v = get("_growth_tracker", true))
    check("_growth_tracker", *v, *v >= 0.0 && (!interval || *v < *interval), "in [0, growth_interval)");
  if (auto v = get("min_scale", false)) check("min_scale", *v, std::isfinite(*v) && *v >= 0.0, "finite and >= 0");
  if (auto v = get("max_scale", false)) check("max_scale", *v, *v > 0.0, "> 0");
  if (auto v = get("hysteresis", true)) check("hysteresis", *v, *v >= 1.0, ">= 1");
  if (auto v = get("_hysteresis_tracker", true)) check("_hysteresis_tracker", *v, *v >= 0.0, ">= 0");
}

template <class Scaler>
CheckpointCounters apply_scaler_and_counters(torch::serialize::InputArchive& archive, Scaler& scaler) {
  torch::serialize::InputArchive scaler_archive;
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
  for (const auto& [key, v] : {std::pair<const char*, const c10::IValue&>{"amp/step", step},
                               {"amp/epoch", epoch},
                               {"amp/batch_in_epoch", batch}})
    TORCH_CHECK(v.isInt() && v.toInt() >= 0, "amp: the checkpoint's '", key, "' is ", v,
                ", not a count >= 0: the checkpoint is damaged");
  check_scaler_state(state);
  scaler.load_state_dict(state);
  return CheckpointCounters{step.toInt(), epoch.toInt(), batch.toInt()};
}

// Refuses a model entry of another shape or dtype, and a missing one, before
// anything changes: LibTorch's Module::load() set_()s a parameter to whatever
// tensor the archive holds, of any shape or dtype. `path` prefixes errors ("model/").
inline void check_module_fits(torch::serialize::InputArchive& archive, const torch::nn::Module& module,
                              const std::string& path) {
  auto check = [&](const std::string& key, const at::Tensor& mine, bool buffer) {
    if (!mine.defined()) return;
    at::Tensor saved;
    TORCH_CHECK(archive.try_read(key, saved, buffer), "amp: the checkpoint has no '", path, key,
                "' for this model: it was written for another model, or is damaged");
    TORCH_CHECK(saved.defined() && saved.sizes() == mine.sizes() && saved.scalar_type() == mine.scalar_type(),
                "amp: the checkpoint's '", path, key, "' is ", saved.defined() ? saved.toString() : "undefined",
                c10::str(saved.defined() ? saved.sizes() : at::IntArrayRef{}), " but this model's is ", mine.toString(),
                c10::str(mine.sizes()), ": it was written for another model, or is damaged");
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::InputArchive sub;
    TORCH_CHECK(archive.try_read(child.key(), sub), "amp: the checkpoint has no '", path, child.key(),
                "' for this model: it was written for another model, or is damaged");
    check_module_fits(sub, *child.value(), path + child.key() + "/");
  }
}

// The per-parameter state of LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop
// must have its parameter's shape, dtype and device and a step count >= 0
// (their load() takes any tensor). Other optimizers check their own (amp's
// low-bit ones do).
inline void check_optimizer_state(const torch::optim::Optimizer& optimizer) {
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const at::Tensor& p = groups[g].params()[i];
      const auto it = optimizer.state().find(compat::optim_state_key(p.unsafeGetTensorImpl()));
      if (it == optimizer.state().end()) continue;
      const torch::optim::OptimizerParamState* s = it->second.get();
      std::vector<std::pair<const char*, at::Tensor>> tensors;
      int64_t step = 0;
      if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
        tensors = {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}, {"max_exp_avg_sq", a->max_exp_avg_sq()}};
        step = a->step();
      } else if (const auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
        tensors = {{"exp_avg", w->exp_avg()}, {"exp_avg_sq", w->exp_avg_sq()}, {"max_exp_avg_sq", w->max_exp_avg_sq()}};
        step = w->step();
      } else if (const auto* m = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
        tensors = {{"momentum_buffer", m->momentum_buffer()}};
      } else if (const auto* ag = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
        tensors = {{"sum", ag->sum()}};
        step = ag->step();
      } else if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
        tensors = {
            {"square_avg", r->square_avg()}, {"momentum_buffer", r->momentum_buffer()}, {"grad_avg", r->grad_avg()}};
        step = r->step();
      }
      for (const auto& [name, t] : tensors)
        TORCH_CHECK(
            !t.defined() || (t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() && t.device() == p.device()),
            "amp: the checkpoint's optimizer state '", name, "' of parameter ", i, " of group ", g, " is ",
            t.toString(), c10::str(t.sizes()), " but the parameter is ", p.toString(), c10::str(p.sizes()),
            ": it was written for another model, or is damaged");
      TORCH_CHECK(step >= 0, "amp: the checkpoint's optimizer step count of parameter ", i, " of group ", g, " is ",
                  step, ": the checkpoint is damaged");
    }
}

inline void load_optimizer(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer) {
  // LibTorch's optimizer.load() keeps entries the archive lacks (a parameter
  // that had no state when saved would keep the state it has now): start empty.
  optimizer.state().clear();
  optimizer.load(archive);
  check_optimizer_state(optimizer);
}

// Loads model, optimizer and scaler from `archive`; returns its counters.
// Throws on a mismatch, possibly after loading part of it: callers roll back.
template <class Scaler>
CheckpointCounters apply_checkpoint(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer, Scaler& scaler) {
  torch::serialize::InputArchive model, optim;
  archive.read("model", model);
  archive.read("optimizer", optim);
  check_module_fits(model, module, "model/");
  module.load(model);
  load_optimizer(optim, optimizer);
  read_lrs(archive, "amp/lr", optimizer);
  return apply_scaler_and_counters(archive, scaler);
}

// The same for several models and optimizers; a checkpoint of another count
// (or a single-model one) is refused before anything is loaded.
template <class Scaler>
CheckpointCounters apply_checkpoint(torch::serialize::InputArchive& archive,
                                    const std::vector<torch::nn::Module*>& modules,
                                    const std::vector<torch::optim::Optimizer*>& optimizers, Scaler& scaler) {
  c10::IValue n_models, n_optimizers;
  TORCH_CHECK(archive.try_read("amp/models", n_models) && archive.try_read("amp/optimizers", n_optimizers),
              "amp: the checkpoint holds one model and optimizer (amp::Trainer::save); load it with amp::Trainer");
  TORCH_CHECK(n_models.toInt() == static_cast<int64_t>(modules.size()) &&
                  n_optimizers.toInt() == static_cast<int64_t>(optimizers.size()),
              "amp: the checkpoint holds ", n_models.toInt(), " models and ", n_optimizers.toInt(), " optimizers, but ",
              modules.size(), " models and ", optimizers.size(),
              " optimizers are set up; set up the same ones, in the same order, before load()");
  std::vector<torch::serialize::InputArchive> models(modules.size());
  for (size_t i = 0; i < modules.size(); ++i) {
    archive.read("model_" + std::to_string(i), models[i]);
    check_module_fits(models[i], *modules[i], "model_" + std::to_string(i) + "/");
  }
  for (size_t i = 0; i < modules.size(); ++i) modules[i]->load(models[i]);
  for (size_t i = 0; i < optimizers.size(); ++i) {
    torch::serialize::InputArchive optim;
    archive.read("optimizer_" + std::to_string(i), optim);
    load_optimizer(optim, *optimizers[i]);
    read_lrs(archive, "amp/lr_" + std::to_string(i), *optimizers[i]);
  }
  return apply_scaler_and_counters(archive, scaler);
}

// apply(archive), and on any failure the state from before it back:
// snapshot(out) writes that state, apply(previous) restores it. Then an amp:
// error: "<what> does not fit <fits> (left unchanged): <the cause>".
template <class Snapshot, class Apply>
void apply_or_roll_back(torch::serialize::InputArchive& archive, const c10::Device& device, Snapshot&& snapshot,
                        Apply&& apply, const std::string& what, const char* fits) {
  std::stringstream before;
  snapshot(before);
  std::string cause;
  try {
    apply(archive);
    return;
  } catch (const c10::Error& e) {
    cause = e.what_without_backtrace();
  } catch (const std::exception& e) {  // LibTorch 1.13 throws some as std::runtime_error
    cause = e.what();
  }
  before.seekg(0);
  torch::serialize::InputArchive previous;
  previous.load_from(before, device);
  apply(previous);
  TORCH_CHECK(false, "amp: ", what, " does not fit ", fits, " (left unchanged): ", cause);
}

}  // namespace detail
}  // namespace amp
