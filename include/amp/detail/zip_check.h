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
// ones, which LibTorch 1.13 writes for its code/ entries: zip_bytes.h); and
// scans each pickle's opcodes (pickle_check.h), so that a length or memo index
// in one never exceeds what the entry holds. Entries may expand to at most
// kMaxExpansion times the file's size in all: what LibTorch then allocates is
// bounded by the file.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/pickle_check.h"
#include "amp/detail/zip_bytes.h"

namespace amp {
namespace detail {

// The entries' uncompressed bytes, all together, are at most this many times
// the file's.
inline constexpr uint64_t kMaxExpansion = 4;

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
    // LibTorch's reader (miniz) reads an entry marked as a directory (the DOS
    // attribute 0x10, or a name ending in '/') as empty, and leaves the
    // tensor's memory as it was allocated: LibTorch never writes one.
    if ((le(c + 38, 4) & 0x10u) != 0 || z.name.back() == '/') fail(entry + " is marked as a directory");
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
