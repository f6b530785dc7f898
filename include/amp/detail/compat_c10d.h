// amp/detail/compat_c10d.h: the c10d (LibTorch's distributed engine) API
// differences between LibTorch 1.13 and 2.x that amp/distributed.h meets,
// in one place. Needs Gloo's headers (Debian: libgloo-dev).
//
//   1.13: ProcessGroupGloo is a ProcessGroup; TCPStoreOptions has no useLibUV.
//   2.x:  ProcessGroupGloo is a Backend (same collective methods); TCPStore
//         may use a libuv server (useLibUV, on by default since 2.4).
// Both: Work::wait(std::chrono::milliseconds) throws when it times out or
// when the collective failed (a peer closed its connection).
#pragma once

// ProcessGroupGloo.hpp declares nothing without it (torch's build defines it).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace amp::detail::compat {

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

}  // namespace amp::detail::compat
