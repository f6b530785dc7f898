// amp/train/activation_meter.h: amp::ActivationMeter, the bytes a forward
// leaves alive for backward, counted exactly from the allocator.
//
//   amp::ActivationMeter meter;                 // before the forward
//   torch::Tensor loss = model(x).sum();
//   int64_t kept = meter.bytes();               // what autograd keeps until backward (and the loss)
//
// A CPU meter counts every CPU allocation of the process made while it lives
// (any thread) that is still alive: bytes() is the sum of the sizes of those
// allocations, peak_bytes() the largest that sum has been. A storage counts
// once, whatever views share it; an allocation made before the meter began
// is never counted, and neither is its free. So measure around the forward
// alone: after a forward, bytes() is what it saved for backward (autocast's
// cached 16-bit weight copies included) plus its output; under no_grad, the
// output only. How: the first meter of the process wraps the CPU allocator in
// force (c10::SetCPUAllocator, priority 1, for the rest of the process; without
// a meter alive each allocation costs one more virtual call and an atomic
// load). While a meter lives, each allocation is entered in a table with its
// size and the meters alive, and freed through it, on whatever thread.
//
// A CUDA meter (amp::ActivationMeter meter(torch::kCUDA), built against a
// CUDA LibTorch) reads the caching allocator's statistics of the device:
// bytes() is the change of its allocated bytes since the meter began (block
// sizes, multiples of 512 bytes; frees of older tensors subtract), and the
// meter resets the device's peak statistics, as
// torch.cuda.reset_peak_memory_stats, so that peak_bytes() is its own.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/detail/compat_allocator.h"
#include "amp/detail/compat_cuda.h"

namespace amp {
namespace detail {

// One meter's count: live bytes and their maximum.
struct MeterCount {
  std::atomic<int64_t> live{0}, peak{0};
  void add(int64_t n) {
    const int64_t now = live.fetch_add(n, std::memory_order_relaxed) + n;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  void sub(int64_t n) { live.fetch_sub(n, std::memory_order_relaxed); }
};
using MeterSet = std::vector<std::shared_ptr<MeterCount>>;

// The CPU allocator in force, wrapped: while a meter lives, each allocation
// is counted by the meters alive at the time, and uncounted when freed.
// A counted DataPtr keeps data == context (so ideep's raw_allocate and
// raw_deallocate, and copy-on-write storages, work as with the allocator it
// wraps): its size, meters and the wrapped DataPtr wait in a table keyed by
// the data pointer.
class CountingCpuAllocator final : public compat::ForwardingAllocator {
 public:
  static constexpr uint8_t kPriority = 1;  // above the default CPU allocator's 0

  // The process's counting allocator, installed by the first call.
  static CountingCpuAllocator& installed() {
    static CountingCpuAllocator* const allocator = [] {
      auto* a = new CountingCpuAllocator(c10::GetCPUAllocator());  // never deleted: it outlives every tensor
      instance() = a;
      c10::SetCPUAllocator(a, kPriority);
      return a;
    }();
    return *allocator;
  }
  void check_in_force() const {
    TORCH_CHECK(c10::GetCPUAllocator() == this,
                "amp: ActivationMeter cannot count CPU allocations: another CPU allocator was installed with "
                "c10::SetCPUAllocator at a priority above ",
                static_cast<int>(kPriority),
                " or after the first meter; install yours before the first ActivationMeter, at a priority of at most ",
                static_cast<int>(kPriority));
  }

  void begin(const std::shared_ptr<MeterCount>& count) {
    std::lock_guard<std::mutex> lock(mutex_);
    meters_.push_back(count);
    publish();
  }
  void end(const std::shared_ptr<MeterCount>& count) {
    std::lock_guard<std::mutex> lock(mutex_);
    meters_.erase(std::remove(meters_.begin(), meters_.end(), count), meters_.end());
    publish();
  }

  // Counted pointers are freed by free_counted; a raw pointer the wrapped
  // allocator made before (ideep frees through whatever allocator is in force)
  // goes on to that allocator's raw deleter.
  c10::DeleterFnPtr raw_deleter() const override { return inner_raw_deleter_ ? &free_counted : nullptr; }

 private:
  struct Entry {
    c10::DataPtr inner;
    int64_t bytes = 0;
    std::shared_ptr<const MeterSet> meters;
  };

  explicit CountingCpuAllocator(c10::Allocator* inner)
      : compat::ForwardingAllocator(inner), inner_raw_deleter_(inner->raw_deleter()) {}

