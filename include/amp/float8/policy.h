// amp/float8/policy.h: what the policy amp::Float8<Recipe> does in a Region,
// a Trainer and a Fabric.
//
//   amp::Trainer<amp::Float8<amp::Tensorwise>, amp::CPU> trainer(model, opt);   // or amp::Delayed<16>
//   trainer.step([&](auto&) { return loss_fn(model->forward(x), y); });
//
// A Float8 region is a bf16 autocast region whose linear routing is on
// (amp/precision/linear_routing.h): each C++ linear whose weight fits
// (float8::fits) runs float8::linear, tensorwise, rowwise or with delayed scaling,
// or a block-scaled recipe's emulated GEMMs (amp/float8/block_scaled.h: MXFP8,
// NVFP4); the others, and every other op, run in bf16 as in Mixed<bf16, NoScaler>.
// The recipe's state (TrainingState) is the trainer's: Tensorwise, the
// rowwise recipes, MXFP8 and NVFP4 have none; Delayed keeps a DelayedScaling
// of every fitting nn::Linear of the model, updated after each optimizer step
// and written into checkpoints; NVFP4<true> keeps the generator its
// stochastic rounding draws from (seeded with 0, written into checkpoints).
#pragma once

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "amp/core/policy.h"
#include "amp/detail/compat_float8.h"
#include "amp/float8/block_scaled.h"
#include "amp/float8/delayed.h"
#include "amp/float8/linear.h"
#include "amp/float8/rowwise.h"
#include "amp/precision/linear_routing.h"
#include "amp/precision/region.h"

