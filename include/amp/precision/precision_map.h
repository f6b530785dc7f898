// amp/precision/precision_map.h: PrecisionMap, a precision per module (Keras'
// DTypePolicyMap, FSDP2's per-module MixedPrecisionPolicy, torchao's module
// filter) for a Mixed or Float8 region.
//
//   auto map = amp::PrecisionMap()
//                  .type<torch::nn::LayerNormImpl>(amp::ModulePrecision::kFp32)  // every LayerNorm
//                  .path("head", amp::ModulePrecision::kFp32);                   // fp32 logits
//   amp::Trainer<P, amp::CPU> trainer(model, optimizer, amp::TrainerOptions().region(
//                                         amp::RegionOptions().precision_map(map)));
//   amp::Region<P, amp::CPU> region(amp::RegionOptions().precision_map(map), *model);  // by hand
//
// Semantics, as Python's `with torch.autocast(enabled=False): m(x.float())`
// (kFp32) or `with torch.autocast(device, dtype): m(x)` (kBf16, kFp16) around
// exactly the mapped modules' forwards: a mapped op's floating inputs are
// cast to fp32 and it runs with autocast off, or it runs under autocast to the
// mapped dtype; its output is in that dtype. kNotFloat8 keeps a linear of a
// Float8 region out of float8 (bf16 autocast, as a linear whose dims do not fit).
//
// How: by parameter ownership, in the dispatcher. LibTorch's nn::Module has no
// forward hooks, and the modules users write are members of TORCH_MODULE
// classes that no wrapper can reach. Each op of a region whose inputs include
// a parameter of a mapped module (a Linear's linear/addmm/matmul, a norm's
// layer_norm, an Embedding's embedding, a convolution, ...) runs in that
// module's precision; the kernels sit on linear routing's dispatch key
// (amp/precision/linear_routing.h), so the map needs routing on. What it
// cannot see: ops without a mapped parameter among their inputs, even inside
// a mapped module's forward (its activations, a softmax, an attention's
// matmul of activations, F::* calls on activations). Parameter-free modules
// (Softmax, GELU) cannot be mapped; run them in region.full_precision(f) or
// under amp::AutocastDisabled. docs/regions.md, "Precision per module".
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/core/device.h"
#include "amp/detail/compat_ops.h"
#include "amp/precision/detail/autocast_tls.h"
#include "amp/precision/linear_routing.h"

namespace amp {

// What a mapped module computes in.
enum class ModulePrecision : std::uint8_t {
  kFp32,       // autocast off, floating inputs cast to fp32: fp32 outputs
  kBf16,       // autocast to bf16
  kFp16,       // autocast to fp16
  kNotFloat8,  // a Float8 region's linear stays out of float8 (bf16 autocast)
};

namespace detail {
inline const char* to_string(ModulePrecision p) {
  switch (p) {
    case ModulePrecision::kFp32:
      return "fp32";
    case ModulePrecision::kBf16:
      return "bf16";
    case ModulePrecision::kFp16:
      return "fp16";
    case ModulePrecision::kNotFloat8:
      return "not float8";
  }
  return "?";
}

// The resolved map: each mapped parameter (by identity) and its module's precision.
using PrecisionTable = std::unordered_map<const c10::TensorImpl*, ModulePrecision>;

// A model's modules, named as in named_modules() (the root is ""), each
// under `prefix` (Fabric's models: "0.", "1.", ...).
struct NamedModule {
  std::string name;
  const torch::nn::Module* module;
};
inline void named_modules_of(const torch::nn::Module& root, const std::string& prefix, std::vector<NamedModule>& out) {
  std::string root_name = prefix.empty() ? "" : prefix.substr(0, prefix.size() - 1);
  out.push_back({root_name, &root});
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false))
    out.push_back({prefix + item.key(), item.value().get()});
}

}  // namespace detail

// Modules picked by path (exact: the module and everything under it), by
// regex (std::regex_match over named_modules() names) or by type, each with
// a precision. A parameter takes the precision of the last entry that picks
// a module holding it. Copies share one resolution cache.
class PrecisionMap {
 public:
  // A map resolved against models (resolve()): what Region(options, resolved) installs.
  using Resolved = std::shared_ptr<const detail::PrecisionTable>;

