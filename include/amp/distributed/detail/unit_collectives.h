// amp/distributed/detail/unit_collectives.h: FullyShard's collectives and
// the storage they fill: a unit's all-gather of its shards into its
// parameters' own storage (allocated for it, freed after), the
// reduce-scatter of its gradients into the shards' .grad once a backward
// has produced them all, the gradient norm's all-reduce for clipping, and
// the bytes held and the collectives issued so far.
//
//   UnitCollectives c(pg, params, compute_dtype, reduce_dtype);  // params: outlive c
//   c.unshard(u); ...; c.reshard(u);      // a unit's forward
//   c.add_gradient(i, u, sync);           // parameter i's .grad is in: u reduced once all are
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "amp/distributed/detail/shard_layout.h"
#include "amp/distributed/detail/shard_units.h"
#include "amp/distributed/process_group.h"

namespace amp::detail {

class UnitCollectives {
 public:
  // The shards are fp32 (the parameters' dtype); units are gathered in
  // compute_dtype, gradients reduce-scattered in reduce_dtype. `params` are
  // the parameters the units index, which outlive this.
  UnitCollectives(ProcessGroup pg, std::vector<ShardedParam>& params, c10::ScalarType compute_dtype,
                  c10::ScalarType reduce_dtype)
      : pg_(std::move(pg)), params_(params), compute_dtype_(compute_dtype), reduce_dtype_(reduce_dtype) {}

  // Gathers the unit: waits for its prefetched all-gather, or issues one and waits.
  void unshard(ShardUnit& u) {
    if (!u.unsharded) start_unshard(u);
    finish_unshard(u);
  }

