// amp/optim/low_bit_adam.h: Adam and AdamW with 8-bit, 4-bit or fp8
// optimizer states (torchao.optim's AdamW8bit, AdamW4bit, AdamWFp8), as
// torch::optim optimizers.
//
//   amp::AdamW8bit optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer);   // ~2 bytes/param of
//   state, not 8 amp::AdamW4bit small(model->parameters(), torch::optim::AdamWOptions(1e-3),
//   amp::LowBitOptions().block_size(128));
//
// The step is torchao's single_param_adam in eager mode, op for op
// (torchao/optim/adam.py; the quantization in optim/quantized_state.h), so
// parameters and states are bitwise those of the same algorithm in Python.
// Options are LibTorch's own AdamOptions/AdamWOptions (param groups,
// checkpoints with optimizer.save/load); LowBitOptions adds the block size
// and bf16 stochastic rounding. Tensors under 4096 elements, or whose size is
// not a multiple of the block size, keep plain states in the parameter's
// dtype (torchao's rule, after bitsandbytes). The step takes GradScaler's
// grad_scale/found_inf on the device (SupportsAmpScaling): under amp's
// Trainer, Stepper and Fabric a skipped step costs no host sync.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_fused_step.h"
#include "amp/optim/detail/lowbit_step_inputs.h"
#include "amp/optim/quantized_state.h"
#include "amp/optim/supports_amp_scaling.h"

namespace amp {

// What the low-bit optimizers add to LibTorch's AdamOptions/AdamWOptions.
struct LowBitOptions {
  // Elements per fp32 scale; 0: torchao's default (256 for 8-bit and fp8, 128 for 4-bit).
  TORCH_ARG(int64_t, block_size) = 0;
  // bf16 parameters get the fp32 update rounded stochastically (torchao's
  // bf16_stochastic_round): pure-bf16 training without fp32 master weights.
  // The random bits come from the default generator of the parameter's
  // device: the same seed gives the same bits.
  TORCH_ARG(bool, bf16_stochastic_round) = false;
  // CPU parameters with quantized states (fp32 or bf16, contiguous) take the
  // fused step: one pass per block, the same bits as the ATen ops. false:
  // every parameter takes the ATen ops one at a time (torchao's eager code).
  TORCH_ARG(bool, fused) = true;
};

namespace detail {
// One parameter's state: torchao's state["step"], "exp_avg", "exp_avg_sq"
// and (amsgrad) "max_exp_avg_sq".
struct LowBitAdamParamState : public torch::optim::OptimizerCloneableParamState<LowBitAdamParamState> {
  TORCH_ARG(at::Tensor, step);  // fp32, 0-dim, on the parameter's device: no host sync to count
  TORCH_ARG(QuantizedState, exp_avg);
  TORCH_ARG(QuantizedState, exp_avg_sq);
  TORCH_ARG(QuantizedState, max_exp_avg_sq);  // amsgrad only

 public:
  // Bytes of the state's tensors (step counter included).
  int64_t nbytes() const {
    return (step_.defined() ? step_.numel() * step_.element_size() : 0) + exp_avg_.nbytes() + exp_avg_sq_.nbytes() +
           max_exp_avg_sq_.nbytes();
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("step", step_);
    exp_avg_.write(archive, "exp_avg");
    exp_avg_sq_.write(archive, "exp_avg_sq");
    if (max_exp_avg_sq_.defined()) max_exp_avg_sq_.write(archive, "max_exp_avg_sq");
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    TORCH_CHECK(archive.try_read("step", step_) && step_.defined() && step_.numel() == 1,
                "amp: the optimizer state in the checkpoint has no tensor \"step\" (not a low-bit Adam state)");
    exp_avg_ = QuantizedState::read(archive, "exp_avg", /*is_signed=*/true);
    exp_avg_sq_ = QuantizedState::read(archive, "exp_avg_sq", /*is_signed=*/false);
    max_exp_avg_sq_ = QuantizedState::read(archive, "max_exp_avg_sq", /*is_signed=*/false);
    TORCH_CHECK(exp_avg_.defined() && exp_avg_sq_.defined(),
                "amp: the optimizer state in the checkpoint lacks exp_avg or exp_avg_sq");
  }
};

// The class behind the six aliases below (name one of them).
template <StateFormat Format, bool IsAdamW>
class LowBitAdam : public torch::optim::Optimizer, public SupportsAmpScaling {
  static_assert(Format != StateFormat::kFloat, "amp: LowBitAdam needs a quantized format; use torch::optim::AdamW");
  static_assert(Format != StateFormat::kFp8 || detail::compat::kHasFloat8Dtype,
                "amp: fp8 optimizer states need LibTorch 2.1 or newer (float8_e4m3fn); use amp::AdamW8bit (the same "
                "bytes per parameter)");

