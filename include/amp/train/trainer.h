// amp/train/trainer.h: Trainer<Policy, Device>: an existing model and optimizer,
// trained under a precision policy.
//
//   amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer);
//   auto r = trainer.step([&](auto& region) { return torch::mse_loss(model(x), y); });
//   trainer.save("ckpt.pt");                  // atomic; load() refuses another policy's checkpoint
//
// step(fn) runs fn(region) under the policy's Region (autocast for Mixed),
// then the Stepper: scaled backward, unscale, optional clipping, step or skip
// on inf/NaN, scaler update (torch's AMP recipe). True<> policies convert the
// model to their dtype at construction; Mixed<> policies require fp32
// parameters, as torch.autocast does.
#pragma once

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/checked_archive.h"
#include "amp/train/checkpoint.h"
#include "amp/train/detail/checkpoint_extras.h"
#include "amp/train/detail/evaluation.h"
#include "amp/train/detail/fp16_pitfalls.h"
#include "amp/train/detail/model_setup.h"
#include "amp/train/detail/progress.h"
#include "amp/train/cross_process.h"
#include "amp/train/rng_state.h"
#include "amp/train/history.h"
#include "amp/core/device.h"
#include "amp/core/policy.h"
#include "amp/precision/region.h"
#include "amp/scaler/dynamic_scaler.h"  // the built-in scalers a policy may name
#include "amp/scaler/no_scaler.h"
#include "amp/scaler/static_scaler.h"
#include "amp/train/stepper.h"
#include "amp/train/trainer_options.h"
#include "amp/train/user_state.h"
#include "amp/core/rules.h"
#include "amp/float8/policy.h"

namespace amp {

namespace detail {

// trainer.capture() is amp::capture(trainer, ...), which amp/capture/captured_step.h
// defines (and marks here), so a Trainer user who never captures does not compile it.
template <class TrainerT, class = void>
struct StepCapturer {
  static_assert(sizeof(TrainerT) == 0,
                "amp: trainer.capture() needs the capture code: #include <amp/capture/captured_step.h> (or "
                "<amp/amp.h>)");
};

}  // namespace detail

template <class Policy, class Device>
class Trainer {
  static_assert(detail::check_supported<Policy, Device>());

 public:
  using policy = Policy;
  using device = Device;
  using traits = policy_traits<Policy>;
  using scaler_type = typename traits::scaler_type;
  using region_type = Region<Policy, Device>;
  static constexpr const char* precision_name = traits::name;  // "bf16-mixed", as precision_name<P>()

  // `model`: a ModuleHolder (torch::nn::Linear, a TORCH_MODULE), a
  // std::shared_ptr<Module>, or a non-const Module& (LibTorch's `Net model;`),
  // which is shared if a shared_ptr owns it and otherwise held without
  // ownership: it must outlive the Trainer. `optimizer` must outlive the Trainer.
  template <class Model>
  Trainer(Model&& model, torch::optim::Optimizer& optimizer, TrainerOptions options = {},
          scaler_type scaler = scaler_type())
      : module_(detail::as_module(std::forward<Model>(model))),
        options_(std::move(options)),
        stepper_(setup(optimizer), options_.step(), std::move(scaler)),
        closure_optimizer_(detail::closure_based(optimizer)) {
    float8_.track(*module_);
    if (!options_.region().precision_map().empty()) {  // resolved once, against the model set up
      detail::check_precision_map<Policy, Device>(options_.region());
      precision_table_ = options_.region().precision_map().resolve({{"", module_.get()}});
    }
    detail::warn_if_slow_fp16<Policy, Device>("Trainer");
  }

  // One optimizer step (or one micro-batch of it, with accumulation):
  // fn(region) runs the forward under the policy and returns the loss.
  template <class F>
  StepResult step(F&& fn) {
    if (closure_optimizer_) {
      if constexpr (traits::uses_loss_scaling) {
        TORCH_CHECK(false, "amp: internal error: a loss-scaling Trainer with LBFGS passed setup()");
      } else {
        return report(after_step(stepper_.closure_step([&] { return forward(fn); })));
      }
    }
    at::Tensor loss = forward(fn);
    return report(after_step(stepper_.step(loss)));
  }