namespace amp {
namespace float8 {

// The linears a Float8 policy runs in float8 and those it leaves in bf16.
struct Coverage {
  std::vector<std::string> converted;  // module paths of the nn::Linear layers whose weight fits
  std::vector<std::string> kept;       // "path [out, in]" of those whose dimensions are not multiples of the block
  std::vector<std::string> mapped;     // "path (fp32)" of those a precision map keeps out of float8
};

// `map`: a region's precision map resolved against `model` (PrecisionMap::resolve), or null.
// Recipe: the policy's; the block-scaled ones tile by their block (MXFP8: 32).
template <class Recipe = Tensorwise>
Coverage coverage(const torch::nn::Module& model, const amp::detail::PrecisionTable* map = nullptr) {
  Coverage out;
  for (const auto& [name, linear] : detail::linears_of(model)) {
    const at::Tensor& w = linear->weight;
    const ModulePrecision* p = map != nullptr ? amp::detail::mapped_precision(*map, w) : nullptr;
    if (p != nullptr) {
      out.mapped.push_back(name + " (" + ::amp::detail::to_string(*p) + ")");
    } else if (detail::fits_recipe<Recipe>(w)) {
      out.converted.push_back(name);
    } else {
      out.kept.push_back(name + " [" + std::to_string(w.size(0)) + ", " + std::to_string(w.size(1)) + "]");
    }
  }
  return out;
}

namespace detail {  // what Trainer and Fabric use

// "float8: 3 linears, 1 kept in bf16 (head [10, 64])"; `block`: the recipe's (kLinearBlock).
inline std::string describe(const Coverage& c, int64_t block = 16) {
  std::string s = "float8: " + std::to_string(c.converted.size()) + " linear(s)";
  if (!c.kept.empty()) {
    s += ", " + std::to_string(c.kept.size()) + " kept in bf16 (dimensions not multiples of " + std::to_string(block) +
         ":";
    for (const std::string& k : c.kept) s += " " + k;
    s += ")";
  }
  if (!c.mapped.empty()) {
    s += ", " + std::to_string(c.mapped.size()) + " kept out by the precision map:";
    for (const std::string& m : c.mapped) s += " " + m;
  }
  return s;
}

// An amp: error unless `device` runs Recipe's float8 matmuls: a 16x16
// _scaled_mm with the recipe's scales is tried once per call (on CUDA it
// needs compute capability 8.9+; the rowwise kernels, a LibTorch that has them).
template <class Recipe>
void check_device(const c10::Device& device) {
  if constexpr (amp::detail::is_block_scaled_recipe_v<Recipe>)
    return;  // emulated: any device with the dtypes (static rules)
#if AMP_DETAIL_HAS_FLOAT8_MATMUL
  constexpr bool rowwise = amp::detail::is_rowwise_recipe_v<Recipe>;
  if (!device.is_cuda() && !rowwise) return;  // the static rules checked CPU's LibTorch
  const auto f32 = at::TensorOptions().device(device).dtype(at::kFloat);
  const at::Tensor a = at::zeros({16, 16}, f32).to(detail::kE4M3);
  const at::Tensor sa = rowwise ? at::ones({16, 1}, f32) : at::ones({}, f32);
  const at::Tensor sb = rowwise ? at::ones({1, 16}, f32) : at::ones({}, f32);
  try {
    (void)at::_scaled_mm(a, a.t(), sa, sb, c10::nullopt, c10::nullopt, at::kBFloat16, false);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "amp: ", rowwise ? "Float8's rowwise recipes need" : "Float8 policies need", " at::_scaled_mm",
                rowwise ? " with rowwise scales" : "",
                " on this device: on CUDA a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)",
                rowwise ? ", on CPU LibTorch 2.14+" : "", "; here use ",
                rowwise ? "amp::Float8<amp::Tensorwise> or " : "",
                "amp::Mixed<amp::bf16, amp::NoScaler>. LibTorch said: ", e.what_without_backtrace());
  }
#else
  (void)device;
#endif
}

// What a trainer keeps for a recipe: track(model) at setup, bind() around
// each forward, update(reduce_max) after each optimizer step (reduce_max
// makes the step's amaxes the same on every process), write/read in checkpoints.
// Tensorwise keeps nothing, nor does a policy without a recipe (void).
template <class Recipe>
class TrainingState {
 public:
  struct Binding {};
  void track(torch::nn::Module& /*model*/, const std::string& /*prefix*/ = "") {}
  Binding bind() const { return {}; }
  template <class ReduceMax>
  void update(ReduceMax&& /*reduce_max*/) {}
  void write(torch::serialize::OutputArchive& /*archive*/) const {}
  void read(torch::serialize::InputArchive& /*archive*/) {}
};

// NVFP4<true>: the generator its stochastic rounding draws from, seeded
// with 0 at construction (the same run gives the same bits), bound around
// each forward and backward, its state written into checkpoints ("nvfp4_sr").
template <>
class TrainingState<NVFP4<true>> {
 public:
  TrainingState() : gen_(at::make_generator<at::CPUGeneratorImpl>(0)) {}

  void track(torch::nn::Module& /*model*/, const std::string& /*prefix*/ = "") {}
  StochasticRoundingGuard bind() { return StochasticRoundingGuard(gen_); }
  template <class ReduceMax>
  void update(ReduceMax&& /*reduce_max*/) {}
  void write(torch::serialize::OutputArchive& archive) const {
    archive.write("nvfp4_sr", gen_.get_state(), /*is_buffer=*/true);
  }
  void read(torch::serialize::InputArchive& archive) {
    c10::IValue state;
    TORCH_CHECK(archive.try_read("nvfp4_sr", state) && state.isTensor(),
                "amp: the checkpoint has no NVFP4 stochastic-rounding state (\"nvfp4_sr\"); it was saved under "
                "another recipe");
    gen_.set_state(state.toTensor());
  }
  at::Generator& generator() { return gen_; }

 private:
  at::Generator gen_;
};

#if AMP_DETAIL_HAS_FLOAT8_MATMUL

template <int H, int M>
class TrainingState<Delayed<H, M>> {
 public:
  TrainingState() : scaling_(DelayedOptions().history_length(H).margin(M)) {}