 public:
  using Options = std::conditional_t<IsAdamW, torch::optim::AdamWOptions, torch::optim::AdamOptions>;
  static constexpr StateFormat kFormat = Format;
  // torchao's default block sizes (adam.py).
  static constexpr int64_t kDefaultBlockSize = Format == StateFormat::kInt4 ? 128 : 256;
  // Smaller tensors keep plain states (torchao's _new_buffer, after bitsandbytes).
  static constexpr int64_t kMinQuantizedNumel = 4096;

  explicit LowBitAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups, Options defaults = {},
                      LowBitOptions low_bit = {})
      : torch::optim::Optimizer(std::move(param_groups), std::make_unique<Options>(defaults)),
        low_bit_(std::move(low_bit)) {
    if (low_bit_.block_size() == 0) low_bit_.block_size(kDefaultBlockSize);
    TORCH_CHECK(low_bit_.block_size() > 0 && (Format != StateFormat::kInt4 || low_bit_.block_size() % 2 == 0),
                "amp: ", name(), ": block_size must be positive", Format == StateFormat::kInt4 ? " and even" : "",
                ", got ", low_bit_.block_size(), " (0: the default, ", kDefaultBlockSize, ")");
    check_options(defaults);
    for (const auto& group : param_groups_) check_options(static_cast<const Options&>(group.options()));
  }
  explicit LowBitAdam(std::vector<at::Tensor> params, Options defaults = {}, LowBitOptions low_bit = {})
      : LowBitAdam(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                   std::move(defaults), std::move(low_bit)) {}

  // torchao's class name: "AdamW8bit", "Adam4bit", "AdamWFp8", ...
  static std::string name() {
    return std::string(IsAdamW ? "AdamW" : "Adam") + (Format == StateFormat::kInt8   ? "8bit"
                                                      : Format == StateFormat::kInt4 ? "4bit"
                                                                                     : "Fp8");
  }
  const LowBitOptions& low_bit_options() const { return low_bit_; }
  int64_t block_size() const { return low_bit_.block_size(); }

  // The format parameter p's moments take: Format, or kFloat for small tensors.
  StateFormat format_for(const at::Tensor& p) const {
    return p.numel() >= kMinQuantizedNumel && p.numel() % block_size() == 0 ? Format : StateFormat::kFloat;
  }

  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    step_scaled(at::Tensor(), at::Tensor());
    return loss;
  }