  // fn(region) for evaluation: under the policy's region, without autograd,
  // the model in eval mode (each submodule's own mode back afterwards).
  // Returns what fn returns:  auto acc = trainer.evaluate([&](auto&) { return accuracy(model, x, y); });
  template <class F>
  decltype(auto) evaluate(F&& fn) {
    [[maybe_unused]] auto float8 = float8_.bind();
    return detail::evaluate<region_type>({module_.get()}, options_.region(), precision_table_, fn);
  }

  // Epochs over `loader` (a LibTorch DataLoader or any range of batches):
  // fn(region, batch) returns the loss. Returns the per-step metrics.
  // The step's loss, scale and skip flag stay on the device and are read in
  // one batch every FitOptions::log_every steps (and at the end): one host
  // sync per log_every steps, not per step; History still has every step.
  template <class Loader, class F>
  History fit(Loader&& loader, F&& fn, FitOptions fo = FitOptions()) {
    TORCH_CHECK(fo.max_epochs() >= 0, "amp: FitOptions::max_epochs must be >= 0, got ", fo.max_epochs());
    TORCH_CHECK(fo.log_every() >= 1, "amp: FitOptions::log_every must be >= 1, got ", fo.log_every());
    TORCH_CHECK(
        fo.checkpoint_every() == 0 || !fo.checkpoint_path().empty(),
        "amp: FitOptions::checkpoint_every is set but checkpoint_path is empty; set .checkpoint_path(\"ckpt.pt\")");
    auto&& range = detail::as_range(loader);
    struct InFit {  // step() leaves the progress to fit()
      bool& flag;
      ~InFit() { flag = false; }
    } in_fit{in_fit_ = true};
    History history;
    detail::Progress bar(options_.progress(), fo.max_steps(), precision_name, fo.log_every());
    bar.note(std::string("optimizer path: ") + optimizer_path());
    if constexpr (detail::is_float8_v<Policy>)
      bar.note(
          float8::detail::describe(float8::coverage<detail::float8_recipe_t<Policy>>(*module_, precision_table_.get()),
                                   float8::detail::kLinearBlock<detail::float8_recipe_t<Policy>>));
    detail::PendingMetrics pending;
    auto flush = [&] { pending.flush(history, bar); };
    bool stop = fo.max_steps() >= 0 && steps() >= fo.max_steps();
    if (stop || epoch_ >= fo.max_epochs()) {
      TORCH_WARN("amp: fit() has nothing to do: the trainer has done ", epoch_, " epoch(s) and ", steps(),
                 " step(s), and FitOptions has max_epochs ", fo.max_epochs(), ", max_steps ", fo.max_steps(),
                 " (both count in total, across fit() calls and resumes); raise them to train more");
    }
    while (!stop && epoch_ < fo.max_epochs()) {
      int64_t batch_index = 0;
      // The CPU generator as the epoch began (a shuffling sampler draws its
      // order from it when the loop starts). After a mid-epoch load(): that
      // state while the loader starts and skips, the checkpoint's after
      // (whatever drew from the generator between load() and fit()).
      at::Tensor resume_rng;
      if (options_.rng_state()) {
        if (batch_in_epoch_ > 0 && epoch_start_rng_.defined() && resume_rng_.defined()) {
          resume_rng = std::exchange(resume_rng_, {});
          detail::set_state_of(at::detail::getDefaultCPUGenerator(), epoch_start_rng_);
        } else {
          epoch_start_rng_ = detail::cpu_rng_state();
        }
      }
      auto start = std::chrono::steady_clock::now();
      for (auto&& batch : range) {
        // After a mid-epoch load(): skip the batches that were already trained on.
        if (batch_index++ < batch_in_epoch_) continue;
        if (resume_rng.defined())
          detail::set_state_of(at::detail::getDefaultCPUGenerator(), std::exchange(resume_rng, {}));
        StepResult r = step([&](region_type& region) { return fn(region, batch); });
        ++batch_in_epoch_;
        if (!r.optimizer_step) continue;
        StepMetrics m;
        m.step = steps();
        m.epoch = epoch_;
        auto now = std::chrono::steady_clock::now();
        m.seconds = std::chrono::duration<double>(now - start).count();
        start = now;
        pending.add(m, r, scale_tensor());
        if (static_cast<int64_t>(pending.size()) >= fo.log_every()) flush();
        if (fo.checkpoint_every() > 0 && steps() % fo.checkpoint_every() == 0) save(fo.checkpoint_path());
        if (fo.max_steps() >= 0 && steps() >= fo.max_steps()) {
          stop = true;
          break;
        }
      }
      if (!stop) {
        ++epoch_;
        batch_in_epoch_ = 0;
        epoch_start_rng_ = at::Tensor();
      }
    }
    flush();
    bar.finish();
    return history;
  }

