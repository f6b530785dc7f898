// amp/detail/zip_check.h: amp's own check of a LibTorch archive's bytes (a
// zip file) before anything in it is deserialized.
//
//   const auto entries = amp::detail::check_zip(read, size, "'ckpt.pt'");  //
//   throws an amp: error
//   // read(pos, buf, n) fills buf with the n bytes at pos; size: the file's
//   length
//
// LibTorch's reader (miniz, built with MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS)
// never compares an entry's bytes with the CRC-32 its zip headers store: a
// flipped bit in tensor data loads as a different tensor. This check parses
// the end of central directory (ZIP64 too), the central directory and every
// local header itself; refuses encrypted or unknown methods, headers that
// disagree, entries outside the file or overlapping, duplicated names,
// entries of several archives and an archive without data.pkl or version;
// computes every entry's CRC-32 over its stored bytes (inflating the deflated
// ones, which LibTorch 1.13 writes for its code/ entries); and scans each
// pickle's opcodes, so that a length or memo index in one never exceeds what
// the entry holds. Entries may expand to at most kMaxExpansion times the
// file's size in all: what LibTorch then allocates is bounded by the file.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace amp {
namespace detail {

// Fills buf with the n bytes at pos (throws when it cannot).
using ByteReader = std::function<void(uint64_t pos, void* buf, size_t n)>;

// The entries' uncompressed bytes, all together, are at most this many times
// the file's.
inline constexpr uint64_t kMaxExpansion = 4;

// CRC-32 (zip's: reflected 0xEDB88320), slicing by 8.
inline const std::array<std::array<uint32_t, 256>, 8>& crc32_tables() {
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
    return t;
  }();
  return tables;
}

// Continues `crc` (0 to start) over n bytes.
inline uint32_t crc32(uint32_t crc, const void* data, size_t n) {
  const auto& t = crc32_tables();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = (static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24) ^
                        crc;
    crc = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
          t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

struct ZipEntry {
  std::string name;
  uint16_t method = 0;  // 0 stored, 8 deflated
  uint32_t crc = 0;
  uint64_t compressed = 0, uncompressed = 0;
  uint64_t header = 0,
           data = 0;        // offsets of the local header and of the stored bytes
  uint64_t descriptor = 0;  // the data descriptor's bytes after them
};

// A refusal: "amp: could not read <source>: it is damaged or not a LibTorch
// archive (<what>); ...".
[[noreturn]] inline void zip_fail(const std::string& source, const std::string& what) {
  TORCH_CHECK(false, "amp: could not read ", source, ": it is damaged or not a LibTorch archive (", what,
              "); nothing was loaded. Load another copy of it or an earlier "
              "checkpoint");
}

inline uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

// Reads [begin, end) of the file in pieces for a pass over an entry's bytes.
class RangeReader {
 public:
  RangeReader(const ByteReader& read, uint64_t begin, uint64_t end) : read_(read), pos_(begin), end_(end) {}
  // The next piece (empty at the end).
  std::pair<const uint8_t*, size_t> next() {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer_.size(), end_ - pos_));
    if (n > 0) read_(pos_, buffer_.data(), n);
    pos_ += n;
    return {buffer_.data(), n};
  }

 private:
  const ByteReader& read_;
  uint64_t pos_, end_;
  std::vector<uint8_t> buffer_ = std::vector<uint8_t>(size_t{1} << 20);
};

// RFC 1951 inflate over an entry's compressed bytes, in a 32 KiB window, the
// output passed to `sink` in pieces (after Mark Adler's puff.c). Throws a
// std::runtime_error on a malformed stream or output past `limit` bytes.
class Inflater {
 public:
  using Sink = std::function<void(const uint8_t*, size_t)>;
  Inflater(RangeReader& in, uint64_t limit, Sink sink) : in_(in), limit_(limit), sink_(std::move(sink)) {}

  uint64_t run() {
    int last = 0;
    do {
      last = bits(1);
      const int type = bits(2);
      if (type == 0)
        stored();
      else if (type == 1)
        fixed();
      else if (type == 2)
        dynamic();
      else
        bad("a block of type 3");
    } while (!last);
    flush();
    return produced_;
  }

