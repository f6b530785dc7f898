// amp/distributed/process_group.h: amp::ProcessGroup and amp::init_process_group,
// the rendezvous half of amp/distributed.h (read that header's comment).
#pragma once

#include <torch/arg.h>
#include <torch/cuda.h>
#include <ATen/ATen.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat_c10d.h"
#include "amp/distributed/detail/env.h"

namespace amp {

// What carries CUDA tensors between processes. CPU tensors, and amp's own
// messages (shape check, checkpoint status, fit()'s losses), always go over Gloo.
enum class Backend {
  kAuto,  // NCCL for CUDA tensors where this LibTorch has it (AMP_DETAIL_HAS_NCCL), Gloo for CPU ones
  kGloo,  // Gloo only: CPU tensors; amp never touches CUDA
  kNccl,  // NCCL for CUDA tensors; init_process_group fails without NCCL or a GPU for LOCAL_RANK
};

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
  // kAuto or kNccl on a LibTorch with NCCL and a GPU for LOCAL_RANK:
  // init_process_group makes cuda:LOCAL_RANK the current device (as
  // torchrun's users expect); put the model on pg.device().
  TORCH_ARG(Backend, backend) = Backend::kAuto;
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
// torchrun's RANK, WORLD_SIZE, LOCAL_RANK (default: RANK), MASTER_ADDR,
// MASTER_PORT; amp: errors for missing or invalid ones.
inline ProcessInfo process_info_from_env() {
  constexpr const char* hint =
      "launch with torchrun or amp's tools/launch, which set RANK, WORLD_SIZE, "
      "LOCAL_RANK, MASTER_ADDR and MASTER_PORT";
  ProcessInfo info;
  info.world_size = detail::env_int("WORLD_SIZE", 1, 1 << 20, hint);
  info.rank = detail::env_int("RANK", 0, info.world_size - 1, hint);
  info.local_rank =
      detail::env_or_empty("LOCAL_RANK").empty() ? info.rank : detail::env_int("LOCAL_RANK", 0, 1 << 20, hint);
  info.master_addr = detail::env_or_empty("MASTER_ADDR");
  TORCH_CHECK(!info.master_addr.empty(), "amp: environment variable MASTER_ADDR is not set; ", hint);
  info.master_port = detail::env_int("MASTER_PORT", 1, 65535, hint);
  return info;
}
}  // namespace detail

namespace detail {
constexpr const char* kNoNcclFix =
    "this LibTorch build has no NCCL for amp (AMP_DETAIL_HAS_NCCL is 0: USE_C10D_NCCL not defined, as in Debian's CPU "
    "LibTorch, or nccl.h not on the include path); build against a CUDA LibTorch with NCCL (the pip wheel's "
    "TorchConfig defines USE_C10D_NCCL) with NCCL's headers, or train on CPU with Backend::kGloo";

// The NCCL group, made on the first CUDA collective (shared by copies).
struct NcclSlot {
  std::mutex mutex;
#if AMP_DETAIL_HAS_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group;
#endif
};
}  // namespace detail

// A Gloo process group with its store, and an NCCL group for CUDA tensors
// where this LibTorch has NCCL: copies share them. Every collective goes by
// its tensor's device: CUDA over NCCL, CPU over Gloo.
class ProcessGroup {
 public:
  // gloo_dtypes: the 16-bit dtypes this build's Gloo takes (init_process_group
  // asks Gloo; the default sends every 16-bit CPU tensor as fp32).
  ProcessGroup(ProcessInfo info, c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo,
               std::chrono::milliseconds timeout, Backend backend = Backend::kGloo,
               c10::Device device = c10::Device(c10::kCPU), detail::compat::GlooDtypes gloo_dtypes = {})
      : info_(std::move(info)),
        store_(std::move(store)),
        gloo_(std::move(gloo)),
        timeout_(timeout),
        backend_(backend),
        device_(device),
        gloo_dtypes_(gloo_dtypes),
        nccl_(std::make_shared<detail::NcclSlot>()) {}