  void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) override {
    at::NoGradGuard no_grad;
    const std::vector<Item> items = gather();  // checks everything before anything changes
    detail::lowbit::DeviceFlags flags(grad_scale, found_inf);
    detail::lowbit::StepConstants constants;  // the fused step's, once per param group and step
    for (const Item& item : items) {
      const c10::Device device = item.param.device();
      at::Tensor grad = item.param.grad();
      const at::Tensor inv_scale = flags.inv_scale(device);
      if (takes_fused_step(item.param)) {
        fused_step_param(item, grad, inv_scale, flags.keep(device), constants);
        continue;
      }
      if (inv_scale.defined()) grad.mul_(inv_scale);
      step_param(item, grad, flags.keep(device));
    }
  }

  // Whether parameter p's step is the fused CPU one (else the ATen ops):
  // LowBitOptions::fused() on, p on the CPU, fp32 or bf16, contiguous, with
  // quantized states, and ATen's lerp rounding known on this machine.
  bool takes_fused_step(const at::Tensor& p) const {
    const at::Tensor& grad = p.grad();
    const bool bf16 = p.scalar_type() == at::kBFloat16;
    // Plain states (small tensors) are fused for fp32 parameters, whose plain moments are fp32.
    return low_bit_.fused() && p.device().is_cpu() && (p.scalar_type() == at::kFloat || bf16) && p.is_contiguous() &&
           (!grad.defined() || (grad.scalar_type() == p.scalar_type() && grad.is_contiguous())) &&
           (!bf16 || format_for(p) != StateFormat::kFloat) && detail::lowbit::aten_cpu_rounding().known();
  }

  // What step_scaled() runs: the fused CPU step when any parameter takes it.
  std::string step_path() const override {
    for (const auto& group : param_groups_)
      for (const at::Tensor& p : group.params())
        if (takes_fused_step(p)) return name() + "'s fused CPU step, one pass per block";
    return name() + "'s step_scaled(): ATen ops one at a time, not fused";
  }

  void make_state() override {
    at::NoGradGuard no_grad;
    gather();
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<detail::LowBitAdamParamState, Options>(archive, *this);
  }

  // Loads a checkpoint written by save() of the same optimizer class and
  // block size; anything else is refused with "amp: ..." and the state is
  // left as it was.
  void load(torch::serialize::InputArchive& archive) override {
    auto saved = std::move(state());
    state().clear();
    try {
      try {
        torch::optim::serialize<detail::LowBitAdamParamState, Options>(archive, *this);
      } catch (const c10::Error& e) {
        const std::string what = e.what_without_backtrace();
        if (what.rfind("amp:", 0) == 0) throw;
        TORCH_CHECK(false, "amp: ", name(), "::load: the checkpoint's optimizer state is not one of ", name(), " (",
                    what.substr(0, what.find('\n')), ")");
      }
      for (size_t g = 0; g < param_groups_.size(); ++g) {
        const auto& params = param_groups_[g].params();
        for (size_t i = 0; i < params.size(); ++i) {
          auto entry = state().find(detail::compat::optim_state_key(params[i].unsafeGetTensorImpl()));
          if (entry == state().end()) continue;
          auto* s = dynamic_cast<detail::LowBitAdamParamState*>(entry->second.get());
          TORCH_INTERNAL_ASSERT(s != nullptr);
          check_loaded(*s, params[i], g, i);
        }
      }
    } catch (...) {
      state() = std::move(saved);
      throw;
    }
  }

 private:
  struct Item {
    at::Tensor param;
    const Options* options;
    detail::LowBitAdamParamState* state;
  };

  static void check_options(const Options& o) {
    TORCH_CHECK(o.lr() >= 0, "amp: ", name(), ": invalid learning rate ", o.lr());
    TORCH_CHECK(o.eps() >= 0, "amp: ", name(), ": invalid epsilon ", o.eps());
    TORCH_CHECK(0 <= std::get<0>(o.betas()) && std::get<0>(o.betas()) < 1.0, "amp: ", name(),
                ": invalid beta at index 0: ", std::get<0>(o.betas()));
    TORCH_CHECK(0 <= std::get<1>(o.betas()) && std::get<1>(o.betas()) < 1.0, "amp: ", name(),
                ": invalid beta at index 1: ", std::get<1>(o.betas()));
    TORCH_CHECK(o.weight_decay() >= 0, "amp: ", name(), ": invalid weight_decay ", o.weight_decay());
  }

  // Every parameter with a gradient, checked, with its state (made when
  // missing: torchao's state initialization). Nothing is changed when a check fails.
  std::vector<Item> gather() {
    std::vector<Item> items;
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      const auto& params = param_groups_[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor& p = params[i];
        const at::Tensor& grad = p.grad();
        if (!grad.defined()) continue;
        TORCH_CHECK(!grad.is_sparse(), "amp: ", name(), " does not support sparse gradients (parameter ", i,
                    " of param group ", g, ")");
        const at::ScalarType t = p.scalar_type();
        TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "amp: ", name(),
                    " steps fp32, bf16 and fp16 parameters; parameter ", i, " of param group ", g, " is ", t);
        TORCH_CHECK(grad.sizes() == p.sizes() && grad.device() == p.device(), "amp: ", name(), ": the gradient of ",
                    "parameter ", i, " of param group ", g, " does not match it (", grad.sizes(), " on ", grad.device(),
                    " vs ", p.sizes(), " on ", p.device(), ")");
        auto entry = state().find(detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
        detail::LowBitAdamParamState* s = nullptr;
        if (entry != state().end()) {
          s = dynamic_cast<detail::LowBitAdamParamState*>(entry->second.get());
          TORCH_CHECK(s != nullptr, "amp: ", name(), ": the state of parameter ", i, " of param group ", g,
                      " is another optimizer's");
          TORCH_CHECK(s->step().device() == p.device(), "amp: ", name(), ": the state of parameter ", i,
                      " of param group ", g, " is on ", s->step().device(), ", the parameter on ", p.device());
        }
        items.push_back(Item{p, &static_cast<const Options&>(param_groups_[g].options()), s});
      }
    }
    for (Item& item : items) {
      if (item.state != nullptr) continue;
      const at::Tensor& p = item.param;
      const bool amsgrad = item.options->amsgrad();
      auto fresh = std::make_unique<detail::LowBitAdamParamState>();
      const StateFormat f = format_for(p);
      fresh->step(at::zeros({}, p.options().dtype(at::kFloat)));
      fresh->exp_avg(detail::QuantizedState::zeros(p, f, /*is_signed=*/true, block_size()));
      fresh->exp_avg_sq(detail::QuantizedState::zeros(p, f, /*is_signed=*/false, block_size()));
      if (amsgrad) fresh->max_exp_avg_sq(detail::QuantizedState::zeros(p, f, /*is_signed=*/false, block_size()));
      item.state = fresh.get();
      state()[detail::compat::optim_state_key(p.unsafeGetTensorImpl())] = std::move(fresh);
    }
    return items;
  }

  // torchao's single_param_adam, op for op. `keep` (0-dim bool, or
  // undefined): true leaves parameter and state as they were.
  void step_param(const Item& item, const at::Tensor& grad, const at::Tensor& keep) {
    const Options& o = *item.options;
    detail::LowBitAdamParamState& s = *item.state;
    const at::Tensor& p = item.param;
    const double beta1 = std::get<0>(o.betas());
    const double beta2 = std::get<1>(o.betas());
    const at::Tensor lr = at::scalar_tensor(o.lr(), p.options().dtype(at::kFloat));  // torchao keeps lr a fp32 tensor

    // Ops act in place on this step's own temporaries (never on p or a
    // state): the same kernels with the same operands, so the same bits, with
    // fewer allocations. Products and sums are swapped only where IEEE
    // arithmetic commutes.
    at::Tensor p_f32 = p.to(at::kFloat);
    at::Tensor grad_f32 = grad.to(at::kFloat);
    if (IsAdamW) {
      at::Tensor decay = p_f32.mul(lr * o.weight_decay());  // lr * weight_decay * p_f32
      p_f32 = at::sub_out(decay, p_f32, decay);
    } else {
      grad_f32 = p_f32.mul(o.weight_decay()).add_(grad_f32);  // grad_f32 + weight_decay * p_f32
    }
    const at::Tensor step = s.step() + 1;
    const at::Tensor bias_correction1 = at::rsub(at::pow(beta1, step), 1);
    const at::Tensor bias_correction2 = at::rsub(at::pow(beta2, step), 1);

    const at::Tensor exp_avg_f32 = lerped(s.exp_avg(), grad_f32, 1 - beta1);
    const at::Tensor exp_avg_sq_f32 = lerped(s.exp_avg_sq(), grad_f32.square(), 1 - beta2);
    s.exp_avg().assign_(exp_avg_f32, keep);
    s.exp_avg_sq().assign_(exp_avg_sq_f32, keep);

    at::Tensor denom;
    if (o.amsgrad()) {
      TORCH_CHECK(s.max_exp_avg_sq().defined(), "amp: ", name(), ": amsgrad was turned on after the first step");
      const at::Tensor max_exp_avg_sq_f32 = at::maximum(s.max_exp_avg_sq().dequantize(), exp_avg_sq_f32);
      s.max_exp_avg_sq().assign_(max_exp_avg_sq_f32, keep);
      denom = max_exp_avg_sq_f32.sqrt();
    } else {
      denom = exp_avg_sq_f32.sqrt();
    }
    denom.div_(bias_correction2.sqrt()).add_(o.eps());  // (sqrt / bias_correction2.sqrt()) + eps
    at::Tensor update = exp_avg_f32 / bias_correction1;
    update.mul_(lr).div_(denom);  // lr * (exp_avg_f32 / bias_correction1) / denom
    p_f32 = p_f32.is_same(p) ? p_f32 - update : p_f32.sub_(update);

    at::Tensor next = low_bit_.bf16_stochastic_round() && p.scalar_type() == at::kBFloat16
                          ? detail::lowbit::fp32_to_bf16_sr(p_f32)
                          : p_f32.to(p.scalar_type());
    p.copy_(keep.defined() ? at::where(keep, p, next) : next);
    s.step().copy_(keep.defined() ? at::where(keep, s.step(), step) : step);
  }

  // step_param's arithmetic in one pass per block (optim/detail/lowbit_fused_step.h).
  void fused_step_param(const Item& item, at::Tensor& grad, const at::Tensor& inv_scale, const at::Tensor& keep,
                        detail::lowbit::StepConstants& constants) {
    const Options& o = *item.options;
    detail::LowBitAdamParamState& s = *item.state;
    TORCH_CHECK(!o.amsgrad() || s.max_exp_avg_sq().defined(), "amp: ", name(),
                ": amsgrad was turned on after the first step");
    detail::lowbit::AdamHyper h;
    h.lr = o.lr();
    h.weight_decay = o.weight_decay();
    h.beta1 = std::get<0>(o.betas());
    h.beta2 = std::get<1>(o.betas());
    h.eps = o.eps();
    h.amsgrad = o.amsgrad();
    h.adamw = IsAdamW;
    h.stochastic_round = low_bit_.bf16_stochastic_round();
    h.block_size = block_size();
    detail::lowbit::fused_adam_param(
        h, item.param, grad, s.step(), detail::lowbit::moment_ref(s.exp_avg()),
        detail::lowbit::moment_ref(s.exp_avg_sq()),
        h.amsgrad ? detail::lowbit::moment_ref(s.max_exp_avg_sq()) : detail::lowbit::MomentRef(), inv_scale, keep,
        constants);
  }

  // The moment's dequantized value lerped towards `end`: in place on the
  // dequantized copy, out of place when that is the state's own tensor.
  static at::Tensor lerped(const detail::QuantizedState& q, const at::Tensor& end, double weight) {
    at::Tensor d = q.dequantize();
    return d.is_same(q.values()) ? d.lerp(end, weight) : d.lerp_(end, weight);
  }

  void check_loaded(detail::LowBitAdamParamState& s, const at::Tensor& p, size_t g, size_t i) const {
    const std::string where = " of parameter " + std::to_string(i) + " of param group " + std::to_string(g);
    const StateFormat f = format_for(p);
    s.exp_avg().check_fits(p, f, block_size(), "exp_avg" + where);
    s.exp_avg_sq().check_fits(p, f, block_size(), "exp_avg_sq" + where);
    if (s.max_exp_avg_sq().defined()) s.max_exp_avg_sq().check_fits(p, f, block_size(), "max_exp_avg_sq" + where);
    s.step(s.step().to(p.device(), at::kFloat).reshape({}));
  }

  LowBitOptions low_bit_;
};
}  // namespace detail

// torchao's classes (torchao/optim/adam.py), with LibTorch's options.
using Adam8bit = detail::LowBitAdam<StateFormat::kInt8, false>;
using AdamW8bit = detail::LowBitAdam<StateFormat::kInt8, true>;
using Adam4bit = detail::LowBitAdam<StateFormat::kInt4, false>;
using AdamW4bit = detail::LowBitAdam<StateFormat::kInt4, true>;
using AdamFp8 = detail::LowBitAdam<StateFormat::kFp8, false>;
using AdamWFp8 = detail::LowBitAdam<StateFormat::kFp8, true>;

}  // namespace amp
