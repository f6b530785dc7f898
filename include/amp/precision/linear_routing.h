// amp/precision/linear_routing.h: linear routing — inside a Mixed region, LibTorch's C++
// linear layers reach aten::linear, as Python's nn.Linear does, so autocast
// casts each weight once per region instead of once per call.
//
//   amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;    // routing on (the default)
//   auto loss = d(real).mean() + d(fake).mean();   // d's weights cast to bf16 once, as in Python
//   amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> off(
//       amp::RegionOptions().linear_routing(amp::LinearRouting::kOff));   // LibTorch's own linears
//
// Why: torch::nn::functional::linear (the same in 1.13's and 2.14's headers) computes
// torch::addmm(bias, x, weight.t()) for 2-D input with a bias and
// x.matmul(weight.t()) otherwise. Autocast caches its 16-bit copy only of a
// leaf that requires grad; weight.t() is a view, so C++ casts the weight at
// every call, where Python's aten::linear casts the weight itself, once per
// autocast region. A module called twice per step then sums its weight
// gradients in fp32 in C++ and in 16 bits in Python: other bits from step 1.
//
// How: while a routing region lives, a TLS-included dispatch key
// (TESTING_ONLY_GenericWrapper, above Autograd and Autocast) has kernels for
// aten::addmm, aten::matmul and aten::linear, and a fallthrough for every
// other op (which therefore costs nothing). addmm(b, x, w.t()) (2-D x,
// beta = alpha = 1) and matmul(x, w.t()), where w.t() is exactly the
// transpose of a 2-D leaf that requires grad, become one linear(x, w[, b]);
// every linear on such a weight then runs the thread's LinearFn
// (detail::set_linear_fn; at::linear by default, which is what Python runs
// and bitwise what the unrouted addmm/matmul compute for one call). With a
// LinearFn of its own (float8), the bias that F::linear adds after a routed
// matmul (input of more than 2 dims) is cast to the output's dtype first, as
// that LinearFn adds a bias (aten::add_ has a kernel for that one call, from
// the first LinearFn on). Only the ops user code calls itself are seen (the
// key is excluded while a kernel runs); nothing is routed inside autocast's
// kernels, where autocast is off (full_precision), or inside backward.
// docs/regions.md, "Linear routing", has the coverage (Bilinear, RNN cells,
// MultiheadAttention) and what stays different.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/linear_ops.h>
#include <ATen/ops/matmul_ops.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/Scalar.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>

#include "amp/detail/compat_ops.h"
#include "amp/detail/thread_state_guard.h"
#include "amp/precision/detail/autocast_tls.h"

namespace amp {

// Whether a Mixed region routes LibTorch's C++ linear layers to aten::linear.
enum class LinearRouting : std::uint8_t {
  kOff,  // LibTorch's own ops: a weight is cast at each call
  kOn,   // one aten::linear per layer call: a weight is cast once per region, as in Python
};

namespace detail {
inline const char* to_string(LinearRouting mode) { return mode == LinearRouting::kOn ? "on" : "off"; }

inline constexpr c10::DispatchKey kLinearRoutingKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

// What a routed linear runs: input, the weight parameter itself (not its
// transpose), and the bias (nullopt or undefined: none). Null: at::linear.
// A later feature (fp8 linears) installs its own, for the weights it knows.
using LinearFn = at::Tensor (*)(const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias);

// A routed linear whose weight a precision map claims (amp/precision/precision_map.h):
// runs it into `out` and returns true; false: not mapped.
using MappedLinearFn = bool (*)(const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, c10::DeviceType device, at::Tensor& out);

struct LinearRoutingState {
  bool on = false;
  c10::DeviceType device = c10::DeviceType::CPU;
  LinearFn fn = nullptr;
  MappedLinearFn mapped = nullptr;  // checked before fn
  // The output of the last matmul(x, w.t()) routed while `fn` is set (identity only):
  // LibTorch's C++ F::linear adds the bias to it next (`output += bias`, in
  // the fp32 bias's precision); routed_add_ casts that bias to the output's
  // dtype first, as `fn`'s own linear(x, w, bias) does (float8: torchao's
  // `y + bias.to(y.dtype)`).
  const c10::TensorImpl* bias_pending = nullptr;
  // The recipe that set `fn` when no other LinearFn may replace it while it
  // is in force (a block-scaled Float8 region: amp/float8/policy.h; float8's
  // guards refuse), else null.
  const char* fixed_by = nullptr;
};

inline LinearRoutingState& linear_routing_state() {
  static thread_local LinearRoutingState state;
  return state;
}

void register_bias_cast_kernel();

// This thread's LinearFn (null: at::linear); returns the previous one.
inline LinearFn set_linear_fn(LinearFn fn) {
  if (fn != nullptr) register_bias_cast_kernel();
  LinearFn prev = linear_routing_state().fn;
  linear_routing_state().fn = fn;
  return prev;
}

// RAII: this thread's LinearFn is `fn`, and LinearRoutingState::fixed_by
// `fixed_by`, while it lives; the previous ones come back after.
class LinearFnGuard {
 public:
  explicit LinearFnGuard(LinearFn fn, const char* fixed_by = nullptr)
      : prev_(set_linear_fn(fn)), prev_fixed_by_(std::exchange(linear_routing_state().fixed_by, fixed_by)) {}
  ~LinearFnGuard() {
    set_linear_fn(prev_);
    linear_routing_state().fixed_by = prev_fixed_by_;
  }
  LinearFnGuard(const LinearFnGuard&) = delete;
  LinearFnGuard& operator=(const LinearFnGuard&) = delete;

