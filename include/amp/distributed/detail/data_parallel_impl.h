// amp/distributed/detail/data_parallel_impl.h: DataParallel's construction helpers
// (amp/distributed.h): the cross-rank shape check, rank 0's broadcast, and
// the gradient buckets, laid out as torch's DDP lays them out.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/hash.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/distributed/process_group.h"
#include "amp/train/rng_state.h"

namespace amp::detail {

// [n_params, n_buffers, then per tensor: dtype, ndim, sizes...]
inline std::vector<int64_t> shape_summary(const std::vector<at::Tensor>& params,
                                          const std::vector<at::Tensor>& buffers) {
  std::vector<int64_t> s{static_cast<int64_t>(params.size()), static_cast<int64_t>(buffers.size())};
  for (const auto* list : {&params, &buffers})
    for (const auto& t : *list) {
      s.push_back(static_cast<int64_t>(t.scalar_type()));
      s.push_back(t.dim());
      for (auto d : t.sizes()) s.push_back(d);
    }
  return s;
}

inline std::string describe_tensor(const std::vector<int64_t>& s, size_t& pos) {
  std::ostringstream o;
  const auto dtype = static_cast<c10::ScalarType>(s[pos]);
  const int64_t ndim = s[pos + 1];
  o << c10::toString(dtype) << "[";
  for (int64_t d = 0; d < ndim; ++d) o << (d ? ", " : "") << s[pos + 2 + d];
  o << "]";
  pos += 2 + static_cast<size_t>(ndim);
  return o.str();
}

// Every rank's summary against rank 0's: the same amp: error on every rank
// (all of them see all summaries), naming the first difference.
inline void check_same_shapes(const ProcessGroup& pg, const std::vector<int64_t>& mine,
                              const std::function<std::string(size_t)>& param_name, const char* who = "DataParallel") {
  const at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  int64_t max_len = 0;
  std::vector<int64_t> lens;
  for (const auto& t : pg.allgather(len, std::string(who) + " shape check")) {
    lens.push_back(t.item<int64_t>());
    max_len = std::max(max_len, lens.back());
  }
  at::Tensor padded = at::zeros({max_len}, at::kLong);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<int64_t>());
  const auto all = pg.allgather(padded, std::string(who) + " shape check");
  auto summary_of = [&](int r) {
    const int64_t* d = all[static_cast<size_t>(r)].data_ptr<int64_t>();
    return std::vector<int64_t>(d, d + lens[static_cast<size_t>(r)]);
  };
  const std::vector<int64_t> ref = summary_of(0);
  for (int r = 1; r < pg.world_size(); ++r) {
    const std::vector<int64_t> other = summary_of(r);
    if (other == ref) continue;
    TORCH_CHECK(other[0] == ref[0], "amp: ", who, ": rank ", r, " has ", other[0], " parameters but rank 0 has ",
                ref[0], "; every rank must build the same model");
    TORCH_CHECK(other[1] == ref[1], "amp: ", who, ": rank ", r, " has ", other[1], " buffers but rank 0 has ", ref[1],
                "; every rank must build the same model");
    size_t pa = 2, pb = 2;
    for (int64_t i = 0; i < ref[0] + ref[1]; ++i) {
      const std::string a = describe_tensor(ref, pa), b = describe_tensor(other, pb);
      const bool is_param = i < ref[0];
      TORCH_CHECK(a == b, "amp: ", who, ": ", is_param ? "parameter " : "buffer ",
                  is_param ? param_name(static_cast<size_t>(i)) : "#" + std::to_string(i - ref[0]), " is ", b,
                  " on rank ", r, " but ", a, " on rank 0; every rank must build the same model");
    }
  }
}

