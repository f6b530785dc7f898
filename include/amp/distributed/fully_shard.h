// amp/distributed/fully_shard.h: fully sharded data parallelism in the shape
// of PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard with a
// MixedPrecisionPolicy): parameters, gradients and optimizer state are dim-0
// shards at rest; a unit (typically each transformer block, then the root
// with what is left) is all-gathered in the compute dtype for its forward
// and again for its backward, and freed after each.
//
//   amp::ProcessGroup pg = amp::init_process_group();
//   amp::FullyShard fsdp(pg, *model, {model->blocks[0], model->blocks[1]},
//                        amp::FullyShardOptions().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
//   torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));   // the shards
//   // the model's forward calls each unit as  x = fsdp.forward(block, x);  the loop calls the root:
//   auto loss = loss_fn(fsdp.forward(model, x), y);
//   loss.backward();                      // each unit's gradients reduce-scattered as backward reaches it
//   fsdp.clip_grad_norm(1.0);             // optional: the global norm over the shards
//   opt.step(); opt.zero_grad();
//
// C++ modules have no forward hooks, so a unit's forward is called through
// fsdp.forward(unit, args...): before it, the unit's shards are cast to
// param_dtype and all-gathered into the module's own parameter tensors
// (whose memory is otherwise freed), its floating inputs cast to
// param_dtype; after it, the parameters are freed (reshard_after_forward)
// and an autograd function on its outputs all-gathers them again when
// backward reaches the unit. A hook on each parameter counts the unit's
// gradients; when the last arrives the unit's gradients are reduce-scattered
// (in reduce_dtype, AVG) into fp32 shards, the parameters' .grad, and the
// unit is freed. docs/distributed.md: the mechanism, what differs from FSDP2.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/distributed/detail/shard_units.h"
#include "amp/distributed/detail/unit_collectives.h"
#include "amp/distributed/detail/unit_order.h"
#include "amp/distributed/process_group.h"
#include "amp/train/gradient_sync.h"

namespace amp {

// FSDP2's MixedPrecisionPolicy and fully_shard's reshard_after_forward.
struct FullyShardOptions {
  // The dtype units compute in: each fp32 shard is cast to it before the
  // all-gather, and each unit's floating inputs are cast to it on entry.
  // nullopt: the parameters' own dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  // The dtype gradients are reduce-scattered in (nullopt: param_dtype's, else
  // the parameters' own); the result lands in the fp32 shards' .grad.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
  // The dtype the root's floating outputs are cast to (nullopt: as computed).
  TORCH_ARG(std::optional<c10::ScalarType>, output_dtype) = std::nullopt;
  // Free each unit's gathered parameters after its forward (gather them again
  // for its backward); false keeps them until its gradients are reduced. The
  // root keeps its own until backward either way, as in FSDP2.
  TORCH_ARG(bool, reshard_after_forward) = true;
  // Issue the next unit's all-gather early, asynchronously: when a unit's
  // forward begins, the unit that followed it in the last forward (learned
  // from the first step); when a unit's backward begins, the unit before it
  // in this forward (FSDP2's backward prefetch of one unit). The gathered
  // bits are the same; the peak of unsharded parameters becomes two units
  // and the root. Off by default: it overlaps communication with compute
  // at the cost of one more unit in memory (docs/performance.md).
  TORCH_ARG(bool, prefetch) = false;
};

class FullyShard : public GradientSync {
 public:
  // `root`'s parameters are sharded: those of each module in `units` form
  // that unit, the rest the root's unit. Every rank must build the same model
  // (same names and shapes; checked) and gets rank 0's values. Build the
  // optimizer from parameters() afterwards; the module's own parameters hold
  // no memory outside a unit's forward and backward.
  FullyShard(ProcessGroup pg, torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
             FullyShardOptions options = {})
      : pg_(std::move(pg)), options_(std::move(options)), collectives_(pg_, params_, compute_dtype(), reduce_dtype()) {
    setup(root, units);
  }
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;