 private:
  struct Huffman {
    std::array<int16_t, 16> count{};
    std::array<int16_t, 320> symbol{};
  };

  [[noreturn]] static void bad(const char* what) { throw std::runtime_error(std::string("deflate stream: ") + what); }

  int byte() {
    if (at_ == piece_.second) {
      piece_ = in_.next();
      at_ = 0;
      if (piece_.second == 0) bad("it ends early");
    }
    return piece_.first[at_++];
  }
  int bits(int need) {
    uint32_t v = bitbuf_;
    while (bitcnt_ < need) {
      v |= static_cast<uint32_t>(byte()) << bitcnt_;
      bitcnt_ += 8;
    }
    bitbuf_ = v >> need;
    bitcnt_ -= need;
    return static_cast<int>(v & ((1u << need) - 1u));
  }
  void put(uint8_t b) {
    if (++produced_ > limit_) bad("it expands past the size its headers declare");
    window_[fill_++] = b;
    if (fill_ == window_.size()) flush();
  }
  void flush() {
    if (fill_ > flushed_) sink_(window_.data() + flushed_, fill_ - flushed_);
    if (fill_ == window_.size()) fill_ = 0;
    flushed_ = fill_;
  }
  uint8_t back(size_t dist) const { return window_[(fill_ + window_.size() - dist) % window_.size()]; }

  void stored() {
    bitbuf_ = 0;
    bitcnt_ = 0;
    const int len = byte() | byte() << 8;
    const int nlen = byte() | byte() << 8;
    if (len != (~nlen & 0xFFFF)) bad("a stored block's length and its complement disagree");
    for (int i = 0; i < len; ++i) put(static_cast<uint8_t>(byte()));
  }

