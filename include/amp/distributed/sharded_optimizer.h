// amp/distributed/sharded_optimizer.h: ShardedOptimizer, ZeRO-1 on c10d: each
// process keeps the optimizer state of 1/N of the parameters.
//
//   amp::ProcessGroup pg = amp::init_process_group();
//   amp::ShardedOptimizer<torch::optim::AdamW> opt(pg, model->parameters(), torch::optim::AdamWOptions(1e-3));
//   amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, opt);
//   amp::DataParallel dp(pg, trainer);                   // gradients averaged as before
//   trainer.step(...);                                   // each rank steps its parameters, then all-gather
//   amp::save_on_rank0(pg, trainer, "ckpt.pt");          // the full state, in AdamW's own format
//
// The design of torch.distributed.optim.ZeroRedundancyOptimizer: whole
// parameters are assigned to ranks (per param group, largest first, each to
// the rank with the fewest elements so far: its _partition_parameters), and
// a local `Inner` optimizer on each rank holds only its own. This object's
// param_groups hold every parameter, so the GradScaler's inf check and
// gradient clipping see all gradients, which DataParallel's all-reduce made
// the same on every rank: one skip decision and one norm everywhere, no
// extra communication, and every parameter is updated by the same kernel on
// the same values as without sharding (bitwise equal to DataParallel alone).
// After the local step the parameters travel in one all-gather per dtype.
// docs/distributed.md has the bytes per parameter, the communication and
// the choice against Megatron's reduce-scatter.
//
// Checkpoints: save() writes Inner's own format with the state of every
// parameter (what an unsharded Inner writes), so a sharded run resumes
// unsharded, in one process or at another world size, and the reverse.
// With more than one process save() is a collective (it gathers the state):
// every rank must call it, as amp::save_on_rank0 does. load() needs no peer.
#pragma once

#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/checked_archive.h"
#include "amp/distributed/process_group.h"
#include "amp/optim/fused.h"
#include "amp/optim/supports_amp_scaling.h"
#include "amp/train/checkpoint.h"
#include "amp/distributed/detail/data_parallel_impl.h"

namespace amp {
namespace detail {

// The owner rank of each parameter (per group), as torch's
// ZeroRedundancyOptimizer._partition_parameters: per group, parameters by
// element count, largest first (a stable sort), each to the rank with the
// fewest elements so far (the lowest such rank); the counts carry over
// from group to group.
inline std::vector<std::vector<int>> partition_parameters(const std::vector<std::vector<int64_t>>& numels, int world) {
  std::vector<int64_t> sizes(static_cast<size_t>(world), 0);
  std::vector<std::vector<int>> owner(numels.size());
  for (size_t g = 0; g < numels.size(); ++g) {
    owner[g].assign(numels[g].size(), 0);
    std::vector<size_t> order(numels[g].size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[g][a] > numels[g][b]; });
    for (size_t i : order) {
      const auto r = static_cast<size_t>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      owner[g][i] = static_cast<int>(r);
      sizes[r] += numels[g][i];
    }
  }
  return owner;
}

// Every rank's bytes (any lengths), in rank order: two all-gathers over Gloo.
inline std::vector<std::string> allgather_bytes(const ProcessGroup& pg, const std::string& mine,
                                                const std::string& what) {
  const at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  std::vector<int64_t> lens;
  for (const auto& t : pg.allgather(len, what)) lens.push_back(t.item<int64_t>());
  const int64_t longest = *std::max_element(lens.begin(), lens.end());
  if (longest == 0) return std::vector<std::string>(lens.size());  // Gloo divides by the size of an empty all-gather
  at::Tensor padded = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(padded.data_ptr<uint8_t>()));
  std::vector<std::string> out;
  const auto all = pg.allgather(padded, what);
  for (size_t r = 0; r < all.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()), static_cast<size_t>(lens[r]));
  return out;
}

// What save_on_rank0 asks of an optimizer whose save() every rank must call.
class CollectiveSave {
 public:
  virtual ~CollectiveSave() = default;
};
}  // namespace detail

