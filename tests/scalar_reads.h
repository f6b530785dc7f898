// tests/scalar_reads.h: counts the calls that read a tensor back to the host.
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <cstring>
#include <memory>

// Counts aten::_local_scalar_dense and aten::item (what reading a device value
// on the host goes through) on this thread, apart from those inside a fused
// kernel: the CPU kernels read the step counter with item() on host memory,
// which is no device sync; the CUDA ones read it on the device.
class ScalarReads {
 public:
  ScalarReads() {
    outside = inside = depth = 0;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&start, &end));
  }
  ~ScalarReads() { at::removeCallback(handle_); }
  ScalarReads(const ScalarReads&) = delete;
  ScalarReads& operator=(const ScalarReads&) = delete;

  static inline thread_local int64_t outside = 0, inside = 0, depth = 0;

 private:
  static bool fused_op(const char* name) { return std::strncmp(name, "aten::_fused_", 13) == 0; }
  static bool scalar_read(const char* name) {
    return std::strcmp(name, "aten::_local_scalar_dense") == 0 || std::strcmp(name, "aten::item") == 0;
  }
  static std::unique_ptr<at::ObserverContext> start(const at::RecordFunction& fn) {
    if (fused_op(fn.name())) ++depth;
    if (scalar_read(fn.name())) ++(depth > 0 ? inside : outside);
    return nullptr;
  }
  static void end(const at::RecordFunction& fn, at::ObserverContext*) {
    if (fused_op(fn.name())) --depth;
  }
  at::CallbackHandle handle_;
};
