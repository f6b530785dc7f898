// amp/distributed/data_parallel.h: data-parallel training on c10d (LibTorch's own
// distributed engine): CPU processes over Gloo; CUDA ones over NCCL where
// LibTorch has it (AMP_HAS_NCCL; compiled, never run so far: README).
//
//   // launched as N processes: tools/launch -n 2 -- ./train   (or torchrun)
//   amp::ProcessGroup pg = amp::init_process_group();      // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer);
//   amp::DataParallel dp(pg, trainer);                     // same shapes on every rank? rank 0's weights to all
//   for (...) trainer.step([&](auto&) { return loss_on_my_shard(); });   // gradients averaged across ranks
//   amp::save_on_rank0(pg, trainer, "ckpt.pt");            // rank 0 writes; every rank: trainer.load("ckpt.pt")
//
// DataParallel is the Stepper's GradientSync (amp/train/stepper.h): a hook on every
// parameter that requires grad puts its gradient into its bucket as backward
// produces it; a full bucket's all-reduce starts at once (buckets in a fixed
// order, the same on every rank), overlapping the rest of backward;
// finish_backward() waits for them and writes the averages into .grad. The
// average is computed as torch DDP's reducer computes it (reducer.cpp, no
// comm hook): each gradient is multiplied by 1/world_size
// as it enters the bucket (at::mul_out with the double 1.0 / N as a wrapped
// scalar), the all-reduce sums, and nothing is divided after (summing and
// then dividing differs in the last bit for N = 3; for a power-of-two N the
// two agree but for subnormal or overflowing values). Gloo's sum of an
// element depends on its offset in the bucket, so the buckets are laid out
// as DDP's reducer lays them out (detail/data_parallel_impl.h): the first
// boundary one bucket per dtype in parameter order; after it, rebuilt in the
// order rank 0's gradients arrived in then, cut at 1 MiB and then at
// bucket_cap_mb (tests/parity/ddp_twin.py compares layouts and bits at 2, 3
// and 4 processes). Micro-batches that do not end an accumulation cycle
// communicate nothing (DDP's no_sync).
// Gradients are averaged while scaled, so every rank unscales the same
// values, makes the same skip decision and keeps the same loss scale (an inf
// on one rank reaches all through the sum). Optionally the buckets travel as
// fp16 or bf16, as DDP's fp16_compress_hook / bf16_compress_hook do it: the
// gradients are copied into the bucket as they are, the bucket is cast to the
// wire dtype and divided there by N (`buffer.to(dtype).div_(world_size)`),
// summed, and copied back. A bucket whose dtype this LibTorch's Gloo lacks
// (a build option: amp/detail/compat_c10d.h) travels as an fp32 copy, summed
// in fp32 and rounded back once. Every wait is bounded by ProcessGroupOptions::timeout: a dead or
// stopped peer is an amp: error.
//
// Needs Gloo's headers (Debian: libgloo-dev); defines USE_C10D_GLOO for them.
#pragma once

#include <torch/arg.h>
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <ostream>
#include <sstream>
#include <streambuf>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/distributed/detail/data_parallel_impl.h"
#include "amp/distributed/process_group.h"
#include "amp/distributed/sharded_optimizer.h"
#include "amp/train/history.h"
#include "amp/train/stepper.h"
#include "amp/version.h"

namespace amp {

enum class GradCompression { kNone, kFp16, kBf16 };

struct DataParallelOptions {
  // Bucket size cap in MiB (DDP's bucket_cap_mb), from the second boundary
  // on; a bucket closes at the parameter that reaches it. The first bucket
  // closes at 1 MiB, or (LibTorch 2.6+, as DDP given bucket_cap_mb) at this
  // cap where it is not 25.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // The dtype buckets travel in: kNone (the gradients' own), kFp16 or kBf16.
  TORCH_ARG(GradCompression, compression) = GradCompression::kNone;
  // Broadcast rank 0's buffers (e.g. BatchNorm statistics) with its parameters at construction.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Start each bucket's all-reduce as soon as backward has filled it (DDP).
  // false: all after backward (for measuring what the overlap buys).
  TORCH_ARG(bool, overlap) = true;
};

class DataParallel : public GradientSync {
 public:
  // `params` (and `buffers`) of this rank's replica: checked to have the same
  // count, shapes and dtypes on every rank, then overwritten with rank 0's.
  // Install it yourself: stepper.set_gradient_sync(&dp).
  DataParallel(ProcessGroup pg, std::vector<at::Tensor> params, std::vector<at::Tensor> buffers = {},
               DataParallelOptions options = {}, std::vector<std::string> names = {})
      : pg_(std::move(pg)), options_(std::move(options)), params_(std::move(params)), names_(std::move(names)) {
    setup(buffers);
  }

