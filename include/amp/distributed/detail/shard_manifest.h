// amp/distributed/detail/shard_manifest.h: the manifest of FullyShard's
// sharded checkpoint, written and read, and the checks of each rank's file
// against it. The manifest (an archive at the checkpoint's path) holds the
// format, the save's id (16 hex digits, new per save), the Trainer's precision,
// the model's parameter names and shapes, the world size, and each rank's file
// ("<path>.<id>.rank<r>", in the manifest's directory) with its size and
// CRC-32; each rank's file holds the id, its rank and the world size.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "amp/detail/atomic_file.h"
#include "amp/detail/checked_archive.h"
#include "amp/detail/zip_bytes.h"
#include "amp/distributed/detail/checkpoint_entries.h"

namespace amp::detail {

inline constexpr int64_t kShardedManifestFormat = 1;

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "amp: could not open '", path, "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

// A sharded checkpoint's manifest, read and checked.
struct Manifest {
  std::string id, precision, model;
  int world = 0;
  std::vector<std::string> files;  // paths (the manifest's directory + the names it holds)
  std::vector<int64_t> sizes, crcs;
};

inline bool is_manifest(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  return archive.try_read("amp/fully_shard/manifest", v);
}

// The name of rank r's file of the save `id` at `path` (no directory).
inline std::string rank_file_name(const std::string& path, const std::string& id, int r) {
  return path.substr(directory_of(path).size()) + "." + id + ".rank" + std::to_string(r);
}

// Writes the manifest at `path` (atomically): the save's id, the Trainer's
// precision, the model's summary and each rank's file, whose size and CRC-32
// `records` holds ("<size> <crc>", by rank).
inline void write_manifest(const std::string& path, const std::string& id, const std::string& precision,
                           const std::string& model, const std::vector<std::string>& records) {
  torch::serialize::OutputArchive mfa;
  mfa.write("amp/fully_shard/manifest", c10::IValue(kShardedManifestFormat));
  mfa.write("amp/fully_shard/id", c10::IValue(id));
  mfa.write("amp/fully_shard/precision", c10::IValue(precision));
  mfa.write("amp/fully_shard/model", c10::IValue(model));
  mfa.write("amp/fully_shard/world", c10::IValue(static_cast<int64_t>(records.size())));
  for (size_t r = 0; r < records.size(); ++r) {
    std::istringstream in(records[r]);
    int64_t size = -1, crc = -1;
    in >> size >> crc;
    const std::string n = std::to_string(r);
    mfa.write("amp/fully_shard/file" + n, c10::IValue(rank_file_name(path, id, static_cast<int>(r))));
    mfa.write("amp/fully_shard/size" + n, c10::IValue(size));
    mfa.write("amp/fully_shard/crc" + n, c10::IValue(crc));
  }
  atomic_write(path, [&](const std::string& tmp) { mfa.save_to(tmp); });
}

inline Manifest read_manifest(torch::serialize::InputArchive& archive, const std::string& path) {
  Manifest mf;
  auto get = [&](const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v), "amp: the sharded checkpoint '", path, "' has no '", key, "': it is damaged");
    return v;
  };
  const c10::IValue format = get("amp/fully_shard/manifest");
  TORCH_CHECK(format.isInt() && format.toInt() == kShardedManifestFormat, "amp: the sharded checkpoint '", path,
              "' has format ", format, ", this amp reads format ", kShardedManifestFormat);
  const c10::IValue id = get("amp/fully_shard/id"), precision = get("amp/fully_shard/precision"),
                    model = get("amp/fully_shard/model"), world = get("amp/fully_shard/world");
  TORCH_CHECK(id.isString() && precision.isString() && model.isString() && world.isInt() && world.toInt() >= 1,
              "amp: the sharded checkpoint '", path, "' is damaged (its id, precision, model or world size)");
  mf.id = id.toStringRef();
  mf.precision = precision.toStringRef();
  mf.model = model.toStringRef();
  mf.world = static_cast<int>(world.toInt());
  for (int r = 0; r < mf.world; ++r) {
    const std::string n = std::to_string(r);
    const c10::IValue file = get("amp/fully_shard/file" + n), size = get("amp/fully_shard/size" + n),
                      crc = get("amp/fully_shard/crc" + n);
    TORCH_CHECK(file.isString() && size.isInt() && crc.isInt() && file.toStringRef().find('/') == std::string::npos,
                "amp: the sharded checkpoint '", path, "' is damaged (rank ", r, "'s file entry)");
    mf.files.push_back(directory_of(path) + file.toStringRef());
    mf.sizes.push_back(size.toInt());
    mf.crcs.push_back(crc.toInt());
  }
  return mf;
}

inline std::string crc_hex_of(int64_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(crc));
  return buf;
}

// Rank r's file of the set: its size and CRC-32 as the manifest says, its
// id, rank and world size the manifest's.
inline torch::serialize::InputArchive open_rank_file(const Manifest& mf, int r, const std::string& path,
                                                     const c10::Device& device) {
  const std::string& file = mf.files[static_cast<size_t>(r)];
  std::ifstream probe(file, std::ios::binary);
  TORCH_CHECK(probe.good(), "amp: the sharded checkpoint '", path, "' lacks rank ", r, "'s file '", file,
              "'; it was removed, or the set was not copied whole");
  probe.close();
  const std::string bytes = file_bytes(file);
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) == mf.sizes[static_cast<size_t>(r)] &&
                  static_cast<int64_t>(crc32(0, bytes.data(), bytes.size())) == mf.crcs[static_cast<size_t>(r)],
              "amp: rank ", r, "'s file '", file, "' of the sharded checkpoint '", path,
              "' does not match the manifest (", bytes.size(), " bytes, CRC-32 ", crc_hex(bytes),
              "; the manifest says ", mf.sizes[static_cast<size_t>(r)], " bytes, ",
              crc_hex_of(mf.crcs[static_cast<size_t>(r)]), "): it is damaged or from another save");
  torch::serialize::InputArchive a = read_archive(bytes, device, "checkpoint '" + file + "'",
                                                  "rank " + std::to_string(r) + "'s file of a sharded checkpoint");
  c10::IValue id, rank, world;
  TORCH_CHECK(a.try_read("amp/fully_shard/id", id) && a.try_read("amp/fully_shard/rank", rank) &&
                  a.try_read("amp/fully_shard/world", world) && id.isString() && id.toStringRef() == mf.id &&
                  rank.isInt() && rank.toInt() == r && world.isInt() && world.toInt() == mf.world,
              "amp: '", file, "' is not rank ", r, "'s file of the save that the sharded checkpoint '", path,
              "' names (id ", mf.id, "): a file from another save");
  return a;
}

}  // namespace amp::detail
