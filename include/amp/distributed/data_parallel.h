// amp/distributed/data_parallel.h: data-parallel training on c10d (LibTorch's own
// distributed engine): CPU processes over Gloo; CUDA ones over NCCL where
// LibTorch has it (AMP_DETAIL_HAS_NCCL; compiled, never run so far: README).
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
// as DDP's reducer lays them out (detail/bucket_layout.h): the first
// boundary one bucket per dtype in parameter order; after it, rebuilt in the
// order rank 0's gradients arrived in then, cut at 1 MiB and then at
// bucket_cap_mb (tests/parity/ddp_twin.py compares layouts and bits at 2, 3
// and 4 processes). Checkpoints carry the rebuilt layout, so that a resumed
// run keeps it (detail/layout_checkpoint.h). Micro-batches that do not end
// an accumulation cycle communicate nothing (DDP's no_sync). The buckets
// themselves: detail/gradient_buckets.h.
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
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/distributed/detail/bucket_layout.h"
#include "amp/distributed/detail/data_parallel_impl.h"
#include "amp/distributed/detail/gradient_buckets.h"
#include "amp/distributed/detail/layout_checkpoint.h"
#include "amp/distributed/process_group.h"
#include "amp/distributed/sharded_optimizer.h"
#include "amp/train/history.h"
#include "amp/train/cross_process.h"
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

