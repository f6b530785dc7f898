// amp/detail/zip_bytes.h: reading a zip archive's bytes for amp's checks
// (zip_check.h, pickle_check.h): little-endian fields, a file read in
// ranges, RFC 1951 inflate, and zip's CRC-32.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace amp {
namespace detail {

// Fills buf with the n bytes at pos (throws when it cannot).
using ByteReader = std::function<void(uint64_t pos, void* buf, size_t n)>;

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

}  // namespace detail
}  // namespace amp
