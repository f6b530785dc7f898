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
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/distributed/detail/shard_layout.h"
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

namespace detail {
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
}  // namespace detail

class FullyShard : public GradientSync {
 public:
  // `root`'s parameters are sharded: those of each module in `units` form
  // that unit, the rest the root's unit. Every rank must build the same model
  // (same names and shapes; checked) and gets rank 0's values. Build the
  // optimizer from parameters() afterwards; the module's own parameters hold
  // no memory outside a unit's forward and backward.
  FullyShard(ProcessGroup pg, torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
             FullyShardOptions options = {})
      : pg_(std::move(pg)), options_(std::move(options)) {
    setup(root, units);
  }
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;
  ~FullyShard() override {
    for (size_t i = 0; i < params_.size(); ++i) accumulators_[i]->del_post_hook(hooks_[i]);
  }

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
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const auto& p : params_)
      if (p.shard.grad().defined()) grads.push_back(p.shard.grad());
    if (grads.empty()) return at::zeros({}, at::kFloat);
    std::vector<at::Tensor> norms;
    for (const auto& g : grads) norms.push_back(at::linalg_vector_norm(g, norm_type));
    at::Tensor partial = at::pow(at::stack(norms), norm_type);
    if (pg_.world_size() > 1) pg_.allreduce_sum(partial, "FullyShard clip_grad_norm all-reduce");
    const at::Tensor total = at::linalg_vector_norm(at::pow(partial, 1.0 / norm_type), norm_type);
    const at::Tensor coef = at::clamp(at::reciprocal(total + 1e-6) * max_norm, c10::nullopt, 1.0);
    for (auto& g : grads) g.mul_(coef);
    return total;
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
  int64_t parameter_bytes() const {
    int64_t n = 0;
    for (const auto& p : params_) n += static_cast<int64_t>(p.padded.nbytes());
    return n;
  }
  int64_t gradient_bytes() const {
    int64_t n = 0;
    std::vector<const void*> seen;
    for (const auto& p : params_) {
      const at::Tensor& g = p.shard.grad();
      if (!g.defined()) continue;
      const void* s = g.storage().unsafeGetStorageImpl();
      if (std::find(seen.begin(), seen.end(), s) != seen.end()) continue;
      seen.push_back(s);
      n += static_cast<int64_t>(g.storage().nbytes());
    }
    return n;
  }
  int64_t unsharded_bytes() const { return unsharded_bytes_; }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }
  void reset_peak() { peak_unsharded_bytes_ = unsharded_bytes_; }
  // The unsharded parameters of each unit in the compute dtype (the root's last).
  std::vector<int64_t> unit_bytes() const {
    std::vector<int64_t> out;
    for (const auto& u : units_) {
      int64_t n = 0;
      for (size_t i : u.params) n += params_[i].layout.numel() * elem_size();
      out.push_back(n);
    }
    return out;
  }
  // All-gathers and reduce-scatters issued so far.
  int64_t allgathers() const { return allgathers_; }
  // Of those, the ones issued early (FullyShardOptions::prefetch).
  int64_t prefetched_allgathers() const { return prefetched_allgathers_; }
  int64_t reduce_scatters() const { return reduce_scatters_; }
  // Their buffers' bytes so far: each all-gather's output (every rank's
  // padded shards in the compute dtype) and each reduce-scatter's input
  // (world_size() rows in reduce_dtype). A ring sends (N-1)/N of these per rank.
  int64_t allgathered_bytes() const { return allgathered_bytes_; }
  int64_t reduce_scattered_bytes() const { return reduce_scattered_bytes_; }

  const ProcessGroup& process_group() const { return pg_; }
  const FullyShardOptions& options() const { return options_; }

 private:
  // Runs after autograd accumulated a parameter's gradient into its .grad.
  struct AfterAccumulate : torch::autograd::FunctionPostHook {
    AfterAccumulate(FullyShard* s, size_t i) : self(s), index(i) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      self->on_grad(index);
      return outputs;
    }
    FullyShard* self;
    size_t index;
  };

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
  int64_t elem_size() const { return static_cast<int64_t>(c10::elementSize(compute_dtype())); }

  void setup(torch::nn::Module& root, const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
    const int world = pg_.world_size(), rank = pg_.rank();
    std::map<const at::TensorImpl*, size_t> unit_of_param;
    for (size_t k = 0; k < units.size(); ++k) {
      TORCH_CHECK(units[k] != nullptr, "amp: FullyShard: unit ", k, " is a null module");
      for (const auto& p : units[k]->parameters(/*recurse=*/true)) {
        TORCH_CHECK(unit_of_param.count(p.unsafeGetTensorImpl()) == 0, "amp: FullyShard: unit ", k,
                    " shares a parameter with an earlier unit; give each parameter to one unit (units do not nest)");
        unit_of_param[p.unsafeGetTensorImpl()] = k;
      }
      units_.emplace_back();
      units_.back().module = units[k].get();
    }
    units_.emplace_back();
    units_.back().module = &root;
    units_.back().root = true;
    root_ = units_.size() - 1;
    std::vector<at::Tensor> whole;
    for (const auto& item : root.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      TORCH_CHECK(p.scalar_type() == at::kFloat && p.device().is_cpu() == pg_.device().is_cpu(),
                  "amp: FullyShard: parameter '", item.key(), "' is ", p.scalar_type(), " on ", p.device(),
                  "; FullyShard shards fp32 parameters on the process group's device (", pg_.device(),
                  "): build the model in fp32 there and set FullyShardOptions::param_dtype for 16-bit compute");
      TORCH_CHECK(p.dim() >= 1, "amp: FullyShard: parameter '", item.key(),
                  "' has no dimension to shard; give it shape [1]");
      TORCH_CHECK(p.requires_grad(), "amp: FullyShard: parameter '", item.key(),
                  "' does not require grad; frozen parameters are not supported yet");
      detail::ShardedParam sp;
      sp.name = item.key();
      sp.module_param = p;
      sp.layout = detail::ShardLayout(p.sizes(), world);
      auto it = unit_of_param.find(p.unsafeGetTensorImpl());
      sp.unit = it == unit_of_param.end() ? root_ : it->second;
      units_[sp.unit].params.push_back(params_.size());
      params_.push_back(std::move(sp));
      whole.push_back(p.detach());
    }
    TORCH_CHECK(unit_of_param.size() + units_[root_].params.size() == params_.size(),
                "amp: FullyShard: a unit's parameters are not among the root's; pass the units' root module");
    check_same_model();
    at::NoGradGuard no_grad;
    for (auto& w : whole) {
      at::Tensor t = w;
      if (world > 1) pg_.broadcast(t, 0, "FullyShard parameter broadcast");
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      p.padded = detail::padded_shard(whole[i], p.layout, rank).view(p.layout.padded_shape());
      p.shard = p.padded.narrow(0, 0, p.layout.rows_of(rank)).detach().requires_grad_(true);
      // The module's tensor becomes the unsharded parameter: the compute
      // dtype, its own storage, freed now (allocated by each gather).
      p.module_param.set_data(at::empty(p.layout.shape, whole[i].options().dtype(compute_dtype())));
      // Its gradient accumulator, made (and kept) while it has its shape:
      // each gradient is counted once autograd has written it to .grad.
      accumulators_.push_back(torch::autograd::impl::grad_accumulator(p.module_param));
      hooks_.push_back(accumulators_.back()->add_post_hook(std::make_unique<AfterAccumulate>(this, i)));
      free_storage(p);
    }
    whole.clear();
    unsharded_bytes_ = peak_unsharded_bytes_ = 0;
  }

  void check_same_model() {
    std::string summary;
    for (const auto& p : params_) summary += p.name + ":" + c10::str(p.layout.shape) + ";";
    at::Tensor mine = at::zeros({2}, at::kLong);
    mine[0] = static_cast<int64_t>(std::hash<std::string>()(summary) & 0x7fffffffffffLL);
    mine[1] = static_cast<int64_t>(params_.size());
    if (pg_.world_size() == 1) return;
    const auto all = pg_.allgather(mine, "FullyShard model check");
    for (size_t r = 0; r < all.size(); ++r)
      TORCH_CHECK(at::equal(all[r], all[0]), "amp: FullyShard: rank ", r,
                  "'s model has other parameter names or shapes than rank 0's; every rank must build the same model");
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
      reshard(u);  // stale after a step: gathered again
      order_.begin_forward();
      unshard(u);
      prefetch(order_.first());
      return;
    } else {
      // In the root's backward: a recompute (amp::checkpoint around the
      // unit's call), which gathers the unit (or finds it gathered).
      TORCH_CHECK(in_root_forward_ || callback_queued_,
                  "amp: FullyShard::forward: a unit ran outside the root's forward; call the root "
                  "as fsdp.forward(root, ...) and the units inside it");
    }
    unshard(u);
    if (in_root_forward_) prefetch(order_.on_forward(index_of(u)));
  }

  size_t index_of(const detail::ShardUnit& u) const { return static_cast<size_t>(&u - units_.data()); }

  // Starts unit k's all-gather now, if prefetching and it is not gathered.
  void prefetch(size_t k) {
    if (!options_.prefetch() || pg_.world_size() == 1 || k == detail::UnitOrder::npos || units_[k].unsharded) return;
    if (!start_unshard(units_[k])) return;
    units_[k].prefetched = true;
    ++prefetched_allgathers_;
  }

  template <class R>
  R post_forward(detail::ShardUnit& u, R out) {
    // A recompute in backward (as FSDP2's forward in PRE_BACKWARD): the unit
    // stays gathered until its gradients are reduce-scattered; no hook.
    if (!u.root && !in_root_forward_) return out;
    const bool grad = at::GradMode::is_enabled();
    if (!u.root && (options_.reshard_after_forward() || !grad)) reshard(u);
    if (u.root) {
      in_root_forward_ = false;
      if (!grad) reshard(u);
      // A unit prefetched for a forward that did not run it: waited for and freed.
      for (auto& other : units_)
        if (other.gather) reshard(other);
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
    unshard(u);
    prefetch(u.root ? order_.begin_backward() : order_.on_backward(k));
  }

  // Parameter i's gradient of this backward is in its .grad. Without sync
  // it is added to the unsharded sum in reduce_dtype (FSDP2's
  // unsharded_accumulated_grad) and dropped; with sync, the unit is
  // reduce-scattered once all its gradients are in.
  void on_grad(size_t i) {
    detail::ShardedParam& p = params_[i];
    detail::ShardUnit& u = units_[p.unit];
    at::NoGradGuard no_grad;
    if (!sync_ || p.accumulated.defined()) {
      const at::Tensor g = p.module_param.grad();
      if (p.accumulated.defined())
        p.accumulated.add_(g);
      else
        p.accumulated = g.to(reduce_dtype(), /*non_blocking=*/false, /*copy=*/true);
      p.module_param.mutable_grad() = at::Tensor();
    }
    if (!sync_) return;
    u.ready.push_back(i);
    if (static_cast<size_t>(++u.arrived) == u.params.size()) reduce(u);
  }

  // Reduce-scatters the unit's ready gradients into the shards' .grad (as
  // FSDP2's foreach_reduce: _chunk_cat into an N x S buffer in reduce_dtype,
  // reduce-scatter with AVG, cast to fp32, each shard's gradient a view of
  // the result at its padded offset, added to an existing .grad), then frees
  // the unit.
  void reduce(detail::ShardUnit& u) {
    at::NoGradGuard no_grad;
    // In the unit's parameter order, as FSDP2's buffer, not as the gradients
    // arrived: Gloo's sum of an element depends on its offset in the buffer
    // (measured: arrival order differs from FSDP2 in the last bit at 3 ranks).
    std::sort(u.ready.begin(), u.ready.end());
    std::vector<at::Tensor> grads;
    std::vector<const detail::ShardLayout*> layouts;
    int64_t total = 0;
    for (size_t i : u.ready) {
      const auto& p = params_[i];
      grads.push_back(p.accumulated.defined() ? p.accumulated : p.module_param.grad());
      layouts.push_back(&params_[i].layout);
      total += params_[i].layout.padded_numel();
    }
    const int world = pg_.world_size();
    at::Tensor in = at::empty({world * total}, grads[0].options().dtype(reduce_dtype()));
    detail::chunk_cat(grads, layouts, in);
    grads.clear();
    at::Tensor out = at::empty({total}, in.options());
    if (world > 1)
      pg_.reduce_scatter_avg(out, in, "FullyShard reduce-scatter");
    else
      out.copy_(in);
    ++reduce_scatters_;
    if (world > 1) reduce_scattered_bytes_ += static_cast<int64_t>(in.nbytes());
    in = at::Tensor();
    if (out.scalar_type() != param_dtype()) out = out.to(param_dtype());
    int64_t off = 0;
    for (size_t i : u.ready) {
      detail::ShardedParam& p = params_[i];
      const int64_t n = p.layout.rows_of(pg_.rank()) * p.layout.inner;
      // A view of the reduce-scatter's output, as FSDP2's; detached, so that
      // an optimizer's zero_grad() may detach_() it.
      at::Tensor shard_grad = out.narrow(0, off, n).view(p.layout.shard_shape(pg_.rank())).detach();
      off += p.layout.padded_numel();
      if (p.shard.grad().defined())
        p.shard.mutable_grad().add_(shard_grad);
      else
        p.shard.mutable_grad() = shard_grad;
      p.accumulated = at::Tensor();
      p.module_param.mutable_grad() = at::Tensor();
    }
    u.ready.clear();
    u.arrived = 0;
    reshard(u);
  }

  // The end of a backward (queued by the root's pre-backward): units with
  // unused parameters reduce what arrived; every unit is freed; the unsharded
  // parameters' own .grad (written by autograd after each hook) dropped.
  void end_backward() {
    callback_queued_ = false;
    for (auto& u : units_) {
      if (sync_ && !u.ready.empty()) reduce(u);
      u.arrived = 0;
      reshard(u);
    }
    for (auto& p : params_) p.module_param.mutable_grad() = at::Tensor();
  }

  // Gathers the unit: waits for its prefetched all-gather, or issues one and waits.
  void unshard(detail::ShardUnit& u) {
    if (!u.unsharded) start_unshard(u);
    finish_unshard(u);
  }

  // Allocates the unit's parameters and starts its all-gather (true if one
  // was issued: not at one process, not for a unit without parameters).
  bool start_unshard(detail::ShardUnit& u) {
    for (size_t i : u.params) {
      const auto& p = params_[i];
      TORCH_CHECK(p.module_param.scalar_type() == compute_dtype(), "amp: FullyShard: parameter '", p.name, "' is ",
                  p.module_param.scalar_type(), " where FullyShard keeps it in ", compute_dtype(),
                  ": the module was converted after FullyShard took it (a Trainer<True<...>> converts its model); "
                  "with param_dtype set, drive FullyShard with a Stepper");
    }
    u.unsharded = true;
    if (u.params.empty()) return false;
    at::NoGradGuard no_grad;
    const int world = pg_.world_size();
    int64_t total = 0;
    for (size_t i : u.params) total += params_[i].layout.padded_numel();
    at::Tensor in = at::empty({total}, at::TensorOptions().dtype(compute_dtype()).device(pg_.device()));
    int64_t off = 0;
    for (size_t i : u.params) {
      const auto& l = params_[i].layout;
      in.narrow(0, off, l.padded_numel()).copy_(params_[i].padded.view({-1}));
      off += l.padded_numel();
    }
    for (size_t i : u.params) alloc_storage(params_[i]);
    u.gather_in = in;
    u.gather_out = in;
    if (world > 1) {
      u.gather_out = at::empty({world * total}, in.options());
      u.gather = pg_.start_allgather_into(u.gather_out, in, "FullyShard all-gather");
      ++allgathers_;
      allgathered_bytes_ += static_cast<int64_t>(u.gather_out.nbytes());
      return true;
    }
    return false;
  }

  // Waits for the unit's all-gather and copies each parameter's rows out of
  // it (a no-op where nothing is in flight).
  void finish_unshard(detail::ShardUnit& u) {
    if (!u.gather_in.defined()) return;
    at::NoGradGuard no_grad;
    const at::Tensor in = std::move(u.gather_in);
    const at::Tensor out = std::move(u.gather_out);
    u.gather_in = u.gather_out = at::Tensor();
    if (u.gather) {
      const auto work = std::exchange(u.gather, c10::intrusive_ptr<c10d::Work>());
      const bool early = std::exchange(u.prefetched, false);
      pg_.wait(work, early ? "FullyShard all-gather (prefetched)" : "FullyShard all-gather");
    }
    const int world = pg_.world_size();
    int64_t total = 0;
    for (size_t i : u.params) total += params_[i].layout.padded_numel();
    int64_t off = 0;
    for (size_t i : u.params) {
      auto& p = params_[i];
      const auto& l = p.layout;
      at::Tensor dst = at::from_blob(p.module_param.data_ptr(), {l.numel()}, in.options());
      for (int r = 0; r < world; ++r) {
        const int64_t n = l.rows_of(r) * l.inner;
        if (n > 0) dst.narrow(0, r * l.chunk * l.inner, n).copy_(out.narrow(0, r * total + off, n));
      }
      off += l.padded_numel();
    }
  }

  void reshard(detail::ShardUnit& u) {
    if (!u.unsharded) return;
    finish_unshard(u);  // a collective in flight is completed (every rank takes part) first
    u.unsharded = false;
    for (size_t i : u.params) free_storage(params_[i]);
  }

  // The unsharded parameter's storage, shared with every view autograd saved
  // of it: allocated and given the parameter's shape for a gather; freed and
  // the tensor shaped [0] (safe to touch) at rest.
  void alloc_storage(detail::ShardedParam& p) {
    c10::StorageImpl* s = p.module_param.storage().unsafeGetStorageImpl();
    const auto nbytes = static_cast<size_t>(p.layout.numel() * elem_size());
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    s->set_nbytes(nbytes);
    p.module_param.unsafeGetTensorImpl()->set_sizes_contiguous(p.layout.shape);
    unsharded_bytes_ += static_cast<int64_t>(nbytes);
    peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, unsharded_bytes_);
  }
  void free_storage(detail::ShardedParam& p) {
    c10::StorageImpl* s = p.module_param.storage().unsafeGetStorageImpl();
    unsharded_bytes_ -= static_cast<int64_t>(s->nbytes());
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
    s->set_nbytes(0);
    p.module_param.unsafeGetTensorImpl()->set_sizes_contiguous({0});
  }

  ProcessGroup pg_;
  FullyShardOptions options_;
  std::vector<detail::ShardedParam> params_;
  std::vector<detail::ShardUnit> units_;
  // shared_ptr up to LibTorch 2.x, intrusive_ptr on 2.14: whatever it returns.
  using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<AccumulatorPtr> accumulators_;
  std::vector<uintptr_t> hooks_;
  size_t root_ = 0;
  bool sync_ = true;
  bool in_root_forward_ = false;
  bool callback_queued_ = false;
  int64_t unsharded_bytes_ = 0;
  int64_t peak_unsharded_bytes_ = 0;
  int64_t allgathers_ = 0;
  int64_t prefetched_allgathers_ = 0;
  detail::UnitOrder order_;
  int64_t reduce_scatters_ = 0;
  int64_t allgathered_bytes_ = 0;
  int64_t reduce_scattered_bytes_ = 0;
};

}  // namespace amp
