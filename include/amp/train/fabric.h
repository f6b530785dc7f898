// amp/train/fabric.h: Fabric<Policy, Device>, several models and optimizers
// under one policy and one scaler (Lightning Fabric's shape; a GAN's recipe).
//
//   amp::Fabric<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA> fabric;
//   fabric.setup(gen, opt_g);  fabric.setup(disc, opt_d);
//   opt_d.zero_grad(); fabric.backward(fabric.forward([&](auto&) { return d_loss(); })); fabric.optimizer_step(opt_d);
//   opt_g.zero_grad(); fabric.backward(fabric.forward([&](auto&) { return g_loss(); })); fabric.optimizer_step(opt_g);
//   fabric.update();                        // one scale update per iteration
//
// torch's AMP recipe for several optimizers (one GradScaler): each
// optimizer's gradients are unscaled once per iteration (clipped after, when
// its StepOptions say so); inf/NaN in one optimizer's gradients skips that
// optimizer only; update() backs the scale off once if any of them had
// inf/NaN. Each optimizer takes the fused, sync-free step where eligible
// (optim/optimizer_step.h, the part Stepper runs for one optimizer). setup()
// checks and converts models as Trainer does. save()/load() hold every model,
// optimizer, the scaler, the counters and the user's entries (user_state()),
// atomically.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/train/checkpoint.h"
#include "amp/train/detail/checkpoint_extras.h"
#include "amp/train/detail/evaluation.h"
#include "amp/train/detail/fp16_pitfalls.h"
#include "amp/train/detail/model_setup.h"
#include "amp/train/cross_process.h"
#include "amp/train/rng_state.h"
#include "amp/core/device.h"
#include "amp/optim/optimizer_step.h"
#include "amp/core/policy.h"
#include "amp/float8/policy.h"
#include "amp/precision/region.h"
#include "amp/scaler/dynamic_scaler.h"  // the built-in scalers a policy may name
#include "amp/scaler/no_scaler.h"
#include "amp/scaler/static_scaler.h"
#include "amp/train/stepper.h"
#include "amp/train/user_state.h"
#include "amp/precision/strict_casts.h"
#include "amp/core/rules.h"

namespace amp {

struct FabricOptions {
  // Each region forward() and evaluate() make: strict casts, linear routing,
  // the precision map (as TrainerOptions::region).
  TORCH_ARG(RegionOptions, region) = {};
  // Checkpoints carry the random generators' states and load() restores them
  // (TrainerOptions::rng_state). false: neither.
  TORCH_ARG(bool, rng_state) = true;
};

template <class Policy, class Device>
class Fabric {
  static_assert(detail::check_supported<Policy, Device>());

 public:
  using policy = Policy;
  using device = Device;
  using traits = policy_traits<Policy>;
  using scaler_type = typename traits::scaler_type;
  using region_type = Region<Policy, Device>;
  static constexpr const char* precision_name = traits::name;  // "bf16-mixed", as precision_name<P>()

  explicit Fabric(FabricOptions options = {}, scaler_type scaler = scaler_type())
      : options_(std::move(options)), scaler_(std::move(scaler)) {
    detail::check_device<Policy, Device>("Fabric");
    detail::warn_if_slow_fp16<Policy, Device>("Fabric");
  }
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  // A model (a ModuleHolder, a std::shared_ptr<Module>, or a non-const
  // Module& that outlives the Fabric, as Trainer takes it): checked against
  // the policy, converted for True<D>. Setting a model up again is a no-op.
  template <class Model>
  void setup(Model&& model) {
    add_model(detail::as_module(std::forward<Model>(model)));
  }

  // A model and an optimizer over parameters of models set up (this one
  // included). The optimizer must outlive the Fabric.
  template <class Model>
  void setup(Model&& model, torch::optim::Optimizer& optimizer, StepOptions options = {}) {
    std::shared_ptr<torch::nn::Module> module = detail::as_module(std::forward<Model>(model));
    // Every check before anything changes.
    for (size_t k = 0; k < parts_.size(); ++k)
      TORCH_CHECK(&parts_[k]->optimizer() != &optimizer, "amp: setup(): this optimizer was already set up (optimizer ",
                  k, "); set up each optimizer once");
    TORCH_CHECK(!detail::closure_based(optimizer),
                "amp: Fabric steps each optimizer with step(), but a "
                "closure-based optimizer (LBFGS) re-evaluates the loss inside its step; train it with amp::Trainer");
    detail::validate(options);
    TORCH_CHECK(options.accumulation_steps() == 1,
                "amp: Fabric steps an optimizer at each fabric.optimizer_step(opt), so StepOptions::accumulation_steps "
                "must be 1 in setup(), got ",
                options.accumulation_steps(),
                "; accumulate by running several backward() calls before fabric.optimizer_step(opt)");
    detail::check_optimizer<Policy>(optimizer);
    check_owned(optimizer, *module);
    add_model(module);  // before the optimizer's path is chosen: True<D> converts the parameters
    parts_.push_back(std::make_unique<detail::OptimizerStep<scaler_type>>(
        optimizer, options.fused(), options.max_grad_norm(), options.norm_type()));
    backward_.push_back(false);
    stepped_.push_back(false);
  }