// Rank 0's values into every rank's tensors: one broadcast per dtype.
inline void broadcast_from_rank0(const ProcessGroup& pg, const std::vector<at::Tensor>& tensors, const char* what) {
  std::map<c10::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  at::NoGradGuard no_grad;
  for (auto& [dtype, list] : by_dtype) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.detach().reshape({-1}));
    at::Tensor all = at::cat(flat);
    pg.broadcast(all, 0, what);
    int64_t off = 0;
    for (auto& t : list) {
      t.detach().copy_(all.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

// One flat all-reduce buffer for a run of same-dtype parameters.
struct Bucket {
  at::Tensor flat;               // the gradients, side by side
  at::Tensor comm;               // what is all-reduced (flat, or its fp16/bf16 copy)
  std::vector<size_t> params;    // indices into DataParallel's parameters
  std::vector<int64_t> offsets;  // each parameter's offset in flat
  std::vector<bool> ready;       // per parameter: its gradient is in flat
  size_t pending = 0;            // parameters not ready yet
  c10::intrusive_ptr<c10d::Work> work;
};

// Gradient buckets as torch's DDP lays them out (find_unused_parameters=False,
// static_graph=False; torch/csrc/distributed/c10d/reducer.cpp and
// torch/nn/parallel/distributed.py; 1.13, 2.6 and main alike unless noted).
struct BucketKey {  // reducer.cpp's: one open bucket per dtype and device
  c10::ScalarType type;
  c10::Device device;
  static size_t hash(const BucketKey& k) { return c10::get_hash(k.type, k.device); }
  bool operator==(const BucketKey& o) const { return type == o.type && device == o.device; }
};

// compute_bucket_assignment_by_size: the parameters in `order` join the open
// bucket of their dtype, which closes once its bytes reach its limit
// (limits[0] for a dtype's first bucket, then the next, the last repeating).
// Closed buckets in closing order, then the open ones in the order of the
// same std::unordered_map with the same hash; sort_by_min: sorted by their
// smallest index, as for the construction-time layout.
inline std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                       const std::vector<size_t>& order,
                                                       const std::vector<size_t>& limits, bool sort_by_min) {
  struct Open {
    std::vector<size_t> indices;
    size_t size = 0;
  };
  std::vector<std::vector<size_t>> out;
  std::unordered_map<BucketKey, size_t, c10::hash<BucketKey>> limit_of;  // index into limits
  std::unordered_map<BucketKey, Open, c10::hash<BucketKey>> open;
  for (size_t j : order) {
    const at::Tensor& p = params[j];
    const BucketKey key{p.scalar_type(), p.device()};
    Open& b = open[key];
    b.indices.push_back(j);
    b.size += static_cast<size_t>(p.numel()) * static_cast<size_t>(p.element_size());
    size_t& li = limit_of.emplace(key, 0).first->second;
    if (b.size >= limits[li]) {
      out.push_back(std::move(b.indices));
      b = Open();
      li = std::min(li + 1, limits.size() - 1);
    }
  }
  for (auto& kv : open)
    if (!kv.second.indices.empty()) out.push_back(std::move(kv.second.indices));
  if (sort_by_min)
    std::sort(out.begin(), out.end(), [](const std::vector<size_t>& a, const std::vector<size_t>& b) {
      return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end());
    });
  return out;
}

// The first iteration's layout (distributed.py's _ddp_init_helper): the
// parameters that require grad, one bucket per dtype (limit sys.maxsize),
// in parameter order; the list reversed (the last parameters' bucket first).
inline std::vector<std::vector<size_t>> initial_buckets(const std::vector<at::Tensor>& params) {
  std::vector<size_t> order;
  for (size_t j = 0; j < params.size(); ++j)
    if (params[j].requires_grad()) order.push_back(j);
  auto out = assign_buckets(params, order, {std::numeric_limits<size_t>::max()}, true);
  std::reverse(out.begin(), out.end());
  return out;
}

// The layout from the second iteration on (Reducer::rebuild_buckets):
// `arrival`, the order of the first synchronized backward's gradients, cut
// at first_cap bytes (each dtype's first bucket), then at cap; not sorted.
// DDP_SET_LAST_BUCKET_CAP=1 makes the small bucket the last one, as there.
inline std::vector<std::vector<size_t>> rebuilt_buckets(const std::vector<at::Tensor>& params,
                                                        std::vector<size_t> arrival, size_t first_cap, size_t cap) {
  const char* env = std::getenv("DDP_SET_LAST_BUCKET_CAP");
  const bool small_last = env != nullptr && std::string(env) == "1";
  if (small_last) std::reverse(arrival.begin(), arrival.end());
  auto out = assign_buckets(params, arrival, {first_cap, cap}, false);
  if (small_last) std::reverse(out.begin(), out.end());
  return out;
}