  // From a Trainer: its module's parameters and buffers; installs itself as
  // the trainer's GradientSync and removes itself when destroyed.
  template <class T, class = std::enable_if_t<detail::has_stepper<T>::value>>
  DataParallel(ProcessGroup pg, T& trainer, DataParallelOptions options = {})
      : pg_(std::move(pg)), options_(std::move(options)) {
    std::vector<at::Tensor> buffers;
    for (const auto& p : trainer.module().named_parameters(/*recurse=*/true)) {
      names_.push_back(p.key());
      params_.push_back(p.value());
    }
    for (const auto& b : trainer.module().buffers(/*recurse=*/true)) buffers.push_back(b);
    setup(buffers);
    auto* stepper = &trainer.stepper();
    stepper->set_gradient_sync(this);
    uninstall_ = [stepper, this] {
      if (stepper->gradient_sync() == this) stepper->set_gradient_sync(nullptr);
    };
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  ~DataParallel() override {
    if (uninstall_) uninstall_();
    for (size_t i = 0; i < params_.size(); ++i)
      if (hooks_[i] != kNoHook) params_[i].remove_hook(hooks_[i]);
  }

  // GradientSync: the Stepper's calls around each micro-batch's backward.
  void begin_backward(bool boundary) override {
    TORCH_CHECK(!in_flight(),
                "amp: DataParallel::begin_backward() while the previous boundary's all-reduces are "
                "still in flight; finish_backward() was not called");
    active_ = boundary;
    if (!boundary) return;
    for (auto& b : buckets_) {
      std::fill(b.ready.begin(), b.ready.end(), false);
      b.pending = b.params.size();
      b.work.reset();
    }
    next_ = 0;
  }

  void finish_backward() override {
    if (!active_) return;
    active_ = false;
    std::lock_guard<std::mutex> lock(mutex_);
    // Parameters backward did not reach (unused in this forward): their
    // current gradient, or zeros, so every rank all-reduces every bucket.
    for (auto& b : buckets_)
      for (size_t k = 0; k < b.params.size(); ++k)
        if (!b.ready[k]) {
          if (!rebuilt_) arrival_.push_back(b.params[k]);
          fill(b, k, at::Tensor());
        }
    launch_ready();
    at::NoGradGuard no_grad;
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      auto& b = buckets_[bi];
      pg_.wait(b.work,
               "gradient all-reduce (bucket " + std::to_string(bi) + " of " + std::to_string(buckets_.size()) + ")");
      b.work.reset();
      // The sum is the average (each term was scaled by 1/N on the way in);
      // world size 1: the gradient itself, bit for bit.
      if (!b.comm.is_same(b.flat)) b.flat.copy_(b.comm);  // compressed or widened: back to the gradients' dtype
      b.comm.reset();
      for (size_t k = 0; k < b.params.size(); ++k) {
        at::Tensor& p = params_[b.params[k]];
        const at::Tensor avg = slot(b, k);
        if (p.grad().defined()) {
          p.mutable_grad().copy_(avg);
        } else {
          p.mutable_grad() = avg.clone();
        }
      }
    }
    if (!rebuilt_) rebuild();
  }

  // Float8 delayed scaling's amaxes of the step: their largest over the ranks
  // (one all-reduce), so that every rank computes the same scales.
  void reduce_max(at::Tensor& t) override { pg_.allreduce_max(t, "float8 amax all-reduce"); }

  // Checkpoints hold every rank's random generators, each restored on its
  // own rank ("amp/rng/rank<r>/"; rank 0's also as "amp/rng/", which a single
  // process reads). gather_rng() (every rank; save_on_rank0 calls it) collects
  // them for rank 0's next write; without it a checkpoint holds this rank's.
  void write_rng(torch::serialize::OutputArchive& archive) const override {
    const std::vector<detail::RngStates> all =
        gathered_rng_.empty() ? std::vector<detail::RngStates>{detail::capture_rng()} : gathered_rng_;
    const int first = gathered_rng_.empty() ? pg_.rank() : 0;
    for (size_t r = 0; r < all.size(); ++r) {
      const int rank = first + static_cast<int>(r);
      detail::write_rng(archive, all[r], "amp/rng/rank" + std::to_string(rank) + "/");
      if (rank == 0) detail::write_rng(archive, all[r], "amp/rng/");
    }
  }
  std::string rng_prefix() const override { return "amp/rng/rank" + std::to_string(pg_.rank()) + "/"; }
  void gather_rng() { gathered_rng_ = detail::allgather_rng(pg_, detail::capture_rng()); }
  void forget_gathered_rng() { gathered_rng_.clear(); }