  // fn(region) under the policy's region (autocast for Mixed); returns fn's value.
  template <class F>
  decltype(auto) forward(F&& fn) {
    static_assert(std::is_invocable_v<F&, region_type&>,
                  "amp: the forward function must take the region: [&](auto& region) { return loss; }");
    [[maybe_unused]] auto float8 = float8_.bind();
    return detail::forward<region_type>(options_.region(), precision_table(), fn);
  }

  // The scaled loss's backward (scaler.scale(loss).backward()); with a
  // GradientSync installed, gradients are averaged across processes after it.
  void backward(const at::Tensor& loss) {
    detail::check_loss(loss, "backward(): ", "the models' outputs");
    if (sync_ != nullptr) sync_->begin_backward(/*boundary=*/true);
    scaler_.scale(loss).backward();
    if (sync_ != nullptr) sync_->finish_backward();
    std::fill(backward_.begin(), backward_.end(), true);
  }

  // That optimizer's part of the iteration: unscale (and clip), then step, or
  // skip when its gradients hold inf/NaN. Once per optimizer per iteration,
  // after a backward().
  void optimizer_step(torch::optim::Optimizer& optimizer) {
    const size_t k = index_of(optimizer, "optimizer_step");
    TORCH_CHECK(!stepped_[k], "amp: optimizer_step(): optimizer ", k,
                " already stepped in this iteration; call fabric.update() before stepping it again");
    TORCH_CHECK(backward_[k], "amp: optimizer_step() without backward(): no backward() since optimizer ", k,
                "'s last step; call fabric.backward(loss) first");
    parts_[k]->run(scaler_);
    stepped_[k] = true;
    backward_[k] = false;
  }

  // Ends the iteration: one scale update from every optimizer stepped since
  // the last update() (backoff once if any saw inf/NaN), then each scheduler
  // in user_state() steps once. Returns the
  // iteration's combined found-inf flag (a 0-dim tensor, no host sync;
  // undefined without loss scaling).
  at::Tensor update() {
    TORCH_CHECK(std::find(stepped_.begin(), stepped_.end(), char{1}) != stepped_.end(),
                "amp: update() without an optimizer_step() since the last update(); call "
                "fabric.optimizer_step(optimizer) first");
    scaler_.update();
    float8_.update(detail::reduce_max_with(sync_));
    user_state_.step_schedulers();
    std::fill(stepped_.begin(), stepped_.end(), char{0});
    ++steps_;
    if constexpr (scaler_capabilities<scaler_type>::found_inf) return scaler_.found_inf();
    return at::Tensor();
  }

  // fn(region) for evaluation: under the policy's region, without autograd,
  // every model in eval mode (each submodule's own mode back afterwards).
  template <class F>
  decltype(auto) evaluate(F&& fn) {
    std::vector<torch::nn::Module*> modules;
    for (const auto& m : models_) modules.push_back(m.get());
    [[maybe_unused]] auto float8 = float8_.bind();
    return detail::evaluate<region_type>(modules, options_.region(), precision_table(), fn);
  }

  // Every model and optimizer (in setup order), the scaler, the counters and
  // user_state(), written atomically. Between iterations (not after an
  // optimizer_step() before its update()).
  void save(const std::string& path) const {
    check_between_iterations("save");
    detail::check_not_sharded(sync_, "Fabric::save",
                              "amp::save_fully_sharded saves a Trainer's (not yet a Fabric's): train "
                              "with an amp::Trainer to checkpoint");
    torch::serialize::OutputArchive archive = archive_now();
    detail::atomic_write(path, [&](const std::string& tmp) { archive.save_to(tmp); });
  }

  // save() into a stream: the same archive, for save_on_rank0's other ranks.
  void save_state(std::ostream& out) const {
    check_between_iterations("save");
    detail::check_not_sharded(sync_, "Fabric::save",
                              "amp::save_fully_sharded saves a Trainer's (not yet a Fabric's): train "
                              "with an amp::Trainer to checkpoint");
    archive_now().save_to(out);
  }

