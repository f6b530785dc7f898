// bench/cuda_syncs.h: host syncs per step, counted with LibTorch's CUDA sync
// debug mode (one warning per sync), for the CUDA benchmarks. Needs
// AMP_LIBTORCH_HAS_CUDA (bench/CMakeLists.txt sets it where LibTorch has CUDA).
#pragma once

#ifdef AMP_LIBTORCH_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace amp_bench {

// Counts the warnings of LibTorch's CUDA sync debug mode (one per host sync).
struct SyncCounter : c10::WarningHandler {
  std::atomic<int64_t> syncs{0};
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++syncs;
  }
};

// Host syncs per call of step(), over `calls` calls, in the sync debug mode.
template <class F>
double syncs_per_step(F&& step, int calls) {
  SyncCounter counter;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&counter);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    for (int i = 0; i < calls; ++i) step();
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  torch::cuda::synchronize();
  return static_cast<double>(counter.syncs.load()) / static_cast<double>(calls);
}

}  // namespace amp_bench
#endif  // AMP_LIBTORCH_HAS_CUDA
