// amp/train/detail/saved_ops.h: the op cache under amp::checkpoint's
// selective policy (CheckpointOptions::save_matmuls), torch 2.4's
// create_selective_checkpoint_contexts with MUST_SAVE for the matmuls and
// PREFER_RECOMPUTE for everything else.
//
//   SavedOps cache;
//   { SavedOpsScope forward(&cache, nullptr); y = fn(x); }      // the matmuls' outputs kept
//   { SavedOpsScope recompute(nullptr, &cache); y = fn(x); }    // handed back, in order
//
// How: kernels for aten::mm, addmm, bmm, baddbmm on
// DispatchKey::ADInplaceOrView, below Autograd and Autocast, where those
// functional ops fall through otherwise (every tensor that autograd sees
// carries the key; the autograd kernel redispatches to it).
// Torch's _CachingTorchDispatchMode sits at the same level (the Python key,
// after autocast's casts and CompositeImplicitAutograd's decompositions), so
// the same calls are seen: linear's addmm, matmul's mm or bmm. Autograd above
// records each call's usual backward node in the recompute; only the matmul
// itself is not run again. With no scope on the thread a kernel redispatches
// at once. Registered once per process, on the first selective checkpoint.
//
// The forward keeps a copy of each output, not the output itself: code after
// the matmul may write into it (C++'s F::linear adds its bias in place to
// matmul's result, which shares mm's storage through _unsafe_view with a
// version counter of its own), and the recompute needs what the matmul
// returned. torch keeps the tensor itself and checks its version counter,
// which misses that case (the recompute then adds the bias twice).
//
// Not aten::_scaled_mm (float8): it has no derivative, and autograd's
// not-implemented kernel redispatches it past ADInplaceOrView (seen on 2.14,
// from C++ and from Python's torch.library alike), so a kernel there never
// runs; float8 linears are recomputed in full.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/baddbmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/mm_ops.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/thread_state_guard.h"

namespace amp {
namespace detail {

// The saved outputs of one checkpointed forward, in call order.
class SavedOps {
 public:
  // One call: the op, its tensor arguments (dtype, dims, sizes, each), the output.
  struct Entry {
    const char* op;
    std::vector<int64_t> args;
    at::Tensor out;
  };

  void push(const char* op, std::vector<int64_t> args, const at::Tensor& out) {
    // A copy with the output's sizes and strides, made below autograd.
    at::Tensor copy = at::empty_strided(out.sizes(), out.strides(), out.options());
    copy.copy_(out);
    bytes_ += static_cast<int64_t>(copy.storage().nbytes());
    entries_.push_back(Entry{op, std::move(args), std::move(copy)});
  }

  // The next saved output, which must come from the same op on arguments of
  // the same dtypes and sizes; it leaves the cache (the recompute's graph
  // holds it from here on, as long as a backward node saves it).
  at::Tensor pop(const char* op, const std::vector<int64_t>& args) {
    TORCH_CHECK(next_ < entries_.size(), "amp: checkpoint's recompute called ", op, " (", describe(args),
                ") after the ", entries_.size(),
                " saved matmul outputs of the forward were used up; fn must call "
                "the same matmuls each time (no state that changes between calls, no branch on grad mode)");
    Entry& e = entries_[next_];
    TORCH_CHECK(std::strcmp(e.op, op) == 0 && e.args == args, "amp: checkpoint's recompute called ", op, " (",
                describe(args), ") where the forward's saved call #", next_, " was ", e.op, " (", describe(e.args),
                "); fn must call the same matmuls in the same order each time (no state that changes between "
                "calls, no branch on grad mode)");
    ++next_;
    bytes_ -= static_cast<int64_t>(e.out.storage().nbytes());
    return std::move(e.out);
  }

  // After a recompute: every saved output was handed back.
  void expect_used_up() const {
    TORCH_CHECK(next_ == entries_.size(), "amp: checkpoint's recompute used ", next_, " of the forward's ",
                entries_.size(), " saved matmul outputs (the next: ", next_ < entries_.size() ? entries_[next_].op : "",
                "); fn must call the same matmuls each time");
  }

  size_t size() const { return entries_.size(); }  // calls saved by the forward
  size_t used() const { return next_; }            // of them handed back so far
  int64_t bytes() const { return bytes_; }         // storage held now
  const Entry& entry(size_t i) const { return entries_.at(i); }

