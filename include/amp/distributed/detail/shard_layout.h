// amp/distributed/detail/shard_layout.h: how FullyShard cuts a parameter into
// dim-0 shards, as FSDP2 cuts it (torch/distributed/fsdp/_fully_shard/
// _fsdp_param.py: torch.chunk into world_size chunks of ceil(d0 / N) rows,
// empty ones for the ranks past the last chunk, every shard padded to the
// first chunk's rows), and how its gradient enters the reduce-scatter buffer
// (torch._chunk_cat: rank r's row holds each parameter's chunk r, zero-padded).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace amp {
namespace detail {

struct ShardLayout {
  std::vector<int64_t> shape;  // the whole parameter's
  int64_t rows = 0;            // shape[0]
  int64_t inner = 1;           // elements per row
  int64_t chunk = 0;           // rows per padded shard: ceil(rows / N)
  int world = 1;

  ShardLayout() = default;
  ShardLayout(at::IntArrayRef sizes, int world_size) : shape(sizes.vec()), world(world_size) {
    rows = shape.empty() ? 1 : shape[0];
    for (size_t d = 1; d < shape.size(); ++d) inner *= shape[d];
    chunk = (rows + world - 1) / world;
  }

  // Rows of rank r's shard (0 for a rank past the last chunk).
  int64_t rows_of(int r) const { return std::max<int64_t>(0, std::min(chunk, rows - r * chunk)); }
  int64_t padded_numel() const { return chunk * inner; }
  // The shape of rank r's unpadded shard.
  std::vector<int64_t> shard_shape(int r) const {
    std::vector<int64_t> s = shape.empty() ? std::vector<int64_t>{1} : shape;
    s[0] = rows_of(r);
    return s;
  }
  std::vector<int64_t> padded_shape() const {
    std::vector<int64_t> s = shape.empty() ? std::vector<int64_t>{1} : shape;
    s[0] = chunk;
    return s;
  }
  int64_t numel() const { return rows * inner; }
};

// Rank r's rows of `whole` (the parameter, any shape), zero-padded to the
// padded shard, as a flat tensor of `whole`'s dtype.
inline at::Tensor padded_shard(const at::Tensor& whole, const ShardLayout& l, int r) {
  at::Tensor flat = at::zeros({l.padded_numel()}, whole.options());
  const int64_t n = l.rows_of(r);
  if (n > 0) flat.narrow(0, 0, n * l.inner).copy_(whole.reshape({-1}).narrow(0, r * l.chunk * l.inner, n * l.inner));
  return flat;
}

// torch._chunk_cat(grads, dim=0, num_chunks=N, out=buffer.view(N, -1)):
// row r of `buffer` (N x sum of padded numels, its dtype) gets each
// gradient's chunk r at its offset, cast, the padding zeroed.
inline void chunk_cat(const std::vector<at::Tensor>& grads, const std::vector<const ShardLayout*>& layouts,
                      at::Tensor& buffer) {
  const int world = layouts.empty() ? 1 : layouts[0]->world;
  at::Tensor rows = buffer.view({world, -1});
  rows.zero_();
  int64_t off = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const ShardLayout& l = *layouts[i];
    const at::Tensor g = grads[i].reshape({-1});
    for (int r = 0; r < world; ++r) {
      const int64_t n = l.rows_of(r);
      if (n > 0) rows[r].narrow(0, off, n * l.inner).copy_(g.narrow(0, r * l.chunk * l.inner, n * l.inner));
    }
    off += l.padded_numel();
  }
}

}  // namespace detail
}  // namespace amp