  // Restores a checkpoint written by save() with the same models and
  // optimizers set up in the same order. Refuses another policy's, another
  // count's, a truncated or corrupt one; on any failure nothing changes.
  void load(const std::string& path) {
    check_between_iterations("load");
    TORCH_CHECK(!models_.empty(), "amp: load(): no model is set up; call fabric.setup(model, optimizer) first");
    torch::serialize::InputArchive archive =
        detail::open_checkpoint(path, models_.front()->parameters().front().device(), precision_name, "Fabric");
    detail::apply_or_roll_back(
        archive, models_.front()->parameters().front().device(),
        [this](std::ostream& out) { archive_now().save_to(out); },
        [this](torch::serialize::InputArchive& a) { apply(a); }, "checkpoint '" + path + "'",
        "these models/optimizers");
  }

  // Every model's parameters and buffers (in setup order), named
  // "<model index>.<parameter name>": for DataParallel(pg, fabric.parameters(),
  // fabric.buffers(), options, fabric.parameter_names()) and set_gradient_sync.
  std::vector<at::Tensor> parameters() const { return collect(true).first; }
  std::vector<std::string> parameter_names() const { return collect(true).second; }
  std::vector<at::Tensor> buffers() const { return collect(false).first; }
  // Installs (nullptr removes) the hook of multi-process training around
  // backward() (amp/distributed.h's DataParallel); not owned.
  void set_gradient_sync(GradientSync* sync) {
    for (const auto& part : parts_)
      if (part->max_grad_norm() > 0.0)
        detail::check_not_sharded(sync, "an optimizer's max_grad_norm",
                                  "clip with fsdp.clip_grad_norm(max_norm) after backward and leave it at 0");
    if constexpr (detail::uses_loss_scaling_v<scaler_type>) detail::connect_found_inf(scaler_, sync);
    sync_ = sync;
  }
  GradientSync* gradient_sync() const { return sync_; }

  scaler_type& scaler() { return scaler_; }
  const scaler_type& scaler() const { return scaler_; }
  const FabricOptions& options() const { return options_; }
  // Training steps completed (update() calls), restored by load().
  int64_t steps() const { return steps_; }
  // The user's own checkpoint entries (amp/train/user_state.h): an LR
  // scheduler (stepped by update()), tensors, integers.
  UserState& user_state() { return user_state_; }
  size_t num_models() const { return models_.size(); }
  size_t num_optimizers() const { return parts_.size(); }
  // The i-th optimizer set up (setup order).
  const torch::optim::Optimizer& optimizer(size_t i) const { return parts_.at(i)->optimizer(); }
  // Whether this optimizer takes the fused, sync-free step, and its path in words.
  bool fused(const torch::optim::Optimizer& optimizer) const { return parts_[index_of(optimizer, "fused")]->fused(); }
  std::string optimizer_path(const torch::optim::Optimizer& optimizer) const {
    return parts_[index_of(optimizer, "optimizer_path")]->optimizer_path();
  }

 private:
  // The region's precision map resolved against the models set up, model i's
  // modules under "<i>." (as float8's names); once, again after setup() adds a model.
  const PrecisionMap::Resolved& precision_table() {
    const PrecisionMap& map = options_.region().precision_map();
    if (map.empty() || precision_table_ != nullptr) return precision_table_;
    detail::check_precision_map<Policy, Device>(options_.region());
    std::vector<std::pair<std::string, const torch::nn::Module*>> models;
    for (size_t i = 0; i < models_.size(); ++i) models.emplace_back(std::to_string(i) + ".", models_[i].get());
    precision_table_ = map.resolve(models);
    return precision_table_;
  }

  void add_model(const std::shared_ptr<torch::nn::Module>& module) {
    for (const auto& m : models_)
      if (m.get() == module.get()) return;
    detail::setup_model<Policy, Device>(*module, "Fabric", "before fabric.setup(model)");
    if constexpr (detail::is_float8_v<Policy>)
      float8::detail::check_device<detail::float8_recipe_t<Policy>>(module->parameters().front().device());
    float8_.track(*module, std::to_string(models_.size()) + ".");  // model i's linears: "<i>.<path>"
    models_.push_back(module);
    precision_table_ = nullptr;
  }