  // Writes model, optimizer, scaler state, counters and the precision name to
  // `path` atomically: a temporary file in the same directory, fsync, rename.
  // A crash at any point leaves either the old or the new file, never a torn one.
  void save(const std::string& path) const {
    TORCH_CHECK(stepper_.micro_step() == 0,
                "amp: save() was called in the middle of gradient accumulation (micro-batch ", stepper_.micro_step(),
                " of ", stepper_.options().accumulation_steps(),
                "); call it after the step that completes the accumulation");
    detail::check_not_sharded(stepper_.gradient_sync(), "Trainer::save",
                              "save on every rank with amp::save_fully_sharded(trainer, path) and load with "
                              "amp::load_fully_sharded (amp/distributed/fully_shard_checkpoint.h)");
    torch::serialize::OutputArchive archive = state_archive();
    detail::atomic_write(path, [&](const std::string& tmp) { archive.save_to(tmp); });
  }

  // Restores a checkpoint written by save(). Refuses one saved under another
  // policy, and a truncated or corrupt file; on any failure the trainer
  // (model, optimizer, scaler, counters) is left exactly as it was.
  void load(const std::string& path) {
    torch::serialize::InputArchive archive = detail::open_checkpoint(path, parameter_device(), precision_name);
    apply_or_roll_back(archive, "checkpoint '" + path + "'");
  }

  // amp::capture(*this, fn, example): the whole training step recorded once
  // in a CUDA graph and replayed per batch (amp/capture/captured_step.h).
  //   auto step = trainer.capture(fn, example);  amp::StepResult r = step(batch);
  template <class F, class Batch, class Self = Trainer>
  auto capture(F&& fn, const Batch& example) {
    return detail::StepCapturer<Self>::make(*this, std::forward<F>(fn), example);
  }

  // The whole training state (model, optimizer, scaler, counters) written to
  // a stream, and read back: an in-memory checkpoint in save()'s format.
  // load_state() replaces the model's and optimizer's tensors; on failure,
  // as load(), nothing changes.
  void save_state(std::ostream& out) const {
    detail::check_not_sharded(stepper_.gradient_sync(), "Trainer::save",
                              "save on every rank with amp::save_fully_sharded(trainer, path) and load with "
                              "amp::load_fully_sharded (amp/distributed/fully_shard_checkpoint.h)");
    state_archive().save_to(out);
  }
  void load_state(std::istream& in) {
    torch::serialize::InputArchive archive =
        detail::read_archive(in, parameter_device(), "the state", "an archive written by amp::Trainer::save_state");
    apply_or_roll_back(archive, "the state");
  }
  // Where the model's parameters are.
  c10::Device parameter_device() const { return module_->parameters().front().device(); }