// Rank 0's layout on every rank (DDP's sync_bucket_indices); n: the number
// of parameters in it (the same on every rank). One broadcast of
// [bucket count, the indices, each bucket's size].
inline std::vector<std::vector<size_t>> sync_buckets(const ProcessGroup& pg,
                                                     const std::vector<std::vector<size_t>>& mine, size_t n) {
  at::Tensor t = at::zeros({static_cast<int64_t>(2 * n + 1)}, at::kLong);
  int64_t* d = t.data_ptr<int64_t>();
  size_t pos = 1;
  d[0] = static_cast<int64_t>(mine.size());
  for (size_t b = 0; b < mine.size(); ++b) {
    for (size_t j : mine[b]) d[pos++] = static_cast<int64_t>(j);
    d[1 + n + b] = static_cast<int64_t>(mine[b].size());
  }
  pg.broadcast(t, 0, "DataParallel bucket rebuild");
  d = t.data_ptr<int64_t>();
  std::vector<std::vector<size_t>> out(static_cast<size_t>(d[0]));
  pos = 1;
  for (size_t b = 0; b < out.size(); ++b)
    for (int64_t k = 0; k < d[1 + n + b]; ++k) out[b].push_back(static_cast<size_t>(d[pos++]));
  return out;
}

// The buckets of `layout` (parameter indices, in launch order), zeroed;
// where[j]: parameter j's bucket and place in it (kNowhere: in none).
constexpr size_t kNowhere = static_cast<size_t>(-1);
inline std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& params,
                                        const std::vector<std::vector<size_t>>& layout,
                                        std::vector<std::pair<size_t, size_t>>& where) {
  std::vector<Bucket> out;
  where.assign(params.size(), {kNowhere, kNowhere});
  for (const auto& ids : layout) {
    Bucket b;
    int64_t numel = 0;
    for (size_t j : ids) {
      where[j] = {out.size(), b.offsets.size()};
      b.offsets.push_back(numel);
      numel += params[j].numel();
    }
    b.flat = at::zeros({numel}, params[ids.front()].options().requires_grad(false));
    b.params = ids;
    b.ready.assign(ids.size(), false);
    b.pending = ids.size();
    out.push_back(std::move(b));
  }
  return out;
}

// Every rank's generator states (the same number of bytes on every rank for
// the CPU generator; CUDA devices may differ): one padded all-gather.
inline std::vector<RngStates> allgather_rng(const ProcessGroup& pg, const RngStates& mine) {
  // [cpu bytes, n cuda, each cuda's bytes, then the bytes], as int64.
  std::vector<int64_t> flat{mine.cpu.numel(), static_cast<int64_t>(mine.cuda.size())};
  for (const auto& t : mine.cuda) flat.push_back(t.numel());
  auto append = [&](const at::Tensor& t) {
    const uint8_t* p = t.contiguous().data_ptr<uint8_t>();
    flat.insert(flat.end(), p, p + t.numel());
  };
  append(mine.cpu);
  for (const auto& t : mine.cuda) append(t);
  const at::Tensor len = at::full({1}, static_cast<int64_t>(flat.size()), at::kLong);
  int64_t max_len = 0;
  for (const auto& t : pg.allgather(len, "random-generator gather")) max_len = std::max(max_len, t.item<int64_t>());
  at::Tensor padded = at::zeros({max_len}, at::kLong);
  std::copy(flat.begin(), flat.end(), padded.data_ptr<int64_t>());
  std::vector<RngStates> all;
  for (const auto& t : pg.allgather(padded, "random-generator gather")) {
    const int64_t* d = t.data_ptr<int64_t>();
    size_t pos = 0;
    auto bytes = [&](int64_t n, size_t& at_pos) {
      at::Tensor out = at::empty({n}, at::kByte);
      for (int64_t i = 0; i < n; ++i) out.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(d[at_pos++]);
      return out;
    };
    const int64_t cpu_n = d[pos++], n_cuda = d[pos++];
    std::vector<int64_t> cuda_n(d + pos, d + pos + n_cuda);
    pos += static_cast<size_t>(n_cuda);
    RngStates s;
    s.cpu = bytes(cpu_n, pos);
    for (int64_t n : cuda_n) s.cuda.push_back(bytes(n, pos));
    all.push_back(std::move(s));
  }
  return all;
}

}  // namespace amp::detail