  void track(torch::nn::Module& model, const std::string& prefix = "") { scaling_.track(model, prefix); }
  DelayedLinearGuard bind() const { return DelayedLinearGuard(scaling_); }
  // reduce_max(at::Tensor&): the amaxes' largest over the processes, in place.
  template <class ReduceMax>
  void update(ReduceMax&& reduce_max) {
    scaling_.update(std::forward<ReduceMax>(reduce_max));
  }

  // A sub-archive "float8": "names" (the state_dict keys) and "t<i>" (its tensors).
  void write(torch::serialize::OutputArchive& archive) const {
    torch::serialize::OutputArchive sub;
    c10::List<std::string> names;
    int64_t i = 0;
    for (const auto& kv : scaling_.state_dict()) {
      names.push_back(kv.key());
      sub.write("t" + std::to_string(i++), kv.value(), /*is_buffer=*/true);
    }
    sub.write("names", c10::IValue(names));
    archive.write("float8", sub);
  }
  // All checked before anything changes (DelayedScaling::load_state_dict).
  void read(torch::serialize::InputArchive& archive) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(archive.try_read("float8", sub), "amp: the checkpoint has no float8 state (\"float8\")");
    c10::IValue names;
    TORCH_CHECK(sub.try_read("names", names) && names.isList(), "amp: the checkpoint's float8 state has no names");
    torch::OrderedDict<std::string, at::Tensor> state;
    int64_t i = 0;
    for (const c10::IValue& name : names.toListRef()) {
      c10::IValue t;
      TORCH_CHECK(sub.try_read("t" + std::to_string(i++), t) && t.isTensor(),
                  "amp: the checkpoint's float8 state lacks the tensor of ", name.toStringRef());
      state.insert(name.toStringRef(), t.toTensor());
    }
    scaling_.load_state_dict(state);
  }

  const DelayedScaling& scaling() const { return scaling_; }

 private:
  DelayedScaling scaling_;
};

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace detail
}  // namespace float8

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
namespace detail {

// Region<Float8<Tensorwise>, D>: the routed linears run float8::linear.
template <>
struct Float8RegionGuard<Tensorwise> {
  LinearFnGuard guard{&float8::linear<Tensorwise>};
};

// Region<Float8<Rowwise>, D> and Region<Float8<RowwiseWithGwHp>, D>:
// float8::linear with torchao's rowwise recipes (amp/float8/rowwise.h).
template <>
struct Float8RegionGuard<Rowwise> {
  LinearFnGuard guard{&float8::linear<Rowwise>};
};
template <>
struct Float8RegionGuard<RowwiseWithGwHp> {
  LinearFnGuard guard{&float8::linear<RowwiseWithGwHp>};
};

// Region<Float8<Delayed<...>>, D>: the routed linears run with the scales of
// the DelayedScaling bound on this thread (a Trainer's or Fabric's, or a
// float8::DelayedLinearGuard of one's own); none bound is an amp: error at the
// first fitting linear.
template <int H, int M>
struct Float8RegionGuard<Delayed<H, M>> {
  LinearFnGuard guard{&float8::detail::delayed_linear};
};

}  // namespace detail
#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

#if AMP_DETAIL_HAS_FLOAT8_DTYPE
namespace detail {

// Region<Float8<MXFP8<Mode>>, D> and Region<Float8<NVFP4<SR>>, D>: the
// routed linears run the block-scaled recipe (amp/float8/block_scaled.h).
template <MxScaleMode Mode>
struct Float8RegionGuard<MXFP8<Mode>> {
  LinearFnGuard guard{&float8::detail::block_scaled_linear<MXFP8<Mode>>, "amp::MXFP8"};
};
template <bool SR>
struct Float8RegionGuard<NVFP4<SR>> {
  LinearFnGuard guard{&float8::detail::block_scaled_linear<NVFP4<SR>>, "amp::NVFP4"};
};

}  // namespace detail
#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace amp