  // Canonical code from lengths; refuses an over-subscribed code (incomplete
  // ones are allowed only for a single code, as zlib).
  static void construct(Huffman& h, const int16_t* length, int n) {
    h.count.fill(0);
    for (int s = 0; s < n; ++s) h.count[static_cast<size_t>(length[s])]++;
    if (h.count[0] == n) return;
    int left = 1;
    for (int len = 1; len < 16; ++len) {
      left <<= 1;
      left -= h.count[static_cast<size_t>(len)];
      if (left < 0) bad("an over-subscribed Huffman code");
    }
    std::array<int16_t, 16> offs{};
    for (int len = 1; len < 15; ++len)
      offs[static_cast<size_t>(len) + 1] =
          static_cast<int16_t>(offs[static_cast<size_t>(len)] + h.count[static_cast<size_t>(len)]);
    for (int s = 0; s < n; ++s)
      if (length[s] != 0)
        h.symbol[static_cast<size_t>(offs[static_cast<size_t>(length[s])]++)] = static_cast<int16_t>(s);
  }
  int decode(const Huffman& h) {
    int code = 0, first = 0, index = 0;
    for (int len = 1; len < 16; ++len) {
      code |= bits(1);
      const int count = h.count[static_cast<size_t>(len)];
      if (code - count < first) return h.symbol[static_cast<size_t>(index + (code - first))];
      index += count;
      first += count;
      first <<= 1;
      code <<= 1;
    }
    bad("a code that is not in its Huffman table");
  }
  void codes(const Huffman& lencode, const Huffman& distcode) {
    static constexpr int16_t lbase[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                          31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
    static constexpr int16_t lext[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                         2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
    static constexpr int16_t dbase[30] = {1,    2,    3,    4,    5,    7,    9,    13,    17,    25,
                                          33,   49,   65,   97,   129,  193,  257,  385,   513,   769,
                                          1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
    static constexpr int16_t dext[30] = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                         6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};
    for (;;) {
      int symbol = decode(lencode);
      if (symbol < 256) {
        put(static_cast<uint8_t>(symbol));
      } else if (symbol == 256) {
        return;
      } else {
        symbol -= 257;
        if (symbol >= 29) bad("a length code out of range");
        const int len = lbase[symbol] + bits(lext[symbol]);
        symbol = decode(distcode);
        if (symbol >= 30) bad("a distance code out of range");
        const auto dist = static_cast<uint64_t>(dbase[symbol] + bits(dext[symbol]));
        if (dist > produced_) bad("a distance back past the start of the output");
        for (int i = 0; i < len; ++i) put(back(static_cast<size_t>(dist)));
      }
    }
  }
  void fixed() {
    Huffman lencode, distcode;
    std::array<int16_t, 288> lengths{};
    for (int s = 0; s < 288; ++s) lengths[static_cast<size_t>(s)] = s < 144 ? 8 : s < 256 ? 9 : s < 280 ? 7 : 8;
    construct(lencode, lengths.data(), 288);
    for (int s = 0; s < 30; ++s) lengths[static_cast<size_t>(s)] = 5;
    construct(distcode, lengths.data(), 30);
    codes(lencode, distcode);
  }
  void dynamic() {
    static constexpr int order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
    const int nlen = bits(5) + 257, ndist = bits(5) + 1, ncode = bits(4) + 4;
    if (nlen > 286 || ndist > 30) bad("too many length or distance codes");
    std::array<int16_t, 320> lengths{};
    for (int i = 0; i < ncode; ++i) lengths[static_cast<size_t>(order[i])] = static_cast<int16_t>(bits(3));
    Huffman lencode, distcode;
    construct(lencode, lengths.data(), 19);
    int index = 0;
    lengths.fill(0);
    while (index < nlen + ndist) {
      int symbol = decode(lencode);
      if (symbol < 16) {
        lengths[static_cast<size_t>(index++)] = static_cast<int16_t>(symbol);
        continue;
      }
      int16_t len = 0;
      if (symbol == 16) {
        if (index == 0) bad("a repeat with no previous length");
        len = lengths[static_cast<size_t>(index - 1)];
        symbol = 3 + bits(2);
      } else if (symbol == 17) {
        symbol = 3 + bits(3);
      } else {
        symbol = 11 + bits(7);
      }
      if (index + symbol > nlen + ndist) bad("too many lengths");
      while (symbol--) lengths[static_cast<size_t>(index++)] = len;
    }
    if (lengths[256] == 0) bad("no end-of-block code");
    construct(lencode, lengths.data(), nlen);
    construct(distcode, lengths.data() + nlen, ndist);
    codes(lencode, distcode);
  }

  RangeReader& in_;
  std::pair<const uint8_t*, size_t> piece_{nullptr, 0};
  size_t at_ = 0;
  uint32_t bitbuf_ = 0;
  int bitcnt_ = 0;
  uint64_t limit_, produced_ = 0;
  std::array<uint8_t, 32768> window_{};
  size_t fill_ = 0, flushed_ = 0;
  Sink sink_;
};

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

// Checks the archive of `size` bytes that `read` gives (see the banner) and
// returns its entries; `source` names it in errors ("checkpoint 'ckpt.pt'").
inline std::vector<ZipEntry> check_zip(const ByteReader& read, uint64_t size, const std::string& source) {
  auto fail = [&](const std::string& what) { zip_fail(source, what); };
  auto bytes = [&](uint64_t pos, size_t n) {
    std::vector<uint8_t> b(n);
    if (n > 0) read(pos, b.data(), n);
    return b;
  };
  // The end of central directory record: the last 22 bytes (plus a comment).
  if (size < 22) fail("it is " + std::to_string(size) + " bytes long, shorter than any zip file");
  const uint64_t tail_len = std::min<uint64_t>(size, 22 + 0xFFFF);
  const std::vector<uint8_t> tail = bytes(size - tail_len, static_cast<size_t>(tail_len));
  int64_t eocd = -1;
  for (int64_t k = static_cast<int64_t>(tail_len) - 22; k >= 0; --k) {
    const uint8_t* p = tail.data() + k;
    if (le(p, 4) == 0x06054b50u && static_cast<uint64_t>(k) + 22 + le(p + 20, 2) == tail_len) {
      eocd = k;
      break;
    }
  }
  if (eocd < 0)
    fail(
        "no end of central directory record (the file is truncated or not a "
        "zip file)");
  const uint8_t* e = tail.data() + eocd;
  const uint64_t eocd_pos = size - tail_len + static_cast<uint64_t>(eocd);
  uint64_t entries = le(e + 10, 2), cd_size = le(e + 12, 4), cd_offset = le(e + 16, 4);
  uint64_t cd_end_limit = eocd_pos;
  if (le(e + 4, 2) != 0 || le(e + 6, 2) != 0 || le(e + 8, 2) != entries) fail("a zip split over several disks");
  if (entries == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu || eocd_pos >= 20) {
    // ZIP64: a locator just before the record points at the ZIP64 end record.
    const bool needed = entries == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_offset == 0xFFFFFFFFu;
    std::vector<uint8_t> loc = eocd_pos >= 20 ? bytes(eocd_pos - 20, 20) : std::vector<uint8_t>(20, 0);
    if (le(loc.data(), 4) == 0x07064b50u) {
      const uint64_t z = le(loc.data() + 8, 8);
      if (le(loc.data() + 4, 4) != 0 || le(loc.data() + 16, 4) > 1) fail("a ZIP64 zip split over several disks");
      if (z > eocd_pos - 20 || eocd_pos - 20 - z < 56) fail("the ZIP64 end record lies outside the file");
      const std::vector<uint8_t> r = bytes(z, 56);
      if (le(r.data(), 4) != 0x06064b50u) fail("no ZIP64 end record where its locator points");
      if (le(r.data() + 16, 4) != 0 || le(r.data() + 20, 4) != 0 || le(r.data() + 24, 8) != le(r.data() + 32, 8))
        fail("a ZIP64 zip split over several disks");
      const uint64_t n64 = le(r.data() + 32, 8), size64 = le(r.data() + 40, 8), off64 = le(r.data() + 48, 8);
      if ((entries != 0xFFFF && entries != n64) || (cd_size != 0xFFFFFFFFu && cd_size != size64) ||
          (cd_offset != 0xFFFFFFFFu && cd_offset != off64))
        fail("the end of central directory and the ZIP64 end record disagree");
      entries = n64;
      cd_size = size64;
      cd_offset = off64;
      cd_end_limit = z;
    } else if (needed) {
      fail(
          "no ZIP64 locator before an end of central directory record that "
          "needs one");
    }
  }
  if (cd_offset > cd_end_limit || cd_size > cd_end_limit - cd_offset)
    fail("the central directory lies outside the file");
  if (entries > cd_size / 46)
    fail("the central directory is too short for its " + std::to_string(entries) + " entries");
  const std::vector<uint8_t> cd = bytes(cd_offset, static_cast<size_t>(cd_size));

  std::vector<ZipEntry> out;
  std::map<std::string, size_t> by_name;
  size_t at = 0;
  for (uint64_t k = 0; k < entries; ++k) {
    if (cd.size() - at < 46 || le(cd.data() + at, 4) != 0x02014b50u)
      fail("central directory record " + std::to_string(k) + " is damaged");
    const uint8_t* c = cd.data() + at;
    const size_t name_len = static_cast<size_t>(le(c + 28, 2)), extra_len = static_cast<size_t>(le(c + 30, 2)),
                 comment_len = static_cast<size_t>(le(c + 32, 2));
    if (cd.size() - at - 46 < name_len + extra_len + comment_len)
      fail("central directory record " + std::to_string(k) + " runs past the directory");
    ZipEntry z;
    z.name.assign(reinterpret_cast<const char*>(c + 46), name_len);
    const std::string entry = "entry '" + z.name + "'";
    if (z.name.empty() || z.name.find('\0') != std::string::npos) fail("an entry with an empty or invalid name");
    const uint64_t flags = le(c + 8, 2);
    z.method = static_cast<uint16_t>(le(c + 10, 2));
    z.crc = static_cast<uint32_t>(le(c + 16, 4));
    z.compressed = le(c + 20, 4);
    z.uncompressed = le(c + 24, 4);
    z.header = le(c + 42, 4);
    if (le(c + 34, 2) != 0) fail(entry + " is on another disk");
    if (flags & 0x41u) fail(entry + " is encrypted");
    if (z.method != 0 && z.method != 8) fail(entry + " has compression method " + std::to_string(z.method));
    // ZIP64 extended information: the fields that are 0xFFFFFFFF, in this
    // order.
    const uint8_t* x = c + 46 + name_len;
    for (size_t xo = 0; xo + 4 <= extra_len;) {
      const uint64_t id = le(x + xo, 2), len = le(x + xo + 2, 2);
      if (xo + 4 + len > extra_len) fail(entry + ": its extra field runs past its record");
      if (id == 1) {
        size_t f = xo + 4;
        for (uint64_t* field : {&z.uncompressed, &z.compressed, &z.header}) {
          if (*field != 0xFFFFFFFFu) continue;
          if (f + 8 > xo + 4 + len) fail(entry + ": its ZIP64 field is too short");
          *field = le(x + f, 8);
          f += 8;
        }
      }
      xo += 4 + static_cast<size_t>(len);
    }
    if (!by_name.emplace(z.name, out.size()).second) fail(entry + " appears twice");
    // Its local header must agree with the central record.
    if (z.header > cd_offset || cd_offset - z.header < 30) fail(entry + ": its local header lies outside the file");
    const std::vector<uint8_t> l = bytes(z.header, 30);
    if (le(l.data(), 4) != 0x04034b50u) fail(entry + ": its local header is damaged (wrong signature)");
    const uint64_t lname = le(l.data() + 26, 2), lextra = le(l.data() + 28, 2);
    if (z.header + 30 + lname + lextra > cd_offset) fail(entry + ": its local header runs past its data");
    const std::vector<uint8_t> ln = bytes(z.header + 30, static_cast<size_t>(lname));
    if (std::string(ln.begin(), ln.end()) != z.name)
      fail(entry + ": its local header names '" + std::string(ln.begin(), ln.end()) + "'");
    if (le(l.data() + 8, 2) != z.method || le(l.data() + 6, 2) != flags)
      fail(entry +
           ": its local header and central record disagree on its "
           "method or flags");
    if (!(flags & 0x08u)) {  // no data descriptor: the local header has the CRC
                             // and the sizes
      const uint64_t lc = le(l.data() + 18, 4), lu = le(l.data() + 22, 4);
      if (le(l.data() + 14, 4) != z.crc || (lc != 0xFFFFFFFFu && lc != z.compressed) ||
          (lu != 0xFFFFFFFFu && lu != z.uncompressed))
        fail(entry +
             ": its local header and central record disagree on its "
             "CRC-32 or sizes");
    }
    z.data = z.header + 30 + lname + lextra;
    if (z.compressed > cd_offset - z.data) fail(entry + ": its data runs past the end of the entries");
    if (flags & 0x08u) {  // the data descriptor after the data (LibTorch writes
                          // one): CRC-32 and sizes again
      const bool wide = z.compressed >= 0xFFFFFFFFu || z.uncompressed >= 0xFFFFFFFFu;
      const uint64_t room = cd_offset - z.data - z.compressed;
      const size_t width = wide ? 8 : 4, len = 4 + 2 * width;
      std::vector<uint8_t> d = bytes(z.data + z.compressed, static_cast<size_t>(std::min<uint64_t>(room, len + 4)));
      const size_t sig = d.size() >= 4 && le(d.data(), 4) == 0x08074b50u ? 4 : 0;
      if (d.size() < sig + len || le(d.data() + sig, 4) != z.crc ||
          le(d.data() + sig + 4, static_cast<int>(width)) != z.compressed ||
          le(d.data() + sig + 4 + width, static_cast<int>(width)) != z.uncompressed)
        fail(entry +
             ": its data descriptor and central record disagree on its "
             "CRC-32 or sizes");
      z.descriptor = sig + len;
    }
    if (z.method == 0 && z.compressed != z.uncompressed) fail(entry + " is stored but its two sizes differ");
    out.push_back(std::move(z));
    at += 46 + name_len + extra_len + comment_len;
  }
  if (at != cd.size()) fail("the central directory has bytes after its " + std::to_string(entries) + " records");

  // No two entries overlap; all bytes together expand by at most kMaxExpansion.
  std::vector<const ZipEntry*> order;
  uint64_t total = 0;
  for (const auto& z : out) {
    order.push_back(&z);
    total += z.uncompressed;
    if (total > kMaxExpansion * size)
      fail("its entries declare " + std::to_string(total) + "+ bytes, more than " + std::to_string(kMaxExpansion) +
           " times the file's " + std::to_string(size));
  }
  std::sort(order.begin(), order.end(), [](const ZipEntry* a, const ZipEntry* b) { return a->header < b->header; });
  for (size_t k = 1; k < order.size(); ++k)
    if (order[k - 1]->data + order[k - 1]->compressed + order[k - 1]->descriptor > order[k]->header)
      fail("entries '" + order[k - 1]->name + "' and '" + order[k]->name + "' overlap");

  // One archive (every name under the first's folder), with the records
  // LibTorch reads first.
  const auto slash = out.empty() ? std::string::npos : out.front().name.find('/');
  if (slash == std::string::npos) fail("no entry in an archive folder");
  const std::string folder = out.front().name.substr(0, slash + 1);
  for (const auto& z : out)
    if (z.name.compare(0, folder.size(), folder) != 0) fail("entry '" + z.name + "' is outside '" + folder + "'");
  for (const char* needed : {"data.pkl", "version"})
    if (!by_name.count(folder + needed)) fail("entry '" + folder + needed + "' is missing");

  // Every entry's bytes against its CRC-32; pickles kept for their scan.
  for (const auto& z : out) {
    const std::string entry = "entry '" + z.name + "'";
    const bool is_pickle = z.name.size() >= 3 && z.name.compare(z.name.size() - 3, 3, "pkl") == 0;
    std::string kept;
    uint32_t crc = 0;
    uint64_t produced = 0;
    RangeReader in(read, z.data, z.data + z.compressed);
    auto sink = [&](const uint8_t* b, size_t n) {
      crc = crc32(crc, b, n);
      if (is_pickle) kept.append(reinterpret_cast<const char*>(b), n);
    };
    if (z.method == 0) {
      for (auto piece = in.next(); piece.second > 0; piece = in.next()) sink(piece.first, piece.second);
      produced = z.compressed;
    } else {
      try {
        produced = Inflater(in, z.uncompressed, sink).run();
      } catch (const std::runtime_error& err) {
        fail(entry + ": its " + err.what());
      }
    }
    if (produced != z.uncompressed)
      fail(entry + " holds " + std::to_string(produced) + " bytes, its headers say " + std::to_string(z.uncompressed));
    if (crc != z.crc)
      fail(entry + ": its bytes do not match their CRC-32 (stored " + c10::str(std::hex, z.crc) + ", computed " +
           c10::str(std::hex, crc) + ")");
    if (is_pickle) {
      const bool data = z.name == folder + "data.pkl";
      std::vector<PickledStorage> storages;
      const std::string wrong = check_pickle(kept, data ? &storages : nullptr);
      if (!wrong.empty()) fail(entry + " is not a valid pickle: " + wrong);
      // LibTorch makes each storage of numel elements over its record's bytes,
      // whatever their length.
      for (const auto& st : storages) {
        const size_t element = storage_element_size(st.type);
        if (element == 0) fail(entry + " names a storage of type '" + st.type + "', which this LibTorch does not know");
        if (st.numel < 0 || static_cast<uint64_t>(st.numel) > size)
          fail(entry + " gives storage '" + st.key + "' " + std::to_string(st.numel) + " elements");
        if (st.numel == 0) continue;
        const auto record = by_name.find(folder + "data/" + st.key);
        if (record == by_name.end()) fail("entry '" + folder + "data/" + st.key + "' is missing");
        const uint64_t bytes_needed = static_cast<uint64_t>(st.numel) * element;
        if (out[record->second].uncompressed < bytes_needed)
          fail("entry '" + folder + "data/" + st.key + "' holds " + std::to_string(out[record->second].uncompressed) +
               " bytes, but its " + st.type + " of " + std::to_string(st.numel) + " elements needs " +
               std::to_string(bytes_needed));
      }
    }
  }
  return out;
}

}  // namespace detail
}  // namespace amp
