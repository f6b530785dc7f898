// amp/optim/detail/lowbit_fused_step.h: the low-bit Adams' fused CPU step.
// One pass per block reads the codes, the scale, the parameter and the
// gradient, computes the new moments and the update, writes the parameter
// and requantizes; blocks run in parallel (detail::parallel_chunks).
//
//   amp::detail::lowbit::fused_adam_param(hyper, param, grad, step, m, v, vmax, inv_scale, keep);
//
// Every step is the IEEE operation LowBitAdam's tensor-op path (torchao's
// eager single_param_adam) performs, in the same order (lowbit_block.h,
// rounded as ATen rounds here: lowbit_rounding.h). The vector ISA is a
// run-time choice (lowbit_simd.h); the bits are the same on each.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amp/detail/parallel.h"
#include "amp/optim/detail/lowbit_block.h"
#include "amp/optim/detail/lowbit_rounding.h"
#include "amp/optim/detail/lowbit_simd.h"
#include "amp/optim/detail/lowbit_threshold.h"
#include "amp/optim/quantized_state.h"

namespace amp {
namespace detail {
namespace lowbit {

// The vector ISA the fused step uses: the best this CPU has, at most
// isa_limit() (tests lower it to check every loop on one machine). The bits
// are the same on every ISA.
// kAvx512Vbmi: AVX-512 with VBMI's byte permutes for the 8-bit/fp8 lookups.
enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vbmi = 3 };

inline std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{static_cast<int>(Isa::kAvx512Vbmi)};
  return limit;
}

inline Isa cpu_isa() {
#if AMP_DETAIL_LOWBIT_X86_CLONES
  static const Isa best = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? Isa::kPortable
                          : !__builtin_cpu_supports("avx512f")                               ? Isa::kAvx2
                          : __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi")
                              ? Isa::kAvx512Vbmi
                              : Isa::kAvx512;
#else
  static const Isa best = Isa::kPortable;
#endif
  return static_cast<Isa>(std::min(static_cast<int>(best), isa_limit().load()));
}

// The fused step over a whole parameter (numel a multiple of block_size).
template <typename P>
void fused_adam_step(const FusedAdam& k, P* param, P* grad, int64_t numel, const MomentRef& m, const MomentRef& v,
                     const MomentRef& vmax, const int32_t* rand16) {
  const int64_t blocks = (numel + k.block_size - 1) / k.block_size;
  const Isa isa = cpu_isa();
  parallel_chunks(blocks, /*grain=*/16, [&](int64_t b0, int64_t b1) {
    // three new moments' values, the codes, two old moments' values
    std::vector<float> buffer(static_cast<size_t>(6 * k.block_size));
#if AMP_DETAIL_LOWBIT_X86_CLONES
    if (isa >= Isa::kAvx512)
      return adam_blocks_avx512(k, param, grad, m, v, vmax, rand16, b0, b1, buffer.data(), isa == Isa::kAvx512Vbmi);
    if (isa == Isa::kAvx2) return adam_blocks_avx2(k, param, grad, m, v, vmax, rand16, b0, b1, buffer.data());
#endif
    adam_blocks_portable(k, param, grad, m, v, vmax, rand16, b0, b1, buffer.data());
  });
}

// A QuantizedState's tensors as the kernel reads them (CPU, contiguous).
inline MomentRef moment_ref(const QuantizedState& q) {
  MomentRef r;
  r.format = q.format();
  if (q.qmap().defined()) {
    r.map = q.qmap().data_ptr<float>();
    r.levels = q.qmap().numel();
    r.ascending = strictly_ascending(r.map, r.levels);
  }
  if (q.format() == StateFormat::kFloat) {
    r.values = q.values().data_ptr<float>();
    return r;
  }
  r.codes = static_cast<uint8_t*>(q.codes().data_ptr());
  r.scale = q.scale().data_ptr<float>();
  return r;
}

// A low-bit Adam's hyperparameters for one parameter (its param group's).
struct AdamHyper {
  double lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
  bool amsgrad = false, adamw = true, stochastic_round = false;
  int64_t block_size = 0;
};

// The step's constants for one (lr, weight decay, betas, step count), each
// from the ATen ops on 0-dim tensors that the tensor-op path runs, read from
// CPU memory (no dispatcher call per parameter beyond these, no sync); kept
// for the next parameter with the same key, so a param group's parameters at
// the same step pay for them once.
class StepConstants {
 public:
  // k's lr, lr_wd, bias_correction1 and bias_correction2_sqrt; `step`: the new step count (step_count + 1, fp32).
  void fill(const AdamHyper& h, float step, FusedAdam& k) {
    const Key key{h.lr, h.weight_decay, h.beta1, h.beta2, step};
    if (!valid_ || !(key == key_)) {
      const at::Tensor lr = at::scalar_tensor(h.lr, at::kFloat);
      const at::Tensor lr_wd = lr * h.weight_decay;
      const at::Tensor step_t = at::scalar_tensor(step, at::kFloat);
      const at::Tensor bias_correction1 = at::rsub(at::pow(h.beta1, step_t), 1);
      const at::Tensor bias_correction2_sqrt = at::rsub(at::pow(h.beta2, step_t), 1).sqrt();
      lr_ = *lr.data_ptr<float>();
      lr_wd_ = *lr_wd.data_ptr<float>();
      bias_correction1_ = *bias_correction1.data_ptr<float>();
      bias_correction2_sqrt_ = *bias_correction2_sqrt.data_ptr<float>();
      key_ = key;
      valid_ = true;
    }
    k.lr = lr_;
    k.lr_wd = lr_wd_;
    k.bias_correction1 = bias_correction1_;
    k.bias_correction2_sqrt = bias_correction2_sqrt_;
  }

