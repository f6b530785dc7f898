// amp/distributed/detail/unit_order.h: the order in which FullyShard's units
// ran their forwards, which its prefetch follows (FSDP2's post-forward order,
// torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py). In forward, the
// unit after this one in the previous forward's order is gathered early
// (learned from the first step, as FSDP2's implicit forward prefetch follows
// the order the CPU issues); in backward, the unit before it in this step's
// order (FSDP2's default backward prefetch of one unit).
//
//   UnitOrder order;
//   order.begin_forward();                 // the root's forward begins
//   size_t next = order.on_forward(k);     // unit k's forward: the unit to prefetch, or npos
//   order.begin_backward(); size_t prev = order.on_backward(k);
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace amp {
namespace detail {

class UnitOrder {
 public:
  static constexpr size_t npos = static_cast<size_t>(-1);

  // A root forward begins: the forward before it is the order to follow.
  void begin_forward() {
    if (!current_.empty()) last_ = std::move(current_);
    current_.clear();
  }
  // The unit the last forward ran first (npos: none known yet).
  size_t first() const { return last_.empty() ? npos : last_[0]; }
  // Unit k's forward begins (inside the root's): the unit that followed this
  // position in the last forward, if the last forward ran k here too.
  size_t on_forward(size_t k) {
    const size_t pos = current_.size();
    current_.push_back(k);
    return pos + 1 < last_.size() && last_[pos] == k ? last_[pos + 1] : npos;
  }

  // A backward begins: the unit this step's forward ran last (npos: none).
  size_t begin_backward() {
    back_ = current_.size();
    return current_.empty() ? npos : current_.back();
  }
  // Unit k's backward begins: the unit that ran before k's latest forward not
  // yet seen in this backward (npos: none, or k did not run in this forward).
  size_t on_backward(size_t k) {
    for (size_t j = back_; j-- > 0;) {
      if (current_[j] != k) continue;
      back_ = j;
      return j > 0 ? current_[j - 1] : npos;
    }
    return npos;
  }

 private:
  std::vector<size_t> last_, current_;
  size_t back_ = 0;
};

}  // namespace detail
}  // namespace amp