  static std::string describe(const std::vector<int64_t>& args) {
    std::string s;
    for (size_t i = 0; i < args.size();) {
      s += (s.empty() ? "" : ", ") + std::string(c10::toString(static_cast<c10::ScalarType>(args[i]))) + "[";
      const auto dims = static_cast<size_t>(args[i + 1]);
      for (size_t d = 0; d < dims; ++d) s += (d ? ", " : "") + std::to_string(args[i + 2 + d]);
      s += "]";
      i += 2 + dims;
    }
    return s;
  }

 private:
  std::deque<Entry> entries_;
  size_t next_ = 0;
  int64_t bytes_ = 0;
};

// The thread's scopes: the forward that saves, the recompute that replays.
struct SavedOpsState {
  SavedOps* saving = nullptr;
  SavedOps* replaying = nullptr;
};

inline SavedOpsState& saved_ops_state() {
  static thread_local SavedOpsState state;
  return state;
}

// The thread's calls inside those scopes: run below the cache, or handed back from it.
struct SavedOpsCounts {
  uint64_t computed = 0, replayed = 0;
};

inline SavedOpsCounts& saved_ops_counts() {
  static thread_local SavedOpsCounts counts;
  return counts;
}

// The tensor arguments of a call, as the cache compares them.
inline void add_arg(std::vector<int64_t>& out, const at::Tensor& t) {
  if (!t.defined()) return;
  out.push_back(static_cast<int64_t>(t.scalar_type()));
  out.push_back(t.dim());
  for (int64_t s : t.sizes()) out.push_back(s);
}
inline void add_arg(std::vector<int64_t>& out, const c10::optional<at::Tensor>& t) {
  if (t.has_value()) add_arg(out, *t);
}
template <class T>
void add_arg(std::vector<int64_t>&, const T&) {}

// The kernel on ADInplaceOrView for one op (Op: at::_ops::mm and the like).
template <class Op, class Schema = typename Op::schema>
struct SavedOpKernel;

template <class Op, class... Args>
struct SavedOpKernel<Op, at::Tensor(Args...)> {
  static at::Tensor run(c10::DispatchKeySet keys, Args... args) {
    const c10::DispatchKeySet below =
        keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::ADInplaceOrView);
    const SavedOpsState& s = saved_ops_state();
    if (s.saving == nullptr && s.replaying == nullptr) return Op::redispatch(below, args...);
    std::vector<int64_t> described;
    (add_arg(described, args), ...);
    at::Tensor out = s.replaying != nullptr ? s.replaying->pop(Op::name, described) : Op::redispatch(below, args...);
    ++(s.replaying != nullptr ? saved_ops_counts().replayed : saved_ops_counts().computed);
    if (s.saving != nullptr) {
      at::AutoDispatchBelowADInplaceOrView plain;
      s.saving->push(Op::name, std::move(described), out);
    }
    return out;
  }
};

template <class Op>
void register_saved_op(torch::Library& library) {
  const auto op = c10::Dispatcher::singleton().findSchema({Op::name, Op::overload_name});
  TORCH_CHECK(!op.has_value() || !op->hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView), "amp: ", Op::name,
              " already has a kernel on the ADInplaceOrView dispatch key in this program, where amp::checkpoint's "
              "selective policy needs its own; use CheckpointOptions().save_matmuls(false)");
  library.impl(Op::name + std::strlen("aten::"), TORCH_FN(SavedOpKernel<Op>::run));
}

// Registers the kernels once per process.
inline void register_saved_op_kernels() {
  static const bool registered = [] {
    static torch::Library kernels(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
    register_saved_op<at::_ops::mm>(kernels);
    register_saved_op<at::_ops::addmm>(kernels);
    register_saved_op<at::_ops::bmm>(kernels);
    register_saved_op<at::_ops::baddbmm>(kernels);
    return true;
  }();
  (void)registered;
}

// RAII: the thread's matmuls save into `saving` and come from `replaying`
// (either may be null) until the scope dies; the enclosing scopes come back after.
class SavedOpsScope {
 public:
  SavedOpsScope(SavedOps* saving, SavedOps* replaying) : guard_(saved_ops_state(), scoped(saving, replaying)) {}

 private:
  static SavedOpsState scoped(SavedOps* saving, SavedOps* replaying) {
    if (saving != nullptr || replaying != nullptr) register_saved_op_kernels();
    return SavedOpsState{saving, replaying};
  }
  ThreadStateGuard<SavedOpsState> guard_;  // no key: the kernels sit on ADInplaceOrView
};

}  // namespace detail
}  // namespace amp