 private:
  struct Key {
    double lr, weight_decay, beta1, beta2;
    float step;
    bool operator==(const Key& o) const {  // exact: the same inputs give the same bits
      return lr == o.lr && weight_decay == o.weight_decay && beta1 == o.beta1 && beta2 == o.beta2 && step == o.step;
    }
  };
  Key key_{};
  bool valid_ = false;
  float lr_ = 0, lr_wd_ = 0, bias_correction1_ = 1, bias_correction2_sqrt_ = 1;
};

// One parameter's fused step (CPU, fp32 or bf16, contiguous; quantized
// moments): LowBitAdam::step_param's result. `inv_scale`/`keep`: GradScaler's,
// or undefined; `constants`: the step's cache, shared by its parameters.
inline void fused_adam_param(const AdamHyper& h, const at::Tensor& p, at::Tensor& grad, at::Tensor& step_count,
                             const MomentRef& m, const MomentRef& v, const MomentRef& vmax, const at::Tensor& inv_scale,
                             const at::Tensor& keep, StepConstants& constants) {
  const bool bf16 = p.scalar_type() == at::kBFloat16;
  // torchao draws the random bits whether or not the step is kept.
  const at::Tensor rand16 =
      h.stochastic_round && bf16 ? at::randint(0, 1 << 16, p.sizes(), p.options().dtype(at::kInt)) : at::Tensor();
  FusedAdam k;
  k.unscale = inv_scale.defined();
  k.inv_scale = k.unscale ? *inv_scale.data_ptr<float>() : 1.f;
  if (keep.defined() && *keep.data_ptr<bool>()) {  // a skipped step: the gradient is unscaled, nothing else changes
    if (k.unscale) grad.mul_(inv_scale);
    return;
  }
  float* count = step_count.data_ptr<float>();
  const float step = *count + 1.f;  // step_count + 1 in fp32, as the tensor op
  constants.fill(h, step, k);
  k.wd = static_cast<float>(h.weight_decay);
  k.w1 = static_cast<float>(1 - h.beta1);
  k.w2 = static_cast<float>(1 - h.beta2);
  k.eps = static_cast<float>(h.eps);
  k.adamw = h.adamw;
  k.amsgrad = h.amsgrad;
  const AtenCpuRounding& aten = aten_cpu_rounding();
  k.lerp = aten.lerp;
  std::memcpy(&k.maximum_nan, &aten.maximum_nan, sizeof(float));
  k.block_size = h.block_size;
  k.numel = p.numel();
  const int32_t* r = rand16.defined() ? rand16.data_ptr<int32_t>() : nullptr;
  alignas(64) float columns[3][272];
  MomentRef moments[3] = {m, v, vmax};
  for (int q = 0; q < 3; ++q)
    if (moments[q].map != nullptr && moments[q].levels % 16 == 0) {
      map_columns(moments[q].map, moments[q].levels, columns[q]);
      moments[q].columns = columns[q];
      moments[q].table = threshold_table(moments[q].format, moments[q].map, moments[q].levels);
    } else {
      moments[q].ascending = false;                                       // no vector search
      moments[q].table = threshold_table(moments[q].format, nullptr, 0);  // fp8's
    }
  if (bf16) {
    fused_adam_step(k, p.data_ptr<at::BFloat16>(), grad.data_ptr<at::BFloat16>(), p.numel(), moments[0], moments[1],
                    moments[2], r);
  } else {
    fused_adam_step(k, p.data_ptr<float>(), grad.data_ptr<float>(), p.numel(), moments[0], moments[1], moments[2], r);
  }
  *count = step;
}

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