  int rank() const { return info_.rank; }
  int world_size() const { return info_.world_size; }
  int local_rank() const { return info_.local_rank; }
  const ProcessInfo& info() const { return info_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  c10d::ProcessGroupGloo& gloo() const { return *gloo_; }
  const c10::intrusive_ptr<c10d::ProcessGroupGloo>& gloo_ptr() const { return gloo_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  Backend backend() const { return backend_; }
  // Where this process trains: cuda:LOCAL_RANK when init_process_group made
  // it the current device (NCCL), else CPU.
  c10::Device device() const { return device_; }

  // An amp: error unless CUDA tensors can travel (NCCL, backend not kGloo).
  void require_cuda(const std::string& what) const {
    TORCH_CHECK(detail::compat::kHasNccl, "amp: ", what, " is on CUDA, but ", detail::kNoNcclFix);
    TORCH_CHECK(backend_ != Backend::kGloo, "amp: ", what,
                " is on CUDA, but ProcessGroupOptions::backend is kGloo (CPU tensors only); use Backend::kAuto or "
                "kNccl, or keep the model on CPU");
  }

#if AMP_DETAIL_HAS_NCCL
  // The NCCL group (on a PrefixStore of the same TCPStore, with the same
  // timeout), made on first use; every rank reaches it at the same collective.
  c10d::ProcessGroupNCCL& nccl() const {
    std::lock_guard<std::mutex> lock(nccl_->mutex);
    if (!nccl_->group) {
      try {
        nccl_->group = detail::compat::make_nccl(c10::make_intrusive<c10d::PrefixStore>("amp_nccl", store_), info_.rank,
                                                 info_.world_size, timeout_);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "amp: rank ", info_.rank, " of ", info_.world_size,
                    " could not create its NCCL group (is this process's GPU free, and NCCL's library the one "
                    "LibTorch was built with?): ",
                    detail::first_line(e));
      }
    }
    return *nccl_->group;
  }
#endif

  // Whether this build's Gloo takes CPU tensors of `dtype` (16-bit ones vary).
  bool gloo_takes(c10::ScalarType dtype) const { return gloo_dtypes_.takes(dtype); }

  // The dtype `t` travels in: its own, or fp32 for a 16-bit CPU tensor where
  // this build's Gloo lacks its dtype (compat::gloo_wire_dtype).
  c10::ScalarType wire_dtype(const at::Tensor& t) const {
    return t.is_cuda() ? t.scalar_type() : detail::compat::gloo_wire_dtype(t.scalar_type(), gloo_dtypes_);
  }

  // Starts a sum all-reduce of `t` in place, over the backend of t's device;
  // t must already be in wire_dtype(t) (the caller widens).
  c10::intrusive_ptr<c10d::Work> start_allreduce(at::Tensor& t, const std::string& what) const {
    std::vector<at::Tensor> v{t};
    return on_backend_of(t, what, [&](auto& backend) { return backend.allreduce(v); });
  }

  // Waits for `work` at most timeout(); an amp: error naming `what` if it
  // times out or fails (a peer died: Gloo reports its closed connection).
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    try {
      if (work->wait(timeout_)) return;
      error = "wait() returned false";
    } catch (const std::exception& e) {
      error = detail::first_line(e);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    TORCH_CHECK(false, "amp: ", what, " on rank ", info_.rank, " of ", info_.world_size, " failed after ", ms.count(),
                " ms (timeout ", timeout_.count(), " ms): a peer process died, hung or diverged from this one (", error,
                ")");
  }

  void barrier() const { wait(gloo_->barrier(), "barrier"); }

  // The collectives below take tensors of any dtype: one that Gloo lacks
  // travels as an fp32 copy (wire_dtype), copied back after.
  void allreduce_sum(at::Tensor& t, const std::string& what) const {
    at::Tensor w = on_wire(t);
    wait(start_allreduce(w, what), what);
    if (!w.is_same(t)) t.copy_(w);
  }

  // The elementwise largest over the processes, in place.
  void allreduce_max(at::Tensor& t, const std::string& what) const {
    at::Tensor w = on_wire(t);
    std::vector<at::Tensor> v{w};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    wait(on_backend_of(w, what, [&](auto& backend) { return backend.allreduce(v, o); }), what);
    if (!w.is_same(t)) t.copy_(w);
  }

  void broadcast(at::Tensor& t, int root, const std::string& what) const {
    at::Tensor w = on_wire(t);
    std::vector<at::Tensor> v{w};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    wait(on_backend_of(w, what, [&](auto& backend) { return backend.broadcast(v, o); }), what);
    if (!w.is_same(t)) t.copy_(w);
  }

  // Every rank's `t` (same shape and dtype on all ranks), in rank order.
  std::vector<at::Tensor> allgather(const at::Tensor& t, const std::string& what) const {
    std::vector<at::Tensor> in{on_wire(t).contiguous()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < info_.world_size; ++r) out[0].push_back(at::empty_like(in[0]));
    wait(on_backend_of(in[0], what, [&](auto& backend) { return backend.allgather(out, in); }), what);
    for (auto& o : out[0]) o = o.to(t.scalar_type());
    return out[0];
  }

  // Every rank's `in` (contiguous, same numel and dtype on every rank),
  // concatenated in rank order into `out` (contiguous, world_size() times as
  // many elements, in's dtype): FSDP's all-gather of parameter shards. Over
  // Gloo it travels as bytes (a copy, exact in every dtype, also the 16-bit
  // ones a build's Gloo lacks).
  void allgather_into(at::Tensor& out, const at::Tensor& in, const std::string& what) const {
    wait(start_allgather_into(out, in, what), what);
  }
  // allgather_into's collective, started and not waited for: `out` holds the
  // result once wait(work, what) returns (keep `in` and `out` alive until then).
  c10::intrusive_ptr<c10d::Work> start_allgather_into(at::Tensor& out, const at::Tensor& in,
                                                      const std::string& what) const {
    TORCH_CHECK(in.is_contiguous() && out.is_contiguous() && out.scalar_type() == in.scalar_type() &&
                    out.numel() == in.numel() * info_.world_size,
                "amp: ", what, ": allgather_into needs contiguous tensors of one dtype, out with world_size x in's ",
                "elements; got in ", in.sizes(), " ", in.scalar_type(), ", out ", out.sizes(), " ", out.scalar_type());
    const bool bytes = in.is_cpu();
    std::vector<at::Tensor> src{bytes ? in.reshape({-1}).view(at::kByte) : in.reshape({-1})};
    const at::Tensor flat = bytes ? out.view({-1}).view(at::kByte) : out.view({-1});
    std::vector<std::vector<at::Tensor>> dst(1);
    const int64_t n = src[0].numel();
    for (int r = 0; r < info_.world_size; ++r) dst[0].push_back(flat.narrow(0, r * n, n));
    return on_backend_of(in, what, [&](auto& backend) { return backend.allgather(dst, src); });
  }

  // The average over the ranks of `in` (contiguous, world_size() x out's
  // elements), this rank's row of it into `out`: FSDP's reduce-scatter of
  // gradients (ReduceOp::AVG). Where this LibTorch's Gloo has a reduce-scatter
  // with AVG (compat::kGlooReduceScatterAvg) and takes the dtype, that one
  // call, as torch.distributed.reduce_scatter_tensor makes it; else a sum
  // all-reduce of `in` (in wire_dtype), this rank's row divided by
  // world_size() (the row's sum rounded once to out's dtype first).
  void reduce_scatter_avg(at::Tensor& out, const at::Tensor& in, const std::string& what) const {
    TORCH_CHECK(in.is_contiguous() && out.is_contiguous() && out.scalar_type() == in.scalar_type() &&
                    in.numel() == out.numel() * info_.world_size,
                "amp: ", what, ": reduce_scatter_avg needs contiguous tensors of one dtype, in with world_size x ",
                "out's elements; got in ", in.sizes(), " ", in.scalar_type(), ", out ", out.sizes(), " ",
                out.scalar_type());
    if (detail::compat::kGlooReduceScatterAvg && in.is_cpu() && gloo_takes(in.scalar_type())) {
      at::Tensor o = out.view({-1});
      at::Tensor i = in.view({-1});
      wait(detail::compat::gloo_reduce_scatter_avg(*gloo_, o, i), what);
      return;
    }
    at::Tensor sum = on_wire(in);
    if (sum.is_same(in)) sum = in.clone();
    wait(start_allreduce(sum, what), what);
    out.view({-1}).copy_(sum.view({info_.world_size, -1})[info_.rank]);
    out.div_(info_.world_size);
  }

 private:
  at::Tensor on_wire(const at::Tensor& t) const {
    const c10::ScalarType wire = wire_dtype(t);
    return wire == t.scalar_type() ? t : t.to(wire);
  }

  // f(Gloo) for a CPU tensor, f(NCCL) for a CUDA one.
  template <class F>
  c10::intrusive_ptr<c10d::Work> on_backend_of(const at::Tensor& t, const std::string& what, F&& f) const {
    if (t.is_cuda()) {
      require_cuda(what);
#if AMP_DETAIL_HAS_NCCL
      return f(nccl());
#endif
    }
    TORCH_CHECK(t.is_cpu(), "amp: ", what, " is on ", t.device(),
                "; amp communicates CPU (Gloo) and CUDA (NCCL) "
                "tensors only: move it to one of them");
    return f(*gloo_);
  }

  ProcessInfo info_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo_;
  std::chrono::milliseconds timeout_;
  Backend backend_;
  c10::Device device_;
  detail::compat::GlooDtypes gloo_dtypes_;
  std::shared_ptr<detail::NcclSlot> nccl_;
};

namespace detail {
// kNccl's requirements (checked before the rendezvous: every rank fails at
// once), and the device: cuda:LOCAL_RANK, made current, where NCCL will
// carry CUDA tensors and this process has that GPU; else CPU.
inline c10::Device training_device(const ProcessInfo& info, Backend backend) {
  if (backend == Backend::kNccl) {
    TORCH_CHECK(compat::kHasNccl, "amp: ProcessGroupOptions::backend is kNccl, but ", kNoNcclFix);
    TORCH_CHECK(torch::cuda::is_available(),
                "amp: ProcessGroupOptions::backend is kNccl, but LibTorch sees no CUDA "
                "device; use Backend::kGloo (or kAuto) to train on CPU");
    // device_count() is size_t up to 2.x, c10::DeviceIndex (int8) in 2.14.
    const auto devices = static_cast<int64_t>(torch::cuda::device_count());
    TORCH_CHECK(info.local_rank < devices, "amp: LOCAL_RANK=", info.local_rank, " but this process sees ", devices,
                " CUDA device(s); start one process per GPU, or pass init_process_group a ProcessInfo whose "
                "local_rank is this process's GPU index");
  }
#if AMP_DETAIL_HAS_NCCL
  if (backend != Backend::kGloo && torch::cuda::is_available() &&
      static_cast<size_t>(info.local_rank) < torch::cuda::device_count()) {
    compat::set_cuda_device(info.local_rank);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(info.local_rank));
  }
#endif
  return c10::Device(c10::kCPU);
}

// Every rank must have been told the same world size (torchrun gives each the
// same WORLD_SIZE; hand-set environments can disagree, and Gloo then only
// times out): each rank publishes its own through the store and compares it
// with rank 0's (rank 0: with every other rank's). Rank 0 serves the store,
// so before it may fail it waits (within the timeout) until each rank it
// compared with has read its value: both sides get the mismatch, not a
// closed connection.
inline void check_same_world_size(c10d::Store& store, const ProcessInfo& info, std::chrono::milliseconds timeout) {
  const std::string mine = std::to_string(info.world_size);
  auto key = [](const char* what, int64_t r) { return std::string("amp/world_size/") + what + std::to_string(r); };
  auto read = [&](int64_t r) {
    std::vector<uint8_t> v;
    try {
      v = store.get(key("of", r));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "amp: rank ", info.rank, " of ", info.world_size, " could not read rank ", r,
                  "'s WORLD_SIZE within ", timeout.count(),
                  " ms (did every rank start, with the same WORLD_SIZE?): ", first_line(e));
    }
    return std::string(v.begin(), v.end());
  };
  auto mismatch = [&](int64_t r, const std::string& theirs) {
    return c10::str("amp: rank ", info.rank, " was given WORLD_SIZE=", mine, " but rank ", r, " WORLD_SIZE=", theirs,
                    "; every process must be given the same WORLD_SIZE (torchrun and tools/launch set it for you)");
  };
  store.set(key("of", info.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  if (info.rank != 0) {
    const std::string theirs = read(0);
    store.set(key("read_by", info.rank), std::vector<uint8_t>{1});
    TORCH_CHECK(theirs == mine, mismatch(0, theirs));
    return;
  }
  for (int64_t r = 1; r < info.world_size; ++r) {
    const std::string theirs = read(r);
    try {
      (void)store.get(key("read_by", r));  // r has read rank 0's value
    } catch (const std::exception&) {
      // r died or stopped after writing: its own error (or none) is its
      // launcher's to report; rank 0's comes next either way.
    }
    TORCH_CHECK(theirs == mine, mismatch(r, theirs));
  }
}
}  // namespace detail

// Rendezvous through a c10d::TCPStore on info.master_addr:master_port (rank 0
// serves it) and a Gloo process group (NCCL's comes on the first CUDA
// collective). Bounded by options.timeout().
inline ProcessGroup init_process_group(const ProcessInfo& info, const ProcessGroupOptions& options = {}) {
  TORCH_CHECK(info.world_size >= 1, "amp: world_size must be >= 1, got ", info.world_size);
  TORCH_CHECK(info.rank >= 0 && info.rank < info.world_size, "amp: rank ", info.rank, " is not in [0, ",
              info.world_size, ")");
  TORCH_CHECK(info.master_port >= 1 && info.master_port <= 65535, "amp: master_port ", info.master_port,
              " is not in [1, 65535]");
  TORCH_CHECK(options.timeout().count() > 0, "amp: ProcessGroupOptions::timeout must be > 0");
  TORCH_CHECK(options.threads() >= 1, "amp: ProcessGroupOptions::threads must be >= 1");
  const c10::Device device = detail::training_device(info, options.backend());
  const std::string where = info.master_addr + ":" + std::to_string(info.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(
        info.master_addr, detail::compat::tcp_store_options(static_cast<uint16_t>(info.master_port), info.rank == 0,
                                                            info.world_size, options.timeout()));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "amp: rank ", info.rank, " of ", info.world_size, " could not rendezvous at ", where, " within ",
                options.timeout().count(), " ms (",
                info.rank == 0 ? "is the port free, and did every rank start?" : "is rank 0 running there?",
                "): ", detail::first_line(e));
  }
  detail::check_same_world_size(*store, info, options.timeout());
  auto gloo_options = detail::compat::GlooOptions::create(options.timeout());
  const std::string host = !options.hostname().empty()             ? options.hostname()
                           : detail::is_loopback(info.master_addr) ? std::string("127.0.0.1")
                                                                   : std::string();
  gloo_options->devices.push_back(detail::compat::gloo_device(host));
  gloo_options->threads = options.threads();
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  try {
    gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world_size, gloo_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "amp: rank ", info.rank, " of ", info.world_size, " could not connect the Gloo group via ",
                where, " within ", options.timeout().count(), " ms: ", detail::first_line(e));
  }
  const detail::compat::GlooDtypes dtypes = detail::compat::probe_gloo_dtypes(*gloo, options.timeout());
  return ProcessGroup(info, std::move(store), std::move(gloo), options.timeout(), options.backend(), device, dtypes);
}

// The same from torchrun's environment variables (detail::process_info_from_env()).
inline ProcessGroup init_process_group(const ProcessGroupOptions& options = {}) {
  return init_process_group(detail::process_info_from_env(), options);
}

}  // namespace amp
