// amp/distributed/detail/layout_checkpoint.h: DataParallel's rebuilt bucket
// layout in a checkpoint, so that a resumed run sums its gradients in the
// buckets of the uninterrupted one (Gloo's sum of an element depends on its
// offset in the bucket).
//
// Keys: "amp/data_parallel/bucket_sizes" (int64: each bucket's number of
// parameters, buckets in launch order) and "amp/data_parallel/bucket_params"
// (int64: the parameters' indices in DataParallel's list, bucket after
// bucket). Neither: the checkpoint has no rebuilt layout (written before
// the first step, without DataParallel, or before amp wrote them).
#pragma once

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "amp/distributed/detail/bucket_layout.h"

namespace amp::detail {

inline constexpr const char* kBucketSizesKey = "amp/data_parallel/bucket_sizes";
inline constexpr const char* kBucketParamsKey = "amp/data_parallel/bucket_params";

inline void write_layout(torch::serialize::OutputArchive& archive, const BucketLayout& layout) {
  std::vector<int64_t> sizes, indices;
  for (const auto& bucket : layout) {
    sizes.push_back(static_cast<int64_t>(bucket.size()));
    for (size_t j : bucket) indices.push_back(static_cast<int64_t>(j));
  }
  archive.write(kBucketSizesKey, at::tensor(sizes, at::kLong), /*is_buffer=*/true);
  archive.write(kBucketParamsKey, at::tensor(indices, at::kLong), /*is_buffer=*/true);
}

// The archive's layout (nullopt: it has none), as written: an amp: error if
// only one entry is there or they are not a layout; whether it fits the
// model is layout_misfit's question.
inline std::optional<BucketLayout> read_layout(torch::serialize::InputArchive& archive) {
  at::Tensor sizes, indices;
  const bool has_sizes = archive.try_read(kBucketSizesKey, sizes, /*is_buffer=*/true);
  const bool has_indices = archive.try_read(kBucketParamsKey, indices, /*is_buffer=*/true);
  if (!has_sizes && !has_indices) return std::nullopt;
  const std::string which = std::string("'") + kBucketSizesKey + "' and '" + kBucketParamsKey + "'";
  TORCH_CHECK(has_sizes && has_indices, "amp: the checkpoint has only one of DataParallel's bucket layout entries ",
              which, "; a damaged checkpoint");
  auto is_list = [](const at::Tensor& t) { return t.scalar_type() == at::kLong && t.dim() == 1; };
  TORCH_CHECK(is_list(sizes) && is_list(indices), "amp: the checkpoint's DataParallel bucket layout entries ", which,
              " are ", sizes.scalar_type(), sizes.sizes(), " and ", indices.scalar_type(), indices.sizes(),
              ", not lists of Long; a damaged checkpoint");
  sizes = sizes.to(at::kCPU).contiguous(), indices = indices.to(at::kCPU).contiguous();
  const int64_t* s = sizes.data_ptr<int64_t>();
  const int64_t* p = indices.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < sizes.numel(); ++b) {
    TORCH_CHECK(s[b] >= 1, "amp: the checkpoint's '", kBucketSizesKey, "' gives bucket ", b, " ", s[b],
                " parameters; a damaged checkpoint");
    total += s[b];
  }
  TORCH_CHECK(total == indices.numel(), "amp: the checkpoint's '", kBucketSizesKey, "' adds up to ", total,
              " parameters but '", kBucketParamsKey, "' lists ", indices.numel(), "; a damaged checkpoint");
  BucketLayout layout(static_cast<size_t>(sizes.numel()));
  int64_t at_pos = 0;
  for (size_t b = 0; b < layout.size(); ++b)
    for (int64_t k = 0; k < s[b]; ++k, ++at_pos) {
      TORCH_CHECK(p[at_pos] >= 0, "amp: the checkpoint's '", kBucketParamsKey, "' holds the index ", p[at_pos],
                  "; a damaged checkpoint");
      layout[b].push_back(static_cast<size_t>(p[at_pos]));
    }
  return layout;
}

}  // namespace amp::detail