 private:
  LinearFn prev_;
  const char* prev_fixed_by_;
};

// The weight w if t is exactly w.t() for a 2-D leaf w that requires grad (a
// parameter: what autocast caches), else an undefined tensor.
inline at::Tensor transposed_leaf(const at::Tensor& t) {
  if (!t.defined() || t.dim() != 2 || !t.is_view()) return {};
  const at::TensorBase& w = t._base();
  if (w.dim() != 2 || !w.requires_grad() || !w.is_leaf() || w.is_view()) return {};
  if (t.sizes()[0] != w.sizes()[1] || t.sizes()[1] != w.sizes()[0] || t.strides()[0] != w.strides()[1] ||
      t.strides()[1] != w.strides()[0] || t.storage_offset() != w.storage_offset()) {
    return {};
  }
  return at::Tensor(w);
}

// Whether a linear on `weight` is routed now: a routing region, the region's
// device, autocast on for it (not inside autocast's own kernels or a
// full_precision island), not inside backward.
inline bool routes(const LinearRoutingState& s, const at::Tensor& weight) {
  return s.on && weight.device().type() == s.device && !autocast_dispatch_excluded(s.device) && !in_backward_pass();
}

inline bool is_one(const c10::Scalar& s) { return !s.isComplex() && s.toDouble() == 1.0; }

// A routed linear: the precision map's, else the LinearFn's, else at::linear.
inline at::Tensor run_linear(const LinearRoutingState& s, const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias) {
  at::Tensor out;
  if (s.mapped != nullptr && s.mapped(input, weight, bias, s.device, out)) return out;
  return s.fn ? s.fn(input, weight, bias) : at::_ops::linear::call(input, weight, bias);
}

inline c10::DispatchKeySet below_routing(c10::DispatchKeySet keys) {
  return keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kLinearRoutingKey);
}

// The kernels on kLinearRoutingKey. Each runs with the key excluded, so the
// ops it calls in turn are never routed.
inline at::Tensor routed_addmm(c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& mat1,
                               const at::Tensor& mat2, const c10::Scalar& beta, const c10::Scalar& alpha) {
  c10::impl::ExcludeDispatchKeyGuard nested(kLinearRoutingKey);
  const LinearRoutingState& s = linear_routing_state();
  if (s.on && mat1.dim() == 2 && is_one(beta) && is_one(alpha)) {
    const at::Tensor w = transposed_leaf(mat2);
    if (w.defined() && routes(s, w)) return run_linear(s, mat1, w, self);
  }
  return at::_ops::addmm::redispatch(below_routing(keys), self, mat1, mat2, beta, alpha);
}

inline at::Tensor routed_matmul(c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& other) {
  c10::impl::ExcludeDispatchKeyGuard nested(kLinearRoutingKey);
  LinearRoutingState& s = linear_routing_state();
  if (s.on) {
    const at::Tensor w = transposed_leaf(other);
    if (w.defined() && routes(s, w)) {
      at::Tensor out = run_linear(s, self, w, c10::nullopt);
      s.bias_pending = s.fn ? out.unsafeGetTensorImpl() : nullptr;  // mapped or not: one rule per region
      return out;
    }
  }
  return at::_ops::matmul::redispatch(below_routing(keys), self, other);
}

// F::linear's `output += bias` right after a matmul routed to a LinearFn:
// the bias in the output's dtype (see LinearRoutingState::bias_pending).
inline at::Tensor& routed_add_(c10::DispatchKeySet keys, at::Tensor& self, const at::Tensor& other,
                               const c10::Scalar& alpha) {
  c10::impl::ExcludeDispatchKeyGuard nested(kLinearRoutingKey);
  LinearRoutingState& s = linear_routing_state();
  const bool pending = s.bias_pending != nullptr && s.bias_pending == self.unsafeGetTensorImpl();
  s.bias_pending = nullptr;
  if (pending && is_one(alpha) && other.dim() == 1 && other.scalar_type() != self.scalar_type())
    return at::_ops::add__Tensor::redispatch(below_routing(keys), self, other.to(self.scalar_type()), alpha);
  return at::_ops::add__Tensor::redispatch(below_routing(keys), self, other, alpha);
}

inline at::Tensor routed_linear(c10::DispatchKeySet keys, const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard nested(kLinearRoutingKey);
  const LinearRoutingState& s = linear_routing_state();
  if (s.on && (s.fn || s.mapped) && routes(s, weight)) return run_linear(s, input, weight, bias);
  return at::_ops::linear::redispatch(below_routing(keys), input, weight, bias);
}

// Registers the kernels and the fallthrough once per process.
inline void register_linear_routing_kernels() {
  static const bool registered = [] {
    TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kLinearRoutingKey),
                "amp: linear routing needs the dispatch key TESTING_ONLY_GenericWrapper, but this program already "
                "registered a fallback for it; turn linear routing off (amp::LinearRouting::kOff)");
    static torch::Library fallthrough(torch::Library::IMPL, "_", kLinearRoutingKey, __FILE__, __LINE__);
    fallthrough.fallback(torch::CppFunction::makeFallthrough());
    static torch::Library kernels(torch::Library::IMPL, "aten", kLinearRoutingKey, __FILE__, __LINE__);
    kernels.impl("addmm", TORCH_FN(routed_addmm));
    kernels.impl("matmul", TORCH_FN(routed_matmul));
    kernels.impl("linear", TORCH_FN(routed_linear));
    return true;
  }();
  (void)registered;
}

