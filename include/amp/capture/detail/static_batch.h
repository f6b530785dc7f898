// amp/capture/detail/static_batch.h: a batch's tensors as fixed buffers, for a
// captured step (amp/capture/captured_step.h). Made from an example batch; each later batch
// is checked against it (shape, dtype, device, named by their place in the
// batch) and copied into the buffers, which the graph reads.
//
//   StaticBatch<std::pair<at::Tensor, at::Tensor>> inputs(example, device);
//   inputs.copy_from(batch);          // "amp: ... batch.second has shape [32, 8] ..."
//   fn(region, inputs.buffers());
//
// A batch is a tensor, a torch::data::Example, a std::pair, std::tuple,
// std::vector or std::array of batches. Anything else (an int, a string)
// would be baked into the graph and silently reused, so it does not compile.
#pragma once

#include <ATen/ATen.h>
#include <torch/data/example.h>

#include <array>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/core/rules.h"  // detail::dependent_false_v

namespace amp {
namespace detail {

// Visits a batch's tensors in order with their place in it ("batch.first",
// "batch[2].data"), and rebuilds a batch with each tensor mapped.
template <class T>
struct BatchWalk {
  static_assert(dependent_false_v<T>,
                "amp: a captured step's batch may hold only tensors: at::Tensor, torch::data::Example, or a "
                "std::pair, std::tuple, std::vector or std::array of them; a value of another type would be "
                "recorded into the CUDA graph once and reused for every batch");
};

template <>
struct BatchWalk<at::Tensor> {
  template <class F>
  static void visit(const at::Tensor& t, const std::string& path, F& f) {
    f(t, path);
  }
  template <class F>
  static at::Tensor map(const at::Tensor& t, F& f) {
    return f(t);
  }
};

template <class A, class B>
struct BatchWalk<std::pair<A, B>> {
  template <class F>
  static void visit(const std::pair<A, B>& p, const std::string& path, F& f) {
    BatchWalk<A>::visit(p.first, path + ".first", f);
    BatchWalk<B>::visit(p.second, path + ".second", f);
  }
  template <class F>
  static std::pair<A, B> map(const std::pair<A, B>& p, F& f) {
    return {BatchWalk<A>::map(p.first, f), BatchWalk<B>::map(p.second, f)};
  }
};

template <class... Ts>
struct BatchWalk<std::tuple<Ts...>> {
  template <class F>
  static void visit(const std::tuple<Ts...>& t, const std::string& path, F& f) {
    visit_each(t, path, f, std::index_sequence_for<Ts...>());
  }
  template <class F>
  static std::tuple<Ts...> map(const std::tuple<Ts...>& t, F& f) {
    return map_each(t, f, std::index_sequence_for<Ts...>());
  }

 private:
  template <class F, size_t... I>
  static void visit_each(const std::tuple<Ts...>& t, const std::string& path, F& f, std::index_sequence<I...>) {
    (BatchWalk<Ts>::visit(std::get<I>(t), "std::get<" + std::to_string(I) + ">(" + path + ")", f), ...);
  }
  template <class F, size_t... I>
  static std::tuple<Ts...> map_each(const std::tuple<Ts...>& t, F& f, std::index_sequence<I...>) {
    return std::tuple<Ts...>{BatchWalk<Ts>::map(std::get<I>(t), f)...};
  }
};

template <class T, class A>
struct BatchWalk<std::vector<T, A>> {
  template <class F>
  static void visit(const std::vector<T, A>& v, const std::string& path, F& f) {
    for (size_t i = 0; i < v.size(); ++i) BatchWalk<T>::visit(v[i], path + "[" + std::to_string(i) + "]", f);
  }
  template <class F>
  static std::vector<T, A> map(const std::vector<T, A>& v, F& f) {
    std::vector<T, A> out;
    out.reserve(v.size());
    for (const T& x : v) out.push_back(BatchWalk<T>::map(x, f));
    return out;
  }
};

template <class T, size_t N>
struct BatchWalk<std::array<T, N>> {
  template <class F>
  static void visit(const std::array<T, N>& a, const std::string& path, F& f) {
    for (size_t i = 0; i < N; ++i) BatchWalk<T>::visit(a[i], path + "[" + std::to_string(i) + "]", f);
  }
  template <class F>
  static std::array<T, N> map(const std::array<T, N>& a, F& f) {
    return map_each(a, f, std::make_index_sequence<N>());
  }

