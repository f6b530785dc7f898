// amp/detail/compat_c10d.h: the c10d (LibTorch's distributed engine) API
// and build differences that amp/distributed.h meets, in one place: LibTorch
// 1.13 against 2.x, and builds with or without NCCL. Needs Gloo's headers
// (Debian: libgloo-dev).
//
//   1.13: ProcessGroupGloo/NCCL are ProcessGroups; TCPStoreOptions has no
//         useLibUV; Gloo has no BFloat16.
//   2.x:  ProcessGroupGloo/NCCL are Backends (same collective methods);
//         TCPStore may use a libuv server (useLibUV, on by default since 2.4).
// Both: Work::wait(std::chrono::milliseconds) throws when it times out or
// when the collective failed (a peer closed its connection). For NCCL work
// (from the headers; not run, no GPU so far): 2.x's wait(timeout) "will
// block the CPU thread until the NCCL work is completed or timed out" and
// throws on a timeout; 1.13's wait() only makes the current stream wait for
// the NCCL stream (the CPU blocks with NCCL_BLOCKING_WAIT=1). Either way,
// the work after wait() on the current stream sees the result.
#pragma once

// ProcessGroupGloo.hpp declares nothing without it (torch's build defines it).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include "amp/detail/compat.h"
#include "amp/version.h"

// AMP_DETAIL_HAS_NCCL: 1 when this LibTorch was built with NCCL (its build defines
// USE_C10D_NCCL: the pip wheel's TorchConfig passes it on to CMake targets;
// Debian's CPU LibTorch has none) and NCCL's nccl.h is on the include path
// (pip: site-packages/nvidia/nccl/include; CUDA installs may have it).
// ProcessGroupNCCL.hpp declares nothing without USE_C10D_NCCL. Define
// AMP_DETAIL_HAS_NCCL=0 to leave NCCL out.
#ifndef AMP_DETAIL_HAS_NCCL
#if defined(USE_C10D_NCCL) && defined(__has_include)
#if __has_include(<nccl.h>)
#define AMP_DETAIL_HAS_NCCL 1
#endif
#endif
#endif
#ifndef AMP_DETAIL_HAS_NCCL
#define AMP_DETAIL_HAS_NCCL 0
#endif
#if AMP_DETAIL_HAS_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace amp::detail::compat {

inline constexpr bool kHasNccl = AMP_DETAIL_HAS_NCCL;

// ProcessGroupGloo's reduce_scatter_single with ReduceOp::AVG: what
// torch.distributed.reduce_scatter_single calls, FSDP2's gradient reduction on
// LibTorch 2.14. 1.13's Gloo has no reduce-scatter of one tensor; 2.6's
// (_reduce_scatter_base) is not relied on, as no FSDP2 reference runs on its
// CPU. Without it ProcessGroup::reduce_scatter_avg all-reduces and slices.
inline constexpr bool kGlooReduceScatterAvg = libtorch_at_least(2, 14);

// Starts that reduce-scatter (AVG) of `in` into `out` (both flat).
template <class Group>
c10::intrusive_ptr<c10d::Work> gloo_reduce_scatter_avg(Group& gloo, at::Tensor& out, at::Tensor& in) {
  if constexpr (kGlooReduceScatterAvg) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::AVG;
    return gloo.reduce_scatter_single(out, in, opts);
  } else {
    (void)out, (void)in;
    TORCH_CHECK(false, "amp: internal: Gloo's reduce-scatter with AVG is not used before LibTorch 2.14");
  }
}

// Which 16-bit dtypes Gloo takes is a property of the LibTorch build, not of
// its version: ProcessGroupGloo rejects a dtype it was built without
// ("Invalid scalar type"). Measured: 1.13 takes fp16, not bf16; Debian 13's
// 2.6 takes both; Debian 14's 2.14 takes neither. init_process_group asks
// (probe_gloo_dtypes); a dtype Gloo lacks travels as fp32.
struct GlooDtypes {
  bool half = false;
  bool bfloat16 = false;
  bool takes(c10::ScalarType dtype) const {
    return dtype == c10::ScalarType::Half ? half : dtype == c10::ScalarType::BFloat16 ? bfloat16 : true;
  }
};

// The dtype a CPU tensor of `dtype` travels in over Gloo: itself, or fp32
// where Gloo lacks it (exact for a broadcast: 16-bit -> fp32 -> 16-bit is
// lossless; an all-reduce then sums in fp32 and rounds once, and every rank
// rounds the same sum).
inline c10::ScalarType gloo_wire_dtype(c10::ScalarType dtype, const GlooDtypes& gloo) {
  return gloo.takes(dtype) ? dtype : c10::ScalarType::Float;
}

// One 1-element all-reduce per 16-bit dtype, on every rank at the same point
// (right after the group connects). Gloo rejects a dtype before it sends
// anything, the same way on every rank, so a rejection leaves the group as it
// was. Any other failure is rethrown.
template <class Group>
GlooDtypes probe_gloo_dtypes(Group& gloo, std::chrono::milliseconds timeout) {
  auto takes = [&](c10::ScalarType dtype) {
    std::vector<at::Tensor> v{at::zeros({1}, at::TensorOptions().dtype(dtype))};
    try {
      gloo.allreduce(v)->wait(timeout);
      return true;
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("Invalid scalar type") != std::string::npos) return false;
      throw;
    }
  };
  GlooDtypes d;
  d.half = takes(c10::ScalarType::Half);
  d.bfloat16 = takes(c10::ScalarType::BFloat16);
  return d;
}

template <class O, class = void>
struct has_use_libuv : std::false_type {};
template <class O>
struct has_use_libuv<O, std::void_t<decltype(std::declval<O&>().useLibUV)>> : std::true_type {};

template <class O>
void classic_tcp_server(O& o) {
  if constexpr (has_use_libuv<O>::value) o.useLibUV = false;
}

// TCPStore options: rank 0 serves, every rank (the server too) is a client;
// the server waits for all of them within `timeout`.
inline c10d::TCPStoreOptions tcp_store_options(uint16_t port, bool is_server, int world_size,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = port;
  o.isServer = is_server;
  o.numWorkers = static_cast<std::size_t>(world_size);
  o.waitWorkers = true;
  o.timeout = timeout;
  // The classic server on every line: Debian's LibTorch 2.x may lack libuv,
  // and the classic one behaves as on 1.13 (same errors, same timeouts).
  classic_tcp_server(o);
  return o;
}

using GlooOptions = c10d::ProcessGroupGloo::Options;

// The Gloo transport device: on an explicit address (e.g. 127.0.0.1), or
// torch's default (the hostname's address; GLOO_SOCKET_IFNAME is read by torch).
inline std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& hostname) {
  return hostname.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                          : c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
}

#if AMP_DETAIL_HAS_NCCL
// An NCCL group on `store` (both lines: (store, rank, size, options), with
// Options::timeout). It makes no communicator until its first collective.
inline c10::intrusive_ptr<c10d::ProcessGroupNCCL> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                            int size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

inline void set_cuda_device(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }
#endif

}  // namespace amp::detail::compat