// routed_add_, registered once per process when a LinearFn is first
// installed: until then every add_ in a routing region falls through.
inline void register_bias_cast_kernel() {
  static const bool registered = [] {
    static torch::Library kernel(torch::Library::IMPL, "aten", kLinearRoutingKey, __FILE__, __LINE__);
    kernel.impl("add_.Tensor", TORCH_FN(routed_add_));
    return true;
  }();
  (void)registered;
}

// RAII: this thread's linears are routed (kOn) or not (kOff) on `device`
// until the guard dies; the enclosing state comes back after.
class LinearRoutingGuard {
 public:
  LinearRoutingGuard(LinearRouting mode, c10::DeviceType device)
      : guard_(linear_routing_state(), routed(mode, device), mode == LinearRouting::kOn) {}

 private:
  // The state with `on` and `device` set; fn, mapped and bias_pending as they are.
  static LinearRoutingState routed(LinearRouting mode, c10::DeviceType device) {
    if (mode == LinearRouting::kOn) register_linear_routing_kernels();
    LinearRoutingState s = linear_routing_state();
    s.on = mode == LinearRouting::kOn;
    s.device = device;
    return s;
  }
  // fn stays as set (LinearFnGuard restores it); a pending bias is the inner scope's.
  struct Restore {
    void operator()(LinearRoutingState& now, const LinearRoutingState& prev) const {
      now.on = prev.on;
      now.device = prev.device;
      now.mapped = prev.mapped;
      now.bias_pending = nullptr;
    }
  };
  ThreadStateGuard<LinearRoutingState, kLinearRoutingKey, Restore> guard_;
};

// Whether this thread's linears are routed now.
inline LinearRouting current_linear_routing() {
  return linear_routing_state().on ? LinearRouting::kOn : LinearRouting::kOff;
}
}  // namespace detail

}  // namespace amp