  // The module named `path` in named_modules() ("blocks.0.ln1", "head") and its submodules.
  PrecisionMap& path(std::string path, ModulePrecision precision) {
    rules_.push_back(Rule{Kind::kPath, std::move(path), {}, std::type_index(typeid(void)), precision});
    return changed();
  }
  // Every module whose full name matches `pattern` (ECMAScript, whole name), and its submodules.
  PrecisionMap& regex(const std::string& pattern, ModulePrecision precision) {
    Rule rule{Kind::kRegex, pattern, {}, std::type_index(typeid(void)), precision};
    try {
      rule.re = std::regex(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "amp: the precision map's regex \"", pattern, "\" does not compile: ", e.what(),
                  "; write an ECMAScript regex that matches whole module names (\"blocks\\\\.[0-9]+\\\\.ln1\")");
    }
    rules_.push_back(std::move(rule));
    return changed();
  }
  // Every module of type ModuleImpl (torch::nn::LayerNormImpl, a TORCH_MODULE's FooImpl), and its submodules.
  template <class ModuleImpl>
  PrecisionMap& type(ModulePrecision precision) {
    static_assert(std::is_base_of_v<torch::nn::Module, ModuleImpl>,
                  "amp: PrecisionMap::type<M>() takes a module class: torch::nn::LayerNormImpl, not "
                  "torch::nn::LayerNorm (the ModuleHolder)");
    rules_.push_back(Rule{
        Kind::kType, c10::demangle(typeid(ModuleImpl).name()), {}, std::type_index(typeid(ModuleImpl)), precision});
    return changed();
  }

  bool empty() const { return rules_.empty(); }
  // Whether any entry maps to `precision`.
  bool maps_to(ModulePrecision precision) const {
    for (const Rule& r : rules_)
      if (r.precision == precision) return true;
    return false;
  }

  // The table for these models (each under its prefix: "" for one, "0.", "1.", ... for Fabric's), resolved again
  // when the prefixes or the parameters themselves changed (a new model at a freed one's address is new). An entry
  // that picks no module, or only modules without parameters, is an amp: error that lists the model's modules.
  Resolved resolve(const std::vector<std::pair<std::string, const torch::nn::Module*>>& models) const {
    std::vector<std::pair<std::string, size_t>> prefixes;
    std::vector<at::Tensor> params;
    for (const auto& m : models) {
      const std::vector<at::Tensor> own = m.second->parameters();
      prefixes.emplace_back(m.first, own.size());
      params.insert(params.end(), own.begin(), own.end());
    }
    std::lock_guard<std::mutex> lock(cache_->mutex);
    if (cache_->table && cache_->prefixes == prefixes && same_tensors(cache_->params, params)) return cache_->table;
    cache_->table = std::make_shared<const detail::PrecisionTable>(resolve_now(models));
    cache_->prefixes = std::move(prefixes);
    cache_->params.clear();
    for (const at::Tensor& p : params) cache_->params.emplace_back(p.getIntrusivePtr());
    return cache_->table;
  }

 private:
  enum class Kind : std::uint8_t { kPath, kRegex, kType };
  struct Rule {
    Kind kind;
    std::string text;  // the path, the regex, the type's name
    std::regex re;
    std::type_index type = std::type_index(typeid(void));
    ModulePrecision precision;
  };
  // Keeps a TensorImpl's memory (not its data): no other tensor can take its address.
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Cache {
    std::mutex mutex;
    std::vector<std::pair<std::string, size_t>> prefixes;  // each model's prefix and parameter count
    std::vector<WeakImpl> params;                          // every model's parameters, in order
    std::shared_ptr<const detail::PrecisionTable> table;
  };
  static bool same_tensors(const std::vector<WeakImpl>& cached, const std::vector<at::Tensor>& now) {
    if (cached.size() != now.size()) return false;
    for (size_t i = 0; i < now.size(); ++i)
      if (cached[i].expired() || cached[i]._unsafe_get_target() != now[i].unsafeGetTensorImpl()) return false;
    return true;
  }

  PrecisionMap& changed() {
    cache_ = std::make_shared<Cache>();  // copies made before keep theirs
    return *this;
  }

