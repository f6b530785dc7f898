// amp/detail/process_group.h: amp::ProcessGroup and amp::init_process_group,
// the rendezvous half of amp/distributed.h (read that header's comment).
#pragma once

#include <torch/arg.h>
#include <ATen/ATen.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat_c10d.h"

namespace amp {

struct ProcessGroupOptions {
  // Bounds the rendezvous (every rank must reach the master within it) and
  // every collective: a dead or stopped peer gives an amp: error after it.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  // The address Gloo binds and announces. "": 127.0.0.1 when MASTER_ADDR is a
  // loopback address (all ranks on this machine), else torch's default (the
  // hostname's address; GLOO_SOCKET_IFNAME picks an interface).
  TORCH_ARG(std::string, hostname) = "";
  // Gloo's worker threads per process.
  TORCH_ARG(int, threads) = 2;
};

// Where this process is: torchrun's variables, or set by hand.
struct ProcessInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

namespace detail {
inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

inline int env_int(const char* name, long lo, long hi, const char* hint) {
  const std::string s = env_or_empty(name);
  TORCH_CHECK(!s.empty(), "amp: environment variable ", name, " is not set; ", hint);
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != s.c_str() && *end == '\0', "amp: environment variable ", name, "=\"", s,
              "\" is not an integer; ", hint);
  TORCH_CHECK(v >= lo && v <= hi, "amp: environment variable ", name, "=", v, " is out of range [", lo, ", ", hi,
              "]; ", hint);
  return static_cast<int>(v);
}

inline bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}
}  // namespace detail

// torchrun's RANK, WORLD_SIZE, LOCAL_RANK (default: RANK), MASTER_ADDR,
// MASTER_PORT; amp: errors for missing or invalid ones.
inline ProcessInfo process_info_from_env() {
  constexpr const char* hint = "launch with torchrun or amp's tools/launch, which set RANK, WORLD_SIZE, "
                               "LOCAL_RANK, MASTER_ADDR and MASTER_PORT";
  ProcessInfo info;
  info.world_size = detail::env_int("WORLD_SIZE", 1, 1 << 20, hint);
  info.rank = detail::env_int("RANK", 0, info.world_size - 1, hint);
  info.local_rank = detail::env_or_empty("LOCAL_RANK").empty() ? info.rank
                                                                : detail::env_int("LOCAL_RANK", 0, 1 << 20, hint);
  info.master_addr = detail::env_or_empty("MASTER_ADDR");
  TORCH_CHECK(!info.master_addr.empty(), "amp: environment variable MASTER_ADDR is not set; ", hint);
  info.master_port = detail::env_int("MASTER_PORT", 1, 65535, hint);
  return info;
}

// A Gloo process group with its store: copies share it.
class ProcessGroup {
 public:
  ProcessGroup(ProcessInfo info, c10::intrusive_ptr<c10d::Store> store,
               c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo, std::chrono::milliseconds timeout)
      : info_(std::move(info)), store_(std::move(store)), gloo_(std::move(gloo)), timeout_(timeout) {}

  int rank() const { return info_.rank; }
  int world_size() const { return info_.world_size; }
  int local_rank() const { return info_.local_rank; }
  const ProcessInfo& info() const { return info_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  c10d::ProcessGroupGloo& gloo() const { return *gloo_; }
  const c10::intrusive_ptr<c10d::ProcessGroupGloo>& gloo_ptr() const { return gloo_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // Waits for `work` at most timeout(); an amp: error naming `what` if it
  // times out or fails (a peer died: Gloo reports its closed connection).
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      if (work->wait(timeout_)) return;
      error = "wait() returned false";
    } catch (const std::exception& e) {
      error = e.what();
      const auto nl = error.find('\n');  // c10::Error: the message, not the backtrace
      if (nl != std::string::npos) error.resize(nl);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    TORCH_CHECK(false, "amp: ", what, " on rank ", info_.rank, " of ", info_.world_size, " failed after ", ms.count(),
                " ms (timeout ", timeout_.count(), " ms): a peer process died, hung or diverged from this one (",
                error, ")");
  }

  void barrier() const { wait(gloo_->barrier(), "barrier"); }

  void allreduce_sum(at::Tensor& t, const std::string& what) const {
    std::vector<at::Tensor> v{t};
    wait(gloo_->allreduce(v), what);
  }

  void broadcast(at::Tensor& t, int root, const std::string& what) const {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    wait(gloo_->broadcast(v, o), what);
  }

  // Every rank's `t` (same shape and dtype on all ranks), in rank order.
  std::vector<at::Tensor> allgather(const at::Tensor& t, const std::string& what) const {
    std::vector<at::Tensor> in{t.contiguous()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < info_.world_size; ++r) out[0].push_back(at::empty_like(in[0]));
    wait(gloo_->allgather(out, in), what);
    return out[0];
  }

 private:
  ProcessInfo info_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo_;
  std::chrono::milliseconds timeout_;
};

// Rendezvous through a c10d::TCPStore on info.master_addr:master_port (rank 0
// serves it) and a Gloo process group. Bounded by options.timeout().
inline ProcessGroup init_process_group(const ProcessInfo& info, const ProcessGroupOptions& options = {}) {
  TORCH_CHECK(info.world_size >= 1, "amp: world_size must be >= 1, got ", info.world_size);
  TORCH_CHECK(info.rank >= 0 && info.rank < info.world_size, "amp: rank ", info.rank, " is not in [0, ",
              info.world_size, ")");
  TORCH_CHECK(info.master_port >= 1 && info.master_port <= 65535, "amp: master_port ", info.master_port,
              " is not in [1, 65535]");
  TORCH_CHECK(options.timeout().count() > 0, "amp: ProcessGroupOptions::timeout must be > 0");
  TORCH_CHECK(options.threads() >= 1, "amp: ProcessGroupOptions::threads must be >= 1");
  const std::string where = info.master_addr + ":" + std::to_string(info.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(
        info.master_addr, detail::compat::tcp_store_options(static_cast<uint16_t>(info.master_port), info.rank == 0,
                                                            info.world_size, options.timeout()));
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (msg.find('\n') != std::string::npos) msg.resize(msg.find('\n'));
    TORCH_CHECK(false, "amp: rank ", info.rank, " of ", info.world_size, " could not rendezvous at ", where,
                " within ", options.timeout().count(), " ms (",
                info.rank == 0 ? "is the port free, and did every rank start?" : "is rank 0 running there?", "): ",
                msg);
  }
  auto gloo_options = detail::compat::GlooOptions::create(options.timeout());
  const std::string host = !options.hostname().empty()              ? options.hostname()
                           : detail::is_loopback(info.master_addr) ? std::string("127.0.0.1")
                                                                   : std::string();
  gloo_options->devices.push_back(detail::compat::gloo_device(host));
  gloo_options->threads = options.threads();
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  try {
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world_size, gloo_options);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (msg.find('\n') != std::string::npos) msg.resize(msg.find('\n'));
    TORCH_CHECK(false, "amp: rank ", info.rank, " of ", info.world_size, " could not connect the Gloo group via ",
                where, " within ", options.timeout().count(), " ms: ", msg);
  }
  return ProcessGroup(info, std::move(store), std::move(gloo), options.timeout());
}

// The same from torchrun's environment variables (process_info_from_env()).
inline ProcessGroup init_process_group(const ProcessGroupOptions& options = {}) {
  return init_process_group(process_info_from_env(), options);
}

}  // namespace amp
