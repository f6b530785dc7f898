// amp/detail/pickle_check.h: amp's check of a pickle in a LibTorch archive
// (data.pkl and the like) before torch's unpickler reads it: every length
// within the entry, every memo index below the memo's size, the tensor
// storages it names (zip_check.h checks each against its record).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/zip_bytes.h"

namespace amp {
namespace detail {

// A tensor storage that a pickle names (torch's persistent id: ('storage',
// torch.<T>Storage, key, location, numel)), read from record data/<key>.
struct PickledStorage {
  std::string key, type;  // type: "torch.FloatStorage"
  int64_t numel = 0;
};

// What check_pickle keeps of a value on the pickle's stack.
struct PickleValue {
  enum Kind { kMark, kString, kGlobal, kInt, kTuple, kOther } kind = kOther;
  std::string text;                // a string's, a global's "module.name"
  int64_t number = 0;              // an int's
  std::vector<PickleValue> items;  // a short tuple's
};

// Runs a pickle's opcodes (protocols 0-5) on a model of its stack and memo to
// its STOP; returns "" or what is wrong. Every length stays within the entry
// and a memo index below its size (torch's unpickler allocates strings by
// their length and reserves memo space by index before reading them); the
// tensor storages it names go to `storages`.
inline std::string check_pickle(const std::string& p, std::vector<PickledStorage>* storages = nullptr) {
  using V = PickleValue;
  const auto n = static_cast<uint64_t>(p.size());
  uint64_t i = 0;
  std::vector<V> stack;
  std::map<uint64_t, V> memo;
  auto need = [&](uint64_t k) { return k <= n - i; };
  auto arg = [&](int bytes) { return le(reinterpret_cast<const uint8_t*>(p.data()) + i, bytes); };
  auto line = [&](std::string* out) {
    const auto e = p.find('\n', static_cast<size_t>(i));
    if (e == std::string::npos) return false;
    *out = p.substr(static_cast<size_t>(i), e - static_cast<size_t>(i));
    i = e + 1;
    return true;
  };
  auto pop = [&](V* out) {
    if (stack.empty() || stack.back().kind == V::kMark) return false;
    if (out != nullptr) *out = std::move(stack.back());
    stack.pop_back();
    return true;
  };
  auto pop_mark = [&](std::vector<V>* items) {
    size_t m = stack.size();
    while (m > 0 && stack[m - 1].kind != V::kMark) --m;
    if (m == 0) return false;
    if (items != nullptr)
      items->assign(std::make_move_iterator(stack.begin() + static_cast<std::ptrdiff_t>(m)),
                    std::make_move_iterator(stack.end()));
    stack.resize(m - 1);
    return true;
  };
  auto tuple = [](std::vector<V> items) {
    V t;
    t.kind = V::kTuple;
    if (items.size() <= 8) t.items = std::move(items);
    return t;
  };
  auto other = [] { return V{}; };
  while (i < n) {
    const uint64_t at = i;
    const auto op = static_cast<uint8_t>(p[static_cast<size_t>(i++)]);
    const std::string where = " at byte " + std::to_string(at);
    // The argument: a fixed number of bytes, a counted string, or text lines.
    int fixed = 0, counted = 0, lines = 0;
    switch (op) {
      case 'K':
      case 'h':
      case 'q':
      case 0x80:
      case 0x82:
      case 'U':
      case 0x8c:
      case 'C':
      case 0x8a:
        fixed = 1;
        break;
      case 'M':
      case 0x83:
        fixed = 2;
        break;
      case 'J':
      case 'j':
      case 'r':
      case 0x84:
      case 'T':
      case 'X':
      case 'B':
      case 0x8b:
        fixed = 4;
        break;
      case 'G':
      case 0x95:
      case 0x8d:
      case 0x8e:
      case 0x96:
        fixed = 8;
        break;
      case 'I':
      case 'L':
      case 'S':
      case 'V':
      case 'F':
      case 'P':
      case 'g':
      case 'p':
        lines = 1;
        break;
      case 'c':
      case 'i':
        lines = 2;
        break;
      default:
        break;
    }
    switch (op) {
      case 'U':
      case 0x8c:
      case 'C':
      case 0x8a:
      case 'T':
      case 'X':
      case 'B':
      case 0x8b:
      case 0x8d:
      case 0x8e:
      case 0x96:
        counted = fixed;
        fixed = 0;
        break;
      default:
        break;
    }
    uint64_t value = 0;
    std::string text, text2;
    if (!need(static_cast<uint64_t>(fixed + counted))) return "it ends inside an opcode's argument" + where;
    if (fixed > 0) {
      value = arg(fixed);
      i += static_cast<uint64_t>(fixed);
    } else if (counted > 0) {
      const uint64_t len = arg(counted);
      i += static_cast<uint64_t>(counted);
      if (!need(len)) return "a length of " + std::to_string(len) + " bytes past its end" + where;
      text = p.substr(static_cast<size_t>(i), static_cast<size_t>(len));
      i += len;
    } else if ((lines >= 1 && !line(&text)) || (lines == 2 && !line(&text2))) {
      return "it ends inside a text argument" + where;
    }
    V v;
    bool ok = true;
    switch (op) {
      case '.':
        return i == n ? "" : "bytes after its STOP";
      case '(':
        v.kind = V::kMark;
        stack.push_back(v);
        break;
      case '0':
        ok = !stack.empty();
        if (ok) stack.pop_back();
        break;
      case '1':
        ok = pop_mark(nullptr);
        break;
      case '2':
        ok = !stack.empty();
        if (ok) stack.push_back(stack.back());
        break;
      case 'X':
      case 0x8c:
      case 0x8d:
      case 'V':
      case 'S':
      case 'T':
      case 'U':
        v.kind = V::kString;
        v.text = text;
        stack.push_back(v);
        break;
      case 'K':
      case 'M':
        v.kind = V::kInt;
        v.number = static_cast<int64_t>(value);
        stack.push_back(v);
        break;
      case 'J':
        v.kind = V::kInt;
        v.number = static_cast<int32_t>(static_cast<uint32_t>(value));
        stack.push_back(v);
        break;
      case 0x8a:  // LONG1: little-endian two's complement
        if (text.size() <= 8) {
          uint64_t u = 0;
          for (size_t k = text.size(); k-- > 0;) u = u << 8 | static_cast<uint8_t>(text[k]);
          if (!text.empty() && text.size() < 8 && (static_cast<uint8_t>(text.back()) & 0x80u))
            u |= ~uint64_t{0} << (8 * text.size());
          v.kind = V::kInt;
          v.number = static_cast<int64_t>(u);
        }
        stack.push_back(v);
        break;
      case 'N':
      case 0x88:
      case 0x89:
      case ']':
      case '}':
      case 0x8f:
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96:
      case 'G':
      case 'F':
      case 'I':
      case 'L':
      case 0x8b:
      case 'P':
      case 0x82:
      case 0x83:
      case 0x84:
      case 0x97:
        stack.push_back(other());
        break;
      case ')':
        stack.push_back(tuple({}));
        break;
      case 'a':
        ok = pop(nullptr) && !stack.empty();
        break;
      case 'e':
      case 'u':
      case 0x90:
        ok = pop_mark(nullptr) && !stack.empty();
        break;
      case 'l':
      case 'd':
      case 0x91:
        ok = pop_mark(nullptr);
        stack.push_back(other());
        break;
      case 'i':
      case 'o':
        ok = pop_mark(nullptr);
        stack.push_back(other());
        break;
      case 't': {
        std::vector<V> items;
        ok = pop_mark(&items);
        stack.push_back(tuple(std::move(items)));
        break;
      }
      case 0x85:
      case 0x86:
      case 0x87: {
        std::vector<V> items(static_cast<size_t>(op - 0x84));
        for (size_t k = items.size(); ok && k-- > 0;) ok = pop(&items[k]);
        stack.push_back(tuple(std::move(items)));
        break;
      }
      case 's':
        ok = pop(nullptr) && pop(nullptr) && !stack.empty();
        break;
      case 'c':
        v.kind = V::kGlobal;
        v.text = text + "." + text2;
        stack.push_back(v);
        break;
      case 0x93: {
        V name, module;
        ok = pop(&name) && pop(&module);
        v.kind = V::kGlobal;
        v.text = module.text + "." + name.text;
        stack.push_back(v);
        break;
      }
      case 'R':
      case 0x81:
        ok = pop(nullptr) && pop(nullptr);
        stack.push_back(other());
        break;
      case 0x92:
        ok = pop(nullptr) && pop(nullptr) && pop(nullptr);
        stack.push_back(other());
        break;
      case 'b':
        ok = pop(nullptr) && !stack.empty();
        break;
      case 'Q': {
        ok = pop(&v);
        const auto& t = v.items;
        if (ok && storages != nullptr && v.kind == V::kTuple && t.size() == 5 && t[0].kind == V::kString &&
            t[0].text == "storage" && t[1].kind == V::kGlobal && t[2].kind == V::kString && t[4].kind == V::kInt)
          storages->push_back({t[2].text, t[1].text, t[4].number});
        stack.push_back(other());
        break;
      }
      case 'q':
      case 'r':
      case 'p':
      case 0x94: {
        if (op == 'p') value = static_cast<uint64_t>(std::strtoull(text.c_str(), nullptr, 10));
        if (op == 0x94) value = memo.size();
        if (value >= n) return "a memo index beyond its size" + where;
        ok = !stack.empty();
        if (ok) memo[value] = stack.back();
        break;
      }
      case 'h':
      case 'j':
      case 'g': {
        if (op == 'g') value = static_cast<uint64_t>(std::strtoull(text.c_str(), nullptr, 10));
        const auto it = memo.find(value);
        if (it == memo.end()) return "a memo index that was never stored" + where;
        stack.push_back(it->second);
        break;
      }
      case 0x80:
      case 0x95:
      case 0x98:
        break;
      default:
        return "an unknown opcode " + std::to_string(op) + where;
    }
    if (!ok) return "an opcode that pops more than the stack holds" + where;
  }
  return "no STOP";
}

// The bytes of one element of torch.<T>Storage (0 for a type this LibTorch does
// not know).
inline size_t storage_element_size(const std::string& type) {
  const std::string prefix = "torch.", suffix = "Storage";
  if (type.size() <= prefix.size() + suffix.size() || type.compare(0, prefix.size(), prefix) != 0 ||
      type.compare(type.size() - suffix.size(), suffix.size(), suffix) != 0)
    return 0;
  const std::string name = type.substr(prefix.size(), type.size() - prefix.size() - suffix.size());
  for (int k = 0; k < static_cast<int>(c10::ScalarType::NumOptions); ++k) {
    const auto t = static_cast<c10::ScalarType>(k);
    if (t != c10::ScalarType::Undefined && name == c10::toString(t)) return c10::elementSize(t);
  }
  return 0;
}

}  // namespace detail
}  // namespace amp