  // Every parameter of `optimizer` belongs to a model set up or to `incoming`.
  void check_owned(const torch::optim::Optimizer& optimizer, const torch::nn::Module& incoming) const {
    std::vector<const c10::TensorImpl*> owned;
    for (const auto& m : models_)
      for (const auto& p : m->parameters()) owned.push_back(p.unsafeGetTensorImpl());
    for (const auto& p : incoming.parameters()) owned.push_back(p.unsafeGetTensorImpl());
    const auto& groups = optimizer.param_groups();
    for (size_t g = 0; g < groups.size(); ++g)
      for (size_t i = 0; i < groups[g].params().size(); ++i)
        TORCH_CHECK(
            std::find(owned.begin(), owned.end(), groups[g].params()[i].unsafeGetTensorImpl()) != owned.end(),
            "amp: setup(): parameter ", i, " of param group ", g,
            " of this optimizer belongs to no model "
            "that was set up; set up its model first (fabric.setup(model)), or pass the model the optimizer trains");
  }

  size_t index_of(const torch::optim::Optimizer& optimizer, const char* what) const {
    for (size_t k = 0; k < parts_.size(); ++k)
      if (&parts_[k]->optimizer() == &optimizer) return k;
    TORCH_CHECK(false, "amp: ", what, "(): this optimizer was not set up; call fabric.setup(model, optimizer) first");
  }

  void check_between_iterations(const char* what) const {
    for (size_t k = 0; k < stepped_.size(); ++k)
      TORCH_CHECK(!stepped_[k], "amp: ", what, "() in the middle of an iteration: optimizer ", k,
                  " stepped and update() has not run; call ", what, "() after fabric.update()");
  }

  torch::serialize::OutputArchive archive_now() const {
    std::vector<const torch::nn::Module*> modules;
    std::vector<const torch::optim::Optimizer*> optimizers;
    for (const auto& m : models_) modules.push_back(m.get());
    for (const auto& part : parts_) {
      part->sync_optimizer_state();  // the fused path's device step counters, into optimizer.state()
      optimizers.push_back(&part->optimizer());
    }
    torch::serialize::OutputArchive archive = detail::checkpoint_archive(
        precision_name, detail::CheckpointCounters{steps_, 0, 0}, modules, optimizers, scaler_);
    detail::write_extras(archive, float8_, user_state_, sync_, options_.rng_state());
    return archive;
  }

  void apply(torch::serialize::InputArchive& archive) {
    struct Reload {  // whatever happens, the fused paths reread the optimizers' state
      std::vector<std::unique_ptr<detail::OptimizerStep<scaler_type>>>& parts;
      ~Reload() {
        for (auto& part : parts) part->reload_optimizer_state();
      }
    } reload{parts_};
    std::vector<torch::nn::Module*> modules;
    std::vector<torch::optim::Optimizer*> optimizers;
    for (const auto& m : models_) modules.push_back(m.get());
    for (const auto& part : parts_) optimizers.push_back(&part->optimizer());
    // The user's, the GradientSync's and the generators' entries checked before anything changes.
    const std::function<bool()> install_extras =
        detail::read_extras(archive, float8_, user_state_, sync_, options_.rng_state());
    steps_ = detail::apply_checkpoint(archive, modules, optimizers, scaler_).step;
    install_extras();
    std::fill(backward_.begin(), backward_.end(), false);
  }

  std::pair<std::vector<at::Tensor>, std::vector<std::string>> collect(bool params) const {
    std::pair<std::vector<at::Tensor>, std::vector<std::string>> out;
    for (size_t i = 0; i < models_.size(); ++i) {
      const auto named = params ? models_[i]->named_parameters(true) : models_[i]->named_buffers(true);
      for (const auto& kv : named) {
        out.first.push_back(kv.value());
        out.second.push_back(std::to_string(i) + "." + kv.key());
      }
    }
    return out;
  }

  FabricOptions options_;
  scaler_type scaler_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  PrecisionMap::Resolved precision_table_;  // precision_table()'s, reset by add_model()
  // Per optimizer, in setup order: its part of the recipe, whether a
  // backward() ran since its last step, whether it stepped since the last update().
  std::vector<std::unique_ptr<detail::OptimizerStep<scaler_type>>> parts_;
  // char, not bool: g++ 14 at -O2 warns (-Wstringop-overflow) on std::fill
  // of a std::vector<bool> inlined from update(), which breaks -Werror builds.
  std::vector<char> backward_;
  std::vector<char> stepped_;
  GradientSync* sync_ = nullptr;
  int64_t steps_ = 0;
  float8::detail::TrainingState<detail::float8_recipe_t<Policy>> float8_;  // a Float8 recipe's scales and histories
  UserState user_state_;
};

}  // namespace amp
