// amp/detail/compat_allocator.h: c10::Allocator's interface as each LibTorch
// spells it, so that an allocator wrapping another is written once.
//
//   class Counting final : public amp::detail::compat::ForwardingAllocator {
//     c10::DataPtr do_allocate(size_t n) override { return inner()->allocate(n); }
//   };
//
// 1.13 declares `DataPtr allocate(size_t) const`; 2.3 made it non-const
// (pytorch#120969). Copy-on-write storages (2.2-2.3) added `copy_data` (pure
// virtual: the copy of an allocation, for materializing one) and
// `is_simple_data_ptr` (whether a DataPtr's context may be moved into a
// copy-on-write context). Which of these this LibTorch has is read from
// c10::Allocator's own declaration (kAllocatorAllocateIsConst and the two
// traits below), not from a version number, so no threshold can be wrong.
// A ForwardingAllocator sends allocate to do_allocate and copy_data and
// is_simple_data_ptr to the allocator it wraps.
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <type_traits>

namespace amp {
namespace detail {
namespace compat {

inline constexpr bool kAllocatorAllocateIsConst =
    std::is_same_v<decltype(&c10::Allocator::allocate), c10::DataPtr (c10::Allocator::*)(size_t) const>;

template <class A, class = void>
struct allocator_has_copy_data : std::false_type {};
template <class A>
struct allocator_has_copy_data<A, std::void_t<decltype(&A::copy_data)>> : std::true_type {};

template <class A, class = void>
struct allocator_has_is_simple_data_ptr : std::false_type {};
template <class A>
struct allocator_has_is_simple_data_ptr<A, std::void_t<decltype(&A::is_simple_data_ptr)>> : std::true_type {};

// The part every version shares: the wrapped allocator and the one hook.
class AllocatorForwardingBase : public c10::Allocator {
 public:
  explicit AllocatorForwardingBase(c10::Allocator* inner) : inner_(inner) {}
  c10::Allocator* inner() const { return inner_; }

 protected:
  virtual c10::DataPtr do_allocate(size_t n) = 0;

 private:
  c10::Allocator* inner_;
};

// Each layer overrides one virtual where this LibTorch declares it; Base is a
// template parameter, so a layer that does not apply is never instantiated.
template <class Base, bool kConst = kAllocatorAllocateIsConst>
class AllocateLayer : public Base {
 public:
  using Base::Base;
  c10::DataPtr allocate(size_t n) override { return this->do_allocate(n); }
};
template <class Base>
class AllocateLayer<Base, true> : public Base {
 public:
  using Base::Base;
  c10::DataPtr allocate(size_t n) const override { return const_cast<AllocateLayer*>(this)->do_allocate(n); }
};

template <class Base, bool kHas = allocator_has_copy_data<c10::Allocator>::value>
class CopyDataLayer : public Base {
 public:
  using Base::Base;
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    this->inner()->copy_data(dest, src, count);
  }
};
template <class Base>
class CopyDataLayer<Base, false> : public Base {
 public:
  using Base::Base;
};

template <class Base, bool kHas = allocator_has_is_simple_data_ptr<c10::Allocator>::value>
class IsSimpleLayer : public Base {
 public:
  using Base::Base;
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override {
    return this->inner()->is_simple_data_ptr(data_ptr);
  }
};
template <class Base>
class IsSimpleLayer<Base, false> : public Base {
 public:
  using Base::Base;
};

// An allocator that wraps `inner`: allocate calls do_allocate (which the
// derived class defines), copy_data and is_simple_data_ptr go to `inner`.
using ForwardingAllocator = IsSimpleLayer<CopyDataLayer<AllocateLayer<AllocatorForwardingBase>>>;

}  // namespace compat
}  // namespace detail
}  // namespace amp
