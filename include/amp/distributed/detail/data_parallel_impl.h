// amp/distributed/detail/data_parallel_impl.h: DataParallel's construction helpers
// (amp/distributed.h): the checks on its parameters, the cross-rank shape
// check, rank 0's broadcast; and the gather of every rank's generators for a
// checkpoint. Its buckets: detail/bucket_layout.h, detail/gradient_buckets.h.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "amp/distributed/process_group.h"
#include "amp/train/rng_state.h"

namespace amp::detail {

// DataParallel's parameters: defined, floating point, on one device that its
// process group serves; compress (the compress hook's dtype, if any) one
// that this Gloo takes, for a CPU model. name(i): how messages name parameter i.
inline void check_model(const ProcessGroup& pg, const std::vector<at::Tensor>& params,
                        std::optional<c10::ScalarType> compress, const std::function<std::string(size_t)>& name) {
  TORCH_CHECK(!params.empty(), "amp: DataParallel needs the model's parameters; got none");
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(params[i].defined(), "amp: DataParallel: parameter ", name(i),
                " is undefined; pass the model's parameters");
  const c10::Device device = params.front().device();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.device() == device, "amp: DataParallel: parameter ", name(i), " is on ", p.device(), " but ", name(0),
                " is on ", device, "; put the whole model on one device (model->to(pg.device()))");
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), "amp: DataParallel: parameter ", name(i), " is ", p.scalar_type(),
                ", not floating point");
  }
  if (device.is_cuda()) {
    pg.require_cuda("DataParallel's model (parameter " + name(0) + ")");
    return;
  }
  TORCH_CHECK(device.is_cpu(), "amp: DataParallel: the model is on ", device,
              "; amp trains CPU (Gloo) and CUDA (NCCL) models across processes: move it to one of them");
  TORCH_CHECK(pg.backend() != Backend::kNccl,
              "amp: DataParallel: the model is on CPU but "
              "ProcessGroupOptions::backend is kNccl (CUDA tensors only); move the model to pg.device() or "
              "use Backend::kAuto or kGloo");
  if (compress) {
    const bool half = *compress == at::kHalf;
    const bool other = pg.gloo_takes(half ? at::kBFloat16 : at::kHalf);  // what this Gloo does take
    TORCH_CHECK(pg.gloo_takes(*compress), "amp: DataParallelOptions::compression(", half ? "kFp16" : "kBf16",
                ") on CPU needs a Gloo that takes ", half ? "Half" : "BFloat16", "; this LibTorch's Gloo takes ",
                other ? (half ? "BFloat16 only" : "Half only") : "neither",
                " (a build option of Gloo): use GradCompression::kNone",
                other ? (half ? " or kBf16" : " or kFp16") : "");
  }
}

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