template <class Inner>
class ShardedOptimizer : public torch::optim::Optimizer, public SupportsAmpScaling, public detail::CollectiveSave {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Inner>,
                "amp: ShardedOptimizer<Inner> needs a torch::optim::Optimizer class, e.g. "
                "amp::ShardedOptimizer<torch::optim::AdamW>");
  static_assert(!std::is_base_of_v<torch::optim::LBFGS, Inner>,
                "amp: ShardedOptimizer does not shard LBFGS (its closure re-evaluates the loss on every rank's "
                "parameters); use torch::optim::LBFGS with DataParallel alone");

  using Factory = std::function<std::unique_ptr<Inner>(std::vector<torch::optim::OptimizerParamGroup>)>;

 public:
  // `groups` (or `params`) and `inner_args` as Inner takes them, e.g.
  // (pg, model->parameters(), torch::optim::AdamWOptions(1e-3)): every rank
  // passes the same parameter shapes in the same order (checked). The
  // parameters must be on one device.
  template <class... Args>
  ShardedOptimizer(ProcessGroup pg, std::vector<torch::optim::OptimizerParamGroup> groups, Args&&... inner_args)
      : ShardedOptimizer(std::move(pg), factory(std::forward<Args>(inner_args)...), std::move(groups)) {}
  template <class... Args>
  ShardedOptimizer(ProcessGroup pg, std::vector<at::Tensor> params, Args&&... inner_args)
      : ShardedOptimizer(std::move(pg), std::vector<torch::optim::OptimizerParamGroup>{std::move(params)},
                         std::forward<Args>(inner_args)...) {}

  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // This rank's parameters, stepped by Inner's own step(); then the all-gather.
  at::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(closure == nullptr,
                "amp: ShardedOptimizer does not take a closure (LBFGS-style optimizers are not sharded)");
    follow_learning_rates();
    inner_->step();
    gather_parameters();
    return at::Tensor();
  }

  // The fused path (Trainer, Stepper, Fabric take it): Inner's fused
  // kernels with grad_scale/found_inf where they serve it (FusedStep), else
  // torch's unfused recipe for this rank's gradients (unscale, then a host
  // read of found_inf to skip); then the all-gather.
  void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) override {
    follow_learning_rates();
    if (inner_fused_) {
      inner_fused_->step(grad_scale, found_inf);
    } else {
      if (grad_scale.defined()) {
        // GradScaler.unscale_'s arithmetic: the reciprocal in fp64, then fp32.
        const at::Tensor inv = grad_scale.to(at::kDouble).reciprocal().to(at::kFloat);
        for (const auto& group : inner_->param_groups())
          for (const auto& p : group.params())
            if (p.grad().defined()) p.grad().mul_(inv.to(p.grad().device()));
      }
      if (!found_inf.defined() || found_inf.item<float>() == 0.0f) inner_->step();
    }
    gather_parameters();
  }

  void make_state() override {
    TORCH_CHECK(false,
                "amp: a ShardedOptimizer's step cannot be captured in a CUDA graph (its all-gather runs on the host's "
                "schedule); train it eagerly");
  }

  // Inner's checkpoint of every parameter's state (the unsharded format).
  // More than one process: a collective, every rank calls it.
  void save(torch::serialize::OutputArchive& archive) const override {
    if (inner_fused_) inner_fused_->sync_optimizer_state();
    std::ostringstream mine;
    {
      torch::serialize::OutputArchive local;
      inner_->save(local);
      local.save_to(mine);
    }
    const std::vector<std::string> blobs =
        pg_.world_size() == 1 ? std::vector<std::string>{mine.str()}
                              : detail::allgather_bytes(pg_, mine.str(),
                                                        "ShardedOptimizer's state gather for a checkpoint (every rank "
                                                        "saves together: amp::save_on_rank0(pg, trainer, path))");
    std::unique_ptr<Inner> full = make_(param_groups_);
    for (int r = 0; r < pg_.world_size(); ++r) {
      std::unique_ptr<Inner> part = make_(groups_of(r));
      torch::serialize::InputArchive a =
          detail::read_archive(blobs[static_cast<size_t>(r)], device_,
                               "rank " + std::to_string(r) + "'s optimizer state", "the bytes its save() sent");
      part->load(a);
      for (auto& entry : part->state()) full->state()[entry.first] = std::move(entry.second);
    }
    full->save(archive);
  }

  // Any checkpoint of an Inner over the same parameters (sharded or not, any
  // world size): this rank keeps its parameters' state. Nothing changes when
  // it does not fit.
  void load(torch::serialize::InputArchive& archive) override {
    std::unique_ptr<Inner> full = make_(param_groups_);
    full->load(archive);
    detail::check_optimizer_state(*full);
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      param_groups_[g].set_options(full->param_groups()[g].options().clone());
      inner_->param_groups()[g].set_options(full->param_groups()[g].options().clone());
    }
    inner_->state().clear();
    for (const auto& group : inner_->param_groups())
      for (const auto& p : group.params()) {
        auto it = full->state().find(detail::fused::state_key(p));
        if (it != full->state().end()) inner_->state()[it->first] = std::move(it->second);
      }
    if (inner_fused_) inner_fused_->reload_optimizer_state();
  }

  // This rank's optimizer: its parameters and their state
  // (amp::optimizer_state_bytes(opt.local()) counts it).
  Inner& local() { return *inner_; }
  const Inner& local() const { return *inner_; }
  // Whether the fused path steps this rank's parameters with Inner's fused
  // kernels (no host sync); else torch's unfused recipe (one found_inf read).
  bool local_fused() const { return inner_fused_.has_value(); }
  // The rank that steps param group g's i-th parameter.
  int owner(size_t group, size_t index) const { return owner_.at(group).at(index); }
  // Parameter elements this rank steps.
  int64_t shard_numel() const {
    int64_t n = 0;
    for (const auto& group : inner_->param_groups())
      for (const auto& p : group.params()) n += p.numel();
    return n;
  }
  // Bytes each rank puts into the parameter all-gathers of one step (its
  // shard, padded to the largest rank's, per dtype).
  int64_t gathered_bytes() const {
    int64_t n = 0;
    for (const auto& d : dtypes_) n += d.longest * static_cast<int64_t>(c10::elementSize(d.dtype));
    return n;
  }
  const ProcessGroup& process_group() const { return pg_; }

 private:
  // The parameters of one dtype, by owner rank, and the longest rank's elements.
  struct DtypeShards {
    c10::ScalarType dtype;
    std::vector<std::vector<at::Tensor>> by_rank;
    int64_t longest = 0;
  };

  template <class... Args>
  static Factory factory(Args&&... inner_args) {
    return [args = std::make_tuple(std::decay_t<Args>(std::forward<Args>(inner_args))...)](
               std::vector<torch::optim::OptimizerParamGroup> groups) {
      return std::apply([&](const auto&... a) { return std::make_unique<Inner>(std::move(groups), a...); }, args);
    };
  }

  ShardedOptimizer(ProcessGroup pg, Factory make, std::vector<torch::optim::OptimizerParamGroup> groups)
      : ShardedOptimizer(std::move(pg), make, make(std::move(groups))) {}

  // `full`: Inner over every parameter, its groups' options completed from
  // its defaults (and checked by Inner); this object takes its groups.
  ShardedOptimizer(ProcessGroup pg, Factory make, std::unique_ptr<Inner> full)
      : torch::optim::Optimizer(full->param_groups(), full->defaults().clone()),
        pg_(std::move(pg)),
        make_(std::move(make)) {
    std::vector<at::Tensor> all;
    std::vector<std::vector<int64_t>> numels;
    for (const auto& group : param_groups_) {
      numels.emplace_back();
      for (const auto& p : group.params()) {
        TORCH_CHECK(p.defined(), "amp: ShardedOptimizer: parameter #", all.size(), " is undefined");
        numels.back().push_back(p.numel());
        all.push_back(p);
      }
    }
    TORCH_CHECK(!all.empty(), "amp: ShardedOptimizer needs parameters; got none");
    device_ = all.front().device();
    for (size_t i = 0; i < all.size(); ++i)
      TORCH_CHECK(all[i].device() == device_, "amp: ShardedOptimizer: parameter #", i, " is on ", all[i].device(),
                  " but #0 is on ", device_, "; put the whole model on one device (model->to(pg.device()))");
    detail::check_same_shapes(
        pg_, detail::shape_summary(all, {}), [](size_t i) { return "#" + std::to_string(i); }, "ShardedOptimizer");
    owner_ = detail::partition_parameters(numels, pg_.world_size());
    inner_ = make_(groups_of(pg_.rank()));
    if (detail::fused_kind(*inner_, device_.type()) != FusedKind::kNone) inner_fused_.emplace(*inner_);
    for (int r = 0; r < pg_.world_size(); ++r)
      for (const auto& group : groups_of(r))
        for (const auto& p : group.params()) {
          auto d =
              std::find_if(dtypes_.begin(), dtypes_.end(), [&](const auto& s) { return s.dtype == p.scalar_type(); });
          if (d == dtypes_.end()) {
            dtypes_.push_back(DtypeShards{
                p.scalar_type(), std::vector<std::vector<at::Tensor>>(static_cast<size_t>(pg_.world_size())), 0});
            d = std::prev(dtypes_.end());
          }
          d->by_rank[static_cast<size_t>(r)].push_back(p);
        }
    for (auto& d : dtypes_)
      for (const auto& list : d.by_rank) {
        int64_t n = 0;
        for (const auto& p : list) n += p.numel();
        d.longest = std::max(d.longest, n);
      }
  }

  // Rank r's param groups: every group, with the parameters r owns, in order.
  std::vector<torch::optim::OptimizerParamGroup> groups_of(int r) const {
    std::vector<torch::optim::OptimizerParamGroup> out;
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      std::vector<at::Tensor> mine;
      const auto& params = param_groups_[g].params();
      for (size_t i = 0; i < params.size(); ++i)
        if (owner_[g][i] == r) mine.push_back(params[i]);
      out.emplace_back(std::move(mine), param_groups_[g].options().clone());
    }
    return out;
  }

  // A learning-rate schedule sets this object's groups; Inner's follow.
  void follow_learning_rates() {
    for (size_t g = 0; g < param_groups_.size(); ++g)
      inner_->param_groups()[g].options().set_lr(param_groups_[g].options().get_lr());
  }

  // Every rank's parameters from their owner: one all-gather per dtype.
  void gather_parameters() {
    if (pg_.world_size() == 1) return;
    at::NoGradGuard no_grad;
    const auto me = static_cast<size_t>(pg_.rank());
    for (const auto& d : dtypes_) {
      if (d.longest == 0) continue;
      at::Tensor mine = at::zeros({d.longest}, at::TensorOptions().dtype(d.dtype).device(device_));
      int64_t off = 0;
      for (const auto& p : d.by_rank[me]) {
        mine.narrow(0, off, p.numel()).copy_(p.detach().reshape({-1}));
        off += p.numel();
      }
      const auto all = pg_.allgather(mine, "ShardedOptimizer's parameter all-gather");
      for (size_t r = 0; r < all.size(); ++r) {
        if (r == me) continue;
        off = 0;
        for (const auto& p : d.by_rank[r]) {
          p.detach().copy_(all[r].narrow(0, off, p.numel()).view(p.sizes()));
          off += p.numel();
        }
      }
    }
  }

  ProcessGroup pg_;
  Factory make_;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::vector<std::vector<int>> owner_;
  std::unique_ptr<Inner> inner_;
  mutable std::optional<FusedStep> inner_fused_;  // save() const brings its counters into Inner's state
  std::vector<DtypeShards> dtypes_;
};

}  // namespace amp
