// amp/distributed/detail/gradient_buckets.h: DataParallel's gradient buckets
// for one layout (detail/bucket_layout.h). Each parameter's gradient goes
// into its place in a flat buffer as backward produces it, times 1/N; a full
// bucket's all-reduce starts at once, buckets in layout order (the same on
// every rank); finish() waits for them and writes the sums, the averages,
// into .grad. The arithmetic is torch DDP's reducer's (reducer.cpp) or,
// with compression, its fp16/bf16 compress hook's. No lock of its own:
// DataParallel holds its mutex around every call.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/distributed/detail/bucket_layout.h"
#include "amp/distributed/process_group.h"

namespace amp::detail {

class GradientBuckets {
 public:
  // compress: the dtype DDP's fp16_compress_hook / bf16_compress_hook sends
  // (nullopt: the gradients' own, the reducer without a comm hook).
  GradientBuckets(ProcessGroup pg, std::vector<at::Tensor> params, std::optional<c10::ScalarType> compress)
      : pg_(std::move(pg)), params_(std::move(params)), compress_(compress) {}

  // Zeroed buffers for `layout` (nothing in flight); a parameter in no
  // bucket is left alone.
  void lay_out(const BucketLayout& layout) {
    buckets_.clear();
    where_.assign(params_.size(), {kNowhere, kNowhere});
    for (const auto& ids : layout) {
      Bucket b;
      int64_t numel = 0;
      for (size_t j : ids) {
        where_[j] = {buckets_.size(), b.offsets.size()};
        b.offsets.push_back(numel);
        numel += params_[j].numel();
      }
      b.flat = at::zeros({numel}, params_[ids.front()].options().requires_grad(false));
      b.params = ids;
      b.ready.assign(ids.size(), false);
      b.pending = ids.size();
      buckets_.push_back(std::move(b));
    }
    next_ = 0;
  }

  BucketLayout layout() const {
    BucketLayout out;
    for (const auto& b : buckets_) out.push_back(b.params);
    return out;
  }
  size_t count() const { return buckets_.size(); }
  int64_t allreduces() const { return allreduces_.load(); }  // issued so far
  bool in_flight() const {
    for (const auto& b : buckets_)
      if (b.work) return true;
    return false;
  }
  bool holds(size_t j) const { return where_[j].first != kNowhere; }
  // Parameter j's gradient is in its bucket (this boundary's backward).
  bool has(size_t j) const { return buckets_[where_[j].first].ready[where_[j].second]; }

  // Before a boundary's backward: every place empty.
  void begin() {
    for (auto& b : buckets_) {
      std::fill(b.ready.begin(), b.ready.end(), false);
      b.pending = b.params.size();
      b.work.reset();
    }
    next_ = 0;
  }

  // grad: parameter j's contribution of this backward (undefined: none);
  // its bucket gets the value .grad will hold after accumulation (earlier
  // micro-batches + grad), times 1/N without compression, as torch's
  // reducer copies it in (mark_variable_ready_dense: at::mul_out(bucket_view,
  // grad, wrapped_scalar_tensor(1.0 / N))); with compression, as it is (the
  // reducer's copy_ when a comm hook is registered). No gradient at all:
  // zeros (the reducer's zero_()).
  void add(size_t j, const at::Tensor& grad) {
    at::NoGradGuard no_grad;
    Bucket& b = buckets_[where_[j].first];
    const size_t k = where_[j].second;
    const at::Tensor& p = params_[j];
    at::Tensor s = slot(b, k);
    const at::Tensor old = p.grad();
    if (!grad.defined() && !old.defined()) {
      s.zero_();
    } else {
      // .grad after this backward: AccumulateGrad's old + grad (summed into
      // the slot), or the one that is defined.
      at::Tensor g = grad.defined() ? grad : old;
      if (grad.defined() && old.defined()) g = at::add_out(s, old, grad);
      if (compress_) {
        if (!g.is_same(s)) s.copy_(g);
      } else {
        // World size 1 multiplies by 1.0: exact, .grad as without DataParallel.
        at::mul_out(s, g, at::native::wrapped_scalar_tensor(1.0 / static_cast<double>(pg_.world_size())));
      }
    }
    b.ready[k] = true;
    --b.pending;
  }

  // The parameters whose gradient is not in yet, in layout order.
  std::vector<size_t> missing() const {
    std::vector<size_t> out;
    for (const auto& b : buckets_)
      for (size_t k = 0; k < b.params.size(); ++k)
        if (!b.ready[k]) out.push_back(b.params[k]);
    return out;
  }

  // Starts the all-reduce of each full bucket, in layout order (the same order on every rank).
  void launch_ready() {
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
      auto& b = buckets_[next_++];
      at::NoGradGuard no_grad;
      if (!compress_) {
        b.comm = b.flat;  // already times 1/N (add)
      } else {
        // fp16_compress_hook / bf16_compress_hook (torch/distributed/algorithms/
        // ddp_comm_hooks/default_hooks.py): buffer.to(dtype).div_(world_size),
        // the integer world size, in the wire dtype.
        b.comm = b.flat.to(*compress_);
        b.comm.div_(static_cast<int64_t>(pg_.world_size()));
      }
      // A dtype this LibTorch's Gloo lacks (16-bit gradients on some builds):
      // an fp32 copy is summed; finish() rounds it back once.
      const c10::ScalarType wire = pg_.wire_dtype(b.comm);
      if (wire != b.comm.scalar_type()) b.comm = b.comm.to(wire);
      b.work = pg_.start_allreduce(b.comm, "gradient all-reduce");
      ++allreduces_;
    }
  }

  // Waits for every bucket's all-reduce (all launched) and writes the
  // averages into .grad.
  void finish() {
    at::NoGradGuard no_grad;
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      auto& b = buckets_[bi];
      pg_.wait(b.work,
               "gradient all-reduce (bucket " + std::to_string(bi) + " of " + std::to_string(buckets_.size()) + ")");
      b.work.reset();
      // The sum is the average (each term was scaled by 1/N on the way in);
      // world size 1: the gradient itself, bit for bit.
      if (!b.comm.is_same(b.flat)) b.flat.copy_(b.comm);  // compressed or widened: back to the gradients' dtype
      b.comm.reset();
      for (size_t k = 0; k < b.params.size(); ++k) {
        at::Tensor& p = params_[b.params[k]];
        const at::Tensor avg = slot(b, k);
        if (p.grad().defined()) {
          p.mutable_grad().copy_(avg);
        } else {
          p.mutable_grad() = avg.clone();
        }
      }
    }
  }

 private:
  // One flat all-reduce buffer for a run of same-dtype parameters.
  struct Bucket {
    at::Tensor flat;               // the gradients, side by side
    at::Tensor comm;               // what is all-reduced (flat, or its fp16/bf16 copy)
    std::vector<size_t> params;    // indices into the parameters
    std::vector<int64_t> offsets;  // each parameter's offset in flat
    std::vector<bool> ready;       // per parameter: its gradient is in flat
    size_t pending = 0;            // parameters not ready yet
    c10::intrusive_ptr<c10d::Work> work;
  };
  static constexpr size_t kNowhere = static_cast<size_t>(-1);

  at::Tensor slot(Bucket& b, size_t k) {
    const at::Tensor& p = params_[b.params[k]];
    return b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
  }

  ProcessGroup pg_;
  std::vector<at::Tensor> params_;
  std::optional<c10::ScalarType> compress_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // per parameter: bucket, place (kNowhere: none)
  size_t next_ = 0;                               // the next bucket to launch
  std::atomic<int64_t> allreduces_{0};
};

}  // namespace amp::detail
