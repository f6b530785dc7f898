// amp/train/user_state.h: UserState, the user's own entries in a checkpoint
// (an LR scheduler, named tensors and integers), saved and loaded with the
// rest of a Trainer's or a Fabric's checkpoint, atomically and all or nothing.
//
//   torch::optim::StepLR lr(optimizer, /*step_size=*/1000, /*gamma=*/0.5);
//   torch::Tensor ema = ...;  int64_t best_epoch = 0;
//   trainer.user_state().scheduler("lr", lr).tensor("ema", ema).integer("best_epoch", best_epoch);
//   trainer.step(fn);          // the Trainer steps `lr` once per optimizer step (not per micro-batch)
//   trainer.save("ckpt.pt");   // ... and load() restores all three, or nothing
//
// A scheduler's state is its step count; the learning rate it set lives in
// the optimizer's parameter groups, which the checkpoint already holds. A
// tensor is loaded in place (same shape and dtype; its device stays); an
// integer through the reference given. The entries registered must be
// exactly the checkpoint's, by name and kind, or load() refuses it before
// anything changes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace amp {
namespace detail {

// LibTorch's LRScheduler keeps its step count protected and has no save():
// read and set through a member pointer formed in a derived class.
struct SchedulerSteps : torch::optim::LRScheduler {
  static unsigned& of(torch::optim::LRScheduler& s) { return s.*(&SchedulerSteps::step_count_); }
};

}  // namespace detail

class UserState {
  enum class Kind { kScheduler, kTensor, kInteger };
  struct Entry {
    Kind kind;
    torch::optim::LRScheduler* scheduler;
    at::Tensor tensor;
    int64_t* integer;

    void assign(const c10::IValue& v) const {
      if (kind == Kind::kScheduler) {
        detail::SchedulerSteps::of(*scheduler) = static_cast<unsigned>(v.toInt());
      } else if (kind == Kind::kTensor) {
        at::NoGradGuard no_grad;
        tensor.copy_(v.toTensor());
      } else {
        *integer = v.toInt();
      }
    }
  };

 public:
  // `s`, stepped after each optimizer step (skipped or not, as Python's loop
  // calls scheduler.step() after scaler.step()): by the Trainer, or by
  // Fabric::update(). Do not step it yourself as well. It must outlive its owner.
  UserState& scheduler(const std::string& name, torch::optim::LRScheduler& s) {
    add(name, Entry{Kind::kScheduler, &s, {}, nullptr});
    return *this;
  }
  // `t`, written as it is at save() and loaded in place (t shares its storage
  // with the caller's tensor: keep using that tensor).
  UserState& tensor(const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(t.defined(), "amp: UserState::tensor(\"", name, "\") got an undefined tensor");
    add(name, Entry{Kind::kTensor, nullptr, t, nullptr});
    return *this;
  }
  // `value`, through the reference: it must outlive its owner.
  UserState& integer(const std::string& name, int64_t& value) {
    add(name, Entry{Kind::kInteger, nullptr, {}, &value});
    return *this;
  }

  // Steps every registered scheduler once (after an optimizer step).
  void step_schedulers() {
    for (auto& kv : entries_)
      if (kv.second.kind == Kind::kScheduler) kv.second.scheduler->step();
  }

  // Writes the entries under "user/<name>" and their list under "amp/user".
  void write(torch::serialize::OutputArchive& archive) const {
    if (entries_.empty()) return;
    archive.write("amp/user", c10::IValue(listing()));
    for (const auto& kv : entries_) {
      const std::string key = "user/" + kv.first;
      const Entry& e = kv.second;
      if (e.kind == Kind::kScheduler)
        archive.write(key, c10::IValue(static_cast<int64_t>(detail::SchedulerSteps::of(*e.scheduler))));
      else if (e.kind == Kind::kTensor)
        archive.write(key, e.tensor.detach(), /*is_buffer=*/true);
      else
        archive.write(key, c10::IValue(*e.integer));
    }
  }

  // What check() found to load, applied after the rest of the checkpoint.
  struct Pending {
    std::vector<std::pair<const Entry*, c10::IValue>> assignments;
    void apply() const {
      for (const auto& a : assignments) a.first->assign(a.second);
    }
  };

  // The archive's entries checked against the registered ones: an amp:
  // error on any mismatch, before anything changes.
  Pending check(torch::serialize::InputArchive& archive) const {
    c10::IValue listed;
    const bool has = archive.try_read("amp/user", listed);
    const std::string mine = listing(), theirs = has && listed.isString() ? listed.toStringRef() : std::string();
    TORCH_CHECK(mine == theirs, "amp: the checkpoint's user state is [", theirs, "] but user_state() here is [", mine,
                "]; register the same entries (name and kind) before load()");
    Pending pending;
    for (const auto& kv : entries_) {
      const std::string key = "user/" + kv.first;
      const Entry& e = kv.second;
      c10::IValue value;
      if (e.kind == Kind::kTensor) {
        at::Tensor t;
        TORCH_CHECK(archive.try_read(key, t, /*is_buffer=*/true), "amp: the checkpoint has no tensor '", key, "'");
        TORCH_CHECK(t.sizes() == e.tensor.sizes() && t.scalar_type() == e.tensor.scalar_type(),
                    "amp: the checkpoint's '", key, "' is ", t.scalar_type(), t.sizes(),
                    " but the registered tensor is ", e.tensor.scalar_type(), e.tensor.sizes());
        value = t;
      } else {
        TORCH_CHECK(archive.try_read(key, value) && value.isInt(), "amp: the checkpoint has no integer '", key, "'");
        TORCH_CHECK(e.kind != Kind::kScheduler || value.toInt() >= 0, "amp: the checkpoint's scheduler step count '",
                    key, "' is negative");
      }
      pending.assignments.emplace_back(&e, value);
    }
    return pending;
  }

 private:
  void add(const std::string& name, Entry e) {
    TORCH_CHECK(!name.empty() && name.find_first_of("/;:") == std::string::npos,
                "amp: a UserState name must be "
                "non-empty, without '/', ';' or ':'; got \"",
                name, "\"");
    TORCH_CHECK(entries_.emplace(name, std::move(e)).second, "amp: UserState already has an entry \"", name, "\"");
  }

  // "kind:name;..." in name order: what write() records and check() compares.
  std::string listing() const {
    std::string out;
    for (const auto& kv : entries_) {
      if (!out.empty()) out += ';';
      out += (kv.second.kind == Kind::kScheduler ? "scheduler:"
              : kv.second.kind == Kind::kTensor  ? "tensor:"
                                                 : "integer:");
      out += kv.first;
    }
    return out;
  }

  std::map<std::string, Entry> entries_;
};

}  // namespace amp