  bool picks(const Rule& r, const detail::NamedModule& m) const {
    switch (r.kind) {
      case Kind::kPath:
        return m.name == r.text;
      case Kind::kRegex:
        return std::regex_match(m.name, r.re);
      case Kind::kType:
        return std::type_index(typeid(*m.module)) == r.type;
    }
    return false;
  }

  detail::PrecisionTable resolve_now(
      const std::vector<std::pair<std::string, const torch::nn::Module*>>& models) const {
    std::vector<detail::NamedModule> modules;
    for (const auto& m : models) detail::named_modules_of(*m.second, m.first, modules);
    detail::PrecisionTable table;
    for (const Rule& r : rules_) {
      bool picked = false, with_params = false;
      for (const detail::NamedModule& m : modules) {
        if (!picks(r, m)) continue;
        picked = true;
        for (const at::Tensor& p : m.module->parameters(/*recurse=*/true)) {
          table[p.unsafeGetTensorImpl()] = r.precision;
          with_params = true;
        }
      }
      TORCH_CHECK(picked, "amp: the precision map's ", describe(r),
                  " matches no module of the model; its modules are: ", names(modules));
      TORCH_CHECK(with_params, "amp: the precision map's ", describe(r),
                  " matches only modules without parameters, which the map cannot see (it finds a module's ops "
                  "by its parameters); run such a module in region.full_precision(f) or under "
                  "amp::AutocastDisabled instead");
    }
    return table;
  }

  static std::string describe(const Rule& r) {
    switch (r.kind) {
      case Kind::kPath:
        return "path \"" + r.text + "\"";
      case Kind::kRegex:
        return "regex \"" + r.text + "\"";
      case Kind::kType:
        return "type " + r.text;
    }
    return "";
  }

  static std::string names(const std::vector<detail::NamedModule>& modules) {
    std::string out;
    const size_t shown = std::min<size_t>(modules.size(), 64);
    for (size_t i = 0; i < shown; ++i) out += (i ? ", \"" : "\"") + modules[i].name + "\"";
    if (shown < modules.size()) out += ", ... (" + std::to_string(modules.size() - shown) + " more)";
    return out;
  }

  std::vector<Rule> rules_;
  std::shared_ptr<Cache> cache_ = std::make_shared<Cache>();
};

namespace detail {

// This thread's table while a region with a map lives (null: none); shared,
// so that a recompute in backward (amp/train/activation_checkpoint.h) keeps it.
inline std::shared_ptr<const PrecisionTable>& precision_table() {
  static thread_local std::shared_ptr<const PrecisionTable> table;
  return table;
}

// The precision of the first tensor among `tensors` that a mapped module owns.
inline const ModulePrecision* mapped_precision(const PrecisionTable& table, const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  auto it = table.find(t.unsafeGetTensorImpl());
  return it == table.end() ? nullptr : &it->second;
}

// Runs `call` in `precision` on `device`: autocast off (kFp32) or to the
// mapped dtype (kBf16, kFp16). Autocast's dispatch key is left to `call`.
template <class F>
decltype(auto) in_precision(ModulePrecision precision, c10::DeviceType device, F&& call) {
  if (precision == ModulePrecision::kFp32) {
    c10::impl::ExcludeDispatchKeyGuard off(autocast_key(device));
    return call();
  }
  const c10::ScalarType dtype = precision == ModulePrecision::kFp16 ? at::kHalf : at::kBFloat16;
  struct Dtype {  // as a nested torch.autocast(dtype=...): the weight cache is shared
    c10::DeviceType device;
    c10::ScalarType prev;
    ~Dtype() { compat::set_autocast_dtype(device, prev); }
  } restore{device, compat::autocast_dtype(device)};
  compat::set_autocast_dtype(device, dtype);
  return call();
}

inline at::Tensor to_fp32(const at::Tensor& t) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble
             ? t.to(at::kFloat)
             : t;
}

// A routed linear whose weight a mapped module owns (LinearRoutingState::mapped).
inline bool mapped_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          c10::DeviceType device, at::Tensor& out) {
  const PrecisionTable* table = precision_table().get();
  if (table == nullptr) return false;
  const ModulePrecision* p = mapped_precision(*table, weight);
  if (p == nullptr) return false;
  if (*p == ModulePrecision::kNotFloat8) {
    out = at::linear(input, weight, bias);
    return true;
  }
  out = in_precision(*p, device, [&] {
    if (*p != ModulePrecision::kFp32) return at::linear(input, weight, bias);
    return at::linear(to_fp32(input), to_fp32(weight), bias ? c10::optional<at::Tensor>(to_fp32(*bias)) : bias);
  });
  return true;
}