  static CountingCpuAllocator*& instance() {
    static CountingCpuAllocator* a = nullptr;
    return a;
  }

  void publish() {  // under mutex_
    alive_ = meters_.empty() ? nullptr : std::make_shared<const MeterSet>(meters_);
    metering_.store(!meters_.empty(), std::memory_order_release);
  }

  c10::DataPtr do_allocate(size_t n) override {
    c10::DataPtr data = inner()->allocate(n);
    if (n == 0 || data.get() == nullptr || !metering_.load(std::memory_order_acquire)) return data;
    void* p = data.get();
    const c10::Device device = data.device();
    const auto bytes = static_cast<int64_t>(n);
    std::shared_ptr<const MeterSet> meters;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!alive_ || table_.count(p) != 0) return data;  // the meters ended meanwhile; an address given twice
      meters = alive_;
      table_.emplace(p, Entry{std::move(data), bytes, meters});
    }
    for (const auto& m : *meters) m->add(bytes);
    return c10::DataPtr(p, p, &free_counted, device);
  }

  static void free_counted(void* p) {
    CountingCpuAllocator& self = *instance();
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      const auto it = self.table_.find(p);
      if (it != self.table_.end()) {
        entry = std::move(it->second);
        self.table_.erase(it);  // before the memory goes back: the address may be handed out again at once
      }
    }
    if (!entry.meters) {  // not counted: a raw pointer of the wrapped allocator
      if (self.inner_raw_deleter_ != nullptr) self.inner_raw_deleter_(p);
      return;
    }
    for (const auto& m : *entry.meters) m->sub(entry.bytes);
  }  // entry.inner frees the memory

  const c10::DeleterFnPtr inner_raw_deleter_;
  std::atomic<bool> metering_{false};
  std::mutex mutex_;
  MeterSet meters_;
  std::shared_ptr<const MeterSet> alive_;
  std::unordered_map<void*, Entry> table_;
};

}  // namespace detail

// Counts the bytes allocated since it began that are still alive, and their
// peak (see the top of this header for what exactly, on CPU and CUDA).
class ActivationMeter {
 public:
  explicit ActivationMeter(c10::Device device = c10::Device(c10::DeviceType::CPU)) : device_(device) {
    if (device_.is_cpu()) {
      detail::CountingCpuAllocator& allocator = detail::CountingCpuAllocator::installed();
      allocator.check_in_force();
      count_ = std::make_shared<detail::MeterCount>();
      allocator.begin(count_);
      return;
    }
#if AMP_DETAIL_WITH_CUDA
    if (device_.is_cuda()) {
      if (!device_.has_index()) device_ = c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
      detail::compat::cuda_reset_peak_allocated_bytes(device_.index());
      start_ = detail::compat::cuda_allocated_bytes(device_.index()).current;
      return;
    }
#endif
    TORCH_CHECK(false, "amp: ActivationMeter counts CPU memory", AMP_DETAIL_WITH_CUDA ? " and CUDA memory" : "",
                ", not ", device_, AMP_DETAIL_WITH_CUDA || !device_.is_cuda() ? "" : " (this build has no CUDA)",
                "; use amp::ActivationMeter(torch::kCPU)", AMP_DETAIL_WITH_CUDA ? " or (torch::kCUDA)" : "");
  }
  ~ActivationMeter() {
    if (count_) detail::CountingCpuAllocator::installed().end(count_);
  }
  ActivationMeter(const ActivationMeter&) = delete;
  ActivationMeter& operator=(const ActivationMeter&) = delete;

  // Bytes allocated since the meter began and still alive.
  int64_t bytes() const {
    if (count_) return count_->live.load(std::memory_order_relaxed);
#if AMP_DETAIL_WITH_CUDA
    return detail::compat::cuda_allocated_bytes(device_.index()).current - start_;
#else
    return 0;
#endif
  }
  // The largest bytes() has been since the meter began.
  int64_t peak_bytes() const {
    if (count_) return count_->peak.load(std::memory_order_relaxed);
#if AMP_DETAIL_WITH_CUDA
    return detail::compat::cuda_allocated_bytes(device_.index()).peak - start_;
#else
    return 0;
#endif
  }
  c10::Device device() const { return device_; }

 private:
  c10::Device device_;
  std::shared_ptr<detail::MeterCount> count_;  // CPU
  int64_t start_ = 0;                          // CUDA: allocated bytes when the meter began
};

}  // namespace amp