 private:
  template <class F, size_t... I>
  static std::array<T, N> map_each(const std::array<T, N>& a, F& f, std::index_sequence<I...>) {
    return std::array<T, N>{{BatchWalk<T>::map(a[I], f)...}};
  }
};

template <class D, class T>
struct BatchWalk<torch::data::Example<D, T>> {
  using E = torch::data::Example<D, T>;
  template <class F>
  static void visit(const E& e, const std::string& path, F& f) {
    BatchWalk<D>::visit(e.data, path + ".data", f);
    BatchWalk<T>::visit(e.target, path + ".target", f);
  }
  template <class F>
  static E map(const E& e, F& f) {
    return E(BatchWalk<D>::map(e.data, f), BatchWalk<T>::map(e.target, f));
  }
};

template <class D>
struct BatchWalk<torch::data::Example<D, torch::data::example::NoTarget>> {
  using E = torch::data::Example<D, torch::data::example::NoTarget>;
  template <class F>
  static void visit(const E& e, const std::string& path, F& f) {
    BatchWalk<D>::visit(e.data, path + ".data", f);
  }
  template <class F>
  static E map(const E& e, F& f) {
    return E(BatchWalk<D>::map(e.data, f));
  }
};

// The batch's buffers: on `device`, with the example's shapes and dtypes.
template <class Batch>
class StaticBatch {
 public:
  StaticBatch(const Batch& example, c10::Device device)
      : places_(places_of(example)), buffers_(buffers_of(example, device)), targets_(tensors_of(buffers_)) {}

  // The batch the captured function reads: fixed tensors, refilled by copy_from().
  const Batch& buffers() const { return buffers_; }

  // Throws "amp: ..." naming the first tensor whose place, shape, dtype or
  // device differs from the example's.
  void check(const Batch& batch) const { (void)checked(batch); }

  // check(), then copies each tensor into its buffer (asynchronously where
  // the source allows: device tensors, pinned host memory). Nothing is copied
  // unless the whole batch fits.
  void copy_from(const Batch& batch) {
    const std::vector<at::Tensor> sources = checked(batch);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < targets_.size(); ++i) targets_[i].copy_(sources[i], /*non_blocking=*/true);
  }

  size_t size() const { return places_.size(); }

 private:
  static constexpr const char* kFix =
      "call recapture(batch) to capture the step again for the new batch (a CUDA graph replays fixed shapes)";

  struct Place {
    std::string path;
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
    c10::Device device;
  };

  // The batch's tensors in order, after check()'s checks.
  std::vector<at::Tensor> checked(const Batch& batch) const {
    std::vector<at::Tensor> tensors;
    tensors.reserve(places_.size());
    size_t i = 0;
    auto compare = [&](const at::Tensor& t, const std::string& path) {
      TORCH_CHECK(i < places_.size(), "amp: the batch has more tensors than the one the step was captured for (",
                  places_.size(), "); ", path, " is new; ", kFix);
      const Place& p = places_[i++];
      TORCH_CHECK(path == p.path,
                  "amp: the batch is laid out differently from the one the step was captured for: ", path,
                  " where the captured batch had ", p.path, "; ", kFix);
      TORCH_CHECK(t.defined(), "amp: ", path, " is an undefined tensor; the step was captured with a tensor there");
      TORCH_CHECK(t.sizes() == c10::IntArrayRef(p.sizes) && t.scalar_type() == p.dtype && t.device() == p.device,
                  "amp: the step was captured for ", p.path, " of shape ", c10::IntArrayRef(p.sizes), ", ", p.dtype,
                  " on ", p.device, ", but got shape ", t.sizes(), ", ", t.scalar_type(), " on ", t.device(), "; ",
                  kFix);
      tensors.push_back(t);
    };
    BatchWalk<Batch>::visit(batch, "batch", compare);
    TORCH_CHECK(i == places_.size(), "amp: the batch has fewer tensors (", i,
                ") than the one the step was captured for (", places_.size(), "); ", kFix);
    return tensors;
  }

  static std::vector<Place> places_of(const Batch& example) {
    std::vector<Place> places;
    auto record = [&](const at::Tensor& t, const std::string& path) {
      TORCH_CHECK(t.defined(), "amp: ", path,
                  " of the example batch is an undefined tensor; a captured step needs "
                  "every tensor of its batch");
      places.push_back(Place{path, t.sizes().vec(), t.scalar_type(), t.device()});
    };
    BatchWalk<Batch>::visit(example, "batch", record);
    return places;
  }

  static Batch buffers_of(const Batch& example, c10::Device device) {
    auto make = [&](const at::Tensor& t) {
      return t.detach().to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true).contiguous();
    };
    return BatchWalk<Batch>::map(example, make);
  }

  static std::vector<at::Tensor> tensors_of(const Batch& batch) {
    std::vector<at::Tensor> out;
    auto add = [&](const at::Tensor& t, const std::string&) { out.push_back(t); };
    BatchWalk<Batch>::visit(batch, "batch", add);
    return out;
  }

  std::vector<Place> places_;
  Batch buffers_;
  std::vector<at::Tensor> targets_;  // buffers_'s tensors, in visiting order
};

}  // namespace detail
}  // namespace amp