// Any other op with a parameter among its inputs (boxed: one kernel for all).
inline void mapped_op(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard nested(kLinearRoutingKey);
  const c10::DispatchKeySet below = below_routing(keys);
  const PrecisionTable* table = precision_table().get();
  const LinearRoutingState& s = linear_routing_state();
  const size_t n = op.schema().arguments().size();
  const ModulePrecision* p = nullptr;
  if (table != nullptr && s.on && !autocast_dispatch_excluded(s.device) && !in_backward_pass()) {
    for (size_t i = stack->size() - n; i < stack->size() && p == nullptr; ++i) {
      const c10::IValue& v = (*stack)[i];
      if (v.isTensor()) p = mapped_precision(*table, v.toTensor());
    }
  }
  if (p == nullptr || *p == ModulePrecision::kNotFloat8) return op.redispatchBoxed(below, stack);
  if (*p == ModulePrecision::kFp32) {
    for (size_t i = stack->size() - n; i < stack->size(); ++i) {
      c10::IValue& v = (*stack)[i];
      if (v.isTensor()) v = to_fp32(v.toTensor());
    }
  }
  // redispatch follows the key set, not the thread's: autocast's key leaves it for kFp32
  const c10::DispatchKeySet keys_now = *p == ModulePrecision::kFp32 ? below.remove(autocast_key(s.device)) : below;
  in_precision(*p, s.device, [&] { op.redispatchBoxed(keys_now, stack); });
}

// The ops of LibTorch's modules with parameters (besides linear's, which
// linear routing has), registered once per process, where this LibTorch has them.
inline void register_precision_map_kernels() {
  static const bool registered = [] {
    static torch::Library kernels(torch::Library::IMPL, "aten", kLinearRoutingKey, __FILE__, __LINE__);
    const std::pair<const char*, const char*> ops[] = {{"layer_norm", ""},
                                                       {"rms_norm", ""},
                                                       {"group_norm", ""},
                                                       {"batch_norm", ""},
                                                       {"instance_norm", ""},
                                                       {"embedding", ""},
                                                       {"embedding_bag", ""},
                                                       {"conv1d", ""},
                                                       {"conv1d", "padding"},
                                                       {"conv2d", ""},
                                                       {"conv2d", "padding"},
                                                       {"conv3d", ""},
                                                       {"conv3d", "padding"},
                                                       {"conv_transpose1d", ""},
                                                       {"conv_transpose2d", "input"},
                                                       {"conv_transpose3d", "input"},
                                                       {"prelu", ""},
                                                       {"bilinear", ""}};
    for (const auto& op : ops) {
      if (!c10::Dispatcher::singleton().findSchema({std::string("aten::") + op.first, op.second})) continue;
      const std::string name = std::string(op.first) + (op.second[0] ? std::string(".") + op.second : "");
      kernels.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&mapped_op>());
    }
    return true;
  }();
  (void)registered;
}

// RAII: this thread's ops follow the installed table (none: as before)
// until the guard dies, when the enclosing table comes back.
class PrecisionMapGuard {
 public:
  PrecisionMapGuard() : prev_(precision_table()), prev_mapped_(linear_routing_state().mapped) {}
  void install(std::shared_ptr<const PrecisionTable> table) {
    if (table == nullptr) return;
    register_precision_map_kernels();
    precision_table() = std::move(table);
    linear_routing_state().mapped = &mapped_linear;
  }
  ~PrecisionMapGuard() {
    precision_table() = prev_;
    linear_routing_state().mapped = prev_mapped_;
  }
  PrecisionMapGuard(const PrecisionMapGuard&) = delete;
  PrecisionMapGuard& operator=(const PrecisionMapGuard&) = delete;

 private:
  std::shared_ptr<const PrecisionTable> prev_;
  MappedLinearFn prev_mapped_;
};

}  // namespace detail
}  // namespace amp