  // The user's own checkpoint entries (amp/train/user_state.h): an LR
  // scheduler (stepped after each optimizer step), tensors, integers.
  UserState& user_state() { return user_state_; }
  torch::nn::Module& module() { return *module_; }
  std::shared_ptr<torch::nn::Module> module_ptr() const { return module_; }
  scaler_type& scaler() { return stepper_.scaler(); }
  const scaler_type& scaler() const { return stepper_.scaler(); }
  torch::optim::Optimizer& optimizer() { return stepper_.optimizer(); }
  const TrainerOptions& options() const { return options_; }
  // The step recipe after the forward (e.g. to install a GradientSync).
  Stepper<scaler_type>& stepper() { return stepper_; }
  const Stepper<scaler_type>& stepper() const { return stepper_; }
  int64_t steps() const { return stepper_.steps(); }
  // Whether steps take the fused, sync-free optimizer path, and the path in words
  // (StepOptions().fused(false) turns it off).
  bool fused() const { return stepper_.fused(); }
  std::string optimizer_path() const { return stepper_.optimizer_path(); }
  int64_t epoch() const { return epoch_; }
  // A Float8 policy's recipe state (float8::detail::TrainingState: Delayed's scales and histories).
  const float8::detail::TrainingState<detail::float8_recipe_t<Policy>>& float8_state() const { return float8_; }

 private:
  // step()'s two halves: the loss of fn(region) under the policy's region
  // (and a Float8 recipe's scales), and what follows the Stepper's step (a
  // Float8 recipe's update: delayed scaling's new scales and history roll).
  template <class F>
  at::Tensor forward(F& fn) {
    static_assert(std::is_invocable_v<F&, region_type&>,
                  "amp: the step function must take the region: [&](auto& region) { return loss; }");
    [[maybe_unused]] auto float8 = float8_.bind();
    return detail::forward<region_type>(options_.region(), precision_table_, fn);
  }

  StepResult after_step(StepResult r) {
    if (!r.optimizer_step) return r;
    float8_.update(detail::reduce_max_with(stepper_.gradient_sync()));
    user_state_.step_schedulers();
    return r;
  }

  // The scale as a tensor without a sync where the scaler has one (torch's
  // _get_scale_async); else its get_scale() (a user-defined scaler).
  at::Tensor scale_tensor() const {
    if constexpr (scaler_capabilities<scaler_type>::scale_async) {
      const at::Tensor t = stepper_.scaler().get_scale_async();
      if (t.defined()) return t;
    }
    return at::full({}, stepper_.scaler().get_scale(), at::kDouble);
  }

  detail::CheckpointCounters counters() const { return detail::CheckpointCounters{steps(), epoch_, batch_in_epoch_}; }

  // A step loop's progress: fit()'s line, every progress_every optimizer
  // steps. None with a fixed state (Stepper::make_static), whose step may be
  // under a CUDA graph's recording, where nothing may be read on the host.
  StepResult report(StepResult r) {
    if (in_fit_ || !options_.progress() || !r.optimizer_step || stepper_.is_static()) return r;
    if (!loop_bar_) {
      TORCH_CHECK(options_.progress_every() >= 1, "amp: TrainerOptions::progress_every must be >= 1, got ",
                  options_.progress_every());
      loop_bar_ = std::make_unique<detail::Progress>(true, -1, precision_name, options_.progress_every());
      loop_bar_->note(std::string("optimizer path: ") + optimizer_path());
    }
    StepMetrics m;
    m.step = steps();
    m.epoch = epoch_;
    loop_pending_.add(m, r, scale_tensor());
    if (static_cast<int64_t>(loop_pending_.size()) >= options_.progress_every()) {
      History lines;  // not kept: a step loop keeps its own records
      loop_pending_.flush(lines, *loop_bar_);
    }
    return r;
  }

