// amp/precision/tf32.h: AllowTF32, the math mode behind amp::True<amp::tf32>.
//
//   {
//     amp::AllowTF32 tf32;        // cuBLAS matmuls and cuDNN convolutions may use TF32
//     auto y = model->forward(x); // fp32 tensors, TF32 tensor-core math
//   }                             // the flags are exactly what they were before
//
// Region<True<tf32>, CUDA> (and so every Trainer step of that policy) holds one.
// Unlike autocast, which is per thread, these flags are process-wide in
// LibTorch (at::globalContext()): while a guard lives, every thread's fp32
// matmuls and convolutions may use TF32. Guards restore in reverse order of
// construction; do not interleave them across threads.
#pragma once

#include "amp/detail/compat_ops.h"

namespace amp {

class AllowTF32 {
 public:
  AllowTF32() : saved_(detail::compat::tf32_flags()) { detail::compat::set_tf32(true); }
  ~AllowTF32() { detail::compat::restore_tf32_flags(saved_); }
  AllowTF32(const AllowTF32&) = delete;
  AllowTF32& operator=(const AllowTF32&) = delete;
  AllowTF32(AllowTF32&&) = delete;
  AllowTF32& operator=(AllowTF32&&) = delete;

 private:
  detail::compat::Tf32Flags saved_;
};

}  // namespace amp