  // All-reduces issued so far (one per bucket per optimizer step), and the bucket count.
  int64_t allreduces() const { return allreduces_.load(); }
  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Parameter indices per bucket, in launch order, of the next boundary:
  // DDP's first layout until the first boundary's finish_backward(), then
  // the rebuilt one (both: detail/data_parallel_impl.h). Frozen parameters
  // (requires_grad false at construction) are in none; their .grad is untouched.
  std::vector<std::vector<size_t>> bucket_layout() const {
    std::vector<std::vector<size_t>> out;
    for (const auto& b : buckets_) out.push_back(b.params);
    return out;
  }

  int rank() const { return pg_.rank(); }
  int world_size() const { return pg_.world_size(); }
  bool is_main() const { return pg_.rank() == 0; }
  void barrier() const { pg_.barrier(); }
  const ProcessGroup& process_group() const { return pg_; }

 private:
  static constexpr unsigned kNoHook = static_cast<unsigned>(-1);

  bool in_flight() const {
    for (const auto& b : buckets_)
      if (b.work) return true;
    return false;
  }

  std::string name(size_t i) const { return i < names_.size() ? "'" + names_[i] + "'" : "#" + std::to_string(i); }

  void setup(const std::vector<at::Tensor>& buffers) {
    TORCH_CHECK(!params_.empty(), "amp: DataParallel needs the model's parameters; got none");
    TORCH_CHECK(options_.bucket_cap_mb() > 0, "amp: DataParallelOptions::bucket_cap_mb must be > 0, got ",
                options_.bucket_cap_mb());
    for (size_t i = 0; i < params_.size(); ++i)
      TORCH_CHECK(params_[i].defined(), "amp: DataParallel: parameter ", name(i),
                  " is undefined; pass the "
                  "model's parameters");
    const c10::Device device = params_.front().device();
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i];
      TORCH_CHECK(p.device() == device, "amp: DataParallel: parameter ", name(i), " is on ", p.device(), " but ",
                  name(0), " is on ", device, "; put the whole model on one device (model->to(pg.device()))");
      TORCH_CHECK(at::isFloatingType(p.scalar_type()), "amp: DataParallel: parameter ", name(i), " is ",
                  p.scalar_type(), ", not floating point");
    }
    if (device.is_cuda()) {
      pg_.require_cuda("DataParallel's model (parameter " + name(0) + ")");
    } else {
      TORCH_CHECK(device.is_cpu(), "amp: DataParallel: the model is on ", device,
                  "; amp trains CPU (Gloo) and CUDA (NCCL) models across processes: move it to one of them");
      TORCH_CHECK(pg_.backend() != Backend::kNccl,
                  "amp: DataParallel: the model is on CPU but "
                  "ProcessGroupOptions::backend is kNccl (CUDA tensors only); move the model to pg.device() or "
                  "use Backend::kAuto or kGloo");
      if (options_.compression() != GradCompression::kNone) {
        const bool half = options_.compression() == GradCompression::kFp16;
        const bool other = pg_.gloo_takes(half ? at::kBFloat16 : at::kHalf);  // what this Gloo does take
        TORCH_CHECK(pg_.gloo_takes(half ? at::kHalf : at::kBFloat16), "amp: DataParallelOptions::compression(",
                    half ? "kFp16" : "kBf16", ") on CPU needs a Gloo that takes ", half ? "Half" : "BFloat16",
                    "; this LibTorch's Gloo takes ", other ? (half ? "BFloat16 only" : "Half only") : "neither",
                    " (a build option of Gloo): use GradCompression::kNone",
                    other ? (half ? " or kBf16" : " or kFp16") : "");
      }
    }
    const std::vector<at::Tensor> bufs = options_.broadcast_buffers() ? buffers : std::vector<at::Tensor>{};
    detail::check_same_shapes(pg_, detail::shape_summary(params_, bufs), [this](size_t i) { return name(i); });
    detail::broadcast_from_rank0(pg_, params_, "DataParallel parameter broadcast");
    if (!bufs.empty()) detail::broadcast_from_rank0(pg_, bufs, "DataParallel buffer broadcast");
    hooks_.assign(params_.size(), kNoHook);
    buckets_ = detail::make_buckets(params_, detail::initial_buckets(params_), where_);
    for (size_t j = 0; j < params_.size(); ++j)
      if (where_[j].first != detail::kNowhere)
        hooks_[j] = params_[j].register_hook([this, j](const at::Tensor& grad) { on_grad(j, grad); });
  }

  // After the first boundary (DDP: before the second forward): the layout
  // from rank 0's gradient order, the same on every rank.
  void rebuild() {
    rebuilt_ = true;
    const auto cap = static_cast<size_t>(options_.bucket_cap_mb() * 1024.0 * 1024.0);
    // dist._DEFAULT_FIRST_BUCKET_BYTES; 2.6+ (not 1.13): the cap where bucket_cap_mb is given.
    const size_t first = (libtorch_at_least(2, 6) && options_.bucket_cap_mb() != 25.0) ? cap : size_t{1} << 20;
    const auto mine = detail::rebuilt_buckets(params_, arrival_, first, cap);
    buckets_ = detail::make_buckets(params_, detail::sync_buckets(pg_, mine, arrival_.size()), where_);
    arrival_.clear();
  }

  at::Tensor slot(detail::Bucket& b, size_t k) {
    const at::Tensor& p = params_[b.params[k]];
    return b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
  }

  // grad: this backward's contribution (undefined: none); the bucket gets the
  // value .grad will hold after accumulation (earlier micro-batches + grad),
  // times 1/N without compression, as torch's reducer copies it in
  // (mark_variable_ready_dense: at::mul_out(bucket_view, grad,
  // wrapped_scalar_tensor(1.0 / N))); with compression, as it is (the
  // reducer's copy_ when a comm hook is registered). No gradient at all:
  // zeros (the reducer's zero_()).
  void fill(detail::Bucket& b, size_t k, const at::Tensor& grad) {
    at::NoGradGuard no_grad;
    const at::Tensor& p = params_[b.params[k]];
    at::Tensor s = slot(b, k);
    const at::Tensor old = p.grad();
    if (!grad.defined() && !old.defined()) {
      s.zero_();
    } else {
      // .grad after this backward: AccumulateGrad's old + grad (summed into
      // the slot), or the one that is defined.
      at::Tensor g = grad.defined() ? grad : old;
      if (grad.defined() && old.defined()) g = at::add_out(s, old, grad);
      if (options_.compression() != GradCompression::kNone) {
        if (!g.is_same(s)) s.copy_(g);
      } else {
        // World size 1 multiplies by 1.0: exact, .grad as without DataParallel.
        at::mul_out(s, g, at::native::wrapped_scalar_tensor(1.0 / static_cast<double>(pg_.world_size())));
      }
    }
    b.ready[k] = true;
    --b.pending;
  }

  void on_grad(size_t j, const at::Tensor& grad) {
    if (!active_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto& b = buckets_[where_[j].first];
    const size_t k = where_[j].second;
    TORCH_CHECK(!b.ready[k], "amp: DataParallel: parameter ", name(j),
                " received two gradients in one backward; call backward once per micro-batch");
    TORCH_CHECK(!grad.is_sparse(), "amp: DataParallel: sparse gradients are not supported (parameter ", name(j), ")");
    if (!rebuilt_) arrival_.push_back(j);  // DDP's push_rebuilt_params
    fill(b, k, grad);
    if (options_.overlap()) launch_ready();
  }

  // Launches ready buckets in index order (the same order on every rank).
  void launch_ready() {
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
      auto& b = buckets_[next_++];
      at::NoGradGuard no_grad;
      if (options_.compression() == GradCompression::kNone) {
        b.comm = b.flat;  // already times 1/N (fill)
      } else {
        // fp16_compress_hook / bf16_compress_hook (torch/distributed/algorithms/
        // ddp_comm_hooks/default_hooks.py): buffer.to(dtype).div_(world_size),
        // the integer world size, in the wire dtype.
        const auto dt = options_.compression() == GradCompression::kFp16 ? at::kHalf : at::kBFloat16;
        b.comm = b.flat.to(dt);
        b.comm.div_(static_cast<int64_t>(pg_.world_size()));
      }
      // A dtype this LibTorch's Gloo lacks (16-bit gradients on some builds):
      // an fp32 copy is summed; finish_backward rounds it back once.
      const c10::ScalarType wire = pg_.wire_dtype(b.comm);
      if (wire != b.comm.scalar_type()) b.comm = b.comm.to(wire);
      b.work = pg_.start_allreduce(b.comm, "gradient all-reduce");
      ++allreduces_;
    }
  }

  ProcessGroup pg_;
  DataParallelOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<unsigned> hooks_;
  std::vector<detail::Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // per parameter: bucket, place (detail::make_buckets)
  std::vector<size_t> arrival_;                   // the first boundary's gradient order
  bool rebuilt_ = false;
  std::function<void()> uninstall_;
  std::mutex mutex_;
  size_t next_ = 0;
  bool active_ = false;
  std::atomic<int64_t> allreduces_{0};
  std::vector<detail::RngStates> gathered_rng_;  // every rank's, between gather_rng() and the save
};