  // The checkpoint: model, optimizer, scaler, counters and a Float8 recipe's state.
  torch::serialize::OutputArchive state_archive() const {
    stepper_.sync_optimizer_state();  // the fused path's device step counters, into optimizer.state()
    torch::serialize::OutputArchive archive =
        detail::checkpoint_archive(precision_name, counters(), *module_, stepper_.optimizer(), stepper_.scaler());
    detail::write_extras(archive, float8_, user_state_, stepper_.gradient_sync(), options_.rng_state());
    if (options_.rng_state() && batch_in_epoch_ > 0 && epoch_start_rng_.defined())
      archive.write("amp/rng/epoch_start_cpu", epoch_start_rng_, /*is_buffer=*/true);
    return archive;
  }

  void apply_or_roll_back(torch::serialize::InputArchive& archive, const std::string& what) {
    detail::apply_or_roll_back(
        archive, parameter_device(), [this](std::ostream& out) { save_state(out); },
        [this](torch::serialize::InputArchive& a) { apply(a); }, what, "this model/optimizer");
  }

  void apply(torch::serialize::InputArchive& archive) {
    struct Reload {  // whatever happens, the fused path rereads the optimizer's state
      Stepper<scaler_type>& s;
      ~Reload() { s.reload_optimizer_state(); }
    } reload{stepper_};
    // The user's, the GradientSync's and the generators' entries checked before anything changes.
    const std::function<bool()> install_extras =
        detail::read_extras(archive, float8_, user_state_, stepper_.gradient_sync(), options_.rng_state());
    at::Tensor epoch_start;
    if (options_.rng_state() && archive.try_read("amp/rng/epoch_start_cpu", epoch_start, /*is_buffer=*/true)) {
      TORCH_CHECK(epoch_start.scalar_type() == at::kByte && epoch_start.numel() == detail::cpu_rng_state().numel(),
                  "amp: the checkpoint's random-generator entry 'amp/rng/epoch_start_cpu' is not a CPU generator "
                  "state of this LibTorch; turn the entry off (TrainerOptions().rng_state(false)) to load the rest");
      epoch_start = epoch_start.to(at::kCPU).contiguous();
    }
    const detail::CheckpointCounters c =
        detail::apply_checkpoint(archive, *module_, stepper_.optimizer(), stepper_.scaler());
    const bool restored_rng = install_extras();
    epoch_start_rng_ = epoch_start;
    resume_rng_ = epoch_start.defined() && restored_rng ? detail::cpu_rng_state() : at::Tensor();
    stepper_.set_steps(c.step);
    epoch_ = c.epoch;
    batch_in_epoch_ = c.batch_in_epoch;
  }

  // Checks the model and optimizer and, for True<D>, converts the model: before
  // the Stepper is made, so that it chooses its optimizer path (fused or not)
  // for the parameters' final dtype. Returns `opt`.
  torch::optim::Optimizer& setup(torch::optim::Optimizer& opt) {
    detail::check_optimizer<Policy>(opt);
    detail::check_accumulation(opt, options_.step().accumulation_steps());  // before the model changes
    detail::check_device<Policy, Device>("Trainer");
    detail::setup_model<Policy, Device>(*module_, "Trainer", "before constructing the Trainer");
    if constexpr (detail::is_float8_v<Policy>)
      float8::detail::check_device<detail::float8_recipe_t<Policy>>(parameter_device());
    return opt;
  }

  std::shared_ptr<torch::nn::Module> module_;
  TrainerOptions options_;
  PrecisionMap::Resolved precision_table_;  // the region's precision map, resolved
  Stepper<scaler_type> stepper_;
  bool closure_optimizer_;
  float8::detail::TrainingState<detail::float8_recipe_t<Policy>> float8_;  // a Float8 recipe's scales and histories
  UserState user_state_;
  int64_t epoch_ = 0;
  int64_t batch_in_epoch_ = 0;
  at::Tensor epoch_start_rng_;  // fit(): the CPU generator's state as this epoch began
  at::Tensor resume_rng_;       // after a mid-epoch load(): the checkpoint's, for fit() once it has skipped
  bool in_fit_ = false;
  std::unique_ptr<detail::Progress> loop_bar_;  // a step loop's progress (report())
  detail::PendingMetrics loop_pending_;
};

}  // namespace amp