class DataParallel : public GradientSync, public detail::AmaxReduce, public detail::CheckpointParticipant {
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
    TORCH_CHECK(!buckets_->in_flight(),
                "amp: DataParallel::begin_backward() while the previous boundary's all-reduces are "
                "still in flight; finish_backward() was not called");
    active_ = boundary;
    if (boundary) buckets_->begin();
  }

  void finish_backward() override {
    if (!active_) return;
    active_ = false;
    std::lock_guard<std::mutex> lock(mutex_);
    // Parameters backward did not reach (unused in this forward): their
    // current gradient, or zeros, so every rank all-reduces every bucket.
    for (size_t j : buckets_->missing()) {
      if (!rebuilt_) arrival_.push_back(j);
      buckets_->add(j, at::Tensor());
    }
    buckets_->launch_ready();
    buckets_->finish();
    if (!rebuilt_) rebuild();
  }

  // detail::AmaxReduce: Float8 delayed scaling's amaxes of the step, their
  // largest over the ranks (one all-reduce), so that every rank computes the same scales.
  void reduce_max(at::Tensor& t) override { pg_.allreduce_max(t, "float8 amax all-reduce"); }

  // detail::CheckpointParticipant: checkpoints hold every rank's random generators, each restored on its
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

  // Checkpoints also hold the rebuilt bucket layout (rank 0's, the same on
  // every rank; detail/layout_checkpoint.h), which a load installs, so that
  // a resumed run sums as the uninterrupted one. A checkpoint without one
  // (written before the first step, without DataParallel, or by amp before
  // it wrote them) brings back the first step's layout, rebuilt after the
  // next step. One that does not fit these parameters: an amp: error.
  void write_state(torch::serialize::OutputArchive& archive) const override {
    if (rebuilt_) detail::write_layout(archive, buckets_->layout());
  }
  std::function<void()> read_state(torch::serialize::InputArchive& archive) override {
    TORCH_CHECK(!buckets_->in_flight(), "amp: a checkpoint was loaded while DataParallel's all-reduces are in flight");
    std::optional<detail::BucketLayout> layout = detail::read_layout(archive);
    if (layout) {
      std::vector<bool> bucketed;
      for (size_t j = 0; j < params_.size(); ++j) bucketed.push_back(hooks_[j] != kNoHook);
      const std::string misfit =
          detail::layout_misfit(*layout, params_, bucketed, [this](size_t i) { return name(i); });
      TORCH_CHECK(misfit.empty(), "amp: the checkpoint's DataParallel bucket layout ('", detail::kBucketParamsKey,
                  "') does not fit this model: ", misfit, "; it was written for another model");
    }
    return [this, layout = std::move(layout)] {
      std::lock_guard<std::mutex> lock(mutex_);
      rebuilt_ = layout.has_value();
      arrival_.clear();
      buckets_->lay_out(layout ? *layout : detail::initial_buckets(params_));
    };
  }

  // All-reduces issued so far (one per bucket per optimizer step), and the bucket count.
  int64_t allreduces() const { return buckets_->allreduces(); }
  int64_t buckets() const { return static_cast<int64_t>(buckets_->count()); }
  // Parameter indices per bucket, in launch order, of the next boundary:
  // DDP's first layout until the first boundary's finish_backward(), then
  // the rebuilt one (both: detail/bucket_layout.h). Frozen parameters
  // (requires_grad false at construction) are in none; their .grad is untouched.
  std::vector<std::vector<size_t>> bucket_layout() const { return buckets_->layout(); }

  int rank() const { return pg_.rank(); }
  int world_size() const { return pg_.world_size(); }
  bool is_main() const { return pg_.rank() == 0; }
  void barrier() const { pg_.barrier(); }
  const ProcessGroup& process_group() const { return pg_; }

 private:
  static constexpr unsigned kNoHook = static_cast<unsigned>(-1);

  std::string name(size_t i) const { return i < names_.size() ? "'" + names_[i] + "'" : "#" + std::to_string(i); }

  std::optional<c10::ScalarType> compress() const {
    if (options_.compression() == GradCompression::kNone) return std::nullopt;
    return options_.compression() == GradCompression::kFp16 ? at::kHalf : at::kBFloat16;
  }

  void setup(const std::vector<at::Tensor>& buffers) {
    TORCH_CHECK(options_.bucket_cap_mb() > 0, "amp: DataParallelOptions::bucket_cap_mb must be > 0, got ",
                options_.bucket_cap_mb());
    detail::check_model(pg_, params_, compress(), [this](size_t i) { return name(i); });
    const std::vector<at::Tensor> bufs = options_.broadcast_buffers() ? buffers : std::vector<at::Tensor>{};
    detail::check_same_shapes(pg_, detail::shape_summary(params_, bufs), [this](size_t i) { return name(i); });
    detail::broadcast_from_rank0(pg_, params_, "DataParallel parameter broadcast");
    if (!bufs.empty()) detail::broadcast_from_rank0(pg_, bufs, "DataParallel buffer broadcast");
    buckets_.emplace(pg_, params_, compress());
    buckets_->lay_out(detail::initial_buckets(params_));
    hooks_.assign(params_.size(), kNoHook);
    for (size_t j = 0; j < params_.size(); ++j)
      if (buckets_->holds(j))
        hooks_[j] = params_[j].register_hook([this, j](const at::Tensor& grad) { on_grad(j, grad); });
  }

  // After the first boundary (DDP: before the second forward): the layout
  // from rank 0's gradient order, the same on every rank.
  void rebuild() {
    rebuilt_ = true;
    const auto cap = static_cast<size_t>(options_.bucket_cap_mb() * 1024.0 * 1024.0);
    // dist._DEFAULT_FIRST_BUCKET_BYTES; 2.6+ (not 1.13): the cap where bucket_cap_mb is given.
    const size_t first = (detail::libtorch_at_least(2, 6) && options_.bucket_cap_mb() != 25.0) ? cap : size_t{1} << 20;
    const auto mine = detail::rebuilt_buckets(params_, arrival_, first, cap);
    buckets_->lay_out(detail::sync_buckets(pg_, mine, arrival_.size()));
    arrival_.clear();
  }

  void on_grad(size_t j, const at::Tensor& grad) {
    if (!active_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!buckets_->has(j), "amp: DataParallel: parameter ", name(j),
                " received two gradients in one backward; call backward once per micro-batch");
    TORCH_CHECK(!grad.is_sparse(), "amp: DataParallel: sparse gradients are not supported (parameter ", name(j), ")");
    if (!rebuilt_) arrival_.push_back(j);  // DDP's push_rebuilt_params
    buckets_->add(j, grad);
    if (options_.overlap()) buckets_->launch_ready();
  }

  ProcessGroup pg_;
  DataParallelOptions options_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<unsigned> hooks_;
  std::optional<detail::GradientBuckets> buckets_;  // made in setup(), after the checks
  std::vector<size_t> arrival_;                     // the first boundary's gradient order
  bool rebuilt_ = false;
  std::function<void()> uninstall_;
  std::mutex mutex_;
  bool active_ = false;
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
  std::optional<detail::QuietProgress> quiet;
  if (pg.rank() != 0) quiet.emplace();
  History history = trainer.fit(mine, std::forward<F>(fn), std::move(fo));
  quiet.reset();
  at::Tensor losses = at::empty({static_cast<int64_t>(history.steps.size())}, at::kDouble);
  for (size_t i = 0; i < history.steps.size(); ++i) losses[static_cast<int64_t>(i)] = history.steps[i].loss;
  pg.allreduce_sum(losses, "fit()'s loss average");
  for (size_t i = 0; i < history.steps.size(); ++i)
    history.steps[i].loss = losses[static_cast<int64_t>(i)].item<double>() / static_cast<double>(world);
  return history;
}

}  // namespace amp