namespace detail {
// A streambuf that keeps nothing: the other ranks' part of a collective save.
class DiscardBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
  std::streamsize xsputn(const char*, std::streamsize n) override { return n; }
};

// Whether trainer (a Trainer or a Fabric) has an optimizer whose save()
// every rank must call (amp/distributed/sharded_optimizer.h).
template <class T>
bool has_collective_save(const T& trainer) {
  if constexpr (has_stepper<T>::value) {
    return dynamic_cast<const CollectiveSave*>(&trainer.stepper().optimizer()) != nullptr;
  } else {
    for (size_t i = 0; i < trainer.num_optimizers(); ++i)
      if (dynamic_cast<const CollectiveSave*>(&trainer.optimizer(i)) != nullptr) return true;
    return false;
  }
}
}  // namespace detail

// Rank 0 writes trainer.save(path) (atomically); every rank returns once it
// is written, or throws if a rank failed. Call on every rank; any world size
// can trainer.load() the file. With a ShardedOptimizer the other ranks take
// part in the save (its state gather) and write nothing.
template <class T>
void save_on_rank0(const ProcessGroup& pg, const T& trainer, const std::string& path) {
  std::string error;
  // Every rank's generators into rank 0's checkpoint (when trainer's GradientSync is a DataParallel).
  auto* dp = dynamic_cast<DataParallel*>(detail::gradient_sync_of(trainer));
  if (dp != nullptr) dp->gather_rng();
  struct Forget {
    DataParallel* dp;
    ~Forget() {
      if (dp != nullptr) dp->forget_gathered_rng();
    }
  } forget{dp};
  try {
    if (pg.rank() == 0) {
      trainer.save(path);
    } else if (detail::has_collective_save(trainer)) {
      detail::DiscardBuffer discard;
      std::ostream out(&discard);
      trainer.save_state(out);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Rank 0's result first: its message is the one every rank reports.
  at::Tensor ok = at::full({1}, error.empty() ? 1 : 0, at::kInt);
  pg.broadcast(ok, 0, "checkpoint save of '" + path + "'");
  TORCH_CHECK(ok.item<int>() == 1, "amp: rank 0 could not write checkpoint '", path, "'",
              pg.rank() == 0 && !error.empty() ? ": " + error : std::string());
  TORCH_CHECK(error.empty(), "amp: rank ", pg.rank(), " failed in the collective save of '", path, "': ", error);
}

// Trainer::fit across processes: rank r trains on batches r, r + W, r + 2W,
// ... of `batches` (W = world size; every rank passes the same range; the
// last size % W batches are dropped so that all ranks take the same number
// of steps, as DistributedSampler's drop_last). Only rank 0 draws progress.
// The History's losses are averaged over the ranks (one all-reduce at the
// end). For a LibTorch DataLoader, shard with
// torch::data::samplers::DistributedRandomSampler and call trainer.fit.
template <class T, class Range, class F>
History fit_sharded(const ProcessGroup& pg, T& trainer, const Range& batches, F&& fn, FitOptions fo = FitOptions()) {
  using Batch = std::decay_t<decltype(*std::begin(batches))>;
  std::vector<Batch> all(std::begin(batches), std::end(batches));
  const size_t world = static_cast<size_t>(pg.world_size());
  std::vector<Batch> mine;
  for (size_t i = static_cast<size_t>(pg.rank()); i < all.size() / world * world; i += world) mine.push_back(all[i]);
  fo.progress(fo.progress().value_or(trainer.options().progress()) && pg.rank() == 0);
  History history = trainer.fit(mine, std::forward<F>(fn), std::move(fo));
  at::Tensor losses = at::empty({static_cast<int64_t>(history.steps.size())}, at::kDouble);
  for (size_t i = 0; i < history.steps.size(); ++i) losses[static_cast<int64_t>(i)] = history.steps[i].loss;
  pg.allreduce_sum(losses, "fit()'s loss average");
  for (size_t i = 0; i < history.steps.size(); ++i)
    history.steps[i].loss = losses[static_cast<int64_t>(i)].item<double>() / static_cast<double>(world);
  return history;
}

}  // namespace amp