  // Allocates the unit's parameters and starts its all-gather (true if one
  // was issued: not at one process, not for a unit without parameters).
  bool start_unshard(ShardUnit& u) {
    for (size_t i : u.params) {
      const auto& p = params_[i];
      TORCH_CHECK(p.module_param.scalar_type() == compute_dtype_, "amp: FullyShard: parameter '", p.name, "' is ",
                  p.module_param.scalar_type(), " where FullyShard keeps it in ", compute_dtype_,
                  ": the module was converted after FullyShard took it (a Trainer<True<...>> converts its model); "
                  "with param_dtype set, drive FullyShard with a Stepper");
    }
    u.unsharded = true;
    if (u.params.empty()) return false;
    at::NoGradGuard no_grad;
    const int world = pg_.world_size();
    int64_t total = 0;
    for (size_t i : u.params) total += params_[i].layout.padded_numel();
    at::Tensor in = at::empty({total}, at::TensorOptions().dtype(compute_dtype_).device(pg_.device()));
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

  void reshard(ShardUnit& u) {
    if (!u.unsharded) return;
    finish_unshard(u);  // a collective in flight is completed (every rank takes part) first
    u.unsharded = false;
    for (size_t i : u.params) free_storage(params_[i]);
  }

  // Frees a module tensor's storage that no gather allocated (at setup):
  // not counted in unsharded_bytes().
  void free_unowned(ShardedParam& p) { release(p); }

  // Parameter i (of unit u) has this backward's gradient in its .grad.
  // Without sync it is added to the unsharded sum in reduce_dtype (FSDP2's
  // unsharded_accumulated_grad) and dropped; with sync, the unit is
  // reduce-scattered once all its gradients are in.
  void add_gradient(size_t i, ShardUnit& u, bool sync) {
    ShardedParam& p = params_[i];
    at::NoGradGuard no_grad;
    if (!sync || p.accumulated.defined()) {
      const at::Tensor g = p.module_param.grad();
      if (p.accumulated.defined())
        p.accumulated.add_(g);
      else
        p.accumulated = g.to(reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
      p.module_param.mutable_grad() = at::Tensor();
    }
    if (!sync) return;
    u.ready.push_back(i);
    if (static_cast<size_t>(++u.arrived) == u.params.size()) reduce(u);
  }

  // Reduce-scatters the unit's ready gradients into the shards' .grad (as
  // FSDP2's foreach_reduce: _chunk_cat into an N x S buffer in reduce_dtype,
  // reduce-scatter with AVG, cast to fp32, each shard's gradient a view of
  // the result at its padded offset, added to an existing .grad), then frees
  // the unit.
  void reduce(ShardUnit& u) {
    at::NoGradGuard no_grad;
    // In the unit's parameter order, as FSDP2's buffer, not as the gradients
    // arrived: Gloo's sum of an element depends on its offset in the buffer
    // (measured: arrival order differs from FSDP2 in the last bit at 3 ranks).
    std::sort(u.ready.begin(), u.ready.end());
    std::vector<at::Tensor> grads;
    std::vector<const ShardLayout*> layouts;
    int64_t total = 0;
    for (size_t i : u.ready) {
      const auto& p = params_[i];
      grads.push_back(p.accumulated.defined() ? p.accumulated : p.module_param.grad());
      layouts.push_back(&params_[i].layout);
      total += params_[i].layout.padded_numel();
    }
    const int world = pg_.world_size();
    at::Tensor in = at::empty({world * total}, grads[0].options().dtype(reduce_dtype_));
    chunk_cat(grads, layouts, in);
    grads.clear();
    at::Tensor out = at::empty({total}, in.options());
    if (world > 1)
      pg_.reduce_scatter_avg(out, in, "FullyShard reduce-scatter");
    else
      out.copy_(in);
    ++reduce_scatters_;
    if (world > 1) reduce_scattered_bytes_ += static_cast<int64_t>(in.nbytes());
    in = at::Tensor();
    if (out.scalar_type() != at::kFloat) out = out.to(at::kFloat);
    int64_t off = 0;
    for (size_t i : u.ready) {
      ShardedParam& p = params_[i];
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

  // Clips the shards' gradients by their global norm (arguments checked by
  // the caller): each shard's norm, stacked, raised to norm_type, summed over
  // the ranks (one all-reduce), raised to 1/norm_type, the norm of those;
  // returns it.
  at::Tensor clip_grad_norm(double max_norm, double norm_type) {
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

  // This rank's padded shards; its shards' gradients (each storage once).
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
  // The unit's unsharded parameters in the compute dtype.
  int64_t unit_bytes(const ShardUnit& u) const {
    int64_t n = 0;
    for (size_t i : u.params) n += params_[i].layout.numel() * elem_size();
    return n;
  }
  int64_t unsharded_bytes() const { return unsharded_bytes_; }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }
  void reset_peak() { peak_unsharded_bytes_ = unsharded_bytes_; }
  int64_t allgathers() const { return allgathers_; }
  int64_t reduce_scatters() const { return reduce_scatters_; }
  int64_t allgathered_bytes() const { return allgathered_bytes_; }
  int64_t reduce_scattered_bytes() const { return reduce_scattered_bytes_; }

 private:
  int64_t elem_size() const { return static_cast<int64_t>(c10::elementSize(compute_dtype_)); }

  // Waits for the unit's all-gather and copies each parameter's rows out of
  // it (a no-op where nothing is in flight).
  void finish_unshard(ShardUnit& u) {
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

  // The unsharded parameter's storage, shared with every view autograd saved
  // of it: allocated and given the parameter's shape for a gather; freed and
  // the tensor shaped [0] (safe to touch) at rest.
  void alloc_storage(ShardedParam& p) {
    c10::StorageImpl* s = p.module_param.storage().unsafeGetStorageImpl();
    const auto nbytes = static_cast<size_t>(p.layout.numel() * elem_size());
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    s->set_nbytes(nbytes);
    p.module_param.unsafeGetTensorImpl()->set_sizes_contiguous(p.layout.shape);
    unsharded_bytes_ += static_cast<int64_t>(nbytes);
    peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, unsharded_bytes_);
  }
  void free_storage(ShardedParam& p) { unsharded_bytes_ -= release(p); }
  // Frees the storage and returns its bytes.
  static int64_t release(ShardedParam& p) {
    c10::StorageImpl* s = p.module_param.storage().unsafeGetStorageImpl();
    const auto nbytes = static_cast<int64_t>(s->nbytes());
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
    s->set_nbytes(0);
    p.module_param.unsafeGetTensorImpl()->set_sizes_contiguous({0});
    return nbytes;
  }

  ProcessGroup pg_;
  std::vector<ShardedParam>& params_;
  c10::ScalarType compute_dtype_;
  c10::ScalarType reduce_dtype_;
  int64_t unsharded_bytes_ = 0;
  int64_t peak_unsharded_bytes_ = 0;
  int64_t allgathers_ = 0;
  int64_t reduce_scatters_ = 0;
  int64_t allgathered_bytes_ = 0;
  int64_t reduce_scattered_bytes_ = 0;
};

}  // namespace amp::detail