  // Runs `module`'s forward as a unit (a module given as a unit, or the root):
  // gathers it, casts floating tensor arguments to param_dtype, calls
  // module->forward(args...), frees it (units, with reshard_after_forward),
  // and arranges its gathering again for backward. Returns forward's result
  // (a tensor or a vector of tensors).
  template <class M, class... Args>
  auto forward(M& module, Args&&... args) {
    detail::ShardUnit& u = unit_of(&*module);
    pre_forward(u);
    auto out = module->forward(cast_input(std::forward<Args>(args))...);
    return post_forward(u, std::move(out));
  }

  // This rank's shards, one leaf per parameter (unpadded, the parameter's
  // dtype), in the root's named_parameters() order: give these to the
  // optimizer. Their .grad is the reduce-scattered gradient.
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params_) out.push_back(p.shard);
    return out;
  }
  // The parameters' names, in the same order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& p : params_) out.push_back(p.name);
    return out;
  }
  // Their unsharded shapes, in the same order.
  std::vector<std::vector<int64_t>> shapes() const {
    std::vector<std::vector<int64_t>> out;
    for (const auto& p : params_) out.push_back(p.layout.shape);
    return out;
  }

  // Clips the shards' gradients by their global norm, as
  // torch.nn.utils.clip_grad_norm_ over FSDP2's DTensors: each shard's
  // norm, stacked, raised to norm_type, summed over the ranks (one
  // all-reduce), raised to 1/norm_type, then the norm of those; the
  // coefficient max_norm * reciprocal(total + 1e-6), clamped to 1.
  // Returns the total norm (the same on every rank). Call on every rank.
  at::Tensor clip_grad_norm(double max_norm, double norm_type = 2.0) {
    TORCH_CHECK(max_norm >= 0.0, "amp: FullyShard::clip_grad_norm: max_norm must be >= 0, got ", max_norm);
    TORCH_CHECK(norm_type > 0.0 && std::isfinite(norm_type),
                "amp: FullyShard::clip_grad_norm: norm_type must be finite and > 0 (2 for the L2 norm), got ",
                norm_type);
    return collectives_.clip_grad_norm(max_norm, norm_type);
  }

  // false: the next backwards only accumulate each unit's unsharded gradient
  // (in reduce_dtype) and communicate nothing; the first backward after
  // true reduce-scatters the sum. FSDP2's set_requires_gradient_sync.
  void set_requires_gradient_sync(bool sync) { sync_ = sync; }
  bool requires_gradient_sync() const { return sync_; }

  // GradientSync (a Stepper's hook): micro-batches that do not end an
  // accumulation cycle do not sync. Gradients are reduced during backward,
  // so finish_backward() only checks that the last backward completed.
  void begin_backward(bool boundary) override { sync_ = boundary; }
  void finish_backward() override {
    for (const auto& u : units_)
      TORCH_CHECK(u.ready.empty(),
                  "amp: FullyShard: a backward did not complete its reduce-scatters; call "
                  "the root's forward through FullyShard::forward so that its end is seen");
  }
  // The Stepper, Trainer and Fabric refuse what would see one shard only
  // (their own clipping, save()): gradient_sync.h.
  bool shards_parameters() const override { return true; }
  // A loss scaler's found-inf flag, the largest over the ranks: every rank
  // skips or steps together and keeps one scale (torch's ShardedGradScaler
  // sums instead; the decisions are the same, and a flag of 0 or 1 is what
  // the fused optimizer kernels expect). The Stepper and Fabric install it
  // in their scaler; by hand: scaler.set_found_inf_sync([&](at::Tensor& f) { fsdp.all_reduce_found_inf(f); }).
  void all_reduce_found_inf(at::Tensor& found_inf) override {
    if (pg_.world_size() > 1) pg_.allreduce_max(found_inf, "FullyShard found-inf all-reduce");
  }

  // Bytes this rank holds: the padded shards; the sharded gradients; the
  // unsharded parameters now, and their most since reset_peak().
  int64_t parameter_bytes() const { return collectives_.parameter_bytes(); }
  int64_t gradient_bytes() const { return collectives_.gradient_bytes(); }
  int64_t unsharded_bytes() const { return collectives_.unsharded_bytes(); }
  int64_t peak_unsharded_bytes() const { return collectives_.peak_unsharded_bytes(); }
  void reset_peak() { collectives_.reset_peak(); }
  // The unsharded parameters of each unit in the compute dtype (the root's last).
  std::vector<int64_t> unit_bytes() const {
    std::vector<int64_t> out;
    for (const auto& u : units_) out.push_back(collectives_.unit_bytes(u));
    return out;
  }
  // All-gathers and reduce-scatters issued so far.
  int64_t allgathers() const { return collectives_.allgathers(); }
  // Of those, the ones issued early (FullyShardOptions::prefetch).
  int64_t prefetched_allgathers() const { return prefetched_allgathers_; }
  int64_t reduce_scatters() const { return collectives_.reduce_scatters(); }
  // Their buffers' bytes so far: each all-gather's output (every rank's
  // padded shards in the compute dtype) and each reduce-scatter's input
  // (world_size() rows in reduce_dtype). A ring sends (N-1)/N of these per rank.
  int64_t allgathered_bytes() const { return collectives_.allgathered_bytes(); }
  int64_t reduce_scattered_bytes() const { return collectives_.reduce_scattered_bytes(); }

  const ProcessGroup& process_group() const { return pg_; }
  const FullyShardOptions& options() const { return options_; }

 private:
  struct PreBackward : torch::autograd::Function<PreBackward> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, FullyShard* self, int64_t unit,
                                                  at::TensorList xs) {
      ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
      ctx->saved_data["unit"] = unit;
      torch::autograd::variable_list out;
      for (const auto& x : xs)
        out.push_back(x);  // an input returned: autograd makes it a view with this function as grad_fn
      return out;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      auto* self = reinterpret_cast<FullyShard*>(ctx->saved_data["self"].toInt());
      self->pre_backward(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
      torch::autograd::variable_list out{at::Tensor(), at::Tensor()};
      for (auto& g : grads) out.push_back(g);
      return out;
    }
  };

  c10::ScalarType param_dtype() const { return at::kFloat; }
  c10::ScalarType compute_dtype() const { return options_.param_dtype().value_or(param_dtype()); }
  c10::ScalarType reduce_dtype() const { return options_.reduce_dtype().value_or(compute_dtype()); }

  void setup(torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
    detail::shard_units(pg_, root, units, compute_dtype(), params_, units_, [this](size_t i) {
      // Each gradient is counted once autograd has written it to .grad.
      grad_hooks_.add(params_[i].module_param,
                      [this, i] { collectives_.add_gradient(i, units_[params_[i].unit], sync_); });
      collectives_.free_unowned(params_[i]);
    });
  }

  detail::ShardUnit& unit_of(const torch::nn::Module* m) {
    auto it = std::find_if(units_.begin(), units_.end(), [m](const detail::ShardUnit& u) { return u.module == m; });
    TORCH_CHECK(it != units_.end(),
                "amp: FullyShard::forward: this module is neither the root nor one of the units "
                "given to FullyShard; call units and the root through it, other modules directly");
    return *it;
  }

  template <class A>
  decltype(auto) cast_input(A&& a) {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
      if (options_.param_dtype() && a.defined() && a.is_floating_point() && a.scalar_type() != compute_dtype())
        return at::Tensor(a.to(compute_dtype()));
      return at::Tensor(a);
    } else {
      return std::forward<A>(a);
    }
  }

  void pre_forward(detail::ShardUnit& u) {
    if (u.root) {
      in_root_forward_ = true;
      collectives_.reshard(u);  // stale after a step: gathered again
      order_.begin_forward();
      collectives_.unshard(u);
      prefetch(order_.first());
      return;
    } else {
      // In the root's backward: a recompute (amp::checkpoint around the
      // unit's call), which gathers the unit (or finds it gathered).
      TORCH_CHECK(in_root_forward_ || callback_queued_,
                  "amp: FullyShard::forward: a unit ran outside the root's forward; call the root "
                  "as fsdp.forward(root, ...) and the units inside it");
    }
    collectives_.unshard(u);
    if (in_root_forward_) prefetch(order_.on_forward(index_of(u)));
  }

  size_t index_of(const detail::ShardUnit& u) const { return static_cast<size_t>(&u - units_.data()); }

  // Starts unit k's all-gather now, if prefetching and it is not gathered.
  void prefetch(size_t k) {
    if (!options_.prefetch() || pg_.world_size() == 1 || k == detail::UnitOrder::npos || units_[k].unsharded) return;
    if (!collectives_.start_unshard(units_[k])) return;
    units_[k].prefetched = true;
    ++prefetched_allgathers_;
  }

  template <class R>
  R post_forward(detail::ShardUnit& u, R out) {
    // A recompute in backward (as FSDP2's forward in PRE_BACKWARD): the unit
    // stays gathered until its gradients are reduce-scattered; no hook.
    if (!u.root && !in_root_forward_) return out;
    const bool grad = at::GradMode::is_enabled();
    if (!u.root && (options_.reshard_after_forward() || !grad)) collectives_.reshard(u);
    if (u.root) {
      in_root_forward_ = false;
      if (!grad) collectives_.reshard(u);
      // A unit prefetched for a forward that did not run it: waited for and freed.
      for (auto& other : units_)
        if (other.gather) collectives_.reshard(other);
    }
    if constexpr (std::is_same_v<R, at::Tensor>) {
      std::vector<at::Tensor> v{std::move(out)};
      wrap_outputs(u, v);
      return v[0];
    } else {
      static_assert(std::is_same_v<R, std::vector<at::Tensor>>,
                    "amp: FullyShard::forward: a unit's forward must return a tensor or a std::vector of tensors");
      wrap_outputs(u, out);
      return out;
    }
  }

  void wrap_outputs(detail::ShardUnit& u, std::vector<at::Tensor>& outs) {
    if (u.root && options_.output_dtype())
      for (auto& o : outs)
        if (o.defined() && o.is_floating_point()) o = o.to(*options_.output_dtype());
    if (!at::GradMode::is_enabled()) return;
    std::vector<size_t> idx;
    torch::autograd::variable_list xs;
    for (size_t i = 0; i < outs.size(); ++i)
      if (outs[i].defined() && outs[i].requires_grad()) idx.push_back(i), xs.push_back(outs[i]);
    if (xs.empty()) return;
    const auto wrapped = PreBackward::apply(this, static_cast<int64_t>(&u - units_.data()), at::TensorList(xs));
    for (size_t k = 0; k < idx.size(); ++k) outs[idx[k]] = wrapped[k];
  }

  // Backward reached unit k's outputs: gather it for its ops (the root's:
  // the backward starts, its end is queued).
  void pre_backward(size_t k) {
    detail::ShardUnit& u = units_[k];
    if (u.root && !callback_queued_) {
      callback_queued_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { end_backward(); });
    }
    collectives_.unshard(u);
    prefetch(u.root ? order_.begin_backward() : order_.on_backward(k));
  }

  // The end of a backward (queued by the root's pre-backward): units with
  // unused parameters reduce what arrived; every unit is freed; the unsharded
  // parameters' own .grad (written by autograd after each hook) dropped.
  void end_backward() {
    callback_queued_ = false;
    for (auto& u : units_) {
      if (sync_ && !u.ready.empty()) collectives_.reduce(u);
      u.arrived = 0;
      collectives_.reshard(u);
    }
    for (auto& p : params_) p.module_param.mutable_grad() = at::Tensor();
  }

  ProcessGroup pg_;
  FullyShardOptions options_;
  std::vector<detail::ShardedParam> params_;
  std::vector<detail::ShardUnit> units_;
  detail::UnitCollectives collectives_;  // gathers, frees and reduces units_
  bool sync_ = true;
  bool in_root_forward_ = false;
  bool callback_queued_ = false;
  int64_t prefetched_allgathers_ = 0;
  detail::UnitOrder order_;
  detail::GradHooks grad_hooks_;  // last: its hooks, which call into the members above, go first
};

}  // namespace amp
