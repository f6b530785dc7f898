// amp/distributed/detail/bucket_layout.h: which parameters share a gradient
// bucket, and in what order, as torch's DDP lays its buckets out; and whether
// a layout fits a list of parameters (one read from a checkpoint).
//
// A layout: parameter indices per bucket, buckets in launch order.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/hash.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/distributed/process_group.h"

namespace amp::detail {

using BucketLayout = std::vector<std::vector<size_t>>;

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
inline BucketLayout assign_buckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                   const std::vector<size_t>& limits, bool sort_by_min) {
  struct Open {
    std::vector<size_t> indices;
    size_t size = 0;
  };
  BucketLayout out;
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
inline BucketLayout initial_buckets(const std::vector<at::Tensor>& params) {
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
inline BucketLayout rebuilt_buckets(const std::vector<at::Tensor>& params, std::vector<size_t> arrival,
                                    size_t first_cap, size_t cap) {
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
inline BucketLayout sync_buckets(const ProcessGroup& pg, const BucketLayout& mine, size_t n) {
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
  BucketLayout out(static_cast<size_t>(d[0]));
  pos = 1;
  for (size_t b = 0; b < out.size(); ++b)
    for (int64_t k = 0; k < d[1 + n + b]; ++k) out[b].push_back(static_cast<size_t>(d[pos++]));
  return out;
}

// Why `layout` does not fit `params` ("" when it does): every parameter
// with bucketed[j] set in exactly one bucket, no other, and each bucket of
// one dtype and device (a layout from a checkpoint: another model's, or a
// damaged one). name(j): how messages name parameter j.
inline std::string layout_misfit(const BucketLayout& layout, const std::vector<at::Tensor>& params,
                                 const std::vector<bool>& bucketed, const std::function<std::string(size_t)>& name) {
  std::vector<bool> seen(params.size(), false);
  for (size_t b = 0; b < layout.size(); ++b) {
    if (layout[b].empty()) return "bucket " + std::to_string(b) + " is empty";
    for (size_t j : layout[b]) {
      if (j >= params.size())
        return "it names parameter #" + std::to_string(j) + ", but there are " + std::to_string(params.size());
      if (seen[j]) return "it holds parameter " + name(j) + " twice";
      if (!bucketed[j]) return "it holds parameter " + name(j) + ", which does not require grad here";
      seen[j] = true;
      const size_t head = layout[b].front();
      const auto kind = [&](size_t i) {
        return std::string(c10::toString(params[i].scalar_type())) + " on " + params[i].device().str();
      };
      if (kind(j) != kind(head))
        return "bucket " + std::to_string(b) + " holds " + name(head) + " (" + kind(head) + ") and " + name(j) + " (" +
               kind(j) + "), but a bucket has one dtype and device";
    }
  }
  for (size_t j = 0; j < params.size(); ++j)
    if (bucketed[j] && !seen[j]) return "parameter " + name(j) + " is in no bucket";
  return "";
}

}  // namespace amp::detail
