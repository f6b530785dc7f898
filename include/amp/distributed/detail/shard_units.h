// amp/distributed/detail/shard_units.h: what FullyShard holds per parameter
// (ShardedParam) and per unit (ShardUnit), and how it builds them: each of
// the root's parameters checked and given to its unit, the model checked
// the same on every rank, rank 0's values broadcast, this rank's shard cut,
// a hook on each parameter's gradient accumulator (GradHooks).
//
//   std::vector<ShardedParam> params; std::vector<ShardUnit> units;
//   shard_units(pg, root, {block0, block1}, at::kBFloat16, params, units,
//               [&](size_t i) { /* params[i]: shard cut, module tensor still allocated */ });
#pragma once

#include <torch/nn/module.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/distributed/detail/shard_layout.h"
#include "amp/distributed/process_group.h"

namespace amp::detail {

// One parameter: the module's own tensor (gathered in the compute dtype for
// its unit's forward and backward, no memory at rest) and this rank's fp32 shard.
struct ShardedParam {
  std::string name;
  at::Tensor module_param;  // the module's tensor: the unsharded parameter, 0 elements at rest
  at::Tensor padded;        // this rank's padded shard, fp32 (the parameter's dtype)
  at::Tensor shard;         // padded's unpadded rows: the leaf the optimizer steps
  at::Tensor accumulated;   // unsharded gradient summed over micro-batches without sync
  ShardLayout layout;
  size_t unit = 0;
};

struct ShardUnit {
  const torch::nn::Module* module = nullptr;
  std::vector<size_t> params;
  bool unsharded = false;  // gathered, or its all-gather in flight (`gather`)
  bool root = false;
  // An all-gather started and not yet waited for (prefetch): its work, its
  // buffers, and each parameter's padded numel.
  c10::intrusive_ptr<c10d::Work> gather;
  at::Tensor gather_in, gather_out;
  bool prefetched = false;    // that all-gather was issued early
  int64_t arrived = 0;        // gradients of this backward so far
  std::vector<size_t> ready;  // parameters whose gradient this backward has produced
};

// A post hook on each parameter's gradient accumulator: its callback runs
// once autograd has written the gradient to the parameter's .grad. The hooks
// are removed with this.
class GradHooks {
 public:
  GradHooks() = default;
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;
  ~GradHooks() {
    for (size_t i = 0; i < hooks_.size(); ++i) accumulators_[i]->del_post_hook(hooks_[i]);
  }
  // The accumulator is made (and kept) while `param` has its shape.
  void add(const at::Tensor& param, std::function<void()> on_grad) {
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(param));
    hooks_.push_back(accumulators_.back()->add_post_hook(std::make_unique<AfterAccumulate>(std::move(on_grad))));
  }

 private:
  struct AfterAccumulate : torch::autograd::FunctionPostHook {
    explicit AfterAccumulate(std::function<void()> f) : on_grad(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      on_grad();
      return outputs;
    }
    std::function<void()> on_grad;
  };
  // shared_ptr up to LibTorch 2.x, intrusive_ptr on 2.14: whatever it returns.
  using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hooks_;
};

// Every rank's parameter names and shapes hash the same as rank 0's (one all-gather).
inline void check_same_model(const ProcessGroup& pg, const std::vector<ShardedParam>& params) {
  std::string summary;
  for (const auto& p : params) summary += p.name + ":" + c10::str(p.layout.shape) + ";";
  at::Tensor mine = at::zeros({2}, at::kLong);
  mine[0] = static_cast<int64_t>(std::hash<std::string>()(summary) & 0x7fffffffffffLL);
  mine[1] = static_cast<int64_t>(params.size());
  if (pg.world_size() == 1) return;
  const auto all = pg.allgather(mine, "FullyShard model check");
  for (size_t r = 0; r < all.size(); ++r)
    TORCH_CHECK(at::equal(all[r], all[0]), "amp: FullyShard: rank ", r,
                "'s model has other parameter names or shapes than rank 0's; every rank must build the same model");
}

// Fills `params` (the root's, in named_parameters() order) and `units` (one
// per module in `modules`, then the root's with the rest), broadcasts rank
// 0's values and cuts this rank's shards. Each module tensor is given its
// own storage in `compute_dtype`; `adopt(i)` runs once parameter i's shard
// is cut, while that storage is still allocated.
template <class Adopt>
void shard_units(const ProcessGroup& pg, torch::nn::Module& root,
                 const std::vector<std::shared_ptr<torch::nn::Module>>& modules, c10::ScalarType compute_dtype,
                 std::vector<ShardedParam>& params, std::vector<ShardUnit>& units, Adopt&& adopt) {
  const int world = pg.world_size(), rank = pg.rank();
  std::map<const at::TensorImpl*, size_t> unit_of_param;
  for (size_t k = 0; k < modules.size(); ++k) {
    TORCH_CHECK(modules[k] != nullptr, "amp: FullyShard: unit ", k, " is a null module");
    for (const auto& p : modules[k]->parameters(/*recurse=*/true)) {
      TORCH_CHECK(unit_of_param.count(p.unsafeGetTensorImpl()) == 0, "amp: FullyShard: unit ", k,
                  " shares a parameter with an earlier unit; give each parameter to one unit (units do not nest)");
      unit_of_param[p.unsafeGetTensorImpl()] = k;
    }
    units.emplace_back();
    units.back().module = modules[k].get();
  }
  units.emplace_back();
  units.back().module = &root;
  units.back().root = true;
  const size_t root_unit = units.size() - 1;
  std::vector<at::Tensor> whole;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    TORCH_CHECK(p.scalar_type() == at::kFloat && p.device().is_cpu() == pg.device().is_cpu(),
                "amp: FullyShard: parameter '", item.key(), "' is ", p.scalar_type(), " on ", p.device(),
                "; FullyShard shards fp32 parameters on the process group's device (", pg.device(),
                "): build the model in fp32 there and set FullyShardOptions::param_dtype for 16-bit compute");
    TORCH_CHECK(p.dim() >= 1, "amp: FullyShard: parameter '", item.key(),
                "' has no dimension to shard; give it shape [1]");
    TORCH_CHECK(p.requires_grad(), "amp: FullyShard: parameter '", item.key(),
                "' does not require grad; frozen parameters are not supported yet");
    ShardedParam sp;
    sp.name = item.key();
    sp.module_param = p;
    sp.layout = ShardLayout(p.sizes(), world);
    auto it = unit_of_param.find(p.unsafeGetTensorImpl());
    sp.unit = it == unit_of_param.end() ? root_unit : it->second;
    units[sp.unit].params.push_back(params.size());
    params.push_back(std::move(sp));
    whole.push_back(p.detach());
  }
  TORCH_CHECK(unit_of_param.size() + units[root_unit].params.size() == params.size(),
              "amp: FullyShard: a unit's parameters are not among the root's; pass the units' root module");
  check_same_model(pg, params);
  at::NoGradGuard no_grad;
  for (auto& w : whole) {
    at::Tensor t = w;
    if (world > 1) pg.broadcast(t, 0, "FullyShard parameter broadcast");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    p.padded = padded_shard(whole[i], p.layout, rank).view(p.layout.padded_shape());
    p.shard = p.padded.narrow(0, 0, p.layout.rows_of(rank)).detach().requires_grad_(true);
    // The module's tensor becomes the unsharded parameter: the compute
    // dtype, its own storage, freed by `adopt` (allocated by each gather).
    p.module_param.set_data(at::empty(p.layout.shape, whole[i].options().dtype(compute_dtype)));
    adopt(i);
  }
}

}  // namespace amp::detail
