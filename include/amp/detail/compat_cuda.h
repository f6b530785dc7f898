// amp/detail/compat_cuda.h: whether amp compiles its CUDA-only code, and the
// CUDA runtime calls that code makes (CUDA graphs, streams, the default CUDA
// generator, the caching allocator's counters).
//
//   #if AMP_DETAIL_WITH_CUDA
//   amp::detail::compat::CudaGraph graph; ...
//   #endif
//
// AMP_DETAIL_WITH_CUDA is 1 where LibTorch's CUDA headers and CUDA's runtime headers
// are both on the include path (a CUDA LibTorch through its TorchConfig.cmake:
// the pip wheel), else 0 (Debian's CPU LibTorch). Define it to 0 to leave the
// CUDA code out of a build that has the headers but links a CPU LibTorch.
// The spellings used here are the same in LibTorch 1.13 and 2.x; where they
// differ, this is the place that switches.
#pragma once

#include <cstdint>

#ifndef AMP_DETAIL_WITH_CUDA
#if defined(__has_include)
#if __has_include(<ATen/cuda/CUDAGraph.h>) && __has_include(<cuda_runtime_api.h>)
#define AMP_DETAIL_WITH_CUDA 1
#endif
#endif
#endif
#ifndef AMP_DETAIL_WITH_CUDA
#define AMP_DETAIL_WITH_CUDA 0
#endif

#if AMP_DETAIL_WITH_CUDA
#include <ATen/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>

namespace amp {
namespace detail {
namespace compat {

using CudaGraph = at::cuda::CUDAGraph;

// Bytes the caching allocator holds from the driver on `device` (reserved,
// all pools); a graph's private pool is what capture adds to it.
inline int64_t cuda_reserved_bytes(c10::DeviceIndex device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return stats.reserved_bytes[0].current;  // [0]: StatType::AGGREGATE in every version
}

// The caching allocator's allocated bytes on `device` (blocks in use, all
// pools) now and at their peak, and the reset of every peak statistic there
// (torch.cuda.reset_peak_memory_stats).
struct CudaAllocatedBytes {
  int64_t current = 0, peak = 0;
};
inline CudaAllocatedBytes cuda_allocated_bytes(c10::DeviceIndex device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};  // [0]: StatType::AGGREGATE
}
inline void cuda_reset_peak_allocated_bytes(c10::DeviceIndex device) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
}

inline void cuda_synchronize() { c10::cuda::device_synchronize(); }

// The default CUDA generator's state on `device` (dropout's random numbers).
inline at::Tensor cuda_rng_state(c10::DeviceIndex device) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
inline void set_cuda_rng_state(c10::DeviceIndex device, const at::Tensor& state) {
  at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Whether `device`'s current stream is capturing a CUDA graph (call it where
// the device has a context: it would make one).
inline bool cuda_stream_capturing(c10::DeviceIndex device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

// A stream other than the current one, for warm-up and capture (a graph
// cannot be captured on the default stream).
inline c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
}

}  // namespace compat
}  // namespace detail
}  // namespace amp
#endif  // AMP_DETAIL_WITH_CUDA
